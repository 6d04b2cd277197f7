"""Which hosts keep a replica of which host's checkpoint (GEMINI, SOSP'23, §4).

Every host owns the shards of its local ranks. With ``m`` replicas in total (the owner's
copy included) each host's shards are also kept in the CPU memory of ``m - 1`` peers:

* **group placement** (``m`` divides ``N``): the hosts form ``N / m`` groups of ``m``
  consecutive hosts and every host replicates to the other ``m - 1`` hosts of its group.
  A group loses data only when all its ``m`` hosts fail.
* **mixed placement** (otherwise): ``N // m - 1`` groups of ``m`` use group placement and
  the last group, of ``m + N % m`` hosts, uses **ring placement**: each host replicates
  to the next ``m - 1`` hosts of that group in ring order, so data is lost when ``m``
  hosts that are consecutive around that ring all fail.

Hosts are numbered ``0 .. N-1`` (the node slots of the rendezvous, i.e. group ranks).
Everything here is pure: no I/O, standard library only, so both the supervisor and
``gemini plan`` use it and it is unit-tested directly.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from fractions import Fraction
from math import comb
from typing import Literal

from launcher.errors import ConfigError

__all__ = ["Placement", "memory_per_host", "plan", "recovery_probability"]

PlacementKind = Literal["none", "group", "mixed"]
GroupKind = Literal["none", "group", "ring"]


@dataclass(frozen=True, kw_only=True)
class Placement:
    """The replica placement of ``nodes`` hosts; build it with :func:`plan`.

    A group of exactly ``replicas`` hosts uses group placement; a larger group (only the
    last group of a mixed placement) uses ring placement inside the group. In both cases
    a host's holders are the next ``replicas - 1`` hosts of its group in ring order, which
    for a group of ``replicas`` hosts is simply the rest of the group.
    """

    nodes: int
    """Number of hosts ``N``."""
    replicas: int
    """Copies of each shard in total, the owner's own included (``m``). This is the
    effective value: :func:`plan` caps it at ``nodes``."""
    kind: PlacementKind
    """``none`` (no peer copies), ``group`` (every group has ``m`` hosts) or ``mixed``
    (groups of ``m`` plus one larger, ring-placed last group)."""
    groups: tuple[tuple[int, ...], ...]
    """The groups, each a tuple of host indices in ring order; together a partition of
    ``0 .. nodes-1``."""
    _group_of: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"nodes must be at least 1, got {self.nodes}", field="nodes")
        if self.replicas < 1:
            raise ConfigError(f"replicas must be at least 1, got {self.replicas}", field="replicas")
        members = sorted(n for g in self.groups for n in g)
        if members != list(range(self.nodes)):
            raise ConfigError(f"groups {self.groups} are not a partition of nodes 0..{self.nodes - 1}")
        if any(len(g) < self.replicas for g in self.groups):
            raise ConfigError(f"every group needs at least replicas={self.replicas} nodes: {self.groups}")
        expected: PlacementKind
        if self.replicas == 1:
            expected = "none"
        elif all(len(g) == self.replicas for g in self.groups):
            expected = "group"
        else:
            expected = "mixed"
        if self.kind != expected:
            raise ConfigError(f"placement kind {self.kind!r} does not match its groups ({expected!r})")
        group_of = [0] * self.nodes
        for index, group in enumerate(self.groups):
            for node in group:
                group_of[node] = index
        object.__setattr__(self, "_group_of", tuple(group_of))

    def group_kind(self, index: int) -> GroupKind:
        """How group ``index`` places replicas: ``none``, ``group`` or ``ring``."""
        size = len(self.groups[index])
        if self.replicas == 1:
            return "none"
        return "group" if size == self.replicas else "ring"

    def group_of(self, node: int) -> int:
        """The index of the group ``node`` belongs to."""
        self._check(node)
        return self._group_of[node]

    def holders(self, node: int) -> tuple[int, ...]:
        """The other hosts that keep a replica of ``node``'s shards (``replicas - 1`` of them).

        They are the next hosts of ``node``'s group in ring order, so in group placement the
        rest of the group starting after ``node`` (the first holder differs per host, which
        spreads the load of a recovery).
        """
        group = self.groups[self.group_of(node)]
        at = group.index(node)
        return tuple(group[(at + i) % len(group)] for i in range(1, self.replicas))

    def kept_by(self, node: int) -> tuple[int, ...]:
        """The hosts whose shards ``node`` keeps: the inverse of :meth:`holders`."""
        group = self.groups[self.group_of(node)]
        at = group.index(node)
        return tuple(group[(at - i) % len(group)] for i in range(1, self.replicas))

    def survives(self, failed: Collection[int]) -> bool:
        """Whether every host's shards still have a copy on a host not in ``failed``."""
        down = set(failed)
        for node in down:
            self._check(node)
        return all(node not in down or any(h not in down for h in self.holders(node))
                   for node in range(self.nodes))

    def _check(self, node: int) -> None:
        if not 0 <= node < self.nodes:
            raise ValueError(f"node {node} is not in 0..{self.nodes - 1}")


def plan(nodes: int, replicas: int) -> Placement:
    """The placement of ``replicas`` copies of each host's shards over ``nodes`` hosts.

    * ``replicas == 1`` or ``nodes == 1``: kind ``none``, every host alone, no peers
      (the effective ``replicas`` is 1).
    * ``replicas >= nodes``: one group of all hosts; everyone keeps everyone, so the
      effective ``replicas`` is ``nodes``.
    * ``replicas`` divides ``nodes``: group placement, groups ``0..m-1``, ``m..2m-1``, ...
    * otherwise mixed placement: ``nodes // m - 1`` groups of ``m`` and a last group of
      ``m + nodes % m`` hosts with ring placement.

    Raises :class:`ConfigError` when ``nodes`` or ``replicas`` is below 1.
    """
    if nodes < 1:
        raise ConfigError(f"nodes must be at least 1, got {nodes}", field="nodes")
    if replicas < 1:
        raise ConfigError(f"replicas must be at least 1, got {replicas}", field="replicas")
    if replicas == 1 or nodes == 1:
        return Placement(nodes=nodes, replicas=1, kind="none",
                         groups=tuple((n,) for n in range(nodes)))
    m = min(replicas, nodes)
    if nodes % m == 0:
        groups = tuple(tuple(range(start, start + m)) for start in range(0, nodes, m))
        return Placement(nodes=nodes, replicas=m, kind="group", groups=groups)
    full = nodes // m - 1
    groups = tuple(tuple(range(g * m, g * m + m)) for g in range(full))
    groups += (tuple(range(full * m, nodes)),)
    return Placement(nodes=nodes, replicas=m, kind="mixed", groups=groups)


def recovery_probability(nodes: int, replicas: int, failures: int) -> Fraction:
    """The exact probability that ``failures`` simultaneous host failures, the failed set
    drawn uniformly among all sets of that size, leave every shard in memory.

    Counts the surviving ``failures``-subsets of hosts: each group contributes a polynomial
    whose coefficient ``j`` is the number of ways ``j`` of its hosts fail without losing a
    shard, and the product over groups gives the count for the whole placement. For
    group placement this equals ``Σ_j (−1)^j C(G,j) C(N−jm, k−jm) / C(N,k)``; e.g.
    ``N=16, m=2`` gives 14/15 for ``k=2`` and 4/5 for ``k=3``.

    ``failures == 0`` gives 1; ``failures >= nodes`` (every host fails) gives 0, as does
    any failure when there are no replicas. A negative ``failures`` is a :class:`ConfigError`.
    """
    if failures < 0:
        raise ConfigError(f"failures must be at least 0, got {failures}", field="failures")
    placement = plan(nodes, replicas)
    if failures >= nodes:
        return Fraction(0)
    total = [1]
    for index, group in enumerate(placement.groups):
        if placement.group_kind(index) == "ring":
            counts = _ring_counts(len(group), placement.replicas)
        else:  # a group of m hosts loses data only when all m fail
            counts = [comb(len(group), j) for j in range(len(group))] + [0]
        total = _multiply(total, counts, failures)
    surviving = total[failures] if failures < len(total) else 0
    return Fraction(surviving, comb(nodes, failures))


def host_checkpoint_bytes(rank_bytes: int, ranks_per_host: int, *, replicated: bool) -> int:
    """One host's checkpoint size from one rank's state: the ranks of a host keep one copy
    of state that every data-parallel rank holds whole (DDP; see ``Checkpointer``'s
    ``replicated``), and each its own shard of sharded state (FSDP, tensor parallelism)."""
    if rank_bytes < 0:
        raise ConfigError(f"state bytes must be at least 0, got {rank_bytes}", field="state_bytes")
    if ranks_per_host < 1:
        raise ConfigError(f"ranks per host must be at least 1, got {ranks_per_host}",
                          field="ranks_per_host")
    return rank_bytes if replicated else rank_bytes * ranks_per_host


def memory_per_host(state_bytes: int, replicas: int) -> int:
    """Bytes of CPU memory one host needs for in-memory checkpoints: ``2 * m *
    state_bytes``.

    ``state_bytes`` is one host's checkpoint size (:func:`host_checkpoint_bytes`). The host keeps its
    own checkpoint in two slots (double buffering: the newest committed step stays intact
    while the next one is written; with replication the slots also keep the globally
    restorable step s* and the step being pushed, which saves never overwrite), and for
    each of the ``m - 1`` peers whose shards it keeps, two replica slots (a torn transfer
    never replaces the last complete replica). Pass the effective ``m``
    (``Placement.replicas``).
    """
    if state_bytes < 0:
        raise ConfigError(f"state bytes must be at least 0, got {state_bytes}", field="state_bytes")
    if replicas < 1:
        raise ConfigError(f"replicas must be at least 1, got {replicas}", field="replicas")
    return 2 * replicas * state_bytes


def _multiply(a: list[int], b: list[int], degree: int) -> list[int]:
    """The product of the polynomials ``a`` and ``b`` up to ``x**degree``."""
    out = [0] * min(len(a) + len(b) - 1, degree + 1)
    for i, x in enumerate(a[: degree + 1]):
        if x:
            for j, y in enumerate(b[: degree + 1 - i]):
                out[i + j] += x * y
    return out


def _linear_counts(longest: int, m: int) -> list[list[int]]:
    """``[L_0, ..., L_longest]``: coefficient ``j`` of ``L_n`` counts the binary strings of
    length ``n`` with ``j`` ones and no run of ``m`` ones.

    ``L_0 = 1``; for ``n >= 1``, ``L_n = (1 + x) L_{n-1} - x^m L_{n-1-m}`` with
    ``L_{-1} = 1`` and ``L_n = 0`` below that: extend by a 0 or a 1, minus the strings
    that now end in exactly ``m`` ones (a 0 or the start, then ``m`` ones).
    """
    table: list[list[int]] = [[1], [1]]  # table[n + 1] is L_n
    for n in range(1, longest + 1):
        prev = table[n]
        poly = prev + [0]
        for j, c in enumerate(prev):
            poly[j + 1] += c
        if n - 1 - m >= -1:
            for j, c in enumerate(table[n - m]):
                poly[j + m] -= c
        table.append(poly)
    return table[1:]


def _ring_counts(size: int, m: int) -> list[int]:
    """Coefficient ``j``: ways ``j`` of ``size`` hosts on a ring fail with no ``m``
    consecutive ones among them (no shard lost under ring placement); needs ``size > m``.

    A failed set other than "all hosts" or "all but one" has a first and a last surviving
    host; the ``a`` failed hosts before the first and the ``b`` after the last form one run
    around the ring, so ``s = a + b < m`` (``s + 1`` ways to split it), and the hosts in
    between are a linear string without an ``m``-run. The other two cases leave a run of at
    least ``size - 1 >= m`` failed hosts, so they lose data.
    """
    linear = _linear_counts(size - 2, m)
    counts = [0] * (size + 1)
    for s in range(min(m - 1, size - 2) + 1):
        for j, count in enumerate(linear[size - 2 - s]):
            counts[j + s] += (s + 1) * count
    return counts
