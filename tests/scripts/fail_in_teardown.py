"""Rank 0 commits step 0, then raises, and its teardown (an atexit handler) takes 3 s;
rank 1, whose work the error broke, exits with code 3 half a second later: torch sees
rank 1 fail first and stops rank 0 (SIGTERM) while it is still tearing down."""

import atexit
import os
import sys
import time

import torch

from launcher import Checkpointer

ckpt = Checkpointer(model=torch.nn.Linear(4, 4))
ckpt.save(0)
ckpt.wait()
if os.environ["RANK"] == "0":
    atexit.register(time.sleep, 3)
    raise ValueError("a batch the script cannot take")
time.sleep(0.5)
sys.exit(3)
