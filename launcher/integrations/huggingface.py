"""In-memory checkpoints for a Hugging Face ``transformers.Trainer``, in one line::

    from launcher.integrations.huggingface import gemini_trainer

    trainer = gemini_trainer(Trainer(model=model, args=args, train_dataset=data))
    trainer.train()

Every ``every`` optimizer steps (default 1), right where the Trainer would write one of
its own checkpoints (after the step's log entry), gemini saves what that checkpoint
holds into its memory tier: the model's state dict, the optimizer's and the LR
scheduler's, the ``TrainerState`` (global step, epoch, log history, the callbacks'
state) and the random states (Python, NumPy, torch, CUDA), in the Trainer's own
formats. Parameters and optimizer state are copied in the background; the optimizer's
next step waits for the copy.

When the worker restarts (under ``gemini run``), ``train()`` called without
``resume_from_checkpoint`` resumes from the step in memory: that step is written as a
Trainer checkpoint directory (a private temporary directory in /dev/shm, removed after
the first step) and handed to the Trainer's own resume, which reloads it and
fast-forwards the data loader to the next batch, as ``resume_from_checkpoint`` does.
The Trainer is not changed: gemini wraps its ``train`` and its per-step log / save /
evaluate on this instance (a ``TrainerCallback`` sees neither the Trainer nor the end
of that step, and cannot choose where ``train`` resumes). The Trainer's own checkpoints
(``save_strategy``) keep working beside gemini's, and an explicit
``resume_from_checkpoint`` wins.

Not saved: a gradient scaler's state (mixed precision on GPUs; its scale re-adapts within
a few steps), and state the Trainer keeps only in its running process (the loss summed
since the last log: with ``logging_steps`` > 1 the first logged loss after a resume
averages fewer steps, as after the Trainer's own resume). DeepSpeed and FSDP engines
(the Trainer's ``fsdp``/``deepspeed`` arguments) save their state their own way and are
refused.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from launcher.hook import Checkpointer
from launcher.state_dicts import model_state

WEIGHTS = "pytorch_model.bin"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
TRAINER_STATE = "trainer_state.json"


class _TrainerSnapshot:
    """A ``Stateful`` over the Trainer's state, in the Trainer's own checkpoint formats;
    it holds the optimizer so that the Checkpointer makes its steps wait for the copy."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.loaded: dict[str, Any] | None = None
        self._history = _JsonList()

    def state_dict(self) -> dict[str, Any]:
        """The Trainer's checkpoint but its random states: the Checkpointer saves those
        itself at the same moment and sets them again at ``restore()``, where the
        resume writes them in the Trainer's format (``_rng_states``)."""
        trainer = self.trainer
        if trainer is None or trainer.optimizer is None or trainer.lr_scheduler is None:
            return {}  # before train() made them
        history, length = self._history.update(trainer.state.log_history)
        return {
            "model": model_state(trainer.model),  # its parameters themselves
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.lr_scheduler.state_dict(),
            "trainer_state": json.dumps(_trainer_state(trainer)),
            "log_history": history,
            "log_history_bytes": length,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


class TrainerCheckpoints:
    """Saves a Trainer's state into gemini's memory tier and resumes from it; made and
    attached by :func:`gemini_trainer`."""

    def __init__(self, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, not {every}")
        self.every = every
        self._snapshot = _TrainerSnapshot()
        self._last = -1  # the global step saved last
        self._resumed: Path | None = None  # the checkpoint directory written for a resume
        self.checkpointer = Checkpointer(extra={"trainer": self._snapshot})

    def attach(self, trainer: Any) -> None:
        """Wrap ``trainer.train`` (resume from memory) and the Trainer's per-step log /
        save / evaluate (save into memory after it)."""
        args = trainer.args
        if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
            raise ValueError("gemini_trainer: DeepSpeed and FSDP through the Trainer save "
                             "their state their own way; not supported")
        after_step = getattr(trainer, "_maybe_log_save_evaluate", None)
        if after_step is None:
            raise TypeError("gemini_trainer: this transformers.Trainer has no per-step "
                            "_maybe_log_save_evaluate (tested with transformers 5.25)")
        self._snapshot.trainer = trainer
        train = trainer.train

        def train_from_memory(resume_from_checkpoint: Any = None, *a: Any, **kw: Any) -> Any:
            self._snapshot.trainer = trainer
            if resume_from_checkpoint is None:
                resume_from_checkpoint = self.resume_directory(trainer)
            try:
                return train(resume_from_checkpoint, *a, **kw)
            finally:  # the Checkpointer lives until exit: it must not keep the DDP model
                self._snapshot.trainer = self._snapshot.optimizer = None  # past the group

        def save_after_step(*a: Any, **kw: Any) -> None:
            after_step(*a, **kw)
            if self._resumed is not None:  # the Trainer has loaded all of it by now
                shutil.rmtree(self._resumed, ignore_errors=True)
                self._resumed = None
            step = trainer.state.global_step
            if step != self._last and step % self.every == 0:
                self._last = step
                self._snapshot.optimizer = trainer.optimizer
                self.checkpointer.save(step - 1)  # step s is the (s-1)th, counted from 0

        trainer.train = train_from_memory
        trainer._maybe_log_save_evaluate = save_after_step

    def resume_directory(self, trainer: Any) -> str | None:
        """Restore the step in memory, if any, and write it as a Trainer checkpoint
        directory; its path, or None on a fresh start."""
        if self.checkpointer.restore() == 0 or self._snapshot.loaded is None:
            return None
        states = _rng_states(trainer)  # as restore() set them: the saved ones
        state, self._snapshot.loaded = self._snapshot.loaded, None
        trainer_state = json.loads(state["trainer_state"])
        history = state["log_history"][:state["log_history_bytes"]]
        trainer_state["log_history"] = json.loads(history.numpy().tobytes())
        self._last = trainer_state["global_step"]
        shm = Path("/dev/shm")
        out = Path(tempfile.mkdtemp(prefix="gemini-hf-resume-",
                                    dir=shm if shm.is_dir() else None))
        self._resumed = out
        torch.save(state["model"], out / WEIGHTS)
        torch.save(state["optimizer"], out / OPTIMIZER)
        torch.save(state["scheduler"], out / SCHEDULER)
        (out / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
        rng_name = (f"rng_state_{trainer.args.process_index}.pth" if trainer.args.world_size > 1
                    else "rng_state.pth")
        torch.save(states, out / rng_name)
        return str(out)


def gemini_trainer(trainer: Any, *, every: int = 1) -> Any:
    """Give ``trainer`` (a ``transformers.Trainer``) in-memory checkpoints every ``every``
    optimizer steps and resume from memory after a restart; returns ``trainer``."""
    TrainerCheckpoints(every).attach(trainer)
    return trainer


def _trainer_state(trainer: Any) -> dict[str, Any]:
    """The Trainer's ``TrainerState`` as its checkpoint's ``trainer_state.json`` holds it,
    without the log history: the stateful callbacks' states as of now, as the Trainer
    records them when it saves."""
    from transformers.trainer_callback import ExportableState

    state = trainer.state
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
              if f.name != "log_history"}
    callbacks: dict[str, Any] = {}
    for callback in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(callback, ExportableState):
            name = type(callback).__name__
            if name in callbacks:  # several of one kind: a list, as the Trainer keeps them
                if not isinstance(callbacks[name], list):
                    callbacks[name] = [callbacks[name]]
                callbacks[name].append(callback.state())
            else:
                callbacks[name] = callback.state()
    fields["stateful_callbacks"] = callbacks
    return fields


def _rng_states(trainer: Any) -> dict[str, Any]:
    """The random states, as the Trainer saves them in ``rng_state*.pth``."""
    import numpy as np

    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        distributed = str(getattr(trainer.args.parallel_mode, "value", "")) == "distributed"
        states["cuda"] = (torch.cuda.random.get_rng_state_all() if distributed
                          else torch.cuda.random.get_rng_state())
    return states


class _JsonList:
    """A growing list of JSON-encodable entries (the log history) as a JSON array in a
    tensor of bytes, each entry encoded once: the history grows by a few entries a step
    and a long run holds many. The tensor keeps its size until it is full (then doubles),
    so the Checkpointer's slot layout stays as it is from one save to the next; the bytes
    past the array's length are not part of it. The Checkpointer copies it at ``save``
    (it is no optimizer's), so the next entries may be written into it at once."""

    def __init__(self) -> None:
        self._buffer = torch.empty(4096, dtype=torch.uint8)
        self._buffer[0] = ord("[")
        self._used = 1  # bytes of "[e1,e2,..." written
        self._entries = 0

    def update(self, entries: list[Any]) -> tuple[torch.Tensor, int]:
        """The buffer and the length of the array holding ``entries`` (the earlier ones
        as before; a shorter list starts over)."""
        if len(entries) < self._entries:  # a resume started it over
            self._used, self._entries = 1, 0
        for entry in entries[self._entries:]:
            self._append(("," if self._entries else "") + json.dumps(entry))
            self._entries += 1
        self._buffer[self._used] = ord("]")  # overwritten by the next entry
        return self._buffer, self._used + 1

    def _append(self, text: str) -> None:
        data = text.encode()
        end = self._used + len(data)
        if end + 1 > len(self._buffer):
            bigger = torch.empty(max(end + 1, 2 * len(self._buffer)), dtype=torch.uint8)
            bigger[:self._used] = self._buffer[:self._used]
            self._buffer = bigger
        self._buffer[self._used:end] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._used = end
