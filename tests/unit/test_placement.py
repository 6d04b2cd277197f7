"""Replica placement (GEMINI §4), the recovery probability, and the sizes ``gemini plan``
reads. The ``gemini plan`` command itself is tested in tests/integration/test_placement.py."""

from __future__ import annotations

from fractions import Fraction
from itertools import combinations
from math import comb

import pytest

from launcher.errors import ConfigError
from launcher.replication.placement import Placement, memory_per_host, plan, recovery_probability

SIZES = [(n, m) for n in range(1, 13) for m in range(1, n + 2)]


@pytest.mark.parametrize("nodes,replicas,kind,groups", [
    (1, 1, "none", ((0,),)),
    (1, 3, "none", ((0,),)),
    (4, 1, "none", ((0,), (1,), (2,), (3,))),
    (4, 2, "group", ((0, 1), (2, 3))),
    (6, 3, "group", ((0, 1, 2), (3, 4, 5))),
    (16, 4, "group", ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15))),
    (2, 2, "group", ((0, 1),)),
    (3, 2, "mixed", ((0, 1, 2),)),
    (5, 2, "mixed", ((0, 1), (2, 3, 4))),
    (7, 3, "mixed", ((0, 1, 2), (3, 4, 5, 6))),
    (8, 3, "mixed", ((0, 1, 2), (3, 4, 5, 6, 7))),
    (11, 4, "mixed", ((0, 1, 2, 3), (4, 5, 6, 7, 8, 9, 10))),
    (3, 3, "group", ((0, 1, 2),)),
    (3, 7, "group", ((0, 1, 2),)),
])
def test_plan_groups(nodes: int, replicas: int, kind: str, groups: tuple[tuple[int, ...], ...]) -> None:
    placement = plan(nodes, replicas)
    assert placement.kind == kind
    assert placement.groups == groups
    assert placement.nodes == nodes
    assert placement.replicas == (1 if kind == "none" else min(replicas, nodes))


def test_mixed_placement_rings_only_the_last_group() -> None:
    placement = plan(11, 4)
    assert [placement.group_kind(i) for i in range(2)] == ["group", "ring"]
    # ring inside the last group: the next m-1 = 3 nodes in ring order
    assert placement.holders(4) == (5, 6, 7)
    assert placement.holders(9) == (10, 4, 5)
    assert placement.kept_by(4) == (10, 9, 8)
    # group placement: the rest of the group, starting after the node
    assert placement.holders(2) == (3, 0, 1)
    assert plan(7, 3).group_kind(1) == "ring" and plan(6, 3).group_kind(1) == "group"


def test_replicas_at_least_nodes_means_everyone_keeps_everyone() -> None:
    placement = plan(3, 5)
    assert placement.replicas == 3
    assert {n: set(placement.holders(n)) for n in range(3)} == {0: {1, 2}, 1: {0, 2}, 2: {0, 1}}


def test_no_replicas_has_no_peers() -> None:
    placement = plan(4, 1)
    assert all(placement.holders(n) == () == placement.kept_by(n) for n in range(4))
    assert placement.survives([]) and not placement.survives([2])


@pytest.mark.parametrize("nodes,replicas", SIZES)
def test_holders_and_kept_by_are_inverse(nodes: int, replicas: int) -> None:
    placement = plan(nodes, replicas)
    m = placement.replicas
    for node in range(nodes):
        holders = placement.holders(node)
        assert len(holders) == len(set(holders)) == m - 1
        assert node not in holders
        assert all(placement.group_of(h) == placement.group_of(node) for h in holders)
        assert len(placement.kept_by(node)) == m - 1  # every node keeps m-1 others: balanced memory
        assert set(placement.kept_by(node)) == {o for o in range(nodes) if node in placement.holders(o)}


@pytest.mark.parametrize("nodes,replicas", [(0, 2), (-3, 2), (4, 0), (4, -1)])
def test_plan_rejects_bad_sizes(nodes: int, replicas: int) -> None:
    with pytest.raises(ConfigError, match="must be at least 1"):
        plan(nodes, replicas)


def test_placement_validates_direct_construction() -> None:
    with pytest.raises(ConfigError, match="partition"):
        Placement(nodes=3, replicas=2, kind="group", groups=((0, 1),))
    with pytest.raises(ConfigError, match="kind"):
        Placement(nodes=4, replicas=2, kind="mixed", groups=((0, 1), (2, 3)))
    with pytest.raises(ConfigError, match="at least replicas"):
        Placement(nodes=3, replicas=2, kind="mixed", groups=((0,), (1, 2)))
    with pytest.raises(ValueError, match="not in 0..3"):
        plan(4, 2).holders(4)
    with pytest.raises(ValueError):
        plan(4, 2).survives([-1])


def test_survives() -> None:
    group = plan(6, 2)
    assert group.survives([0, 2, 4])
    assert not group.survives([2, 3])
    ring = plan(7, 3)  # (0,1,2) group, (3,4,5,6) ring
    assert ring.survives([0, 1, 3, 5])
    assert not ring.survives([5, 6, 3])  # three consecutive around the ring
    assert not ring.survives([6, 3, 4])  # 6 is held by 3 and 4: the run wraps around
    assert ring.survives([3, 4, 0, 1])  # two adjacent in the ring, two in the group
    assert not ring.survives([0, 1, 2])


def test_paper_figures() -> None:
    assert recovery_probability(16, 2, 2) == Fraction(14, 15)
    assert recovery_probability(16, 2, 3) == Fraction(4, 5)
    assert f"{float(recovery_probability(16, 2, 2)) * 100:.1f}" == "93.3"
    assert f"{float(recovery_probability(16, 2, 3)) * 100:.1f}" == "80.0"


def _design_formula(nodes: int, m: int, k: int) -> Fraction:
    """DESIGN.md: Σ_j (−1)^j C(G,j) C(N−jm, k−jm) / C(N,k) for group placement."""
    groups = nodes // m
    good = sum((-1) ** j * comb(groups, j) * comb(nodes - j * m, k - j * m)
               for j in range(groups + 1) if k - j * m >= 0)
    return Fraction(good, comb(nodes, k))


@pytest.mark.parametrize("nodes,m", [(4, 2), (8, 2), (16, 2), (9, 3), (12, 4), (30, 5)])
def test_group_placement_matches_design_formula(nodes: int, m: int) -> None:
    for k in range(nodes + 1):
        assert recovery_probability(nodes, m, k) == _design_formula(nodes, m, k), k


@pytest.mark.parametrize("nodes,replicas", [(n, m) for n, m in SIZES if n <= 11])
def test_recovery_probability_matches_brute_force(nodes: int, replicas: int) -> None:
    placement = plan(nodes, replicas)
    for k in range(nodes + 1):
        subsets = list(combinations(range(nodes), k))
        expected = Fraction(sum(placement.survives(s) for s in subsets), len(subsets))
        assert recovery_probability(nodes, replicas, k) == expected, (k, placement)


def test_recovery_probability_edges() -> None:
    assert recovery_probability(8, 2, 0) == 1
    assert recovery_probability(8, 2, 8) == 0
    assert recovery_probability(8, 2, 20) == 0
    assert recovery_probability(8, 1, 1) == 0
    assert recovery_probability(1, 2, 1) == 0
    assert recovery_probability(5, 9, 4) == 1  # everyone keeps everyone: one survivor is enough
    with pytest.raises(ConfigError, match="failures"):
        recovery_probability(8, 2, -1)
    with pytest.raises(ConfigError):
        recovery_probability(0, 2, 1)


def test_recovery_probability_scales() -> None:
    # a large mixed placement with a big ring group stays exact and quick
    p = recovery_probability(1003, 5, 40)
    assert 0 < p < 1
    assert recovery_probability(1003, 5, 1) == 1


def test_memory_per_host() -> None:
    gib = 1 << 30
    assert memory_per_host(gib, 2) == 4 * gib  # 2 own slots + 2 of one peer's
    assert memory_per_host(gib, 3) == 6 * gib
    assert memory_per_host(100, 1) == 200  # no peers: the double buffer only
    assert memory_per_host(0, 4) == 0
    with pytest.raises(ConfigError):
        memory_per_host(-1, 2)
    with pytest.raises(ConfigError):
        memory_per_host(1, 0)


def test_parse_size() -> None:
    from gemini_cli.plan import parse_size

    assert parse_size("1048576") == 1 << 20
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4 kb") == 4000 and parse_size("3G") == 3 << 30 and parse_size("7B") == 7
    for bad in ("bogus", "", "-1", "1.2.3", "5 parsecs", "GiB"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)
