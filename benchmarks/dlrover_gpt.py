"""The example GPT (examples/train_gpt.py) checkpointed with DLRover's Flash Checkpoint
into memory every step: the peer's side of benchmarks/large_state_bench.py, run with
``dlrover-run`` in DLRover's own environment (see that script).

Takes the example's flags, plus ``--ckpt-dir`` (DLRover's checkpoint directory) and
``--no-checkpoint``. Prints what the example prints: ``median_step_ms=... first_step_ms=...``
and ``median_stall_ms=...`` (the time in ``save_checkpoint``, which copies synchronously).
"""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
# The example imports gemini's Checkpointer, which this environment has not installed and
# this script does not use.
sys.modules.setdefault("launcher", types.SimpleNamespace(Checkpointer=None))
import train_gpt as gpt  # noqa: E402


def main() -> None:
    import torch
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
    from torch.nn.parallel import DistributedDataParallel

    ckpt_dir = sys.argv[sys.argv.index("--ckpt-dir") + 1]
    del sys.argv[sys.argv.index("--ckpt-dir"):sys.argv.index("--ckpt-dir") + 2]
    args = gpt.parse_args()
    rank, world_size, device = gpt.setup("cpu", args.seed)
    data, vocab_size = gpt.encode(gpt.make_corpus(args.seed))
    model = gpt.GPT(gpt.GPTConfig(vocab_size=vocab_size, seq_len=args.seq_len,
                                  n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))
    ddp_model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, gpt.lr_lambda(args.steps))
    checkpointer = None if args.no_checkpoint else DdpCheckpointer(ckpt_dir)
    step_times, stalls = [], []
    for step in range(args.steps):
        began = time.perf_counter()
        inputs, targets = gpt.get_batch(data, args.seed, step, rank, args.batch_size, args.seq_len)
        loss = gpt.train_step(ddp_model, optimizer, scheduler, inputs, targets)
        gpt.mean_across_ranks(loss, world_size)
        if checkpointer is not None:
            saved = time.perf_counter()
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "step": step}
            checkpointer.save_checkpoint(step, state, storage_type=StorageType.MEMORY)
            stalls.append(time.perf_counter() - saved)
        step_times.append(time.perf_counter() - began)
    if rank == 0:
        print(f"done steps={args.steps} median_step_ms={gpt.median_ms(step_times):.2f} "
              f"first_step_ms={1e3 * step_times[0]:.1f}", flush=True)
        if stalls:
            print(f"checkpoint stall per step: median_stall_ms={gpt.median_ms(stalls):.3f}",
                  flush=True)
    del ddp_model
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
