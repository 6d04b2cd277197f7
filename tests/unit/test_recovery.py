"""Which step to restore and from where: pure decisions over every tier."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import pytest

from launcher.events import EventLog, read_events
from launcher.recovery import (
    HoldingsReport,
    ReportRefused,
    RestorePlan,
    Source,
    Tier,
    choose_plan,
    choose_step,
    gather_sources,
    plan_resharded,
    plan_resized,
    plan_restore,
)
from launcher.tiers import read_holdings

MEMORY, PERSIST = Source(Tier.MEMORY), Source(Tier.PERSIST)
Report = HoldingsReport


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
        0: Report(local={0: [9, 10], 1: [9, 10]}, replicas={2: [8, 9], 3: [8, 9]}),
        1: Report(replicas={0: [8, 9], 1: [8, 9]}),
    }
    plan = plan_restore(gather_sources(reports), 4)
    assert plan.step == 9
    assert plan.sources[0] == [MEMORY, peer(1)]
    assert plan.sources[2] == [peer(0)]


def test_a_lost_group_falls_back_to_the_persistent_tier() -> None:
    reports = {
        0: Report(local={0: [20, 21]}, persist={0: [10, 15]}),
        1: Report(persist={1: [10, 15]}),
    }
    plan = plan_restore(gather_sources(reports), 2)
    assert plan == RestorePlan(15, {0: [PERSIST], 1: [PERSIST]})


def test_faster_tiers_first_and_nothing_common_means_a_fresh_start() -> None:
    reports = {
        2: Report(local={0: [5]}, replicas={1: [5]}, persist={0: [5]}),
        1: Report(replicas={0: [5]}),
    }
    assert plan_restore(gather_sources(reports), 1).sources[0] == [MEMORY, peer(1), PERSIST]
    assert plan_restore(gather_sources(reports), 2).sources[1] == [peer(2)]
    assert plan_restore(gather_sources({1: Report(replicas={0: [5]})}), 2) == RestorePlan(None)
    assert plan_restore({}, 1) == RestorePlan(None)


def test_the_copy_a_host_keeps_of_its_own_rank_is_memory() -> None:
    """Replication keeps a copy of each rank it sends in its host's replica slots; after a
    peer's loss the host resumes its own rank from that copy (memory), not the network."""
    reports = {
        0: Report(local={0: [20, 21]}, replicas={0: [18], 1: [18]}),
        1: Report(local={1: [19]}),  # a replacement: its own copy is gone
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
    reports = {
        0: Report(ranks=[0], resizable={3: {0: [7, 8]}}),
        1: Report(ranks=[1], resizable={3: {2: [7, 8], 1: [7]}}),
    }
    plan = plan_resized(reports, 2)
    assert plan.step == 7 and plan.world_size == 3 and plan.origin == {0: 0, 1: 1}
    assert plan.sources == {0: [MEMORY], 1: [MEMORY]}
    grown = plan_resized({0: Report(ranks=[0], resizable={2: {0: [9]}}),
                          1: Report(ranks=[1], resizable={2: {1: [9]}}),
                          2: Report(ranks=[2])}, 3)
    assert grown.step == 9 and grown.origin == {0: 0, 1: 1, 2: 0}
    assert grown.sources[2] == [peer(0)]
    assert plan_resized({0: Report(ranks=[0], resizable={2: {0: [4]}})}, 2).step is None
    assert plan_resized({0: Report(ranks=[0], resizable={3: {1: [4]}})}, 2).step is None


def test_a_sharded_state_is_resharded_from_every_old_rank() -> None:
    """Four old ranks of a sharded state, spread over two survivors (own slots and
    replicas): every host plans to bring in all four, from itself where it holds one,
    else from the peers that do; a step some old rank lacks everywhere is not chosen."""
    reports = {0: Report(reshardable={4: {0: [6, 8], 1: [6, 8], 2: [6], 3: [6, 8]}}),
               1: Report(reshardable={4: {2: [6, 8], 3: [8]}})}
    plan = plan_resharded(reports, 2, node=0)
    assert plan.step == 8 and plan.world_size == 4 and plan.reshard
    assert plan.sources == {0: [MEMORY], 1: [MEMORY], 2: [peer(1)], 3: [MEMORY]}
    other = plan_resharded(reports, 2, node=1)
    assert other.step == 8 and other.sources[0] == [peer(0)]
    assert other.sources[3] == [MEMORY]
    reports[1] = Report(reshardable={4: {3: [8]}})
    assert plan_resharded(reports, 2, node=0).step == 6
    assert plan_resharded({0: Report(reshardable={2: {0: [3], 1: [3]}})}, 2, 0).step is None


def test_the_newest_of_the_three_plans_wins() -> None:
    """A world of 2 on two nodes: their own slots hold step 5 of the current world; a
    copy of an earlier world of 4 at a newer step wins (whole copies of replicated state,
    or shards of sharded state), an older one does not."""
    def reports(resizable: dict[int, dict[int, list[int]]],
                reshardable: dict[int, dict[int, list[int]]]) -> dict[int, HoldingsReport]:
        return {node: Report(ranks=[node], local={node: [5]}, resizable=resizable,
                             reshardable=reshardable)
                for node in (0, 1)}

    old = {4: {rank: [7] for rank in range(4)}}
    same = choose_plan(reports({}, {}), 2, node=0)
    assert same.step == 5 and same.world_size is None and not same.reshard
    resized = choose_plan(reports(old, {}), 2, node=0)
    assert resized.step == 7 and resized.world_size == 4 and not resized.reshard
    resharded = choose_plan(reports({}, old), 2, node=1)
    assert resharded.step == 7 and resharded.world_size == 4 and resharded.reshard
    older = {4: {rank: [3] for rank in range(4)}}
    assert choose_plan(reports(older, older), 2, node=0).step == 5


def test_a_step_one_host_avoids_is_restored_by_none() -> None:
    """One host's report names step 6 to avoid (its workers failed right after restoring
    it): every host's plan takes the next older step, in every tier and world size."""
    reports = {
        node: Report(ranks=[node], local={node: [5, 6]}, replicas={1 - node: [6]},
                     persist={node: [4, 6]}, resizable={4: {r: [6] for r in range(4)}})
        for node in (0, 1)}
    assert choose_plan(reports, 2, node=0).step == 6
    reports[1] = replace(reports[1], avoid=[6])
    for node in (0, 1):
        plan = choose_plan(reports, 2, node=node)
        assert plan.step == 5 and plan.world_size is None
    # node 0 has nothing older in memory: the files
    reports[0] = replace(reports[0], local={0: [6]})
    assert choose_plan(reports, 2, node=0).step == 4


def test_a_ceiling_rolls_every_host_back() -> None:
    """After the replicas disagreed, one host's report sets a ceiling (the newest step
    they agreed on): no host's plan restores a newer step; -1 means a fresh start."""
    reports = {node: Report(ranks=[node], local={node: [10, 12]}, replicas={1 - node: [10, 12]})
               for node in (0, 1)}
    assert choose_plan(reports, 2, node=0).step == 12
    reports[0] = replace(reports[0], ceiling=10)
    assert [choose_plan(reports, 2, node=n).step for n in (0, 1)] == [10, 10]
    reports[1] = replace(reports[1], ceiling=-1)
    assert choose_plan(reports, 2, node=1).step is None
    reports = {node: replace(report, ceiling=None) for node, report in reports.items()}
    assert choose_plan(reports, 2, node=1).step == 12


FULL = Report(local={0: [9, 10], 1: [10]}, replicas={2: [8, 9]}, persist={0: [5]},
              address=("10.0.0.7", 29600), ranks=[0, 1], avoid=[11], ceiling=-1,
              resizable={4: {3: [7]}}, reshardable={8: {6: [6, 7], 7: [7]}})


def test_a_report_comes_back_from_json_with_ints() -> None:
    """JSON keys are strings: what the store holds names ranks and world sizes as
    digits, and every host reads them back as the ints the writer had."""
    written = json.loads(FULL.dumps())
    assert written["version"] == HoldingsReport.VERSION == 1
    assert written["local"] == {"0": [9, 10], "1": [10]}
    assert written["reshardable"] == {"8": {"6": [6, 7], "7": [7]}}
    read = HoldingsReport.loads(FULL.dumps().encode())  # as a store's get returns it
    assert read == FULL and read.address == ("10.0.0.7", 29600)
    assert list(read.resizable) == [4] and list(read.resizable[4]) == [3]
    assert HoldingsReport.loads(Report().dumps()) == Report()


def _written(**changes: object) -> str:
    """FULL as written, with ``changes`` to its JSON fields (None values are removed)."""
    fields = json.loads(FULL.dumps())
    fields.update(changes)
    return json.dumps({k: v for k, v in fields.items() if v is not None or k == "ceiling"})


@pytest.mark.parametrize(("changes", "why"), [
    ({"version": 2}, "version 2; this host reads version 1"),
    ({"version": "1"}, "version '1'"),
    ({"version": None}, "version None"),
    ({"version": True}, "version True"),
])
def test_a_report_of_another_version_is_refused(changes: dict[str, object], why: str) -> None:
    with pytest.raises(ReportRefused, match=re.escape(why)):
        HoldingsReport.loads(_written(**changes))


@pytest.mark.parametrize(("data", "why"), [
    (_written(local={"0": ["9"]}), "'local' is malformed: a str where an integer belongs"),
    (_written(replicas={"0": [True]}), "'replicas' is malformed: a bool"),
    (_written(persist={"rank0": [5]}), "'persist' is malformed: the key 'rank0'"),
    (_written(persist={"01": [5]}), "'persist' is malformed: the key '01'"),
    (_written(resizable={"4": [7]}), "'resizable' is malformed: a list where an object"),
    (_written(ranks={"0": 1}), "'ranks' is malformed: a dict where a list"),
    (_written(address=["h", "29600"]), "'address' is malformed: a str where an integer"),
    (_written(address="h:29600"), "'address' is malformed: not null or"),
    (_written(ceiling=-2), "'ceiling' is malformed: -2 is below -1"),
    (_written(ceiling=3.0), "'ceiling' is malformed: a float"),
    (_written(avoid=None), "lacks 'avoid'"),
    (_written(extra=1), "unknown field"),
    ("[1, 2]", "a list, not an object"),
    ("{", "not JSON"),
    (b"\xff", "not JSON"),
    ("[" * 100_000 + "]" * 100_000, "not JSON"),
])
def test_a_malformed_report_is_refused(data: str | bytes, why: str) -> None:
    with pytest.raises(ReportRefused, match=re.escape(why)):
        HoldingsReport.loads(data)


class _Store:
    """The round's store as :func:`read_holdings` reads it: written values by key."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, key: str) -> bytes:
        return self.values[key].encode()


def test_a_refused_report_holds_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A peer's report that does not parse is left out of the round (a warning and a
    ``holdings_refused`` event), not read in part: its node holds nothing, and the plan
    restores its rank from the copies the other nodes keep."""
    good = {node: Report(ranks=[node], local={node: [4, 6]}, replicas={1 - node: [4]},
                         address=("h", 29600 + node)) for node in (0, 1)}
    store = _Store({"holdings/0": good[0].dumps(),
                    "holdings/1": good[1].dumps().replace('"version": 1', '"version": 2')})
    events = EventLog(tmp_path / "run", host="h0")
    with caplog.at_level(logging.WARNING, logger="launcher.tiers"):
        reports = read_holdings(store, 2, events)  # type: ignore[arg-type]
    assert reports == {0: good[0]}
    assert "node 1's holdings report is refused" in caplog.text
    refused = [e for e in read_events(tmp_path / "run") if e["event"] == "holdings_refused"]
    assert [e["node"] for e in refused] == [1] and "version 2" in refused[0]["why"]
    assert choose_plan(reports, 2, node=0) == RestorePlan(4, {0: [MEMORY], 1: [peer(0)]})
    store.values["holdings/1"] = good[1].dumps()
    assert read_holdings(store, 2, events) == good  # type: ignore[arg-type]
    events.close()
    assert choose_plan(good, 2, node=0) == RestorePlan(6, {0: [MEMORY], 1: [MEMORY]})


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
