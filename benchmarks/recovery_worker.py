"""Worker of recovery_bench.py: trains a state of a given size, dies once, reports timings.

Modes: "gemini" saves every step with gemini's Checkpointer; "disk" saves the step before
the kill with torch.save (+fsync) and restores with torch.load, as a torchrun job would.
On its first attempt the worker kills itself right after the snapshot of --kill-step is
durable, writing the kill time first; the restarted worker prints a JSON line with the
phases of its recovery.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

T_START = time.time()
SETTLE_S = 10.0

import torch  # noqa: E402

from launcher import Checkpointer  # noqa: E402

T_IMPORTED = time.time()

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["gemini", "disk"], required=True)
p.add_argument("--state-bytes", type=int, required=True)
p.add_argument("--dir", required=True)
p.add_argument("--kill-step", type=int, default=1)
args = p.parse_args()
torch.set_num_threads(1)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

# params + Adam's exp_avg + exp_avg_sq = 3x the parameter bytes
param_bytes = args.state_bytes // 3
chunk = 64 << 20
sizes = [chunk] * (param_bytes // chunk) + ([param_bytes % chunk] if param_bytes % chunk else [])
torch.manual_seed(0)
model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s // 4)) for s in sizes])
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
t_built = time.time()


def train_step() -> None:
    loss = sum((p * p).sum() for p in model.parameters())
    opt.zero_grad()
    loss.backward()
    opt.step()


path = os.path.join(args.dir, "ckpt.pt")
if args.mode == "gemini":
    ckpt = Checkpointer(model=model, optimizer=opt)
    start = ckpt.restore()
elif attempt > 0:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    start = state["step"] + 1
else:
    start = 0
t_restored = time.time()

for step in range(start, args.kill_step + 2):
    train_step()
    if args.mode == "gemini":
        ckpt.save(step)
    if attempt == 0 and step == args.kill_step:
        if args.mode == "gemini":
            ckpt.wait()
        else:
            with open(path + ".tmp", "wb") as fh:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(path + ".tmp", path)
        # A failure hours into a run finds the supervisor settled (gemini's standby
        # workers start importing torch 3 s after the workers): fail no sooner than that.
        time.sleep(max(0.0, T_START + SETTLE_S - time.time()))
        if os.environ.get("BENCH_DROP_CACHES"):  # cold page cache, as after a reboot
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("3\n")
        with open(os.path.join(args.dir, "killed_at"), "w") as fh:
            fh.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt > 0:
        t_step = time.time()
        with open(os.path.join(args.dir, "killed_at")) as fh:
            killed = float(fh.read())
        print("RECOVERY " + json.dumps({
            "resumed_at": start, "restart": T_START - killed, "startup": t_built - T_START,
            "imports": T_IMPORTED - T_START,
            "restore": t_restored - t_built, "first_step": t_step - t_restored,
            "total": t_step - killed}), flush=True)
        break
if args.mode == "gemini":
    ckpt.close()
