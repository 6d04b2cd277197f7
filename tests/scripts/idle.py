"""A worker that does nothing but tick: `idle.py SECONDS` prints "tick RANK N" every 0.2 s."""

import os
import sys
import time

rank = os.environ["RANK"]
deadline = time.monotonic() + float(sys.argv[1])
n = 0
while time.monotonic() < deadline:
    print(f"tick {rank} {n}", flush=True)
    n += 1
    time.sleep(0.2)
