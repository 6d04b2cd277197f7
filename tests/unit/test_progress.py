"""The lock step of replication (``launcher.replication.progress``): targets, s*, misses."""

from __future__ import annotations

import pytest

from launcher.replication import progress
from launcher.replication.progress import Done, Plan


def done(target: int, step: int, *, newest: int = 0, seconds: float = 0.5,
         round_id: str = "r1") -> Done:
    return Done(round=round_id, target=target, step=step, newest=newest, seconds=seconds)


@pytest.mark.parametrize(("newest", "every", "margin", "want"),
                         [(-1, 1, 2, 1), (10, 1, 2, 12), (10, 4, 2, 12), (11, 4, 2, 16),
                          (0, 5, 2, 5), (-1, 3, 2, 3)])
def test_a_target_is_a_multiple_of_every_past_the_margin(newest: int, every: int, margin: int,
                                                         want: int) -> None:
    assert progress.target_after(newest, every, margin) == want


def test_every_is_the_iterations_one_replication_takes_unless_fixed() -> None:
    assert progress.every_for(1.0, 0.3, 0) == 4
    assert progress.every_for(0.01, 0.3, 0) == 1
    assert progress.every_for(1.0, None, 0) == 1
    assert progress.every_for(1.0, 0.3, 7) == 7
    assert progress.margin_for(0.3) == progress.MIN_MARGIN
    assert progress.margin_for(0.01) == 25


def test_a_round_starts_without_sstar_and_a_target_ahead_of_the_restored_step() -> None:
    plan = progress.first_plan("r1", newest=40, interval=0.1, fixed_every=0)
    assert plan.sstar == -1 and plan.target == 40 + plan.margin and plan.every == 1
    assert progress.first_plan("r1", newest=1, interval=None, fixed_every=3).target == 3
    assert progress.first_plan("r1", newest=-1, interval=None, fixed_every=3).target == 0


def test_sstar_moves_once_every_node_replicated_the_same_step() -> None:
    plan = Plan(round="r1", sstar=10, target=14, every=2, margin=2)
    assert progress.advance(plan, {0: done(14, 14)}, nodes=2, newest=15, interval=0.1,
                            fixed_every=2) is None  # node 1 has not answered
    stale = {0: done(14, 14), 1: done(12, 12)}  # node 1's answer is for an older target
    assert progress.advance(plan, stale, nodes=2, newest=15, interval=0.1, fixed_every=2) is None
    other = {0: done(14, 14), 1: done(14, 14, round_id="r0")}
    assert progress.advance(plan, other, nodes=2, newest=15, interval=0.1, fixed_every=2) is None
    nxt = progress.advance(plan, {0: done(14, 14, newest=16), 1: done(14, 14, newest=17)},
                           nodes=2, newest=15, interval=0.1, fixed_every=2)
    assert nxt is not None
    assert (nxt.sstar, nxt.every, nxt.lag_steps) == (14, 2, 3)
    assert nxt.target >= 17 + nxt.margin and nxt.target % 2 == 0
    assert nxt.lag_seconds == pytest.approx(0.3)


def test_a_miss_keeps_sstar_and_plans_further_ahead() -> None:
    plan = Plan(round="r1", sstar=10, target=14, every=1, margin=2)
    answers = {0: done(14, 14, newest=15), 1: done(14, -1, newest=16)}
    nxt = progress.advance(plan, answers, nodes=2, newest=15, interval=0.1, fixed_every=0)
    assert nxt is not None and nxt.sstar == 10 and nxt.margin == 4 and nxt.target >= 20
    differing = {0: done(14, 14), 1: done(14, 15)}  # not the same step everywhere
    nxt = progress.advance(plan, differing, nodes=2, newest=15, interval=0.1, fixed_every=0)
    assert nxt is not None and nxt.sstar == 10


def test_slow_replication_spaces_the_targets() -> None:
    plan = Plan(round="r1", sstar=-1, target=2, every=1, margin=2)
    nxt = progress.advance(plan, {0: done(2, 2, seconds=1.2), 1: done(2, 2, seconds=2.0)},
                           nodes=2, newest=9, interval=0.25, fixed_every=0)
    assert nxt is not None and nxt.sstar == 2 and nxt.every == 8 and nxt.target == 9 + nxt.margin
    assert nxt.margin == 8  # at least k: replication pins both slots for half the saves at most
    fast = progress.advance(plan, {0: done(2, 2, seconds=0.1), 1: done(2, 2, seconds=0.2)},
                            nodes=2, newest=9, interval=0.5, fixed_every=0)
    assert fast is not None and (fast.every, fast.margin, fast.target) == (1, 1, 10)
    fixed = progress.advance(plan, {0: done(2, 2, seconds=2.0), 1: done(2, 2, seconds=2.0)},
                             nodes=2, newest=9, interval=0.25, fixed_every=4)
    assert fixed is not None and fixed.margin == progress.MIN_MARGIN and fixed.target == 12


def test_records_survive_the_store_and_garbage_is_none() -> None:
    plan = Plan(round="r1", sstar=3, target=6, every=3, margin=2, lag_steps=2)
    assert Plan.loads(plan.dumps()) == plan
    assert Done.loads(done(6, 6).dumps()) == done(6, 6)
    for data in (None, b"", b"not json", b"[1, 2]", b'{"round": "r1"}'):
        assert Plan.loads(data) is None and Done.loads(data) is None


def _voting(target: int, step: int, host: str, agree: dict[str, list[str]]) -> Done:
    return Done(round="r", target=target, step=step, newest=step, seconds=0.1, host=host,
                agree=agree)


def test_replicas_that_disagree_keep_sstar_and_say_who_differs() -> None:
    """Ranks with the same key (the same share of the replicated state) on different
    nodes must have the same digest: then s* moves and the check is counted; otherwise s*
    stays on the last step they agreed on and the plan says which ranks and hosts differ."""
    plan = Plan(round="r", sstar=10, target=12, every=1, margin=1)
    same = {0: _voting(12, 12, "h0", {"0": ["a", "1"], "1": ["b", "2"]}),
            1: _voting(12, 12, "h1", {"2": ["a", "1"], "3": ["b", "2"]})}
    agreed = progress.advance(plan, same, nodes=2, newest=12, interval=0.1, fixed_every=0)
    assert agreed is not None and agreed.sstar == 12 and agreed.checked == 1
    assert agreed.diverged is None
    flipped = {0: same[0], 1: _voting(12, 12, "h1", {"2": ["a", "1"], "3": ["b", "X"]})}
    kept = progress.advance(plan, flipped, nodes=2, newest=12, interval=0.1, fixed_every=0)
    assert kept is not None and kept.sstar == 10 and kept.target > 12
    assert kept.diverged == {"step": 12, "agreed": 10, "ranks": [1, 3], "odd": [],
                             "nodes": [0, 1], "hosts": ["h0", "h1"]}
    assert Plan.loads(kept.dumps()) == kept  # it travels through the store
    later = {n: Done(**{**vars(d), "target": kept.target, "step": kept.target})
             for n, d in flipped.items()}
    still = progress.advance(kept, later, nodes=2, newest=kept.target, interval=0.1,
                             fixed_every=0)
    assert still is not None and still.sstar == 10 and still.diverged == kept.diverged


def test_a_majority_of_replicas_names_the_odd_one() -> None:
    dones = {n: _voting(5, 5, f"h{n}", {str(n): ["k", "X" if n == 2 else "d"]})
             for n in range(3)}
    assert progress.disagreement(dones, dones)["odd"] == [2]  # type: ignore[index]
    # nothing to compare: a key seen once, no records, an old host's report
    lone = {0: _voting(5, 5, "h0", {"0": ["k", "d"]}), 1: _voting(5, 5, "h1", {"1": ["j", "e"]}),
            2: Done(round="r", target=5, step=5, newest=5, seconds=0.1)}
    assert progress.disagreement(lone, lone) is None
    assert Done.loads(b'{"round": "r", "target": 5, "step": 5, "newest": 5, "seconds": 0.1}'
                      ) == lone[2]
