"""The example GPT (examples/train_gpt.py) checkpointed with DLRover's Flash Checkpoint
into memory every step: the peer's side of benchmarks/large_state_bench.py and
benchmarks/campaign_bench.py, run with ``dlrover-run`` in DLRover's own environment (see
those scripts).

Takes the example's flags, plus ``--ckpt-dir`` (DLRover's checkpoint directory),
``--disk-every N`` (every N-th save goes to the directory too, ``StorageType.DISK``: the
agent persists it from shared memory in the background; 0: never) and
``--no-checkpoint``. On start it loads what ``load_checkpoint`` returns (the agent's
shared memory, else the newest saved to disk) and prints ``resumed at step N``. Prints
what the example prints: ``step N loss ...``, ``median_step_ms=... first_step_ms=...``
and ``median_stall_ms=...`` (the time in ``save_checkpoint``, which copies
synchronously).
"""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
# The example imports gemini's Checkpointer, which this environment has not installed and
# this script does not use.
sys.modules.setdefault("launcher", types.SimpleNamespace(Checkpointer=None))
import train_gpt as gpt  # noqa: E402


def _take(flag: str, default: str) -> str:
    """Remove ``flag VALUE`` from sys.argv (the example's parser does not know it)."""
    if flag not in sys.argv:
        return default
    at = sys.argv.index(flag)
    value = sys.argv[at + 1]
    del sys.argv[at:at + 2]
    return value


def _cloned(value: Any) -> Any:
    """A copy of a loaded state: its tensors alias DLRover's shared memory, which the
    next save overwrites."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: _cloned(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(item) for item in value)
    return value


def restore(checkpointer: Any, model: Any, optimizer: Any, scheduler: Any) -> int:
    """Load what DLRover has (its shared memory, else the newest on disk); the first
    step to run."""
    state = checkpointer.load_checkpoint()
    if not state:
        return 0
    state = _cloned(state)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"]) + 1


def main() -> None:
    import torch
    from dlrover.python.common.storage import KeepLatestStepStrategy
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
    from torch.nn.parallel import DistributedDataParallel

    ckpt_dir = _take("--ckpt-dir", "./checkpoints")
    disk_every = int(_take("--disk-every", "0"))
    args = gpt.parse_args()
    rank, world_size, device = gpt.setup("cpu", args.seed)
    data, vocab_size = gpt.encode(gpt.make_corpus(args.seed))
    model = gpt.GPT(gpt.GPTConfig(vocab_size=vocab_size, seq_len=args.seq_len,
                                  n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))
    ddp_model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, gpt.lr_lambda(args.steps))
    checkpointer = None
    start = 0
    if not args.no_checkpoint:
        # Two checkpoints on disk at most: DLRover keeps every one without a strategy.
        checkpointer = DdpCheckpointer(ckpt_dir, deletion_strategy=KeepLatestStepStrategy(
            max_to_keep=2, checkpoint_dir=ckpt_dir))
        start = restore(checkpointer, model, optimizer, scheduler)
    if rank == 0 and start > 0:
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        print(f"resumed at step {start} from DLRover Flash Checkpoint (restart {restarts})",
              flush=True)
    step_times, stalls = [], []
    for step in range(start, args.steps):
        began = time.perf_counter()
        inputs, targets = gpt.get_batch(data, args.seed, step, rank, args.batch_size, args.seq_len)
        loss = gpt.mean_across_ranks(
            gpt.train_step(ddp_model, optimizer, scheduler, inputs, targets), world_size)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss:.4f}", flush=True)
        if args.device_time > 0:
            time.sleep(args.device_time)
        if checkpointer is not None:
            saved = time.perf_counter()
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "step": step}
            to_disk = disk_every > 0 and (step + 1) % disk_every == 0
            checkpointer.save_checkpoint(
                step, state, storage_type=StorageType.DISK if to_disk else StorageType.MEMORY)
            stalls.append(time.perf_counter() - saved)
        step_times.append(time.perf_counter() - began)
        if args.sleep > 0:
            time.sleep(args.sleep)
    if rank == 0:
        print(f"done steps={args.steps} median_step_ms={gpt.median_ms(step_times):.2f} "
              f"first_step_ms={1e3 * step_times[0] if step_times else 0:.1f}", flush=True)
        if stalls:
            print(f"checkpoint stall per step: median_stall_ms={gpt.median_ms(stalls):.3f}",
                  flush=True)
    del ddp_model
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
