"""Test helper: a real single-member etcd on free loopback ports, in a temporary data dir.

    with EtcdServer() as etcd:          # started; stopped and removed on exit
        store = open_store(etcd.url)
        etcd.stop()                     # "etcd went away" (SIGTERM; sig=SIGKILL to crash it)
        etcd.start()                    # back on the same ports with the same data

Only the process this helper started is ever signalled. Without an ``etcd`` binary,
:func:`require_etcd` skips the test, or fails it when ``CI=true`` (CI installs etcd).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import pytest
from helpers import free_port

INSTALL_HINT = "apt-get install etcd-server"


def require_etcd() -> str:
    """The etcd binary's path; skips the calling test without one (fails it on CI)."""
    path = shutil.which("etcd")
    if path is not None:
        return path
    reason = f"no etcd binary on PATH ({INSTALL_HINT})"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI=true, so etcd tests must run", pytrace=False)
    pytest.skip(reason)


class _Started:
    """``with``: started on entry (closed again if starting fails), closed on exit."""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _S) -> _S:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


_S = TypeVar("_S", bound=_Started)


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


class TLSFiles:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (CN ``client``),
    made with the ``openssl`` command in ``directory``."""

    def __init__(self, directory: Path) -> None:
        if shutil.which("openssl") is None:
            reason = "no openssl command (apt-get install openssl)"
            if os.environ.get("CI") == "true":
                pytest.fail(f"{reason}; CI=true, so TLS tests must run", pytrace=False)
            pytest.skip(reason)
        self.ca, self.ca_key = directory / "ca.crt", directory / "ca.key"
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                 "-subj", "/CN=gemini-test-ca", "-keyout", str(self.ca_key), "-out", str(self.ca))
        self.server, self.server_key = self._issue(directory, "server", "IP:127.0.0.1")
        self.client, self.client_key = self._issue(directory, "client", "DNS:client")

    def _issue(self, directory: Path, name: str, san: str) -> tuple[Path, Path]:
        cert, key, request = (directory / f"{name}.crt", directory / f"{name}.key",
                              directory / f"{name}.csr")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", str(key), "-out", str(request))
        extensions = directory / f"{name}.ext"
        extensions.write_text(f"subjectAltName={san}\n"
                              "extendedKeyUsage=serverAuth,clientAuth\n")
        _openssl("x509", "-req", "-in", str(request), "-CA", str(self.ca), "-CAkey",
                 str(self.ca_key), "-CAcreateserial", "-days", "2", "-out", str(cert),
                 "-extfile", str(extensions))
        return cert, key


class EtcdServer(_Started):
    """One etcd member serving ``http://127.0.0.1:<client_port>``.

    The ports and the data dir are chosen once, so :meth:`stop` then :meth:`start` brings
    the same member back with its data (keys, leases, revisions). Elections are tuned
    fast (10 ms heartbeat, 100 ms election timeout), which also lets etcd grant leases as
    short as 1 s (its minimum is 1.5 election timeouts, rounded up to whole seconds).
    With ``tls``, clients talk TLS and must show a certificate the member's CA signed
    (``--client-cert-auth``); :attr:`tls` holds the files.
    """

    def __init__(self, *, heartbeat_ms: int = 10, election_ms: int = 100,
                 cluster: EtcdCluster | None = None, tls: bool = False) -> None:
        self.cluster = cluster
        self.binary = require_etcd()
        self.tmp = Path(tempfile.mkdtemp(prefix="gemini-etcd-"))
        self.tls = TLSFiles(self.tmp) if tls else None
        self.data_dir = self.tmp / "data"
        self.log_path = self.tmp / "etcd.log"
        self.name = f"gemini-test-{uuid.uuid4().hex[:12]}"
        self.client_port = free_port()
        self.peer_port = free_port()
        while self.peer_port == self.client_port:
            self.peer_port = free_port()
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.proc: subprocess.Popen[bytes] | None = None
        atexit.register(self.close)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        """The store URL of this server, for ``launcher.store.open_store``."""
        return f"etcd://{self.endpoint}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def command(self) -> list[str]:
        client = self.client_url
        peer = f"http://127.0.0.1:{self.peer_port}"
        tls = [] if self.tls is None else [
            "--cert-file", str(self.tls.server), "--key-file", str(self.tls.server_key),
            "--client-cert-auth", "--trusted-ca-file", str(self.tls.ca)]
        return [self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", self.cluster.initial if self.cluster else f"{self.name}={peer}",
                "--initial-cluster-state", "new",
                "--heartbeat-interval", str(self.heartbeat_ms),
                "--election-timeout", str(self.election_ms), *tls]

    def etcdctl(self, *args: str) -> str:
        """Run ``etcdctl`` against this member (with the client certificate under TLS)."""
        tls = [] if self.tls is None else [
            f"--cacert={self.tls.ca}", f"--cert={self.tls.client}", f"--key={self.tls.client_key}"]
        done = subprocess.run(["etcdctl", f"--endpoints={self.client_url}", *tls, *args],
                              capture_output=True, text=True, timeout=30,
                              env={**os.environ, "ETCDCTL_API": "3"})
        if done.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def enable_auth(self, password: str) -> None:
        """Turn on etcd's user authentication with one user, ``root``."""
        self.etcdctl("user", "add", f"root:{password}")
        self.etcdctl("auth", "enable")

    def _open(self, request: urllib.request.Request | str, timeout: float) -> bytes:
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.client), str(self.tls.client_key))
        with urllib.request.urlopen(request, timeout=timeout, context=context) as reply:
            return bytes(reply.read())

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def launch(self) -> None:
        """Start the etcd process (again) without waiting for it."""
        if self.running:
            return
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def send(self, sig: signal.Signals) -> None:
        """Send ``sig`` (SIGSTOP, SIGCONT) to the running etcd."""
        assert self.proc is not None and self.proc.poll() is None, "etcd is not running"
        self.proc.send_signal(sig)

    def is_leader(self) -> bool:
        """Whether this member leads its cluster (etcd's v3 status API)."""
        request = urllib.request.Request(f"{self.client_url}/v3/maintenance/status",
                                         data=b"{}", method="POST")
        try:
            status = json.loads(self._open(request, 1))
        except (OSError, urllib.error.URLError, ValueError):
            return False
        return str(status.get("leader")) == str(status.get("header", {}).get("member_id"))

    def start(self, *, timeout: float = 20.0) -> None:
        """Start etcd (again) and return once it reports healthy; raises RuntimeError with
        the end of its log if it does not within ``timeout`` seconds. A restart whose port
        is taken meanwhile (an outgoing connection of another process on this machine may
        get it as its source port) is tried again until the timeout."""
        if self.running:
            return
        deadline = time.monotonic() + timeout
        logged = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.launch()
        while time.monotonic() < deadline:
            proc = self.proc
            assert proc is not None
            if proc.poll() is not None:
                with open(self.log_path, "rb") as log:
                    log.seek(logged)
                    taken = b"address already in use" in log.read()
                if not taken:
                    raise RuntimeError(f"etcd exited with {proc.returncode}:\n{self.log_tail()}")
                time.sleep(0.2)
                logged = self.log_path.stat().st_size
                self.launch()
                continue
            if self.healthy():
                return
            time.sleep(0.05)
        self.stop(sig=signal.SIGKILL)
        raise RuntimeError(f"etcd not healthy after {timeout}s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        """Whether etcd answers ``/health`` with a leader."""
        try:
            return b'"true"' in self._open(f"{self.client_url}/health", 0.5)
        except (OSError, urllib.error.URLError):
            return False

    def stop(self, *, sig: signal.Signals = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Stop the etcd this helper started (idempotent): ``sig``, then SIGKILL after
        ``timeout`` seconds."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        """Stop etcd and delete its data dir and log (idempotent)."""
        self.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)
        atexit.unregister(self.close)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class EtcdCluster(_Started):
    """``size`` etcd members forming one cluster on loopback ports.

    ``url`` names every member (``etcd://a,b,c``); each member can be stopped, frozen and
    started again on its data like a single :class:`EtcdServer`.
    """

    def __init__(self, size: int = 3) -> None:
        self.members = [EtcdServer(heartbeat_ms=20, election_ms=200, cluster=self)
                        for _ in range(size)]
        self.initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    @property
    def endpoint(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    @property
    def url(self) -> str:
        return f"etcd://{self.endpoint}"

    def leader(self, timeout: float = 10.0) -> EtcdServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for member in self.members:
                if member.running and member.is_leader():
                    return member
            time.sleep(0.05)
        raise RuntimeError("the etcd cluster has no leader")

    def start(self, *, timeout: float = 30.0) -> None:
        for member in self.members:  # together: a member waits for a quorum
            member.launch()
        deadline = time.monotonic() + timeout
        while not all(m.healthy() for m in self.members):
            if time.monotonic() > deadline:
                tails = "\n".join(m.log_tail(10) for m in self.members)
                raise RuntimeError(f"etcd cluster not healthy after {timeout}s:\n{tails}")
            time.sleep(0.05)

    def close(self) -> None:
        for member in self.members:
            member.close()
