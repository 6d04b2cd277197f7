"""A small model trained by a Lightning ``Trainer`` (CPU, DDP over gloo, one process per
worker under ``gemini run``) with gemini's in-memory checkpoints
(``launcher.integrations.lightning``): dropout, AdamW, a per-step LR schedule, and a plain
DataLoader that Lightning gives a shuffling DistributedSampler (8 batches per epoch with 2
workers).

  --steps N          optimizer steps (max_steps)
  --kill RANK:STEP   SIGKILL rank RANK once gemini committed global step STEP (first
                     attempt only)
  --out PATH         rank 0 writes the final weights and its losses by global step
  --mode MODE        gemini (default): in-memory checkpoints every step; loop: a plain
                     Checkpointer(model, optimizer) saved after each batch instead of the
                     integration (the hand-written loop's cost, benchmarks); none: without
                     them; disk: Lightning's own ModelCheckpoint every step instead
  --width N          hidden width (benchmarks)
  --output-dir DIR   where ModelCheckpoint writes (--mode disk)
Prints "resume rank=R from=S" when training starts (S: the global step it starts from);
rank 0 prints "median_step_ms=X" at the end: the median wall time of a training step.
"""

import argparse
import os
import signal
import sys
import time

import lightning.pytorch as pl
import restart_stamps
import torch
from save_cost import SaveCost

from launcher import Checkpointer
from launcher.integrations.lightning import GeminiCheckpoints

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=16)
p.add_argument("--kill", default="")
p.add_argument("--out", default="")
p.add_argument("--mode", choices=["gemini", "loop", "none", "disk"], default="gemini")
p.add_argument("--width", type=int, default=32)
p.add_argument("--output-dir", default="")
args = p.parse_args()
rank = int(os.environ.get("RANK", "0"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Regression(pl.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                         "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                              torch.randn(64, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)


class Probe(pl.Callback):
    """Says where training starts, records rank 0's loss of every step, times each step
    from its start to the next one's (its checkpoint included), and kills this rank once
    step ``--kill`` is committed."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.began = 0.0
        self.times: list[float] = []
        self.cost = SaveCost()
        self.loop: Checkpointer | None = None  # --mode loop

    def on_train_start(self, trainer, pl_module):
        print(f"resume rank={rank} from={trainer.global_step}", flush=True)
        if args.mode == "loop":
            self.loop = Checkpointer(model=pl_module, optimizer=trainer.optimizers[0])
            self.loop.restore()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self.began:
            self.times.append(now - self.began)
        self.began = now
        if args.kill and attempt == 0:  # GeminiCheckpoints saved the last step (it runs last)
            who, step = map(int, args.kill.split(":"))
            if who == rank and trainer.global_step == step:
                if args.mode == "gemini":
                    checkpoints.checkpointer.wait()  # that step's save is committed
                restart_stamps.killed()
                os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = outputs["loss"].item()
        restart_stamps.step_done(rank)
        if self.loop is not None:
            self.loop.save(trainer.global_step - 1)
        self.cost.step(self.loop or (checkpoints.checkpointer if args.mode == "gemini"
                                     else None))


pl.seed_everything(0, verbose=False)  # the model's initial weights
model = Regression(args.width)
probe = Probe()
callbacks: list[pl.Callback] = []
if args.mode == "gemini":
    checkpoints = GeminiCheckpoints(every=1)
    callbacks.append(checkpoints)
elif args.mode == "disk":
    callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.output_dir,
                                                  every_n_train_steps=1, save_last=True))
trainer = pl.Trainer(
    accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")), strategy="ddp",
    max_steps=args.steps, callbacks=[*callbacks, probe], deterministic=True,
    enable_checkpointing=args.mode == "disk", logger=False, enable_progress_bar=False,
    enable_model_summary=False, default_root_dir=args.output_dir or None)
# disk: a restart resumes from Lightning's last checkpoint in --output-dir
trainer.fit(model, ckpt_path="last" if args.mode == "disk" and attempt > 0 else None)
probe.cost.report(rank)
if rank == 0:
    steps = sorted(probe.times)
    print(f"median_step_ms={1e3 * steps[len(steps) // 2]:.2f}", flush=True)
if rank == 0 and args.out:
    torch.save({"weights": model.state_dict(), "losses": probe.losses,
                "global_step": trainer.global_step}, args.out)
sys.stdout.flush()
# Lightning never destroys the process group, and gloo can abort the process while the
# interpreter finalizes ("terminate called without an active exception"): a worker that
# finished would then count as failed. The script's work is done and flushed here, so it
# skips the finalization.
if args.mode == "gemini":
    checkpoints.checkpointer.close()  # what its exit handler would do
os._exit(0)
