"""``gemini status``: hosts, root, ranks, restarts, newest steps and recent failures of a run."""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING, Any

import click

from gemini_cli import output
from gemini_cli.errors import printable

if TYPE_CHECKING:
    from rich.text import Text

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
    from launcher.events import check_run_id

    if run_id is not None:
        check_run_id(run_id)  # it names a key prefix: no "/" reaching into another run
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
    """The human view. Every value from the store is shown as plain text (:func:`_text`):
    any host of the run (or anyone who may write the store) chose it, so it is neither
    markup for rich nor a terminal control sequence, and a value of an unexpected type
    shows as its JSON, not as a crash."""
    from rich.table import Table
    from rich.text import Text

    console = output.console(highlight=False)
    if clear:
        console.clear()
    now = time.time()
    root = _plain(status.get("root")) if status.get("root") is not None else "-"
    console.print(Text.assemble("run ", (_plain(status.get("run_id")), "bold"),
                                f"  root: {root}  store: {printable(url)}"))
    _render_hosts(console, status, root, now)
    stopped = status.get("stopped")
    if isinstance(stopped, dict):
        console.print(Text.assemble(("stopped for good", "bold red"),
                                    f" by host {_plain(stopped.get('host'))}: "
                                    f"{_plain(stopped.get('reason'))}"), soft_wrap=True)
    ready = {_plain(h) for h in status.get("ready_spares") or []}
    spares = [f"{name} ({'ready' if name in ready else 'warming up'})"
              for name in map(_plain, status.get("spares") or [])]
    console.print(_text(_recoverable(status.get("replication"), spares)))
    _render_goodput(console, status.get("goodput"))
    ranks = Table(title="newest step per rank and tier")
    for column in ("rank", "host", "memory", "peer replicas", "lag", "persisted"):
        ranks.add_column(column)
    for rank, r in status["ranks"].items():
        replicas = {_plain(host): step for host, step in (r.get("replicas") or {}).items()
                    if _number(step) is not None}
        newest = _number(r.get("memory"))
        lag = "-" if newest is None or not replicas else str(newest - min(replicas.values()))
        ranks.add_row(_text(rank), _text(r.get("host", "")), _text(_step(r.get("memory"))),
                      _text(", ".join(f"{h}:{s}" for h, s in sorted(replicas.items())) or "-"),
                      lag, _text(_step(r.get("persist"))))
    console.print(ranks)
    if status["events"]:
        events = Table(title="recent events")
        for column in ("time", "host", "event", "detail"):
            events.add_column(column)
        for e in status["events"]:
            detail = {k: v for k, v in e.items() if k not in ("event", "host", "ts", "pid")}
            events.add_row(_clock(e.get("ts", 0)), _text(e.get("host", "")),
                           _text(e.get("event", "")), _text(_short(detail)))
        console.print(events)


def _render_hosts(console: Any, status: dict[str, Any], root: str, now: float) -> None:
    """The hosts table, with each host's pace (straggler score), and the stragglers."""
    from rich.table import Table
    from rich.text import Text

    hosts = Table(title="hosts")
    for column in ("host", "status", "pid", "ranks", "round", "restarts", "changed", "pace"):
        hosts.add_column(column)
    verdict = _dict(status.get("stragglers"))
    scores = _dict(verdict.get("scores"))
    slow = {_plain(h) for h in verdict.get("stragglers") or [] if isinstance(h, str)}
    for h in status["hosts"]:
        name = _plain(h.get("host"))
        state = _plain(h.get("status"))
        colour = {"alive": "green", "waiting": "yellow", "lost": "red"}.get(state, "dim")
        updated = _number(h.get("updated", now))
        hosts.add_row(_text(name + (" (root)" if name == root else "")),
                      _text(state, colour), _text(h.get("pid", "")),
                      _text(_ranks(h.get("ranks"))), _text(h.get("round", "")),
                      _text(h.get("restart_count", 0)),
                      "-" if updated is None else f"{now - updated:.0f} s ago",
                      _pace(scores.get(h.get("host")), name in slow))
    console.print(hosts)
    if slow:
        console.print(Text.assemble(("stragglers: ", "bold red"), _plain(", ".join(
            f"{host} ({_number(scores.get(host)) or 0:.2f}x the median host's own work)"
            for host in sorted(slow)))))


#: The parts of a run's wall time as ``gemini status`` draws them (launcher.goodput).
#: A part's colour and glyph (the bar reads without colour too: training █, what
#: checkpoints cost ▓, recovery ▒, the rest ░).
_PARTS = (("useful", "green", "█"), ("redone", "red", "▓"), ("checkpoint", "cyan", "▓"),
          ("detection", "magenta", "▒"), ("rendezvous", "yellow", "▒"),
          ("start_up", "blue", "▒"), ("restore", "bright_blue", "▒"),
          ("waiting", "bright_black", "░"), ("other", "white", "░"))
_BAR = 60


def _render_goodput(console: Any, goodput: object) -> None:
    """ETTR, a bar of where the wall time went, and the table of its parts (nothing
    before the run's first worker started)."""
    from rich.table import Table
    from rich.text import Text

    wall = _number(goodput.get("wall_s")) if isinstance(goodput, dict) else None
    if not wall or not isinstance(goodput, dict):
        return
    lost = goodput.get("lost_s")
    lost = lost if isinstance(lost, dict) else {}
    seconds = {"useful": _number(goodput.get("useful_s")) or 0.0,
               **{part: _number(lost.get(part)) or 0.0 for part, _, _ in _PARTS[1:]}}
    ettr = _number(goodput.get("ettr"))
    bar = Text("|")
    for part, colour, glyph in _PARTS:
        bar.append(glyph * round(_BAR * seconds[part] / wall), style=colour)
    bar.append("|")
    console.print(Text.assemble(
        ("goodput ", "bold"), ("-" if ettr is None else f"{100 * ettr:.1f}%", "bold"),
        f" ETTR over {_duration(wall)}, {_plain(goodput.get('failures', 0))} restarts, "
        f"step {1000 * (_number(goodput.get('step_s')) or 0.0):.1f} ms (median), "
        f"as host {_plain(goodput.get('host'))} counts it"))
    console.print(bar)
    table = Table(title="where the time went")
    for column in ("part", "seconds", "share"):
        table.add_column(column)
    for part, colour, glyph in _PARTS:
        table.add_row(Text(f"{glyph} {part.replace('_', '-')}", style=colour),
                      f"{seconds[part]:.1f}",
                      f"{100 * seconds[part] / wall:.1f}%")
    console.print(table)


def _duration(seconds: float) -> str:
    minutes, rest = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{rest:02d}s" if hours else (
        f"{minutes}m{rest:02d}s" if minutes else f"{seconds:.1f} s")


def _pace(score: object, straggler: bool) -> Text:
    """A host's own work per step against the median host's (its straggler score)."""
    from rich.text import Text

    value = _number(score)
    return Text("-" if value is None else f"{value:.2f}x" + (" straggler" if straggler else ""),
                style="red" if straggler else "")


def _dict(value: object) -> dict[Any, Any]:
    return value if isinstance(value, dict) else {}


def _plain(value: object) -> str:
    """A store value as one printable string: text as it is, anything else as JSON."""
    return printable(value if isinstance(value, str) else json.dumps(value, sort_keys=True))


def _text(value: object, style: str = "") -> Text:
    """A table cell that shows ``value`` literally (rich parses a ``str`` as markup)."""
    from rich.text import Text

    return Text(_plain(value), style=style)


def _number(value: object) -> float | None:
    """``value`` if it is a finite number (not a bool), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return value
    return None


def _clock(ts: object) -> str:
    seconds = _number(ts)
    try:
        return "-" if seconds is None else time.strftime("%H:%M:%S", time.localtime(seconds))
    except (OverflowError, OSError, ValueError):  # a time no clock shows
        return "-"


def _recoverable(plan: object, spares: list[str]) -> str:
    """One line on s*, the step every rank resumes from after a host loss, and the spares."""
    spare = f"  spares: {', '.join(spares)}" if spares else "  spares: none"
    if not plan or not isinstance(plan, dict):
        return "host-loss recovery step: - (no replication between hosts)" + spare
    sstar = _number(plan.get("sstar", -1))
    if sstar is None or sstar < 0:
        return f"host-loss recovery step: none yet (first target {_plain(plan.get('target'))})" + spare
    return (f"host-loss recovery step s*: {_plain(plan['sstar'])}  lag: {_plain(plan.get('lag_steps', 0))} "
            f"steps ({_number(plan.get('lag_seconds', 0.0)) or 0.0:.1f} s)  replicated every "
            f"{_plain(plan.get('every', 1))} steps" + spare)


def _step(step: object) -> str:
    return "-" if step is None else _plain(step)


def _ranks(ranks: object) -> str:
    if not isinstance(ranks, list) or not ranks:
        return "-" if not ranks else _plain(ranks)
    if not all(_number(r) is not None for r in ranks):
        return _plain(ranks)
    return f"{min(ranks)}-{max(ranks)}" if len(ranks) > 1 else str(ranks[0])


def _short(detail: dict[str, Any]) -> str:
    text = json.dumps(detail, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."
