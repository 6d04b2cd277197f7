"""How the Checkpointer reads the state it saves, at every save, at a hand-written loop's
cost: a module's state dict (:func:`model_state`) and a torch.distributed.checkpoint
``Stateful`` app state's (:class:`AppStateReader`).

An app state's ``state_dict()`` is the user's code; in DCP's recipe it is
``get_state_dict(model, optimizer)``, which maps every parameter to its fully qualified
name and walks the model through its state-dict hooks at each call: about ten times what
reading the model and optimizer directly costs. Where the app state's dict is exactly the
state of a model and an optimizer it holds (the same keys and plain values, and tensor
for tensor their own memory), the reader builds that dict from the model's parameters
and the optimizer's own state dict, with the names mapped as ``get_state_dict`` maps
them, and asks the app state itself again at the 1st, 2nd, 4th ... save and every
:data:`RECHECK`: a dict that differs there makes it ask the app state at every save
until a check finds them the same again (so does a dict that can no longer be built: an
optimizer that gained a parameter group). Any other app state is asked at every save
(and compared only at those checks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from launcher.codec import is_dtensor, local_shard

logger = logging.getLogger(__name__)

_MODULE = torch.nn.Module

#: Every this many saves (and at the 1st, 2nd, 4th, ... before), the app state's own
#: ``state_dict()`` is read and compared with the dict built in its place.
RECHECK = 128

#: Module names that ``get_state_dict`` leaves out of a parameter's name (the wrappers of
#: DDP, FSDP1, activation checkpointing and ``torch.compile``).
_WRAPPERS = frozenset({"module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module",
                       "_orig_mod"})


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """``model.state_dict(keep_vars=True)`` with its tensors that are not parameters (buffers)
    cloned: parameters change only in the optimizer step, which waits for the copy;
    buffers (batch-norm statistics, ...) change in forward, so they are copied now.

    Where no module customises its state dict (hooks, overrides, extra state), it is read
    straight from the modules' parameters and buffers, in the order ``Module.state_dict``
    uses: the same keys and tensors, without torch's recursive calls and their hooks'
    bookkeeping, which are paid at every save."""
    state = module_tensors(model)
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            state[key] = value.detach().clone()
    return state


def module_tensors(model: torch.nn.Module) -> dict[str, Any]:
    """``model.state_dict(keep_vars=True)``, read as :func:`model_state` reads it, nothing
    cloned."""
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
    return state


class AppStateReader:
    """``app.state_dict()`` for the Checkpointer's saves; see the module."""

    def __init__(self, app: Any, model: torch.nn.Module | None,
                 optimizer: torch.optim.Optimizer | None) -> None:
        self.app, self.model, self.optimizer = app, model, optimizer
        self.calls = 0
        self.built: Callable[[], dict[str, Any]] | None = None  # in place of the app's

    def __call__(self) -> Any:
        self.calls += 1
        calls = self.calls
        check = not calls & (calls - 1) or not calls % RECHECK
        if self.built is not None and not check:
            try:
                return self.built()
            except Exception as exc:  # the optimizer changed its groups, say: the app's serves
                logger.warning("gemini: the app state's dict cannot be built from its model "
                               "and optimizer any more (%s); it is read at every save until "
                               "they agree again", exc)
                self.built = None
        tree = self.app.state_dict()
        if check:
            was = self.built is not None
            self.built = self._builder(tree)
            if was and self.built is None:
                logger.warning("gemini: the app state's state_dict() no longer holds just its "
                               "model's and optimizer's state; it is read at every save "
                               "until they agree again")
        return tree

    def _builder(self, tree: Any) -> Callable[[], dict[str, Any]] | None:
        """A function that builds ``tree`` from the model and optimizer, if the tree built
        now from their live tensors is ``tree``: the same keys and plain values, and each
        tensor the same memory as ``tree``'s."""
        if self.model is None or not isinstance(tree, dict):
            return None
        parts: dict[str, Callable[[bool], Any]] = {}
        for key, part in tree.items():
            read = (self._optimizer_reader(part) if _is_optimizer_state(part)
                    else self._model_reader(part))
            if read is None:
                return None
            parts[key] = read
        try:
            same = _same({key: read(True) for key, read in parts.items()}, tree)
        except Exception as exc:  # a state the comparison does not know: the app's serves
            logger.debug("gemini: the app state is read at every save: %s", exc)
            return None
        if not same:
            return None
        return lambda: {key: read(False) for key, read in parts.items()}

    def _model_reader(self, part: Any) -> Callable[[bool], Any] | None:
        """Reads the model's state (its live tensors, or with buffers cloned) under the
        names in ``part``."""
        assert self.model is not None
        model = self.model
        if not isinstance(part, dict) or not all(isinstance(k, str) for k in part):
            return None

        def state(live: bool) -> dict[str, Any]:
            return module_tensors(model) if live else model_state(model)

        own = list(module_tensors(model))
        if set(own) == set(part):
            return state
        names = {key: ".".join(a for a in key.split(".") if a not in _WRAPPERS) for key in own}
        if len(set(names.values())) != len(names) or set(names.values()) != set(part):
            return None
        return lambda live: {names[key]: value for key, value in state(live).items()}

    def _optimizer_reader(self, part: dict[str, Any]) -> Callable[[bool], Any] | None:
        """Reads the optimizer's state dict with its parameters named as in ``part``."""
        optimizer = self.optimizer
        if optimizer is None:
            return None
        own = optimizer.state_dict()
        groups, named = own["param_groups"], part["param_groups"]
        if not isinstance(named, list) or len(groups) != len(named):
            return None
        names: dict[Any, Any] = {}
        for group, named_group in zip(groups, named, strict=True):
            params = named_group.get("params") if isinstance(named_group, dict) else None
            if not isinstance(params, list) or len(params) != len(group["params"]):
                return None
            names.update(zip(group["params"], params, strict=True))

        def read(live: bool) -> dict[str, Any]:
            state = optimizer.state_dict()
            return {"state": {names[i]: value for i, value in state["state"].items()},
                    "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                                     for group in state["param_groups"]]}

        return read


def _is_optimizer_state(part: Any) -> bool:
    return isinstance(part, dict) and set(part) == {"state", "param_groups"}


def _same(a: Any, b: Any) -> bool:
    """Whether two state trees hold the same structure, equal plain values and the same
    tensors: each pair the same memory (of the local shard, for DTensors on the same mesh
    and placements), shape, strides and dtype."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if is_dtensor(a) != is_dtensor(b):
            return False
        if is_dtensor(a) and (a.placements != b.placements  # type: ignore[attr-defined]
                              or a.device_mesh != b.device_mesh):  # type: ignore[attr-defined]
            return False
        a, b = local_shard(a), local_shard(b)
        return bool(a.data_ptr() == b.data_ptr() and a.shape == b.shape
                    and a.stride() == b.stride() and a.dtype == b.dtype
                    and a.device == b.device)
    if isinstance(a, dict) and isinstance(b, dict):  # an OrderedDict (torch's) too
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
