"""A gloo DDP worker that exits with code 3 on one rank while the restart count is low.

usage: crash_ddp.py CRASH_RANK CRASH_WHILE_RESTART_COUNT_BELOW
Prints "ok rank=R restart=N" after a DDP step and a barrier on the surviving attempt.
"""

import os
import sys

import torch
import torch.distributed as dist

crash_rank, crash_below = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
model(torch.ones(2, 4)).sum().backward()
if rank == crash_rank and restart < crash_below:
    # os._exit, not sys.exit: interpreter teardown with a live gloo DDP sometimes aborts
    # (SIGABRT, pytorch/pytorch#56297), which would blur the exit code this test checks.
    os._exit(3)
dist.barrier()
print(f"ok rank={rank} restart={restart}", flush=True)
del model  # DDP must go before its process group (pytorch/pytorch#56297)
dist.destroy_process_group()
# torch 2.13's gloo sometimes aborts in interpreter teardown after all of this ("terminate
# called without an active exception", SIGABRT; 2 of 25 runs under torchrun on a loaded
# 2-core machine), which would add a restart that this script's callers count.
os._exit(0)
