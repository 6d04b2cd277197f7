"""A small character-level GPT trained with DDP (or FSDP2, ``--fsdp``), for demos, launcher
tests and benchmarks.

Runs under torchrun (or gemini) when RANK/WORLD_SIZE are set, and as a single process
otherwise. The data is synthetic and made in code, and the batch for (step, rank) is a
pure function of (seed, step, rank), so a run resumed at step s sees exactly the batches
an uninterrupted run would. Two runs with the same flags end with bitwise-equal weights.

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 20
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launcher import Checkpointer

# ---------------------------------------------------------------------------- data

SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher"]
VERBS = ["sees", "likes", "finds", "follows", "paints", "remembers"]
OBJECTS = ["the river", "a red ball", "the green house", "an apple", "the quiet town"]
ENDINGS = [".", " today.", " again.", " in the morning.", " at night."]


def make_corpus(seed: int, n_sentences: int = 4000) -> str:
    """Seeded English-like text from a tiny grammar (about 150 KB)."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(n_sentences):
        words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
        if rng.random() < 0.3:
            words += ["and", rng.choice(VERBS), rng.choice(OBJECTS)]
        sentence = " ".join(words) + rng.choice(ENDINGS)
        sentences.append(sentence[0].upper() + sentence[1:])
    return " ".join(sentences) + "\n"


def encode(text: str) -> tuple[torch.Tensor, int]:
    """Map characters to ids (their rank in the sorted vocabulary); returns the id tensor
    and the vocabulary size. ASCII text is mapped as bytes, in a few tensor operations:
    a restarted worker encodes the corpus again before its first step."""
    raw = text.encode()
    if len(raw) != len(text):  # not ASCII: character by character
        vocab = sorted(set(text))
        index = {char: i for i, char in enumerate(vocab)}
        return torch.tensor([index[c] for c in text], dtype=torch.long), len(vocab)
    codes = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    present = torch.zeros(128, dtype=torch.long)
    present[codes] = 1
    return (torch.cumsum(present, 0) - 1)[codes], int(present.sum())


def get_batch(
    data: torch.Tensor, seed: int, step: int, rank: int, batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-character targets; a pure function of (seed, step, rank)."""
    batch_seed = random.Random(f"{seed}/{step}/{rank}").getrandbits(63)
    generator = torch.Generator().manual_seed(batch_seed)
    starts = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=generator)
    inputs = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
    targets = torch.stack([data[s + 1 : s + seq_len + 1] for s in starts.tolist()])
    return inputs, targets


# --------------------------------------------------------------------------- model


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    n_embd: int


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time_, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        shape = (batch, time_, self.n_head, channels // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(batch, time_, channels))
        return out


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.seq_len, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


# ------------------------------------------------------------------------ training


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds after each step")
    parser.add_argument("--device-time", type=float, default=0.0, metavar="SECONDS",
                        help="seconds each step waits before its checkpoint, counted in the "
                             "step's time, as if for an accelerator: a stand-in for GPU "
                             "compute, during which the host's CPU is free")
    parser.add_argument("--save-weights", metavar="PATH", help="rank 0 saves the final weights")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard parameters and optimizer state with FSDP2 (fully_shard) "
                             "instead of replicating them with DDP")
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--alternate-saves", type=int, default=0, metavar="N",
                        help="save only in every other block of N steps, and report the "
                             "median step with and without a save (benchmarks)")
    parser.add_argument("--no-checkpoint", action="store_true",
                        help="do not save to gemini's in-memory tier (for overhead baselines)")
    parser.add_argument("--torch-save", metavar="PATH",
                        help="instead of gemini's hook, rank 0 writes the state to PATH with "
                             "torch.save (and fsync) every step, and every rank resumes from "
                             "it with torch.load: a plain torchrun job (benchmark baselines)")
    parser.add_argument("--torch-save-every", type=int, default=1, metavar="N",
                        help="with --torch-save, write every N-th step only")
    return parser.parse_args()


def save_to_disk(path: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """What a torchrun job does: the whole state to a file, atomically replaced."""
    partial = f"{path}.partial"
    with open(partial, "wb") as fh:
        torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(partial, path)


def load_from_disk(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler) -> int:
    """The first step to run after the state in ``path`` (0 without one)."""
    if not os.path.exists(path):
        return 0
    state = torch.load(path, map_location="cpu")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"]) + 1


def setup(device_kind: str, seed: int) -> tuple[int, int, torch.device]:
    """Seed everything and join the process group if launched by torchrun."""
    if device_kind == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, device
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def lr_lambda(total_steps: int) -> Callable[[int], float]:
    """Linear warmup over the first 10% of steps, then cosine decay to 10%."""
    warmup = max(1, total_steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def mean_across_ranks(value: torch.Tensor, world_size: int) -> float:
    """The mean of a scalar over all ranks (the value itself without a group)."""
    if world_size == 1:
        return value.item()
    total = value.detach().clone()
    dist.all_reduce(total)
    return total.item() / world_size


def median_ms(times: list[float]) -> float:
    return 1e3 * sorted(times)[len(times) // 2] if times else 0.0


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """One optimizer step; returns this rank's loss."""
    optimizer.zero_grad(set_to_none=True)
    loss: torch.Tensor = model(inputs, targets)
    torch.autograd.backward(loss)
    optimizer.step()
    scheduler.step()
    return loss.detach()


# Complexity above 10: one script's whole run, its modes (FSDP, torch.save, timing) in line.
def main() -> None:  # noqa: C901
    args = parse_args()
    rank, world_size, device = setup(args.device, args.seed)
    data, vocab_size = encode(make_corpus(args.seed))
    config = GPTConfig(
        vocab_size=vocab_size,
        seq_len=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )
    model = GPT(config).to(device)
    ddp_model: nn.Module = model
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        if args.torch_save or not dist.is_initialized():
            raise SystemExit("--fsdp runs under torchrun or gemini run, without --torch-save")
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif world_size > 1:
        ddp_model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.steps))
    # gemini's hook: model, optimizer, scheduler and RNG states in memory every step.
    ckpt = Checkpointer(model=model, optimizer=optimizer, extra={"scheduler": scheduler})
    if args.torch_save:
        args.no_checkpoint = True
        start = load_from_disk(args.torch_save, model, optimizer, scheduler)
    else:  # without checkpoints, nothing to restore and no slots to reserve
        start = 0 if args.no_checkpoint else ckpt.restore()
    if rank == 0 and start > 0:
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        where = args.torch_save or "the in-memory checkpoint"
        print(f"resumed at step {start} from {where} (restart {restarts})", flush=True)
    loss = float("nan")
    step_times = []
    stalls = []  # per step: seconds the loop spent blocked in a checkpoint's save and waits
    by_saving: dict[bool, list[float]] = {True: [], False: []}
    for step in range(start, args.steps):
        began = time.perf_counter()
        stalled = ckpt.stalled
        inputs, targets = get_batch(data, args.seed, step, rank, args.batch_size, args.seq_len)
        rank_loss = train_step(ddp_model, optimizer, scheduler, inputs.to(device), targets.to(device))
        loss = mean_across_ranks(rank_loss, world_size)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss:.4f}", flush=True)
        if args.device_time > 0:
            time.sleep(args.device_time)
        saving = not args.no_checkpoint and (
            args.alternate_saves <= 0 or (step // args.alternate_saves) % 2 == 0)
        if saving:
            ckpt.save(step)  # a large state finishes copying in the background
        elif args.torch_save and rank == 0 and (step + 1) % args.torch_save_every == 0:
            saved = time.perf_counter()
            save_to_disk(args.torch_save, step, model, optimizer, scheduler)
            stalled -= time.perf_counter() - saved
        step_times.append(time.perf_counter() - began)
        stalls.append(ckpt.stalled - stalled)
        by_saving[saving].append(step_times[-1])
        if args.sleep > 0:
            time.sleep(args.sleep)
    ckpt.close()
    if rank == 0:
        print(f"done steps={args.steps} final_loss={loss:.4f} "
              f"median_step_ms={median_ms(step_times):.2f} "
              f"first_step_ms={1e3 * step_times[0] if step_times else 0:.1f}", flush=True)
        if stalls and (args.torch_save or not args.no_checkpoint):
            print(f"checkpoint stall per step: median_stall_ms={median_ms(stalls):.3f} "
                  f"max_stall_ms={1e3 * max(stalls):.3f} saves_skipped={ckpt.skipped}", flush=True)
        if args.alternate_saves > 0:
            print(f"median_saving_ms={median_ms(by_saving[True]):.3f} "
                  f"median_plain_ms={median_ms(by_saving[False]):.3f}", flush=True)
        if args.save_weights:
            torch.save(model.state_dict(), args.save_weights)
    # Free DDP before the group: if DDP's reducer drops the last reference to a gloo
    # group, the group's threads are joined with the GIL held and can deadlock at exit
    # (pytorch/pytorch#56297); destroy_process_group releases the GIL first.
    del ddp_model
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
