"""One benchmark script at two commits, in one run, rounds interleaved: did a change make
it slower?

The base commit is checked out into a temporary git worktree; each round runs the
script once in the base tree and once in this one (the order alternates), with the same
arguments and this virtual environment (a benchmark script puts its own tree first on
``sys.path``). Each cell of the script's Markdown table that starts with a number is
reduced to the median over the rounds; the table printed has, per column, the base's
figure, this tree's, and their ratio.

    python benchmarks/commits_bench.py --base 208104d --rounds 3 -- save_bench.py --sizes 256M,1G
    python benchmarks/commits_bench.py --base 208104d --rounds 3 -- transport_bench.py
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_NUMBER = re.compile(r"^[+-]?\d+(\.\d+)?")


def parse_table(output: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the last Markdown table in ``output``."""
    lines = [line for line in output.splitlines() if line.startswith("|")]
    if len(lines) < 3:
        raise SystemExit(f"no table in the benchmark's output:\n{output[-2000:]}")
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    start = max(i for i, row in enumerate(cells) if all(set(c) <= {"-"} for c in row)) - 1
    return cells[start], cells[start + 2:]


def number(cell: str) -> float | None:
    match = _NUMBER.match(cell)
    return float(match.group()) if match else None


def run(tree: Path, script: list[str]) -> str:
    done = subprocess.run([sys.executable, str(tree / "benchmarks" / script[0]), *script[1:]],
                          cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{script[0]} in {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("script", nargs=argparse.REMAINDER,
                        help="-- SCRIPT.py [ARGS...] (a script in benchmarks/)")
    args = parser.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("name the benchmark script after --")
    base = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    results: dict[str, list[list[list[str]]]] = {"base": [], "head": []}
    header: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gemini-base-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), base], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            for n in range(args.rounds):
                order = [("base", tree), ("head", ROOT)]
                for name, where in order if n % 2 == 0 else order[::-1]:
                    header, rows = parse_table(run(where, script))
                    results[name].append(rows)
                    print(f"round {n + 1}: {name} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           check=False, capture_output=True)
    every = results["base"] + results["head"]
    numeric = [c for c in range(1, len(header))
               if all(number(rows[r][c]) is not None for rows in every for r in range(len(rows)))]
    out_rows = []
    for r, first in enumerate(results["head"][0]):
        row = [first[0]]
        for c in numeric:
            b, h = (statistics.median(number(rows[r][c]) or 0.0 for rows in results[name])
                    for name in ("base", "head"))
            row.append(f"{b:g} -> {h:g} ({h / b:.2f}x)" if b else f"{b:g} -> {h:g}")
        out_rows.append(row)
    columns = [header[0]] + [header[c] for c in numeric]
    print(f"machine: {machine()}")
    print(f"{' '.join(script)}: base {base} -> this tree {head}; medians over {args.rounds} "
          "interleaved rounds of each run's own figures\n")
    print(table(columns, out_rows))


if __name__ == "__main__":
    main()
