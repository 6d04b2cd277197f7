"""The goodput ledger (launcher.goodput) against hand-computed histories."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.goodput import (
    LOST,
    Cluster,
    Ledger,
    Setting,
    gemini_ettr,
    gemini_waste,
    group_mtbf,
    newest,
    recommend,
    replication_steps,
    storage_baseline,
)


def _steps(ledger: Ledger, first: int, last: int, at: float, *, every: float = 1.0,
           stall: float = 0.1, stalled: float = 0.0) -> float:
    """Steps ``first``..``last`` (numbers of steps done), one every ``every`` seconds
    from ``at`` on, each blocked ``stall`` s by its save; the time of the last."""
    for done in range(first, last + 1):
        at += every
        stalled += stall
        ledger.progress(steps=done, saved_at=at, stalled=stalled, restored=0,
                        restore_began=None, restore_ended=None)
    return at


def _restore(ledger: Ledger, began: float, ended: float, restored: int) -> None:
    ledger.progress(steps=restored, saved_at=0.0, stalled=0.0, restored=restored,
                    restore_began=began, restore_ended=ended)


def _adds_up(report: dict) -> None:
    parts = report["useful_s"] + sum(report["lost_s"].values())
    assert math.isclose(parts, report["wall_s"], abs_tol=1e-9), report
    assert all(v >= -1e-9 for v in report["lost_s"].values()), report


def test_a_failure_and_its_recovery_are_split_into_their_parts() -> None:
    ledger = Ledger()
    ledger.started(100.0)
    _restore(ledger, 101.0, 101.5, 0)  # a fresh start: 1 s to restore(), 0.5 s in it
    last = _steps(ledger, 1, 10, 101.5)  # 10 steps of 1 s, 0.1 s of each a save's stall
    assert last == 111.5
    ledger.ended(112.0)  # known 0.5 s after the last step
    ledger.started(113.0)  # rendezvous 1 s
    _restore(ledger, 113.5, 114.0, 8)  # the newest step every rank held: 8 steps done
    _steps(ledger, 9, 12, 114.0)  # 9 and 10 again, then 11 and 12
    ledger.finished(119.0)  # the exit after the last step (118) is not counted
    report = ledger.report(200.0)
    assert report["wall_s"] == pytest.approx(18.0)
    assert report["step_s"] == pytest.approx(0.9)
    assert report["steps"] == 12 and report["redone_steps"] == 2 and report["failures"] == 1
    assert report["useful_s"] == pytest.approx(12 * 0.9)
    assert report["lost_s"] == pytest.approx({
        "redone": 2 * 0.9, "checkpoint": 14 * 0.1, "detection": 0.5, "rendezvous": 1.0,
        "start_up": 1.5, "restore": 1.0, "waiting": 0.0, "other": 0.0})
    assert report["ettr"] == pytest.approx(10.8 / 18)
    _adds_up(report)


def test_a_live_ledger_counts_the_open_phase_up_to_now() -> None:
    ledger = Ledger()
    ledger.started(0.0)
    _restore(ledger, 2.0, 2.5, 0)
    _steps(ledger, 1, 4, 2.5, stall=0.0)
    ledger.ended(7.0)  # a host joined or left
    report = ledger.report(9.0)  # still in the rendezvous
    assert report["lost_s"]["rendezvous"] == pytest.approx(2.0)
    assert report["lost_s"]["detection"] == pytest.approx(0.5)
    assert report["wall_s"] == pytest.approx(9.0)
    _adds_up(report)


def test_a_script_without_restore_starts_training_at_its_first_save() -> None:
    ledger = Ledger()
    ledger.started(10.0)
    ledger.progress(steps=1, saved_at=13.0, stalled=0.0, restored=0, restore_began=None,
                    restore_ended=None)
    _steps(ledger, 2, 5, 13.0, stall=0.0)
    report = ledger.report(17.0)
    assert report["lost_s"]["start_up"] == pytest.approx(3.0)
    assert report["steps"] == 5
    # 5 steps at the median 1 s, but the steps took 4 s (the first one's was start-up)
    assert report["useful_s"] == pytest.approx(4.0)
    _adds_up(report)


def test_steps_restored_from_an_earlier_job_are_not_useful_in_this_one() -> None:
    ledger = Ledger()
    ledger.started(0.0)
    _restore(ledger, 0.5, 1.0, 100)  # e.g. from the persistent tier
    _steps(ledger, 101, 103, 1.0, stall=0.0)
    assert ledger.report(4.0)["useful_s"] == pytest.approx(3.0)
    assert ledger.high_water == 103


def test_a_resumed_ledger_keeps_the_run_and_counts_the_gap_as_waiting() -> None:
    ledger = Ledger()
    ledger.started(0.0)
    _restore(ledger, 1.0, 1.0, 0)
    _steps(ledger, 1, 10, 1.0, stall=0.0)  # last step at 11
    record = ledger.to_json(12.0)
    # the supervisor died; the next one (or a spare) goes on 20 s later
    resumed = Ledger.resume(record, 31.0)
    assert resumed.t0 == 0.0 and resumed.resumed
    assert resumed.failures == 1  # written while training: what ended its writer
    ledger.ended(12.5)  # written after its writer's restart: counted there
    assert Ledger.resume(ledger.to_json(13.0), 31.0).failures == 1
    ledger.started(13.5)  # written while the next round's workers start: its supervisor's
    assert Ledger.resume(ledger.to_json(14.0), 31.0).failures == 2  # end is one more,
    assert Ledger.resume(ledger.to_json(14.0), 31.0, own=False).failures == 1  # a spare's not
    resumed.started(32.0)
    _restore(resumed, 32.5, 33.0, 14)  # the job ran on to 14 steps meanwhile, elsewhere
    _steps(resumed, 15, 16, 33.0, stall=0.0)
    report = resumed.report(35.0)
    # 21 s from the last step it had seen to the new round; steps 11-14 were done in it,
    # elsewhere: their median time is the steps' again
    assert report["lost_s"]["waiting"] == pytest.approx(31.0 - 11.0 + 1.0 - 4 * 1.0)
    assert report["steps"] == 16
    assert report["useful_s"] == pytest.approx(16.0)
    _adds_up(report)


@pytest.mark.parametrize("record", [
    {}, {"v": 99, "t0": 0.0, "as_of": 1.0, "seconds": {}},
    {"v": 1, "t0": None, "as_of": 1.0, "seconds": {}},
    {"v": 1, "t0": 0.0, "as_of": float("nan"), "seconds": {}},
    {"v": 1, "t0": 0.0, "as_of": 1.0, "seconds": []},
])
def test_a_record_that_is_not_a_ledger_is_refused(record: dict) -> None:
    with pytest.raises(ValueError):
        Ledger.resume(record, 5.0)


def test_hostile_fields_of_a_record_are_dropped() -> None:
    record = {"v": 1, "t0": 0.0, "as_of": 1.0, "seconds": {"training": -5,
              "waiting": "x"}, "high_water": -3, "useful_steps": True, "samples": [1, "a", -2,
              float("inf"), 0.5]}
    ledger = Ledger.resume(record, 2.0)
    assert ledger.seconds["training"] == 0.0 and ledger.high_water == 0
    assert list(ledger.samples) == [1.0, 0.5]
    _adds_up(ledger.report(3.0))


def test_the_newest_record_is_the_last_written() -> None:
    records = [{"as_of": 5.0, "x": 1}, {"as_of": "late"}, {"as_of": 7.0, "x": 2}, {}]
    assert newest(records) == {"as_of": 7.0, "x": 2}
    assert newest([]) is None


_EVENTS = st.lists(st.one_of(
    st.tuples(st.just("start"), st.floats(0, 5)),
    st.tuples(st.just("end"), st.floats(0, 5)),
    st.tuples(st.just("restore"), st.floats(0, 2), st.floats(0, 2), st.integers(0, 50)),
    st.tuples(st.just("steps"), st.integers(0, 20), st.floats(0.01, 3), st.floats(0, 0.5)),
), max_size=30)


@settings(max_examples=200, deadline=None)
@given(_EVENTS, st.floats(0, 10))
def test_any_history_adds_up_to_the_wall_time(history: list, tail: float) -> None:
    """Whatever the order of rounds, restores and steps: every part is >= 0, ETTR is in
    [0, 1], and the parts add up to the wall time, live and after a store round trip."""
    ledger, now, steps = Ledger(), 0.0, 0
    for item in history:
        if item[0] == "start":
            now += item[1]
            ledger.started(now)
        elif item[0] == "end":
            now += item[1]
            ledger.ended(now)
        elif item[0] == "restore":
            steps = item[3]
            _restore(ledger, now + item[1], now + item[1] + item[2], steps)
            now += item[1] + item[2]
        else:
            now = _steps(ledger, steps + 1, steps + item[1], now, every=item[2], stall=item[3])
            steps += item[1]
    for report in (ledger.report(now + tail),
                   Ledger.resume(ledger.to_json(now), now + tail).report(now + tail)
                   if ledger.t0 is not None else ledger.report(now)):
        _adds_up(report)
        assert report["ettr"] is None or 0.0 <= report["ettr"] <= 1.0 + 1e-9
        assert set(report["lost_s"]) == set(LOST)


# -- the planner ------------------------------------------------------------------------------

CLUSTER = Cluster(nodes=10, job_mtbf=3600.0, step_time=2.0, host_bytes=10**10,
                  host_share=0.5, network_bytes_per_s=1e9, storage_bytes_per_s=5e8,
                  restart_time=100.0, replace_time=300.0, stall=0.002, worker_recovery=1.0,
                  host_recovery=3.0)


def test_gemini_waste_and_ettr_by_hand() -> None:
    # replication of 10 GB at 1 GB/s: 10 s = 5 steps of 2 s
    assert replication_steps(CLUSTER, Setting()) == 5
    assert replication_steps(CLUSTER, Setting(replicate_every=2)) == 2
    waste = gemini_waste(CLUSTER, Setting())
    assert waste["worker"] == pytest.approx(1.0 + 2.0)  # recovery + in-flight + half a step
    assert waste["host"] == pytest.approx(3.0 + 1.0 + 5 * 2.0)  # spare + in flight + lag
    assert waste["per_failure"] == pytest.approx(0.5 * 3.0 + 0.5 * 14.0)
    assert waste["checkpoint_fraction"] == pytest.approx(0.001)
    assert gemini_ettr(CLUSTER, Setting()) == pytest.approx(0.999 * (1 - 8.5 / 3600))
    # no spare: the host loss waits for a replacement
    assert gemini_waste(CLUSTER, Setting(spares=0))["host"] == pytest.approx(300.0 + 1.0 + 10.0)
    # no replica: a host loss restarts from storage (restart + reading 10 GB at 0.5 GB/s)
    assert gemini_waste(CLUSTER, Setting(replicas=1))["host"] == pytest.approx(100.0 + 20.0)


def test_the_storage_baseline_is_youngs_optimum_by_hand() -> None:
    base = storage_baseline(CLUSTER)
    write = 10**10 / 5e8  # 20 s
    interval = math.sqrt(2 * write * 3600.0)  # 379.5 s
    assert base["write_s"] == pytest.approx(write)
    assert base["interval_s"] == pytest.approx(interval)
    assert base["per_failure"] == pytest.approx(interval / 2 + 100.0 + write)
    assert base["ettr"] == pytest.approx(1 - write / interval - (interval / 2 + 120.0) / 3600)
    # Young's interval is the optimum of this waste: any other interval wastes more
    for factor in (0.5, 0.8, 1.25, 2.0):
        tau = interval * factor
        assert 1 - write / tau - (tau / 2 + 120.0) / 3600 < base["ettr"]


def test_the_recommendation_weighs_a_spare_against_the_host_it_takes() -> None:
    # 10 hosts failing every hour: a spare (1/11 of the hosts idle) costs more than the
    # 300 s a replacement takes at one host loss every two hours
    assert recommend(CLUSTER, 36000.0)["spares"] == 0
    # ... but not at one host loss every two minutes
    busy = Cluster(**{**CLUSTER.__dict__, "job_mtbf": 240.0})
    assert recommend(busy, 2400.0)["spares"] == 1
    best = recommend(CLUSTER, 36000.0)
    assert best["replicas"] == 2 and best["replicate_every"] == 5
    # persist against the loss of both holders within one re-replication window
    window = 3.0 + 10.0
    group = 36000.0 ** 2 / (10 * window)
    assert group_mtbf(CLUSTER, Setting(), 36000.0) == pytest.approx(group)
    assert best["persist_every_s"] == pytest.approx(math.sqrt(2 * 20.0 * group))
