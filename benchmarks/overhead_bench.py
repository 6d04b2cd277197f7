"""Cost of saving every step: the example GPT under `gemini run`, with and without saves.

Runs examples/train_gpt.py with 2 workers under `gemini run`, two ways, for the default
model and a larger one:
  * separate runs: runs with `ckpt.save(step)` every step alternate with runs without
    (--no-checkpoint); each run reports the median of its steps, this prints the median
    over --repeat runs of each. Run-to-run noise on a shared VM (a millisecond on a 12 ms
    step) is of the size of the effect.
  * same run: each run saves in every other block of 10 steps (--alternate-saves 10) and
    reports the median step with and without a save; this prints the median over
    --repeat runs of each run's ratio, which cancels the noise between runs.
  * in save(): the median time per step that the loop spent in save() and in waits for
    a copy (the example's `median_stall_ms`) in the runs that save every step, also as a
    share of the step without saves: the save's own cost, without the noise of a whole
    step (and without what the save thread's work costs the training around it).
The variants take turns in every round.

Each run of the default model trains 800 steps (about 10 s), one of the larger model
200 (about 30 s): a run of 200 steps of the default model gives a same-run ratio that
moves by several percent from run to run.

    python benchmarks/overhead_bench.py --repeat 5
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

EXAMPLE = str(HERE.parent / "examples" / "train_gpt.py")
LARGER = ["--n-embd", "256", "--n-layer", "4", "--n-head", "8"]
# name -> (example arguments, steps per run)
MODELS: dict[str, tuple[list[str], int]] = {
    "default (0.1 M params, 1.3 MB state)": ([], 800),
    "larger (3.2 M params, 38 MB state)": (LARGER, 200),
}


def run_example(args: list[str]) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "gemini_cli", "run", "--standalone", "--nproc-per-node", "2",
               "--no-standby", EXAMPLE, *args]
        env = dict(os.environ, GEMINI_RUN_ROOT=tmp, PYTHONWARNINGS="ignore")
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode != 0 or "median_step_ms=" not in done.stdout:
            raise RuntimeError(done.stdout[-2000:] + done.stderr[-2000:])
        return done.stdout


def step_ms(extra: list[str], steps: int, checkpoint: bool) -> tuple[float, float]:
    """A run's median step and median time within save() and waits per step (0 without
    saves)."""
    out = run_example(["--steps", str(steps), *extra, *([] if checkpoint else ["--no-checkpoint"])])
    stall = re.findall(r"median_stall_ms=([\d.]+)", out)
    return float(re.findall(r"median_step_ms=([\d.]+)", out)[-1]), float(stall[-1]) if stall else 0


def same_run_ratio(extra: list[str], steps: int) -> float:
    """Median step with a save / without, from one run saving in every other 10 steps."""
    out = run_example(["--steps", str(steps), "--alternate-saves", "10", *extra])
    saving, plain = re.findall(r"median_saving_ms=([\d.]+) median_plain_ms=([\d.]+)", out)[-1]
    return float(saving) / float(plain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    found: dict[str, tuple[list[float], list[float], list[float], list[float]]] = {
        name: ([], [], [], []) for name in MODELS}
    for round_ in range(args.repeat):  # interleaved: drift hits every variant alike
        for name, (extra, steps) in MODELS.items():
            without, with_save, ratios, stalls = found[name]
            without.append(step_ms(extra, steps, checkpoint=False)[0])
            step, stall = step_ms(extra, steps, checkpoint=True)
            with_save.append(step)
            stalls.append(stall)
            ratios.append(same_run_ratio(extra, steps))
        print(f"round {round_ + 1} of {args.repeat} measured", file=sys.stderr, flush=True)
    rows = []
    for name, (without, with_save, ratios, stalls) in found.items():
        base, ours = statistics.median(without), statistics.median(with_save)
        stall = statistics.median(stalls)
        rows.append([name, f"{base:.2f} ms", f"{ours:.2f} ms", f"{stall:.3f} ms",
                     f"{100 * stall / base:.1f}%", f"{100 * (ours / base - 1):+.1f}%",
                     f"{100 * (statistics.median(ratios) - 1):+.1f}%"])
    print(f"machine: {machine()}")
    per_run = " / ".join(str(n) for _, n in MODELS.values())
    print(f"2 workers (gloo, CPU); medians over {args.repeat} runs of each run's median step "
          f"time ({per_run} steps per run)\n")
    print(table(["model", "step, no saves", "step, save every step", "in save() per step",
                 "save() / step", "overhead (separate runs)", "overhead (same run)"], rows))
    print("\nsame-run overhead of each run, in order:")
    for name, (_, _, ratios, _) in found.items():
        print(f"  {name}: " + " ".join(f"{100 * (r - 1):+.1f}%" for r in ratios))


if __name__ == "__main__":
    main()
