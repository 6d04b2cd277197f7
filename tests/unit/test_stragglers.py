"""Stragglers: the worker's own-work clock and the root's judgement (launcher.stragglers)."""

from __future__ import annotations

import array
import time

import pytest
import torch

from launcher import memory
from launcher.stragglers import RELEARN, Judgement, PaceClock, judge

THRESHOLD, WINDOW = 1.25, 30.0


def _run(history: list[dict[str, tuple[float, int]]], every: float = 5.0) -> list[Judgement]:
    judgements, previous = [], Judgement()
    for i, paces in enumerate(history):
        previous = judge(paces, previous, i * every, threshold=THRESHOLD, window=WINDOW)
        judgements.append(previous)
    return judgements


def test_a_persistently_slow_host_is_a_straggler_after_a_window() -> None:
    slow = {"a": (0.10, 50), "b": (0.10, 50), "c": (0.20, 50)}
    judgements = _run([slow] * 10)
    assert judgements[0].scores["c"] == pytest.approx(2.0)
    assert [bool(j.stragglers) for j in judgements] == [False] * 6 + [True] * 4  # 30 s
    assert judgements[-1].stragglers == {"c"}
    # back to speed: it stops being one after a window below the threshold
    healed = _run([slow] * 8 + [{"a": (0.1, 50), "b": (0.1, 50), "c": (0.1, 50)}] * 8)
    assert healed[7].stragglers == {"c"} and healed[-1].stragglers == set()
    assert healed[-3].stragglers == {"c"}  # 25 s below: not yet


def test_a_slow_moment_is_not_a_straggler() -> None:
    """A slow window (a data loader's hiccup, a persist) that does not last a window."""
    fine = {"a": (0.1, 50), "b": (0.1, 50), "c": (0.1, 50)}
    hiccup = {"a": (0.1, 50), "b": (0.1, 50), "c": (0.3, 50)}
    judgements = _run([fine, hiccup, hiccup, hiccup, fine, hiccup, hiccup, fine] * 3)
    assert not any(j.stragglers for j in judgements)


def test_everyone_slow_blames_no_host() -> None:
    """A data loader slow on every rank moves the median with it."""
    judgements = _run([{"a": (0.1, 50), "b": (0.1, 50), "c": (0.1, 50)}] * 3
                      + [{"a": (0.4, 50), "b": (0.41, 50), "c": (0.39, 50)}] * 12)
    assert not any(j.stragglers for j in judgements)


def test_hosts_without_enough_steps_are_not_judged() -> None:
    """An evaluation or a restart leaves a window with few or no optimizer steps."""
    judgements = _run([{"a": (0.1, 50), "b": (0.1, 50), "c": (0.5, 2)}] * 12)
    assert not any(j.stragglers for j in judgements) and "c" not in judgements[-1].scores
    assert _run([{"a": (0.1, 50)}] * 12)[-1].scores == {}  # one host: nothing to compare


def test_two_hosts_one_twice_as_slow() -> None:
    judgements = _run([{"a": (0.1, 50), "b": (0.2, 50)}] * 8)
    assert judgements[-1].stragglers == {"b"}  # 0.2 / 0.15 = 1.33


def _clock() -> tuple[PaceClock, array.array]:
    words = array.array("Q", [0] * memory.HEARTBEAT_WORDS)
    return PaceClock(memoryview(words).cast("B").cast("Q")), words


def test_the_clock_times_the_work_before_the_last_gradient() -> None:
    """From one optimizer step to the last gradient of the next backward: what comes after
    it (here a sleep standing in for the wait in the all-reduce) is not own work."""
    clock, words = _clock()
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clock.watch(model.parameters())
    optimizer.register_step_pre_hook(lambda *a: clock.step())
    for _ in range(6):
        time.sleep(0.02)  # own work: the data loader
        model(torch.randn(8, 64)).sum().backward()
        time.sleep(0.05)  # waiting for the others
        optimizer.step()
        optimizer.zero_grad()
    # the first step has no start before it, the second learns the last gradient's
    # parameter (the only one hooked afterwards)
    assert words[memory.OWN_STEPS] == 4 and len(clock._handles) == 1
    own = words[memory.OWN_NS] / words[memory.OWN_STEPS] / 1e9
    assert 0.02 <= own < 0.045, own  # the 20 ms of loading and the backward, not the 50 ms
    clock.close()
    model(torch.randn(8, 64)).sum().backward()  # a closed clock's hooks write nothing
    optimizer.step()
    assert words[memory.OWN_STEPS] == 4 and not clock._handles


def test_the_clock_learns_again_when_the_last_gradient_moves() -> None:
    """The learned parameter frozen: after RELEARN steps without its gradient, every
    parameter is hooked again, the new last one learned, and timing goes on."""
    clock, words = _clock()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clock.watch(model.parameters())
    optimizer.register_step_pre_hook(lambda *a: clock.step())

    def steps(count: int) -> None:
        for _ in range(count):
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

    steps(4)
    learned = next(iter(clock._handles))
    frozen = next(p for p in model.parameters() if id(p) == learned)
    frozen.requires_grad_(False)
    timed = words[memory.OWN_STEPS]
    steps(RELEARN + 1)
    assert len(clock._handles) > 1 or next(iter(clock._handles)) != learned
    steps(4)
    assert len(clock._handles) == 1 and next(iter(clock._handles)) != learned
    assert words[memory.OWN_STEPS] > timed
