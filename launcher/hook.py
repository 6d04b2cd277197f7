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
A torch.distributed.checkpoint ``Stateful`` app state (what DCP users and torchtitan
pass to ``dcp.save``) is such an object and may stand in for ``model`` and
``optimizer``: ``Checkpointer(extra={"app": app_state})``. Its tensors that are
parameters or optimizer states (of the optimizers passed, among the ``extra`` values,
or held by them) are copied in the background like the model's, since those optimizers'
steps wait for the copy; its other tensors are copied at ``save``. DTensors (FSDP2's
``get_state_dict``) are rebuilt on the meshes of the live state. Where an app state's
dict is exactly its model's and optimizer's state, most saves build it from them
(``launcher.state_dicts.AppStateReader``) instead of calling ``state_dict()``.

The state-tree codec (``launcher.codec``), the copy engine (``launcher.copier``) and the
restart prefetch (``launcher.prefetch``) are modules of their own; the hook shares only
``launcher.contract`` and the codec with the supervisor, and imports nothing heavier than
torch. Nothing starts at import.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from launcher import memory, prefetch, rng
from launcher.codec import (
    Resolve,
    assign_shares,
    clone_tensors,
    dtensor_nodes,
    encode,
    is_dtensor,
    live_meshes,
    local_shard,
    replica_ranks,
    reshard,
    slot_tensors,
    unflatten,
)
from launcher.contract import (
    ENV_HEARTBEAT,
    ENV_PREFIX,
    ENV_RESTORE_RESHARD,
    ENV_RESTORE_STEP,
    ENV_RUN_DIR,
    ENV_SOCKET,
    ENV_SUPERVISOR_PID,
)
from launcher.copier import (
    META_FRAME,
    CopyWorker,
    Layout,
    agree_digest,
    block_record,
    plan_layout,
    slot_bytes,
)
from launcher.errors import CheckpointError, StorageError
from launcher.state_dicts import AppStateReader, model_state
from launcher.stragglers import PaceClock

logger = logging.getLogger(__name__)


_warned_inactive = False


def _after_first_step(optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The shape of ``optimizer.state_dict()`` after its first step, while it has no state
    yet (torch's optimizers create it then): from a twin of the same class stepped once
    over shape-only ("meta") copies of the parameters. None when it has state already,
    or the twin cannot be made (a fused or custom optimizer, sharded parameters)."""
    if optimizer.state or any(is_dtensor(p) for group in optimizer.param_groups
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


#: Seconds a copy waits at most for the host's other ranks to commit the copy they are
#: writing, before it overwrites the step they all hold (``Checkpointer._host_keeps``).
PEER_COPY_WAIT = 5.0

#: Bytes below which a tensor of an ``extra`` value that is not a guarded tensor itself is
#: copied at ``save`` without asking whether it views one: a copy of a few KiB costs less
#: than finding the storages of every parameter and optimizer state.
_CLONE_BELOW = 64 << 10


def _storage(tensor: torch.Tensor) -> int:
    """The address of the memory behind ``tensor`` (a DTensor's: its local shard's)."""
    return int(local_shard(tensor).untyped_storage().data_ptr())


def _members(obj: Any) -> list[Any]:
    """The attribute values of ``obj``, the items of those that are lists or tuples."""
    found: list[Any] = []
    for member in getattr(obj, "__dict__", {}).values():
        found.extend(member if isinstance(member, (list, tuple)) else [member])
    return found


def _holds(headers: list[memory.SlotHeader | None], step: int) -> bool:
    return any(memory.committed(h) and h is not None and h.step == step for h in headers)


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None))


class Checkpointer:
    """Saves and restores a worker's training state through gemini's in-memory tier."""

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 extra: dict[str, Any] | None = None, *,
                 replicated: bool | None = None) -> None:
        """``replicated``: whether every data-parallel rank holds the whole model and
        optimizer state bit for bit (DDP), so that when the job shrinks or grows any
        rank's copy serves any rank, and the ranks of a host keep one copy of it between
        them: each copies, hashes and keeps its share of the parameters and optimizer
        state (``extra``, buffers and random states stay per rank), and a restore reads
        the other shares from the host's other ranks' slots of the same step. None (the
        default): shared when ``model`` is a ``DistributedDataParallel`` (unless the
        optimizer is a ``ZeroRedundancyOptimizer``), resizable unless the state holds
        DTensors (FSDP2, tensor parallelism); True: both, for replicas that a wrapper of
        another kind keeps in step; False for model-parallel state kept in plain tensors
        (each rank its own shard), which then restores only into the same world size."""
        self.model = model
        self.optimizer = optimizer
        self.extra: dict[str, Any] = extra if extra is not None else {}
        self._readers: dict[str, AppStateReader] = {}  # per Stateful extra value
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
        self._worker: CopyWorker | None = None
        self._saved = False  # whether save() was called yet
        self._pending: threading.Event | None = None
        self._error: BaseException | None = None
        self._conn: socket.socket | None = None
        self._stream: Any = None
        self._layouts: list[Layout | None] = [None, None]
        self._rng: dict[str, Any] = {}  # see rng.capture
        self._memo: dict[str, tuple[Any, str, list[str]]] = {}  # see encode
        # id(segment) -> its address registered with CUDA as pinned memory (0: failed)
        self._pinned: dict[int, int] = {}
        self._closed = False
        self._group: list[int] | None = None  # the ranks that keep one copy between them
        self._ddp: bool | None = None  # whether a DDP wraps the model (_wrapped_by_ddp)
        self._verified: dict[int, int] = {}  # rank -> seq of its slot verified at restore
        self._shares: tuple[Any, list[int], str] | None = None  # see _split
        self._heartbeat: memory.Segment | None = None
        self._beat_view: memoryview | None = None  # this rank's counter in it
        self._beats = 0
        self._pace: PaceClock | None = None  # this rank's own work per step (stragglers)
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
        prefetch.prefetch()  # a worker not started from a standby begins it here
        self._attach_heartbeat()
        self._hooked: set[int] = set()  # ids of the optimizers looked at by _hook_optimizers
        self._waiting: list[torch.optim.Optimizer] = []  # ... whose steps wait for copies
        self._hook_optimizers()
        atexit.register(self.close)

    # -- public API -----------------------------------------------------------------------
    def restore(self) -> int:
        """Load the step the supervisor chose; return the first step to run (0 if none)."""
        if not self.active:
            return 0
        self._progress(memory.RESTORE_BEGAN, time.monotonic_ns())
        first = self._restore()
        self._progress(memory.RESTORED, first)
        self._progress(memory.STEPS_DONE, first)
        self._progress(memory.RESTORE_ENDED, time.monotonic_ns())
        return first

    def _restore(self) -> int:
        self._wait()
        step = int(os.environ.get(ENV_RESTORE_STEP, "-1"))
        self._verified = prefetch.verified_seqs()
        if step >= 0:  # a pull from a peer may still be on its way: wait for this rank's
            self._await(self.rank)
        verified = self._verified.get(self.rank)
        self._attach_existing()
        reshard_from = int(os.environ.get(ENV_RESTORE_RESHARD, "0") or 0)
        if step >= 0 and reshard_from:
            self._load_resharded(step, reshard_from)
            self._discard_newer_than(step)
            # The own slots hold the old world's copies: the next save goes to the slot
            # the supervisor lets grow, not to the one with the newest of them.
            committed = [(h.step, h.seq, i) for i, seg in enumerate(self._segments)
                         if seg is not None and (h := memory.read_header(seg.view)) is not None
                         and h.state is memory.SlotState.COMMITTED]
            self._newest = max(committed)[2] if committed else None
            return step + 1
        if step < 0 and all(segment is None for segment in self._segments):
            # Fail before training, not at the first save, if /dev/shm is too small; then
            # reserve and pre-fault both slots now, before training: so that the first
            # save costs no more than a steady one. A fresh start only: a restart finds
            # its slots in memory.
            state = self._capture()
            if self.optimizer is not None and (after := _after_first_step(self.optimizer)):
                state["optimizer"] = after  # its state appears at the first step
            tensors: list[tuple[str, torch.Tensor]] = []
            tree = encode(state, "", tensors, {})
            own, shared = self._split(tensors, tree)
            nbytes = slot_bytes(own, len(tree) + len(shared))
            self._request({"op": "check", "rank": self.rank, "nbytes": nbytes})
            self._reserve(nbytes)
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
        prefetched = prefetch.take(segment.name, header.seq)
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
            view[memory.BEAT] = self._beats

    def _progress(self, field: int, value: int) -> None:
        """Set a word of this rank's progress for its supervisor (``launcher.goodput``)."""
        view = self._beat_view
        if view is not None:
            view[field] = value

    def save(self, step: int) -> None:
        """Snapshot the state as of the end of ``step``; returns before the copy is done."""
        began = time.perf_counter()
        self.heartbeat()
        try:
            self._save(step)
        finally:
            self.stalled += time.perf_counter() - began
            view = self._beat_view
            if view is not None:  # what the run's goodput counts: stalls, steps done
                view[memory.STALLED] = int(self.stalled * 1e9)
                view[memory.SAVED_AT] = time.monotonic_ns()
                view[memory.STEPS_DONE] = step + 1  # last: the supervisor reads it first

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
        self._hook_optimizers()
        state = self._capture()
        ready = None  # where the training stream stands: the GPU copies start there
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record()
        encoded = None
        if not self._saved:
            self._saved = True
            if not self._group:  # the model may have been wrapped since restore() looked
                self._group = self._ddp = None
            # The first save encodes here: a value it cannot save fails this call.
            encoded = self._encode(state)
            self._record_imports()
        done = threading.Event()
        self._pending = done
        if self._pins is not None:  # the host's other ranks wait for it (_host_keeps)
            memory.write_copying(self._pins.view, step)
        self._copier(ready is None).submit(
            lambda: self._copy(index, step, state, encoded, ready), done)

    @staticmethod
    def _record_imports() -> None:
        """Once past its first step, local rank 0 lists the modules the worker imported
        for the standbys that may replace it (``launcher.standby.record_imports``), from
        a thread: the loop goes on."""
        run_dir = os.environ.get(ENV_RUN_DIR, "")
        if not run_dir or os.environ.get("LOCAL_RANK", "0") != "0":
            return

        def record() -> None:
            from launcher.standby import record_imports

            try:
                record_imports(run_dir)
            except OSError as exc:
                logger.debug("gemini: could not record the imports: %s", exc)

        threading.Thread(target=record, name="gemini-imports", daemon=True).start()

    def _copier(self, idle: bool | None = None) -> CopyWorker:
        """The background copy thread, started on first use: on the CPU it takes only idle
        CPU time; with CUDA it queues the GPU's copies, which must not wait for a core."""
        if self._worker is None:
            if idle is None:
                idle = not torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
            self._worker = CopyWorker(idle=idle)
        return self._worker

    def _reserve(self, nbytes: int) -> None:
        """Create both slots at ``nbytes`` and map them."""
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
                self._beat_view[memory.BEAT] = memory.HEARTBEAT_DONE  # no hang from here on
                if self._pace is not None:
                    self._pace.close()
                    self._pace = None
                self._beat_view.release()
                self._beat_view = None
                self._heartbeat.close()
            if self._conn is not None:
                self._conn.close()

    # -- capture and load -----------------------------------------------------------------
    def _capture(self) -> dict[str, Any]:
        state: dict[str, Any] = {"rng": rng.capture(self._rng)}
        if self.model is not None:
            state["model"] = model_state(self.model)  # buffers copied, parameters not
        if self.optimizer is not None:
            optimizer = self.optimizer.state_dict()
            # The thread encodes the state later; schedulers and loops change the groups
            # (their learning rate, ...) before the next optimizer step, so copy them now.
            if isinstance(optimizer, dict) and "param_groups" in optimizer:
                optimizer["param_groups"] = clone_tensors(optimizer["param_groups"])
            state["optimizer"] = optimizer
        extra: dict[str, Any] = {}
        # The tensors that change only in an optimizer step, found at the first tensor of
        # an extra value: their ids (a parameter or optimizer state handed over as itself)
        # and, when a large tensor is not one of them, their storages (a view of one).
        guarded: list[torch.Tensor] | None = None
        ids: set[int] = set()
        storages: set[int] | None = None

        def is_guarded(tensor: torch.Tensor) -> bool:
            nonlocal guarded, ids, storages
            if guarded is None:
                guarded = self._guarded()
                ids = {id(t) for t in guarded}
            if id(tensor) in ids:
                return True
            if tensor.nbytes < _CLONE_BELOW:
                return False  # copied at once: cheaper than looking up its storage
            if storages is None:
                storages = {_storage(t) for t in guarded}
            return _storage(tensor) in storages

        for key, value in self.extra.items():
            tree = self._reader(key, value)() if _stateful(value) else value
            extra[key] = clone_tensors(tree, keep=is_guarded)
        state["extra"] = extra
        return state

    def _reader(self, key: str, app: Any) -> AppStateReader:
        """What reads the state dict of the Stateful ``extra[key]`` at each save: with the
        model and the optimizer it holds, if it holds one of each."""
        reader = self._readers.get(key)
        if reader is None or reader.app is not app:
            members = _members(app)
            models = {id(m): m for m in members if isinstance(m, torch.nn.Module)}
            optimizers = {id(o): o for o in members if isinstance(o, torch.optim.Optimizer)}
            model = next(iter(models.values())) if len(models) == 1 else None
            optimizer = next(iter(optimizers.values())) if len(optimizers) == 1 else None
            reader = self._readers[key] = AppStateReader(app, model, optimizer)
        return reader

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers whose step must wait for a pending copy: ``optimizer``, those
        among the ``extra`` values or held by them (a DCP ``Stateful`` app state that holds
        the model and optimizer), and those such an optimizer wraps (accelerate's
        ``AcceleratedOptimizer``, torchtitan's container)."""
        found: dict[int, torch.optim.Optimizer] = {}
        candidates = [self.optimizer, *self.extra.values()]
        candidates += [member for value in self.extra.values() for member in _members(value)]
        while candidates:
            candidate = candidates.pop()
            if isinstance(candidate, torch.optim.Optimizer) and id(candidate) not in found:
                found[id(candidate)] = candidate
                candidates.extend(_members(candidate))
        return list(found.values())

    def _hook_optimizers(self) -> None:
        """Make the step of every optimizer of :meth:`_optimizers` wait for the copy (again
        at each save: a Stateful may be given its optimizer after the Checkpointer)."""
        for optimizer in self._optimizers():
            if id(optimizer) not in self._hooked:
                self._hooked.add(id(optimizer))
                try:
                    optimizer.register_step_pre_hook(self._before_optimizer_step)
                except AttributeError:  # a wrapper that skipped Optimizer.__init__
                    continue  # (accelerate's): the optimizer it wraps is found too
                self._waiting.append(optimizer)
                if self._pace is not None:  # FSDP's gradients hold its waits: not timed
                    self._pace.watch(p for group in optimizer.param_groups
                                     for p in group["params"] if not is_dtensor(p))

    def _guarded(self) -> list[torch.Tensor]:
        """The tensors that change only in an optimizer step, which waits for the copy: the
        parameters and optimizer states of the hooked optimizers, and ``model``'s
        parameters."""
        tensors: list[torch.Tensor] = []
        if self.model is not None:
            tensors.extend(self.model.parameters())
        for optimizer in self._waiting:
            for group in optimizer.param_groups:
                tensors.extend(group["params"])
            for per_param in optimizer.state.values():
                tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
        return tensors

    def _load(self, segment: memory.Segment, meta: dict[str, Any], step: int,
              prefetched: dict[int, torch.Tensor]) -> None:
        """Load the state of ``segment``; ``prefetched`` holds private copies of some of
        its tensors (by index), used instead of copying them again. The shares that the
        host's other ranks keep are read from their copies of the same step."""
        header = memory.read_header(segment.view)
        assert header is not None
        opened: list[memory.Segment] = []
        resolve = self._resolver(step, header.world_size, opened)

        def decode() -> dict[str, Any]:
            tensors = slot_tensors(segment.view, meta, resolve, prefetched=prefetched)
            return unflatten(meta["tree"], tensors, self._live_meshes())  # type: ignore[no-any-return]

        try:
            self._apply(decode, step, frozenset(map(id, prefetched.values())))
        finally:
            _close_all(opened)

    def _resolver(self, step: int, world: int, opened: list[memory.Segment]) -> Resolve:
        """Finds the copy of ``step`` that another rank of this host wrote (see
        ``replicated``), verified unless the supervisor just did."""
        def resolve(rank: int) -> tuple[Any, dict[str, Any]]:
            if not opened:  # the other ranks' pulls may still be on their way
                for other in self._host_ranks():
                    if other != self.rank:
                        self._await(other)
            segment = self._copy_of(rank, step, world)
            opened.append(segment)
            header = memory.read_header(segment.view)
            assert header is not None
            meta = memory.read_meta(segment.view, header)
            if self._verified.get(rank) != header.seq:
                memory.verify(segment.view, header, meta)
            return segment.view, meta

        return resolve

    def _await(self, rank: int) -> None:
        """Wait until the supervisor has ``rank``'s restore step in this host's memory;
        note the seq of the slot it verified, if any."""
        seq = self._request({"op": "await", "rank": rank}).get("seq")
        if seq is not None:
            self._verified[rank] = int(seq)

    def _live_meshes(self) -> dict[str, Any]:
        """The device meshes the saved DTensors are rebuilt on: those of the model, the
        optimizer, and the ``extra`` values (a Stateful's current state dict)."""
        return live_meshes(
            [*self.model.parameters(), *self.model.buffers()] if self.model is not None else [],
            [g["params"] for g in self.optimizer.param_groups]
            if self.optimizer is not None else [],
            [value.state_dict() if _stateful(value) else value for value in self.extra.values()])

    def _load_resharded(self, step: int, world: int) -> None:
        """Load ``step`` written by a world of ``world`` ranks into this rank's shards:
        from the committed copies of every old rank on this host (own slots or replicas,
        as the supervisor brought them in), each verified."""
        copies: list[tuple[int, memory.Segment, dict[str, Any]]] = []
        try:
            for old in range(world):
                segment = self._copy_of(old, step, world)
                header = memory.read_header(segment.view)
                assert header is not None
                meta = memory.read_meta(segment.view, header)
                memory.verify(segment.view, header, meta)
                copies.append((old, segment, meta))
            self._apply(lambda: reshard([(r, seg.view, m) for r, seg, m in copies],
                                        self.rank % world, self._live_meshes()), step)
        finally:
            _close_all([segment for _, segment, _ in copies])

    def _copy_of(self, rank: int, step: int, world: int) -> memory.Segment:
        """A committed slot on this host holding ``step`` of ``rank`` of a world of
        ``world`` ranks: the rank's own slots first, then the replicas of it, then any
        slot of this host (after the job shrank or grew, the new ranks' own slots hold
        the old ranks' copies)."""
        names = [memory.slot_name(self._prefix, rank, index, replica=replica)
                 for replica in (False, True) for index in range(2)]
        names += [name for name in memory.list_segments(self._prefix)
                  if name not in names and memory.parse_slot_name(name)]
        for name in names:
            if not (memory.SHM_DIR / name).exists():
                continue
            try:
                segment = memory.attach_segment(name, populate=False)
            except StorageError:  # unusable (empty, not ours): it holds no copy
                continue
            if memory.committed(memory.read_header(segment.view), step=step, rank=rank,
                                world_size=world):
                return segment
            segment.close()
        raise CheckpointError(f"rank {self.rank}: no copy of step {step} of rank {rank} "
                              f"(of {world}) on this host")

    def _apply(self, decode: Callable[[], dict[str, Any]], step: int,
               owned: frozenset[int] = frozenset()) -> None:
        """Put the state ``decode()`` returns into the model, optimizer, ``extra`` and RNG;
        tensors whose id is in ``owned`` are private copies already."""
        try:
            state = decode()
            if self.model is not None:
                if "model" not in state:
                    raise CheckpointError("it holds no model state")
                self.model.load_state_dict(state["model"])
            if self.optimizer is not None:
                if "optimizer" not in state:
                    raise CheckpointError("it holds no optimizer state")
                self.optimizer.load_state_dict(clone_tensors(state["optimizer"], owned))
            for key, value in self.extra.items():
                if key not in state["extra"]:
                    raise CheckpointError(f"it holds no extra value {key!r}")
                saved = clone_tensors(state["extra"][key], owned)
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
        rng.restore(clone_tensors(state["rng"]))

    # -- slots ----------------------------------------------------------------------------
    def _attach_existing(self) -> None:
        for index in range(2):
            name = memory.slot_name(self._prefix, self.rank, index)
            if self._segments[index] is None and (memory.SHM_DIR / name).exists():
                # no pre-faulting: a restore reads one slot once; saves fault pages lazily
                try:
                    self._segments[index] = memory.attach_segment(name, populate=False)
                except StorageError as exc:  # unusable (empty, not ours): as if absent; the
                    logger.warning("%s", exc)  # supervisor replaces it when it allocates
        for segment in self._segments:
            header = memory.read_header(segment.view) if segment is not None else None
            if header is not None:
                self._seq = max(self._seq, header.seq)

    def _next_slot(self) -> int | None:
        """The slot the next save writes: the older one, unless it holds a step the
        supervisor pinned, then the newer one, unless that one does too (None: skip).
        The copy may still choose the newer one (:meth:`_keeping_common`)."""
        order = [0, 1] if self._newest is None else [1 - self._newest, self._newest]
        kept = self._pinned_slots()
        return next((i for i in order if i not in kept), None)

    def _pinned_slots(self) -> set[int]:
        """The indexes of this rank's slots that hold a step the supervisor pinned."""
        if self._pins is None:
            name = memory.pins_name(self._prefix, self.rank)
            if not (memory.SHM_DIR / name).exists():
                return set()
            self._pins = memory.attach_segment(name, populate=False)
        return memory.pinned_slots(
            [memory.read_header(seg.view) if seg is not None else None for seg in self._segments],
            memory.read_pins(self._pins.view))

    def _keeping_common(self, index: int) -> int | None:
        """The slot a copy chosen for slot ``index`` writes: ``index``, unless it is the
        older slot and holds the newest step the host's ranks all hold (:meth:`_host_keeps`),
        then the newer one, unless that one is pinned (None: the save is dropped). Asked
        in the copy thread, which may wait for a peer's copy there: the training thread
        goes on, and only an optimizer step would wait for it."""
        newer = self._newest
        if newer is None or newer == index:
            return index
        older_seg, newer_seg = self._segments[index], self._segments[newer]
        if older_seg is None or newer_seg is None or not self._host_keeps(
                memory.read_header(older_seg.view), memory.read_header(newer_seg.view)):
            return index
        return None if newer in self._pinned_slots() else newer

    def _host_keeps(self, older: memory.SlotHeader | None,
                    newer: memory.SlotHeader | None) -> bool:
        """Whether the older of this rank's slots must be kept, for a save to overwrite
        the newer: when its step is the newest the host's other ranks all hold and they
        do not all hold the newer one yet. A peer's copy of it pending or in flight (its
        pins' copying field) is waited for first (at most ``PEER_COPY_WAIT``):
        overwriting the older step while a peer's copy of the newer one is unfinished
        would leave no step common to the host if that peer died in its copy (this rank
        holding s-1 and s, the peer s-2), and the job would start over."""
        if not (memory.committed(older) and memory.committed(newer)):
            return False
        assert older is not None and newer is not None
        deadline = time.monotonic() + PEER_COPY_WAIT
        while True:
            peers = self._peer_slots()
            lacking = [rank for rank, pair in peers.items() if not _holds(pair, newer.step)]
            if not lacking:
                return False
            if time.monotonic() >= deadline or not any(
                    memory.peek_copying(self._prefix, rank) == newer.step for rank in lacking):
                break
            time.sleep(0.0005)
        peers = self._peer_slots()  # a copy may have committed between the two reads
        return (not all(_holds(pair, newer.step) for pair in peers.values())
                and all(_holds(pair, older.step) for pair in peers.values()))

    def _peer_slots(self) -> dict[int, list[memory.SlotHeader | None]]:
        """The headers of the own slots of this host's other ranks that have slots."""
        found = {}
        for rank in self._host_ranks():
            if rank != self.rank:
                pair = [memory.peek_header(memory.slot_name(self._prefix, rank, index))
                        for index in range(2)]
                if any(pair):
                    found[rank] = pair
        return found

    def _find(self, step: int) -> int | None:
        return memory.holding(step, [memory.read_header(segment.view) if segment else None
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
    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                               kwargs: dict[str, Any]
                               ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Wait for a pending copy before the step changes parameters. A step of torch's
        own optimizers given a closure (Lightning's, LBFGS) runs it, forward and backward,
        before any update: the wait moves to after the closure, so the copy still overlaps
        them. Any other optimizer may change parameters before it calls its closure (SAM
        perturbs them first): it waits before the step."""
        self.heartbeat()
        if self._pace is not None:
            self._pace.step()
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if not callable(closure) or not type(optimizer).__module__.startswith("torch.optim."):
            self.wait()
            return None

        def closure_then_wait(*a: Any, **kw: Any) -> Any:
            result = closure(*a, **kw)
            self.wait()
            return result

        if len(args) > 1:
            return (args[0], closure_then_wait, *args[2:]), kwargs
        return args, {**kwargs, "closure": closure_then_wait}

    def _attach_heartbeat(self) -> None:
        """Map this rank's counter in the supervisor's heartbeat segment (launcher.health)."""
        name = os.environ.get(ENV_HEARTBEAT, "")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if not name:
            return
        try:
            segment = memory.attach_segment(name, populate=False)
        except StorageError:
            return  # a supervisor without hang detection
        offset = local_rank * memory.HEARTBEAT_STRIDE
        if offset + memory.HEARTBEAT_STRIDE <= segment.size:
            self._heartbeat = segment
            self._beat_view = memoryview(segment.view)[
                offset:offset + memory.HEARTBEAT_STRIDE].cast("Q")
            self._pace = PaceClock(self._beat_view)
        else:
            segment.close()

    def _encode(self, state: dict[str, Any]) -> tuple[str, list[tuple[str, torch.Tensor]]]:
        """The skeleton's JSON of ``state`` (from ``_capture``) and its tensors, in order."""
        tensors: list[tuple[str, torch.Tensor]] = []
        return encode(state, "", tensors, self._memo), tensors

    def _copy(self, index: int, step: int, state: dict[str, Any],
              encoded: tuple[str, list[tuple[str, torch.Tensor]]] | None, ready: Any) -> None:
        try:
            self._write(index, step, *(encoded or self._encode(state)), ready)
        except BaseException as exc:  # surfaced by the next wait()
            self._error = exc
        finally:
            if self._pins is not None and self._pins.buf is not None:
                memory.write_copying(self._pins.view, -1)

    def _write(self, index: int, step: int, tree: str, tensors: list[tuple[str, torch.Tensor]],
               ready: Any) -> None:
        """Copy the state (``tree``: its skeleton's JSON) into slot ``index`` and commit it:
        the tensors this rank keeps; the others are named under ``shared``."""
        chosen = self._keeping_common(index)
        if chosen is None:
            self.skipped += 1
            return
        index = chosen
        own, shared = self._split(tensors, tree)
        layout = self._layout_for(index, own, len(tree) + len(shared) + AGREE_LEN,
                                  self._agree_mask(own, tree))
        buf = layout.segment.view
        memory.set_state(buf, memory.SlotState.WRITING)
        assert self._worker is not None
        batches, digests = self._worker.copy_all(buf, layout, [t for _, t in own], ready)
        big = iter(digests)
        records = ",".join(record if isinstance(record, str)
                           else record[0] + f'"{next(big):016x}"' + record[1]
                           for record in layout.records)
        blocks = ",".join(block_record(start, end, digest) for (start, end), digest in zip(
            layout.group_ranges, batches, strict=True))
        sharded = '"__dtensor__"' in tree
        replicated = self.replicated if self.replicated is not None else not sharded
        agree = (f'"agree":{{"key":"{layout.agree_key:016x}","digest":'
                 f'"{agree_digest(layout, batches, digests):016x}"}},'
                 if layout.agree_key else "")
        meta = (f'{{"step":{step},"replicated":{"true" if replicated else "false"},'
                f'"sharded":{"true" if sharded else "false"},'
                f'"tensors":[{records}],"blocks":[{blocks}],{agree}'
                + (f'"shared":{shared},' if shared else "") + '"tree":' + tree + "}").encode()
        self._seq += 1
        memory.write_commit(buf, step=step, seq=self._seq, rank=self.rank,
                            world_size=self.world_size, run_id=self.run_id,
                            data_len=layout.data_len, meta=meta)
        self._newest = index

    def _host_ranks(self) -> list[int]:
        """The ranks of this host: torch elastic numbers them consecutively."""
        first = self.rank - int(os.environ.get("LOCAL_RANK", "0"))
        return list(range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))

    def _replicated(self) -> bool:
        """Whether every data-parallel replica holds this rank's model and optimizer state
        bit for bit: ``replicated``, else whether a DDP wraps the model (a scan of the
        garbage collector's objects: once, and again at the first save)."""
        if self.replicated is not None:
            return self.replicated
        if self._ddp is None:
            self._ddp = _wrapped_by_ddp(self.model)
        return self._ddp

    def _sharers(self) -> list[int]:
        """The ranks of this host that keep one copy of the replicated plain tensors
        between them (see ``replicated``); empty when each keeps its own."""
        if self._group is None:
            zero = type(self.optimizer).__name__ == "ZeroRedundancyOptimizer"
            shared = not zero and self._replicated()
            ranks = self._host_ranks()
            self._group = ranks if shared and len(ranks) > 1 else []
        return self._group

    def _split(self, tensors: list[tuple[str, torch.Tensor]], tree: str
               ) -> tuple[list[tuple[str, torch.Tensor]], str]:
        """The tensors this rank keeps, and the JSON list of those another rank of the
        host keeps for it (``[index, owner, path, dtype, shape]``; empty: none).

        Shared are the parameters and optimizer state of replicated plain tensors (among
        :meth:`_sharers`), and DTensor shards that other ranks of the host hold too (a
        ``Replicate`` placement: HSDP's replicate dimension), among those ranks. Each
        set of ranks holding the same tensors splits them with ``assign_shares``."""
        group = self._sharers()
        sharded = '"__dtensor__"' in tree
        if not group and not (sharded and len(self._host_ranks()) > 1):
            return tensors, ""
        key = tuple((path, t.dtype, t.shape, isinstance(t, torch.nn.Parameter))
                    for path, t in tensors)
        if self._shares is None or self._shares[0] != key:
            classes: list[tuple[int, ...] | None] = [
                tuple(group) if group and (path.startswith("/optimizer/state/") or (
                    path.startswith("/model/") and parameter)) else None
                for path, _, _, parameter in key]
            if sharded:
                host = set(self._host_ranks())
                for node in dtensor_nodes(json.loads(tree)):
                    same = tuple(sorted(replica_ranks(node, self.rank) & host))
                    classes[node["__dtensor__"]] = same if len(same) > 1 else None
            sizes = [t.numel() * t.element_size() for _, t in tensors]
            owners: list[int | None] = [None] * len(tensors)
            for members in {c for c in classes if c}:
                among = [i for i, c in enumerate(classes) if c == members]
                for i, owner in zip(among, assign_shares([sizes[i] for i in among],
                                                         [True] * len(among), list(members)),
                                    strict=True):
                    owners[i] = owner
            mine = [i for i, owner in enumerate(owners) if owner in (None, self.rank)]
            shared = [[i, owner, path, str(dtype).removeprefix("torch."), list(shape)]
                      for i, (owner, (path, dtype, shape, _)) in enumerate(zip(owners, key, strict=True))
                      if owner not in (None, self.rank)]
            self._shares = (key, mine, json.dumps(shared, separators=(",", ":")) if shared else "")
        _, mine, text = self._shares
        return [tensors[i] for i in mine], text

    def _layout_for(self, index: int, tensors: list[tuple[str, torch.Tensor]],
                    tree_len: int, agree: list[bool]) -> Layout:
        """Where each tensor goes in slot ``index``; reused while the state keeps its shape
        and the slot has room for the metadata (``tree_len``: its tree's part), which grows
        with values in ``extra`` like a list of losses."""
        signature = (tuple((path, t.dtype, t.shape, t.device) for path, t in tensors),
                     tuple(agree))
        cached = self._layouts[index]
        if cached is not None and cached.signature == signature and (
            cached.segment is self._segments[index]
        ) and tree_len + cached.records_len + META_FRAME <= cached.meta_room:
            return cached
        self._layouts[index] = None
        segment = self._slot_for(index, slot_bytes(tensors, tree_len))
        if any(t.is_cuda for _, t in tensors):
            self._pin(segment)
        layout = plan_layout(segment, tensors, signature, agree)
        self._layouts[index] = layout
        return layout

    def _agree_mask(self, tensors: list[tuple[str, torch.Tensor]], tree: str) -> list[bool]:
        """Which of this rank's tensors every data-parallel replica holds bit for bit:
        the parameters and optimizer state of a DDP model (or ``replicated=True``), not
        under ZeroRedundancyOptimizer, and not in a state of DTensors; their checksums are
        compared between replicas (replica agreement, ``launcher.replication``)."""
        zero = type(self.optimizer).__name__ == "ZeroRedundancyOptimizer"
        if zero or '"__dtensor__"' in tree or not self._replicated():
            return [False] * len(tensors)
        return [path.startswith("/optimizer/state/") or (
            path.startswith("/model/") and isinstance(t, torch.nn.Parameter))
            for path, t in tensors]


#: Metadata bytes of the replica-agreement record (``"agree":{"key":...,"digest":...},``).
AGREE_LEN = 64


def _wrapped_by_ddp(model: torch.nn.Module | None) -> bool:
    """Whether ``model`` is a ``DistributedDataParallel`` or the module a live one wraps
    (scripts often hand the Checkpointer the inner module, for its state dict's keys).
    One pass over the objects the garbage collector tracks: tens of milliseconds, once."""
    ddp = torch.nn.parallel.DistributedDataParallel
    if model is None or isinstance(model, ddp):
        return model is not None
    kinds, stack = set(), [ddp]
    while stack:
        kind = stack.pop()
        kinds.add(kind)
        stack.extend(kind.__subclasses__())
    return any(type(obj) in kinds and obj.module is model for obj in gc.get_objects())


def _close_all(segments: list[memory.Segment]) -> None:
    for segment in segments:
        try:
            segment.close()
        except BufferError:  # a view of it is still referenced: unmapped at exit
            pass


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

