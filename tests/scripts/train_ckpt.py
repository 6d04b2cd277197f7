"""A small, fully deterministic DDP training job that uses gemini's Checkpointer.

Fault injection for tests (deterministic, only on the attempt given):
  --kill RANK:STEP:WHEN[:ATTEMPT]   SIGKILL rank RANK at step STEP, WHEN is
      "copy"  inside the snapshot copy of STEP: bytes written, not committed
      "late"  like "copy", but training goes on while the copy runs (with --slow-copy:
              a rank that dies in a copy its peers have run a step past)
      "step"  between steps, after the snapshot of STEP is committed
      "flip"  like "step", but first flip one bit of that committed snapshot in memory
      "stop"  like "step", but SIGSTOP instead: a hung worker (for --hang-timeout)
Prints "resume rank=R start=S attempt=A" and, on rank 0, "step S loss L".
"""

import time

STARTED = time.time()  # before torch is imported: the step log's "start"

import argparse  # noqa: E402
import hashlib  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402

import restart_stamps  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from launcher import Checkpointer, copier, memory  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--width", type=int, default=64)
p.add_argument("--depth", type=int, default=2)
p.add_argument("--out", default="")
p.add_argument("--init", default="", help="start from a state --out wrote (a reference run "
               "that changes its world size between runs: no gemini involved)")
p.add_argument("--kill", action="append", default=[])
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--grad-sync", choices=["ddp", "params"], default="ddp",
               help="params: one all_reduce per gradient, in a fixed order. DDP sums each bucket "
               "in an order that depends on its bucket layout, which it rebuilds in the first "
               "iteration after every (re)start: with more than 2 ranks that changes the "
               "rounding, so a resumed run is not bitwise equal to an unfailed one")
p.add_argument("--replicated", action="store_true",
               help="tell the Checkpointer that every rank holds the same state (with "
               "--grad-sync params, which it cannot see)")
p.add_argument("--private-mb", type=int, default=0,
               help="also checkpoint this many MiB of random bytes that differ for every "
               "rank and step, in extra: state no peer holds, so replication must send it")
p.add_argument("--raise-after-restore", type=int, default=None, metavar="STEP",
               help="rank 0 raises right after restoring any step >= STEP: a state the "
               "script cannot take (an older one it can)")
p.add_argument("--grow-at", default="", metavar="STEP:MB",
               help="from step STEP on, extra holds MB MiB more of private bytes: the state "
               "outgrows its slots (with a full /dev/shm, the new ones cannot be made)")
p.add_argument("--flip-param", default="", metavar="RANK:STEP",
               help="silent data corruption: right after the optimizer step of STEP (in a "
               "run started from step 0 only), rank RANK flips one mantissa bit of a "
               "parameter it saves itself (with replicated state split between the local "
               "ranks, one of its share)")
p.add_argument("--step-log", default="", metavar="FILE",
               help="rank 0 appends 'start T' as it starts and 'step S T' as each step ends "
               "(wall-clock seconds): the workload's own record of its goodput")
p.add_argument("--loader-jitter", type=float, default=0.0, metavar="SECONDS",
               help="each step first waits a random 0..SECONDS, the same distribution on "
               "every rank: a data loader with hiccups")
p.add_argument("--pause-every", default="", metavar="N:SECONDS",
               help="after every N-th step, pause SECONDS without an optimizer step: an "
               "evaluation")
p.add_argument("--slow-copy", default="", metavar="RANK:STEP:SECONDS",
               help="rank RANK's save of STEP waits SECONDS before copying, its slot in "
               "WRITING: a copy still in flight when a peer fails")
p.add_argument("--report-slots", action="store_true",
               help="rank 0 prints the bytes of the last step in the host's own slots "
               "(every rank's) and the bytes of one model and optimizer state")
args = p.parse_args()

def log_step(line, at=None):
    if args.step_log and os.environ.get("RANK", "0") == "0":
        with open(args.step_log, "a") as log:
            log.write(f"{line} {at or time.time():.6f}\n")


log_step("start", STARTED)
torch.manual_seed(0)
random.seed(0)
torch.use_deterministic_algorithms(True)
distributed = "RANK" in os.environ
if distributed:
    dist.init_process_group("gloo")
rank = dist.get_rank() if distributed else 0
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

layers = []
for _ in range(args.depth):
    layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
net = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1))
ddp = distributed and args.grad_sync == "ddp"
model = torch.nn.parallel.DistributedDataParallel(net) if ddp else net
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
extra = {"scheduler": sched, "progress": {"samples": 0}}
if args.private_mb:
    extra["private"] = torch.zeros(args.private_mb << 18)
ckpt = Checkpointer(model=model, optimizer=opt, extra=extra,
                    replicated=True if args.replicated else None)
start = ckpt.restore()
if args.init:
    init = torch.load(args.init)
    net.load_state_dict(init["model"])
    opt.load_state_dict(init["opt"])
    sched.load_state_dict(init["sched"])
    extra["progress"]["samples"] = init["samples"]
    torch.set_rng_state(init["rng"])
    start = init["step"] + 1
digest = hashlib.sha1(b"".join(t.detach().numpy().tobytes() for t in net.state_dict().values()))
print(f"resume rank={rank} start={start} attempt={attempt} model={digest.hexdigest()[:12]} "
      f"samples={extra['progress']['samples']}", flush=True)

if rank == 0 and args.raise_after_restore is not None and start - 1 >= args.raise_after_restore:
    raise ValueError(f"cannot train from the state of step {start - 1}")

kills = []
for spec in args.kill:
    parts = spec.split(":")
    kills.append((int(parts[0]), int(parts[1]), parts[2], int(parts[3]) if len(parts) > 3 else 0))


slow = args.slow_copy.split(":") if args.slow_copy else None
if slow and int(slow[0]) == rank:
    slow_copy = copier.CopyWorker.copy_all

    def copy_slowly(self, *copy_args):
        if saving == int(slow[1]):
            time.sleep(float(slow[2]))
        return slow_copy(self, *copy_args)

    copier.CopyWorker.copy_all = copy_slowly

copy_kill_steps = {k_step for k_rank, k_step, when, k_attempt in kills
                   if k_rank == rank and k_attempt == attempt and when in ("copy", "late")}
if copy_kill_steps:
    real_copy = copier.CopyWorker.copy_all

    def copy_then_die(self, buf, layout, tensors, *rest):
        # the tensor bytes are written, the slot is WRITING: die before the commit
        result = real_copy(self, buf, layout, tensors, *rest)
        assert memory.read_header(buf).state is memory.SlotState.WRITING
        os.kill(os.getpid(), signal.SIGKILL)
        return result

    def arm(step):
        copier.CopyWorker.copy_all = copy_then_die if step in copy_kill_steps else real_copy


jitter = random.Random(rank)  # not the global RNG: the training's draws stay the same
for step in range(start, args.steps):
    if args.loader_jitter:
        time.sleep(jitter.uniform(0, args.loader_jitter))
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(16, args.width, generator=g)
    y = x.sum(dim=1, keepdim=True).sin() + 0.01 * torch.rand(16, 1)  # global RNG used too
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    if distributed and not ddp:
        for param in net.parameters():
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()
    opt.step()
    if args.flip_param and start == 0 and (rank, step) == tuple(
            map(int, args.flip_param.split(":"))):
        ckpt.wait()  # the parameter flipped is one this rank saves itself (its share)
        newest = ckpt._segments[ckpt._newest]
        meta = memory.read_meta(newest.view, memory.read_header(newest.view))
        params = dict(model.named_parameters())
        name = next(e["path"][len("/model/"):] for e in meta["tensors"]
                    if e["path"][len("/model/"):] in params)
        with torch.no_grad():
            params[name].view(-1)[:1].view(torch.int32)[0] ^= 1 << 12
        print(f"flipped rank={rank} step={step} param={name}", flush=True)
    sched.step()
    extra["progress"]["samples"] += 16
    if args.private_mb:
        extra["private"].copy_(torch.rand(args.private_mb << 18,
                                          generator=torch.Generator().manual_seed(step * 7919 + rank)))
    if args.grow_at and step == int(args.grow_at.split(":")[0]):
        extra["grown"] = torch.ones(int(args.grow_at.split(":")[1]) << 18)
    if copy_kill_steps:
        arm(step)
    saving = step
    ckpt.save(step)
    if any((rank, step, when, attempt) in kills for when in ("step", "flip", "stop")):
        ckpt.wait()
        if (rank, step, "flip", attempt) in kills:
            newest = ckpt._segments[ckpt._newest]
            newest.view[memory.HEADER_SIZE + 100] ^= 0x10
        stop = (rank, step, "stop", attempt) in kills
        if not stop:
            restart_stamps.killed()
        os.kill(os.getpid(), signal.SIGSTOP if stop else signal.SIGKILL)
    if (rank, step, "copy", attempt) in kills:
        ckpt.wait()  # the copy thread kills the process before this returns
    if rank == 0:
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    restart_stamps.step_done(rank)
    log_step(f"step {step}")
    if args.pause_every and (step + 1) % int(args.pause_every.split(":")[0]) == 0:
        time.sleep(float(args.pause_every.split(":")[1]))
    if args.sleep:
        time.sleep(args.sleep)

if args.report_slots:
    from slot_report import report

    report(ckpt, args.steps - 1, net, opt)
ckpt.close()
if rank == 0 and args.out:
    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "samples": extra["progress"]["samples"],
                "rng": torch.get_rng_state(), "sched": sched.state_dict(), "step": args.steps - 1},
               args.out)
if distributed:
    del model  # DDP must go before its process group (pytorch/pytorch#56297)
    dist.destroy_process_group()
