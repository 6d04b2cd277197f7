"""``gemini plan``: placement groups, recovery probability and memory per host."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
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


_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|m|min|h|d|w)?\s*", re.IGNORECASE)
_SECONDS = {None: 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number of seconds, or one with a unit s, m (min), h, d, w
    (e.g. ``90s``, ``12h``, ``30d``); ValueError unless it is more than 0."""
    match = _DURATION.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration (expected e.g. 600, 90s, 12h, 30d)")
    seconds = float(match.group(1)) * _SECONDS[match.group(2) and match.group(2).lower()]
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{text!r}: a duration must be more than 0")
    return seconds


def _parsed(parse: Callable[[str], Any]) -> Callable[..., Any]:
    """A click callback: ``parse(value)``, its ValueError a ``BadParameter`` (None stays)."""
    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
        if value is None:
            return None
        try:
            return parse(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    return callback


_duration, _byte_size = _parsed(parse_duration), _parsed(parse_size)


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
@click.option("--mtbf", callback=_duration, default=None, metavar="DURATION",
              help="Mean time between failures of one host (e.g. 30d): adds the expected "
              "goodput (ETTR) with gemini beside checkpointing to storage, and the "
              "settings to use. Needs --state-bytes and --step-time.")
@click.option("--job-mtbf", callback=_duration, default=None, metavar="DURATION",
              help="Mean time between failures of the whole job instead (e.g. 3h).")
@click.option("--step-time", callback=_duration, default=None, metavar="DURATION",
              help="One training step (e.g. 1.5s).")
@click.option("--from-status", type=click.File("r"), default=None, metavar="FILE",
              help="`gemini status --json` of a running job (- for stdin): its median step, "
              "checkpoint stall, recovery per failure and, without --mtbf, its failure "
              "rate, measured.")
@click.option("--host-share", type=click.FloatRange(0, 1), default=0.6, show_default=True,
              help="Share of failures that take a host away (the rest: worker crashes).")
@click.option("--spares", type=click.IntRange(min=0), default=1, show_default=True,
              help="Hot spare hosts.")
@click.option("--replicate-every", type=click.IntRange(min=0), default=0, metavar="N",
              help="Replicate every N-th step.  [default: 0 (measured)]")
@click.option("--network-bandwidth", type=click.FloatRange(min=0, min_open=True),
              default=1250.0, show_default=True, metavar="MB_PER_S",
              help="What a host sends to a peer while it trains, MB/s.")
@click.option("--storage-bandwidth", type=click.FloatRange(min=0, min_open=True),
              default=1000.0, show_default=True, metavar="MB_PER_S",
              help="What a host writes to the shared file system, MB/s.")
@click.option("--restart-time", callback=_duration, default="60s", show_default=True,
              metavar="DURATION", help="Restarting the whole job from storage.")
@click.option("--replace-time", callback=_duration, default="300s", show_default=True,
              metavar="DURATION", help="Getting a replacement host when no spare waits.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema gemini.plan/v1).")
def plan_command(nodes: int, replicas: int, failures: int, state_bytes: int | None,
                 ranks_per_host: int, parallelism: str, show_groups: bool | None,
                 as_json: bool, **goodput: Any) -> int:
    """Show how gemini places the replicas of each host's in-memory checkpoint.

    Prints the placement groups (group placement when m divides N, mixed placement with
    a ring-placed last group otherwise, as in the GEMINI paper), which hosts keep each
    host's replicas, the probability that --failures simultaneous random host failures
    still leave every checkpoint in memory, and with --state-bytes the CPU memory each
    host needs: a summary first, then (--groups) the table of groups. With --mtbf (or
    --job-mtbf, or --from-status) and --step-time, the expected goodput of the job with
    gemini and with checkpoints to storage at the optimal interval, and the settings
    with the best goodput (docs/goodput.md has the model). Exit code 0; 2 on invalid
    input.
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
    report.update(_goodput(report, **goodput))
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
    if report["goodput"] is not None:
        _render_goodput(console, report["goodput"])
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


def _goodput(report: dict[str, Any], *, mtbf: float | None, job_mtbf: float | None,
             step_time: float | None, from_status: Any, host_share: float, spares: int,
             replicate_every: int, network_bandwidth: float, storage_bandwidth: float,
             restart_time: float, replace_time: float) -> dict[str, Any]:
    """The planner's part of the report: ``ettr`` and ``goodput`` (both None unless a
    failure rate is given or measured)."""
    from launcher.goodput import Cluster, Setting, gemini_ettr, gemini_waste, recommend, storage_baseline

    measured = _measured(from_status) if from_status is not None else {}
    if mtbf is not None and job_mtbf is not None:
        raise click.UsageError("give --mtbf (per host) or --job-mtbf, not both")
    nodes = report["nodes"]
    job = job_mtbf or (mtbf / nodes if mtbf else measured.get("job_mtbf"))
    step = step_time or measured.get("step_time")
    if job is None:
        if step_time is not None:
            raise click.UsageError("--step-time needs a failure rate: --mtbf or --job-mtbf")
        return {"ettr": None, "goodput": None}
    if step is None or report["host_checkpoint_bytes"] is None:
        raise click.UsageError("a goodput plan needs --step-time and --state-bytes")
    cluster = Cluster(nodes=nodes, job_mtbf=job, step_time=step,
                      host_bytes=report["host_checkpoint_bytes"], host_share=host_share,
                      network_bytes_per_s=network_bandwidth * 1e6,
                      storage_bytes_per_s=storage_bandwidth * 1e6, restart_time=restart_time,
                      replace_time=replace_time,
                      **{k: v for k, v in measured.items()
                         if k in ("stall", "worker_recovery", "host_recovery")})
    setting = Setting(replicas=report["replicas"], replicate_every=replicate_every,
                      spares=spares)
    ettr = gemini_ettr(cluster, setting)
    host_mtbf = mtbf or job * nodes
    return {"ettr": ettr, "goodput": {
        "ettr": ettr, "job_mtbf_s": job, "failures_per_day": 86400 / job, "step_s": step,
        "waste_per_failure_s": gemini_waste(cluster, setting),
        "baseline": storage_baseline(cluster), "recommended": recommend(cluster, host_mtbf),
        "measured": sorted(measured)}}


def _measured(stream: Any) -> dict[str, float]:
    """What ``gemini status --json`` of a running job measured: its median step, the
    checkpoint stall per step, the time lost per failure (all of it counted as one
    worker or host recovery) and, after at least one failure, the job's MTBF."""
    try:
        goodput = json.load(stream).get("goodput") or {}
        wall, step = float(goodput["wall_s"]), float(goodput["step_s"])
        lost, steps = goodput["lost_s"], int(goodput["steps"])
        failures = int(goodput["failures"])
        recovery = sum(float(lost[k]) for k in ("detection", "rendezvous", "restore",
                                                 "waiting"))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise click.UsageError(f"--from-status: not the JSON of `gemini status --json` "
                               f"with a goodput ({type(exc).__name__}: {exc})") from None
    found = {"step_time": step} if step > 0 else {}
    if steps:
        found["stall"] = float(lost["checkpoint"]) / steps
    if failures:
        found["job_mtbf"] = wall / failures
        found["worker_recovery"] = found["host_recovery"] = recovery / failures
    return found


def _render_goodput(console: Any, goodput: dict[str, Any]) -> None:
    """Expected ETTR with gemini and with storage checkpoints, and the best settings."""
    base, best = goodput["baseline"], goodput["recommended"]
    waste = goodput["waste_per_failure_s"]
    console.print(f"expected goodput (ETTR) at one failure every {_time(goodput['job_mtbf_s'])} "
                  f"({goodput['failures_per_day']:.1f} a day): gemini [bold]"
                  f"{100 * goodput['ettr']:.1f}%[/] ({waste['per_failure']:.1f} s lost per "
                  f"failure: {waste['worker']:.1f} s a worker crash, {waste['host']:.1f} s a "
                  f"host loss); checkpoints to storage every {_time(base['interval_s'])} "
                  f"(the optimal interval): [bold]{100 * base['ettr']:.1f}%[/] "
                  f"({base['per_failure']:.0f} s lost per failure)")
    console.print(f"recommended: --replicas {best['replicas']} with {best['spares']} hot "
                  f"spare{_s(best['spares'])}, replication every {best['replicate_every']} "
                  f"step{_s(best['replicate_every'])} (ETTR {100 * best['ettr']:.1f}%), "
                  f"--persist-every {_time(best['persist_every_s'])} for the losses no replica "
                  "covers")
    if goodput["measured"]:
        console.print(f"measured by the running job: {', '.join(goodput['measured'])}")


def _time(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


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
