"""Run by torchrun (2 ranks, gloo, CPU): the Checkpointer's reader of DCP app states
(``launcher.state_dicts.AppStateReader``) against the app states' own ``state_dict()``,
over 40 training steps of each:

  fsdp2     FSDP2 (fully_shard) model and AdamW, DCP's recipe (get_state_dict)
  ddp       DDP-wrapped model and SGD with momentum (names without "module.")
  counter   the recipe plus the step count: not the model's and optimizer's alone
  changing  the recipe until step 20, then with a "step" key too
  two       two models: which is the app state's is not known
  copy      the recipe with the model's tensors copied: equal values, other memory
  grown     the recipe, its optimizer given a second parameter group at step 10

For each, rank 0 prints "CASE built=B calls=C unequal=S,...": whether the reader builds
the dict itself after the last step, how often it asked the app state, and the steps at
which what it returned differed from the app state's own dict.
"""

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from launcher.codec import local_shard
from launcher.state_dicts import AppStateReader


def equal(a: object, b: object) -> bool:
    """Whether two state trees hold equal values (tensors: their local shards)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(local_shard(a), local_shard(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(equal, a, b))
    return type(a) is type(b) and a == b


def net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))


class Recipe:
    """DCP's app state, counting its state_dict calls."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer, self.calls, self.step = model, optimizer, 0, 0

    def state_dict(self) -> dict:
        self.calls += 1
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict) -> None:
        raise AssertionError("not restored here")

    def train(self, step: int) -> None:
        """What the training loop does to the app state's objects before step ``step``."""


class Counter(Recipe):
    def state_dict(self) -> dict:
        return {**super().state_dict(), "step": self.step}


class Changing(Recipe):
    def state_dict(self) -> dict:
        state = super().state_dict()
        return {**state, "step": self.step} if self.step >= 20 else state


class Copy(Recipe):
    def state_dict(self) -> dict:
        state = super().state_dict()
        return {**state, "model": {k: v.detach().clone() for k, v in state["model"].items()}}


class Grown(Recipe):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(model, optimizer)
        self.later = list(model[2].parameters())  # not in the optimizer until step 10

    def train(self, step: int) -> None:
        if step == 10:
            self.optimizer.add_param_group({"params": self.later})


class Two(Recipe):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(model, optimizer)
        self.ema = net()


def case(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         kind: type[Recipe]) -> None:
    app = kind(model, optimizer)
    models = [m for m in vars(app).values() if isinstance(m, torch.nn.Module)]
    reader = AppStateReader(app, models[0] if len(models) == 1 else None, optimizer)
    unequal = []
    for step in range(40):
        app.step = step
        app.train(step)
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        got = reader()
        calls = app.calls
        if not equal(got, app.state_dict()):
            unequal.append(step)
        app.calls = calls  # the comparison's call is not the reader's
    if dist.get_rank() == 0:
        print(f"{name} built={reader.built is not None} calls={app.calls} "
              f"unequal={','.join(map(str, unequal))}", flush=True)


dist.init_process_group("gloo")
torch.manual_seed(0)
sharded = net()
for layer in sharded:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(sharded)
case("fsdp2", sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-2), Recipe)
wrapped = DistributedDataParallel(net())
case("ddp", wrapped, torch.optim.SGD(wrapped.parameters(), lr=1e-2, momentum=0.9), Recipe)
for name, kind in (("counter", Counter), ("changing", Changing), ("two", Two), ("copy", Copy)):
    model = net()
    case(name, model, torch.optim.AdamW(model.parameters(), lr=1e-2), kind)
model = net()
case("grown", model, torch.optim.AdamW(model[0].parameters(), lr=1e-2), Grown)
dist.destroy_process_group()
