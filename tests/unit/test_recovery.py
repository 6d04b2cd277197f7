"""Which step to restore and from where: pure decisions over every tier."""

from __future__ import annotations

from launcher.recovery import RestorePlan, Source, Tier, choose_step, gather_sources, plan_restore

MEMORY, PERSIST = Source(Tier.MEMORY), Source(Tier.PERSIST)


def peer(node: int) -> Source:
    return Source(Tier.PEER, node)


def test_choose_step() -> None:
    assert choose_step({0: [3, 4], 1: [4, 5]}, 2) == 4
    assert choose_step({0: [3, 4], 1: [5]}, 2) is None
    assert choose_step({0: [3, 4]}, 2) is None
    assert choose_step({}, 1) is None
    assert choose_step({0: [7, 2], 1: [2, 7], 2: [7]}, 3) == 7


def test_a_lost_host_comes_back_from_a_peer_at_the_newest_common_step() -> None:
    # node 0 runs ranks 0-1 and keeps node 1's replicas; node 1 (ranks 2-3) was replaced
    reports = {
        0: {"local": {"0": [9, 10], "1": [9, 10]}, "replicas": {"2": [8, 9], "3": [8, 9]}},
        1: {"local": {}, "replicas": {"0": [8, 9], "1": [8, 9]}},
    }
    plan = plan_restore(gather_sources(reports), 4)
    assert plan.step == 9
    assert plan.sources[0] == [MEMORY, peer(1)]
    assert plan.sources[2] == [peer(0)]


def test_a_lost_group_falls_back_to_the_persistent_tier() -> None:
    reports = {
        0: {"local": {"0": [20, 21]}, "replicas": {}, "persist": {"0": [10, 15]}},
        1: {"local": {}, "replicas": {}, "persist": {"1": [10, 15]}},
    }
    plan = plan_restore(gather_sources(reports), 2)
    assert plan == RestorePlan(15, {0: [PERSIST], 1: [PERSIST]})


def test_faster_tiers_first_and_nothing_common_means_a_fresh_start() -> None:
    reports = {
        2: {"local": {"0": [5]}, "replicas": {"1": [5]}, "persist": {"0": [5]}},
        1: {"replicas": {"0": [5]}},
    }
    assert plan_restore(gather_sources(reports), 1).sources[0] == [MEMORY, peer(1), PERSIST]
    assert plan_restore(gather_sources(reports), 2).sources[1] == [peer(2)]
    assert plan_restore(gather_sources({1: {"replicas": {"0": [5]}}}), 2) == RestorePlan(None)
    assert plan_restore({}, 1) == RestorePlan(None)


def test_the_copy_a_host_keeps_of_its_own_rank_is_memory() -> None:
    """Replication keeps a copy of each rank it sends in its host's replica slots; after a
    peer's loss the host resumes its own rank from that copy (memory), not the network."""
    reports = {
        0: {"local": {"0": [20, 21]}, "replicas": {"0": [18], "1": [18]}},
        1: {"local": {"1": [19]}, "replicas": {}},  # a replacement: its own copy is gone
    }
    plan = plan_restore(gather_sources(reports), 2)
    assert plan == RestorePlan(18, {0: [MEMORY], 1: [peer(0)]})


def test_a_job_that_shrank_or_grew_restores_whole_copies() -> None:
    """Three nodes of one rank each ran a world of 3; node 1 is lost and the survivors
    (now ranks 0 and 1: node 2 took slot 1) form a world of 2. Rank 1 restores old rank
    1's copy, a replica node 2 keeps (MEMORY there), rank 0 its own. When a third node
    joins again (world 3 from a world of 2), rank 2 takes old rank 0's copy from a peer.
    Steps not complete for the ranks a world needs are skipped; a world of the same size
    is not a resize."""
    from launcher.recovery import Source, Tier, plan_resized

    reports = {
        0: {"ranks": [0], "resizable": {"3": {"0": [7, 8]}}},
        1: {"ranks": [1], "resizable": {"3": {"2": [7, 8], "1": [7]}}},
    }
    plan = plan_resized(reports, 2)
    assert plan.step == 7 and plan.world_size == 3 and plan.origin == {0: 0, 1: 1}
    assert plan.sources == {0: [Source(Tier.MEMORY)], 1: [Source(Tier.MEMORY)]}
    grown = plan_resized({0: {"ranks": [0], "resizable": {"2": {"0": [9]}}},
                          1: {"ranks": [1], "resizable": {"2": {"1": [9]}}},
                          2: {"ranks": [2], "resizable": {}}}, 3)
    assert grown.step == 9 and grown.origin == {0: 0, 1: 1, 2: 0}
    assert grown.sources[2] == [Source(Tier.PEER, 0)]
    assert plan_resized({0: {"ranks": [0], "resizable": {"2": {"0": [4]}}}}, 2).step is None
    assert plan_resized({0: {"ranks": [0], "resizable": {"3": {"1": [4]}}}}, 2).step is None


def test_a_sharded_state_is_resharded_from_every_old_rank() -> None:
    """Four old ranks of a sharded state, spread over two survivors (own slots and
    replicas): every host plans to bring in all four, from itself where it holds one,
    else from the peers that do; a step some old rank lacks everywhere is not chosen."""
    from launcher.recovery import Source, Tier, plan_resharded

    reports = {0: {"reshardable": {"4": {"0": [6, 8], "1": [6, 8], "2": [6], "3": [6, 8]}}},
               1: {"reshardable": {"4": {"2": [6, 8], "3": [8]}}}}
    plan = plan_resharded(reports, 2, node=0)
    assert plan.step == 8 and plan.world_size == 4 and plan.reshard
    assert plan.sources == {0: [Source(Tier.MEMORY)], 1: [Source(Tier.MEMORY)],
                            2: [Source(Tier.PEER, 1)], 3: [Source(Tier.MEMORY)]}
    other = plan_resharded(reports, 2, node=1)
    assert other.step == 8 and other.sources[0] == [Source(Tier.PEER, 0)]
    assert other.sources[3] == [Source(Tier.MEMORY)]
    del reports[1]["reshardable"]["4"]["2"]
    assert plan_resharded(reports, 2, node=0).step == 6
    assert plan_resharded({0: {"reshardable": {"2": {"0": [3], "1": [3]}}}}, 2, 0).step is None


def test_the_newest_of_the_three_plans_wins() -> None:
    """A world of 2 on two nodes: their own slots hold step 5 of the current world; a
    copy of an earlier world of 4 at a newer step wins (whole copies of replicated state,
    or shards of sharded state), an older one does not."""
    from launcher.recovery import choose_plan

    def reports(resizable: dict[str, dict[str, list[int]]],
                reshardable: dict[str, dict[str, list[int]]]) -> dict[int, dict[str, object]]:
        return {node: {"ranks": [node], "local": {str(node): [5]}, "replicas": {},
                       "persist": {}, "resizable": resizable, "reshardable": reshardable}
                for node in (0, 1)}

    old = {"4": {str(rank): [7] for rank in range(4)}}
    same = choose_plan(reports({}, {}), 2, node=0)
    assert same.step == 5 and same.world_size is None and not same.reshard
    resized = choose_plan(reports(old, {}), 2, node=0)
    assert resized.step == 7 and resized.world_size == 4 and not resized.reshard
    resharded = choose_plan(reports({}, old), 2, node=1)
    assert resharded.step == 7 and resharded.world_size == 4 and resharded.reshard
    older = {"4": {str(rank): [3] for rank in range(4)}}
    assert choose_plan(reports(older, older), 2, node=0).step == 5


def test_a_step_one_host_avoids_is_restored_by_none() -> None:
    """One host's report names step 6 to avoid (its workers failed right after restoring
    it): every host's plan takes the next older step, in every tier and world size."""
    from launcher.recovery import choose_plan

    reports: dict[int, dict[str, object]] = {
        node: {"ranks": [node], "local": {str(node): [5, 6]}, "replicas": {str(1 - node): [6]},
               "persist": {str(node): [4, 6]}, "resizable": {"4": {str(r): [6] for r in range(4)}},
               "reshardable": {}}
        for node in (0, 1)}
    assert choose_plan(reports, 2, node=0).step == 6
    reports[1]["avoid"] = [6]
    for node in (0, 1):
        plan = choose_plan(reports, 2, node=node)
        assert plan.step == 5 and plan.world_size is None
    reports[0]["local"] = {"0": [6]}  # node 0 has nothing older in memory: the files
    assert choose_plan(reports, 2, node=0).step == 4


def test_a_ceiling_rolls_every_host_back() -> None:
    """After the replicas disagreed, one host's report sets a ceiling (the newest step
    they agreed on): no host's plan restores a newer step; -1 means a fresh start."""
    from launcher.recovery import choose_plan

    reports: dict[int, dict[str, object]] = {
        node: {"ranks": [node], "local": {str(node): [10, 12]},
               "replicas": {str(1 - node): [10, 12]}, "persist": {}, "resizable": {},
               "reshardable": {}}
        for node in (0, 1)}
    assert choose_plan(reports, 2, node=0).step == 12
    reports[0]["ceiling"] = 10
    assert [choose_plan(reports, 2, node=n).step for n in (0, 1)] == [10, 10]
    reports[1]["ceiling"] = -1
    assert choose_plan(reports, 2, node=1).step is None
    reports[0]["ceiling"] = reports[1]["ceiling"] = None
    assert choose_plan(reports, 2, node=1).step == 12


def test_the_divergence_policy() -> None:
    """rollback asks the agent for one (a ceiling for the plans), at most max_rollbacks
    times to the same step, then stops; stop stops at once (exit 5); warn does nothing."""
    from launcher.errors import ReplicasDivergedError
    from launcher.tiers import MemoryService

    service = MemoryService.__new__(MemoryService)  # the policy alone: no slots, no server
    service.ceiling, service.rollback_to, service.fatal, service._rollbacks = None, None, None, {}
    service.on_divergence, service.max_rollbacks, service.exclude_divergent = "rollback", 2, False
    record = {"step": 14, "agreed": 10, "ranks": [0, 1]}
    for _ in range(2):
        service.diverged(record)
        assert service.rollback_to == service.ceiling == 10 and service.fatal is None
        service.rollback_to = service.ceiling = None
    service.diverged(record)
    assert isinstance(service.fatal, ReplicasDivergedError) and service.rollback_to is None
    service.fatal, service.on_divergence = None, "stop"
    service.diverged(record)
    assert isinstance(service.fatal, ReplicasDivergedError) and "stop" in str(service.fatal)
    service.fatal, service.on_divergence = None, "warn"
    service.diverged(record)
    assert service.fatal is None and service.rollback_to is None


def test_with_exclusion_the_outvoted_host_leaves_and_the_others_stop_at_the_agreed_step() -> None:
    from types import SimpleNamespace

    from launcher.errors import HostUnhealthyError
    from launcher.tiers import MemoryService

    record = {"step": 14, "agreed": 10, "ranks": [0, 1, 2], "odd": [1]}
    for ranks, leaves in ((frozenset({1}), True), (frozenset({0}), False)):
        service = MemoryService.__new__(MemoryService)
        service.ceiling, service.rollback_to, service.fatal, service._rollbacks = None, None, None, {}
        service.on_divergence, service.max_rollbacks, service.exclude_divergent = "rollback", 3, True
        service.server = SimpleNamespace(ranks=ranks)  # type: ignore[assignment]
        service.diverged(record)
        assert service.ceiling == 10 and service.rollback_to is None  # no rollback restart
        assert isinstance(service.fatal, HostUnhealthyError) is leaves
