"""Standby workers: interpreters that have already imported torch, waiting to become workers.

Restarting a worker costs a Python start and ``import torch`` (1.3-2.5 s here) before the
script even begins; that is most of a recovery. The supervisor keeps one standby per
local rank. When torch elastic starts a worker whose command is ``python -u SCRIPT ...``
(or ``-m MODULE``) with output going to the console, the standby receives the worker's
exact argv, environment and working directory through a pipe of its own and runs the
script in place, as ``python -u`` itself would (``_run``). Anything else
(``--no-python``, log-file redirects, NUMA wrappers, another interpreter) starts a fresh
process as usual.

A standby exits when that pipe closes, so it never outlives its supervisor.

This module is also the standby's entry point: ``python -u -m launcher.standby JOB_FD``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from typing import Any

from launcher.contract import ENV_RUN_DIR, RAISED_DIR

logger = logging.getLogger(__name__)


class StandbyPool:
    """Keeps ``size`` standby interpreters ready (thread-safe)."""

    def __init__(self, size: int, title_room: int = 0) -> None:
        """``title_room``: bytes of command line each standby reserves, so that the worker
        it becomes shows its own command (see :func:`show_command`)."""
        self.size = size
        self.padding = " " * title_room  # its own arguments before it are spare room
        self._idle: list[subprocess.Popen[bytes]] = []
        self._ready: dict[int, int] = {}  # pid -> the pipe on which it says it is ready
        self._lock = threading.Lock()
        self._closed = False

    def fill(self, polite: bool = False) -> None:
        """Start standbys until ``size`` are idle (they import torch in the background;
        ``polite``: at a lower priority, for while this host's workers train)."""
        with self._lock:
            for gone in [p for p in self._idle if p.poll() is not None]:
                self._forget(gone.pid)
            self._idle = [p for p in self._idle if p.poll() is None]
            while not self._closed and len(self._idle) < self.size:
                # The job comes through a pipe of its own: the worker keeps this
                # process's stdin, as torchrun's workers do (a breakpoint() can read it).
                job_in, job_out = os.pipe()
                ready_in, ready_out = os.pipe()
                try:
                    proc = subprocess.Popen(
                        [sys.executable, "-u", "-m", "launcher.standby", str(job_in),
                         "polite" if polite else "-", str(ready_out), self.padding],
                        pass_fds=(job_in, ready_out), start_new_session=True)
                except BaseException:
                    os.close(job_out)
                    os.close(ready_in)
                    raise
                finally:
                    os.close(job_in)
                    os.close(ready_out)
                os.set_blocking(ready_in, False)
                proc.stdin = os.fdopen(job_out, "wb")  # what activate() writes the job to
                self._idle.append(proc)
                self._ready[proc.pid] = ready_in

    def ready(self) -> bool:
        """Whether ``size`` standbys wait with torch imported."""
        with self._lock:
            for proc in self._idle:
                fd = self._ready.get(proc.pid)
                if fd is not None and proc.poll() is None:
                    try:
                        if os.read(fd, 1):
                            self._forget(proc.pid)
                    except BlockingIOError:
                        pass
            return len([p for p in self._idle if p.poll() is None and p.pid not in self._ready]
                       ) >= self.size

    def _forget(self, pid: int) -> None:
        fd = self._ready.pop(pid, None)
        if fd is not None:
            os.close(fd)

    def take(self) -> subprocess.Popen[bytes] | None:
        """An idle, living standby, or None."""
        with self._lock:
            while self._idle:
                proc = self._idle.pop(0)
                self._forget(proc.pid)
                if proc.poll() is None:
                    return proc
            return None

    def close(self) -> None:
        """Stop every idle standby (idempotent)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            for proc in idle:
                self._forget(proc.pid)
        for proc in idle:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()


class StandbyService:
    """Supervisor service: fills the standby pool as the supervisor starts, so that they
    import torch while it waits for the first round (a spare waits ready to take a lost
    host's place at once) and its first workers run in standbys and die with it; and
    again once the workers of a round are past their start (``progressed()``: every worker
    completed its first step), or ``REFILL_FALLBACK`` seconds after they started when
    nothing tells (a script without a Checkpointer). Nothing is refilled while no round
    runs: a restart under way has the host's CPU to itself."""

    #: Seconds after workers start before new standbys start importing torch when no
    #: progress is reported. They import at a lower priority (``polite``) as long as the
    #: workers run, but on a host whose cores the workers' start keeps busy they still
    #: take a share of them. A failure before they are ready restarts cold, or waits for a
    #: standby still importing (at the workers' priority from then on).
    REFILL_FALLBACK = 10.0

    def __init__(self, local_world_size: int, command: list[str] | tuple[str, ...] = (),
                 progressed: Callable[[], bool] = lambda: False) -> None:
        """``command``: the workers' command after the interpreter, for the room each
        standby keeps for showing it; ``progressed()``: whether every worker of the
        running round completed its first step."""
        self.pool = StandbyPool(local_world_size,
                                len(sys.executable) + 4 + sum(len(a) + 1 for a in command))
        self.enabled = install(self.pool)
        self.progressed = progressed
        self._started: float | None = None  # when this round's workers started
        self._past_start = False  # whether they are past their start
        if not self.enabled:
            logger.info("standby workers unavailable with this torch version")
        else:
            self.pool.fill()

    def before_start(self, group: Any, store: Any) -> None:
        if self.enabled:
            self.pool.fill()

    def after_start(self, group: Any) -> None:
        self._started = time.monotonic()
        self._past_start = False

    def after_stop(self, group: Any) -> None:
        self._started = None

    def check(self) -> None:
        # Refill once the workers are past their start; later, a standby that died while
        # waiting (OOM killer, a stray signal) is replaced at once, not at the next
        # restart, which would otherwise start a cold process.
        if not self.enabled or self._started is None:
            return
        if not self._past_start:
            self._past_start = (self.progressed()
                                or time.monotonic() - self._started >= self.REFILL_FALLBACK)
        if self._past_start:
            self.pool.fill(polite=True)

    def ready(self) -> bool:
        """Whether a standby per local rank waits with torch imported."""
        return not self.enabled or self.pool.ready()

    def close(self) -> None:
        self.pool.close()


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the supervisor) dies, so a killed
    host takes its workers along instead of leaving them hanging in a collective."""
    if sys.platform.startswith("linux"):
        import ctypes

        parent = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)


def activate(proc: subprocess.Popen[bytes], argv: list[str], env: dict[str, str]) -> bool:
    """Hand a worker's command to a standby; False if the standby is gone."""
    job = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode() + b"\n"
    assert proc.stdin is not None
    try:
        proc.stdin.write(job)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        return False
    return True


def usable(args: tuple[Any, ...], stdout: object, stderr: object) -> bool:
    """Whether a worker command can run in a standby."""
    return (stdout is None and stderr is None and len(args) >= 3
            and args[0] == sys.executable and args[1] == "-u")


def install(pool: StandbyPool) -> bool:
    """Make torch elastic start script workers in standbys from ``pool`` (this process only).

    Returns False, changing nothing, when this torch version has no hook for it.
    """
    try:
        from torch.distributed.elastic.multiprocessing import api
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            SubprocessHandler,
        )
    except ImportError:
        return False
    if not hasattr(api, "get_subprocess_handler") or not hasattr(SubprocessHandler, "_popen"):
        return False

    class StandbyHandler(SubprocessHandler):
        def _popen(self, args: tuple[Any, ...], env: dict[str, str]) -> Any:
            if usable(args, self._stdout, self._stderr):
                proc = pool.take()
                if proc is not None and activate(proc, [str(a) for a in args[1:]], env):
                    return proc
            return super()._popen(args, env)

    def get_subprocess_handler(**kwargs: Any) -> SubprocessHandler:
        return StandbyHandler(**kwargs)

    api.get_subprocess_handler = get_subprocess_handler
    return True


# -- the standby process -------------------------------------------------------------------

def _run(job: dict[str, Any]) -> None:
    """Become the worker ``job`` describes: its environment, directory and command
    (``python -u ARGV...``), run as ``python`` itself would run it."""
    import runpy

    this_file = __file__
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    sys.orig_argv = [sys.orig_argv[0], *job["argv"]]  # python's own command line
    show_command([sys.orig_argv[0], *job["argv"]])  # what ps and pgrep -f find
    if "launcher.prefetch" in sys.modules:  # imported while waiting: start on the job's slot
        sys.modules["launcher.prefetch"].prefetch()
    argv = list(job["argv"][1:])  # after the interpreter's "-u"
    try:
        if argv[0] == "-m":  # as `python -m`, which runs the module through runpy too
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            sys.modules["__main__"] = _fresh_main()  # runpy runs the module in its namespace
            runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]
        elif os.path.isfile(argv[0]) and not zipfile.is_zipfile(argv[0]):
            sys.argv = argv
            _run_script(argv[0])
        else:  # a directory or zip file with a __main__.py
            sys.argv = argv
            sys.path[0] = argv[0]
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:  # as the interpreter reports it, minus this module's frames
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == this_file:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        if isinstance(exc, KeyboardInterrupt):  # python dies of SIGINT, after atexit
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        _note_raised()
        sys.exit(1)


def _note_raised() -> None:
    """Leave word that this worker dies of its own error (``contract.RAISED_DIR``)."""
    run_dir = os.environ.get(ENV_RUN_DIR, "")
    if run_dir:
        with contextlib.suppress(OSError):
            folder = os.path.join(run_dir, RAISED_DIR)
            os.makedirs(folder, mode=0o700, exist_ok=True)
            os.close(os.open(os.path.join(folder, str(os.getpid())),
                             os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))


def show_command(argv: list[str]) -> bool:
    """Show ``argv`` as this process's command line (``ps``, ``pgrep -f``,
    ``/proc/PID/cmdline``), as a worker torchrun started would show it, by writing it over
    the argument strings the kernel reports, as setproctitle does: joined by spaces and
    ended by a NUL before the area's last byte, which the kernel then reports up to that
    NUL (psutil splits it at the spaces). The process name stays. False where the area
    is too small (the title is cut) or cannot be found."""
    import ctypes

    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
    except (OSError, IndexError, ValueError):
        return False
    room = end - start
    title = " ".join(argv).encode(errors="replace")[:max(0, room - 2)]
    if room < 2:
        return False
    ctypes.memmove(start, title + b"\0" + b" " * (room - len(title) - 1), room)
    return len(title) == len(" ".join(argv).encode(errors="replace"))


def _fresh_main() -> Any:
    """An empty ``__main__`` module, as the interpreter starts with (not this module)."""
    import builtins
    import types

    main = types.ModuleType("__main__")
    main.__annotations__ = {}
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    main.__spec__ = None
    main.__package__ = None
    return main


def _run_script(path: str) -> None:
    """Run the file at ``path`` as ``python PATH`` does: in a fresh ``__main__`` module
    whose ``__file__`` is absolute, with a source loader, the ``builtins`` module as
    ``__builtins__`` and the script's own directory (symlinks resolved) first on the path."""
    import importlib.machinery

    full = os.path.join(os.getcwd(), path)  # as CPython makes it absolute: not normalized
    sys.path[0] = os.path.dirname(os.path.realpath(full))
    main = _fresh_main()
    main.__file__ = full
    main.__cached__ = None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", full)
    sys.modules["__main__"] = main
    with open(full, "rb") as fh:
        code = compile(fh.read(), full, "exec", dont_inherit=True)
    exec(code, main.__dict__)


#: Imported by a standby before it waits: torch, and what torch imports lazily on first use
#: of an optimizer (torch._dynamo, ~0.8 s), DDP and the process groups.
WARM_MODULES = ("torch", "torch._dynamo", "torch.optim", "torch.distributed",
                "torch.nn.parallel", "launcher.hook", "launcher.prefetch")


#: The file in the run's directory where a worker (local rank 0), once past its first save,
#: lists the modules it imported from the installed packages and the standard library, in
#: import order, each with the file it came from: a framework (transformers, Lightning,
#: accelerate) imports for seconds, and a standby that replaces the worker imports the
#: same modules before it waits (:func:`warm_recorded`).
IMPORTS_FILE = "imports.json"
#: Modules a standby imports too, comma-separated (``gemini run --preload``): the user's
#: own packages, which are not recorded (they live outside the installed packages).
ENV_PRELOAD = "GEMINI_PRELOAD"
_IMPORTS_LIMIT = 4 << 20  # bytes of IMPORTS_FILE a standby reads


def record_imports(run_dir: str) -> None:
    """Write :data:`IMPORTS_FILE` into ``run_dir`` for this process's modules (atomically:
    a standby reads the whole list or the previous one). Only modules whose file lies
    under the interpreter's library directories are listed: a module found on the
    script's own path would mean something else to a standby elsewhere."""
    import sysconfig

    paths = sysconfig.get_paths()
    roots = tuple({os.path.join(form(paths[key]), "")
                   for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths
                   for form in (os.path.abspath, os.path.realpath)})
    found = [[name, origin] for name, module in list(sys.modules.items())
             if name != "__main__" and isinstance(origin := getattr(module, "__file__", None), str)
             and origin.startswith(roots)]
    path = os.path.join(run_dir, IMPORTS_FILE)
    partial = f"{path}.{os.getpid()}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.write(fd, json.dumps({"modules": found}).encode())
    finally:
        os.close(fd)
    os.replace(partial, path)


def warm_recorded(job_arrived: Callable[[], bool]) -> int:
    """Import the modules of ``$GEMINI_PRELOAD``, then those a worker of this run recorded
    (:data:`IMPORTS_FILE`), until ``job_arrived()``; returns how many it imported. A
    recorded module is imported only where this interpreter finds it at the file the
    worker loaded it from, and never through a package it skipped; any failure skips
    that module (the worker imports what it needs itself)."""
    import importlib
    import importlib.util

    wanted: list[tuple[str, str | None]] = [
        (name.strip(), None) for name in os.environ.get(ENV_PRELOAD, "").split(",") if name.strip()]
    run_dir = os.environ.get(ENV_RUN_DIR, "")
    if run_dir:
        from launcher.files import read_user_file

        try:
            data = read_user_file(os.path.join(run_dir, IMPORTS_FILE), "import list",
                                  _IMPORTS_LIMIT)
            if len(data) > _IMPORTS_LIMIT:
                raise ValueError("import list too long")
            wanted += [(str(name), str(origin)) for name, origin in json.loads(data)["modules"]]
        except Exception:  # none recorded yet, or unreadable: a warm-up only
            logger.debug("standby: no import list in %s", run_dir, exc_info=True)
    imported = 0
    for name, origin in wanted:
        if job_arrived():
            break
        parent = name.rpartition(".")[0]
        if name in sys.modules or (origin is not None and parent and parent not in sys.modules):
            continue  # done, or its package was skipped: not through the child
        try:
            if origin is not None:
                spec = importlib.util.find_spec(name)
                if spec is None or spec.origin != origin:
                    continue
            importlib.import_module(name)
            imported += 1
        except Exception:
            logger.debug("standby could not pre-import %s", name, exc_info=True)
    return imported


STANDBY_NICE = 10
"""The niceness a standby imports at: training keeps the CPU it needs (a GPU host has
cores to spare, and its standbys are ready in seconds either way)."""


def _be_polite(job_fd: int) -> None:
    """Import at :data:`STANDBY_NICE`, thread and session, and return to a worker's
    priority as soon as the job arrives on ``job_fd`` (from a thread: an import in
    progress finishes at the worker's priority)."""
    import select

    main = threading.get_native_id()
    base = os.getpriority(os.PRIO_PROCESS, main)
    niced = _renice_step()
    if niced:
        os.setpriority(os.PRIO_PROCESS, main, base + niced)
    _set_group_nice(STANDBY_NICE)

    def wake() -> None:
        select.select([job_fd], [], [])  # the job, or the end of the pipe
        if niced:
            os.setpriority(os.PRIO_PROCESS, main, base)
        _set_group_nice(0)  # as a fresh session's: where torchrun starts its workers

    threading.Thread(target=wake, name="gemini-standby-wake", daemon=True).start()


def _renice_step() -> int:
    """How much a standby may lower its thread's priority while it imports:
    :data:`STANDBY_NICE` if it can raise it back afterwards (root, or RLIMIT_NICE allows),
    else 0, so that its worker never runs at a lower priority than torchrun's would."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_NICE)[0]
    if os.geteuid() == 0 or limit == resource.RLIM_INFINITY:
        return STANDBY_NICE
    lowest = 20 - limit  # the lowest niceness this process may set: can it come back?
    return STANDBY_NICE if os.getpriority(os.PRIO_PROCESS, 0) >= lowest else 0


_group_nice: dict[str, Any] = {"want": 0, "retrying": False}  # this session's niceness
_group_nice_lock = threading.Lock()


def _write_group_nice(nice: int) -> bool | None:
    """True when set; False when the kernel asks to retry later; None without autogroups."""
    try:
        fd = os.open("/proc/self/autogroup", os.O_WRONLY)
    except OSError:
        return None
    try:
        os.write(fd, str(nice).encode())
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None
    finally:
        os.close(fd)


def _set_group_nice(nice: int) -> None:
    """Give this process's session the scheduler niceness ``nice``, best-effort: now, or
    from a thread that retries (the newest request wins).

    With autogroups (Linux's default outside a cgroup), each session is scheduled as one
    group against the others, and a thread's niceness only orders it within its own
    session: a standby, a session of its own like every torchrun worker, would import at
    a full share next to the workers whatever its thread's niceness. Any user may raise
    a session's niceness and bring it back to 0; without CAP_SYS_ADMIN the kernel takes
    one change per 100 ms from anyone (EAGAIN)."""
    with _group_nice_lock:
        _group_nice["want"] = nice
        if _group_nice["retrying"] or _write_group_nice(nice) is not False:
            return  # done, impossible, or the retrying thread writes the newest
        _group_nice["retrying"] = True

    def retry() -> None:
        for _ in range(100):
            time.sleep(0.02 + 0.08 * random.random())
            with _group_nice_lock:
                if _write_group_nice(_group_nice["want"]) is not False:
                    break
        with _group_nice_lock:
            _group_nice["retrying"] = False

    threading.Thread(target=retry, name="gemini-group-nice", daemon=True).start()


def main() -> None:
    import importlib
    import select

    die_with_parent()
    job_fd = int(sys.argv[1])
    if sys.argv[2:3] == ["polite"]:  # this host's workers train: import without slowing them
        _be_polite(job_fd)

    def job_arrived() -> bool:
        # The job is here (the first start of a run, when the standby was started a
        # moment ago): run it now and let it import what it needs itself.
        return bool(select.select([job_fd], [], [], 0)[0])

    for module in WARM_MODULES:
        if job_arrived():
            break
        try:
            importlib.import_module(module)
        except Exception:  # a warm-up only: the worker will import what it needs itself
            logger.debug("standby could not pre-import %s", module, exc_info=True)
    warm_recorded(job_arrived)

    if len(sys.argv) > 3 and sys.argv[3].isdigit():  # tell the supervisor: ready
        ready = int(sys.argv[3])
        with contextlib.suppress(OSError):
            os.write(ready, b"r")
        with contextlib.suppress(OSError):
            os.close(ready)  # the worker it becomes must not inherit it
    with os.fdopen(job_fd, "rb") as jobs:
        line = jobs.readline()
    if not line:
        return  # the supervisor closed the pool, or died
    _run(json.loads(line))


if __name__ == "__main__":
    main()
