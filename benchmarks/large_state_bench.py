"""Checkpointing every step at realistic state sizes: gemini against torchrun + torch.save.

The example GPT (examples/train_gpt.py) with 2 workers (DDP, gloo, CPU) and AdamW, sized
to about 288 MiB and 1 GiB of model and optimizer state per rank, trained for a fixed
number of steps, each launcher with and without a checkpoint every step, in
interleaved rounds:

* ``gemini run`` without checkpoints (``--no-checkpoint``) and with ``ckpt.save(step)``
  every step;
* ``torchrun`` without checkpoints and with rank 0 writing the whole state with
  ``torch.save`` (and fsync) to local disk every step (the example's ``--torch-save``);
* with ``--dlrover ENV`` (a virtual environment with DLRover installed, see
  ../shared/PEERS.md or DLRover's docs: ``pip install torch==2.13.0
  "dlrover[k8s,torch]==0.6.1" protobuf``), ``dlrover-run`` without checkpoints and with
  Flash Checkpoint's ``DdpCheckpointer`` saving into memory every step
  (benchmarks/dlrover_gpt.py).

Printed per size: the whole run's wall time (launcher start to exit), the median step,
the first-save stall (the first step with a save less the first step without: slot
allocation and the first copy), the time the loop is blocked per checkpoint, and the
overheads against the same launcher without checkpoints.

    python benchmarks/large_state_bench.py --repeat 3 [--dlrover /path/to/venv]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import machine, mib, table  # noqa: E402

EXAMPLE = str(HERE.parent / "examples" / "train_gpt.py")
# name -> (model flags, steps per run)
SIZES: dict[str, tuple[list[str], int]] = {
    "288M": (["--n-embd", "640", "--n-layer", "5", "--n-head", "8"], 30),
    "1G": (["--n-embd", "1024", "--n-layer", "7", "--n-head", "8"], 20),
}
COMMON = ["--batch-size", "4", "--log-every", "1000000"]


def state_bytes(model: list[str]) -> int:
    """Parameters and AdamW's two moments, in float32, of the example with ``model``."""
    sys.path.insert(0, str(HERE.parent / "examples"))
    import torch
    from train_gpt import GPT, GPTConfig

    flags = dict(zip(model[::2], model[1::2], strict=True))
    config = GPTConfig(vocab_size=40, seq_len=64, n_layer=int(flags["--n-layer"]),
                       n_head=int(flags["--n-head"]), n_embd=int(flags["--n-embd"]))
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(config).parameters())
    return 12 * params


def run(launcher: str, model: list[str], steps: int, save: bool, tmp: str,
        dlrover: Path | None = None) -> dict[str, float]:
    args = [EXAMPLE, "--steps", str(steps), *COMMON, *model]
    env = dict(os.environ, GEMINI_RUN_ROOT=f"{tmp}/runs", PYTHONWARNINGS="ignore")
    master = None
    if launcher == "gemini":
        cmd = [sys.executable, "-m", "gemini_cli", "run", "--standalone", "--nproc-per-node",
               "2", *args, *([] if save else ["--no-checkpoint"])]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", *args, "--no-checkpoint"]
        if save:
            cmd += ["--torch-save", f"{tmp}/ckpt.pt"]
    else:  # DLRover: its own master (dlrover-run --standalone fails on torch 2.13)
        assert dlrover is not None
        job, port = f"gemini-bench-{os.getpid()}-{time.monotonic_ns()}", _free_port()
        master = subprocess.Popen([str(dlrover / "bin" / "python"), "-m",
                                   "dlrover.python.master.main", "--port", str(port),
                                   "--node_num", "1", "--job_name", job, "--platform", "local"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(3)
        env.update(DLROVER_MASTER_ADDR=f"127.0.0.1:{port}", ELASTIC_JOB_NAME=job)
        cmd = [str(dlrover / "bin" / "dlrover-run"), "--standalone", "--nproc_per_node", "2",
               str(HERE / "dlrover_gpt.py"), *args[1:], "--ckpt-dir", f"{tmp}/dlrover",
               *([] if save else ["--no-checkpoint"])]
    try:
        began = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        total = time.perf_counter() - began
    finally:
        if master is not None:
            master.kill()
            master.wait()
            for leftover in Path("/dev/shm").glob(f"{env['ELASTIC_JOB_NAME']}_ckpt_shm_*"):
                leftover.unlink()
            shutil.rmtree(Path("/tmp/ckpt_sock") / env["ELASTIC_JOB_NAME"], ignore_errors=True)
    found = re.search(r"median_step_ms=([\d.]+) first_step_ms=([\d.]+)", done.stdout)
    if done.returncode != 0 or found is None:
        raise RuntimeError(done.stdout[-2000:] + done.stderr[-2000:])
    stall = re.search(r"median_stall_ms=([\d.]+)", done.stdout)
    return {"total": total, "step": float(found.group(1)), "first": float(found.group(2)),
            "blocking": float(stall.group(1)) if stall else 0.0}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sizes", default=",".join(SIZES), help="of: " + ", ".join(SIZES))
    parser.add_argument("--dlrover", type=Path, metavar="ENV",
                        help="a virtual environment with DLRover installed: measure it too")
    args = parser.parse_args()
    launchers = {"gemini": "gemini, ckpt.save every step",
                 "torchrun": "torchrun + torch.save every step (disk)"}
    if args.dlrover:
        launchers["dlrover"] = "DLRover Flash Checkpoint every step (memory)"
    variants = [(launcher, save) for launcher in launchers for save in (False, True)]
    sizes = args.sizes.split(",")
    found: dict[tuple[str, str, bool], list[dict[str, float]]] = {
        (size, launcher, save): [] for size in sizes for launcher, save in variants}
    for round_ in range(args.repeat):  # interleaved: drift hits every variant alike
        for size in sizes:
            model, steps = SIZES[size]
            for launcher, save in variants:
                with tempfile.TemporaryDirectory() as tmp:
                    found[size, launcher, save].append(
                        run(launcher, model, steps, save, tmp, args.dlrover))
        print(f"round {round_ + 1} of {args.repeat} measured", file=sys.stderr, flush=True)
    print(f"machine: {machine()}")
    print(f"2 workers (DDP, gloo, CPU), AdamW; medians of {args.repeat} runs\n")
    for size in sizes:
        model, steps = SIZES[size]

        def median(launcher: str, save: bool, key: str, size: str = size) -> float:
            return statistics.median(r[key] for r in found[size, launcher, save])

        rows = []
        for launcher, label in launchers.items():
            total0, total1 = median(launcher, False, "total"), median(launcher, True, "total")
            step0, step1 = median(launcher, False, "step"), median(launcher, True, "step")
            stall = median(launcher, True, "first") - median(launcher, False, "first")
            rows.append([label, f"{total0:.1f} s", f"{total1:.1f} s",
                         f"{100 * (total1 / total0 - 1):+.1f}%", f"{step0:.0f} ms",
                         f"{step1:.0f} ms", f"{100 * (step1 / step0 - 1):+.1f}%",
                         f"{stall / 1e3:.2f} s", f"{stall / step1:.1f}x",
                         f"{median(launcher, True, 'blocking'):.2f} ms"])
        print(f"{mib(state_bytes(model))} of state per rank ({' '.join(model)}), {steps} steps\n")
        print(table(["", "total, no checkpoint", "total, every step", "total overhead",
                     "median step, none", "median step, every step", "step overhead",
                     "first-save stall", "stall / median step", "blocking per checkpoint"],
                    rows))
        print()


if __name__ == "__main__":
    main()
