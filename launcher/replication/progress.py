"""Which step every host replicates next, and which step is globally restorable (s*).

The invariant: at every moment there is a step s* such that, after the loss of any single
host (or of any set of hosts the placement survives), every rank can restore s* from a
copy that is still in memory: one of its own host's two slots keeps s*, and every holder
of the rank keeps its replica of s*. Neither is overwritten until a newer step is
complete in the same sense (``SlotOwner.pin``: one replica slot keeps s* while the other
takes the next step; ``SlotOwner.pin_own``: the worker's saves skip the slot holding s*
and the one being pushed).

Replication moves in lock step, one *target* at a time, all hosts on the same step:

1. The leader (node 0 of the round) publishes a :class:`Plan`: s* and the next target T,
   a step still in the future for every host (``margin`` steps past the newest it saw;
   with ``--replicate-every N``, the next multiple of N).
2. Every host, once its workers commit the first step >= T, pushes it from the slot
   that holds it (pinned meanwhile) to the rank's holders (each push tells the holder s*, so
   that it keeps s* and overwrites the older slot), then publishes a :class:`Done`.
3. When every host has replicated the same step, that step is the new s*, and the
   leader plans the next target. A host that could not catch the step (its workers
   overwrote it first, or its ranks caught different steps) reports a miss; the
   leader then plans a new target further ahead.

``every`` (k) is ``--replicate-every`` or, by default, measured: the number of iterations
one replication takes. A new target is planned as soon as the last one is agreed, so
targets are about k + margin steps apart, and s* is never more than about 2k + margin
steps behind the newest step (k + margin while the next target is trained towards, k
while it is replicated). The margin is at least k (by default): a save that comes while
a target is replicated is skipped (both of its worker's slots are pinned), so that happens
to at most about half of the saves, and the bound is about 3k. With a fixed N, targets are
multiples of N, and the bound is about 3N + margin. Every function
here is pure: the replication service reads and writes the store and the slots.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

MARGIN_SECONDS = 0.25
"""How far in the future a target is placed: time for every host to read the plan."""
MIN_MARGIN, MAX_MARGIN = 1, 256
MAX_EVERY = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The replication state of one rendezvous round, as the leader publishes it."""

    round: str
    """Identifies the round; records of other rounds are ignored."""
    sstar: int
    """The globally restorable step (-1: none yet in this round)."""
    target: int
    """Replicate the first committed step >= this."""
    every: int
    """k: the iterations one replication takes, or ``--replicate-every`` N (then targets
    are multiples of N)."""
    margin: int
    """Steps between the newest step the leader saw and the target."""
    lag_steps: int = 0
    """Steps between the newest committed step and s*, when the plan was made."""
    lag_seconds: float = 0.0
    """The same in seconds (``lag_steps`` iterations)."""
    seconds: float = 0.0
    """How long the last replication took (the slowest host), in seconds."""
    checked: int = 0
    """Targets of this round whose replicas were compared (see :func:`disagreement`)."""
    diverged: dict[str, Any] | None = None
    """The disagreement of this round since s* last moved: ``step`` (the first target
    whose replicas differed), ``agreed`` (s*, the newest step they agreed on), ``ranks``,
    ``nodes``, ``hosts`` and ``odd`` (the ranks a majority outvotes; empty with two
    replicas). It stays while they go on differing."""

    def dumps(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def loads(cls, data: bytes | None) -> Plan | None:
        fields = _load(data)
        return None if fields is None else _build(cls, fields)


@dataclass(frozen=True, kw_only=True)
class Done:
    """One host's report on a target."""

    round: str
    target: int
    """The target it answers."""
    step: int
    """The step it replicated to every holder, or -1: it missed the target."""
    newest: int
    """The newest step its workers had committed."""
    seconds: float
    """From the plan to the last holder's acknowledgement."""
    host: str = ""
    """The host that answers."""
    agree: dict[str, list[str]] = field(default_factory=dict)
    """Per rank, the ``[key, digest]`` of its replicated state at ``step`` (the slot
    metadata's ``agree``): ranks with the same key must have the same digest."""

    def dumps(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def loads(cls, data: bytes | None) -> Done | None:
        fields = _load(data)
        return None if fields is None else _build(cls, fields)


_T = TypeVar("_T")


def _load(data: bytes | None) -> dict[str, Any] | None:
    """The fields of a record, or None for a missing or unreadable one."""
    if not data:
        return None
    try:
        fields = json.loads(data)
    except ValueError:
        return None
    return fields if isinstance(fields, dict) else None


def _build(cls: type[_T], fields: dict[str, Any]) -> _T | None:
    try:
        return cls(**fields)
    except TypeError:  # written by another version
        return None


def target_after(newest: int, every: int, margin: int) -> int:
    """The smallest multiple of ``every`` that is at least ``margin`` steps past ``newest``."""
    low = max(0, newest + margin)
    return -(-low // every) * every


def margin_for(interval: float | None) -> int:
    """Steps that take at least :data:`MARGIN_SECONDS` (at least :data:`MIN_MARGIN`)."""
    if not interval or interval <= 0:
        return MIN_MARGIN
    return min(MAX_MARGIN, max(MIN_MARGIN, math.ceil(MARGIN_SECONDS / interval)))


def every_for(seconds: float, interval: float | None, fixed: int) -> int:
    """k: ``fixed`` when the user set it, else the iterations one replication takes."""
    if fixed > 0:
        return fixed
    if not interval or interval <= 0:
        return 1
    return min(MAX_EVERY, max(1, math.ceil(seconds / interval)))


def first_plan(round_id: str, *, newest: int, interval: float | None, fixed_every: int) -> Plan:
    """The plan a round starts with: no s* yet, the first target ``margin`` steps ahead."""
    every = every_for(0.0, interval, fixed_every)
    margin = margin_for(interval)
    return Plan(round=round_id, sstar=-1, target=target_after(newest, fixed_every or 1, margin),
                every=every, margin=margin)


def advance(plan: Plan, dones: Mapping[int, Done], *, nodes: int, newest: int,
            interval: float | None, fixed_every: int) -> Plan | None:
    """The leader's next plan once every node of the round answered ``plan``'s target, or
    None while some have not. ``newest`` is the newest step the leader's workers
    committed, ``interval`` the measured seconds per iteration."""
    answers = [d for n in range(nodes) if (d := dones.get(n)) is not None
               and d.round == plan.round and d.target == plan.target]
    if len(answers) < nodes:
        return None
    newest = max([newest, *(d.newest for d in answers)])
    seconds = max(d.seconds for d in answers)
    steps = {d.step for d in answers}
    checked, diverged = plan.checked, plan.diverged
    current = {n: d for n, d in dones.items() if d in answers}
    differ = disagreement(current, current) if len(steps) == 1 and min(steps) >= 0 else None
    if differ is not None:  # s* stays on the newest step the replicas agreed on
        sstar, every, margin = plan.sstar, plan.every, plan.margin
        if diverged is None or diverged.get("agreed") != plan.sstar:  # a new divergence
            diverged = {"step": min(steps), "agreed": plan.sstar, **differ}
        newest = max(newest, *steps)
    elif len(steps) == 1 and min(steps) >= 0:
        sstar = steps.pop()
        checked += any(len(d.agree) for d in answers) and len(answers) > 1
        every = every_for(seconds, interval, fixed_every)
        # At least k steps between a step's s* and the next target: a replication keeps
        # both of a worker's slots (skipping its saves) for at most half of them.
        margin = margin_for(interval) if fixed_every else min(
            MAX_MARGIN, max(margin_for(interval), every))
    else:  # a miss: try again further ahead
        sstar, every = plan.sstar, plan.every
        margin = min(MAX_MARGIN, plan.margin * 2)
        newest = max(newest, *steps)
    lag = max(0, newest - sstar) if sstar >= 0 else 0
    return Plan(round=plan.round, sstar=sstar, target=target_after(max(newest, sstar),
                                                                   fixed_every or 1, margin),
                every=every, margin=margin, lag_steps=lag,
                lag_seconds=round(lag * (interval or 0.0), 3), seconds=round(seconds, 3),
                checked=checked, diverged=diverged)


def disagreement(dones: Mapping[int, Done], nodes: Iterable[int]) -> dict[str, Any] | None:
    """Whether the replicas of one step disagree: the ranks whose replicated state has
    the same key (the same share of the same tensors) must have the same digest, on
    whichever node they are. None when they agree (or nothing can be compared); else the
    ranks, nodes and hosts of each key that differs, and ``odd``: the ranks outvoted by a
    strict majority of the same key (none with two replicas: either may be wrong)."""
    by_key: dict[str, dict[int, tuple[int, str]]] = {}
    for node in nodes:
        done = dones.get(node)
        for rank, record in (done.agree if done is not None else {}).items():
            if rank.isdigit() and isinstance(record, list) and len(record) == 2:
                by_key.setdefault(str(record[0]), {})[int(rank)] = (node, str(record[1]))
    ranks: set[int] = set()
    odd: set[int] = set()
    for members in by_key.values():
        votes = Counter(digest for _, digest in members.values())
        if len(votes) < 2:
            continue
        ranks |= set(members)
        top, count = votes.most_common(1)[0]
        if 2 * count > len(members):
            odd |= {rank for rank, (_, digest) in members.items() if digest != top}
    if not ranks:
        return None
    where = {rank: node for members in by_key.values() for rank, (node, _) in members.items()}
    nodes_of = sorted({where[rank] for rank in ranks})
    return {"ranks": sorted(ranks), "odd": sorted(odd), "nodes": nodes_of,
            "hosts": sorted({dones[n].host for n in nodes_of if dones[n].host})}
