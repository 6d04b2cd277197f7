"""GPU to CPU: how fast a checkpoint of CUDA state reaches gemini's shared-memory slot.

On a host with a CUDA device, side by side in one process:

* pinned D2H: ``copy_(non_blocking=True)`` of a CUDA tensor into a torch pinned buffer
  (``pin_memory=True``), the bandwidth the device can give;
* into a slot: the same copy on a side stream into a gemini slot (shared memory that the
  Checkpointer registers with CUDA, ``cudaHostRegister``);
* save to commit: ``Checkpointer.save`` of a model holding that many bytes of CUDA
  parameters until the slot is committed (the side-stream copy, then the xxh3 of the
  bytes on the CPU), and the time ``save`` itself blocks the loop.

Printed: medians of ``--repeat`` copies and the slot's bandwidth as a ratio of pinned
D2H. Without a CUDA device it says so and exits 0.

    python benchmarks/gpu_copy_bench.py --mib 1024 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from common import machine, table  # noqa: E402


def _timed_copy(dst: object, src: object, stream: object) -> float:
    import torch

    torch.cuda.synchronize()
    began = time.perf_counter()
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)  # type: ignore[attr-defined]
    stream.synchronize()  # type: ignore[attr-defined]
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    from launcher import contract, hook, memory
    from launcher.slots import SlotOwner, SlotServer

    nbytes = args.mib << 20
    run_id = f"gpu-bench-{os.getpid()}"
    owner = SlotOwner(run_id=run_id, host_id="bench", local_world_size=1)
    server = SlotServer(owner)
    os.environ.update({contract.ENV_SOCKET: server.env_address, contract.ENV_PREFIX: owner.prefix,
                       "TORCHELASTIC_RUN_ID": run_id, "RANK": "0", "WORLD_SIZE": "1",
                       contract.ENV_RESTORE_STEP: "-1"})
    try:
        # 16 parameters of equal size: a model's tensors, copied on the side stream
        model = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(nbytes // 16 // 4, device="cuda")) for _ in range(16))
        ckpt = hook.Checkpointer(model=model)
        ckpt.restore()
        src = torch.cat([p.detach().view(-1) for p in model])
        pinned = torch.empty(src.numel(), dtype=src.dtype, pin_memory=True)
        stream = torch.cuda.Stream()
        saves, blocking, plain, into_slot = [], [], [], []
        for step in range(args.repeat + 1):  # the first save sizes and registers the slots
            began = time.perf_counter()
            ckpt.save(step)
            returned = time.perf_counter()
            ckpt.wait()
            if step:
                saves.append(time.perf_counter() - began)
                blocking.append(returned - began)
            segment = ckpt._segments[ckpt._newest or 0]
            assert segment is not None
            slot = torch.frombuffer(segment.view, dtype=src.dtype, count=src.numel(),
                                    offset=memory.HEADER_SIZE)
            plain.append(_timed_copy(pinned, src, stream))
            into_slot.append(_timed_copy(slot, src, stream))
            del slot
        ckpt.close()
    finally:
        server.close()
        owner.close()
    gib = nbytes / (1 << 30)
    d2h, slot_bw = gib / statistics.median(plain), gib / statistics.median(into_slot)
    print(f"machine: {machine()}, {torch.cuda.get_device_name()}\n"
          f"{args.mib} MiB of CUDA parameters; medians of {args.repeat}\n")
    print(table(["", "median", "GiB/s", "vs pinned D2H"], [
        ["pinned D2H (torch pinned buffer)", f"{1e3 * statistics.median(plain):.1f} ms",
         f"{d2h:.1f}", "1.00x"],
        ["D2H into a gemini slot (side stream)", f"{1e3 * statistics.median(into_slot):.1f} ms",
         f"{slot_bw:.1f}", f"{slot_bw / d2h:.2f}x"],
        ["Checkpointer.save -> committed (copy + xxh3)", f"{1e3 * statistics.median(saves):.1f} ms",
         f"{gib / statistics.median(saves):.1f}", "-"],
        ["Checkpointer.save blocking the loop", f"{1e3 * statistics.median(blocking):.2f} ms",
         "-", "-"],
    ]))


if __name__ == "__main__":
    main()
