"""``gemini plan``: placement groups, recovery probability and memory per host."""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

import click

from gemini_cli import output

SCHEMA = "gemini.plan/v1"

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in ``text``: a plain integer or a number with a unit, e.g. ``512MiB``, ``2GiB``,
    ``1.5GB``. KiB/MiB/GiB/TiB (and K/M/G/T) are powers of 1024, kB/MB/GB/TB powers of 1000;
    a fractional byte count is rounded down. Raises :class:`ValueError` with the reason.
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (expected e.g. 1048576, 512MiB, 2GiB, 1.5GB)")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
        raise ValueError(f"{text!r} is not a size") from None
    return int(number * _UNITS[unit])


def _byte_size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """The click callback of ``--state-bytes``: :func:`parse_size` or a ``BadParameter``."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


@click.command("plan", short_help="Show the replica placement for N hosts.")
@click.option("--nodes", type=click.IntRange(max=100_000), required=True,
              help="Number of hosts N (at most 100000).")
@click.option("--replicas", type=int, default=2, show_default=True,
              help="Copies of each host's checkpoint in total, its own included (m).")
@click.option("--failures", type=click.IntRange(min=0), default=2, show_default=True,
              help="Simultaneous host failures k for the recovery probability.")
@click.option("--state-bytes", callback=_byte_size, default=None, metavar="SIZE",
              help="One rank's checkpoint size (e.g. 512MiB, 2GiB, 1.5GB) to size the memory "
              "of a host.")
@click.option("--ranks-per-host", type=click.IntRange(min=1), default=1, show_default=True,
              help="Workers per host (--nproc-per-node).")
@click.option("--parallelism", type=click.Choice(["sharded", "ddp"]), default="sharded",
              show_default=True,
              help="ddp: every rank holds the whole state, and the ranks of a host keep one "
              "copy of it; sharded (FSDP, tensor parallelism): each rank its own shard.")
@click.option("--groups/--no-groups", "show_groups", default=None,
              help="Print the table of placement groups and who holds whose replicas after "
              "the summary.  [default: for 8 hosts or fewer]")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema gemini.plan/v1).")
def plan_command(nodes: int, replicas: int, failures: int, state_bytes: int | None,
                 ranks_per_host: int, parallelism: str, show_groups: bool | None,
                 as_json: bool) -> int:
    """Show how gemini places the replicas of each host's in-memory checkpoint.

    Prints the placement groups (group placement when m divides N, mixed placement with
    a ring-placed last group otherwise, as in the GEMINI paper), which hosts keep each
    host's replicas, the probability that --failures simultaneous random host failures
    still leave every checkpoint in memory, and with --state-bytes the CPU memory each
    host needs: a summary first, then (--groups) the table of groups. Exit code 0; 2 on
    invalid input.
    """
    from launcher.replication.placement import (
        host_checkpoint_bytes,
        memory_per_host,
        plan,
        recovery_probability,
    )

    placement = plan(nodes, replicas)
    probability = recovery_probability(nodes, replicas, failures)
    host_bytes = None if state_bytes is None else host_checkpoint_bytes(
        state_bytes, ranks_per_host, replicated=parallelism == "ddp")
    memory = None if host_bytes is None else memory_per_host(host_bytes, placement.replicas)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "nodes": placement.nodes,
        "replicas": placement.replicas,
        "replicas_requested": replicas,
        "kind": placement.kind,
        "groups": [list(g) for g in placement.groups],
        "group_kinds": [placement.group_kind(i) for i in range(len(placement.groups))],
        "holders": [list(placement.holders(n)) for n in range(placement.nodes)],
        "failures": failures,
        "probability": float(probability),
        "probability_exact": f"{probability.numerator}/{probability.denominator}",
        "state_bytes": state_bytes,
        "ranks_per_host": ranks_per_host,
        "parallelism": parallelism,
        "host_checkpoint_bytes": host_bytes,
        "memory_per_host_bytes": memory,
    }
    if as_json:
        click.echo(json.dumps(report))
    else:
        _render(report, probability, placement.nodes <= 8 if show_groups is None else show_groups)
    return 0


def _render(report: dict[str, Any], probability: Fraction, show_groups: bool) -> None:
    """The summary (placement, recovery probability, memory per host), then the groups."""
    from rich.table import Table

    console = output.console()
    m = report["replicas"]
    capped = (f" (capped from {report['replicas_requested']})"
              if m != report["replicas_requested"] and m > 1 else "")
    groups = len(report["groups"])
    how = ("no replication" if report["kind"] == "none" else
           f"{report['kind']} placement, {groups} group{_s(groups)}")
    console.print(f"[bold]{report['nodes']}[/] host{_s(report['nodes'])}, [bold]{m}[/] "
                  f"cop{'ies' if m != 1 else 'y'} of each checkpoint{capped}: {how}")
    k = report["failures"]
    console.print(f"recovery from memory after {k} simultaneous host failure{_s(k)}: "
                  f"[bold]{_percent(probability)}[/] ({report['probability_exact']})")
    if report["kind"] == "none":
        console.print("no peer replicas: a lost host's checkpoint comes from persistent storage")
    if report["memory_per_host_bytes"] is not None:
        state = _size(report["host_checkpoint_bytes"])
        ranks = report["ranks_per_host"]
        each = (f"; one copy of the DDP state for its {ranks} ranks"
                if report["parallelism"] == "ddp" and ranks > 1 else
                f"; {ranks} ranks x {_size(report['state_bytes'])}" if ranks > 1 else "")
        parts = (f"2 slots x {m} copies x {state}: its own and {m - 1} peer{_s(m - 1)}{each}"
                 if m > 1 else f"2 slots x {state}{each}")
        console.print(f"CPU memory per host: [bold]{_size(report['memory_per_host_bytes'])}[/] "
                      f"({parts})")
        # kB/MB/GB count in powers of 1000, K/M/G and KiB/MiB/GiB in 1024: say which it was
        console.print(f"one rank's checkpoint (--state-bytes): {report['state_bytes']:,} bytes "
                      f"= {_size(report['state_bytes'], 1000)} = {_size(report['state_bytes'])}")
    if not show_groups:
        console.print(f"placement groups: {groups} (--groups lists them and who holds whose "
                      "replicas)")
        return
    table = Table(title="placement groups")
    for column in ("group", "nodes", "placement", "replicas of node -> held by"):
        table.add_column(column)
    for index, (group, kind) in enumerate(zip(report["groups"], report["group_kinds"], strict=True)):
        held = "\n".join(f"{n} -> {_nodes(report['holders'][n]) or '-'}" for n in group)
        table.add_row(str(index), _nodes(group), kind, held)
    console.print(table)


def _s(count: int) -> str:
    return "" if count == 1 else "s"


def _nodes(nodes: list[int]) -> str:
    return ", ".join(str(n) for n in nodes)


def _percent(p: Fraction) -> str:
    """``p`` as a percentage with one decimal that never rounds to a certainty it isn't."""
    text = f"{float(p) * 100:.1f}%"
    if text == "100.0%" and p < 1:
        return ">99.9%"
    if text == "0.0%" and p > 0:
        return "<0.1%"
    return text


def _size(n: int, base: int = 1024) -> str:
    """``n`` bytes in powers of 1024 (KiB, MiB, ...) or of 1000 (kB, MB, ...)."""
    units = ("B", "KiB", "MiB", "GiB", "TiB") if base == 1024 else ("B", "kB", "MB", "GB", "TB")
    value = float(n)
    for unit in units:
        if value < base or unit == units[-1]:
            return f"{n} B" if unit == "B" else f"{value:.{1 if base == 1024 else 2}f} {unit}"
        value /= base
    raise AssertionError("unreachable")  # pragma: no cover - the loop always returns
