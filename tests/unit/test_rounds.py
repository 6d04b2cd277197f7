"""When a supervisor restarts its round: pure decisions over what it knows of the job."""

from __future__ import annotations

from itertools import product
from typing import Any

import pytest

from launcher.rounds import (
    AfterFailure,
    WaitingAnswer,
    after_failure,
    answer_waiting,
    round_moved_on,
    stranded,
)

MEMBERS = frozenset({"a", "b", "c"})  # the round of host "a"
NONE: frozenset[str] = frozenset()


def answer(**changes: Any) -> WaitingAnswer:
    """``answer_waiting`` for host "a" of a healthy round of three, max four hosts."""
    state: dict[str, Any] = dict(waiting=0, moved_on=False, lost=NONE, members=MEMBERS,
                                 host="a", acted_on=NONE, world=3, max_nodes=4,
                                 spares_noted=False)
    return answer_waiting(**{**state, **changes})


@pytest.mark.parametrize(("joined", "current", "moved_on"), [
    (None, None, False),  # before this host's first round
    (None, 3, False),
    (3, None, False),  # a backend without round numbers
    (3, 3, False),
    (3, 4, True),
    (4, 3, True),
])
def test_round_moved_on(joined: int | None, current: int | None, moved_on: bool) -> None:
    assert round_moved_on(joined, current) is moved_on


def test_a_healthy_round_answers_torchs_count() -> None:
    assert answer() == WaitingAnswer(count=0, acted_on=NONE)
    assert answer(waiting=2) == WaitingAnswer(count=2, acted_on=NONE)


def test_a_host_the_job_went_on_without_is_fenced_and_restarts() -> None:
    got = answer(moved_on=True, lost=frozenset({"b"}), acted_on=frozenset({"c"}), waiting=3)
    assert got == WaitingAnswer(count=1, acted_on=frozenset({"c"}), fence=True)


def test_a_lost_member_restarts_the_round_once() -> None:
    first = answer(lost=frozenset({"b"}))
    assert first == WaitingAnswer(count=1, acted_on=frozenset({"b"}), lost=frozenset({"b"}))
    again = answer(lost=frozenset({"b"}), acted_on=first.acted_on)
    assert again == WaitingAnswer(count=0, acted_on=frozenset({"b"}))


def test_only_other_members_of_this_round_count_as_lost() -> None:
    assert answer(lost=frozenset({"a", "x"})) == WaitingAnswer(count=0, acted_on=NONE)


def test_a_second_loss_announces_every_lost_member() -> None:
    got = answer(lost=frozenset({"b", "c"}), acted_on=frozenset({"b"}))
    assert got.count == 1
    assert got.lost == got.acted_on == frozenset({"b", "c"})


def test_a_member_that_registered_again_is_acted_on_when_lost_again() -> None:
    back = answer(lost=NONE, acted_on=frozenset({"b"}))
    assert back == WaitingAnswer(count=0, acted_on=NONE)
    assert answer(lost=frozenset({"b"}), acted_on=back.acted_on).lost == frozenset({"b"})


def test_hosts_waiting_beside_a_full_group_stay_spares() -> None:
    full = answer(waiting=1, world=4)
    assert full == WaitingAnswer(count=0, acted_on=NONE, note_spares=True)
    assert answer(waiting=1, world=4, spares_noted=True) == WaitingAnswer(count=0, acted_on=NONE)
    assert answer(waiting=0, world=4) == WaitingAnswer(count=0, acted_on=NONE)


def test_a_member_whose_workers_failed_restarts_a_full_group_at_once() -> None:
    # it said so before it re-joined: every host restarts now, spares or not
    said = answer(world=4, failed=frozenset({"b"}))
    assert said == WaitingAnswer(count=1, acted_on=NONE, failed=frozenset({"b"}))
    # it left torch's round to re-join (nothing said, e.g. the store was away): a member
    # waits beside the full group, so it is no spare
    left = answer(waiting=2, world=4, left=True)
    assert left == WaitingAnswer(count=2, acted_on=NONE)


def test_only_other_members_failures_restart_the_round() -> None:
    assert answer(world=4, failed=frozenset({"a", "x"})) == WaitingAnswer(count=0, acted_on=NONE)
    # a member that left without anyone waiting was dropped as dead: its lease decides
    assert answer(world=4, left=True) == WaitingAnswer(count=0, acted_on=NONE)
    assert answer(waiting=1, world=3).count == 1  # room to grow: torch's restart lets it in


def test_a_lost_member_restarts_even_a_full_group() -> None:
    got = answer(waiting=1, world=4, lost=frozenset({"c"}))
    assert (got.count, got.lost, got.note_spares) == (1, frozenset({"c"}), False)


@pytest.mark.parametrize(("moved_on", "lost", "acted_on", "waiting", "world"), list(product(
    (False, True), (NONE, frozenset({"b"})), (NONE, frozenset({"b"})), (0, 1), (3, 4))))
def test_at_most_one_thing_is_recorded(moved_on: bool, lost: frozenset[str],
                                       acted_on: frozenset[str], waiting: int,
                                       world: int) -> None:
    got = answer(moved_on=moved_on, lost=lost, acted_on=acted_on, waiting=waiting, world=world)
    assert sum((got.fence, bool(got.lost), got.note_spares)) <= 1
    assert got.count >= 0


@pytest.mark.parametrize(("remaining", "finished", "world", "min_nodes", "choice"), [
    (0, 0, 2, 2, AfterFailure.NO_RESTARTS),
    (0, 1, 2, 1, AfterFailure.NO_RESTARTS),
    (3, 0, 2, 2, AfterFailure.RESTART),  # nobody finished: a full new round
    (3, 1, 3, 2, AfterFailure.RESTART),  # the two left still form a round
    (3, 1, 2, 2, AfterFailure.PEERS_FINISHED),
    (1, 2, 3, 2, AfterFailure.PEERS_FINISHED),
    (1, 1, 4, 1, AfterFailure.RESTART),
])
def test_after_failure(remaining: int, finished: int, world: int, min_nodes: int,
                       choice: AfterFailure) -> None:
    assert after_failure(remaining_restarts=remaining, finished=finished, world=world,
                         min_nodes=min_nodes) is choice


@pytest.mark.parametrize(("finished", "restarting", "world", "min_nodes", "static", "closes"), [
    (1, 1, 2, 2, False, True),  # the one left restarted and cannot form a round alone
    (1, 1, 2, 2, True, False),  # a static rendezvous cannot be closed
    (1, 0, 2, 2, False, False),  # the other host still runs: wait for it
    (1, 1, 3, 2, False, False),  # one host is neither finished nor restarting
    (1, 2, 3, 2, False, False),  # the two restarting hosts form a round of their own
    (2, 1, 3, 2, False, True),
    (1, 2, 3, 3, False, True),
])
def test_stranded(finished: int, restarting: int, world: int, min_nodes: int, static: bool,
                  closes: bool) -> None:
    assert stranded(finished=finished, restarting=restarting, world=world,
                    min_nodes=min_nodes, static=static) is closes


# -- the no-progress guard ------------------------------------------------------------
def test_a_failure_by_an_outside_signal_has_no_signature() -> None:
    from launcher.rounds import failure_signature

    assert failure_signature({0: (-9, "Signal 9 (SIGKILL)"), 1: (1, "gloo: connection reset")}) is None
    assert failure_signature({3: (-15, ""), 4: (-15, "")}) is None  # SIGTERM to all: outside
    # torch stops the others with SIGTERM once one failed: only the failed one counts
    assert failure_signature({0: (1, "ValueError: x"), 1: (-15, "")}) == frozenset(
        {(0, 1, "ValueError: x")})
    raised = failure_signature({1: (1, "Traceback...\nValueError: loss is nan\n")})
    assert raised == frozenset({(1, 1, "ValueError: loss is nan")})
    assert failure_signature({0: (-11, "Signal 11 (SIGSEGV) received by PID 7")}) == frozenset(
        {(0, -11, "SIGSEGV")})  # a crash counts, whatever its pid
    assert failure_signature({0: (1, "To enable traceback see: https://pytorch.org/docs")}
                             ) == frozenset({(0, 1, "")})


def test_a_script_that_fails_after_every_restore_tries_one_older_step_then_gives_up() -> None:
    """Restored at 10 after a kill: the first failure avoids 10 (the next round restores
    9), the next ones restore 9 again, and the third gives up (limit 3)."""
    from launcher.rounds import FailureHistory, Guard, failure_signature, guard_failure

    nan = failure_signature({0: (1, "ValueError: nan")})
    history = FailureHistory()
    verdict, history = guard_failure(history, signature=None, committed=10, restored=-1, limit=3)
    assert verdict is Guard.RESTART and history.same == 0 and history.high_water == 10
    verdict, history = guard_failure(history, signature=nan, committed=10, restored=10, limit=3)
    assert verdict is Guard.RESTART_OLDER and history.avoid == {10}
    verdict, history = guard_failure(history, signature=nan, committed=10, restored=9, limit=3)
    assert verdict is Guard.RESTART and history.same == 2 and history.avoid == {10}
    verdict, history = guard_failure(history, signature=nan, committed=10, restored=9, limit=3)
    assert verdict is Guard.GIVE_UP and history.same == 3


def test_progress_or_another_failure_starts_counting_again() -> None:
    from launcher.rounds import FailureHistory, Guard, failure_signature, guard_failure

    a = failure_signature({0: (1, "ValueError: a")})
    b = failure_signature({0: (1, "ValueError: b")})
    history = FailureHistory(high_water=20)
    for _ in range(5):  # a new step every time: never gives up, never avoids
        history = guard_failure(history, signature=a, committed=history.high_water + 3,
                                restored=history.high_water, limit=2)[1]
        assert history.same == 1 and not history.avoid
    verdict, history = guard_failure(history, signature=b, committed=history.high_water,
                                     restored=history.high_water - 2, limit=2)
    assert verdict is Guard.RESTART and history.same == 1
    verdict, history = guard_failure(history, signature=None, committed=history.high_water,
                                     restored=history.high_water - 2, limit=2)
    assert verdict is Guard.RESTART and history.same == 1  # transient: no count, no reset
    both = b | failure_signature({1: (1, "RuntimeError: gloo: connection reset")})
    verdict, history = guard_failure(history, signature=both, committed=history.high_water,
                                     restored=history.high_water - 2, limit=3)
    assert verdict is Guard.RESTART and history.same == 2  # rank 0 failed the same way
    verdict, _ = guard_failure(history, signature=b, committed=history.high_water,
                               restored=history.high_water - 2, limit=3)
    assert verdict is Guard.GIVE_UP
    verdict, _ = guard_failure(history, signature=b, committed=history.high_water,
                               restored=history.high_water - 2, limit=0)
    assert verdict is Guard.RESTART  # limit 0: off
    history = FailureHistory(high_water=5, signature=a, same=1)
    assert guard_failure(history, signature=b, committed=5, restored=3, limit=2)[1].same == 1


def test_without_a_committed_step_only_max_restarts_bounds_the_restarts() -> None:
    """A script without gemini's Checkpointer shows no steps: it fails like under torchrun."""
    from launcher.rounds import FailureHistory, Guard, failure_signature, guard_failure

    crash = failure_signature({1: (3, "")})
    history = FailureHistory()
    for _ in range(5):
        verdict, history = guard_failure(history, signature=crash, committed=-1,
                                         restored=-1, limit=2)
        assert verdict is Guard.RESTART and history.same == 0
