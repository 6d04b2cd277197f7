"""In-memory checkpoints of what Hugging Face accelerate's ``Accelerator.save_state``
saves, through gemini's ``Checkpointer``::

    from launcher import Checkpointer
    from launcher.integrations.accelerate import accelerator_state

    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    ckpt = Checkpointer(extra={"accelerator": accelerator_state(accelerator)})
    start = ckpt.restore()                       # 0, or the step to resume at
    for step, batch in enumerate(accelerator.skip_first_batches(data, start), start):
        ...
        ckpt.save(step)

Saved at each ``save``: every prepared model's state dict (unwrapped), every prepared
optimizer's and scheduler's, a stateful data loader's position (``use_stateful_dataloader``;
other loaders are fast-forwarded with ``skip_first_batches``, as after
``Accelerator.load_state``), every prepared loader's epoch and the state its shuffling
generator had when the epoch's order was drawn, the gradient scaler's, the objects
registered with ``register_for_checkpointing``, and the accelerator's step; the
Checkpointer adds the random states. ``restore`` loads them into the same objects.
DeepSpeed and FSDP engines (accelerate's plugins) save their state their own way and are
refused.
"""

from __future__ import annotations

from typing import Any

from launcher.state_dicts import model_state


class AcceleratorState:
    """A ``Stateful`` over what ``accelerator.save_state`` would save (see the module)."""

    def __init__(self, accelerator: Any) -> None:
        state = accelerator.state
        if getattr(state, "deepspeed_plugin", None) or getattr(state, "fsdp_plugin", None):
            raise ValueError("accelerator_state: DeepSpeed and FSDP plugins save their state "
                             "their own way; not supported")
        self.accelerator = accelerator
        # The Checkpointer finds optimizers among its values' attributes: their steps then
        # wait for its copy, so their parameters need not be cloned at save.
        self.optimizers = accelerator._optimizers
        self.orders = [_LoaderOrder(loader) for loader in accelerator._dataloaders]
        self.unwrapped: dict[int, tuple[Any, Any]] = {}  # by id: (prepared, unwrapped)

    def _unwrap(self, model: Any) -> Any:
        """``accelerator.unwrap_model(model)``, asked once per prepared model (about 20 us
        a call, at every save otherwise)."""
        known = self.unwrapped.get(id(model))
        if known is None or known[0] is not model:
            known = self.unwrapped[id(model)] = (model, self.accelerator.unwrap_model(model))
        return known[1]

    def state_dict(self) -> dict[str, Any]:
        acc = self.accelerator
        scaler = getattr(acc, "scaler", None)
        return {
            # their parameters themselves (the Checkpointer copies them in the background)
            "models": [model_state(self._unwrap(model)) for model in acc._models],
            "optimizers": [optimizer.state_dict() for optimizer in acc._optimizers],
            "schedulers": [scheduler.state_dict() for scheduler in acc._schedulers],
            "dataloaders": [loader.state_dict() if _stateful_loader(loader) else None
                            for loader in acc._dataloaders],
            "scaler": scaler.state_dict() if scaler is not None else None,
            "custom": [obj.state_dict() for obj in acc._custom_objects],
            "step": acc.step,
            "orders": [order.state_dict(acc.gradient_state) for order in self.orders],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        acc = self.accelerator
        for kind, objects in (("models", [self._unwrap(m) for m in acc._models]),
                              ("optimizers", acc._optimizers),
                              ("schedulers", acc._schedulers),
                              ("custom", acc._custom_objects)):
            if len(state[kind]) != len(objects):
                raise ValueError(f"the checkpoint holds {len(state[kind])} {kind}, the "
                                 f"accelerator has {len(objects)}")
            for obj, saved in zip(objects, state[kind], strict=True):
                obj.load_state_dict(saved)
        for loader, saved in zip(acc._dataloaders, state["dataloaders"], strict=True):
            if saved is not None and _stateful_loader(loader):
                loader.load_state_dict(saved)
        scaler = getattr(acc, "scaler", None)
        if scaler is not None and state["scaler"] is not None:
            scaler.load_state_dict(state["scaler"])
        acc.step = state["step"]
        for order, saved in zip(self.orders, state.get("orders") or [], strict=False):
            order.load_state_dict(saved)


def accelerator_state(accelerator: Any) -> AcceleratorState:
    """The state of ``accelerator`` (after ``prepare``) as one ``Stateful`` to hand to
    ``Checkpointer(extra=...)``."""
    return AcceleratorState(accelerator)


def _stateful_loader(loader: Any) -> bool:
    return bool(getattr(loader, "use_stateful_dataloader", False))


class _LoaderOrder:
    """The data order of one prepared loader: its epoch (``iteration``) and the state of its
    shuffling generator when the current epoch drew its order.

    A loader shuffled by a generator (its own, or the one accelerate gives a sampler that
    has none) draws each epoch's permutation when the epoch's iteration starts. A resume
    mid-epoch re-iterates that epoch (``skip_first_batches``), so it needs the generator as
    it was before that draw; a resume after the epoch's last batch starts the next epoch,
    so it needs the generator as it is. The draw is seen as a change of the generator's
    state between two saves (the loader's only use of it): the state before the change is
    the one the epoch started from. A seedable sampler (``use_seedable_sampler``) derives
    the order from the epoch alone, which is restored too.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.generator: Any = getattr(loader, "synchronized_generator", None)
        if self.generator is None:
            sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
            self.generator = getattr(sampler, "generator", None)
        self.seen = self._now()
        self.start = self.seen

    def _now(self) -> Any:
        return None if self.generator is None else self.generator.get_state()

    def state_dict(self, gradient_state: Any) -> dict[str, Any]:
        now = self._now()
        if now is not None and not now.equal(self.seen):
            self.start, self.seen = self.seen, now
        # after the epoch's last batch the loop starts the next epoch anew
        ended = bool(gradient_state.end_of_dataloader)
        return {"epoch": int(getattr(self.loader, "iteration", 0)) + ended,
                "generator": now if ended else self.start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if hasattr(self.loader, "iteration"):
            self.loader.set_epoch(int(state["epoch"]))
        if self.generator is not None and state["generator"] is not None:
            self.generator.set_state(state["generator"])
            self.seen = self.start = self._now()
