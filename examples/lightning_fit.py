"""A Lightning ``Trainer`` with gemini's in-memory checkpoints: one callback.

A small character-level language model (an embedding, a GRU, dropout) trained from
scratch on seeded random token sequences with DDP on the CPU; needs ``lightning``
(``pip install -e '.[frameworks]'``).

    gemini run --nproc-per-node 2 --max-restarts 3 examples/lightning_fit.py --steps 200

Kill a worker mid-run (``pkill -9 -f lightning_fit.py -n``): ``trainer.fit`` resumes at
the next step from memory, mid-epoch, without ``ckpt_path``.
"""

import argparse
import os

import lightning.pytorch as pl
import torch

from launcher.integrations.lightning import GeminiCheckpoints


class Sequences(torch.utils.data.Dataset):
    """Seeded random token sequences; the target of each token is the next one."""

    def __init__(self, n: int = 512, length: int = 33, vocab: int = 64) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i, :-1], self.ids[i, 1:]


class CharModel(pl.LightningModule):
    def __init__(self, vocab: int = 64, width: int = 128) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Embedding(vocab, width)
        self.rnn = torch.nn.GRU(width, width, batch_first=True)
        self.drop = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(width, vocab)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
                      ) -> torch.Tensor:
        inputs, targets = batch
        hidden, _ = self.rnn(self.embed(inputs))
        logits = self.head(self.drop(hidden))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict[str, object]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> torch.utils.data.DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        return torch.utils.data.DataLoader(Sequences(), batch_size=16, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // int(
            os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp", max_steps=args.steps, logger=False, enable_checkpointing=False,
        callbacks=[GeminiCheckpoints(every=1)])
    trainer.fit(CharModel())
    # Lightning keeps the process group for later calls; a group left to the interpreter's
    # exit can abort the process under gloo.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
