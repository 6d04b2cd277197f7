"""A small model trained with Hugging Face accelerate (CPU, gloo under ``gemini run``),
checkpointed through ``launcher.integrations.accelerate``: 12 steps over 1.5 epochs of a
data loader prepared by the accelerator (shuffled: 8 batches per epoch and rank), with
dropout (random state) and an LR schedule.

  --kill RANK:STEP   SIGKILL rank RANK once step STEP is committed (first attempt only)
  --out PATH         rank 0 writes the final weights and the losses by step
  --mode MODE        gemini (default): in-memory checkpoints every step; loop: a plain
                     Checkpointer(model, optimizer) instead of the integration (the
                     hand-written loop's cost, benchmarks); none: without
                     them; disk: accelerator.save_state every step instead
  --steps N, --width N  steps and hidden width (benchmarks)
  --sampler KIND     generator (default): the loader shuffles with a generator of its own;
                     seedable: accelerate's seedable sampler (order a function of the epoch)
Prints "resume rank=R start=S" (S: the first step this attempt runs); rank 0 prints
"median_step_ms=X" at the end (a step with its checkpoint).
"""

import argparse
import json
import os
import signal
import sys
import time

import restart_stamps
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from save_cost import SaveCost

from launcher import Checkpointer
from launcher.integrations.accelerate import accelerator_state

p = argparse.ArgumentParser()
p.add_argument("--kill", default="")
p.add_argument("--out", default="")
p.add_argument("--mode", choices=["gemini", "loop", "none", "disk"], default="gemini")
p.add_argument("--steps", type=int, default=12)
p.add_argument("--width", type=int, default=32)
p.add_argument("--output-dir", default="")
p.add_argument("--sampler", choices=["generator", "seedable"], default="generator")
args = p.parse_args()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
STEPS = args.steps

accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
    use_seedable_sampler=args.sampler == "seedable"))
rank = accelerator.process_index
set_seed(0)
torch.use_deterministic_algorithms(True)
model = torch.nn.Sequential(torch.nn.Linear(8, args.width), torch.nn.Tanh(),
                            torch.nn.Dropout(0.1), torch.nn.Linear(args.width, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
g = torch.Generator().manual_seed(0)
dataset = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                         torch.randn(64, 1, generator=g))
# Its own generator (without one, accelerate gives the sampler one seeded from the global
# random state); the integration saves its state as the epoch drew its order.
data = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True,
                                   generator=torch.Generator().manual_seed(0))
model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)

PER_EPOCH = len(data)
ckpt = (Checkpointer(extra={"accelerator": accelerator_state(accelerator)})
        if args.mode == "gemini" else
        Checkpointer(model=accelerator.unwrap_model(model), optimizer=optimizer)
        if args.mode == "loop" else Checkpointer())
cost = SaveCost()
start = ckpt.restore()
saved = os.path.join(args.output_dir, "step.json") if args.output_dir else ""
if args.mode == "disk" and attempt > 0 and os.path.exists(saved):  # resume from the disk
    accelerator.load_state(args.output_dir)
    with open(saved) as f:
        start = json.load(f)["step"] + 1
print(f"resume rank={rank} start={start}", flush=True)
losses = {}
times: list[float] = []
kill = tuple(map(int, args.kill.split(":"))) if args.kill else None
step = start
while step < STEPS:
    epoch, skip = divmod(step, PER_EPOCH)
    data.set_epoch(epoch)
    for inputs, targets in accelerator.skip_first_batches(data, skip) if skip else data:
        began = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses[step] = accelerator.reduce(loss.detach(), "mean").item()
        if args.mode in ("gemini", "loop"):
            ckpt.save(step)
            cost.step(ckpt)
        elif args.mode == "disk":
            accelerator.save_state(args.output_dir)
            if rank == 0:
                with open(saved + ".new", "w") as f:
                    json.dump({"step": step}, f)
                os.replace(saved + ".new", saved)
        times.append(time.perf_counter() - began)
        restart_stamps.step_done(rank)
        if kill == (rank, step) and attempt == 0:
            ckpt.wait()
            restart_stamps.killed()
            os.kill(os.getpid(), signal.SIGKILL)
        step += 1
        if step == STEPS:
            break
ckpt.close()
cost.report(rank)
if rank == 0:
    print(f"median_step_ms={1e3 * sorted(times)[len(times) // 2]:.2f}", flush=True)
if rank == 0 and args.out:
    torch.save({"weights": accelerator.unwrap_model(model).state_dict(), "losses": losses},
               args.out)
accelerator.end_training()
sys.stdout.flush()
# accelerate leaves the process group to the interpreter's exit, where gloo can abort the
# process ("terminate called without an active exception", pytorch/pytorch#190489): a
# worker that finished would then count as failed. Its work is done and flushed here.
os._exit(0)
