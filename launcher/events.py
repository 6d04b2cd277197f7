"""JSON-lines event log of a run: what the supervisors did, for ``gemini status``.

Each run has a directory ``<run_root>/<run_id>``; every supervisor appends one JSON object
per line to ``events.jsonl`` there with a single ``write`` on an ``O_APPEND`` descriptor,
so lines from several supervisors on one machine never interleave.
"""

from __future__ import annotations

import json
import os
import re
import socket
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


class EventLog:
    """Appends events for one supervisor; safe to use after ``close`` (it then drops them)."""

    def __init__(self, run_dir: Path, *, host: str | None = None) -> None:
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = run_dir / EVENTS_FILE
        self.host = host or socket.gethostname()
        self._fd: int | None = os.open(
            self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
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
    """Yield the run's events in file order, skipping a torn last line."""
    try:
        with open(run_dir / EVENTS_FILE, encoding="utf-8") as fh:
            for line in fh:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        return
