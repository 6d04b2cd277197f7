"""Coordination through the store, within one process: pruning, the replication secret,
a host declared dead. The tests with real hosts (``gemini run``), etcd and heartbeats are
in tests/integration/test_coordination.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from helpers import free_port


def test_old_events_and_rendezvous_rounds_are_pruned(tmp_path: Path) -> None:
    from launcher.coordination import prune_events
    from launcher.rendezvous import prune_rounds
    from launcher.store.embedded import EmbeddedStore

    store = EmbeddedStore(tmp_path / "store.db")
    try:
        for i in range(30):
            store.put(f"gemini/runs/r/events/{i:020d}-h0", b"{}")
        assert prune_events(store, "gemini/runs/r/", keep=10) == 20
        assert sorted(store.get_prefix("gemini/runs/r/events/")) == [
            f"gemini/runs/r/events/{i:020d}-h0" for i in range(20, 30)]
        kv = "gemini/rdzv/r/kv/torch.rendezvous.r."
        for round_ in range(12):
            for key in ("0", "1", "last_member"):
                store.put(f"{kv}{round_}/{key}", b"x")
        store.put("gemini/rdzv/r/state", b"s")
        assert prune_rounds(store, "r", 11) == 30
        left = store.get_prefix("gemini/rdzv/r/")
        assert sorted({k[len(kv):].partition("/")[0] for k in left if k.startswith(kv)}) == [
            "10", "11"]
        assert "gemini/rdzv/r/state" in left
    finally:
        store.close()


def test_the_replication_secret_lives_as_long_as_the_run(tmp_path: Path) -> None:
    """The first host to ask makes the secret; it stays while any host of the run is
    alive, and the last one to leave deletes it."""
    from launcher.coordination import CoordinationService, secret_key
    from launcher.replication.service import load_secret
    from launcher.slots import SlotOwner
    from launcher.store import open_store

    url = f"embedded://{tmp_path / 'store.db'}"
    run_id = f"secret-{tmp_path.name}"
    hosts = []
    for name in ("h0", "h1"):
        store = open_store(url)
        owner = SlotOwner(run_id=run_id, host_id=name, local_world_size=1)
        hosts.append((CoordinationService(store, run_id=run_id, host_id=name, owner=owner,
                                          ttl=2.0), owner, store))
    first, second = (load_secret("", store, run_id) for _, _, store in hosts)
    assert first == second and len(first) == 64
    reader = open_store(url)
    try:
        for service, owner, _ in hosts:
            record = json.loads(reader.get(secret_key(run_id)) or b"{}")
            assert record["secret"].encode() == first  # a host is still alive
            service.close()
            owner.close()
        assert reader.get(secret_key(run_id)) is None
    finally:
        reader.close()


def test_a_host_whose_lease_was_lost_holds_the_secret_with_its_new_one(tmp_path: Path) -> None:
    """A supervisor whose lease ended (a store outage longer than the TTL) registers with a
    new lease and moves its hold on the run's secret to it (``rehold_secret``, as
    ``gemini run`` sets it): the secret record names the new lease, not the old one."""
    from launcher.coordination import CoordinationService, secret_key
    from launcher.replication.service import hold_secret, load_secret
    from launcher.slots import SlotOwner
    from launcher.store import open_store

    url = f"embedded://{tmp_path / 'store.db'}"
    run_id = f"rehold-{tmp_path.name}"
    store, reader = open_store(url), open_store(url)
    owner = SlotOwner(run_id=run_id, host_id="h0", local_world_size=1)
    service = CoordinationService(store, run_id=run_id, host_id="h0", owner=owner, ttl=1.0)
    try:
        old = service.lease
        secret = load_secret("", store, run_id, lease=old)
        service.rehold_secret = lambda lease, replaces: hold_secret(store, run_id, lease,
                                                                    replaces=replaces)
        reader.revoke_lease(old.id)
        deadline = time.monotonic() + 10
        while service.lease.id == old.id and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.lease.id != old.id
        while time.monotonic() < deadline:
            record = json.loads(reader.get(secret_key(run_id)) or b"{}")
            if service.lease.id in record.get("leases", []):
                break
            time.sleep(0.05)
        assert record["secret"].encode() == secret
        assert record["leases"] == [service.lease.id]
    finally:
        service.close()
        owner.close()
        store.close()
        reader.close()


def test_a_host_whose_port_refuses_is_declared_dead_for_every_host(tmp_path: Path) -> None:
    """Three supervisors' coordination services on one store, and a spare. h1 stops
    listening where its replication server was (its supervisor died); h0 declares it
    dead: h1's lease is revoked, and h2 counts it lost through its watch, well within the
    TTL, and wakes its agent. h2 still listens: h0 leaves it alone. The spare learns of it
    too, and is handed the live peers' replicas of h1's ranks to take over."""
    import socket

    from launcher.coordination import CoordinationService
    from launcher.slots import SlotOwner
    from launcher.store import open_store

    url = f"embedded://{tmp_path / 'store.db'}"
    run_id = f"dead-{tmp_path.name}"
    listening = socket.create_server(("127.0.0.1", 0))
    hosts: dict[str, tuple[CoordinationService, SlotOwner]] = {}
    handed: list[object] = []
    running_handed: list[object] = []
    try:
        for name in ("h0", "h1", "h2", "spare"):
            owner = SlotOwner(run_id=run_id, host_id=name, local_world_size=1)
            hosts[name] = (CoordinationService(open_store(url), run_id=run_id, host_id=name,
                                               owner=owner, ttl=30.0), owner)
        gone = free_port()  # nothing listens there
        for name, port in (("h1", gone), ("h2", listening.getsockname()[1])):
            hosts[name][0].describe(state="running", replication=["127.0.0.1", port],
                                    node=f"addr_{name}_0", ranks=[int(name[1])])
        h0, h2, spare = hosts["h0"][0], hosts["h2"][0], hosts["spare"][0]
        spare.spare.take_over, h2.spare.take_over = handed.append, running_handed.append
        woken: list[str] = []
        h2.on_lost = lambda: woken.append("h2")  # its agent's monitor loop looks at once
        for holder, step in (("h2", 7), ("h1", 9)):  # what each published of rank 1
            h0.store.put(h0.prefix + f"replicas/1/{holder}", json.dumps({"step": step}).encode())
        h0.store.put(h0.prefix + "replication/plan", json.dumps({"sstar": 8}).encode())
        dead = h0.declare_dead(["h1", "h2"])
        assert list(dead) == ["h1"] and str(gone) in dead["h1"], dead
        assert h0.lost_hosts() == {"h1"} and h0.lost_nodes() == {"addr_h1_0"}
        deadline = time.monotonic() + 10  # the TTL is 30 s
        while h2.lost_hosts() != {"h1"}:
            assert time.monotonic() < deadline, "h2 did not learn of h1's death"
            time.sleep(0.05)
        assert h2.lost_nodes() == {"addr_h1_0"} and woken == ["h2"]
        assert h0.declare_dead(["h1", "h2"]) == {}  # already lost; h2 still listens
        while not handed:
            assert time.monotonic() < deadline, "the spare was not handed h1's ranks"
            time.sleep(0.05)
        # h1's own replica went with it; h2 holds s* (pinned), and published step 7
        # a while ago: s* first
        h2_address = ("127.0.0.1", listening.getsockname()[1])
        assert handed == [{1: [(h2_address, 8), (h2_address, 7)]}]
        assert not running_handed  # a running host keeps its own ranks
    finally:
        listening.close()
        for service, owner in hosts.values():
            service.close()
            owner.close()


def test_a_spare_reserves_the_slots_of_the_ranks_it_may_take_over(tmp_path: Path) -> None:
    """A running host publishes the size of its largest slot; a host that waits (a
    spare) reserves two segments of that size per local rank, within a heartbeat."""
    from launcher import memory
    from launcher.coordination import CoordinationService
    from launcher.slots import SlotOwner
    from launcher.store import open_store

    url = f"embedded://{tmp_path / 'store.db'}"
    run_id = f"reserve-{tmp_path.name}"
    running_owner = SlotOwner(run_id=run_id, host_id="h0", local_world_size=2)
    spare_owner = SlotOwner(run_id=run_id, host_id="spare", local_world_size=2)
    running = CoordinationService(open_store(url), run_id=run_id, host_id="h0",
                                  owner=running_owner, ttl=1.0)
    spare = CoordinationService(open_store(url), run_id=run_id, host_id="spare",
                                owner=spare_owner, ttl=1.0)
    try:
        running_owner.allocate(0, 3 << 20)
        running.describe(state="running")
        deadline = time.monotonic() + 10
        while spare_owner.reserve(0, 3 << 20) < 4:  # counts what is reserved, adds none
            assert time.monotonic() < deadline, "the spare reserved nothing"
            time.sleep(0.05)
        names = [n for n in memory.list_segments(spare_owner.prefix)
                 if memory.parse_slot_name(n) is None and not n.endswith(("owner", "p0"))]
        assert len(names) == 4, names
    finally:
        for service, owner in ((running, running_owner), (spare, spare_owner)):
            service.close()
            owner.close()


def test_status_lists_a_live_hosts_ranks_before_their_first_step(tmp_path: Path) -> None:
    """Rows for every rank of a live host from its start (no step published yet: memory
    None); a rank with a published step keeps it."""
    from launcher.coordination import read_status
    from launcher.store.embedded import EmbeddedStore

    store = EmbeddedStore(tmp_path / "store.db")
    try:
        store.put("gemini/runs/r/hosts/h0", json.dumps({"ranks": [0, 1, True, "2"]}).encode())
        store.put("gemini/runs/r/alive/h0", b"1")
        store.put("gemini/runs/r/ranks/1", json.dumps({"host": "h0", "memory": 7}).encode())
        store.put("gemini/runs/r/hosts/gone", json.dumps({"ranks": [5]}).encode())
        ranks = read_status(store, "r").ranks
        assert ranks == {0: {"host": "h0", "memory": None}, 1: {"host": "h0", "memory": 7}}
    finally:
        store.close()
