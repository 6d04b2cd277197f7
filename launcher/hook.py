"""The worker-side checkpoint hook: ``from launcher import Checkpointer``.

    ckpt = Checkpointer(model=model, optimizer=optimizer, extra={"scheduler": sched})
    start = ckpt.restore()          # 0 on a fresh start, else the step to resume at
    for step in range(start, total):
        ...train one step...
        ckpt.save(step)             # a large state finishes copying in the background

``save`` captures references to the state (model and optimizer tensors are copied later,
in a background thread, into a shared-memory slot that the supervisor owns); the
optimizer's pre-step hook waits for an unfinished copy before parameters change, so a
snapshot never mixes two steps. Small state that other code may mutate at any time
(model buffers, ``extra`` values, RNG states, the optimizer's parameter groups) is
copied synchronously. On the CPU the thread runs only on CPU time that nothing else
wants (``priority.idle_priority``): where training keeps every core busy, the copy
runs while the loop waits (for its peers, or in the optimizer's pre-step hook).

``extra`` maps names to objects with ``state_dict``/``load_state_dict`` (LR schedulers,
samplers, ...), which are restored in place, or to plain values (ints, floats, strings,
lists, dicts, tensors), which ``restore`` writes back into the same ``extra`` dict.

This module imports only the standard library, torch, xxhash, ``launcher.memory``,
``launcher.priority`` and ``launcher.rng``.
"""

from __future__ import annotations

import atexit
import base64
import collections
import ctypes
import itertools
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from launcher import memory, rng
from launcher.errors import CheckpointError, StorageError
from launcher.priority import idle_priority

logger = logging.getLogger(__name__)

# Set by the supervisor (launcher.slots); repeated here to keep this module's imports small.
ENV_SOCKET = "GEMINI_SLOT_SOCKET"
ENV_PREFIX = "GEMINI_SLOT_PREFIX"
ENV_RESTORE_STEP = "GEMINI_RESTORE_STEP"
ENV_RESTORE_VERIFIED = "GEMINI_RESTORE_VERIFIED"
ENV_SUPERVISOR_PID = "GEMINI_SUPERVISOR_PID"

_warned_inactive = False


# -- state tree <-> JSON skeleton + tensors ---------------------------------------------

_SCALARS = frozenset({type(None), bool, int, float, str})
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_STR, _DUNDER = itertools.repeat(str), itertools.repeat("__")
_DICTS = frozenset({dict, collections.OrderedDict})
_TABLE_KEYS = frozenset({int, str})
_chain = itertools.chain.from_iterable
_json_str = json.encoder.encode_basestring_ascii
_META_FRAME = 256  # metadata bytes besides the tree and the tensor records (step, block)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2, tensor parallelism): only once something
    imported ``torch.distributed.tensor`` can one exist."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _tensor_leaf(tensor: torch.Tensor, path: str, tensors: list[tuple[str, torch.Tensor]]
                 ) -> dict[str, Any]:
    """The skeleton node of a tensor; a DTensor is saved as its local shard plus what
    rebuilds it around that shard (mesh, placements, global shape and stride)."""
    if type(tensor) in _PLAIN_TENSORS or not _is_dtensor(tensor):
        tensors.append((path, tensor))
        return {"__tensor__": len(tensors) - 1}
    tensors.append((path, tensor.to_local()))  # type: ignore[attr-defined]
    return {"__dtensor__": len(tensors) - 1,
            "mesh": _mesh_key(tensor.device_mesh),  # type: ignore[attr-defined]
            "placements": [_placement(p, path) for p in tensor.placements],  # type: ignore[attr-defined]
            "shape": list(tensor.shape), "stride": list(tensor.stride())}


def _mesh_key(mesh: Any) -> str:
    return json.dumps([mesh.device_type, mesh.mesh.tolist(), list(mesh.mesh_dim_names or [])])


def _placement(placement: Any, path: str) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if type(placement).__name__ == "_StridedShard":
        return ["_StridedShard", placement.dim, placement.split_factor]
    if isinstance(placement, Shard):
        return ["Shard", placement.dim]
    if isinstance(placement, Replicate):
        return ["Replicate"]
    if isinstance(placement, Partial):
        return ["Partial", placement.reduce_op]
    raise CheckpointError(f"cannot checkpoint {path}: DTensor placement {placement!r}")


def _dtensor(node: dict[str, Any], local: torch.Tensor, meshes: dict[str, Any] | None
             ) -> torch.Tensor:
    """Rebuild a saved DTensor around its ``local`` shard, on the live mesh it was on."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if meshes is None:
        raise CheckpointError("it holds sharded (DTensor) state, which only a restore into "
                              "the model that saved it can rebuild")
    mesh = meshes.get(node["mesh"])
    if mesh is None:
        raise CheckpointError(f"it holds a DTensor on device mesh {node['mesh']}, which "
                              "no DTensor of the model or optimizer is on")
    placements = []
    for kind, *args in node["placements"]:
        if kind == "_StridedShard":
            placements.append(_StridedShard(args[0], split_factor=args[1]))
        else:
            placements.append({"Shard": Shard, "Replicate": Replicate,
                               "Partial": Partial}[kind](*args))
    return DTensor.from_local(local, mesh, placements, run_check=False,
                              shape=torch.Size(node["shape"]), stride=tuple(node["stride"]))


def _live_meshes(*trees: Any) -> dict[str, Any]:
    """The device meshes of the DTensors in ``trees`` (nested lists and dicts)."""
    meshes: dict[str, Any] = {}
    stack = list(trees)
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, torch.Tensor) and _is_dtensor(item):
            meshes.setdefault(_mesh_key(item.device_mesh), item.device_mesh)  # type: ignore[attr-defined]
    return meshes


def _flatten(obj: Any, path: str, tensors: list[tuple[str, torch.Tensor]]) -> Any:
    """JSON-able skeleton of ``obj``; tensors are replaced by their index in ``tensors``.

    This runs at every save, so leaves (scalars and tensors, nearly every node) are handled
    in the loops over their containers rather than by a call each.
    """
    kind = type(obj)
    if kind in _SCALARS:
        return obj
    if isinstance(obj, torch.Tensor):
        return _tensor_leaf(obj, path, tensors)
    if isinstance(obj, dict):
        if all(map(isinstance, obj, _STR)) and not any(map(str.startswith, obj, _DUNDER)):
            out = {}
            for k, v in obj.items():
                if type(v) in _SCALARS:
                    out[k] = v
                elif type(v) in _PLAIN_TENSORS:  # the common case, without a call
                    tensors.append((f"{path}/{k}", v))
                    out[k] = {"__tensor__": len(tensors) - 1}
                elif isinstance(v, torch.Tensor):
                    out[k] = _tensor_leaf(v, f"{path}/{k}", tensors)
                else:
                    out[k] = _flatten(v, f"{path}/{k}", tensors)
            return out
        return {"__items__": [[k if type(k) in _SCALARS else _flatten(k, f"{path}/<key>", tensors),
                               _flatten(v, f"{path}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (tuple, list)):
        if _SCALARS.issuperset(map(type, obj)):  # e.g. param ids: no recursion
            items = list(obj)
        else:
            items = [_flatten(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, bytes):
        return {"__bytes__": base64.b64encode(obj).decode()}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    raise CheckpointError(f"cannot checkpoint {path or 'value'}: unsupported type "
                          f"{type(obj).__name__} (use tensors, numbers, strings, lists, dicts)")


def _encode(obj: Any, path: str, tensors: list[tuple[str, torch.Tensor]],
            memo: dict[str, tuple[Any, str, list[str]]]) -> str:
    """``json.dumps(_flatten(obj, path, tensors), separators=(",", ":"))``, faster at every
    save after the first.

    A *tensor table* (a dict of plain tensors, like a model's state_dict, or of such dicts,
    like an optimizer's per-parameter state) has a skeleton that depends only on its keys
    and on where its tensors start in ``tensors``. ``memo`` (path -> (structure, JSON, tensor
    paths)) keeps the last table seen at each path; a table with the same structure takes
    its JSON from there instead of building and encoding a node per tensor. The structure
    holds every key with its exact type, so the JSON is exactly what encoding would give.
    (A memo of the parts without tensors, keyed by marshal's bytes of them, halved their
    cost on warm caches and saved nothing within a training loop: not kept.)
    """
    if type(obj) in _DICTS:
        structure = _table_structure(obj, len(tensors))
        if structure is not None:
            known = memo.get(path)
            if known is not None and known[0] == structure:
                values = obj.values()
                if not structure[1]:  # a dict of dicts of tensors
                    values = _chain(map(dict.values, values))
                tensors.extend(zip(known[2], values, strict=True))
                return known[1]
            base = len(tensors)
            text = json.dumps(_flatten(obj, path, tensors), separators=(",", ":"))
            memo[path] = (structure, text, [p for p, _ in tensors[base:]])
            return text
        if any(type(v) in _DICTS for v in obj.values()) and all(
                map(isinstance, obj, _STR)) and not any(map(str.startswith, obj, _DUNDER)):
            # a dict of parts (the state, an optimizer's state_dict): encode each on its own
            return "{" + ",".join(f"{_json_str(k)}:{_encode(v, f'{path}/{k}', tensors, memo)}"
                                  for k, v in obj.items()) + "}"
    return json.dumps(_flatten(obj, path, tensors), separators=(",", ":"))


def _table_structure(obj: dict[Any, Any], base: int) -> tuple[Any, ...] | None:
    """What the skeleton of ``obj`` depends on, if ``obj`` is a tensor table (see
    ``_encode``): its first tensor's index and its keys (for a dict of dicts, each dict's
    keys); None if it is not one. Outer keys of a dict of dicts must be exactly int or
    str, so that equal keys are the same key (True == 1, but encodes otherwise); inner
    keys are strings, which equal only strings. Every pass runs in C (``map``)."""
    values = obj.values()
    if _PLAIN_TENSORS.issuperset(map(type, values)):
        return (base, True, tuple(obj)) if all(map(isinstance, obj, _STR)) else None
    if not (_DICTS.issuperset(map(type, values)) and _TABLE_KEYS.issuperset(map(type, obj))
            and _PLAIN_TENSORS.issuperset(map(type, _chain(map(dict.values, values))))):
        return None
    inner = tuple(map(tuple, values))
    if not all(map(isinstance, _chain(inner), _STR)):
        return None
    return (base, False, tuple(obj), inner)


def _unflatten(node: Any, tensors: list[torch.Tensor], meshes: dict[str, Any] | None = None
               ) -> Any:
    """The state tree of a skeleton; DTensors are rebuilt on the live ``meshes`` (see
    ``_live_meshes``), and None refuses them."""
    if isinstance(node, list):
        return [_unflatten(v, tensors, meshes) for v in node]
    if not isinstance(node, dict):
        return node
    if "__tensor__" in node:
        return tensors[node["__tensor__"]]
    if "__dtensor__" in node:
        return _dtensor(node, tensors[node["__dtensor__"]], meshes)
    if "__tuple__" in node:
        return tuple(_unflatten(v, tensors, meshes) for v in node["__tuple__"])
    if "__items__" in node:
        return {_unflatten(k, tensors, meshes): _unflatten(v, tensors, meshes)
                for k, v in node["__items__"]}
    if "__bytes__" in node:
        return base64.b64decode(node["__bytes__"])
    if "__dtype__" in node:
        return getattr(torch, node["__dtype__"])
    return {k: _unflatten(v, tensors, meshes) for k, v in node.items()}


_MODULE = torch.nn.Module


def _model_state(model: torch.nn.Module) -> dict[str, Any]:
    """``model.state_dict(keep_vars=True)`` with its tensors that are not parameters (buffers)
    cloned: parameters change only in the optimizer step, which waits for the copy;
    buffers (batch-norm statistics, ...) change in forward, so they are copied now.

    Where no module customises its state dict (hooks, overrides, extra state), it is read
    straight from the modules' parameters and buffers, in the order ``Module.state_dict``
    uses: the same keys and tensors, without torch's recursive calls (the example's 26
    modules: about 105 us within a training loop, against about 150 us)."""
    state: dict[str, Any] = {}
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    while stack:
        prefix, module = stack.pop()
        kind, own = type(module), module.__dict__
        if (kind.state_dict is not _MODULE.state_dict
                or kind._save_to_state_dict is not _MODULE._save_to_state_dict
                or kind.get_extra_state is not _MODULE.get_extra_state
                or module._state_dict_pre_hooks or module._state_dict_hooks
                or "state_dict" in own or "_save_to_state_dict" in own):
            state = dict(model.state_dict(keep_vars=True))  # torch's own walk
            break
        for name, param in module._parameters.items():
            if param is not None:
                state[prefix + name] = param
        skip = module._non_persistent_buffers_set
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in skip:
                state[prefix + name] = buffer
        stack.extend(reversed([(f"{prefix}{name}.", child)
                               for name, child in module._modules.items() if child is not None]))
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            state[key] = value.detach().clone()
    return state


def _after_first_step(optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The shape of ``optimizer.state_dict()`` after its first step, while it has no state
    yet (torch's optimizers create it then): from a twin of the same class stepped once
    over shape-only ("meta") copies of the parameters. None when it has state already,
    or the twin cannot be made (a fused or custom optimizer, sharded parameters)."""
    if optimizer.state or any(_is_dtensor(p) for group in optimizer.param_groups
                              for p in group["params"]):
        return None
    try:
        groups = [{**group, "params": [torch.empty_like(p, device="meta")
                                       for p in group["params"]]}
                  for group in optimizer.param_groups]
        for group in groups:
            for p in group["params"]:
                p.grad = torch.empty_like(p)
        kind: Any = type(optimizer)  # torch's optimizers take (params, **defaults)
        twin = kind(groups)
        twin.step()
        after: dict[str, Any] = twin.state_dict()
    except Exception as exc:  # any failure: the first save allocates instead
        logger.debug("gemini: cannot foresee the optimizer's state: %s", exc)
        return None
    after["param_groups"] = optimizer.state_dict()["param_groups"]
    return after


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None))


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Checkpointer:
    """Saves and restores a worker's training state through gemini's in-memory tier."""

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 extra: dict[str, Any] | None = None, *,
                 replicated: bool | None = None) -> None:
        """``replicated``: whether every data-parallel rank holds the whole model and
        optimizer state (DDP), so that when the job shrinks or grows any rank's copy
        serves any rank. None (the default) says yes unless the state holds DTensors
        (FSDP2, tensor parallelism); pass False for model-parallel state kept in plain
        tensors (each rank its own shard), which then restores only into the same world
        size."""
        self.model = model
        self.optimizer = optimizer
        self.extra: dict[str, Any] = extra if extra is not None else {}
        self.replicated = replicated
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        self._address = os.environ.get(ENV_SOCKET, "")
        self._prefix = os.environ.get(ENV_PREFIX, "")
        self.active = bool(self._address and self._prefix)
        self._segments: list[memory.Segment | None] = [None, None]
        self._pins: memory.Segment | None = None  # the steps the slots keep (memory.PINS)
        self._newest: int | None = None  # slot index holding the newest committed step
        self._seq = 0
        self._worker: _Worker | None = None
        self._saved = False  # whether save() was called yet
        self._reserved: threading.Event | None = None  # set once the slots are reserved
        self._pending: threading.Event | None = None
        self._error: BaseException | None = None
        self._conn: socket.socket | None = None
        self._stream: Any = None
        self._layouts: list[_Layout | None] = [None, None]
        self._rng: dict[str, Any] = {}  # see rng.capture
        self._memo: dict[str, tuple[Any, str, list[str]]] = {}  # see _encode
        # id(segment) -> its address registered with CUDA as pinned memory (0: failed)
        self._pinned: dict[int, int] = {}
        self._closed = False
        self._heartbeat: memory.Segment | None = None
        self._beat_view: memoryview | None = None  # this rank's counter in it
        self._beats = 0
        # Seconds the training loop has spent blocked in save() and in waits for a copy
        # (wait(), the optimizer pre-step hook): how long checkpointing has stalled it.
        self.stalled = 0.0
        # Saves skipped because both slots held a step the supervisor pinned (replication
        # of one step still in flight while the other is the globally restorable one).
        self.skipped = 0
        if not self.active:
            _warn_inactive()
            return
        _die_with_supervisor()
        self._attach_heartbeat()
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._before_optimizer_step)
        atexit.register(self.close)

    # -- public API -----------------------------------------------------------------------
    def restore(self) -> int:
        """Load the step the supervisor chose; return the first step to run (0 if none)."""
        if not self.active:
            return 0
        self._wait()
        step = int(os.environ.get(ENV_RESTORE_STEP, "-1"))
        verified = _verified_seqs().get(self.rank)
        if step >= 0:  # a pull from a peer may still be on its way: wait for this rank's
            seq = self._request({"op": "await", "rank": self.rank}).get("seq")
            verified = verified if seq is None else int(seq)
        self._attach_existing()
        if step < 0 and all(segment is None for segment in self._segments):
            # Fail before training, not at the first save, if /dev/shm is too small; then
            # reserve and pre-fault both slots in the background, so that the first save
            # costs no more than a steady one.
            state = self._capture()
            if self.optimizer is not None and (after := _after_first_step(self.optimizer)):
                state["optimizer"] = after  # its state appears at the first step
            tensors: list[tuple[str, torch.Tensor]] = []
            tree = _encode(state, "", tensors, {})
            nbytes = _slot_bytes(tensors, len(tree))
            self._request({"op": "check", "rank": self.rank, "nbytes": nbytes})
            self._reserved = threading.Event()
            self._copier().submit(lambda: self._reserve(nbytes), self._reserved)
        if step < 0:
            self._discard_newer_than(-1)
            return 0
        index = self._find(step)
        if index is None:
            raise CheckpointError(f"rank {self.rank}: step {step} is not in local memory")
        segment = self._segments[index]
        assert segment is not None
        header = memory.read_header(segment.view)
        assert header is not None
        meta = memory.read_meta(segment.view, header)
        if header.seq != verified:  # else the supervisor just did
            memory.verify(segment.view, header, meta)
        global _prefetch
        prefetched = _prefetch.take(segment.name, header.seq) if _prefetch is not None else {}
        _prefetch = None
        self._load(segment, meta, step, prefetched)
        self._discard_newer_than(step)
        self._newest = index
        return step + 1

    def heartbeat(self) -> None:
        """Tell the supervisor that this worker is making progress. Optimizer steps and
        ``save()`` do it already; call it within long phases that have neither (an
        evaluation, say) when the job runs with ``--hang-timeout``."""
        view = self._beat_view
        if view is not None:
            self._beats += 1
            view[0] = self._beats

    def save(self, step: int) -> None:
        """Snapshot the state as of the end of ``step``; returns before the copy is done."""
        began = time.perf_counter()
        self.heartbeat()
        try:
            self._save(step)
        finally:
            self.stalled += time.perf_counter() - began

    def _save(self, step: int) -> None:
        self._wait()
        if not self.active or self._closed:
            return
        index = self._next_slot()
        if self._pins is not None:
            memory.write_seen(self._pins.view, step)
        if index is None:
            self.skipped += 1
            if self.skipped == 1:
                logger.info("gemini: rank %d skips saves while both its slots hold steps "
                            "that replication keeps (step %d first)", self.rank, step)
            return
        state = self._capture()
        ready = None  # where the training stream stands: the GPU copies start there
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record()
        encoded = None
        if not self._saved:
            self._saved = True
            # The first save encodes here: a value it cannot save fails this call.
            encoded = self._encode(state)
        done = threading.Event()
        self._pending = done
        self._copier(ready is None).submit(
            lambda: self._copy(index, step, state, encoded, ready), done)

    def _copier(self, idle: bool | None = None) -> _Worker:
        """The background copy thread, started on first use: on the CPU it takes only idle
        CPU time; with CUDA it queues the GPU's copies, which must not wait for a core."""
        if self._worker is None:
            if idle is None:
                idle = not torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
            self._worker = _Worker(idle=idle)
        return self._worker

    def _reserve(self, nbytes: int) -> None:
        """Create both slots at ``nbytes`` and map them (the copy thread, before the first
        save: its job queues behind this one)."""
        try:
            for index in range(2):
                self._slot_for(index, nbytes)
        except Exception as exc:  # the first save tries again, and reports it
            logger.debug("gemini: rank %d could not reserve its slots: %s", self.rank, exc)

    def wait(self) -> None:
        """Block until the last ``save`` is committed; re-raise its error, if any."""
        began = time.perf_counter()
        try:
            self._wait()
        finally:
            self.stalled += time.perf_counter() - began

    def _wait(self) -> None:
        pending = self._pending
        if pending is not None:
            pending.wait()
            self._pending = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Finish the pending copy, release the slots (the supervisor keeps them) and the
        references to the model, optimizer and ``extra``. Called at exit too."""
        if self._closed:
            return
        try:
            if self._reserved is not None:
                self._reserved.wait()
            self._wait()
        finally:
            self._closed = True
            # Let the model (a DDP wrapper, say) go when the script lets it go: a DDP that
            # outlives destroy_process_group can abort the process at exit under gloo.
            self.model, self.optimizer, self.extra = None, None, {}
            self._layouts = [None, None]  # their tensors view the mappings
            for segment in self._segments:
                if segment is not None:
                    self._unpin(segment)
                    segment.close()
            if self._pins is not None:
                self._pins.close()
            if self._beat_view is not None and self._heartbeat is not None:
                self._beat_view[0] = memory.HEARTBEAT_DONE  # no hang from here on
                self._beat_view.release()
                self._beat_view = None
                self._heartbeat.close()
            if self._conn is not None:
                self._conn.close()

    # -- capture and load -----------------------------------------------------------------
    def _capture(self) -> dict[str, Any]:
        state: dict[str, Any] = {"rng": rng.capture(self._rng)}
        if self.model is not None:
            state["model"] = _model_state(self.model)  # buffers copied, parameters not
        if self.optimizer is not None:
            optimizer = self.optimizer.state_dict()
            # The thread encodes the state later; schedulers and loops change the groups
            # (their learning rate, ...) before the next optimizer step, so copy them now.
            if isinstance(optimizer, dict) and "param_groups" in optimizer:
                optimizer["param_groups"] = _clone_tensors(optimizer["param_groups"])
            state["optimizer"] = optimizer
        extra: dict[str, Any] = {}
        for key, value in self.extra.items():
            if _stateful(value):
                extra[key] = _clone_tensors(value.state_dict())
            else:
                extra[key] = _clone_tensors(value)
        state["extra"] = extra
        return state

    def _load(self, segment: memory.Segment, meta: dict[str, Any], step: int,
              prefetched: dict[int, torch.Tensor]) -> None:
        """Load the state of ``segment``; ``prefetched`` holds private copies of some of
        its tensors (by index), used instead of copying them again."""
        tensors = [prefetched[i] if i in prefetched else _slot_tensor(segment.view, entry)
                   for i, entry in enumerate(meta["tensors"])]
        owned = frozenset(map(id, prefetched.values()))
        try:
            state = _unflatten(meta["tree"], tensors, _live_meshes(
                [*self.model.parameters(), *self.model.buffers()]
                if self.model is not None else [],
                [g["params"] for g in self.optimizer.param_groups]
                if self.optimizer is not None else []))
            if self.model is not None:
                if "model" not in state:
                    raise CheckpointError("it holds no model state")
                self.model.load_state_dict(state["model"])
            if self.optimizer is not None:
                if "optimizer" not in state:
                    raise CheckpointError("it holds no optimizer state")
                self.optimizer.load_state_dict(_clone_tensors(state["optimizer"], owned))
            for key, value in self.extra.items():
                if key not in state["extra"]:
                    raise CheckpointError(f"it holds no extra value {key!r}")
                saved = _clone_tensors(state["extra"][key], owned)
                if _stateful(value):
                    value.load_state_dict(saved)
                else:
                    self.extra[key] = saved
        except (RuntimeError, ValueError, KeyError) as exc:
            reason = " ".join(str(exc).split())
            raise CheckpointError(f"rank {self.rank}: checkpoint of step {step} does not "
                                  f"match the model/optimizer: {reason}") from None
        except CheckpointError as exc:
            raise CheckpointError(f"rank {self.rank}: checkpoint of step {step}: {exc}") from None
        rng.restore(_clone_tensors(state["rng"]))

    # -- slots ----------------------------------------------------------------------------
    def _attach_existing(self) -> None:
        for index in range(2):
            name = memory.slot_name(self._prefix, self.rank, index)
            if self._segments[index] is None and (memory.SHM_DIR / name).exists():
                # no pre-faulting: a restore reads one slot once; saves fault pages lazily
                self._segments[index] = memory.attach_segment(name, populate=False)
        for segment in self._segments:
            header = memory.read_header(segment.view) if segment is not None else None
            if header is not None:
                self._seq = max(self._seq, header.seq)

    def _next_slot(self) -> int | None:
        """The slot the next save writes: the older one, unless it holds a step the
        supervisor pinned, then the newer one, unless that one does too (None: skip)."""
        order = [0, 1] if self._newest is None else [1 - self._newest, self._newest]
        if self._pins is None:
            name = memory.pins_name(self._prefix, self.rank)
            if not (memory.SHM_DIR / name).exists():
                return order[0]
            self._pins = memory.attach_segment(name, populate=False)
        kept = memory.pinned_slots(
            [memory.read_header(seg.view) if seg is not None else None for seg in self._segments],
            memory.read_pins(self._pins.view))
        return next((i for i in order if i not in kept), None)

    def _find(self, step: int) -> int | None:
        return _newest_holding(step, [memory.read_header(segment.view) if segment else None
                                      for segment in self._segments])

    def _discard_newer_than(self, step: int) -> None:
        """Forget steps after the restored one: they belong to an abandoned attempt."""
        for segment in self._segments:
            header = memory.read_header(segment.view) if segment is not None else None
            if segment is not None and header is not None and header.step > step:
                memory.set_state(segment.view, memory.SlotState.EMPTY)

    def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        if self._conn is None:
            self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._conn.connect("\0" + self._address[1:])
            self._stream = self._conn.makefile("rwb")
        self._stream.write((json.dumps(message) + "\n").encode())
        self._stream.flush()
        line = self._stream.readline()
        if not line:
            raise StorageError("the gemini supervisor closed the slot connection")
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise StorageError(reply.get("error", "slot request failed"))
        return reply

    def _slot_for(self, index: int, nbytes: int) -> memory.Segment:
        segment = self._segments[index]
        if segment is None or segment.size < nbytes:
            reply = self._request({"op": "alloc", "rank": self.rank, "nbytes": nbytes})
            self._layouts = [None, None]  # their tensors view mappings about to be replaced
            for i, name in enumerate(reply["slots"]):
                old = self._segments[i]
                if old is None or old.size < nbytes or not old.path.exists() or (
                    os.stat(old.path).st_size != old.size
                ):
                    if old is not None:
                        self._unpin(old)
                        old.close()
                    self._segments[i] = memory.attach_segment(name)
            segment = self._segments[index]
            assert segment is not None
            if segment.size < nbytes:
                raise StorageError(f"slot {segment.name} has {segment.size} bytes, "
                                   f"need {nbytes}")
        return segment

    def _pin(self, segment: memory.Segment) -> None:
        """Register ``segment`` with CUDA as pinned (page-locked) memory, once, so that
        copies from the GPU into it run asynchronously (DMA) at full speed; without it a
        device-to-host copy is staged and synchronous."""
        if id(segment) in self._pinned:
            return
        address = torch.frombuffer(segment.view, dtype=torch.uint8).data_ptr()
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        error = int(cudart.cudaHostRegister(address, segment.size, 0))
        if error:
            logger.warning("gemini: cannot pin slot %s for CUDA (error %d); copies from the "
                           "GPU will be synchronous", segment.name, error)
            address = 0
        self._pinned[id(segment)] = address

    def _unpin(self, segment: memory.Segment) -> None:
        address = self._pinned.pop(id(segment), 0)
        if address:
            torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]

    # -- the copy (on the background thread) ----------------------------------------------
    def _before_optimizer_step(self, *_: Any) -> None:
        self.heartbeat()
        self.wait()

    def _attach_heartbeat(self) -> None:
        """Map this rank's counter in the supervisor's heartbeat segment (launcher.health)."""
        name = os.environ.get(memory.ENV_HEARTBEAT, "")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if not name:
            return
        try:
            segment = memory.attach_segment(name, populate=False)
        except StorageError:
            return  # a supervisor without hang detection
        offset = local_rank * memory.HEARTBEAT_STRIDE
        if offset + 8 <= segment.size:
            self._heartbeat = segment
            self._beat_view = memoryview(segment.view)[offset:offset + 8].cast("Q")
        else:
            segment.close()

    def _encode(self, state: dict[str, Any]) -> tuple[str, list[tuple[str, torch.Tensor]]]:
        """The skeleton's JSON of ``state`` (from ``_capture``) and its tensors, in order."""
        tensors: list[tuple[str, torch.Tensor]] = []
        return _encode(state, "", tensors, self._memo), tensors

    def _copy(self, index: int, step: int, state: dict[str, Any],
              encoded: tuple[str, list[tuple[str, torch.Tensor]]] | None, ready: Any) -> None:
        try:
            self._write(index, step, *(encoded or self._encode(state)), ready)
        except BaseException as exc:  # surfaced by the next wait()
            self._error = exc

    def _write(self, index: int, step: int, tree: str, tensors: list[tuple[str, torch.Tensor]],
               ready: Any) -> None:
        """Copy the state (``tree``: its skeleton's JSON) into slot ``index`` and commit it."""
        layout = self._layout_for(index, tensors, len(tree))
        buf = layout.segment.view
        memory.set_state(buf, memory.SlotState.WRITING)
        assert self._worker is not None
        block_digest, digests = self._worker.copy_all(buf, layout, [t for _, t in tensors],
                                                      ready)
        big = iter(digests)
        records = ",".join(record if isinstance(record, str)
                           else record[0] + f'"{next(big):016x}"' + record[1]
                           for record in layout.records)
        block = {"offset": layout.block[0], "nbytes": layout.block[1] - layout.block[0],
                 "xxh3": f"{block_digest:016x}"}
        replicated = self.replicated if self.replicated is not None else (
            '"__dtensor__"' not in tree)
        meta = (f'{{"step":{step},"replicated":{"true" if replicated else "false"},'
                f'"tensors":[{records}],"blocks":[{json.dumps(block)}],"tree":' + tree + "}"
                ).encode()
        self._seq += 1
        memory.write_commit(buf, step=step, seq=self._seq, rank=self.rank,
                            world_size=self.world_size, run_id=self.run_id,
                            data_len=layout.data_len, meta=meta)
        self._newest = index

    def _layout_for(self, index: int, tensors: list[tuple[str, torch.Tensor]],
                    tree_len: int) -> _Layout:
        """Where each tensor goes in slot ``index``; reused while the state keeps its shape
        and the slot has room for the metadata (``tree_len``: its tree's part), which grows
        with values in ``extra`` like a list of losses."""
        signature = tuple((path, t.dtype, t.shape, t.device) for path, t in tensors)
        cached = self._layouts[index]
        if cached is not None and cached.signature == signature and (
            cached.segment is self._segments[index]
        ) and tree_len + cached.records_len + _META_FRAME <= cached.meta_room:
            return cached
        self._layouts[index] = None
        sizes = [_tensor_bytes(t) for _, t in tensors]
        small = [0 < n <= memory.SMALL_TENSOR and t.device.type == "cpu"
                 and t.layout == torch.strided
                 for n, (_, t) in zip(sizes, tensors, strict=True)]
        # Small tensors first, back to back: one checksum covers exactly them.
        offsets, offset = [0] * len(tensors), 0
        for first_pass in (True, False):
            for i, nbytes in enumerate(sizes):
                if small[i] == first_pass:
                    offsets[i] = offset
                    offset += (nbytes + memory.ALIGN - 1) // memory.ALIGN * memory.ALIGN
        segment = self._slot_for(index, _slot_bytes(tensors, tree_len))
        if any(t.is_cuda for _, t in tensors):
            self._pin(segment)
        buf = segment.view
        small_at = [o for o, is_small in zip(offsets, small, strict=True) if is_small]
        small_end = max((o + n for o, n, f in zip(offsets, sizes, small, strict=True) if f),
                        default=0)
        # Batches of small tensors of about memory.COPY_CHUNK bytes: each is hashed from the cache
        # right after it is copied. (first, last + 1, end offset), in slot order.
        groups: list[tuple[int, int, int]] = []
        first = 0
        for i, start in enumerate(small_at):
            if start - small_at[first] >= memory.COPY_CHUNK:
                groups.append((first, i, start))
                first = i
        if small_at:
            groups.append((first, len(small_at), small_end))
        # Each group is copied by one torch.cat of byte views of its tensors (and zero
        # padding up to the next tensor's offset) into the group's bytes in the slot: one
        # call instead of a copy dispatch per tensor (about 40 us for the example's 116
        # tensors, against 500 us). The byte views are made by the copy, when a tensor's
        # address differs from the one its view was made for.
        small_sizes = [n for n, f in zip(sizes, small, strict=True) if f]
        parts: list[list[torch.Tensor]] = []
        where: list[tuple[int, int]] = []
        zeros = torch.zeros(memory.ALIGN, dtype=torch.uint8)
        for g, (lo, hi, end) in enumerate(groups):
            group: list[torch.Tensor] = []
            for i in range(lo, hi):
                where.append((g, len(group)))
                group.append(zeros[:0])
                pad = (small_at[i + 1] if i + 1 < hi else end) - small_at[i] - small_sizes[i]
                if pad:
                    group.append(zeros[:pad])
            parts.append(group)
        layout = _Layout(
            signature=signature, segment=segment, data_len=offset, offsets=offsets,
            nbytes=sizes, small=small, records=[],
            dsts=[torch.frombuffer(buf, dtype=t.dtype, count=t.numel(),
                                   offset=memory.HEADER_SIZE + o).view(t.shape)
                  for o, (_, t), f in zip(offsets, tensors, small, strict=True) if f],
            block=(min(small_at, default=0), small_end), groups=groups,
            blocks=[torch.frombuffer(buf, dtype=torch.uint8, count=end - small_at[lo],
                                     offset=memory.HEADER_SIZE + small_at[lo])
                    for lo, _, end in groups],
            parts=parts, where=where, ptrs=[-1] * len(small_at),
            meta_room=segment.size - memory.HEADER_SIZE - offset, records_len=0)
        for (path, tensor), start, is_small in zip(tensors, offsets, small, strict=True):
            record = json.dumps({"path": path, "dtype": str(tensor.dtype).split(".")[-1],
                                 "shape": list(tensor.shape), "offset": start,
                                 "nbytes": _tensor_bytes(tensor), "device": str(tensor.device),
                                 "xxh3": None if is_small else "@"}, separators=(",", ":"))
            if is_small:  # runs of small tensors' records are joined once, here
                if layout.records and isinstance(layout.records[-1], str):
                    layout.records[-1] += "," + record
                else:
                    layout.records.append(record)
            else:
                head, tail = record.split('"@"')
                layout.records.append((head, tail))
        layout.records_len = sum(len(r) + 1 if isinstance(r, str) else len(r[0]) + len(r[1]) + 19
                                 for r in layout.records)
        self._layouts[index] = layout
        return layout


def _slot_bytes(tensors: list[tuple[str, torch.Tensor]], tree_len: int) -> int:
    """The size of a slot for ``tensors`` with a tree of ``tree_len`` bytes of JSON: the
    aligned tensors and room for the metadata, which grows a little (values in ``extra``
    like a list of losses)."""
    data = sum((_tensor_bytes(t) + memory.ALIGN - 1) // memory.ALIGN * memory.ALIGN
               for _, t in tensors)
    return memory.slot_size(data, tree_len + _META_FRAME + sum(len(p) + 200 for p, _ in tensors))


@dataclass
class _Layout:
    """The placement of one state's tensors in one slot (see ``Checkpointer._layout_for``)."""

    signature: tuple[Any, ...]
    segment: memory.Segment
    data_len: int
    offsets: list[int]
    nbytes: list[int]
    small: list[bool]  # copied in one batch, checked by the block checksum
    # The tensors' metadata JSON, in the tree's order: a string for each run of small
    # tensors (complete), a pair for a large one (split around its checksum).
    records: list[str | tuple[str, str]]
    dsts: list[torch.Tensor]  # the small tensors' places in the slot, shaped like them
    block: tuple[int, int]  # byte range of the slot's data covering every small tensor
    groups: list[tuple[int, int, int]]  # batches of ``dsts`` copied and hashed together
    blocks: list[torch.Tensor]  # each group's bytes in the slot
    parts: list[list[torch.Tensor]]  # each group's torch.cat inputs: byte views and padding
    where: list[tuple[int, int]]  # each small tensor's (group, index in its parts)
    ptrs: list[int]  # each small tensor's address when its byte view was made (-1: none)
    meta_room: int  # bytes of the slot left for the metadata
    records_len: int  # bytes of the records in the metadata, with their checksums


class _Worker:
    """A daemon thread that runs one job at a time: the background copy."""

    def __init__(self, *, idle: bool) -> None:
        self._idle = idle
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = (
            queue.SimpleQueue())
        self._streams: dict[torch.device, Any] = {}  # a side stream per CUDA device
        self.thread = threading.Thread(target=self._run, name="gemini-save", daemon=True)
        self.thread.start()

    def submit(self, job: Callable[[], None], done: threading.Event) -> None:
        self._jobs.put((job, done))

    def _run(self) -> None:
        if self._idle:
            idle_priority()
        while True:
            job, done = self._jobs.get()
            try:
                job()
            finally:
                done.set()

    def copy_all(self, buf: Any, layout: _Layout, tensors: list[torch.Tensor],
                 ready: Any = None) -> tuple[int, list[int]]:
        """Copy every tensor to its place in the slot; return the checksum of the block of
        small tensors and the checksums of the large ones.

        Small CPU tensors are copied in batches (see ``Checkpointer._layout_for``) and
        share one checksum; other large CPU tensors go through ``copy_and_hash``. CUDA
        tensors are copied by the GPU on a side stream, once the training stream reaches
        ``ready`` (the event save() recorded), into the pinned slot, while this thread
        copies the CPU tensors; they are hashed when that stream is done.
        """
        # save() records ``ready`` exactly when the state has CUDA tensors
        on_gpu = self._start_gpu_copies(buf, layout, tensors, ready) if ready is not None else []
        srcs = [t for t, small in zip(tensors, layout.small, strict=True) if small]
        ptrs = list(map(torch.Tensor.data_ptr, srcs))
        if ptrs != layout.ptrs:
            _refresh_byte_views(layout, srcs, ptrs)
        # A byte view covers its tensor's bytes while the tensor is contiguous and at the
        # address it was made for (the view keeps that storage alive: no other tensor can
        # move there); a tensor that is not contiguous, or is a lazily conjugated or
        # negated view (its bytes are not its values), has none: torch copies them all.
        whole = all(map(torch.Tensor.is_contiguous, srcs)) and not (
            any(map(torch.Tensor.is_conj, srcs)) or any(map(torch.Tensor.is_neg, srcs)))
        hasher = xxhash.xxh3_64()
        done = memory.HEADER_SIZE + layout.block[0]
        view = memoryview(buf)
        try:
            with torch.no_grad():
                for group, (first, last, end) in enumerate(layout.groups):
                    if whole:
                        torch.cat(layout.parts[group], out=layout.blocks[group])
                    else:
                        torch._foreach_copy_(layout.dsts[first:last], srcs[first:last])
                    hasher.update(view[done:memory.HEADER_SIZE + end])
                    done = memory.HEADER_SIZE + end
        finally:
            view.release()
        block = hasher.intdigest()
        big = [(tensor, memory.HEADER_SIZE + start, nbytes)
               for tensor, start, nbytes, small in zip(
                   tensors, layout.offsets, layout.nbytes, layout.small, strict=True)
               if not small]
        digests = [-1 if tensor.is_cuda else copy_and_hash(buf, start, tensor, nbytes)
                   for tensor, start, nbytes in big]
        if on_gpu:  # the GPU's copies: hash them once they have landed
            for done in on_gpu:
                done.synchronize()
            with memoryview(buf) as view:
                digests = [memory.checksum(view[start:start + nbytes]) if tensor.is_cuda
                           else digest for (tensor, start, nbytes), digest in zip(
                               big, digests, strict=True)]
        return block, digests

    def _start_gpu_copies(self, buf: Any, layout: _Layout, tensors: list[torch.Tensor],
                          ready: Any) -> list[Any]:
        """Queue the copies of the CUDA tensors into the slot on a side stream per device,
        after ``ready``; return an event per device that marks their end."""
        by_device: dict[torch.device, list[int]] = {}
        for i, tensor in enumerate(tensors):
            if tensor.is_cuda:
                by_device.setdefault(tensor.device, []).append(i)
        done = []
        for device, indices in by_device.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                self._streams[device] = stream
            with torch.cuda.device(device), torch.cuda.stream(stream), torch.no_grad():
                stream.wait_event(ready)
                for i in indices:
                    tensor, nbytes = tensors[i], layout.nbytes[i]
                    if nbytes:
                        dst = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes,
                                               offset=memory.HEADER_SIZE + layout.offsets[i])
                        dst.view(tensor.dtype).view(tensor.shape).copy_(tensor,
                                                                        non_blocking=True)
                done.append(stream.record_event())
        return done


def _refresh_byte_views(layout: _Layout, srcs: list[torch.Tensor], ptrs: list[int]) -> None:
    """Remake the byte views of the small tensors that moved since their view was made."""
    for i, (src, ptr) in enumerate(zip(srcs, ptrs, strict=True)):
        if ptr != layout.ptrs[i]:
            group, index = layout.where[i]
            contiguous = src.is_contiguous() and not (src.is_conj() or src.is_neg())
            layout.parts[group][index] = (src.detach().reshape(-1).view(torch.uint8)
                                          if contiguous else layout.parts[group][index][:0])
            layout.ptrs[i] = ptr if contiguous else -1


def copy_and_hash(buf: Any, start: int, tensor: torch.Tensor, nbytes: int) -> int:
    """Copy ``tensor`` to byte ``start`` of ``buf``; return the xxh3 of the copied bytes.

    A CPU tensor is copied and hashed in chunks that fit the core's L2 cache, so the hash
    reads each chunk from cache right after the copy wrote it: the checksum costs no extra
    pass over memory (about 0.9x a plain memcpy here, against 0.7x for a copy followed by
    a hash of the destination). ``ctypes.memmove`` and xxhash both release the GIL.
    """
    if nbytes == 0:
        return xxhash.xxh3_64_intdigest(b"")
    dst = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start)
    src = tensor.detach()
    view = memoryview(buf)
    try:
        if not src.is_contiguous() or src.device.type != "cpu" or src.is_conj() or (
                src.is_neg()):
            dst.view(src.dtype).view(src.shape).copy_(src)
            return memory.checksum(view[start:start + nbytes])
        hasher = xxhash.xxh3_64()
        to, frm = dst.data_ptr(), src.data_ptr()
        for lo in range(0, nbytes, memory.COPY_CHUNK):
            size = min(memory.COPY_CHUNK, nbytes - lo)
            ctypes.memmove(to + lo, frm + lo, size)
            hasher.update(view[start + lo:start + lo + size])
        return hasher.intdigest()
    finally:
        view.release()


def _slot_tensor(buf: Any, entry: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, entry["dtype"])
    shape = tuple(entry["shape"])
    nbytes = int(entry["nbytes"])
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes,
                            offset=memory.HEADER_SIZE + int(entry["offset"]))
    tensor = flat.view(dtype).view(shape)
    device = entry.get("device", "cpu")
    return tensor.to(device) if device != "cpu" else tensor


def load_state(buf: Any, meta: dict[str, Any]) -> dict[str, Any]:
    """The state tree a committed slot holds (``{"model": ..., "optimizer": ..., "extra": ...,
    "rng": ...}``, each key only if it was saved), read from ``buf`` (a slot's bytes: a mapped
    segment, a mapped persisted file, a private copy) as described by its metadata ``meta``.

    Every tensor is a CPU copy that owns its memory, whatever device it was saved from, so
    the result outlives ``buf``. Checksums are the caller's business (``memory.verify``).
    """
    tensors = [_slot_tensor(buf, {**entry, "device": "cpu"}) for entry in meta["tensors"]]
    state: dict[str, Any] = _clone_tensors(_unflatten(meta["tree"], tensors))
    return state


class _Prefetch:
    """The large CPU tensors that ``restore`` copies out of the slot (optimizer state and
    ``extra``; model tensors go straight into the parameters), copied into this process's
    memory by a thread while the script starts, builds its model and reaches ``restore``.

    Fresh memory costs a page fault per 4 KiB page here: the copies of a 1 GiB state's
    optimizer tensors took about 0.25 s of a recovery, now spent while the script is busy
    elsewhere. ``restore`` uses them only if they come from the slot it restores (same
    name and seq; nothing writes to a committed slot before the worker's next save).
    """

    def __init__(self, prefix: str, rank: int, step: int) -> None:
        self.key: tuple[str, int] | None = None  # (slot name, seq) they were copied from
        self.tensors: dict[int, torch.Tensor] = {}  # index in the slot's metadata -> copy
        self._thread = threading.Thread(target=self._copy, args=(prefix, rank, step),
                                        name="gemini-prefetch", daemon=True)
        self._thread.start()

    def take(self, name: str, seq: int) -> dict[int, torch.Tensor]:
        self._thread.join()
        return self.tensors if self.key == (name, seq) else {}

    def _copy(self, prefix: str, rank: int, step: int) -> None:
        segments: list[memory.Segment | None] = []
        try:
            for index in range(2):
                name = memory.slot_name(prefix, rank, index)
                segments.append(memory.attach_segment(name, populate=False)
                                if (memory.SHM_DIR / name).exists() else None)
            headers = [memory.read_header(s.view) if s else None for s in segments]
            newest = _newest_holding(step, headers)
            if newest is None:
                return
            segment, header = segments[newest], headers[newest]
            assert segment is not None and header is not None
            meta = memory.read_meta(segment.view, header)
            copies = {}
            for i, entry in enumerate(meta["tensors"]):
                if entry["path"].startswith(("/optimizer/", "/extra/")) and (
                        entry.get("device", "cpu") == "cpu"
                        and int(entry["nbytes"]) > memory.SMALL_TENSOR):
                    src = _slot_tensor(segment.view, entry)
                    copies[i] = torch.empty_like(src)
                    # a plain memcpy that releases the GIL: torch's own copy would start a
                    # pool of compute threads for this thread
                    ctypes.memmove(copies[i].data_ptr(), src.data_ptr(), src.nbytes)
            self.key, self.tensors = (segment.name, header.seq), copies
        except Exception:  # restore() reads the slot itself, and reports what is wrong
            logger.debug("prefetch failed", exc_info=True)
            self.key, self.tensors = None, {}
        finally:
            for segment in segments:
                if segment is not None:
                    segment.close()


def _newest_holding(step: int, headers: list[memory.SlotHeader | None]) -> int | None:
    """The index of the committed slot of ``step`` with the highest seq in ``headers``."""
    best: tuple[int, int] | None = None
    for index, header in enumerate(headers):
        if header is not None and header.state is memory.SlotState.COMMITTED and (
            header.step == step and (best is None or header.seq > best[1])
        ):
            best = (index, header.seq)
    return best[0] if best else None


_prefetch: _Prefetch | None = None


def prefetch() -> None:
    """Start copying the step this worker will restore (``GEMINI_RESTORE_STEP``) out of
    its slot in the background; see ``_Prefetch``. Called as a standby takes its job and
    when this module is imported in a worker, before the script reaches ``restore``."""
    global _prefetch
    step = os.environ.get(ENV_RESTORE_STEP, "")
    prefix = os.environ.get(ENV_PREFIX, "")
    if _prefetch is None and prefix and step.isdigit() and os.environ.get(ENV_SOCKET):
        _prefetch = _Prefetch(prefix, int(os.environ.get("RANK", "0")), int(step))


def _verified_seqs() -> dict[int, int]:
    """Rank -> seq of the slot holding the restore step that the supervisor verified in
    this round, from ``GEMINI_RESTORE_VERIFIED`` ("rank:seq,...")."""
    pairs = (item.split(":") for item in os.environ.get(ENV_RESTORE_VERIFIED, "").split(",")
             if item)
    return {int(rank): int(seq) for rank, seq in pairs}


def _clone_tensors(obj: Any, owned: frozenset[int] = frozenset()) -> Any:
    """A copy of ``obj`` whose tensors own their memory (never alias a slot); tensors whose
    id is in ``owned`` own theirs already and are kept."""
    if isinstance(obj, torch.Tensor):
        return obj if id(obj) in owned else obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone_tensors(v, owned) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_tensors(v, owned) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone_tensors(v, owned) for v in obj)
    return obj


def _die_with_supervisor() -> None:
    """Ask Linux to SIGKILL this worker when its supervisor dies, as a host failure would:
    an orphaned worker would otherwise keep training with a group that is being replaced.
    Only for a worker started directly by the supervisor (``GEMINI_SUPERVISOR_PID``)."""
    supervisor = os.environ.get(ENV_SUPERVISOR_PID, "")
    if not supervisor.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    if os.getppid() != int(supervisor):
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(supervisor):  # it died before the call
        os.kill(os.getpid(), signal.SIGKILL)


def _warn_inactive() -> None:
    global _warned_inactive
    if not _warned_inactive:
        _warned_inactive = True
        warnings.warn("gemini Checkpointer: not running under `gemini run`; "
                      "save() and restore() keep nothing", RuntimeWarning, stacklevel=3)


prefetch()
