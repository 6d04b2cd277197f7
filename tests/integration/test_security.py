"""Attacks on a running job, as a hostile user on the host or anyone who reaches a port
would make them, with real processes; each must fail safe."""

from __future__ import annotations

import base64
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    GEMINI,
    SCRIPTS,
    env_with,
    events,
    free_port,
    kill_group,
    kill_tree,
    poll,
    read_lines,
    start,
)

pytestmark = pytest.mark.timeout(180)

_ROOT = os.geteuid() == 0
_NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]


def _as_stranger(*cmd: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` as another user (nobody) when this test runs as root, else as this
    one (the store is just as open to it)."""
    return subprocess.run([*(_NOBODY if _ROOT else []), *cmd], capture_output=True, text=True,
                          timeout=timeout, check=False)


_PAYLOAD = """
class Payload:
    def __reduce__(self):
        import os
        return (os.system, ("touch " + sys.argv[3],))
"""

_PLANT = _PAYLOAD + """
import base64, datetime, pickle, sys, time
from torch.distributed import TCPStore

store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False,
                 timeout=datetime.timedelta(seconds=20))
key = "torch.rendezvous." + sys.argv[4]
while not base64.b64decode(store.get(key)).startswith(b"gemini-rdzv 1 "):
    time.sleep(0.05)  # until the host has written its state
store.set(key, base64.b64encode(pickle.dumps(Payload())))
print("planted", flush=True)
"""

_SERVE = _PAYLOAD + """
import base64, datetime, pickle, sys, time
from torch.distributed import TCPStore

store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True,
                 timeout=datetime.timedelta(seconds=20))
store.set("torch.rendezvous." + sys.argv[4], base64.b64encode(pickle.dumps(Payload())))
print("serving", flush=True)
time.sleep(120)
"""


def _c10d_run(tmp_path: Path, port: int, run_id: str, secret: bool) -> list[str]:
    argv = [*GEMINI, "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--no-standby"]
    if secret:
        (tmp_path / "secret").write_text(secrets.token_hex(16))
        argv += ["--secret-file", str(tmp_path / "secret")]
    return argv


@pytest.mark.parametrize("secret", [True, False], ids=["secret-file", "no-secret"])
def test_a_pickle_planted_in_the_c10d_rendezvous_runs_no_code(tmp_path: Path, secret: bool) -> None:
    """Another user writes a pickle over the c10d rendezvous state of a host that waits
    for its peer: no code runs, and the host says so and goes on waiting with the state
    it wrote; its peer comes, and the job runs and ends 0."""
    marker = tmp_path / "pwned"
    tmp_path.chmod(0o777)  # the stranger may create the marker, were its code run
    port, run_id = free_port(), f"sec{os.getpid()}"
    argv = [*_c10d_run(tmp_path, port, run_id, secret), str(SCRIPTS / "idle.py"), "1"]
    first = start(argv, env=env_with(tmp_path, GEMINI_HOST_ID="host0"))
    second = None
    try:
        planted = _as_stranger(sys.executable, "-c", _PLANT, "127.0.0.1", str(port),
                               str(marker), run_id)
        assert planted.returncode == 0, planted.stderr[-2000:]
        lines: list[str] = []
        read_lines(first, lines)
        poll(lambda: any("not a gemini state" in line for line in lines), 30, "the warning",
             details=lambda: "".join(lines)[-3000:])
        assert first.poll() is None, "".join(lines)[-3000:]
        second = start(argv, env=env_with(tmp_path, GEMINI_HOST_ID="host1"))
        out, _ = second.communicate(timeout=120)
        first.wait(timeout=60)
        assert [first.returncode, second.returncode] == [0, 0], "".join(lines)[-3000:] + out
        assert not any(line.startswith("gemini: error:") for line in lines), "".join(lines)
        assert "tick 0 0" in "".join(lines) + out and "tick 1 0" in "".join(lines) + out
    finally:
        kill_group(first)
        if second is not None:
            kill_group(second)
    time.sleep(0.5)
    assert not marker.exists(), "the planted pickle ran"


@pytest.mark.parametrize("secret", [True, False], ids=["secret-file", "no-secret"])
def test_a_pickle_in_the_c10d_store_before_the_run_stops_it_unread(tmp_path: Path,
                                                                   secret: bool) -> None:
    """Another user serves the c10d rendezvous store, a pickle already in the run's
    key, before the first host comes: the host has no state of its own to go on with,
    runs no code and stops with exit 3 and one line that says why."""
    marker = tmp_path / "pwned"
    tmp_path.chmod(0o777)
    port, run_id = free_port(), f"sec{os.getpid()}"
    store = start([*(_NOBODY if _ROOT else []), sys.executable, "-c", _SERVE, "127.0.0.1",
                   str(port), str(marker), run_id])
    try:
        assert store.stdout is not None and store.stdout.readline() == "serving\n"
        host = start([*_c10d_run(tmp_path, port, run_id, secret), str(SCRIPTS / "idle.py"), "60"],
                     env=env_with(tmp_path))
        try:
            out, _ = host.communicate(timeout=60)
        finally:
            kill_group(host)
    finally:
        kill_group(store)
    assert not marker.exists(), "the planted pickle ran"
    assert host.returncode == 3, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("gemini: error:")]
    assert len(errors) == 1, out[-3000:]
    assert "the rendezvous state is not gemini's signed JSON" in errors[0], out[-3000:]


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
    the job uses: a pickle written over the rendezvous state runs no code and changes
    nothing; the peer comes, and the job runs and ends 0."""
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
                str(SCRIPTS / "idle.py"), "1"]
        first = start(argv, env=env_with(tmp_path, GEMINI_HOST_ID="host0"))
        second = None
        lines: list[str] = []
        read_lines(first, lines)
        try:
            import pyetcd

            key = "gemini/rdzv/planted/state"
            client = pyetcd.client(*etcd.endpoint.split(":"))
            poll(lambda: client.get(key)[0], 60, "the rendezvous state in etcd")
            client.put(key, bits)
            poll(lambda: any("not a gemini state" in line for line in lines), 30,
                 "the warning", details=lambda: "".join(lines)[-3000:])
            second = start(argv, env=env_with(tmp_path, GEMINI_HOST_ID="host1"))
            out, _ = second.communicate(timeout=120)
            first.wait(timeout=60)
            assert [first.returncode, second.returncode] == [0, 0], "".join(lines)[-3000:] + out
        finally:
            kill_group(first)
            if second is not None:
                kill_group(second)
    assert not marker.exists(), "the planted pickle ran"


_OVERWRITE = """
import base64, datetime, json, sys, time
from torch.distributed import TCPStore

store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False,
                 timeout=datetime.timedelta(seconds=20))
key = "torch.rendezvous." + sys.argv[3]
for value in sys.argv[4:]:
    if value == "FORGED":  # the hosts' own state, moved 5 rounds on and emptied, unsigned
        state = json.loads(base64.b64decode(store.get(key)).split(b" ", 3)[3])
        state.update(round=state["round"] + 5, participants=[], complete=False)
        bits = b"gemini-rdzv 1 " + b"0" * 64 + b" " + json.dumps(state).encode()
        store.set(key, base64.b64encode(bits))
    else:
        store.set(key, base64.b64decode(value))
    print("wrote", flush=True)
    time.sleep(0.6)
"""

#: What a stranger writes over a running job's rendezvous state, 5 times over 3 s: a
#: state of a later round with a forged MAC; or values that are no gemini state at all
#: (junk, base64 of junk, bytes that are not UTF-8, nothing, torch's "no state yet").
_WRITES = {
    "forged": ["FORGED"] * 5,
    "junk": [base64.b64encode(v).decode() for v in (
        b"garbage", base64.b64encode(b"garbage"), b"\xff\xfe\x00junk", b"", b"Y2FuaW1hZGFt")],
}


@pytest.mark.parametrize("attack", sorted(_WRITES))
def test_a_stranger_writing_the_rendezvous_state_changes_nothing(tmp_path: Path,
                                                                 attack: str) -> None:
    """A party without the run's secret writes over the rendezvous state of a running
    two-host c10d job, again and again: a state of a later round with a forged MAC, or
    values that are no gemini state. The hosts ignore them (one warning naming why), go
    on with the round they verified, write a signed state over them, and the job trains
    to its end: no host is left out, no round or restart follows."""
    port, run_id = free_port(), f"forge{os.getpid()}"
    (tmp_path / "secret").write_text(secrets.token_hex(16))
    argv = [*GEMINI, "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--no-standby",
            "--secret-file", str(tmp_path / "secret"), str(SCRIPTS / "train_ckpt.py"),
            "--steps", "150", "--sleep", "0.1"]
    hosts = [start(argv, env=env_with(tmp_path, GEMINI_HOST_ID=f"host{i}")) for i in range(2)]
    outputs: list[list[str]] = [[], []]
    for host, sink in zip(hosts, outputs, strict=True):
        read_lines(host, sink)

    def steps() -> list[int]:
        return [int(line.split()[1]) for sink in outputs for line in list(sink)
                if line.startswith("step ")]

    def details() -> str:
        return "\n".join(f"--- host{i}\n{''.join(sink)[-3000:]}" for i, sink in enumerate(outputs))

    try:
        poll(lambda: max(steps(), default=-1) >= 5, 120, "the job to train", details=details)
        wrote = _as_stranger(sys.executable, "-c", _OVERWRITE, "127.0.0.1", str(port), run_id,
                             *_WRITES[attack])
        assert wrote.returncode == 0 and wrote.stdout.count("wrote") == 5, wrote.stderr[-2000:]
        after = max(steps())
        poll(lambda: max(steps()) >= after + 10, 60, "the steps to go on", details=details)
        for host in hosts:
            host.wait(timeout=120)
        assert [host.returncode for host in hosts] == [0, 0], details()
    finally:
        for host in hosts:
            kill_tree(host.pid)
            kill_group(host)
    text = "".join(line for sink in outputs for line in sink)
    assert "left out" not in text, text
    assert sum(line.startswith("resume rank=") for sink in outputs for line in sink) == 2, text
    assert max(steps()) == 149, text
    reason = "bad signature" if attack == "forged" else "not a gemini state"
    warned = [sum("ignoring a rendezvous value" in line and reason in line for line in sink)
              for sink in outputs]
    assert max(warned) == 1 and min(warned) <= 1, text  # said, once a minute at most
    happened = [e["event"] for e in events(tmp_path / "runs")]
    assert happened.count("rendezvous") == 2, happened  # one round, both hosts
    assert not {"restart", "fenced", "member_failed", "member_lost"} & set(happened), happened
