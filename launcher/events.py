"""JSON-lines event log of a run: what the supervisors did, for ``gemini status``.

Each run has a directory ``<run_root>/<run_id>``; every supervisor appends one JSON object
per line to ``events.jsonl`` there with a single ``write`` on an ``O_APPEND`` descriptor,
so lines from several supervisors on one machine never interleave.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from launcher.errors import ConfigError

EVENTS_FILE = "events.jsonl"


_RUN_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:-]{0,127}")


def check_run_id(run_id: str) -> str:
    """``run_id`` if it is a safe name for a directory (1-128 letters, digits, ``.``,
    ``_``, ``:``, ``-``; not starting with a dot, a colon or a dash); else ConfigError."""
    if not _RUN_ID.fullmatch(run_id):
        shown = run_id if len(run_id) <= 40 else run_id[:40] + "..."
        raise ConfigError(f"run id {shown!r}: use 1-128 letters, digits, '.', '_', ':' or '-', "
                          "not starting with '.', ':' or '-'", field="rdzv_id")
    return run_id


def run_directory(run_root: str, run_id: str) -> Path:
    """Where the run's events and state live (the path, without creating it)."""
    return Path(os.path.expanduser(run_root)) / check_run_id(run_id)


def _refusal(info: os.stat_result, kind: str) -> str | None:
    """Why a run directory (``kind`` "directory") or events file ("file") with ``info``
    (from ``lstat``/``fstat``) is not this user's own, or None if it is."""
    is_kind = stat.S_ISDIR if kind == "directory" else stat.S_ISREG
    if not is_kind(info.st_mode):
        return f"not a {kind}"
    if info.st_uid != os.geteuid():
        return f"owned by uid {info.st_uid}, not by this user"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _open_run_directory(run_dir: Path) -> int:
    """A descriptor of ``run_dir``, created mode 0700 if missing, after checking that it
    is a directory of this user that nobody else can write: in a shared run root another
    user may have made it first, to plant an ``events.jsonl`` link to a file of their
    choosing (a root supervisor would append to it). ConfigError if not."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)  # the run root, perhaps shared
    try:
        os.mkdir(run_dir, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        why: str | None = "a symbolic link or not a directory"
    else:
        why = _refusal(os.fstat(fd), "directory")
        if why is None:
            return fd
        os.close(fd)
    raise ConfigError(f"run directory {run_dir}: {why}; remove it or choose another "
                      "--run-root", field="run_root")


class EventLog:
    """Appends events for one supervisor; safe to use after ``close`` (it then drops them).

    The run directory must be this user's own and closed to others (:class:`ConfigError`
    otherwise); ``events.jsonl`` is opened in it without following links."""

    def __init__(self, run_dir: Path, *, host: str | None = None) -> None:
        self.path = run_dir / EVENTS_FILE
        self.host = host or socket.gethostname()
        dir_fd = _open_run_directory(run_dir)
        try:
            # O_NONBLOCK: a FIFO in its place must not hang the supervisor (it is refused).
            fd = os.open(EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                         | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise ConfigError(f"{self.path}: a symbolic link; remove it", field="run_root") \
                from None
        finally:
            os.close(dir_fd)
        why = _refusal(os.fstat(fd), "file")
        if why is not None:
            os.close(fd)
            raise ConfigError(f"{self.path}: {why}; remove it", field="run_root")
        self._fd: int | None = fd
        self._sinks: list[Callable[[str, dict[str, Any]], None]] = []

    def add_sink(self, sink: Callable[[str, dict[str, Any]], None]) -> None:
        """Also hand every event to ``sink(event, fields)`` (which must not block)."""
        self._sinks.append(sink)

    def write(self, event: str, **fields: Any) -> None:
        """Record ``event`` with ``fields``; values must be JSON-serialisable."""
        if self._fd is None:
            return
        record = {"ts": round(time.time(), 6), "event": event, "host": self.host,
                  "pid": os.getpid(), **fields}
        os.write(self._fd, (json.dumps(record, sort_keys=True) + "\n").encode())
        for sink in self._sinks:
            sink(event, fields)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def report_dead(events: EventLog, dead: Mapping[str, str], **fields: Any) -> None:
    """Say on stderr and as ``host_dead`` events that the hosts of ``dead`` (host ->
    evidence) are gone."""
    for host, evidence in dead.items():
        print(f"gemini: host {host} is gone ({evidence}): every host restarts without it",
              file=sys.stderr, flush=True)
        events.write("host_dead", lost=host, evidence=evidence, **fields)


def read_events(run_dir: Path) -> Iterator[dict[str, Any]]:
    """Yield the run's events in file order, skipping a torn last line; nothing if the
    file is missing, a link, or not a regular file (a FIFO planted there would hang)."""
    try:
        fd = os.open(run_dir / EVENTS_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            return
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return
    with open(fd, encoding="utf-8") as fh:
        for line in fh:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
