"""Which step to restore: pure decisions from a snapshot of what every rank holds.

No processes, no I/O: the supervisor gathers every host's :class:`HoldingsReport`, calls
:func:`choose_plan`, and hands the answer to its workers.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar


class ReportRefused(ValueError):
    """A holdings report that is not a well-formed record of this version of
    :class:`HoldingsReport` (what is wrong is in the message)."""


@dataclass(frozen=True, kw_only=True)
class HoldingsReport:
    """One host's report to a round: the verified steps it holds of each rank in each
    tier, and what the round needs to know of it besides. Every host writes its own to the
    round's store (``holdings/<node>``, :meth:`dumps`) and reads every host's
    (:meth:`loads`), so that all compute the same plan from the same reports. A field not
    given to the constructor is empty: the host holds nothing there."""

    VERSION: ClassVar[int] = 1
    """The format written under ``"version"``; :meth:`loads` refuses any other."""

    local: dict[int, list[int]] = field(default_factory=dict)
    """Rank -> verified steps in the host's own slots, for the ranks it runs now."""
    replicas: dict[int, list[int]] = field(default_factory=dict)
    """Rank -> verified steps in the replica slots it keeps for peers."""
    persist: dict[int, list[int]] = field(default_factory=dict)
    """Rank -> steps in the persistent tier, for the ranks it runs now."""
    address: tuple[str, int] | None = None
    """Where its replication transport listens (None: no replication)."""
    ranks: list[int] = field(default_factory=list)
    """The global ranks it runs in this round."""
    avoid: list[int] = field(default_factory=list)
    """Steps no host of the round restores (its workers failed right after restoring one)."""
    ceiling: int | None = None
    """No host of the round restores a newer step (the replicas disagreed after it; -1: not
    even step 0, the round starts fresh); None: no ceiling."""
    resizable: dict[int, dict[int, list[int]]] = field(default_factory=dict)
    """World size -> rank -> verified steps of replicated state written by a world of
    another size (:func:`plan_resized`)."""
    reshardable: dict[int, dict[int, list[int]]] = field(default_factory=dict)
    """The same for sharded state (:func:`plan_resharded`)."""

    def dumps(self) -> str:
        """The report as JSON (ranks and world sizes become strings as object keys)."""
        return json.dumps({"version": self.VERSION, **asdict(self)}, sort_keys=True)

    @classmethod
    def loads(cls, data: bytes | str) -> HoldingsReport:
        """The report ``data`` holds, written by :meth:`dumps`, with ranks, world sizes and
        steps as ints. Anything else raises :class:`ReportRefused`: not JSON, another
        version, a field missing or unknown, a value of the wrong type. No field is
        defaulted: a report read in part could name copies its host does not hold, or hide
        an ``avoid`` or a ``ceiling``; the caller decides what a refused report means for
        the round (``tiers.read_holdings``: its host holds nothing)."""
        try:
            fields = json.loads(data)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            raise ReportRefused(f"the holdings report is not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise ReportRefused(f"the holdings report is a {type(fields).__name__}, "
                                "not an object")
        version = fields.pop("version", None)
        if type(version) is not int or version != cls.VERSION:  # true == 1 in Python
            raise ReportRefused(f"the holdings report has version {version!r}; this host "
                                f"reads version {cls.VERSION} (every host must run the "
                                "same version of gemini)")
        if unknown := sorted(set(fields) - set(_FIELDS)):
            raise ReportRefused(f"the holdings report has unknown field(s) {', '.join(unknown)}")
        parsed: dict[str, Any] = {}
        for name, parse in _FIELDS.items():
            if name not in fields:
                raise ReportRefused(f"the holdings report lacks {name!r}")
            try:
                parsed[name] = parse(fields[name])
            except ValueError as exc:
                raise ReportRefused(f"the holdings report's {name!r} is malformed: {exc}"
                                    ) from None
        return cls(**parsed)


def _int(value: Any) -> int:
    if type(value) is not int:  # JSON's true is a bool and 7.0 a float: neither is a step
        raise ValueError(f"a {type(value).__name__} where an integer belongs")
    return value


def _key(value: str) -> int:
    """A rank or world size written as a JSON object key: its decimal digits, so that no
    two keys name the same rank."""
    if not (value.isascii() and value.isdigit()) or str(int(value)) != value:
        raise ValueError(f"the key {value[:20]!r} is not a rank or world size")
    return int(value)


def _ints(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise ValueError(f"a {type(value).__name__} where a list belongs")
    return [_int(item) for item in value]


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"a {type(value).__name__} where an object belongs")
    return value


def _steps(value: Any) -> dict[int, list[int]]:
    return {_key(rank): _ints(steps) for rank, steps in _object(value).items()}


def _worlds(value: Any) -> dict[int, dict[int, list[int]]]:
    return {_key(world): _steps(ranks) for world, ranks in _object(value).items()}


def _address(value: Any) -> tuple[str, int] | None:
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)):
        raise ValueError("not null or [host, port]")
    return value[0], _int(value[1])


def _ceiling(value: Any) -> int | None:
    if value is None:
        return None
    if _int(value) < -1:
        raise ValueError(f"{value} is below -1")
    return int(value)


_FIELDS: dict[str, Callable[[Any], Any]] = {
    "local": _steps, "replicas": _steps, "persist": _steps, "address": _address,
    "ranks": _ints, "avoid": _ints, "ceiling": _ceiling, "resizable": _worlds,
    "reshardable": _worlds}
"""How :meth:`HoldingsReport.loads` reads each field of the JSON record."""


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


def gather_sources(reports: Mapping[int, HoldingsReport]) -> dict[int, dict[int, list[Source]]]:
    """Turn every node's report of what it holds into ``available`` for :func:`plan_restore`:
    its own slots as MEMORY, the replicas it keeps as PEER of that node, persisted files
    as PERSIST. A node's replica of a rank it runs (it held a peer's rank that is now its
    own, or a slot adopted from an earlier run) counts as MEMORY: it is copied into the
    rank's own slot without the network.
    """
    available: dict[int, dict[int, list[Source]]] = {}
    for node, report in sorted(reports.items()):
        tiers = ((report.local, Tier.MEMORY), (report.replicas, Tier.PEER),
                 (report.persist, Tier.PERSIST))
        for held, tier in tiers:
            for rank, steps in held.items():
                # A replica of a rank this host runs is as good as its own copy.
                kept = tier is Tier.PEER and rank in report.local
                source = Source(Tier.MEMORY) if kept else Source(tier, node if tier is Tier.PEER
                                                                 else -1)
                for step in steps:
                    available.setdefault(rank, {}).setdefault(step, []).append(source)
    return available


def plan_resized(reports: Mapping[int, HoldingsReport], world_size: int) -> RestorePlan:
    """The newest step that ``world_size`` ranks can restore from copies written while the
    job ran with another number of ranks (it shrank after a host loss, or grows back):
    new rank ``r`` restores old rank ``r % W`` of a world of ``W`` ranks. Only state that
    every data-parallel rank holds whole is reported as resizable (DDP: any rank's copy
    is every rank's), under ``reports[node].resizable[W][rank]``, verified steps of the
    node's own and replica slots; a copy on the node that runs the new rank now is
    MEMORY, on another node PEER (a pull names the old rank)."""
    best = RestorePlan(None)
    worlds = {world for report in reports.values() for world in report.resizable}
    runs = {rank: node for node, report in reports.items() for rank in report.ranks}
    for world in sorted(worlds - {world_size}):
        available: dict[int, dict[int, list[Source]]] = {}
        for rank in range(world_size):
            old = rank % world
            for node, report in sorted(reports.items()):
                held = report.resizable.get(world, {}).get(old, [])
                source = Source(Tier.MEMORY) if runs.get(rank) == node else Source(Tier.PEER, node)
                for step in held:
                    available.setdefault(rank, {}).setdefault(step, []).append(source)
        plan = plan_restore(available, world_size)
        if plan.step is not None and (best.step is None or plan.step > best.step):
            best = RestorePlan(plan.step, plan.sources, world_size=world,
                               origin={rank: rank % world for rank in range(world_size)})
    return best


def plan_resharded(reports: Mapping[int, HoldingsReport], world_size: int,
                   node: int) -> RestorePlan:
    """The newest step that ``world_size`` ranks can restore from sharded state (DTensors:
    FSDP2, tensor parallelism) written while the job ran with another number of ranks
    ``W``: every host brings in the copy of step ``s`` of each of the ``W`` old ranks, and
    each new rank assembles its own shard from them. ``reports[n].reshardable[W][rank]``
    lists the verified steps node ``n`` holds (own or replica slots). The plan is
    ``node``'s: per old rank, MEMORY when ``node`` holds the copy, else the peers that do,
    lowest node first."""
    best = RestorePlan(None)
    worlds = {world for report in reports.values() for world in report.reshardable}
    for world in sorted(worlds - {world_size}):
        holders: dict[int, dict[int, list[int]]] = {}  # old rank -> step -> nodes
        for peer, report in sorted(reports.items()):
            for rank, steps in report.reshardable.get(world, {}).items():
                for held in steps:
                    holders.setdefault(rank, {}).setdefault(held, []).append(peer)
        step = choose_step({rank: list(steps) for rank, steps in holders.items()}, world)
        if step is None or (best.step is not None and step <= best.step):
            continue
        sources = {rank: [Source(Tier.MEMORY)] if node in holders[rank][step]
                   else [Source(Tier.PEER, peer) for peer in holders[rank][step]]
                   for rank in range(world)}
        best = RestorePlan(step, sources, world_size=world, reshard=True)
    return best


def choose_plan(reports: Mapping[int, HoldingsReport], world_size: int,
                node: int) -> RestorePlan:
    """``node``'s plan for a round of ``world_size`` ranks, from every host's holdings
    report: the newest step of the three ways to restore, the same world size first
    (:func:`plan_restore`), then a whole copy per rank after the job shrank or grew
    (:func:`plan_resized`), then shards assembled from the old ranks' copies
    (:func:`plan_resharded`); a later one wins only with a newer step. No step that a
    report names under ``avoid`` is chosen (:func:`without_avoided`). A node without a
    report holds nothing."""
    reports = without_avoided(reports)
    plan = plan_restore(gather_sources(reports), world_size)
    for other in (plan_resized(reports, world_size),
                  plan_resharded(reports, world_size, node)):
        if other.step is not None and (plan.step is None or other.step > plan.step):
            plan = other
    return plan


def without_avoided(reports: Mapping[int, HoldingsReport]) -> dict[int, HoldingsReport]:
    """``reports`` without any step that one of them lists under ``avoid`` (a host's
    workers failed right after restoring it, and no host of the round restores it again)
    or that is newer than a ``ceiling`` one of them sets (the replicas disagreed after
    it: the round rolls back to it). Every host computes the plan from the same reports,
    so all of them skip the same steps."""
    avoid = {step for report in reports.values() for step in report.avoid}
    ceiling = min((c for report in reports.values() if (c := report.ceiling) is not None),
                  default=None)
    if not avoid and ceiling is None:
        return dict(reports)

    def kept(held: Mapping[int, list[int]]) -> dict[int, list[int]]:
        return {rank: [step for step in steps if step not in avoid
                       and (ceiling is None or step <= ceiling)]
                for rank, steps in held.items()}

    return {node: replace(report, local=kept(report.local), replicas=kept(report.replicas),
                          persist=kept(report.persist),
                          resizable={world: kept(ranks)
                                     for world, ranks in report.resizable.items()},
                          reshardable={world: kept(ranks)
                                       for world, ranks in report.reshardable.items()})
            for node, report in reports.items()}
