"""The per-step cost of gemini's framework integrations, side by side in one run.

For each framework, the same small training script (2 workers, CPU, gloo), three ways:
without checkpoints (under torchrun), with gemini's in-memory checkpoint every step
(under ``gemini run``), and with the framework's own checkpoint to local disk every step
(under torchrun: the Trainer's ``save_strategy``, ``Accelerator.save_state``, Lightning's
``ModelCheckpoint(every_n_train_steps=1)``, ``torch.distributed.checkpoint.save`` of the
DCP app state). Printed: the median step (its checkpoint
included) and the ratio to the run without checkpoints. The variants are interleaved
round by round.

    python benchmarks/integrations_bench.py --repeat 3
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import machine, table  # noqa: E402

SCRIPTS = HERE.parent / "tests" / "scripts"
FRAMEWORKS = {
    "transformers.Trainer (GPT-2, 4 layers x 256)": [
        str(SCRIPTS / "train_hf.py"), "--steps", "150", "--n-embd", "256", "--n-layer", "4"],
    "accelerate (MLP, width 4096)": [
        str(SCRIPTS / "train_accelerate.py"), "--steps", "150", "--width", "4096"],
    "Lightning Trainer (MLP, width 4096)": [
        str(SCRIPTS / "train_lightning.py"), "--steps", "150", "--width", "4096"],
    "DCP Stateful app state (FSDP2 MLP, width 4096)": [
        str(SCRIPTS / "train_fsdp.py"), "--steps", "150", "--width", "4096", "--app-state"],
}
MODES = {
    "no checkpoint (torchrun)": ("torchrun", "none"),
    "gemini, every step (gemini run)": ("gemini", "gemini"),
    "gemini's Checkpointer(model, optimizer) as in a hand-written loop (gemini run)": (
        "gemini", "loop"),
    "the framework's own, to disk, every step (torchrun)": ("torchrun", "disk"),
}


def step_ms(script: list[str], launcher: str, mode: str) -> tuple[float, float | None]:
    """Rank 0's median step in one run, and the median time a step waited for gemini (in
    ``save()`` and for a copy: the Checkpointer's stall)."""
    if mode == "loop" and "--app-state" in script:  # DCP: the model and optimizer given
        script, mode = [a for a in script if a != "--app-state"], "gemini"
    with tempfile.TemporaryDirectory() as tmp:
        runner = (["-m", "gemini_cli", "run"] if launcher == "gemini"
                  else ["-m", "torch.distributed.run", "--standalone"])
        env = dict(os.environ, GEMINI_RUN_ROOT=f"{tmp}/runs", PYTHONWARNINGS="ignore")
        done = subprocess.run([sys.executable, *runner, "--nproc-per-node", "2", *script,
                               "--mode", mode, "--output-dir", f"{tmp}/out"],
                              capture_output=True, text=True, env=env, timeout=900)
        found = re.search(r"median_step_ms=([\d.]+)", done.stdout)
        if done.returncode != 0 or found is None:
            raise RuntimeError(f"{script[0]} {mode} failed:\n{done.stdout[-2000:]}"
                               f"{done.stderr[-3000:]}")
        stall = re.search(r"median_save_ms=([\d.]+)", done.stdout)
        return float(found.group(1)), float(stall.group(1)) if stall else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {machine()}\nmedians of {args.repeat} runs\n", flush=True)
    times: dict[tuple[str, str], list[float]] = {
        (framework, mode): [] for framework in FRAMEWORKS for mode in MODES}
    stalls: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeat):
        for framework, script in FRAMEWORKS.items():
            for mode, (launcher, flag) in MODES.items():
                ms, stall = step_ms(script, launcher, flag)
                times[framework, mode].append(ms)
                if stall is not None:
                    stalls.setdefault((framework, mode), []).append(stall)
    rows = []
    for framework in FRAMEWORKS:
        base = statistics.median(times[framework, "no checkpoint (torchrun)"])
        loop = stalls.get((framework, list(MODES)[2]))
        for mode in MODES:
            ms = statistics.median(times[framework, mode])
            stall = stalls.get((framework, mode))
            rows.append([framework, mode, f"{ms:.1f} ms", f"{ms / base:.2f}x",
                         f"{statistics.median(stall):.2f} ms" if stall else "-",
                         f"{statistics.median(stall) / statistics.median(loop):.2f}x"
                         if stall and loop else "-"])
    print(table(["framework", "checkpoint", "median step", "vs no checkpoint",
                 "gemini's stall per step", "vs Checkpointer(model, optimizer)"], rows),
          flush=True)


if __name__ == "__main__":
    main()
