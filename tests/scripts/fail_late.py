"""A gloo job whose one rank fails after its work, once its peers are done.

usage: fail_late.py FAIL_RANK DELAY_S
Every rank does an all_reduce and prints "done rank=R restart=N"; on the first attempt
FAIL_RANK then sleeps DELAY_S seconds and exits with code 3 (as a worker that crashes
in teardown), long after the other ranks exited 0.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

fail_rank, delay = int(sys.argv[1]), float(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
total = torch.ones(1)
dist.all_reduce(total)
print(f"done rank={rank} restart={restart}", flush=True)
dist.destroy_process_group()
if rank == fail_rank and restart == 0:
    time.sleep(delay)
    os._exit(3)
