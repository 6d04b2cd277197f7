"""What the first write to fresh memory costs on this machine, gibibyte after gibibyte.

A checkpoint tier in memory is memory the host did not use before: on bare metal its
first touch costs the kernel's page allocation and zeroing (a fraction of a second per
GiB); on a virtual machine whose hypervisor backs guest memory lazily, or takes back
what the guest frees, the first touch of memory the host has not backed yet costs an
exit to the hypervisor per page, several times more. That cost lands on whoever
touches the memory first: the tier's slots, or the training's own buffers if the slots
took the memory that was still backed.

Maps anonymous memory 1 GiB at a time, writes one byte per page, keeps it mapped, and
prints the seconds each GiB took; then frees it all.

    python benchmarks/first_touch_bench.py [--gib 12]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, table  # noqa: E402

GIB = 1 << 30
PAGE = mmap.PAGESIZE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=12, help="GiB to touch, in all")
    args = parser.parse_args()
    held = []
    seconds: list[float] = []
    for _ in range(args.gib):
        began = time.perf_counter()
        buf = mmap.mmap(-1, GIB)
        for offset in range(0, GIB, PAGE):
            buf[offset] = 1
        held.append(buf)
        seconds.append(time.perf_counter() - began)
    for buf in held:
        buf.close()
    fastest = min(seconds)
    print(f"machine: {machine()}\n")
    print(table(["GiB", "first touch", "vs the fastest GiB"],
                [[str(i + 1), f"{s:.2f} s", f"{s / fastest:.1f}x"]
                 for i, s in enumerate(seconds)]))
    print(f"\nfastest GiB {fastest:.2f} s, median {statistics.median(seconds):.2f} s, "
          f"slowest {max(seconds):.2f} s")


if __name__ == "__main__":
    main()
