"""A small, deterministic FSDP2 (fully_shard) job on CPU with gloo that uses gemini's
Checkpointer: its model and optimizer state are DTensors sharded across the ranks.

  --kill RANK:STEP   SIGKILL rank RANK right after its snapshot of STEP is committed
                     (first attempt only)
  --out PATH         rank 0 writes the full (unsharded) model and optimizer state
  --dump DIR         rank 0 writes the full state before each save as DIR/saved-W-STEP.pt
                     (W: the world size) and right after a restore as DIR/restored-W-S.pt
  --sleep SECONDS    pause after each step
  --app-state        hand the Checkpointer only a torch.distributed.checkpoint Stateful
                     app state (get_state_dict/set_state_dict), as DCP users and
                     torchtitan do, instead of the model and optimizer
  --mode MODE        gemini (default): in-memory checkpoints every step; none: without
                     them; disk: torch.distributed.checkpoint.save of the app state to
                     --output-dir every step instead (benchmarks; with --app-state)
  --width N          hidden width (benchmarks)
  --hsdp             HSDP: a 2-D mesh, parameters replicated over its first dimension
                     (2 replicas) and sharded over the second
  --report-slots     rank 0 prints the bytes of the last step in the host's slots
  --loader           batches from a shuffled DataLoader (DistributedSampler, 64 samples of
                     8 a batch) over epochs, fast-forwarded on resume, instead of one
                     batch generated from each step's number
Prints "resume rank=R start=S attempt=A world=W" and "step N" (rank 0); rank 0 prints
"median_step_ms=X" at the end (a step with its checkpoint).
"""

import argparse
import itertools
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from save_cost import SaveCost
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

from launcher import Checkpointer

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
p.add_argument("--loader", action="store_true")
p.add_argument("--kill", default="")
p.add_argument("--out", default="")
p.add_argument("--dump", default="")
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--app-state", action="store_true")
p.add_argument("--mode", choices=["gemini", "none", "disk"], default="gemini")
p.add_argument("--width", type=int, default=33)
p.add_argument("--output-dir", default="")
p.add_argument("--hsdp", action="store_true")
p.add_argument("--report-slots", action="store_true")
args = p.parse_args()


def full_state() -> dict:
    """Model and optimizer state, unsharded (a collective: every rank calls it)."""
    full = {f"model/{k}": v.full_tensor() for k, v in model.state_dict().items()}
    for i, state in enumerate(opt.state.values()):
        for key, value in state.items():
            full[f"opt/{i}/{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full


def dump(name: str) -> None:
    full = full_state()
    if args.dump and rank == 0:
        torch.save(full, os.path.join(args.dump, name))


dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
model = torch.nn.Sequential(torch.nn.Linear(16, args.width), torch.nn.Tanh(),
                            torch.nn.Linear(args.width, 4))
mesh = None
if args.hsdp:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                            mesh_dim_names=("replicate", "shard"))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)


class AppState(Stateful):
    """The app state of torch.distributed.checkpoint's FSDP2 recipe."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optimizer_state}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


app_state = AppState(model, opt)
if args.mode != "gemini":
    ckpt = Checkpointer()
elif args.app_state:
    ckpt = Checkpointer(extra={"app": app_state})
else:
    ckpt = Checkpointer(model=model, optimizer=opt)
start = ckpt.restore()
world = dist.get_world_size()
print(f"resume rank={rank} start={start} attempt={attempt} world={world}", flush=True)
if args.dump and start:
    dump(f"restored-{world}-{start - 1}.pt")
kill = tuple(map(int, args.kill.split(":"))) if args.kill else None
times: list[float] = []
cost = SaveCost()


def batches(start: int):
    """(step, batch) from ``start`` on."""
    if not args.loader:
        for step in range(start, args.steps):
            yield step, torch.randn(8, 16, generator=torch.Generator().manual_seed(
                step * 100 + rank))
        return
    dataset = torch.utils.data.TensorDataset(
        torch.randn(64, 16, generator=torch.Generator().manual_seed(0)))
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)
    step = start
    while step < args.steps:
        epoch, skip = divmod(step, len(loader))
        sampler.set_epoch(epoch)  # the order: a function of the seed and the epoch
        for (x,) in itertools.islice(loader, skip, None):
            yield step, x
            step += 1
            if step == args.steps:
                return


for step, x in batches(start):
    began = time.perf_counter()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if args.dump:  # before the save: a committed step always has its dump
        dump(f"saved-{world}-{step}.pt")
    if args.mode == "gemini":
        ckpt.save(step)
        cost.step(ckpt)
    elif args.mode == "disk":
        dcp.save({"app": app_state}, checkpoint_id=args.output_dir)
    times.append(time.perf_counter() - began)
    if rank == 0:
        print(f"step {step}", flush=True)
    time.sleep(args.sleep)
    if kill == (rank, step) and attempt == 0:
        ckpt.wait()
        os.kill(os.getpid(), signal.SIGKILL)
if args.report_slots:
    from slot_report import report

    report(ckpt, args.steps - 1, model, opt)
ckpt.close()
cost.report(rank)
if rank == 0 and times:
    print(f"median_step_ms={1e3 * sorted(times)[len(times) // 2]:.2f}", flush=True)
full = full_state()
if rank == 0 and args.out:
    torch.save(full, args.out)
dist.destroy_process_group()
# torch 2.13's FSDP2 on gloo aborts at interpreter exit about one run in four, under
# torchrun as well ("terminate called without an active exception"): skip that teardown.
sys.stdout.flush()
os._exit(0)
