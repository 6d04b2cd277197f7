"""``gemini status``: hosts, root, ranks, restarts, newest steps and recent failures of a run."""

from __future__ import annotations

import json
import time
from typing import Any

import click

SCHEMA = "gemini.status/v1"


@click.command("status", short_help="Show a run: hosts, root, ranks, steps, failures.")
@click.option("--store", "store_url", default=None, metavar="URL",
              help="etcd://HOST:PORT[,...] or embedded:///PATH (default: $GEMINI_STORE, else "
                   "the embedded store next to the run root).")
@click.option("--run-id", default=None, help="The run (its rdzv id); default: the newest run.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema gemini.status/v1).")
@click.option("--watch", "watch_seconds", type=float, default=None, metavar="SECONDS",
              is_flag=False, flag_value=2.0, help="Refresh every SECONDS (default 2) until ^C.")
def status_command(store_url: str | None, run_id: str | None, as_json: bool,
                   watch_seconds: float | None) -> int:
    """Show what the supervisors of a run report through the coordination store.

    An etcd store that asks for credentials gets those of ``gemini run`` from the same
    environment variables (GEMINI_STORE_CACERT, GEMINI_STORE_CERT, GEMINI_STORE_KEY,
    GEMINI_STORE_USER, GEMINI_STORE_PASSWORD_FILE).

    Exit code 0; 3 when the store is unreachable; 2 when the run is unknown.
    """
    from launcher.coordination import RunReader

    with RunReader(store_url) as reader:
        while True:
            status = reader.status(run_id)
            if as_json:
                click.echo(json.dumps({"schema": SCHEMA, "store": reader.url,
                                       **status.as_json()}))
            else:
                _render(status.as_json(), reader.url, clear=watch_seconds is not None)
            if watch_seconds is None:
                return 0
            time.sleep(watch_seconds)


def _render(status: dict[str, Any], url: str, *, clear: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if clear:
        console.clear()
    now = time.time()
    console.print(f"run [bold]{status['run_id']}[/]  root: {status['root'] or '-'}  "
                  f"store: {url}")
    hosts = Table(title="hosts")
    for column in ("host", "status", "pid", "ranks", "round", "restarts", "changed"):
        hosts.add_column(column)
    for h in status["hosts"]:
        colour = {"alive": "green", "waiting": "yellow", "lost": "red"}.get(h["status"], "dim")
        hosts.add_row(h["host"] + (" (root)" if h["host"] == status["root"] else ""),
                      f"[{colour}]{h['status']}[/]", str(h.get("pid", "")),
                      _ranks(h.get("ranks", [])), str(h.get("round", "")),
                      str(h.get("restart_count", 0)), f"{now - h.get('updated', now):.0f} s ago")
    console.print(hosts)
    ready = set(status.get("ready_spares") or [])
    console.print(_recoverable(status.get("replication"),
                               [f"{h} ({'ready' if h in ready else 'warming up'})"
                                for h in status.get("spares") or []]))
    ranks = Table(title="newest step per rank and tier")
    for column in ("rank", "host", "memory", "peer replicas", "lag", "persisted"):
        ranks.add_column(column)
    for rank, r in status["ranks"].items():
        replicas = {host: step for host, step in (r.get("replicas") or {}).items()
                    if step is not None}
        newest = r.get("memory")
        lag = "-" if newest is None or not replicas else str(newest - min(replicas.values()))
        ranks.add_row(rank, r.get("host", ""), _step(newest),
                      ", ".join(f"{h}:{s}" for h, s in sorted(replicas.items())) or "-",
                      lag, _step(r.get("persist")))
    console.print(ranks)
    if status["events"]:
        events = Table(title="recent events")
        for column in ("time", "host", "event", "detail"):
            events.add_column(column)
        for e in status["events"]:
            detail = {k: v for k, v in e.items() if k not in ("event", "host", "ts", "pid")}
            events.add_row(time.strftime("%H:%M:%S", time.localtime(e.get("ts", 0))),
                           e.get("host", ""), e.get("event", ""), _short(detail))
        console.print(events)


def _recoverable(plan: dict[str, Any] | None, spares: list[str]) -> str:
    """One line on s*, the step every rank resumes from after a host loss, and the spares."""
    spare = f"  spares: {', '.join(spares)}" if spares else "  spares: none"
    if not plan:
        return "host-loss recovery step: - (no replication between hosts)" + spare
    if plan.get("sstar", -1) < 0:
        return f"host-loss recovery step: none yet (first target {plan.get('target')})" + spare
    return (f"host-loss recovery step s*: {plan['sstar']}  lag: {plan.get('lag_steps', 0)} "
            f"steps ({plan.get('lag_seconds', 0.0):.1f} s)  replicated every "
            f"{plan.get('every', 1)} steps" + spare)


def _step(step: int | None) -> str:
    return "-" if step is None else str(step)


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "-"
    return f"{min(ranks)}-{max(ranks)}" if len(ranks) > 1 else str(ranks[0])


def _short(detail: dict[str, Any]) -> str:
    text = json.dumps(detail, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."
