"""Which step to restore: pure decisions from a snapshot of what every rank holds.

No processes, no I/O: the supervisor gathers the holdings, calls :func:`choose_step`,
and hands the answer to its workers.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any


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


class Tier(enum.IntEnum):
    """Where a copy of a rank's checkpoint lives, in order of preference (fastest first)."""

    MEMORY = 0
    """The shared memory of the host that runs the rank now."""
    PEER = 1
    """A replica in another host's memory, pulled over the replication transport."""
    PERSIST = 2
    """A file in the persistent tier."""


@dataclass(frozen=True, order=True)
class Source:
    """One copy of a rank's checkpoint: its tier and, for PEER, the node holding it."""

    tier: Tier
    node: int = -1


@dataclass(frozen=True)
class RestorePlan:
    """The step every rank restores, and where each rank's copy of it comes from."""

    step: int | None
    """None: no step is complete for every rank anywhere; start fresh."""
    sources: dict[int, list[Source]] = field(default_factory=dict)
    """Per rank, the copies of ``step`` in order of preference."""
    world_size: int | None = None
    """The world size the copies were written with, when it differs from the job's now
    (it shrank or grew: :func:`plan_resized`); None: the same."""
    origin: dict[int, int] = field(default_factory=dict)
    """With ``world_size``: the rank of that world whose copy each rank restores."""
    reshard: bool = False
    """With ``world_size``: the state is sharded (DTensors), and every rank assembles its
    shard from the copies of all of that world's ranks; ``sources`` then lists, per rank
    of that world, where this host gets its copy (:func:`plan_resharded`)."""


def plan_restore(available: Mapping[int, Mapping[int, Collection[Source]]],
                 world_size: int) -> RestorePlan:
    """The newest step complete for every rank across all tiers, with its sources.

    ``available[rank][step]`` lists the copies of ``step`` for ``rank``. Copies in a
    faster tier come first; between peers, the lower node first (every host computes
    the same plan from the same snapshot).
    """
    step = choose_step({rank: list(steps) for rank, steps in available.items()}, world_size)
    if step is None:
        return RestorePlan(None)
    return RestorePlan(step, {rank: sorted(set(available[rank][step]))
                              for rank in range(world_size)})


def explain_incomplete(available: Mapping[int, Mapping[int, Collection[Source]]],
                       world_size: int) -> str:
    """Why no step is complete for every rank: what each rank holds, and where."""
    parts = []
    for rank in range(world_size):
        steps = available.get(rank, {})
        if not steps:
            parts.append(f"rank {rank} holds nothing")
            continue
        held = ", ".join(
            f"{step} ({'/'.join(sorted({_where(s) for s in steps[step]}))})"
            for step in sorted(steps))
        parts.append(f"rank {rank} holds {held}")
    return "; ".join(parts) + ": no step in common"


def _where(source: Source) -> str:
    return f"peer node {source.node}" if source.tier is Tier.PEER else source.tier.name.lower()


def gather_sources(reports: Mapping[int, Mapping[str, Any]]) -> dict[int, dict[int, list[Source]]]:
    """Turn every node's report of what it holds into ``available`` for :func:`plan_restore`.

    ``reports[node]`` has ``"local"`` (rank -> verified steps in the node's own slots, for
    the ranks it runs now), ``"replicas"`` (rank -> verified steps it keeps for peers) and
    ``"persist"`` (rank -> steps in the persistent tier), with ranks as strings (JSON).
    A node's replica of a rank it runs (it held a peer's rank that is now its own, or a
    slot adopted from an earlier run) counts as MEMORY: it is copied into the rank's own
    slot without the network.
    """
    available: dict[int, dict[int, list[Source]]] = {}
    tiers = (("local", Tier.MEMORY), ("replicas", Tier.PEER), ("persist", Tier.PERSIST))
    for node, report in sorted(reports.items()):
        own = {str(rank) for rank in report.get("local") or {}}
        for key, tier in tiers:
            for rank, steps in (report.get(key) or {}).items():
                # A replica of a rank this host runs is as good as its own copy.
                kept = tier is Tier.PEER and str(rank) in own
                source = Source(Tier.MEMORY) if kept else Source(tier, node if tier is Tier.PEER
                                                                 else -1)
                for step in steps:
                    available.setdefault(int(rank), {}).setdefault(int(step), []).append(source)
    return available


def plan_resized(reports: Mapping[int, Mapping[str, Any]], world_size: int) -> RestorePlan:
    """The newest step that ``world_size`` ranks can restore from copies written while the
    job ran with another number of ranks (it shrank after a host loss, or grows back):
    new rank ``r`` restores old rank ``r % W`` of a world of ``W`` ranks. Only state that
    every data-parallel rank holds whole is reported as resizable (DDP: any rank's copy
    is every rank's), under ``reports[node]["resizable"][W][rank]``, verified steps of
    the node's own and replica slots; a copy on the node that runs the new rank now is
    MEMORY, on another node PEER (a pull names the old rank)."""
    best = RestorePlan(None)
    worlds = {int(w) for report in reports.values() for w in report.get("resizable") or {}}
    for world in sorted(worlds - {world_size}):
        runs = {rank: node for node, report in reports.items()
                for rank in report.get("ranks") or []}
        available: dict[int, dict[int, list[Source]]] = {}
        for rank in range(world_size):
            old = rank % world
            for node, report in sorted(reports.items()):
                held = (report.get("resizable") or {}).get(str(world), {}).get(str(old), [])
                source = Source(Tier.MEMORY) if runs.get(rank) == node else Source(Tier.PEER, node)
                for step in held:
                    available.setdefault(rank, {}).setdefault(int(step), []).append(source)
        plan = plan_restore(available, world_size)
        if plan.step is not None and (best.step is None or plan.step > best.step):
            best = RestorePlan(plan.step, plan.sources, world_size=world,
                               origin={rank: rank % world for rank in range(world_size)})
    return best


def plan_resharded(reports: Mapping[int, Mapping[str, Any]], world_size: int,
                   node: int) -> RestorePlan:
    """The newest step that ``world_size`` ranks can restore from sharded state (DTensors:
    FSDP2, tensor parallelism) written while the job ran with another number of ranks
    ``W``: every host brings in the copy of step ``s`` of each of the ``W`` old ranks, and
    each new rank assembles its own shard from them. ``reports[n]["reshardable"][W][rank]``
    lists the verified steps node ``n`` holds (own or replica slots). The plan is
    ``node``'s: per old rank, MEMORY when ``node`` holds the copy, else the peers that do,
    lowest node first."""
    best = RestorePlan(None)
    worlds = {int(w) for report in reports.values() for w in report.get("reshardable") or {}}
    for world in sorted(worlds - {world_size}):
        holders: dict[int, dict[int, list[int]]] = {}  # old rank -> step -> nodes
        for peer, report in sorted(reports.items()):
            for rank, steps in ((report.get("reshardable") or {}).get(str(world)) or {}).items():
                for step in steps:
                    holders.setdefault(int(rank), {}).setdefault(int(step), []).append(peer)
        step = choose_step({rank: list(steps) for rank, steps in holders.items()}, world)
        if step is None or (best.step is not None and step <= best.step):
            continue
        sources = {rank: [Source(Tier.MEMORY)] if node in holders[rank][step]
                   else [Source(Tier.PEER, peer) for peer in holders[rank][step]]
                   for rank in range(world)}
        best = RestorePlan(step, sources, world_size=world, reshard=True)
    return best


def choose_plan(reports: Mapping[int, Mapping[str, Any]], world_size: int,
                node: int) -> RestorePlan:
    """``node``'s plan for a round of ``world_size`` ranks, from every host's holdings
    report: the newest step of the three ways to restore, the same world size first
    (:func:`plan_restore`), then a whole copy per rank after the job shrank or grew
    (:func:`plan_resized`), then shards assembled from the old ranks' copies
    (:func:`plan_resharded`); a later one wins only with a newer step. No step that a
    report names under ``"avoid"`` is chosen (:func:`without_avoided`)."""
    reports = without_avoided(reports)
    plan = plan_restore(gather_sources(reports), world_size)
    for other in (plan_resized(reports, world_size),
                  plan_resharded(reports, world_size, node)):
        if other.step is not None and (plan.step is None or other.step > plan.step):
            plan = other
    return plan


def without_avoided(reports: Mapping[int, Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """``reports`` without any step that one of them lists under ``"avoid"`` (a host's
    workers failed right after restoring it, and no host of the round restores it again)
    or that is newer than a ``"ceiling"`` one of them sets (the replicas disagreed after
    it: the round rolls back to it). Every host computes the plan from the same reports,
    so all of them skip the same steps."""
    avoid = {int(step) for report in reports.values() for step in report.get("avoid") or ()}
    ceilings = [int(c) for report in reports.values()
                if isinstance(c := report.get("ceiling"), int) and c >= -1]
    ceiling = min(ceilings, default=None)

    def kept(steps: Any) -> list[int]:
        return [step for step in steps if int(step) not in avoid
                and (ceiling is None or int(step) <= ceiling)]

    if not avoid and ceiling is None:
        return {node: dict(report) for node, report in reports.items()}
    filtered: dict[int, dict[str, Any]] = {}
    for node, report in reports.items():
        copy = dict(report)
        for key in ("local", "replicas", "persist"):
            copy[key] = {rank: kept(steps) for rank, steps in (report.get(key) or {}).items()}
        for key in ("resizable", "reshardable"):
            copy[key] = {world: {rank: kept(steps) for rank, steps in ranks.items()}
                         for world, ranks in (report.get(key) or {}).items()}
        filtered[node] = copy
    return filtered
