"""Politeness of background threads (replication, persistence) next to training: a lower
CPU priority, and a gate that tells when the training processes leave the CPU idle."""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from collections.abc import Iterable

IDLE_WINDOW = 0.01
"""Seconds per window of the training processes' CPU use that :class:`IdleGate` judges."""
IDLE_SHARE = 0.5
"""A training process counts as busy in a window when it used this share of a core."""


def lower_priority(nice: int) -> None:
    """Give the calling thread (not its process) the niceness ``nice``, best-effort (Linux
    schedules threads individually): under CPU contention training threads then go first."""
    if nice > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (OSError, AttributeError):
            pass


def idle_priority() -> None:
    """Run the calling thread only on CPU time that nothing else wants (Linux's SCHED_IDLE;
    where that is refused, the lowest niceness), best-effort. When such a thread holds
    back something that waits for it, the waiter leaves its core idle, and it runs."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
    except (OSError, AttributeError):
        lower_priority(19)


class IdleGate:
    """Whether this host's training processes leave the CPU idle right now.

    Judged in each of the last two :data:`IDLE_WINDOW` windows from each process's CPU
    time (all its threads: compute, communication, data loading in threads; read through
    its CPU-time clock, ``clock_getcpuclockid``) and from the time its main thread ran or
    waited for a core (``/proc/PID/schedstat``: a busy process on a crowded host uses
    little CPU but waits for it): idle when neither reached :data:`IDLE_SHARE` of the
    window for any process, or when the processes together left at least two of this
    host's ``cpus`` free (a GPU host, whose workers spin while they wait for their GPUs,
    has cores to spare). A worker waiting for its accelerator, its data or its
    peers is idle; one computing on the CPU is not. A lower priority alone does not
    protect training on a busy host: a background thread inside a long system call (a
    loopback TCP transfer, say) is not preempted on kernels without full preemption, and
    each wake-up of a training thread then waits for it. One thread asks; another may
    :meth:`watch`.
    """

    def __init__(self, cpus: int | None = None) -> None:
        """``cpus``: the cores this host has (default: those this process may run on)."""
        self._cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
        self._watched: tuple[tuple[int, int], ...] = ()  # (pid, its CPU-time clock)
        # (when, what was watched, CPU times, main threads' run + wait times) at the start
        # of the current window
        self._last: tuple[float, tuple[tuple[int, int], ...], list[int | None],
                          list[int | None]] | None = None
        self._quiet = 0  # consecutive quiet windows (idle workers, or cores to spare)

    @staticmethod
    def available() -> bool:
        """Whether this system has per-process CPU-time clocks."""
        return _cpu_clock(os.getpid()) is not None

    def watch(self, pids: Iterable[int]) -> None:
        """Judge by these processes from now on (a new round's workers)."""
        self._watched = tuple((pid, c) for pid in pids if (c := _cpu_clock(pid)) is not None)

    def wait(self, until: float, stop: threading.Event) -> bool:
        """Wait until :meth:`idle`; False when ``until`` (monotonic time) passes first or
        ``stop`` is set."""
        while not self.idle():
            if time.monotonic() >= until or stop.wait(IDLE_WINDOW):
                return False
        return True

    def idle(self) -> bool:
        """True when the watched processes were idle over the last two windows. After a
        pause of more than a window the count starts again (False)."""
        watched = self._watched
        if not watched:
            return True
        now = time.monotonic()
        last = self._last
        if last is not None and last[1] is watched and now - last[0] < IDLE_WINDOW:
            return self._quiet >= 2
        used = [_cpu_ns(clock) for _, clock in watched]
        wanted = [_main_thread_ns(pid) for pid, _ in watched]
        self._last = (now, watched, used, wanted)
        if last is None or last[1] is not watched or now - last[0] > 2 * IDLE_WINDOW:
            self._quiet = 0  # a fresh window first
        else:
            span = (now - last[0]) * 1e9
            spent = _deltas(used, last[2])
            quiet = (all(ns < IDLE_SHARE * span for ns in spent + _deltas(wanted, last[3]))
                     or sum(spent) <= (self._cpus - 2) * span)
            self._quiet = self._quiet + 1 if quiet else 0
        return self._quiet >= 2


def _deltas(now: list[int | None], before: list[int | None]) -> list[int]:
    return [a - b for a, b in zip(now, before, strict=True) if a is not None and b is not None]


def _main_thread_ns(pid: int) -> int | None:
    """Nanoseconds the main thread of ``pid`` ran or waited for a core, or None."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as fh:
            run, wait = fh.read().split()[:2]
        return int(run) + int(wait)
    except (OSError, ValueError):
        return None


def _cpu_clock(pid: int) -> int | None:
    """The id of the clock that counts the CPU time of process ``pid``, or None."""
    clock = ctypes.c_int()
    try:
        failed = _libc().clock_getcpuclockid(pid, ctypes.byref(clock))
    except (OSError, AttributeError):
        return None
    return None if failed else clock.value


def _cpu_ns(clock: int) -> int | None:
    """The CPU time a process clock shows, or None once the process is gone."""
    try:
        return time.clock_gettime_ns(clock)
    except OSError:
        return None


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
