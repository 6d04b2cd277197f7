"""Cost of saving every step: the example GPT under `gemini run`, with and without saves.

Runs examples/train_gpt.py with 2 workers under `gemini run`, alternating runs with
`ckpt.save(step)` every step and runs without (--no-checkpoint), and compares the median
step time (each run reports the median of its own steps; this prints the median over
--repeat runs). Measured for the default model and a larger one.

    python benchmarks/overhead_bench.py --repeat 3 --steps 60
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
MODELS = {
    "default (0.1 M params, 1.3 MB state)": [],
    "larger (3.2 M params, 38 MB state)": ["--n-embd", "256", "--n-layer", "4", "--n-head", "8"],
}


def step_ms(extra: list[str], steps: int, checkpoint: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "gemini_cli", "run", "--standalone", "--nproc-per-node", "2",
               "--no-standby", EXAMPLE, "--steps", str(steps), *extra]
        if not checkpoint:
            cmd.append("--no-checkpoint")
        env = dict(os.environ, GEMINI_RUN_ROOT=tmp, PYTHONWARNINGS="ignore")
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        match = re.search(r"median_step_ms=([\d.]+)", done.stdout)
        if done.returncode != 0 or not match:
            raise RuntimeError(done.stdout[-2000:] + done.stderr[-2000:])
        return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    rows = []
    for name, extra in MODELS.items():
        with_save, without = [], []
        for _ in range(args.repeat):
            without.append(step_ms(extra, args.steps, checkpoint=False))
            with_save.append(step_ms(extra, args.steps, checkpoint=True))
        base, ours = statistics.median(without), statistics.median(with_save)
        rows.append([name, f"{base:.2f} ms", f"{ours:.2f} ms", f"{100 * (ours / base - 1):+.1f}%"])
        print(f"measured {name}", file=sys.stderr, flush=True)
    print(f"machine: {machine()}")
    print(f"2 workers (gloo, CPU); median over {args.repeat} runs of each run's median step "
          f"time ({args.steps} steps)\n")
    print(table(["model", "step, no saves", "step, save every step", "overhead"], rows))


if __name__ == "__main__":
    main()
