"""The save path of gemini's in-memory checkpoint, next to its baselines, in one run.

For each state size it measures (medians):
  * stall     - how long ``Checkpointer.save()`` blocks the training loop
  * commit    - from ``save()`` until the snapshot is committed (copy + checksums)
  * torch.save - ``torch.save`` of the same state to a file in /dev/shm
  * memcpy    - a raw copy of the same bytes into pre-faulted shared memory (the limit)
and prints commit throughput relative to memcpy and the stall relative to the commit.

    python benchmarks/save_bench.py --sizes 64M,256M,1G,2G --repeat 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median_time, mib, table, timer  # noqa: E402

from launcher import contract, hook, memory  # noqa: E402
from launcher.slots import SlotOwner, SlotServer  # noqa: E402

CHUNK = 64 << 20  # bytes per parameter tensor


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def make_model(nbytes: int) -> torch.nn.Module:
    sizes = [CHUNK] * (nbytes // CHUNK) + ([nbytes % CHUNK] if nbytes % CHUNK else [])
    params = [torch.nn.Parameter(torch.randn(s // 4)) for s in sizes]
    module = torch.nn.Module()
    module.params = torch.nn.ParameterList(params)
    return module


def raw_copy(model: torch.nn.Module, segment: memory.Segment) -> None:
    """Copy every parameter's bytes back to back into ``segment`` (no checksums)."""
    dst = torch.frombuffer(segment.view, dtype=torch.uint8)
    offset = 0
    for param in model.parameters():
        flat = param.detach().view(-1).view(torch.uint8)
        dst[offset:offset + flat.numel()].copy_(flat)
        offset += flat.numel()


def bench_size(nbytes: int, repeat: int) -> list[object]:
    model = make_model(nbytes)
    ckpt = hook.Checkpointer(model=model)
    ckpt.restore()
    segment = memory.create_segment(f"gemini-bench-{os.getpid()}", nbytes)
    step = iter(range(10**9))
    for _ in range(2):  # the first save allocates and pre-faults both slots
        ckpt.save(next(step))
        ckpt.wait()
    raw_copy(model, segment)
    # Rounds of stall, commit and memcpy, interleaved: this VM's memory bandwidth drifts
    # by 10-20% over a run, and each figure's median then sees the same drift.
    stalls, commits, copies = [], [], []
    for _ in range(repeat):
        with timer() as stall:
            ckpt.save(next(step))
        ckpt.wait()
        stalls.append(stall())
        with timer() as commit:
            ckpt.save(next(step))
            ckpt.wait()
        commits.append(commit())
        with timer() as copy:
            raw_copy(model, segment)
        copies.append(copy())
    ckpt.close()
    segment.close()
    memory.unlink_segment(segment.name)
    t_stall, t_commit, t_memcpy = map(statistics.median, (stalls, commits, copies))

    path = Path(memory.SHM_DIR) / f"gemini-bench-{os.getpid()}.pt"
    state = model.state_dict()
    t_torch = median_time(lambda: torch.save(state, path), repeat=max(1, repeat // 2))
    path.unlink()
    gbps = lambda t: f"{nbytes / t / 1e9:.2f} GB/s"  # noqa: E731
    return [mib(nbytes), f"{t_stall * 1e3:.2f} ms", f"{t_commit * 1e3:.1f} ms ({gbps(t_commit)})",
            f"{t_torch * 1e3:.0f} ms ({gbps(t_torch)})", f"{t_memcpy * 1e3:.1f} ms ({gbps(t_memcpy)})",
            f"{t_memcpy / t_commit:.2f}x", f"{100 * t_stall / t_commit:.1f}%"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64M,256M,1G,2G")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run_id = f"bench-{os.getpid()}"
    owner = SlotOwner(run_id=run_id, host_id="bench", local_world_size=1)
    server = SlotServer(owner)
    os.environ.update({contract.ENV_SOCKET: server.env_address, contract.ENV_PREFIX: owner.prefix,
                       "TORCHELASTIC_RUN_ID": run_id, contract.ENV_RESTORE_STEP: "-1"})
    rows = []
    try:
        with tempfile.TemporaryDirectory():
            for text in args.sizes.split(","):
                rows.append(bench_size(parse_size(text), args.repeat))
                print(f"measured {text}", file=sys.stderr, flush=True)
    finally:
        server.close()
        owner.close()
    print(f"machine: {machine()}")
    print(f"medians of {args.repeat} runs; one training thread (torch.set_num_threads(1))\n")
    print(table(["state", "save() stall", "commit (copy+xxh3)", "torch.save to /dev/shm",
                 "raw memcpy to shm", "commit vs memcpy", "stall / commit"], rows))


if __name__ == "__main__":
    main()
