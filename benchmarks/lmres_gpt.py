"""The example GPT (examples/train_gpt.py) checkpointed with lm-resiliency 0.2.0's GEMINI
(the GEMINI paper authors' implementation): the peer's side of benchmarks/campaign_bench.py,
run with torchrun in lm-resiliency's own environment.

lm-resiliency is enabled the way its API guide says for a native PyTorch loop: one
``enable_resiliency(model, optimizer, interval=1, ...)`` call after the model and optimizer
exist and before the loop, on every rank. It then captures the model, optimizer, RNG and
the caller's extra state (here the LR scheduler) from a post-hook of ``optimizer.step()``
after every step into CPU buffers, replicates each capture to the paired rank over a Gloo
group in the background, and writes its node-local disk tier (``--ckpt-dir``) every
``--flush-every`` steps and, from a SIGTERM handler or at exit, the newest own and peer
copies. The same call restores on start: the newest step every rank holds, from memory
or the disk tier; ``handle.step_count`` is then the first step to run. SCOUT detection
is off (it localizes with three or more equivalent peers; this job has two).

Takes the example's flags, plus ``--ckpt-dir`` (the disk tier), ``--run-id`` (GEMINI's
run identity, kept across restarts of the whole job so that the new job may load the
old job's files), ``--flush-every N`` (0: only on SIGTERM and at exit) and
``--no-checkpoint``. Prints what the example prints: ``step N loss ...``, ``resumed at
step N`` and ``median_step_ms=...``.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import types
from collections.abc import Callable
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


def enable(model: Any, optimizer: Any, scheduler: Any, world_size: int, ckpt_dir: str,
           run_id: str, flush_every: int) -> Any:
    """lm-resiliency's handle: GEMINI captures after every optimizer step, restored from
    the newest step every rank holds."""
    import torch
    import torch.distributed as dist
    from lm_resiliency import InMemoryCkptConfig, enable_resiliency

    def restore_scheduler(extra: dict[str, Any]) -> None:
        scheduler.load_state_dict(extra["scheduler"])
        # The capture runs in optimizer.step()'s post-hook, before this step's
        # scheduler.step(): advance the scheduler over the step the checkpoint holds.
        scheduler.step()

    # Without a group, enable_resiliency forms its peer groups itself, an NCCL one among
    # them, which a CPU-only torch cannot create: pass the Gloo group it would have formed
    # (all ranks: DDP's replicas).
    group = dist.new_group(backend="gloo") if world_size > 1 else None
    return enable_resiliency(
        model, optimizer, interval=1, enable_detection=False, group=group,
        checkpoint=InMemoryCkptConfig(disk_folder=ckpt_dir, disk_flush_interval=flush_every,
                                      run_id=run_id, pin_memory=False),
        device=torch.device("cpu"),
        extra_state_fn=lambda: {"scheduler": scheduler.state_dict()},
        load_extra_state_fn=restore_scheduler)


def prune(ckpt_dir: str, keep: int = 4) -> None:
    """Remove all but the newest ``keep`` steps of the disk tier: lm-resiliency never
    removes a generation it wrote (nothing calls its ``cleanup_older_than``), and a
    step of this job takes 2 x 250 MiB."""
    for run in Path(ckpt_dir).glob("runs/*/*"):
        steps = sorted(run.glob("step-*"), key=lambda path: int(path.name.split("-")[1]))
        for old in steps[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def train(args: Any, rank: int, world_size: int, start: int, model: Any, optimizer: Any,
          scheduler: Any, after_step: Callable[[int], None]) -> None:
    """The example's loop from ``start``, with its step lines and timing."""
    from torch.nn.parallel import DistributedDataParallel

    data, _ = gpt.encode(gpt.make_corpus(args.seed))
    ddp_model = DistributedDataParallel(model) if world_size > 1 else model
    loss = float("nan")
    step_times = []
    for step in range(start, args.steps):
        began = time.perf_counter()
        inputs, targets = gpt.get_batch(data, args.seed, step, rank, args.batch_size, args.seq_len)
        rank_loss = gpt.train_step(ddp_model, optimizer, scheduler, inputs, targets)
        loss = gpt.mean_across_ranks(rank_loss, world_size)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss:.4f}", flush=True)
        if args.device_time > 0:
            time.sleep(args.device_time)
        step_times.append(time.perf_counter() - began)
        after_step(step)
        if args.sleep > 0:
            time.sleep(args.sleep)
    if rank == 0:
        print(f"done steps={args.steps} final_loss={loss:.4f} "
              f"median_step_ms={gpt.median_ms(step_times):.2f} "
              f"first_step_ms={1e3 * step_times[0] if step_times else 0:.1f}", flush=True)


def main() -> None:
    import torch
    import torch.distributed as dist

    ckpt_dir = _take("--ckpt-dir", "./checkpoints")
    run_id = _take("--run-id", os.environ.get("TORCHELASTIC_RUN_ID", "lmres-gpt"))
    flush_every = int(_take("--flush-every", "0"))
    args = gpt.parse_args()
    rank, world_size, _ = gpt.setup("cpu", args.seed)
    _, vocab_size = gpt.encode(gpt.make_corpus(args.seed))
    model = gpt.GPT(gpt.GPTConfig(vocab_size=vocab_size, seq_len=args.seq_len,
                                  n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, gpt.lr_lambda(args.steps))
    resiliency = None
    if not args.no_checkpoint:
        resiliency = enable(model, optimizer, scheduler, world_size, ckpt_dir, run_id,
                            flush_every)
    start = resiliency.step_count if resiliency is not None else 0
    if rank == 0 and start > 0:
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        print(f"resumed at step {start} from lm-resiliency (restart {restarts})", flush=True)

    def after_step(step: int) -> None:
        if rank == 0 and flush_every > 0 and (step + 1) % flush_every == 0:
            prune(ckpt_dir)

    train(args, rank, world_size, start, model, optimizer, scheduler, after_step)
    if resiliency is not None:
        resiliency.close()  # before the groups it uses are destroyed
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
