"""Replication pacing without workers: the pacer paces at its rate when it has no idle
gate. The idle gate on real processes is tested in tests/integration/test_pacing.py."""

from __future__ import annotations

import threading
import time

from launcher.replication.service import _Pacer


def test_pacer_without_a_gate_paces_at_the_rate() -> None:
    pacer = _Pacer(None, rate=1e6, until=time.monotonic() + 60, stop=threading.Event())
    began = time.monotonic()
    for sent in (0, 100_000, 200_000):
        pacer(sent)
    assert 0.19 < time.monotonic() - began < 2
