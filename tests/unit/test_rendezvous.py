"""Rendezvous helpers that need no processes: stable node slots, the rendezvous speed-ups."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from launcher.rendezvous import _caller_name, assign_slots, worker_ranks


def test_stable_slots() -> None:
    # h0 (slot 0) died; replacement h2 joins; torch numbered the survivors h1=0, h2=1
    assert assign_slots({0: ("h1", 1), 1: ("h2", None)}, 2) == {0: 1, 1: 0}
    # first round: nobody has a slot, order by host id
    assert assign_slots({0: ("b", None), 1: ("a", None)}, 2) == {0: 1, 1: 0}
    # the world shrank: a slot past the end is given up
    assert assign_slots({0: ("h2", 2), 1: ("h1", 1)}, 2) == {0: 0, 1: 1}
    # two claims of one slot: the first host id keeps it
    assert assign_slots({0: ("x", 0), 1: ("a", 0)}, 2) == {0: 1, 1: 0}


@pytest.mark.parametrize("nodes", [
    [("trainer", 2), ("trainer", 2)],
    [("trainer", 2), ("trainer", 3), ("eval", 1), ("trainer", 2)],
    [("a", 1)],
])
def test_worker_ranks_are_torchs(nodes: list[tuple[str, int]]) -> None:
    """Each supervisor computes its workers' ranks from the round's posts as torch's
    agents assign them through the store (its rank 0 reading everyone's role and count)."""
    import threading

    from torch.distributed import HashStore
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec

    store, found = HashStore(), {}

    def assign(slot: int) -> None:
        role, count = nodes[slot]
        spec = WorkerSpec(role=role, local_world_size=count, entrypoint="x", rdzv_handler=None)
        workers = SimpleElasticAgent._assign_worker_ranks(object(), store, slot, len(nodes), spec)
        found[slot] = [(w.global_rank, w.world_size, w.role_rank, w.role_world_size)
                       for w in workers]

    threads = [threading.Thread(target=assign, args=(slot,)) for slot in range(len(nodes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    for slot, (_, count) in enumerate(nodes):
        base, size, role_base, role_size = worker_ranks(nodes, slot)
        assert found[slot] == [(base + i, size, role_base + i, role_size) for i in range(count)]


def test_fast_event_names_match_torchs() -> None:
    slow = dynamic_rendezvous.get_method_name
    assert slow.__module__ == dynamic_rendezvous.__name__, "already replaced in this process"

    def record(name_of: Any) -> str:
        return str(name_of())

    def some_method(name_of: Any) -> str:
        return record(name_of)

    assert some_method(_caller_name) == some_method(slow) == "some_method"
    assert _caller_name(10_000) == slow(10_000) == "no_method_name"


def test_polls_end_when_the_state_changes_and_single_nodes_skip_the_start_skew() -> None:
    """A node polling for the next round wakes as soon as the rendezvous state changes
    (else after the poll interval); only a multi-node job spreads the first attempts, and
    only before this node saw a round form."""
    import threading

    from launcher import rendezvous

    slept: list[object] = []
    delay = rendezvous._wake_on_change(slept.append)
    single, rounds = rendezvous._SINGLE_NODE[0], dict(rendezvous._LAST_ROUNDS)
    try:
        rendezvous._LAST_ROUNDS.clear()
        rendezvous._SINGLE_NODE[:] = [True]
        delay((0, 0.3))
        rendezvous._SINGLE_NODE[:] = [False]
        delay((0, 0.3))  # a multi-node job's first join: spread
        assert slept == [(0, 0.3)]
        rendezvous._LAST_ROUNDS["run"] = rendezvous._LastRound(0, frozenset({"a", "b"}))
        delay((0, 0.3))  # a rejoin after round 0 (torch would spread it too): at once
    finally:
        rendezvous._SINGLE_NODE[:] = [single]
        rendezvous._LAST_ROUNDS.clear()
        rendezvous._LAST_ROUNDS.update(rounds)
    assert slept == [(0, 0.3)]
    rendezvous._CHANGED.clear()  # a backend of another test may have set it
    started = time.monotonic()
    delay(0.3)
    assert time.monotonic() - started >= 0.3
    threading.Timer(0.1, rendezvous._CHANGED.set).start()
    started = time.monotonic()
    delay(30)
    assert time.monotonic() - started < 10
    assert not rendezvous._CHANGED.is_set()


def test_the_last_rounds_members_join_before_spares() -> None:
    """When a round ends, its members rejoin first: a spare waits while a member of the
    last round is alive and outside the new round, and in any case for the settle time;
    after the grace period it joins regardless (a member that never returns)."""
    from launcher.rendezvous import SETTLE, members_first

    members = frozenset({"a", "b"})
    assert members_first("a", members, [], [], 0.0, 10.0)  # a member never waits
    assert not members_first("s", members, ["a"], ["a", "b", "s"], 5.0, 10.0)  # b is alive
    assert not members_first("s", members, ["a", "b"], ["a", "b", "s"], SETTLE / 2, 10.0)
    assert members_first("s", members, ["a", "b"], ["a", "b", "s"], SETTLE, 10.0)
    assert members_first("s", members, ["a"], ["a", "s"], SETTLE, 10.0)  # b is gone
    assert members_first("s", members, ["a"], ["a", "b", "s"], 10.0, 10.0)  # grace over
    assert members_first("s", frozenset(), [], [], SETTLE, 10.0)  # no last round seen
    # b is known lost: a spare joins at once while the round has room beside a's return
    assert members_first("s", members, [], ["s"], 0.0, 10.0, gone=frozenset({"'b'"}),
                         max_nodes=2)
    assert not members_first("s", members, ["t"], ["s", "t"], 0.0, 10.0,
                             gone=frozenset({"'b'"}), max_nodes=2)  # a second spare: no room
    assert not members_first("s", members, [], ["s"], 0.0, 10.0, max_nodes=2)  # none known lost


def test_known_dead_nodes_leave_the_rendezvous_state_at_once() -> None:
    """A node named by the registered callable is dropped from the participants, the
    wait list, the redundancy list and the heartbeats, fresh as its heartbeat is; a
    complete round left without participants opens the next one."""
    import datetime
    from types import SimpleNamespace

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _NodeDesc,
        _RendezvousState,
    )

    from launcher import rendezvous

    dead, alive, spare = (_NodeDesc("host", pid, 0) for pid in (1, 2, 3))
    now = datetime.datetime.now(datetime.timezone.utc)
    state = _RendezvousState()
    state.round, state.complete = 4, True
    state.participants = {dead: 0, alive: 1}
    state.redundancy_list = {spare}
    state.last_heartbeats = {dead: now, alive: now, spare: now}
    holder = SimpleNamespace(_state=state, _settings=SimpleNamespace(min_nodes=2))
    previous = list(rendezvous._GONE)
    try:
        rendezvous.drop_gone_nodes(lambda: frozenset({repr(dead), repr(spare)}))
        rendezvous._drop_gone(holder)
        assert state.participants == {alive: 1} and state.complete and state.round == 4
        assert not state.redundancy_list and set(state.last_heartbeats) == {alive}
        rendezvous.drop_gone_nodes(lambda: frozenset({repr(alive)}))
        rendezvous._drop_gone(holder)
        assert not state.participants and not state.complete and state.round == 5
    finally:
        rendezvous._GONE[:] = previous


def test_a_node_known_lost_that_heartbeats_again_stays() -> None:
    """A node counted lost that heartbeats after it was first seen lost (a frozen host
    thawed, and joined the next round: torch's join records a heartbeat) is alive: it is
    not dropped from the round it joined, whatever the lost list still says."""
    import datetime
    from types import SimpleNamespace

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _NodeDesc,
        _RendezvousState,
    )

    from launcher import rendezvous

    thawed, survivor = _NodeDesc("host", 1, 0), _NodeDesc("host", 2, 0)
    then = datetime.datetime.now(datetime.timezone.utc)
    state = _RendezvousState()
    state.round, state.complete = 4, True
    state.participants = {thawed: 0, survivor: 1}
    state.last_heartbeats = {thawed: then, survivor: then}
    holder = SimpleNamespace(_state=state, _settings=SimpleNamespace(min_nodes=2))
    previous = list(rendezvous._GONE)
    try:
        rendezvous.drop_gone_nodes(lambda: frozenset({repr(thawed)}))
        rendezvous._drop_gone(holder)  # first seen lost: dropped
        assert state.participants == {survivor: 1} and thawed not in state.last_heartbeats
        state.round, state.complete = 5, True  # it thawed and both joined the next round
        state.participants = {thawed: 0, survivor: 1}
        state.last_heartbeats[thawed] = then + datetime.timedelta(seconds=3)
        rendezvous._drop_gone(holder)
        assert state.participants == {thawed: 0, survivor: 1} and state.round == 5
    finally:
        rendezvous._GONE[:] = previous
        rendezvous._GONE_BEATS.clear()


def test_a_round_closes_once_every_live_node_rejoined() -> None:
    """After a host loss (its node dropped, so no longer heartbeating) the survivors close
    the round as soon as they all joined; a spare or a member still alive and not yet
    rejoined keeps it open; there is no early close before a first complete round."""
    from launcher.rendezvous import all_rejoined

    members = frozenset({"a", "b", "c"})
    assert all_rejoined(members, ["a", "c"], ["a", "c"])  # b is gone
    assert not all_rejoined(members, ["a"], ["a", "c"])  # c is alive, not back yet
    assert not all_rejoined(members, ["a", "c"], ["a", "c", "spare"])  # the spare joins too
    assert all_rejoined(members, ["a", "c", "spare"], ["a", "c", "spare"])
    assert not all_rejoined(frozenset(), ["a"], ["a"])


def test_a_store_listens_where_its_endpoint_name_resolves_when_that_is_this_host() -> None:
    """An IP address or localhost is bound as given; a name is bound to the one address
    it resolves to when that is this machine's own and not a loopback one; else (a name
    of a loopback address, as Debian maps a host's own name, or no local address at all)
    every interface."""
    import socket

    from launcher.rendezvous import listen_address

    assert listen_address("127.0.0.1") == "127.0.0.1"
    assert listen_address("[::1]") == "::1"
    assert listen_address("localhost") == "127.0.0.1"
    assert listen_address("no-such-host.invalid") is None
    own = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None,
                                                     proto=socket.IPPROTO_TCP)}
    want = None if len(own) != 1 or next(iter(own)).startswith("127.") else next(iter(own))
    assert listen_address(socket.gethostname()) == want
    assert listen_address("ip6-localhost") is None  # a loopback name: every interface


def test_a_name_of_this_hosts_own_address_is_bound_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The name resolved (here by a stand-in resolver) to an address of this machine's
    interfaces: that address; to an address that is not this machine's, or to two
    addresses: every interface."""
    import socket

    import psutil

    from launcher.rendezvous import listen_address

    own = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
           if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not own:
        pytest.skip("this machine has no IPv4 address besides loopback")
    names = {"head": [own[0]], "elsewhere": ["203.0.113.7"], "two": [own[0], "203.0.113.7"]}

    def resolve(host: str, *args: object, **kwargs: object) -> list[tuple]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in names[host]]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert listen_address("head") == own[0]
    assert listen_address("elsewhere") is None
    assert listen_address("two") is None


def test_a_set_up_record_that_is_not_geminis_is_refused_with_what_it_holds() -> None:
    from launcher.elastic_agent import _member_record

    good = {"host": "h0", "slot": None, "role": "default", "workers": 2,
            "store": ["10.0.0.1", 29500]}
    assert _member_record(json.dumps(good).encode()) == good
    for bad in [b"junk", b"[]", json.dumps({**good, "workers": 0}).encode(),
                json.dumps({**good, "slot": "1"}).encode(),
                json.dumps({**good, "store": ["x"]}).encode(),
                json.dumps({k: v for k, v in good.items() if k != "host"}).encode()]:
        with pytest.raises(RuntimeError, match="not gemini's"):
            _member_record(bad)
