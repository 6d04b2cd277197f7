"""Attacks through files, as another user on a shared host would make them, with real
processes: a run directory, a persist directory, an embedded store or an export directory
that a second uid made first (or planted something in) must not be written through, trusted
or read from. Each attack fails safe: nothing of the stranger's is written, trusted or
handed the run's secret, and a refused command says so in one ``gemini: error:`` line with
its documented exit code.

The stranger is uid 65534 (``setpriv``), so these tests need root; they are skipped
otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import GEMINI, REPO, SCRIPTS, Done, env_with, run
from persist_support import Host, hosts, shm

from launcher import persist

__all__ = ["hosts", "shm"]  # fixtures (persist_support), used by name

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second "
                                 "uid (setpriv --reuid 65534)")]

STRANGER = 65534
_AS_STRANGER = ["setpriv", "--reuid", str(STRANGER), "--regid", str(STRANGER),
                "--clear-groups"]


def _stranger(*cmd: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` as the other user."""
    return subprocess.run([*_AS_STRANGER, *cmd], capture_output=True, text=True, timeout=60,
                          check=False, cwd="/", **kwargs)  # type: ignore[call-overload]


def _stranger_py(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    done = _stranger(sys.executable, "-c", code, *args,
                     env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def _gemini(*args: str, env: dict[str, str] | None = None) -> Done:
    return run([*GEMINI, *args], cwd=REPO, timeout=90,
               env={**(env or os.environ), "PYTHONPATH": str(REPO)})


def _one_error(done: Done, code: int, *words: str) -> str:
    """The one ``gemini: error:`` line of a command refused with exit ``code``."""
    errors = [line for line in done.stderr.splitlines() if line.startswith("gemini: error:")]
    assert done.returncode == code and len(errors) == 1, done.output[-3000:]
    assert all(word in errors[0] for word in words), errors[0]
    return errors[0]


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user may create entries in (mode 1777, as /tmp itself), which
    the stranger can reach (pytest's tmp_path is private to root); removed at the end."""
    path = Path(tempfile.mkdtemp(prefix="gemini-test-shared-", dir="/tmp"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- 2: the run directory and events.jsonl ---------------------------------------------------

@pytest.mark.parametrize("plant", ["events-link", "run-dir-link", "foreign-run-dir"])
def test_a_run_directory_made_by_another_user_is_refused(tmp_path: Path, shared: Path,
                                                          plant: str) -> None:
    """In a shared run root, another user made the run's directory first: with an
    ``events.jsonl`` link to a file of root's, as a link to a directory of theirs, or
    empty (theirs to fill later). ``gemini run`` refuses it with exit 2 before starting a
    worker, and nothing is written through the link."""
    run_id = f"files-{os.getpid()}-{plant}"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    theirs = shared / "theirs"
    script = (f"import os; os.makedirs({str(theirs)!r}, exist_ok=True); "
              f"os.chmod({str(theirs)!r}, 0o777)\n")
    if plant == "events-link":
        script += (f"os.mkdir({str(shared / run_id)!r}, 0o777)\n"
                   f"os.symlink({str(victim)!r}, {str(shared / run_id / 'events.jsonl')!r})")
    elif plant == "run-dir-link":
        script += f"os.symlink({str(theirs)!r}, {str(shared / run_id)!r})"
    else:
        script += f"os.mkdir({str(shared / run_id)!r}, 0o777)"
    _stranger_py(script)
    done = _gemini("run", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", run_id,
                   "--run-root",
                   str(shared), "--no-standby", str(SCRIPTS / "idle.py"), "0.5",
                   env=env_with(tmp_path))
    _one_error(done, 2, "run directory", str(shared / run_id))
    assert "tick" not in done.stdout  # no worker started
    assert victim.read_text() == "precious\n"
    assert os.listdir(theirs) == []


def test_events_are_written_to_a_private_run_directory(tmp_path: Path) -> None:
    """The ordinary case still works: the run directory is made mode 0700, the log 0600."""
    from launcher.events import EventLog, read_events

    log = EventLog(tmp_path / "runs" / "r1", host="h0")
    log.write("started", n=1)
    log.close()
    assert (tmp_path / "runs" / "r1").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "runs" / "r1" / "events.jsonl").stat().st_mode & 0o777 == 0o600
    assert [e["event"] for e in read_events(tmp_path / "runs" / "r1")] == ["started"]


# -- 3: the persist directory ----------------------------------------------------------------

#: Run as the stranger: a persisted step that passes every check (manifest, header and
#: tensor checksums), planted for ``run_id`` at ``step`` under ``directory``.
_PLANT_STEP = """
import mmap, os, sys, time
from pathlib import Path
import xxhash
from launcher import memory, persist
from persist_support import commit_slot

directory, run_id, step = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
buf = mmap.mmap(-1, memory.slot_size(4096, 1024))
commit_slot(buf, step=step, seq=1, rank=0, world_size=1, run_id=run_id)
header = memory.read_header(buf)
end = header.meta_offset + header.meta_len
path = persist.slot_path(directory, run_id, 0, step)
for folder in (path.parent.parent, path.parent):
    if not folder.exists():
        folder.mkdir()
        os.chmod(folder, 0o777)
path.write_bytes(buf[:end])
manifest = persist.Manifest(run_id, 0, step, 1, 1, end,
                            xxhash.xxh3_64_intdigest(buf[:memory.HEADER_SIZE]),
                            header.meta_hash, "stranger", time.time())
persist.manifest_path(path).write_bytes(manifest.to_json())
print(path)
"""

PLANTED = 999999


def test_another_users_persisted_run_is_refused(shared: Path, hosts: list[Host]) -> None:
    """The stranger made the run's directory in a shared --persist-dir first, with a
    step 999999 that passes every checksum. scan trusts none of it; ``gemini export
    --from-dir`` and ``gemini inspect --dir`` refuse it (exit 4), and a writer does not
    start in it (ConfigError, exit 2)."""
    run_id = f"files-{os.getpid()}-persist-a"
    _stranger_py(_PLANT_STEP, str(shared), run_id, str(PLANTED))
    assert persist.scan(shared, run_id) == {}
    out = shared / "out"
    done = _gemini("export", str(out), "--run-id", run_id, "--from-dir", str(shared))
    _one_error(done, 4, f"uid {STRANGER}")
    assert not out.exists()
    done = _gemini("inspect", "--dir", str(shared), "--run-id", run_id, "--json")
    _one_error(done, 4, f"uid {STRANGER}")
    done = _gemini("inspect", "--dir", str(shared), "--json")  # every run: theirs skipped
    assert done.returncode == 0 and json.loads(done.stdout)["slots"] == [], done.output

    host = Host(run_id, "h0", [0], 1)
    hosts.append(host)
    writer = host.writer(shared, every_steps=1)
    with pytest.raises(persist.ConfigError, match=f"uid {STRANGER}"):
        writer.start()
    writer.close()


def test_a_step_planted_in_a_run_directory_others_can_write_is_ignored(
        shared: Path, hosts: list[Host]) -> None:
    """The user's own run directory is writable by others (made so by hand, or by an old
    gemini): the stranger plants step 999999 in it. The newest step for scan, ``gemini
    inspect --dir`` and ``gemini export --from-dir`` is still the user's own step 2."""
    run_id = f"files-{os.getpid()}-persist-b"
    host = Host(run_id, "h0", [0], 1)
    hosts.append(host)
    writer = host.writer(shared, every_steps=1)
    host.commit(0, 2)
    assert writer.run_once() == [(0, 2)]
    persist.run_dir(shared, run_id).chmod(0o777)
    _stranger_py(_PLANT_STEP, str(shared), run_id, str(PLANTED))

    assert persist.scan(shared, run_id) == {0: [2]}
    assert persist.complete_steps(shared, run_id) == [2]
    done = _gemini("inspect", "--dir", str(shared), "--run-id", run_id, "--json")
    assert done.returncode == 0, done.output
    assert [r["step"] for r in json.loads(done.stdout)["slots"]] == [2]
    out = shared / "out"
    done = _gemini("export", str(out), "--run-id", run_id, "--from-dir", str(shared), "--json")
    assert done.returncode == 0, done.output
    assert json.loads(done.stdout)["step"] == 2

    # A planted file beside the user's own in their step directory is not trusted either.
    theirs = persist.slot_path(shared, run_id, 0, PLANTED)
    mine = persist.slot_path(shared, run_id, 0, 2)
    mine.parent.chmod(0o777)
    _stranger_py(f"import shutil; shutil.copy({str(theirs)!r}, {str(mine)!r} + '.x')")
    (mine.parent / (mine.name + ".x")).unlink()
    _stranger_py(f"import os; os.rename({str(theirs.with_suffix('.json'))!r}, "
                 f"{str(mine.parent / 'rank-00001.json')!r})")
    _stranger_py(f"import os; os.rename({str(theirs)!r}, "
                 f"{str(mine.parent / 'rank-00001.gslot')!r})")
    with pytest.raises(persist.CheckpointError, match=f"uid {STRANGER}"):
        persist.read_slot_file(mine.parent / "rank-00001.gslot")
    assert persist.scan(shared, run_id) == {0: [2]}


# -- 4: the embedded store's side files ------------------------------------------------------

_HOLD_WAL = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
os.fchmod(fd, 0o666)
print("ready", flush=True)
sys.stdin.readline()
os.lseek(fd, 0, 0)
data = b""
while chunk := os.read(fd, 1 << 20):
    data += chunk
print(len(data), b"secret" in data, flush=True)
"""


@pytest.mark.parametrize("suffix", ["-wal", "-shm"])
def test_a_store_side_file_made_by_another_user_is_refused(tmp_path: Path, shared: Path,
                                                           suffix: str) -> None:
    """The stranger made ``store.db-wal`` (or ``-shm``) first in the directory of the
    store and keeps it open to read what SQLite writes there: the run's secret. ``gemini
    run`` refuses the store (exit 3) before writing anything, and the file stays empty."""
    store = shared / "store.db"
    spy = subprocess.Popen([*_AS_STRANGER, sys.executable, "-c", _HOLD_WAL, f"{store}{suffix}"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert spy.stdout is not None and spy.stdin is not None
        assert spy.stdout.readline().strip() == "ready"
        done = _gemini("run", "--nproc-per-node", "1", "--rdzv-id", f"files-{os.getpid()}",
                       "--store", f"embedded://{store}", "--no-standby",
                       str(SCRIPTS / "idle.py"), "0", env=env_with(tmp_path))
        out, _ = spy.communicate(input="\n", timeout=30)
    finally:
        spy.kill()
        spy.wait()
    _one_error(done, 3, f"store.db{suffix}", f"uid {STRANGER}")
    assert out.split() == ["0", "False"], out


def test_the_store_side_files_are_this_users_own(tmp_path: Path) -> None:
    """The ordinary case: an embedded store makes its WAL and index files mode 0600 before
    SQLite opens them, and a link in their place is refused."""
    from launcher.errors import StoreError
    from launcher.store.embedded import EmbeddedStore

    store = EmbeddedStore(tmp_path / "store.db")
    store.put("k", b"v")
    for suffix in ("-wal", "-shm"):
        info = (tmp_path / f"store.db{suffix}").lstat()
        assert info.st_uid == os.geteuid() and info.st_mode & 0o777 == 0o600
    store.close()
    (tmp_path / "elsewhere").write_bytes(b"")
    (tmp_path / "second.db-wal").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StoreError, match="symbolic link"):
        EmbeddedStore(tmp_path / "second.db")
    assert (tmp_path / "elsewhere").read_bytes() == b""


# -- 6: gemini export ------------------------------------------------------------------------

@pytest.fixture
def persisted(tmp_path: Path, hosts: list[Host]) -> tuple[Path, str]:
    """A private persist directory holding step 3 of a run: (directory, run id)."""
    run_id = f"files-{os.getpid()}-export"
    directory = tmp_path / "persist"
    host = Host(run_id, "h0", [0], 1)
    hosts.append(host)
    host.commit(0, 3)
    assert host.writer(directory, every_steps=1).run_once() == [(0, 3)]
    return directory, run_id


@pytest.mark.parametrize("made", ["stranger", "world-writable", "link"])
def test_export_refuses_a_directory_others_can_write(shared: Path, persisted: tuple[Path, str],
                                                     made: str) -> None:
    """OUT_DIR is an empty directory of the stranger's, one of the user's that others can
    write, or a link to one: ``gemini export`` refuses it (exit 4) and writes nothing
    there, since whoever can write it could swap the pickled ``.metadata`` for theirs."""
    directory, run_id = persisted
    out = shared / "out"
    if made == "stranger":
        _stranger("mkdir", "-m", "777", str(out))
    elif made == "world-writable":
        out.mkdir()
        out.chmod(0o777)
    else:
        _stranger("mkdir", "-m", "777", str(shared / "theirs"))
        _stranger("ln", "-s", str(shared / "theirs"), str(out))
    done = _gemini("export", str(out), "--run-id", run_id, "--from-dir", str(directory))
    _one_error(done, 4, str(out))
    assert os.listdir(out) == []


def test_export_files_are_private_and_cannot_be_replaced(shared: Path,
                                                         persisted: tuple[Path, str]) -> None:
    """A new OUT_DIR is made mode 0700 and its files 0600 (they were 0644, in a 0755
    directory: readable by all); the stranger can neither read them nor put a pickle of
    theirs in place of ``.metadata``, and DCP loads the export back without running any."""
    directory, run_id = persisted
    out = shared / "out"
    done = _gemini("export", str(out), "--run-id", run_id, "--from-dir", str(directory))
    assert done.returncode == 0, done.output
    assert out.stat().st_mode & 0o777 == 0o700
    names = sorted(os.listdir(out))
    assert ".metadata" in names and not [n for n in names if n.startswith(".gemini-export")]
    for name in names:
        info = (out / name).lstat()
        assert info.st_mode & 0o777 == 0o600 and info.st_uid == 0, (name, oct(info.st_mode))
        assert _stranger("cat", str(out / name)).returncode != 0
    marker = shared / "pwned"
    evil = shared / "evil"
    _stranger_py(f"""
import os, pickle
class Payload:
    def __reduce__(self):
        return (os.system, ("touch {marker}",))
open({str(evil)!r}, "wb").write(pickle.dumps(Payload()))
for attempt in (lambda: os.replace({str(evil)!r}, {str(out / '.metadata')!r}),
                lambda: open({str(out / '.metadata')!r}, "wb")):
    try:
        attempt()
    except PermissionError:
        continue
    raise SystemExit("replaced the export's metadata")
""")
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import load

    state: dict[str, object] = {"step": -1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(state, checkpoint_id=out, no_dist=True)
    assert state["step"] == 3 and not marker.exists()
