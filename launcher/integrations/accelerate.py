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
``Accelerator.load_state``), the gradient scaler's, the objects registered with
``register_for_checkpointing``, and the accelerator's step; the Checkpointer adds the
random states. ``restore`` loads them into the same objects. DeepSpeed and FSDP engines
(accelerate's plugins) save their state their own way and are refused.
"""

from __future__ import annotations

from typing import Any


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

    def state_dict(self) -> dict[str, Any]:
        acc = self.accelerator
        scaler = getattr(acc, "scaler", None)
        return {
            "models": [acc.unwrap_model(model).state_dict() for model in acc._models],
            "optimizers": [optimizer.state_dict() for optimizer in acc._optimizers],
            "schedulers": [scheduler.state_dict() for scheduler in acc._schedulers],
            "dataloaders": [loader.state_dict() if _stateful_loader(loader) else None
                            for loader in acc._dataloaders],
            "scaler": scaler.state_dict() if scaler is not None else None,
            "custom": [obj.state_dict() for obj in acc._custom_objects],
            "step": acc.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        acc = self.accelerator
        for kind, objects in (("models", [acc.unwrap_model(m) for m in acc._models]),
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


def accelerator_state(accelerator: Any) -> AcceleratorState:
    """The state of ``accelerator`` (after ``prepare``) as one ``Stateful`` to hand to
    ``Checkpointer(extra=...)``."""
    return AcceleratorState(accelerator)


def _stateful_loader(loader: Any) -> bool:
    return bool(getattr(loader, "use_stateful_dataloader", False))
