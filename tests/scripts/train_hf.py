"""A tiny GPT-2 trained by a Hugging Face ``transformers.Trainer`` (CPU, gloo under
``gemini run``) with gemini's in-memory checkpoints (``launcher.integrations``).

  --steps N          optimizer steps (8 per epoch: 64 samples, 4 per rank, 2 ranks)
  --kill RANK:STEP   SIGKILL rank RANK once gemini committed global step STEP (first
                     attempt only)
  --out PATH         rank 0 writes the final weights and the logged losses (by step)
Prints "resume rank=R from=S" at the start of training (S: the global step resumed).
"""

import argparse
import os
import signal
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from launcher.integrations.huggingface import TrainerCheckpoints

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--kill", default="")
p.add_argument("--out", default="")
p.add_argument("--output-dir", required=True)
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
    """Says where training starts; kills this rank once step ``--kill`` is committed."""

    def on_train_begin(self, args_, state, control, **kwargs):
        print(f"resume rank={rank} from={state.global_step}", flush=True)

    def on_step_begin(self, args_, state, control, **kwargs):
        if args.kill and attempt == 0:
            who, step = map(int, args.kill.split(":"))
            if who == rank and state.global_step == step:
                checkpoints.checkpointer.wait()  # step's save is committed
                os.kill(os.getpid(), signal.SIGKILL)


training = TrainingArguments(
    output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=4,
    learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", seed=0,
    full_determinism=True, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
config = GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2)
model = GPT2LMHeadModel(config)
trainer = Trainer(model=model, args=training, train_dataset=Samples(), callbacks=[Probe()])
checkpoints = TrainerCheckpoints()
checkpoints.attach(trainer)
trainer.train()
if rank == 0 and args.out:
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    torch.save({"weights": trainer.model.state_dict(), "losses": losses,
                "global_step": trainer.state.global_step}, args.out)
sys.stdout.flush()
