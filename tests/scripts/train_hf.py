"""A tiny GPT-2 trained by a Hugging Face ``transformers.Trainer`` (CPU, gloo under
``gemini run``) with gemini's in-memory checkpoints (``launcher.integrations``).

  --steps N          optimizer steps (8 per epoch: 64 samples, 4 per rank, 2 ranks)
  --kill RANK:STEP   SIGKILL rank RANK once gemini committed global step STEP (first
                     attempt only)
  --out PATH         rank 0 writes the final weights and the logged losses (by step)
  --mode MODE        gemini (default): in-memory checkpoints every step; loop: a plain
                     Checkpointer(model, optimizer) saved after each step instead of the
                     integration (the hand-written loop's cost, benchmarks); none: without
                     them; disk: the Trainer's own checkpoint every step instead
  --n-embd, --n-layer  model size (benchmarks)
Rank 0 prints "median_step_ms=X" at the end: the median wall time of a training step.
Prints "resume rank=R from=S" at the start of training (S: the global step resumed).
"""

import argparse
import os
import signal
import sys
import time

import restart_stamps
import torch
from save_cost import SaveCost
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

from launcher import Checkpointer
from launcher.integrations.huggingface import TrainerCheckpoints

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--kill", default="")
p.add_argument("--out", default="")
p.add_argument("--output-dir", required=True)
p.add_argument("--mode", choices=["gemini", "loop", "none", "disk"], default="gemini")
p.add_argument("--n-embd", type=int, default=32)
p.add_argument("--n-layer", type=int, default=2)
args = p.parse_args()
rank = int(os.environ.get("RANK", "0"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Samples(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 97, (64, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Probe(TrainerCallback):
    """Says where training starts, times each step from its start to the next one's (its
    checkpoint included), and kills this rank once step ``--kill`` is committed."""

    def __init__(self) -> None:
        self.began = 0.0
        self.times: list[float] = []
        self.cost = SaveCost()
        self.loop: Checkpointer | None = None  # --mode loop

    def on_train_begin(self, args_, state, control, **kwargs):
        print(f"resume rank={rank} from={state.global_step}", flush=True)
        if args.mode == "loop":
            self.loop = Checkpointer(model=kwargs["model"], optimizer=kwargs["optimizer"])
            self.loop.restore()

    def on_step_begin(self, args_, state, control, **kwargs):
        now = time.perf_counter()
        if self.began:
            self.times.append(now - self.began)
        self.began = now
        if args.kill and attempt == 0:
            who, step = map(int, args.kill.split(":"))
            if who == rank and state.global_step == step:
                if args.mode == "gemini":
                    checkpoints.checkpointer.wait()  # step's save is committed
                restart_stamps.killed()
                os.kill(os.getpid(), signal.SIGKILL)

    def on_step_end(self, args_, state, control, **kwargs):
        restart_stamps.step_done(rank)
        if self.loop is not None:
            self.loop.save(state.global_step - 1)
        self.cost.step(self.loop or (checkpoints.checkpointer if args.mode == "gemini"
                                     else None))


training = TrainingArguments(
    output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=4,
    learning_rate=1e-3, logging_steps=1, report_to="none", seed=0,
    save_strategy="steps" if args.mode == "disk" else "no", save_steps=1,
    full_determinism=True, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
set_seed(0)  # the model's initial weights
config = GPT2Config(vocab_size=97, n_positions=16, n_embd=args.n_embd, n_layer=args.n_layer,
                    n_head=2)
model = GPT2LMHeadModel(config)
probe = Probe()
trainer = Trainer(model=model, args=training, train_dataset=Samples(), callbacks=[probe])
if args.mode == "gemini":
    checkpoints = TrainerCheckpoints()
    checkpoints.attach(trainer)
# disk: a restart resumes from the Trainer's newest checkpoint in --output-dir
trainer.train(resume_from_checkpoint=True if args.mode == "disk" and attempt > 0 else None)
probe.cost.report(rank)
if rank == 0:
    steps = sorted(probe.times)
    print(f"median_step_ms={1e3 * steps[len(steps) // 2]:.2f}", flush=True)
if rank == 0 and args.out:
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    torch.save({"weights": trainer.model.state_dict(), "losses": losses,
                "global_step": trainer.state.global_step}, args.out)
sys.stdout.flush()
# The Trainer never destroys the process group, and gloo can abort the process while the
# interpreter finalizes ("terminate called without an active exception",
# pytorch/pytorch#190489): a worker that finished would then count as failed. The script's
# work is done and flushed here, so it skips the finalization.
if args.mode == "gemini":
    checkpoints.checkpointer.close()  # what its exit handler would do
os._exit(0)
