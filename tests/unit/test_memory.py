"""Shared-memory slots, the supervisor's slot owner, and the worker hook, in one process.

Real /dev/shm segments, a real Unix socket server; no torch elastic. The tests that start
processes are in tests/integration/test_memory.py.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from memory_support import _model, _save_two_steps, _train, run_id, supervisor

from launcher import codec, contract, copier, hook, memory, prefetch, rng
from launcher.errors import CheckpointError, StorageError
from launcher.slots import SlotOwner, SlotServer

__all__ = ["run_id", "supervisor"]  # fixtures (memory_support), used by name


def test_tree_roundtrip_keeps_types() -> None:
    tree = {"a": (1, 2.5, "x"), 3: [None, True, b"\x00\xff"], "__k": torch.float16,
            "t": torch.arange(3), "nested": {0: {"inf": float("inf")}},
            "model": {"w": torch.ones(2), "n": 4, "sub": {"b": torch.zeros(1)}},
            (1, "k"): "tuple key"}
    tensors: list[tuple[str, torch.Tensor]] = []
    skeleton = codec.flatten(tree, "", tensors)
    back = codec.unflatten(skeleton, [t for _, t in tensors])
    assert back.keys() == tree.keys()
    assert back["a"] == (1, 2.5, "x") and back[3] == [None, True, b"\x00\xff"]
    assert back["__k"] is torch.float16 and torch.equal(back["t"], tree["t"])
    assert back["nested"] == {0: {"inf": float("inf")}}
    assert back["model"]["n"] == 4 and torch.equal(back["model"]["sub"]["b"], torch.zeros(1))
    assert back[(1, "k")] == "tuple key"
    assert [path for path, _ in tensors] == ["/t", "/model/w", "/model/sub/b"]


class _WithExtraState(torch.nn.Linear):
    def get_extra_state(self) -> Any:
        return {"calls": 3}

    def set_extra_state(self, state: Any) -> None:
        pass


def _drop_bias(module: torch.nn.Module, state: dict[str, Any], prefix: str, _: Any) -> None:
    del state[prefix + "bias"]


@pytest.mark.parametrize("custom", ["none", "post_hook", "pre_hook", "extra_state",
                                    "instance_override"])
def test_model_state_is_the_state_dict_torch_gives(custom: str) -> None:
    """``hook.model_state`` reads plain modules' parameters and buffers itself: the same
    keys in the same order, the same parameters and copies of the buffers, as torch's
    ``state_dict(keep_vars=True)``, whatever a module customises."""
    shared = torch.nn.Linear(2, 2)
    inner = torch.nn.Sequential(shared, torch.nn.BatchNorm1d(2))
    model = torch.nn.Sequential(shared, inner, torch.nn.Identity(), inner)
    model.register_buffer("scratch", torch.zeros(1), persistent=False)
    model.register_parameter("absent", None)
    model.add_module("gone", None)
    calls: list[str] = []
    if custom == "post_hook":
        inner[1].register_state_dict_post_hook(_drop_bias)
    elif custom == "pre_hook":  # it runs (and could change the module first)
        inner.register_state_dict_pre_hook(lambda module, prefix, keep_vars: calls.append(prefix))
    elif custom == "extra_state":
        inner.add_module("2", _WithExtraState(2, 2))
    elif custom == "instance_override":
        inner[1]._save_to_state_dict = lambda destination, prefix, keep_vars: None  # type: ignore[method-assign]
    state = hook.model_state(model)
    assert calls == (["1.", "3."] if custom == "pre_hook" else [])
    expected = model.state_dict(keep_vars=True)
    assert list(state) == list(expected)
    for key, value in expected.items():
        if isinstance(value, torch.nn.Parameter):
            assert state[key] is value, key
        elif isinstance(value, torch.Tensor):
            assert state[key] is not value and torch.equal(state[key], value), key
        else:
            assert state[key] == value, key


def test_encoded_skeleton_is_the_json_of_the_skeleton_save_after_save() -> None:
    """``_encode`` (a memo of tensor tables) gives exactly the JSON and the tensor list of
    ``_flatten`` at every save, also when a table's keys, their types or its place change,
    or a value beside them changes only its type."""
    w, b, m = torch.ones(2), torch.zeros(3), torch.arange(4)

    def state(model: dict[Any, Any], opt: dict[Any, Any], first: list[Any],
              lr: Any = 0.1, pos: Any = 2) -> dict[str, Any]:
        return {"rng": {"python": [3, *first, None]}, "model": model,
                "optimizer": {"state": opt, "param_groups": [{"lr": lr, "params": [0, 1]}]},
                "extra": {"step": 5, "sampler": {"pos": pos}}}

    class Text(str):
        pass

    model = {"w": w, "b": b}
    opt = {0: {"step": m, "exp_avg": w}, 1: {"step": m, "exp_avg": b}}
    trees = [
        state(model, opt, []),
        state(model, opt, []),  # every table from the memo
        state(model, opt, [m]),  # every table one tensor later
        state({"b": b, "w": w}, {1: opt[1], 0: opt[0]}, []),  # same keys, other order
        state(model, {1: opt[0], 2: opt[1]}, []),
        state(model, {True: opt[0], 2: opt[1]}, []),  # True == 1, but not the same key
        state(model, {"0": opt[0], 1: opt[1]}, []),
        state(model, {0: {"step": 1.0, "exp_avg": w}, 1: opt[1]}, []),  # a scalar: no table
        state({"__w": w, "b": b}, opt, []),
        state({**model, "c": torch.nn.Parameter(w)}, {**opt, 2: {}}, []),
        state({}, {}, []),
        state(model, opt, []),
        state(model, opt, [], lr=1),  # parts without tensors: 0.1, 1, 1.0 and True differ
        state(model, opt, [], lr=1.0, pos=2.0),
        state(model, opt, [], lr=True, pos=(2,)),
        state(model, opt, [], lr=-0.0, pos=[2]),
        state(model, opt, [], lr=0.0, pos={"a": 1, "b": 2}),
        state(model, opt, [], lr=0.0, pos={"b": 2, "a": 1}),
        state(model, opt, [], lr="y", pos={Text("b"): 2}),  # marshal refuses a subclass
        state(model, opt, [], lr="x", pos={"b": 2}),
        state(model, opt, [], lr=float("nan"), pos=m),
        state(model, opt, [], lr=float("nan"), pos=2),
    ]
    memo: dict[str, Any] = {}
    for tree in trees:
        expected: list[tuple[str, torch.Tensor]] = []
        skeleton = json.dumps(codec.flatten(tree, "", expected), separators=(",", ":"))
        tensors: list[tuple[str, torch.Tensor]] = []
        assert codec.encode(tree, "", tensors, memo) == skeleton
        assert [p for p, _ in tensors] == [p for p, _ in expected]
        assert all(t is e for (_, t), (_, e) in zip(tensors, expected, strict=True))
    assert set(memo) == {"/model", "/optimizer/state", "/extra/sampler"}  # {"pos": m}: a table


def test_rng_states_are_captured_into_the_same_tensors() -> None:
    """With a Checkpointer's ``kept`` tensors every capture reuses them (so they keep their
    place in the batched copy), and each capture holds the state of its moment."""
    import random

    kept: dict[str, torch.Tensor] = {}
    first = rng.capture(kept)
    python, generator = first["python"][1].clone(), first["torch"].clone()
    drawn, sampled = random.random(), torch.rand(3)
    second = rng.capture(kept)
    assert second["python"][1] is first["python"][1] and second["torch"] is first["torch"]
    assert not torch.equal(second["python"][1], python)
    assert not torch.equal(second["torch"], generator)
    rng.restore({"python": [first["python"][0], python, None], "torch": generator})
    assert random.random() == drawn and torch.equal(torch.rand(3), sampled)


@pytest.mark.parametrize("fast", [True, False])
def test_rng_capture_equals_the_generators_getters(monkeypatch: pytest.MonkeyPatch,
                                                   fast: bool) -> None:
    """``rng.capture`` reads Python's and numpy's generators from their C objects (fast)
    or through their getters (where the probe of the object layout fails): either way it
    returns exactly what ``random.getstate()`` and ``numpy.random.get_state()`` do, through
    draws that change every field (a cached Gaussian, a twist of the words, a reseed)."""
    import random

    import numpy

    generator = numpy.random.mtrand._rand
    if fast:  # the layouts of this Python and numpy are known: the fast path is in use
        assert rng._probe_python(random.Random) >= 0 and rng._probe_numpy(generator) >= 0
    else:
        monkeypatch.setattr(rng, "_PYTHON_AT", -1)
        monkeypatch.setitem(rng._NUMPY_GAUSS, (type(generator), type(generator._bit_generator)),
                            -1)
    kept: dict[str, torch.Tensor] = {}
    steps = [lambda: None, random.random, lambda: random.gauss(0, 1), lambda: random.gauss(0, 1),
             lambda: random.getrandbits(64 * 700), lambda: random.seed(11),
             numpy.random.random_sample, numpy.random.standard_normal,
             numpy.random.standard_normal, lambda: numpy.random.randint(0, 9, size=2000),
             lambda: numpy.random.seed(5), lambda: random.setstate(random.getstate())]
    for step in steps:
        step()
        state = rng.capture(kept)
        version, internal, gauss = state["python"]
        assert (version, tuple(internal.tolist()), gauss) == random.getstate()
        kind, keys, pos, has_gauss, numpy_gauss = numpy.random.get_state()
        assert state["numpy"][0] == kind and (state["numpy"][1].numpy() == keys).all()
        assert state["numpy"][2:] == [pos, has_gauss, numpy_gauss]
    assert state["python"][1] is kept["python"] and state["numpy"][1] is kept["numpy"]
    # another bit generator than MT19937 (numpy.random.set_bit_generator): no fast read
    assert rng._probe_numpy(numpy.random.RandomState(numpy.random.PCG64(1))) == -1


def test_string_subclass_keys_are_strings() -> None:
    class Key(str):
        pass

    tensors: list[tuple[str, torch.Tensor]] = []
    skeleton = codec.flatten({Key("lr"): 0.1}, "", tensors)
    assert codec.unflatten(json.loads(json.dumps(skeleton)), []) == {"lr": 0.1}


def test_replicated_tensors_are_spread_over_the_ranks_of_a_host_alike_everywhere() -> None:
    sizes = [400, 100, 300, 200, 8, 900]
    shareable = [True, True, True, True, False, True]
    owners = codec.assign_shares(sizes, shareable, [4, 5])
    assert owners == [5, 4, 5, 5, None, 4]  # largest first, to the lighter rank
    assert codec.assign_shares(sizes, shareable, [4, 5]) == owners  # a pure function
    assert codec.assign_shares(sizes, [False] * 6, [4, 5]) == [None] * 6


def test_the_ranks_holding_the_same_shard_are_those_along_replicate_dimensions() -> None:
    node = {"mesh": json.dumps(["cpu", [[0, 1], [2, 3]], ["replicate", "shard"]]),
            "placements": [["Replicate"], ["Shard", 0]]}  # HSDP
    assert [sorted(codec.replica_ranks(node, r)) for r in range(4)] == [[0, 2], [1, 3]] * 2
    node["placements"] = [["Shard", 0], ["Shard", 1]]
    assert codec.replica_ranks(node, 1) == {1}
    node["placements"] = [["Replicate"], ["Partial", "sum"]]  # a pending sum differs
    assert codec.replica_ranks(node, 1) == {1, 3}
    assert codec.replica_ranks(node, 9) == {9}  # off the mesh


def test_a_slot_that_shares_tensors_is_read_with_its_owners_copy() -> None:
    mine, theirs = torch.arange(4.0), torch.arange(6, dtype=torch.int64).view(2, 3)
    buf, other = bytearray(memory.HEADER_SIZE + 64), bytearray(memory.HEADER_SIZE + 64)
    buf[memory.HEADER_SIZE:memory.HEADER_SIZE + 16] = mine.numpy().tobytes()
    other[memory.HEADER_SIZE:memory.HEADER_SIZE + 48] = theirs.numpy().tobytes()

    def entry(path: str, t: torch.Tensor) -> dict[str, Any]:
        return {"path": path, "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape), "offset": 0, "nbytes": t.nbytes, "xxh3": None}

    meta = {"tensors": [entry("/extra/a", mine)], "tree": [{"__tensor__": 0}, {"__tensor__": 1}],
            "shared": [[0, 3, "/model/w", "int64", [2, 3]]]}
    owner = {"tensors": [entry("/model/w", theirs)]}
    got = codec.slot_tensors(buf, meta, lambda rank: (other, owner) if rank == 3 else None)
    assert torch.equal(got[0], theirs) and torch.equal(got[1], mine)
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[3\] of its host keep"):
        codec.load_state(buf, meta)
    meta["shared"][0][4] = [3, 2]
    with pytest.raises(CheckpointError, match="does not hold /model/w as int64"):
        codec.slot_tensors(buf, meta, lambda rank: (other, owner))


def test_unsupported_value_is_a_clear_error() -> None:
    with pytest.raises(CheckpointError, match="extra/x.*set"):
        codec.flatten({"extra": {"x": {1, 2}}}, "", [])


def test_save_restore_bitwise(supervisor: SlotServer, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _model()
    extra = {"count": 3, "sched": torch.optim.lr_scheduler.StepLR(opt, 2)}
    ckpt = hook.Checkpointer(model=model, optimizer=opt, extra=extra)
    assert ckpt.restore() == 0
    for step in range(3):
        _train(model, opt)
        extra["sched"].step()
        extra["count"] = step
        ckpt.save(step)
    ckpt.wait()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    ckpt.close()

    model2, opt2 = _model()
    extra2 = {"count": -1, "sched": torch.optim.lr_scheduler.StepLR(opt2, 2)}
    torch.manual_seed(123)
    monkeypatch.setenv(contract.ENV_RESTORE_STEP, "2")
    ckpt2 = hook.Checkpointer(model=model2, optimizer=opt2, extra=extra2)
    assert ckpt2.restore() == 3
    for key, value in model2.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert extra2["count"] == 2 and extra2["sched"].last_epoch == 3
    assert torch.equal(torch.get_rng_state(), rng)
    # optimizer state must not alias the slot: training on must not change slot bytes
    _train(model2, opt2)
    ckpt2.close()
    info = [memory.inspect_slot(n) for n in memory.list_segments(supervisor.owner.prefix + "r")]
    assert {i.valid_step for i in info} == {1, 2}


@pytest.mark.parametrize("prefetched_step", [1, 0])
def test_restore_uses_the_copies_prefetched_from_its_slot(
        supervisor: SlotServer, monkeypatch: pytest.MonkeyPatch, prefetched_step: int) -> None:
    """A worker copies the large optimizer tensors of its restore step out of the slot in
    the background (as a standby does when its job arrives); restore() takes those copies
    instead of copying again, and only if they come from the slot it restores."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1100, 1100)  # a 4.8 MB weight: Adam's state of it is large
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    ckpt = hook.Checkpointer(model=model, optimizer=opt)
    ckpt.restore()
    for step in range(2):
        model(torch.randn(2, 1100)).square().mean().backward()
        opt.step()
        ckpt.save(step)
    ckpt.close()
    expected = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}

    monkeypatch.setenv(contract.ENV_RESTORE_STEP, str(prefetched_step))
    monkeypatch.setattr(prefetch, "_prefetch", None)
    prefetch.prefetch()
    started = prefetch._prefetch
    assert started is not None
    monkeypatch.setenv(contract.ENV_RESTORE_STEP, "1")
    model2 = torch.nn.Linear(1100, 1100)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.1)
    assert hook.Checkpointer(model=model2, optimizer=opt2).restore() == 2
    assert prefetch._prefetch is None
    state = opt2.state_dict()["state"][0]
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    copies = {id(t) for t in started.tensors.values()}
    assert len(copies) == 2  # exp_avg and exp_avg_sq of the weight
    used = {id(state["exp_avg"]), id(state["exp_avg_sq"])}
    assert (used == copies) == (prefetched_step == 1)


def test_a_snapshot_holds_the_state_as_save_found_it(supervisor: SlotServer,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The save thread encodes and copies the state after save() returns; what the loop
    may change before the next optimizer step (the groups' learning rate, buffers, extra
    values, RNG states) is the value at save(). The thread is held until all of them
    have changed. A learning rate held in a tensor is changed in place by schedulers."""
    model, _ = _model()
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.1), foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    extra = {"sched": sched, "seen": [1, 2]}
    ckpt = hook.Checkpointer(model=model, optimizer=opt, extra=extra)
    ckpt.restore()
    _train(model, opt)
    ckpt.save(0)
    ckpt.wait()
    _train(model, opt)
    sched.step()
    gate = threading.Event()
    assert ckpt._worker is not None
    ckpt._worker.submit(gate.wait, threading.Event())  # the thread's next job waits
    ckpt.save(1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    lr, rng_state = opt.param_groups[0]["lr"].clone(), torch.get_rng_state()
    sched.step()
    opt.param_groups[0]["betas"] = (0.1, 0.2)
    model(torch.randn(4, 8))  # batch norm's running statistics change in forward
    extra["seen"].append(3)
    torch.rand(3)
    gate.set()
    ckpt.wait()
    ckpt.close()

    model2, _ = _model()
    opt2 = torch.optim.Adam(model2.parameters(), lr=torch.tensor(0.1), foreach=False)
    extra2 = {"sched": torch.optim.lr_scheduler.StepLR(opt2, 1, gamma=0.5), "seen": []}
    monkeypatch.setenv(contract.ENV_RESTORE_STEP, "1")
    assert hook.Checkpointer(model=model2, optimizer=opt2, extra=extra2).restore() == 2
    for key, value in model2.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert torch.equal(opt2.param_groups[0]["lr"], lr)
    assert opt2.param_groups[0]["betas"] == (0.9, 0.999)
    assert extra2["seen"] == [1, 2] and extra2["sched"].last_epoch == 1
    assert torch.equal(torch.get_rng_state(), rng_state)


class _PerturbFirst(torch.optim.SGD):
    """Changes the parameters before it calls its closure, as SAM does."""

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        with torch.no_grad():
            for group in self.param_groups:
                for param in group["params"]:
                    param.add_(1.0)
        loss = closure() if closure is not None else None
        super().step()
        return loss


def test_a_step_with_a_closure_waits_for_the_copy_before_any_update(
        supervisor: SlotServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's own optimizers call their closure (forward and backward: Lightning's
    step) before updating anything: the copy of the last save overlaps it, and the
    update waits for it. An optimizer of another kind may change the parameters before
    its closure: its step waits for the copy first, and the snapshot holds the values
    at save()."""
    model, opt = _model()
    ckpt = hook.Checkpointer(model=model, optimizer=opt)
    ckpt.restore()
    _train(model, opt)
    ckpt.save(0)
    ckpt.wait()
    assert ckpt._worker is not None
    released = threading.Event()
    ckpt._worker.submit(lambda: released.wait(20), threading.Event())  # holds the copy
    ckpt.save(1)

    def closure() -> torch.Tensor:
        released.set()  # reached before the step waited for the copy
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        return loss

    began = time.monotonic()
    opt.step(closure)
    assert time.monotonic() - began < 10  # the closure did not wait for the held copy
    ckpt.close()

    model, _ = _model()
    perturbing = _PerturbFirst(model.parameters(), lr=0.1)
    ckpt = hook.Checkpointer(model=model, optimizer=perturbing)
    ckpt.restore()  # a fresh start (RESTORE_STEP -1)
    ckpt.save(2)
    ckpt.wait()
    gate = threading.Event()
    assert ckpt._worker is not None
    ckpt._worker.submit(gate.wait, threading.Event())
    ckpt.save(3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    threading.Timer(0.3, gate.set).start()  # the copy runs once the step waits for it
    perturbing.step(lambda: model(torch.randn(4, 8)).square().mean())
    ckpt.close()

    model2, _ = _model()
    monkeypatch.setenv(contract.ENV_RESTORE_STEP, "3")
    hook.Checkpointer(model=model2, optimizer=_PerturbFirst(model2.parameters(), lr=0.1)).restore()
    for key, value in model2.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_the_save_thread_runs_on_idle_cpu_time(supervisor: SlotServer) -> None:
    """A CPU job's save thread is scheduled with SCHED_IDLE: training threads go first."""
    model, opt = _model()
    ckpt = hook.Checkpointer(model=model, optimizer=opt)
    ckpt.restore()
    ckpt.save(0)
    ckpt.wait()
    assert ckpt._worker is not None
    thread = ckpt._worker.thread  # this checkpointer's, not an earlier test's
    assert thread.native_id is not None
    assert os.sched_getscheduler(thread.native_id) == os.SCHED_IDLE
    ckpt.close()


def test_a_value_that_cannot_be_saved_fails_save_or_the_next_wait(
        supervisor: SlotServer) -> None:
    model, opt = _model()
    extra: dict[str, Any] = {"x": 1}
    ckpt = hook.Checkpointer(model=model, optimizer=opt, extra=extra)
    ckpt.restore()
    extra["x"] = {1}
    with pytest.raises(CheckpointError, match="extra/x.*set"):
        ckpt.save(0)  # the first save encodes within save()
    extra["x"] = 1
    ckpt.save(0)
    extra["x"] = {2}
    ckpt.save(1)  # encoded on the thread: the error comes with the next wait
    with pytest.raises(CheckpointError, match="extra/x.*set"):
        ckpt.wait()
    ckpt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_is_copied_into_pinned_slots_and_restored(
        supervisor: SlotServer, monkeypatch: pytest.MonkeyPatch) -> None:
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512)).cuda()
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    model, opt = build()
    ckpt = hook.Checkpointer(model=model, optimizer=opt)
    ckpt.restore()
    for step in range(3):
        model(torch.randn(8, 512, device="cuda")).square().mean().backward()
        opt.step()  # waits for the copy of the step before: parameters change here
        opt.zero_grad()
        ckpt.save(step)
    ckpt.wait()
    assert len(ckpt._pinned) == 2 and all(ckpt._pinned.values())  # both slots pinned
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    ckpt.close()
    assert ckpt._pinned == {}

    model2, opt2 = build()
    monkeypatch.setenv(contract.ENV_RESTORE_STEP, "2")
    ckpt2 = hook.Checkpointer(model=model2, optimizer=opt2)
    assert ckpt2.restore() == 3
    for key, value in model2.state_dict().items():
        assert value.is_cuda and torch.equal(value.cpu(), expected[key]), key
    ckpt2.close()


def test_stall_counts_the_loops_time_in_save_and_waits(supervisor: SlotServer) -> None:
    model, opt = _model()
    ckpt = hook.Checkpointer(model=model, optimizer=opt)
    ckpt.restore()
    assert ckpt.stalled == 0.0
    _train(model, opt)
    ckpt.save(0)
    assert ckpt.stalled > 0
    ckpt.wait()
    before = ckpt.stalled
    model(torch.randn(4, model[0].in_features)).square().mean().backward()
    ckpt._pending = threading.Event()  # a copy that ends in 0.2 s: the pre-step hook waits
    threading.Timer(0.2, ckpt._pending.set).start()
    opt.step()
    assert ckpt.stalled - before >= 0.1
    ckpt.close()


def test_flipped_byte_falls_back_to_older_slot(supervisor: SlotServer) -> None:
    _save_two_steps()
    owner = supervisor.owner
    assert owner.holdings([0], 1) == {0: [0, 1]}
    newest = next(s for s in memory.iter_slots(owner.prefix) if s.valid_step == 1)
    segment = memory.attach_segment(newest.name)
    segment.view[memory.HEADER_SIZE + 5] ^= 0x01  # one flipped bit in tensor data
    segment.close()
    assert "checksum mismatch" in (memory.inspect_slot(newest.name).error or "")
    assert owner.holdings([0], 1) == {0: [0]}
    # discarded, so that nothing picks it for step 1 (a good copy may be pulled beside it)
    header = memory.inspect_slot(newest.name).header
    assert header is not None and header.state is memory.SlotState.EMPTY


def test_worker_verifies_unless_the_supervisor_did(supervisor: SlotServer,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _save_two_steps()
    newest = next(s for s in memory.iter_slots(supervisor.owner.prefix) if s.valid_step == 1)
    assert newest.header is not None
    segment = memory.attach_segment(newest.name)
    segment.view[memory.HEADER_SIZE + 5] ^= 0x01
    segment.close()
    monkeypatch.setenv(contract.ENV_RESTORE_STEP, "1")
    monkeypatch.setenv(contract.ENV_RESTORE_VERIFIED, f"0:{newest.header.seq + 1},1:{newest.header.seq}")
    model, opt = _model()
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        hook.Checkpointer(model=model, optimizer=opt).restore()


def test_mismatched_checkpoint_is_a_clear_error(supervisor: SlotServer,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _model(8)
    ckpt = hook.Checkpointer(model=model, optimizer=opt)
    ckpt.restore()
    ckpt.save(0)
    ckpt.close()
    other, other_opt = _model(16)
    monkeypatch.setenv(contract.ENV_RESTORE_STEP, "0")
    with pytest.raises(CheckpointError, match="does not match the model.*size mismatch"):
        hook.Checkpointer(model=other, optimizer=other_opt).restore()


def test_slot_grows_without_losing_newest(supervisor: SlotServer) -> None:
    owner = supervisor.owner
    names = owner.allocate(0, 1 << 16)
    seg = memory.attach_segment(names[1])
    memory.write_commit(seg.view, step=7, seq=1, rank=0, world_size=1, run_id=owner.run_id,
                        data_len=0, meta=b'{"tree":{},"tensors":[]}')
    seg.close()
    owner.allocate(0, 1 << 20)  # slot 1 holds the newest step: only slot 0 grows
    sizes = [memory.attach_segment(n).size for n in names]
    assert sizes[0] >= 1 << 20 and sizes[1] == 1 << 16
    assert owner.holdings([0], 1) == {0: [7]}


def test_growing_metadata_gets_a_larger_slot(supervisor: SlotServer,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A value of ``extra`` that grows at every step (a list of losses, say) outgrows the
    metadata room of the first slots; the next save moves to larger ones."""
    model, opt = _model()
    losses: list[str] = []
    ckpt = hook.Checkpointer(model=model, optimizer=opt, extra={"losses": losses})
    ckpt.restore()
    for step in range(150):  # 1 kB a step: 150 kB, more than the first slots' headroom
        losses.append(f"{step:04}" * 250)
        ckpt.save(step)
    ckpt.close()
    monkeypatch.setenv(contract.ENV_RESTORE_STEP, "149")
    extra: dict[str, Any] = {"losses": []}
    assert hook.Checkpointer(model=model, optimizer=opt, extra=extra).restore() == 150
    assert extra["losses"] == losses


def test_slots_of_an_abandoned_attempt_are_forgotten_before_the_round(
        supervisor: SlotServer) -> None:
    """Before a round starts, the supervisor forgets every slot, own or replica, newer
    than the step the job restores: replication, which resumes before the worker restores,
    would otherwise push the abandoned step to the peers as this rank's newest."""
    owner = supervisor.owner

    def commit(name: str, step: int, seq: int) -> None:
        seg = memory.attach_segment(name)
        memory.write_commit(seg.view, step=step, seq=seq, rank=0, world_size=1,
                            run_id=owner.run_id, data_len=0, meta=b'{"tree":{},"tensors":[]}')
        seg.close()

    own = owner.allocate(0, 1 << 16)
    commit(own[0], 190, 1)
    commit(own[1], 191, 2)
    replica = owner.allocate(0, 1 << 16, replica=True)
    commit(replica[0], 191, 2)
    owner.discard_newer_than(190)
    assert owner.holdings([0], 1) == {0: [190]}
    assert owner.holdings(None, 1, replica=True) == {0: []}


def test_shm_too_small_is_reported_with_sizes(supervisor: SlotServer) -> None:
    huge = memory.shm_free_bytes() + (1 << 30)
    with pytest.raises(StorageError, match=r"need \d+ bytes .* bytes available.*shm-size"):
        supervisor.owner.allocate(0, huge)
    with pytest.raises(StorageError, match="too small"):
        supervisor.owner.check_capacity(0, huge)


def test_inactive_outside_gemini_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(contract.ENV_SOCKET, raising=False)
    monkeypatch.setattr(hook, "_warned_inactive", False)
    model, opt = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = hook.Checkpointer(model=model, optimizer=opt)
        hook.Checkpointer(model=model)
    assert len(caught) == 1 and "not running under `gemini run`" in str(caught[0].message)
    assert ckpt.restore() == 0
    ckpt.save(0)
    ckpt.wait()


def test_saves_follow_tensors_that_move(supervisor: SlotServer) -> None:
    """Small tensors are copied from their addresses (memmove); a tensor that moves, is
    rewritten in place, changes its strides under the same address, is not contiguous,
    or is a lazily negated or conjugated view must still be saved as it is at that save."""
    model = torch.nn.Linear(4, 4)  # square: its transpose has the same shape and address
    extra = {"t": torch.arange(6.0).reshape(2, 3)}
    weight = model.weight

    def transpose() -> None:
        weight.data = weight.data.t()

    def replace() -> None:
        weight.data = torch.randn(4, 4)

    changes = [lambda: None, lambda: weight.data.mul_(2), transpose, lambda: None, replace,
               lambda: extra.update(t=torch.arange(6.0).reshape(3, 2).t()),  # not contiguous
               lambda: extra.update(t=torch.arange(6.0).reshape(2, 3) + 1), transpose,
               lambda: setattr(weight, "data", torch.randn(4, 4)._neg_view()),
               lambda: extra.update(t=torch.arange(6.0).reshape(2, 3) * (1 + 1j)),
               lambda: extra.update(t=extra["t"].conj()), lambda: weight.data.mul_(3)]
    ckpt = hook.Checkpointer(model=model, extra=extra)
    ckpt.restore()
    for step, change in enumerate(changes):
        change()
        ckpt.save(step)
        ckpt.wait()
        info = next(i for i in memory.iter_slots(supervisor.owner.prefix) if i.valid_step == step)
        segment = memory.attach_segment(info.name)
        assert info.meta is not None
        state = codec.load_state(segment.view, info.meta)
        segment.close()
        assert torch.equal(state["model"]["weight"], weight), step
        assert torch.equal(state["extra"]["t"], extra["t"]), step
    ckpt.close()


def test_small_tensors_are_checksummed_batch_by_batch(supervisor: SlotServer) -> None:
    """The small tensors lie back to back in batches of about ``COPY_CHUNK`` bytes, one
    checksum each (a batch unchanged on a peer host is not sent to it again): the
    batches cover them exactly, and a flipped byte is found in its own batch."""
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])  # 8 x 256 KiB
    ckpt = hook.Checkpointer(model=model)
    ckpt.restore()
    ckpt.save(0)
    ckpt.close()
    info = next(i for i in memory.iter_slots(supervisor.owner.prefix) if i.valid_step == 0)
    assert info.meta is not None and info.header is not None
    blocks = info.meta["blocks"]
    assert len(blocks) >= 3, blocks
    ends = [b["offset"] + b["nbytes"] for b in blocks]
    assert blocks[0]["offset"] == 0 and [b["offset"] for b in blocks[1:]] == ends[:-1]
    assert ends[-1] >= max(t["offset"] + t["nbytes"] for t in info.meta["tensors"])
    segment = memory.attach_segment(info.name)
    try:
        data = segment.view[memory.HEADER_SIZE:memory.HEADER_SIZE + info.header.data_len]
        assert all(int(b["xxh3"], 16) == xxhash.xxh3_64_intdigest(
            data[b["offset"]:b["offset"] + b["nbytes"]]) for b in blocks)
        segment.view[memory.HEADER_SIZE + blocks[1]["offset"] + 3] ^= 0x01
    finally:
        segment.close()
    assert (f"checksum mismatch in the small tensors at {blocks[1]['offset']}"
            in (memory.inspect_slot(info.name).error or ""))


def test_large_tensors_are_copied_and_hashed_in_chunks(supervisor: SlotServer,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    big = torch.nn.Linear(1100, 1100)  # 4.6 MiB of weights: copied and hashed chunk by chunk
    assert big.weight.numel() * 4 > memory.SMALL_TENSOR
    big.weight.data = big.weight.data.clone()._neg_view()  # its bytes are not its values
    ckpt = hook.Checkpointer(model=big)
    ckpt.restore()
    ckpt.save(0)
    ckpt.close()
    info = [memory.inspect_slot(n) for n in memory.list_segments(supervisor.owner.prefix + "r")]
    committed = [i for i in info if i.valid_step == 0]
    assert committed and committed[0].meta is not None
    large = [t for t in committed[0].meta["tensors"] if t["xxh3"] is not None]
    assert [t["path"] for t in large] == ["/model/weight"]
    restored = torch.nn.Linear(1100, 1100)
    monkeypatch.setenv(contract.ENV_RESTORE_STEP, "0")
    hook.Checkpointer(model=restored).restore()
    assert torch.equal(restored.weight, big.weight) and torch.equal(restored.bias, big.bias)


@pytest.mark.parametrize("nbytes", [1, memory.COPY_CHUNK - 1, memory.COPY_CHUNK, 3 * memory.COPY_CHUNK + 5])
def test_copy_and_hash_copies_exactly_and_hashes_the_copy(nbytes: int) -> None:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    buf = bytearray(nbytes + 128)
    digest = copier.copy_and_hash(buf, 64, src, nbytes)
    assert bytes(buf[64:64 + nbytes]) == src.numpy().tobytes()
    assert buf[:64] == bytes(64) and buf[64 + nbytes:] == bytes(64)
    assert digest == memory.checksum(memoryview(buf)[64:64 + nbytes])


def _checked_slot() -> tuple[memory.Segment, memory.SlotHeader, dict]:
    """A committed slot of a block of small tensors, one empty and two large tensors."""
    name = f"gemini-verifier-{os.getpid()}"
    data = os.urandom(3 * memory.COPY_CHUNK + 4096)
    block, big1, big2 = (0, 4096), (4096, 4096 + memory.COPY_CHUNK + 7), (
        4096 + memory.COPY_CHUNK + 64, len(data))
    digest = lambda lo, hi: f"{memory.checksum(memoryview(data)[lo:hi]):016x}"  # noqa: E731
    meta = {"step": 3, "blocks": [{"offset": 0, "nbytes": 4096, "xxh3": digest(*block)}],
            "tensors": [{"path": "/a", "offset": 64, "nbytes": 100, "xxh3": None},
                        {"path": "/empty", "offset": 4096, "nbytes": 0, "xxh3": digest(0, 0)},
                        {"path": "/b", "offset": big1[0], "nbytes": big1[1] - big1[0],
                         "xxh3": digest(*big1)},
                        {"path": "/c", "offset": big2[0], "nbytes": big2[1] - big2[0],
                         "xxh3": digest(*big2)}], "tree": {}}
    segment = memory.create_segment(name, memory.slot_size(len(data), 4096))
    segment.view[memory.HEADER_SIZE:memory.HEADER_SIZE + len(data)] = data
    raw = json.dumps(meta).encode()
    memory.write_commit(segment.view, step=3, seq=1, rank=0, world_size=1, run_id="r",
                        data_len=len(data), meta=raw)
    header = memory.read_header(segment.view)
    assert header is not None
    return segment, header, meta


@pytest.mark.parametrize("chunk", [1, 4095, memory.COPY_CHUNK, 10 << 20])
def test_stream_verifier_checks_in_any_chunking(chunk: int) -> None:
    segment, header, meta = _checked_slot()
    try:
        step = max(chunk, 1 << 16) if chunk == 1 else chunk  # 1-byte steps would be slow
        verifier = memory.StreamVerifier(segment.view, header.data_len, meta)
        for upto in range(0, header.data_len, step):
            verifier.advance(upto)
        verifier.finish()
        memory.verify(segment.view, header, meta)
        # a flipped byte in the second large tensor: found once that tensor is complete
        spot = meta["tensors"][3]["offset"] + 5
        segment.view[memory.HEADER_SIZE + spot] ^= 0x01
        verifier = memory.StreamVerifier(segment.view, header.data_len, meta)
        verifier.advance(header.data_len)  # found, but reported by finish()
        with pytest.raises(CheckpointError, match="tensor /c"):
            verifier.finish()
        with pytest.raises(CheckpointError, match="tensor /c"):
            memory.verify(segment.view, header, meta)
    finally:
        segment.close()
        memory.unlink_segment(segment.name)


@pytest.mark.parametrize(("change", "error"), [
    ({"offset": -64}, "out of bounds"),
    ({"nbytes": 10 << 20}, "out of bounds"),
    ({"offset": 4000}, "overlap"),
])
def test_stream_verifier_rejects_bad_ranges(change: dict, error: str) -> None:
    segment, header, meta = _checked_slot()
    try:
        meta["tensors"][2].update(change)
        with pytest.raises(CheckpointError, match=error):
            memory.StreamVerifier(segment.view, header.data_len, meta)
        meta["tensors"][2]["xxh3"] = None  # a tensor outside the block with no checksum
        meta["tensors"][2].update(offset=4096, nbytes=100)
        with pytest.raises(CheckpointError, match="has no checksum"):
            memory.StreamVerifier(segment.view, header.data_len, meta)
    finally:
        segment.close()
        memory.unlink_segment(segment.name)


def test_sharded_state_outside_its_model_is_a_clear_error() -> None:
    """A DTensor's shard can only be rebuilt on the live device mesh of the model that
    saved it; reading such a slot on its own (gemini export) says so."""
    node = {"__dtensor__": 0, "mesh": '["cpu", [0, 1], []]', "placements": [["Shard", 0]],
            "shape": [4], "stride": [1]}
    meta = {"tree": {"model": {"w": node}}, "tensors": [
        {"path": "/model/w", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8,
         "device": "cpu", "xxh3": None}]}
    buf = bytearray(memory.HEADER_SIZE + memory.ALIGN)
    with pytest.raises(CheckpointError, match=r"sharded \(DTensor\) state"):
        codec.load_state(buf, meta)


def test_a_dtensors_local_shard_is_the_one_torch_hands_out(tmp_path: Path) -> None:
    """``codec.local_shard`` reads the shard a DTensor keeps (``_local_tensor``, torch's
    own name) instead of calling ``to_local()``: the same memory, shape and values; a
    save matches views of parameters by that memory."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        tensor = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        local = codec.local_shard(tensor)
        # torch still keeps it there (else local_shard falls back to the slower call)
        assert local is tensor._local_tensor
        assert type(local) is torch.Tensor
        assert local.untyped_storage().data_ptr() == tensor.to_local().untyped_storage().data_ptr()
        assert torch.equal(local, tensor.to_local())
        plain = torch.ones(2)
        assert codec.local_shard(plain) is plain
    finally:
        dist.destroy_process_group()


# -- a hostile user on the same host ------------------------------------------------------
def test_an_unsafe_file_under_a_slot_name_is_left_alone(tmp_path: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a slot's name: a link to another file, a hard link, a file of the wrong
    mode. The owner adopts none of them (and says so), never writes through them, and
    allocates its slots as usual."""
    monkeypatch.setenv("GEMINI_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(memory, "_SHM_DIR", None)
    prefix = memory.segment_prefix("hostile", "h0")
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * 8192)
    os.chmod(victim, 0o600)
    where = memory.shm_dir()
    (where / memory.slot_name(prefix, 0, 0)).symlink_to(victim)
    os.link(victim, where / memory.slot_name(prefix, 0, 1))
    loose = where / memory.slot_name(prefix, 1, 0)
    loose.write_bytes(b"x" * 8192)
    os.chmod(loose, 0o644)
    for name in (memory.slot_name(prefix, 0, 0), memory.slot_name(prefix, 0, 1),
                 memory.slot_name(prefix, 1, 0)):
        with pytest.raises(StorageError, match="does not exist|refusing|cannot open"):
            memory.attach_segment(name)
    owner = SlotOwner(run_id="hostile", host_id="h0", local_world_size=2)
    try:
        assert owner.segments() == {}
        names = owner.allocate(0, 1 << 16)
        assert len(names) == 2 and victim.read_bytes() == b"v" * 8192
    finally:
        owner.close()
    assert victim.read_bytes() == b"v" * 8192


def test_pinned_slots_are_the_ones_holding_sstar_and_the_first_step_at_the_target() -> None:
    def header(step: int, state: memory.SlotState = memory.SlotState.COMMITTED
               ) -> memory.SlotHeader:
        return memory.SlotHeader(state, step, 1, 0, 1, 0, 0, 0, 0, 0, "r")

    pair = [header(4), header(6)]
    assert memory.pinned_slots(pair, (-1, -1)) == set()
    assert memory.pinned_slots(pair, (4, -1)) == {0}
    assert memory.pinned_slots(pair, (4, 5)) == {0, 1}  # 6: the first step >= 5
    assert memory.pinned_slots(pair, (4, 3)) == {0}  # 4 is the first step >= 3 (and s*)
    assert memory.pinned_slots(pair, (2, 7)) == set()  # neither is held: both may go
    assert memory.pinned_slots([header(4, memory.SlotState.WRITING), header(6)],
                               (4, 8)) == set()  # a slot being written holds nothing


def test_a_fresh_start_reserves_both_slots_before_the_first_save(
        supervisor: SlotServer) -> None:
    """``restore()`` on a fresh start creates both slots at the state's size before it
    returns; the first saves write into those very segments (no allocation on the
    training path)."""
    model, opt = _model(width=64)
    ckpt = hook.Checkpointer(model=model, optimizer=opt)
    assert ckpt.restore() == 0
    prefix = supervisor.owner.prefix

    def slots() -> dict[str, tuple[int, int]]:
        return {p.name: (p.stat().st_ino, p.stat().st_size)
                for p in memory.shm_dir().glob(prefix + "r0-s*")}

    reserved = slots()
    assert len(reserved) == 2, reserved
    for step in range(3):
        _train(model, opt)
        ckpt.save(step)
    ckpt.wait()
    assert slots() == reserved
    assert sorted(s.valid_step for s in memory.iter_slots(prefix)
                  if s.valid_step is not None) == [1, 2]
    ckpt.close()


def test_saves_never_overwrite_pinned_steps_and_skip_when_both_are(
        supervisor: SlotServer) -> None:
    """The supervisor pins s* and the replication target of rank 0 (``pin_own``): a save
    writes the older slot unless it holds a pinned step, then the newer; with both slots
    pinned it is skipped (and counted), and resumes once a pin moves on."""
    owner = supervisor.owner
    model, opt = _model()
    ckpt = hook.Checkpointer(model=model, optimizer=opt)
    ckpt.restore()

    def steps() -> list[int]:
        return sorted(s.valid_step for s in memory.iter_slots(owner.prefix)
                      if s.valid_step is not None)

    for step in range(2):
        _train(model, opt)
        ckpt.save(step)
    ckpt.wait()
    assert steps() == [0, 1]
    owner.pin_own(0, 0, -1)  # s* = 0: step 2 goes over step 1, the newer slot
    _train(model, opt)
    ckpt.save(2)
    ckpt.wait()
    assert steps() == [0, 2]
    owner.pin_own(0, 0, 2)  # and step 2 is being pushed: step 3 is skipped
    _train(model, opt)
    ckpt.save(3)
    ckpt.wait()
    assert steps() == [0, 2] and ckpt.skipped == 1
    # the supervisor still learns where training is: its next target lies past step 3
    assert owner.seen(0) == 3
    owner.pin_own(0, 2, 5)  # step 2 is the new s*: step 4 goes over step 0
    _train(model, opt)
    ckpt.save(4)
    ckpt.wait()
    assert steps() == [2, 4] and ckpt.skipped == 1 and owner.seen(0) == 4
    owner.forget_seen()  # a new round starts over from the step it restores
    assert owner.seen(0) == -1
    ckpt.close()


def test_the_segment_directory_is_made_anew_when_another_run_removed_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last run of a user to end on a host removes the user's empty segment directory;
    a run that resolved the directory before (and had no segment in it yet) makes it anew
    rather than failing on its first segment."""
    monkeypatch.setenv("GEMINI_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(memory, "_SHM_DIR", None)
    directory = memory.shm_dir()
    directory.rmdir()  # what release_shm_dir does in the other run
    owner = SlotOwner(run_id="anew", host_id="h0", local_world_size=1)
    try:
        assert len(owner.allocate(0, 1 << 16)) == 2 and directory.is_dir()
    finally:
        owner.close()


def test_a_restore_that_could_not_be_brought_in_fails_the_worker_not_the_service(
        supervisor: SlotServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's restore() awaits its rank's step (a pull may still be on its way); when
    the supervisor could not bring it in, the restore fails with the reason and the slot
    service goes on (the next round plans again)."""
    _save_two_steps()
    waited: list[int] = []

    def arrival(rank: int) -> int | None:
        waited.append(rank)
        raise CheckpointError(f"rank {rank}: step 1 could not be brought in: peer gone")

    supervisor.arrival = arrival
    monkeypatch.setenv(contract.ENV_RESTORE_STEP, "1")
    model, opt = _model()
    ckpt = hook.Checkpointer(model=model, optimizer=opt)
    with pytest.raises(StorageError, match="could not be brought in: peer gone"):
        ckpt.restore()
    ckpt.close()
    assert waited == [0] and supervisor.fatal is None


def test_reserved_segments_become_slots_without_allocating_again() -> None:
    """A spare reserves segments ahead; the slots made next take them (same file: its
    inode moves), as many as were reserved, with the size they ask for; the rest are
    created as usual, and closing the owner removes what was left unused."""
    owner = SlotOwner(run_id="reserve", host_id="h0", local_world_size=1)
    try:
        assert owner.reserve(3, 1 << 20) == 3
        assert owner.reserve(3, 1 << 20) == 3  # enough already: none more
        where = memory.shm_dir()
        reserved = sorted(n for n in memory.list_segments(owner.prefix)
                          if memory.parse_slot_name(n) is None and n.endswith(("v1", "v2", "v3")))
        assert len(reserved) == 3
        inodes = {os.stat(where / n).st_ino for n in reserved}
        names = owner.allocate(0, 1 << 19)
        assert {os.stat(where / n).st_ino for n in names} <= inodes
        assert all(os.stat(where / n).st_size == 1 << 19 for n in names)
        # still mapped with their pages in: writing a slot faults none of its 128 pages in
        slot = owner.segments()[0][0]
        ones = b"\x01" * slot.size
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        slot.view[:] = ones
        assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 64
        bigger = owner.allocate(1, 1 << 20, replica=True)
        stats = [os.stat(where / n) for n in bigger]
        assert sum(s.st_ino in inodes for s in stats) == 1  # one reserve left, one new
        assert all(s.st_size == 1 << 20 for s in stats)
        assert owner.own_slot_bytes() == 1 << 19
    finally:
        owner.close()
    assert memory.list_segments(owner.prefix) == []


def test_replicas_compare_their_replicated_state_by_one_digest(supervisor: SlotServer) -> None:
    """With replicated state, the slot's metadata carries one digest of the checksums of
    the parameters and optimizer state alone (batches never mix them with the per-rank
    RNG state): equal whatever the RNG, different once a parameter bit flips."""
    model, opt = _model()
    ckpt = hook.Checkpointer(model=model, optimizer=opt, replicated=True)
    ckpt.restore()
    _train(model, opt)

    def saved(step: int, seed: int) -> dict[str, Any]:
        torch.manual_seed(seed)  # another replica's RNG state
        ckpt.save(step)
        ckpt.wait()
        segment = next(s for s in supervisor.owner.segments()[0]
                       if (h := memory.read_header(s.view)) is not None and h.step == step)
        return memory.read_meta(segment.view, memory.read_header(segment.view))

    first, second = saved(1, 1), saved(2, 2)
    assert first["blocks"][0]["xxh3"] != second["blocks"][0]["xxh3"]  # the RNG differs
    assert first["agree"] == second["agree"]
    with torch.no_grad():
        next(model.parameters()).view(-1)[0:1].view(torch.int32)[0] ^= 1 << 12
    third = saved(3, 2)
    assert third["agree"]["key"] == first["agree"]["key"]
    assert third["agree"]["digest"] != first["agree"]["digest"]
    ckpt.close()
    plain = hook.Checkpointer(model=model, optimizer=opt, replicated=False)
    plain.save(4)
    plain.wait()
    segment = next(s for s in supervisor.owner.segments()[0]
                   if (h := memory.read_header(s.view)) is not None and h.step == 4)
    assert "agree" not in memory.read_meta(segment.view, memory.read_header(segment.view))
    plain.close()
