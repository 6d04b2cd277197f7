"""Stragglers: what the timing costs a step, and how fast a slow host is found.

1. The per-step cost of the own-work clock (``launcher.stragglers.PaceClock``: a
   ``post_accumulate_grad`` hook on the parameter whose gradient comes last, learned in
   the first step, and one at each optimizer step), on the
   example GPT's training step in one process, interleaved with the same step without it
   (medians over ``--steps`` steps, ``--repeat`` rounds).
2. Detection time against the slowdown: three simulated hosts (one worker each, etcd),
   default thresholds (1.25x for 20 s); one host's worker is stopped a fraction of every
   0.12 s (SIGSTOP/SIGCONT: 1/3 for 1.5x, 1/2 for 2x, 3/4 for 4x); the clock runs from the
   first stop to the root's ``straggler`` event. With ``--healthy MINUTES``, also a run of
   that length with evaluation pauses, persist writes and a jittery data loader on every
   rank, counting false reports.

    python benchmarks/straggler_bench.py --repeat 3 [--healthy 10]
"""

from __future__ import annotations

import argparse
import array
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "examples"))
from common import machine, table  # noqa: E402
from etcd_server import EtcdServer  # noqa: E402
from replication_bench import GEMINI, Host, _events, _shm_dir  # noqa: E402

# compute-bound own work (no sleep in the step): a duty cycle stopping the worker a
# fraction f of the time slows its own work by about 1 / (1 - f)
TRAIN = [str(HERE.parent / "tests" / "scripts" / "train_ckpt.py"), "--grad-sync", "params",
         "--width", "768", "--depth", "6"]
FACTORS = {"1.5x": 1 / 3, "2x": 1 / 2, "4x": 3 / 4}
PERIOD = 0.12


def step_cost(steps: int, repeat: int) -> list[str]:
    import torch
    import train_gpt as gpt

    from launcher import memory
    from launcher.stragglers import PaceClock

    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(vocab_size=64, seq_len=32, n_layer=4, n_head=4, n_embd=128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    timed = {"without": [], "with": []}  # type: dict[str, list[float]]
    inputs = torch.randint(0, 64, (8, 32))

    def run(with_clock: bool) -> float:
        local = PaceClock(memoryview(array.array("Q", [0] * memory.HEARTBEAT_WORDS)).cast("B")
                          .cast("Q"))
        handles = []
        if with_clock:
            local.watch(model.parameters())
            handles.append(optimizer.register_step_pre_hook(lambda *a: local.step()))
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            loss = model(inputs, inputs)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - began)
        for handle in handles:
            handle.remove()
        local.close()
        return statistics.median(times)

    run(False)  # warm-up
    for _ in range(repeat):
        for name in ("without", "with"):
            timed[name].append(run(name == "with"))
    without, with_ = statistics.median(timed["without"]), statistics.median(timed["with"])
    params = sum(1 for _ in model.parameters())
    return [f"1. own-work clock on the example GPT's step ({params} parameter tensors), "
            f"medians of {repeat} rounds of {steps} steps:",
            table(["without", "with the clock", "ratio"],
                  [[f"{1e3 * without:.2f} ms", f"{1e3 * with_:.2f} ms",
                    f"{with_ / without:.3f}x"]])]


def _hosts(tmp: str, etcd: EtcdServer, *extra: str) -> list[Host]:
    env = dict(os.environ, GEMINI_RUN_ROOT=f"{tmp}/runs", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", PYTHONPATH=str(HERE.parent / "tests" / "scripts"))
    argv = [*GEMINI, "--nnodes", "3:3", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3",
            "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "slow", "--rdzv-conf",
            "last_call_timeout=1", "--store", etcd.url, "--replication-addr", "127.0.0.1",
            *TRAIN, *extra]
    return [Host(argv, dict(env, GEMINI_HOST_ID=f"h{i}", GEMINI_SHM_DIR=_shm_dir(tmp, i)))
            for i in range(3)]


def _wait(predicate: object, timeout: float, what: str, hosts: list[Host]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}:\n" + "\n".join(
                h.output()[-1500:] for h in hosts))
        time.sleep(0.2)


def detection(off: float) -> float:
    """Seconds from the first stop of h1's worker to the root's straggler event."""
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="bench-") as tmp, \
            EtcdServer() as etcd:
        runs = Path(tmp) / "runs"
        hosts = _hosts(tmp, etcd, "--steps", "100000")
        stop = threading.Event()
        try:
            _wait(lambda: len({e["host"] for e in _events(runs) if e["event"] == "start"}) == 3,
                  120, "three hosts", hosts)
            time.sleep(25)  # every host's window full of healthy steps
            slots = {int(e["group_rank"]): str(e["host"]) for e in _events(runs)  # type: ignore[call-overload]
                     if e["event"] == "rendezvous"}
            start = [e for e in _events(runs) if e["event"] == "start"
                     and e["host"] == slots[1]][-1]
            pid = int(start["workers"][0]["pid"])  # type: ignore[index]

            def duty() -> None:
                while not stop.is_set():
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(PERIOD * off)
                    os.kill(pid, signal.SIGCONT)
                    time.sleep(PERIOD * (1 - off))

            slowed = time.time()
            threading.Thread(target=duty, daemon=True).start()
            _wait(lambda: any(e["event"] == "straggler" for e in _events(runs)), 300,
                  "a straggler event", hosts)
            found = next(e for e in _events(runs) if e["event"] == "straggler")
            if found["straggler"] != slots[1]:
                raise RuntimeError(f"wrong host: {found}")
            print(f"  stopped {off:.2f} of the time: score {found['score']}, found after "
                  f"{float(found['ts']) - slowed:.1f} s", file=sys.stderr, flush=True)  # type: ignore[arg-type]
            return float(found["ts"]) - slowed  # type: ignore[arg-type]
        finally:
            stop.set()
            for host in hosts:
                try:
                    os.kill(host.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                host.kill()


def healthy(minutes: float) -> int:
    """False reports in a healthy run of ``minutes``."""
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="bench-") as tmp, \
            EtcdServer() as etcd:
        runs = Path(tmp) / "runs"
        hosts = _hosts(tmp, etcd, "--persist-dir", f"{tmp}/persist", "--persist-every", "20",
                       "--steps", "100000", "--loader-jitter", "0.06", "--pause-every", "200:5")
        try:
            time.sleep(minutes * 60)
            return sum(e["event"] == "straggler" for e in _events(runs))
        finally:
            for host in hosts:
                host.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--healthy", type=float, default=0.0, metavar="MINUTES")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: 1,2")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    if "1" not in args.skip.split(","):
        print("\n".join(step_cost(args.steps, args.repeat)), flush=True)
    if "2" not in args.skip.split(","):
        rows = []
        for name, off in FACTORS.items():
            seconds = [detection(off) for _ in range(args.repeat)]
            print(name, seconds, file=sys.stderr, flush=True)
            rows.append([name, f"{statistics.median(seconds):.1f} s",
                         f"{min(seconds):.1f}-{max(seconds):.1f} s"])
        print(f"2. slowed host -> straggler event, 3 hosts, defaults (1.25x, 20 s window), "
              f"medians of {args.repeat}:")
        print(table(["slowdown of the host's own work", "detection", "range"], rows))
    if args.healthy:
        print(f"healthy run of {args.healthy:g} minutes (evaluation pauses, persist writes, "
              f"a jittery loader everywhere): {healthy(args.healthy)} false reports")


if __name__ == "__main__":
    main()
