"""In-memory checkpoints for a Lightning ``Trainer``, in one callback::

    from launcher.integrations.lightning import GeminiCheckpoints

    trainer = Trainer(accelerator="gpu", devices=8, strategy="ddp",
                      callbacks=[GeminiCheckpoints(every=1)])
    trainer.fit(model, data)

Every ``every`` optimizer steps, at the end of the step's batch (``on_train_batch_end``,
where ``ModelCheckpoint(every_n_train_steps=...)`` writes its files), gemini saves what
Lightning's own checkpoint holds into its memory tier: the Trainer's ``dump_checkpoint``
(the LightningModule's state dict, the optimizers' and LR schedulers' states, the loops'
progress with the position of resumable data loaders, the callbacks' states, the
precision plugin's, epoch and global step, hyperparameters, a datamodule's state and
what ``on_save_checkpoint`` hooks add), plus the random states (Python, NumPy, torch,
CUDA), which Lightning does not save. The callback moves itself after the Trainer's
other callbacks, so that a step's snapshot holds what they did at that step.
Parameters and optimizer state are copied in the background; the optimizer's next step
waits for the copy after its closure (forward and backward), right before it changes
them. Values the state-tree codec does not know (hyperparameters that are arbitrary
objects) are pickled.

When the worker restarts (under ``gemini run``), ``trainer.fit(model)`` without
``ckpt_path`` resumes from the step in memory: the callback's ``setup``, which Lightning
calls before it restores a checkpoint, hands that step to the Trainer's checkpoint
connector, where ``fit(ckpt_path=...)`` puts the checkpoint it reads from a file; so
Lightning's own resume reloads the model, optimizers, schedulers, callbacks and loops as
from a file written at that step, and no file is written. A callback suffices (the
Hugging Face Trainer needs a wrapper) because of that order. An explicit ``ckpt_path``
(or ``trainer.ckpt_path``) wins: Lightning reads it in place of the step in memory.
``ModelCheckpoint`` keeps writing its files beside gemini's memory; its state is part of
what gemini saves.

The data position: Lightning 2.x resumes a data loader mid-epoch only if it has
``state_dict``/``load_state_dict`` (torchdata's ``StatefulDataLoader``, say), from the
state saved with the loops; it restarts any other at the epoch's first batch. gemini
fast-forwards such a plain loader when training starts (``on_train_start``): it sets the
samplers' epoch, reads and discards the batches the epoch trained on before the saved
step (as the Hugging Face Trainer does; Lightning's warning that the loader restarts the
epoch is silenced then), then sets the random states to the saved ones; when the saved
step ended an epoch, it restarts the loader's iteration after that, as the unfailed run
did. The resumed run then equals the unfailed one bit for bit, at the same world size,
if an epoch's data order is a function of the epoch (Lightning's ``DistributedSampler``
under DDP, the default, or no shuffling). Not replayed: the order of a ``RandomSampler``
without a generator of its own (drawn from the global random state when the epoch's
iteration starts) and the random state of data loader workers (``num_workers`` > 0,
seeded then too). A ``training_step`` that takes ``dataloader_iter`` fetches batches
itself and is not fast-forwarded; a resumable loader is resumed by Lightning, and
whether that is bit for bit depends on the loader.

Not saved: state only in the running process (metrics accumulated since the last log, a
logger's buffers), as with Lightning's own checkpoints. A validation due at the saved
step is not run again after the resume, as after Lightning's resume from a checkpoint
written at ``on_train_batch_end``. FSDP, DeepSpeed and model-parallel strategies save
their state their own way and are refused; so are processes Lightning starts itself
(``ddp_spawn``): run one worker per device with ``gemini run --nproc-per-node``.

Tested with Lightning 2.6. Works with the ``lightning.pytorch`` and the
``pytorch_lightning`` package, whichever the program imported (``lightning.pytorch`` when
both or neither), and imports it only when ``GeminiCheckpoints`` is first used.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import io
import logging
import pickle
import sys
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch

from launcher import rng
from launcher.hook import Checkpointer
from launcher.state_dicts import model_state

logger = logging.getLogger(__name__)

# Strategies whose state is not the LightningModule's and optimizers' plain state dicts.
_REFUSED = frozenset({"DeepSpeedStrategy", "FSDPStrategy", "ModelParallelStrategy",
                      "XLAStrategy", "XLAFSDPStrategy", "SingleDeviceXLAStrategy"})
_SUPPORTED = frozenset({"SingleDeviceStrategy", "DDPStrategy"})
# The parts of a Lightning checkpoint that are tensor tables and optimizer states, which
# the codec takes as they are; the rest may hold any object.
_TENSOR_PARTS = frozenset({"state_dict", "optimizer_states"})
_PICKLED = "__gemini_pickled__"
_REST = "__gemini_rest__"  # the checkpoint's parts other than _TENSOR_PARTS, pickled
_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"
_LEAVES = frozenset({type(None), bool, int, float, str, bytes, torch.dtype})
# Annotations of dataclass fields that hold a leaf (Lightning's progress counters).
_PLAIN = frozenset({bool, int, float, str, "bool", "int", "float", "str"})


class _LightningSnapshot:
    """A ``Stateful`` over the Trainer's checkpoint; it holds the Trainer's optimizers, so
    that the Checkpointer makes their steps wait for its copy (and copies their state and
    parameters in the background)."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.live = False  # whether training runs: dump_checkpoint is complete then
        self.loaded: dict[str, Any] | None = None
        self.loops: Callable[[], dict[str, Any]] | None = None  # see _LoopStates
        self.weights: Callable[[], dict[str, Any]] | None = None  # see _module_weights

    def state_dict(self) -> dict[str, Any]:
        if not self.live:
            return {}  # before the fit loop starts (the Checkpointer sizes its slots)
        connector = self.trainer._checkpoint_connector
        if self.loops is None or self.weights is None:
            self.loops = _LoopStates.checked(self.trainer)
            self.weights = _module_weights(self.trainer)
        # the same dicts, faster
        connector._get_loops_state_dict = self.loops
        connector._get_lightning_module_state_dict = self.weights
        try:
            checkpoint = connector.dump_checkpoint(weights_only=False)
        finally:
            connector.__dict__.pop("_get_loops_state_dict", None)
            connector.__dict__.pop("_get_lightning_module_state_dict", None)
        rest = {key: value for key, value in checkpoint.items() if key not in _TENSOR_PARTS}
        blob = _pickled_without_tensors(rest)
        if blob is not None:  # the common case: one pickle, no walk of the loops' dicts
            return {**{key: checkpoint[key] for key in _TENSOR_PARTS if key in checkpoint},
                    _REST: blob}
        return {key: value if key in _TENSOR_PARTS else _encodable(value)
                for key, value in checkpoint.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            self.loaded = None
            return
        self.loaded = {key: value if key in _TENSOR_PARTS else _decoded(value)
                       for key, value in state.items() if key != _REST}
        if _REST in state:
            self.loaded.update(pickle.loads(state[_REST]))  # this worker's own state


def _module_weights(trainer: Any) -> Callable[[], dict[str, Any]]:
    """The LightningModule's state dict as the checkpoint connector gets it, read by
    ``model_state`` (its parameters themselves, which the Checkpointer recognises without
    looking up their storages, and without torch's recursive walk) where the strategy and
    the module take it from ``Module.state_dict`` unchanged (DDP, one device); else the
    connector's own method. The keys and values are Lightning's."""
    connector = trainer._checkpoint_connector
    base = importlib.import_module(_lightning().__name__ + ".strategies.strategy").Strategy
    if (type(trainer.strategy).lightning_module_state_dict is base.lightning_module_state_dict
            and type(trainer.lightning_module).state_dict is torch.nn.Module.state_dict):
        return lambda: model_state(trainer.lightning_module)
    return cast("Callable[[], dict[str, Any]]", connector._get_lightning_module_state_dict)


class _LoopStates:
    """The Trainer's loops' state dict (``_CheckpointConnector._get_loops_state_dict``),
    built as Lightning builds it, where Lightning's ``dataclasses.asdict`` deep-copies
    every value of every progress dataclass and its walk tests every attribute of every
    loop: most of the time ``dump_checkpoint`` takes. Here each loop's progress and
    sub-loop attributes are found once (again if its attributes change), a progress
    dataclass is read as a copy of its ``__dict__``, and the fit loop's own state asks
    whether a data loader is resumable once per loader. Used only where it gave exactly
    Lightning's dict at the first save (:meth:`checked`); a loop or progress class that
    overrides ``state_dict`` is asked for its own."""

    _NAMES = ("fit_loop", "validate_loop", "test_loop", "predict_loop")

    def __init__(self, trainer: Any) -> None:
        name = _lightning().__name__
        self.trainer = trainer
        self.loop = importlib.import_module(name + ".loops.loop")._Loop
        self.progress = importlib.import_module(name + ".loops.progress")._BaseProgress
        self.fit_state = importlib.import_module(name + ".loops.fit_loop")._FitLoop.on_save_checkpoint
        self.resumable = importlib.import_module(name + ".utilities.combined_loader")._Stateful
        # per loop, by id: the loop (kept alive), its attribute count, the names of its
        # progress attributes and of its sub-loops
        self.shapes: dict[int, tuple[Any, int, tuple[str, ...], tuple[str, ...]]] = {}
        # per dataclass: its field count, the names of the fields not annotated as numbers
        # or strings
        self.classes: dict[type, tuple[int, tuple[str, ...]]] = {}
        self.loaders: dict[int, tuple[Any, bool]] = {}  # per loader, by id: resumable?

    @classmethod
    def checked(cls, trainer: Any) -> Callable[[], dict[str, Any]]:
        """An instance for ``trainer`` if it gives what Lightning gives, else Lightning's
        own method."""
        own = trainer._checkpoint_connector._get_loops_state_dict
        try:
            loops = cls(trainer)
            if loops() == own():
                return loops
        except Exception as exc:  # any surprise: Lightning's own serves
            logger.debug("gemini: Lightning's loop states are read its own way: %s", exc)
        return cast("Callable[[], dict[str, Any]]", own)

    def __call__(self) -> dict[str, Any]:
        return {name: self._loop(getattr(self.trainer, name), {}, "") for name in self._NAMES}

    def _loop(self, loop: Any, into: dict[str, Any], prefix: str) -> dict[str, Any]:
        if type(loop).state_dict is not self.loop.state_dict:
            loop.state_dict(into, prefix)
            return into
        shape = self.shapes.get(id(loop))
        if shape is None or shape[0] is not loop or shape[1] != len(loop.__dict__):
            attributes = loop.__dict__
            shape = self.shapes[id(loop)] = (
                loop, len(attributes),
                tuple(k for k, v in attributes.items() if isinstance(v, self.progress)),
                tuple(k for k, v in attributes.items() if isinstance(v, self.loop)))
        _, _, progresses, children = shape
        into[prefix + "state_dict"] = (self._fit_state(loop)
                                       if type(loop).on_save_checkpoint is self.fit_state
                                       else loop.on_save_checkpoint())
        for key in progresses:
            into[prefix + key] = self._progress(getattr(loop, key))
        for key in children:
            self._loop(getattr(loop, key), into, prefix + key + ".")
        return into

    def _fit_state(self, loop: Any) -> dict[str, Any]:
        """``_FitLoop.on_save_checkpoint``: the resumable train data loaders' states."""
        state: dict[str, Any] = {}
        combined = loop._combined_loader
        if combined is not None:
            states = [loader.state_dict() for loader in combined.flattened
                      if self._resumable(loader)]
            if states:
                state["combined_loader"] = states
        return state

    def _resumable(self, loader: Any) -> bool:
        known = self.loaders.get(id(loader))
        if known is None or known[0] is not loader:
            known = self.loaders[id(loader)] = (loader, isinstance(loader, self.resumable))
        return known[1]

    def _progress(self, progress: Any) -> Any:
        kind = type(progress)
        if kind.state_dict is not self.progress.state_dict:
            return progress.state_dict()
        return self._fields(progress)

    def _fields(self, value: Any) -> Any:
        """``dataclasses.asdict(value)`` for dataclasses of numbers, strings and dataclasses."""
        kind = type(value)
        if kind in _LEAVES:
            return value
        plan = self.classes.get(kind)
        if plan is None:
            if not dataclasses.is_dataclass(value):
                return copy.deepcopy(value)
            fields = dataclasses.fields(value)
            plan = self.classes[kind] = (
                len(fields), tuple(f.name for f in fields if f.type not in _PLAIN))
        count, nested = plan
        state = dict(getattr(value, "__dict__", ()))
        if len(state) != count:  # slots, or attributes besides the fields
            state = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
            nested = tuple(state)
        for name in nested:
            if type(field := state[name]) not in _LEAVES:
                state[name] = self._fields(field)
        return state


class _Checkpoints:
    """The logic of ``GeminiCheckpoints``; the class users get mixes it into the Lightning
    package's ``Callback`` (see ``_callback_class``)."""

    def __init__(self, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, not {every}")
        self.every = every
        self._snapshot = _LightningSnapshot()
        self._last = -1  # the global step saved last
        self._restored = False  # whether this callback looked in memory yet (once)
        # The random states of the step restored from memory, set again when training
        # starts (Lightning's setup and data loaders draw from them until then).
        self._resume: tuple[int, dict[str, Any]] | None = None
        self.checkpointer = Checkpointer(extra={"lightning": self._snapshot})

    # -- Lightning's hooks ----------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Before Lightning restores a checkpoint: restore the step in memory, if any, and
        make it the checkpoint that ``fit`` restores when it is given no ``ckpt_path``."""
        if stage != "fit":
            return
        _check_supported(trainer, self.checkpointer)
        self._snapshot.trainer = trainer
        # Last among the callbacks (after ModelCheckpoint, which Lightning puts last): a
        # step's snapshot holds what the others did at that step. A new list: Lightning is
        # iterating the current one.
        trainer.callbacks = [c for c in trainer.callbacks if c is not self] + [self]
        if self._restored:  # a second fit() in this process continues from its own state
            return
        self._restored = True
        before = rng.capture({})
        if self.checkpointer.restore() == 0 or self._snapshot.loaded is None:
            return
        loaded, self._snapshot.loaded = self._snapshot.loaded, None
        self._resume = (int(loaded["global_step"]), rng.capture({}))
        rng.restore(before)  # until it is known that this step is the one resumed
        self._last = int(loaded["global_step"])
        # What fit(ckpt_path=...) would have read from the file; a ckpt_path given to fit
        # replaces it (the connector's resume_start).
        trainer._checkpoint_connector._loaded_checkpoint = loaded

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Once the fit loop has its data: for a step resumed from memory, fast-forward the
        train data and set the random states to the saved ones."""
        self._snapshot.optimizers = list(trainer.optimizers)
        self._snapshot.live = True
        resume, self._resume = self._resume, None
        if resume is None:
            return
        step, states = resume
        rank = self.checkpointer.rank
        if trainer.ckpt_path:
            logger.info("gemini: rank %d resumes from %s, as fit was told; not from step %d "
                        "in memory", rank, trainer.ckpt_path, step)
            return
        skipped = _resume_data(trainer, states)
        logger.info("gemini: rank %d resumed from memory at global step %d (train data "
                    "fast-forwarded by %d batches)", rank, step, skipped)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step != self._last and step % self.every == 0:
            self._last = step
            self.checkpointer.save(step - 1)  # step s is the (s-1)th, counted from 0

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._snapshot.live = False


def _check_supported(trainer: Any, checkpointer: Checkpointer) -> None:
    strategy = trainer.strategy
    kinds = {kind.__name__ for kind in type(strategy).__mro__}
    if kinds & _REFUSED or not kinds & _SUPPORTED:
        raise ValueError(f"GeminiCheckpoints: the {type(strategy).__name__} saves its state "
                         "its own way; supported: single-device and DDP strategies")
    if getattr(strategy, "_start_method", "popen") != "popen":
        raise ValueError("GeminiCheckpoints: processes that Lightning starts itself "
                         "(ddp_spawn, ddp_fork) are not gemini's workers; start one worker "
                         "per device with `gemini run --nproc-per-node`")
    if checkpointer.active and trainer.world_size != checkpointer.world_size:
        raise ValueError(f"GeminiCheckpoints: the Trainer runs {trainer.world_size} processes, "
                         f"gemini started {checkpointer.world_size}; give the Trainer gemini's "
                         "(devices=--nproc-per-node, num_nodes=the hosts)")
    if not hasattr(trainer, "_checkpoint_connector") or not hasattr(
            trainer.fit_loop, "_data_fetcher"):
        raise TypeError("GeminiCheckpoints: this Lightning Trainer has no checkpoint "
                        "connector or data fetcher where expected (tested with Lightning 2.6)")


def _resume_data(trainer: Any, states: dict[str, Any]) -> int:
    """Set the random states to ``states`` (the saved step's), with the train data where
    the unfailed run had it: for data loaders that Lightning does not resume itself, skip
    the batches the epoch trained on before the saved step; how many were skipped."""
    fit_loop = trainer.fit_loop
    done = fit_loop.epoch_loop.batch_progress.current.ready
    loaders = fit_loop._combined_loader.flattened if fit_loop._combined_loader else []
    resumable = [_stateful(loader) for loader in loaders]
    fetcher = fit_loop._data_fetcher
    if fetcher is None or not loaders or all(resumable):
        rng.restore(states)  # Lightning restored the loaders' positions
        return 0
    if done >= trainer.num_training_batches:
        # The saved step ended an epoch: the next one starts its iteration, which draws
        # from the random state (a loader's base seed), after the saved step, as the
        # unfailed run's did; Lightning made the iterator before that (in setup_data).
        rng.restore(states)
        iter(fetcher)
        return 0
    skipped = 0
    if any(resumable):
        logger.warning("gemini: some train data loaders are resumable, others not; those "
                       "restart the epoch's data (make all of them resumable)")
    elif not isinstance(getattr(fetcher, "batches", None), list):  # dataloader_iter steps
        logger.warning("gemini: a training_step that takes dataloader_iter restarts the "
                       "epoch's data after a resume (use a resumable data loader)")
    else:
        # Lightning sets the samplers' epoch after this hook, before the epoch's first
        # batch, which the skip reads now.
        for loader in loaders:
            _set_sampler_epoch(loader, fit_loop.epoch_progress.current.processed)
        for _ in range(done):
            next(fetcher)
        # The epoch loop adds the batches already trained on to this count when it starts.
        fetcher.fetched -= done
        skipped = int(done)
        # Its warning that a non-resumable loader restarts the epoch's data is then wrong.
        warnings.filterwarnings("ignore", message=_NOT_RESUMABLE)
    rng.restore(states)  # after the skipped batches' draws
    return skipped


def _set_sampler_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch`` on the loader's sampler and its batch sampler's (a DistributedSampler's
    order depends on it), as Lightning does at an epoch's start."""
    samplers = [getattr(loader, "sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None)]
    for sampler in {id(s): s for s in samplers if s is not None}.values():
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


def _stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None))


class _TensorFound(Exception):
    pass


class _TensorlessPickler(pickle.Pickler):
    """A pickler that stops at the first tensor: tensors go into the slot as tensors (a
    GPU tensor copied on its device, a parameter not copied at all), never into a pickle.
    Containers and numbers never reach ``reducer_override``: it costs nothing for them."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            raise _TensorFound
        return NotImplemented


def _pickled_without_tensors(tree: Any) -> bytes | None:
    """``tree`` pickled, or None where it holds a tensor. One C-speed pass over the
    non-tensor part of a Lightning checkpoint (the loops' progress, the callbacks',
    schedulers' and precision plugin's states, hyperparameters), where the state-tree
    codec and the Checkpointer's copy would each walk its many small dicts at every save."""
    buffer = io.BytesIO()
    try:
        _TensorlessPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(tree)
    except _TensorFound:
        return None
    return buffer.getvalue()


def _encodable(tree: Any) -> Any:
    """``tree`` with the values the state-tree codec cannot hold pickled (as a one-key
    dict of bytes); containers are rebuilt, tensors kept."""
    kind = type(tree)
    if kind in _LEAVES or isinstance(tree, torch.Tensor):
        return tree
    if isinstance(tree, dict):  # a dict subclass comes back as a dict (as hparams are saved)
        return {key: value if type(value) in _LEAVES else _encodable(value)
                for key, value in tree.items()}
    if kind is list or kind is tuple:
        return kind(_encodable(value) for value in tree)
    return {_PICKLED: pickle.dumps(tree)}


def _decoded(tree: Any) -> Any:
    """The inverse of :func:`_encodable`."""
    if isinstance(tree, dict):
        if len(tree) == 1 and _PICKLED in tree:
            return pickle.loads(tree[_PICKLED])  # this worker's own state
        return {key: _decoded(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_decoded(value) for value in tree)
    return tree


def _lightning() -> Any:
    """The Lightning package the program uses: ``pytorch_lightning`` if it imported that
    and not ``lightning.pytorch``, else ``lightning.pytorch`` (or ``pytorch_lightning``
    where only that is installed)."""
    if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
        return sys.modules["pytorch_lightning"]
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("GeminiCheckpoints needs Lightning: pip install lightning "
                      "(or pytorch-lightning)")


_classes: dict[str, type] = {}


def _callback_class() -> type:
    """``GeminiCheckpoints`` for the Lightning package in use: ``_Checkpoints`` mixed into
    its ``Callback``, so that its Trainer accepts it."""
    package = _lightning()
    name = package.__name__
    if name not in _classes:
        _classes[name] = type("GeminiCheckpoints", (_Checkpoints, package.Callback), {
            "__module__": __name__,
            "__doc__": "A Lightning callback: gemini's in-memory checkpoints every ``every`` "
                       "optimizer steps, and the resume from them (see the module)."})
    return _classes[name]


def __getattr__(name: str) -> Any:
    """``GeminiCheckpoints``, made on first use (Lightning is imported then)."""
    if name == "GeminiCheckpoints":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
