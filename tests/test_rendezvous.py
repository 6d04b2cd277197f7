"""Stable node slots: a pure function, tested without processes."""

from __future__ import annotations

from launcher.rendezvous import assign_slots


def test_stable_slots() -> None:
    # h0 (slot 0) died; replacement h2 joins; torch numbered the survivors h1=0, h2=1
    assert assign_slots({0: ("h1", 1), 1: ("h2", None)}, 2) == {0: 1, 1: 0}
    # first round: nobody has a slot, order by host id
    assert assign_slots({0: ("b", None), 1: ("a", None)}, 2) == {0: 1, 1: 0}
    # the world shrank: a slot past the end is given up
    assert assign_slots({0: ("h2", 2), 1: ("h1", 1)}, 2) == {0: 0, 1: 1}
    # two claims of one slot: the first host id keeps it
    assert assign_slots({0: ("x", 0), 1: ("a", 0)}, 2) == {0: 1, 1: 0}
