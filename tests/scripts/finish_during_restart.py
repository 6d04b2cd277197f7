"""A gloo job whose other hosts finish while one host restarts after a failure.

usage: finish_during_restart.py FAILING_HOST
On the first attempt, after an all_reduce, local rank 0 of the host FAILING_HOST
(GEMINI_HOST_ID) stops the other hosts' supervisors (SIGSTOP: they must not learn of the
failure, which the failing host tells them at once, before their workers are done) and
exits with code 3; its other local ranks take 2 s to stop on SIGTERM, so that host stops
its workers and joins the next round late. The ranks of every other host exit 0 once
that host has recorded its restart in the run's event log: they finish while it
restarts, and a moment after they are gone their supervisor is let go on (SIGCONT). On
later attempts every rank exits 0 after the all_reduce.
"""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

failing_host = os.environ["GEMINI_HOST_ID"] == sys.argv[1]
dist.init_process_group("gloo")
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
total = torch.ones(1)
dist.all_reduce(total)
print(f"done rank={dist.get_rank()} restart={restart}", flush=True)
dist.destroy_process_group()
if restart > 0:
    os._exit(0)
events = os.path.join(os.environ["GEMINI_RUN_DIR"], "events.jsonl")
if failing_host and os.environ["LOCAL_RANK"] == "0":
    with open(events, encoding="utf-8") as fh:
        others = {e["pid"] for line in fh if line.endswith("\n")
                  and (e := json.loads(line))["host"] != os.environ["GEMINI_HOST_ID"]}
    for pid in others:
        os.kill(pid, signal.SIGSTOP)
    os._exit(3)
if failing_host:
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(2), os._exit(0)))
    while True:
        time.sleep(1)
while True:
    with open(events, encoding="utf-8") as fh:
        if any(json.loads(line)["event"] == "restart" for line in fh if line.endswith("\n")):
            break
    time.sleep(0.02)
supervisor = os.getppid()
if os.fork() == 0:  # resumes the supervisor once this worker is gone
    time.sleep(0.5)
    os.kill(supervisor, signal.SIGCONT)
    os._exit(0)
os._exit(0)
