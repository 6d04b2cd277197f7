"""Which step to restore: pure decisions from a snapshot of what every rank holds.

No processes, no I/O: the supervisor gathers the holdings, calls :func:`choose_step`,
and hands the answer to its workers.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


def choose_step(holdings: Mapping[int, Collection[int]], world_size: int) -> int | None:
    """The newest step that every one of ``world_size`` ranks holds a verified copy of.

    ``holdings`` maps a global rank to the committed, checksum-verified steps available
    for it. A rank missing from ``holdings`` holds nothing, so no step is common and the
    answer is None (start fresh, or use another tier).
    """
    common: set[int] | None = None
    for rank in range(world_size):
        steps = set(holdings.get(rank, ()))
        common = steps if common is None else common & steps
        if not common:
            return None
    return max(common) if common else None
