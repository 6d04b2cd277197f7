"""The double-buffer rule (launcher.memory): which of a rank's slots holds a step, and
which holds the newest, decided from headers alone."""

from __future__ import annotations

from launcher import memory

COMMITTED, WRITING, EMPTY = (memory.SlotState.COMMITTED, memory.SlotState.WRITING,
                             memory.SlotState.EMPTY)


def _header(step: int, seq: int, state: memory.SlotState = COMMITTED, *, rank: int = 0,
            world_size: int = 2, run_id: str = "run") -> memory.SlotHeader:
    return memory.SlotHeader(state, step, seq, rank, world_size, 0, 0, 0, 0, 0, run_id)


def test_a_step_is_held_by_its_latest_commit() -> None:
    assert memory.holding(5, [_header(5, 3), _header(5, 4)]) == 1
    assert memory.holding(5, [_header(5, 4), _header(5, 3)]) == 0
    assert memory.holding(5, [_header(5, 4), _header(5, 4)]) == 0  # a tie: the first
    assert memory.holding(5, [_header(4, 9), _header(5, 1)]) == 1


def test_slots_not_committed_hold_nothing() -> None:
    assert memory.holding(5, [_header(5, 9, WRITING), _header(5, 1)]) == 1
    assert memory.holding(5, [None, _header(5, 1)]) == 1
    assert memory.holding(5, [_header(5, 9, WRITING), _header(5, 8, EMPTY)]) is None
    assert memory.holding(5, [None, None]) is None
    assert memory.holding(5, []) is None
    assert memory.holding(6, [_header(5, 1), _header(4, 2)]) is None
    assert memory.newest([_header(7, 9, WRITING), None]) is None


def test_rank_world_size_and_run_narrow_the_holders_where_given() -> None:
    headers = [_header(5, 9, rank=1), _header(5, 1, world_size=4, run_id="other")]
    assert memory.holding(5, headers) == 0
    assert memory.holding(5, headers, rank=0) == 1
    assert memory.holding(5, headers, rank=2) is None
    assert memory.holding(5, headers, world_size=4) == 1
    assert memory.holding(5, headers, world_size=2) == 0
    assert memory.holding(5, headers, run_id="other") == 1
    assert memory.holding(5, headers, rank=1, run_id="other") is None
    # a header keeps the first 64 characters of the run id
    assert memory.holding(5, [_header(5, 1, run_id="r" * 64)], run_id="r" * 80) == 0


def test_committed_checks_state_and_each_field_given() -> None:
    header = _header(5, 1, rank=1, world_size=4, run_id="run")
    assert memory.committed(header)
    assert memory.committed(header, step=5, rank=1, world_size=4, run_id="run")
    assert not memory.committed(None)
    assert not memory.committed(_header(5, 1, WRITING))
    assert not memory.committed(_header(5, 1, EMPTY), step=5)
    for mismatch in ({"step": 4}, {"rank": 0}, {"world_size": 2}, {"run_id": "other"}):
        assert not memory.committed(header, **mismatch)


def test_each_committed_step_maps_to_its_latest_commit() -> None:
    headers = [_header(3, 1), _header(4, 2), _header(3, 5), _header(6, 9, WRITING), None,
               _header(4, 2, rank=1)]
    assert memory.by_step(headers) == {3: 2, 4: 1}
    assert memory.by_step(headers, rank=1) == {4: 5}
    assert memory.by_step([]) == {}


def test_the_newest_slot_holds_the_highest_step_then_the_latest_commit() -> None:
    assert memory.newest([_header(4, 9), _header(5, 1)]) == 1
    assert memory.newest([_header(5, 1), _header(4, 9)]) == 0
    assert memory.newest([_header(5, 1), _header(5, 2)]) == 1
    assert memory.newest([_header(5, 2), _header(5, 2)]) == 0  # a tie: the first
    assert memory.newest([_header(6, 3, WRITING), _header(5, 1)]) == 1
    assert memory.newest([None, _header(5, 1)]) == 1
    assert memory.newest([]) is None
