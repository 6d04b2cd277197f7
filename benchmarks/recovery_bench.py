"""Time from a worker kill to its first completed step after restore: gemini vs torchrun.

gemini restores from the in-memory tier; the baseline is the same worker under torchrun
restoring with torch.load from a torch.save file on local disk, with the file still in the
page cache ("disk, warm") and, when run as root, after dropping the page cache ("disk,
cold"), as after a reboot or on a busy host. Both also run with huge pages for large CPU
tensors (gemini's --huge-pages; THP_MEM_ALLOC_ENABLE=1 for torchrun, which has no flag
for it), so that what the allocator gains is shown apart from what the memory tier
gains. Every run: one worker, killed (SIGKILL) right after the checkpoint of step 1 is
durable; --max-restarts 1. Medians of --repeat runs, the variants interleaved.

    python benchmarks/recovery_bench.py --sizes 256M,1G --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import machine, mib, table  # noqa: E402
from save_bench import parse_size  # noqa: E402

WORKER = str(HERE / "recovery_worker.py")
PHASES = ("restart", "startup", "restore", "first_step", "total")


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def one_run(mode: str, nbytes: int, cold: bool, huge: bool = False) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GEMINI_RUN_ROOT=os.path.join(tmp, "runs"), PYTHONUNBUFFERED="1")
        env.pop("THP_MEM_ALLOC_ENABLE", None)
        launcher = ([sys.executable, "-m", "gemini_cli", "run"] if mode == "gemini"
                    else [sys.executable, "-m", "torch.distributed.run"])
        if huge and mode == "gemini":
            launcher.append("--huge-pages")
        elif huge:
            env["THP_MEM_ALLOC_ENABLE"] = "1"
        cmd = [*launcher, "--nproc-per-node", "1", "--max-restarts", "1", "--monitor-interval",
               "0.1", WORKER, "--mode", mode, "--state-bytes", str(nbytes), "--dir", tmp]
        if cold:
            env["BENCH_DROP_CACHES"] = "1"
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RECOVERY ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        result: dict[str, float] = json.loads(lines[-1].split(" ", 1)[1])
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256M,1G")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cold_ok = os.geteuid() == 0 and drop_caches()
    variants = [("gemini", False, False, "gemini (memory)"),
                ("gemini", False, True, "gemini (memory), --huge-pages"),
                ("disk", False, False, "torchrun + disk, warm"),
                ("disk", False, True, "torchrun + disk, warm, huge pages")]
    if cold_ok:
        variants.append(("disk", True, False, "torchrun + disk, cold"))
    rows = []
    for text in args.sizes.split(","):
        nbytes = parse_size(text)
        runs: dict[str, list[dict[str, float]]] = {label: [] for *_, label in variants}
        for _ in range(args.repeat):
            for mode, cold, huge, label in variants:  # interleaved: drift hits all alike
                runs[label].append(one_run(mode, nbytes, cold, huge))
        medians = {label: {k: statistics.median(r[k] for r in found) for k in PHASES}
                   for label, found in runs.items()}
        for label in ("gemini (memory)", "gemini (memory), --huge-pages"):
            print(f"measured {text}; {label} totals: "
                  + ", ".join(f"{r['total']:.2f} s" for r in runs[label]),
                  file=sys.stderr, flush=True)
        ours = medians["gemini (memory)"]["total"]
        huge = medians["gemini (memory), --huge-pages"]["total"]
        for label, m in medians.items():
            rows.append([mib(nbytes), label, *(f"{m[k]:.2f} s" for k in PHASES),
                         f"{m['total'] / ours:.2f}x", f"{m['total'] / huge:.2f}x"])
    print(f"machine: {machine()}")
    print(f"medians of {args.repeat} runs; one worker; SIGKILL after the checkpoint of step 1\n")
    print(table(["state", "restore from", "kill -> new process", "import+build", "restore",
                 "first step", "kill -> first step", "vs gemini", "vs gemini --huge-pages"],
                rows))


if __name__ == "__main__":
    main()
