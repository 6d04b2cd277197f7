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


class IdleGate:
    """Whether this host's training processes leave the CPU idle right now.

    Judged from each process's CPU time (all its threads: compute, communication, data
    loading in threads), read through its CPU-time clock (``clock_getcpuclockid``), in
    each of the last two :data:`IDLE_WINDOW` windows: idle when none of them used
    :data:`IDLE_SHARE` of a core, or when together they left at least two of this
    process's ``cpus`` free (a GPU host, whose workers spin while they wait for their
    GPUs, has cores to spare). A worker waiting for its accelerator, its data or its
    peers is idle; one computing on the CPU is not. A lower priority alone does not
    protect training on a busy host: a background thread inside a long system call (a
    loopback TCP transfer, say) is not preempted on kernels without full preemption, and
    each wake-up of a training thread then waits for it. One thread asks; another may
    :meth:`watch`.
    """

    def __init__(self, cpus: int | None = None) -> None:
        """``cpus``: the cores this host has (default: those this process may run on)."""
        self._cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
        self._clocks: tuple[int, ...] = ()
        # (when, the clocks read, what they showed) at the start of the current window
        self._last: tuple[float, tuple[int, ...], list[int | None]] | None = None
        self._quiet = 0  # consecutive windows in which every process was idle

    @staticmethod
    def available() -> bool:
        """Whether this system has per-process CPU-time clocks."""
        return _cpu_clock(os.getpid()) is not None

    def watch(self, pids: Iterable[int]) -> None:
        """Judge by these processes from now on (a new round's workers)."""
        self._clocks = tuple(c for pid in pids if (c := _cpu_clock(pid)) is not None)

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
        clocks = self._clocks
        if not clocks:
            return True
        now = time.monotonic()
        last = self._last
        if last is not None and last[1] is clocks and now - last[0] < IDLE_WINDOW:
            return self._quiet >= 2
        used = [_cpu_ns(clock) for clock in clocks]
        self._last = (now, clocks, used)
        if last is None or last[1] is not clocks or now - last[0] > 2 * IDLE_WINDOW:
            self._quiet = 0  # a fresh window first
        else:
            span = (now - last[0]) * 1e9
            spent = [ns - old for ns, old in zip(used, last[2], strict=True)
                     if ns is not None and old is not None]
            quiet = (all(ns < IDLE_SHARE * span for ns in spent)
                     or sum(spent) <= (self._cpus - 2) * span)
            self._quiet = self._quiet + 1 if quiet else 0
        return self._quiet >= 2


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
