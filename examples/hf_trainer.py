"""A Hugging Face ``transformers.Trainer`` with gemini's in-memory checkpoints: one line.

A tiny GPT-2 trained from scratch on synthetic token sequences; needs ``transformers``
and ``accelerate`` (``pip install -e '.[frameworks]'``).

    gemini run --nproc-per-node 2 --max-restarts 3 examples/hf_trainer.py --steps 40

Kill a worker mid-run (``pkill -9 -f hf_trainer.py -n``): the Trainer resumes at the
next step from memory, mid-epoch, without ``resume_from_checkpoint``.
"""

import argparse
import gc
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

from launcher.integrations.huggingface import gemini_trainer


class Sequences(torch.utils.data.Dataset):
    """Seeded random token sequences whose labels are the inputs (language modelling)."""

    def __init__(self, n: int = 256, length: int = 32, vocab: int = 128) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--output-dir", default=tempfile.mkdtemp(prefix="hf-trainer-"))
    args = parser.parse_args()
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2,
                                       n_head=2))
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=8,
        learning_rate=1e-3, logging_steps=5, save_strategy="no", report_to="none",
        use_cpu=True, disable_tqdm=True, seed=0)
    trainer = gemini_trainer(Trainer(model=model, args=training, train_dataset=Sequences()))
    trainer.train()
    # The Trainer leaves the process group to the interpreter's exit, where gloo can abort
    # the process ("terminate called without an active exception"), under torchrun too;
    # the DDP model must go first.
    accelerator = trainer.accelerator
    del trainer, model
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()
