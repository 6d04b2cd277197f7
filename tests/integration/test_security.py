"""Attacks on a running job, as a hostile user on the host or anyone who reaches a port
would make them, with real processes; each must fail safe."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import GEMINI, SCRIPTS, env_with, free_port, kill_group, poll, start

pytestmark = pytest.mark.timeout(180)

_ROOT = os.geteuid() == 0
_NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]


def _as_stranger(*cmd: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` as another user (nobody) when this test runs as root, else as this
    one (the store is just as open to it)."""
    return subprocess.run([*(_NOBODY if _ROOT else []), *cmd], capture_output=True, text=True,
                          timeout=timeout, check=False)


_PLANT = """
import base64, datetime, pickle, sys
from torch.distributed import TCPStore

class Payload:
    def __reduce__(self):
        import os
        return (os.system, ("touch " + sys.argv[3],))

store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False,
                 timeout=datetime.timedelta(seconds=20))
key = "torch.rendezvous." + sys.argv[4]
store.get(key)  # the rendezvous has started
store.set(key, base64.b64encode(pickle.dumps(Payload())))
print("planted", flush=True)
"""


@pytest.mark.parametrize("secret", [True, False], ids=["secret-file", "no-secret"])
def test_a_pickle_planted_in_the_c10d_rendezvous_runs_no_code(tmp_path: Path, secret: bool) -> None:
    """Another user writes a pickle into the c10d rendezvous store of a host that waits
    for its peer: no code runs on the host, which stops with one clear line and exit 3."""
    marker = tmp_path / "pwned"
    tmp_path.chmod(0o777)  # the stranger may create the marker, were its code run
    port, run_id = free_port(), f"sec{os.getpid()}"
    argv = [*GEMINI, "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--no-standby"]
    if secret:
        (tmp_path / "secret").write_text(secrets.token_hex(16))
        argv += ["--secret-file", str(tmp_path / "secret")]
    host = start([*argv, str(SCRIPTS / "idle.py"), "60"], env=env_with(tmp_path))
    try:
        planted = _as_stranger(sys.executable, "-c", _PLANT, "127.0.0.1", str(port),
                               str(marker), run_id)
        assert planted.returncode == 0, planted.stderr[-2000:]
        out, _ = host.communicate(timeout=60)
        assert not marker.exists(), "the planted pickle ran"
        assert host.returncode == 3, out[-3000:]
        errors = [line for line in out.splitlines() if line.startswith("gemini: error:")]
        assert len(errors) == 1 and "rendezvous state" in errors[0], out[-3000:]
    finally:
        kill_group(host)
    time.sleep(0.5)
    assert not marker.exists()


def test_the_c10d_store_of_a_loopback_endpoint_listens_on_loopback_alone(tmp_path: Path) -> None:
    """The host serving the c10d rendezvous store for ``127.0.0.1`` listens there, not on
    every interface (torch's TCPStore alone binds to all of them)."""
    import psutil

    port = free_port()
    argv = [*GEMINI, "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bound", "--no-standby",
            str(SCRIPTS / "idle.py"), "60"]
    host = start(argv, env=env_with(tmp_path))
    try:
        def listening() -> list[str]:
            return [c.laddr.ip for c in psutil.Process(host.pid).net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN and c.laddr.port == port]

        assert poll(listening, 60, "the rendezvous store listening") == ["127.0.0.1"]
    finally:
        kill_group(host)


@pytest.mark.etcd
def test_a_pickle_planted_in_the_etcd_v3_rendezvous_runs_no_code(tmp_path: Path) -> None:
    """The same attack on the etcd-v3 rendezvous, by anyone who can write to the etcd
    the job uses: a pickle written over the rendezvous state runs no code."""
    from etcd_server import EtcdServer

    marker = tmp_path / "pwned"
    payload = ("import os, pickle, sys\n"
               "class P:\n"
               "    def __reduce__(self): return (os.system, ('touch ' + sys.argv[1],))\n"
               "sys.stdout.buffer.write(pickle.dumps(P()))\n")
    bits = subprocess.run([sys.executable, "-c", payload, str(marker)], capture_output=True,
                          check=True).stdout
    with EtcdServer() as etcd:
        argv = [*GEMINI, "run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint,
                "--rdzv-id", "planted", "--store", etcd.url, "--no-standby",
                str(SCRIPTS / "idle.py"), "60"]
        host = start(argv, env=env_with(tmp_path))
        try:
            import pyetcd

            key = "gemini/rdzv/planted/state"
            client = pyetcd.client(*etcd.endpoint.split(":"))
            poll(lambda: client.get(key)[0], 60, "the rendezvous state in etcd")
            client.put(key, bits)
            out, _ = host.communicate(timeout=60)
            assert not marker.exists(), "the planted pickle ran"
            assert host.returncode == 3, out[-3000:]
            assert "rendezvous state" in out, out[-3000:]
        finally:
            kill_group(host)
