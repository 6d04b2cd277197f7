"""Run by torchrun (2 ranks, gloo, CPU): the Checkpointer's reader of DCP app states
(``launcher.state_dicts.AppStateReader``) against the app states' own ``state_dict()``,
over 40 training steps of each:

  fsdp2     FSDP2 (fully_shard) model and AdamW, DCP's recipe (get_state_dict)
  ddp       DDP-wrapped model and SGD with momentum (names without "module.")
  counter   the recipe plus the step count: not the model's and optimizer's alone
  changing  the recipe until step 20, then with a "step" key too
  two       two models: which is the app state's is not known

For each, rank 0 prints "CASE built=B calls=C unequal=S,...": whether the reader builds
the dict itself after the last step, how often it asked the app state, and the steps at
which what it returned differed from the app state's own dict.
"""

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from launcher.state_dicts import AppStateReader, _equal


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


class Counter(Recipe):
    def state_dict(self) -> dict:
        return {**super().state_dict(), "step": self.step}


class Changing(Recipe):
    def state_dict(self) -> dict:
        state = super().state_dict()
        return {**state, "step": self.step} if self.step >= 20 else state


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
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        got = reader()
        calls = app.calls
        if not _equal(got, app.state_dict()):
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
for name, kind in (("counter", Counter), ("changing", Changing), ("two", Two)):
    model = net()
    case(name, model, torch.optim.AdamW(model.parameters(), lr=1e-2), kind)
dist.destroy_process_group()
