"""``gemini inspect``: what this host holds in shared memory, or what a persistent-tier
directory holds (``--dir``), verified against checksums."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from gemini_cli import output
from gemini_cli.errors import code_for
from launcher.errors import CheckpointError

SCHEMA = "gemini.inspect/v1"


@click.command("inspect", short_help="Show the checkpoints this host holds in memory.")
@click.option("--run-id", default=None, help="Only the slots of this run (its rdzv id).")
@click.option("--dir", "persist_dir", type=click.Path(path_type=Path), default=None,
              help="Inspect the persisted checkpoint files under this directory instead.")
@click.option("--tensors", is_flag=True, help="List every tensor of each committed slot.")
@click.option("--no-verify", is_flag=True, help="Skip recomputing the checksums.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema gemini.inspect/v1).")
def inspect_command(run_id: str | None, persist_dir: Path | None, tensors: bool,
                    no_verify: bool, as_json: bool) -> int:
    """List every checkpoint slot in this host's shared memory: run, rank, slot, step,
    state, sizes and tensors; checksums are verified unless --no-verify. With --dir, list
    the persisted files under that directory the same way (slot is empty, segment is the
    file's path relative to the directory; a file without its manifest is UNPUBLISHED).

    Exit code 0 when every committed slot verifies, 5 when one is corrupt, 4 when --dir
    is not a directory.
    """
    if persist_dir is not None:
        from launcher import persist

        infos = persist.inspect_dir(persist_dir, run_id, check=not no_verify)
        rows = [_file_row(info, persist_dir, tensors) for info in infos]
        where, key, title = str(persist_dir), "dir", "persisted checkpoints in"
    else:
        from launcher import memory

        rows = [_row(info, tensors) for info in memory.run_slots(run_id, check=not no_verify)]
        where, key, title = str(memory.SHM_DIR), "shm_dir", "in-memory checkpoints in"
    if as_json:
        click.echo(json.dumps({"schema": SCHEMA, key: where, "slots": rows}, indent=2))
    else:
        _render(rows, tensors, where, title)
    corrupt = any(r["state"] == "COMMITTED" and r["error"] for r in rows)
    return code_for(CheckpointError) if corrupt else 0


def _row(info: Any, with_tensors: bool) -> dict[str, Any]:
    header = info.header
    committed = header is not None and header.state.name == "COMMITTED"
    return _common(info, with_tensors, segment=info.name, slot=info.index,
                   copy="replica" if info.replica else "own",
                   state=header.state.name if header else "INVALID",
                   step=header.step if committed else None)


def _common(info: Any, with_tensors: bool, **fields: Any) -> dict[str, Any]:
    """The fields that slots and persisted files share (``info``: a ``memory.SlotInfo``
    or a ``persist.FileInfo``), plus ``fields``."""
    header, meta = info.header, info.meta
    row: dict[str, Any] = {
        **fields, "rank": info.rank, "bytes": info.size,
        "run_id": header.run_id if header else None,
        "seq": header.seq if header else None,
        "world_size": header.world_size if header else None,
        "data_bytes": header.data_len if header else None,
        "tensor_count": len(meta["tensors"]) if meta else None,
        "verified": bool(meta) and info.error is None,
        "error": info.error,
    }
    if with_tensors and meta:
        row["tensors"] = _tensors(meta)
    return row


def _tensors(meta: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: t[k] for k in ("path", "dtype", "shape", "nbytes", "xxh3")}
            for t in meta["tensors"]]


def _file_row(info: Any, root: Path, with_tensors: bool) -> dict[str, Any]:
    """A row of the same schema for a persisted file (``launcher.persist.FileInfo``)."""
    header = info.header
    state = header.state.name if header else "INVALID"
    if header and not info.published:
        state = "UNPUBLISHED"
    return _common(info, with_tensors, segment=str(info.path.relative_to(root)), slot=None,
                   copy="persisted", state=state, step=info.step)


def _render(rows: list[dict[str, Any]], with_tensors: bool, where: str,
            title: str = "in-memory checkpoints in") -> None:
    from rich.table import Table

    console = output.console()
    if not rows:
        console.print(f"no gemini checkpoint slots in {where}")
        return
    table = Table(title=f"{title} {where}")
    for column in ("run", "rank", "copy", "slot", "state", "step", "tensors", "data", "size",
                   "check"):
        table.add_column(column, justify="right" if column in ("rank", "slot", "step") else "left",
                         overflow="fold", max_width=20 if column == "run" else None,
                         no_wrap=column != "run")
    for r in rows:
        check = "[red]" + r["error"] + "[/]" if r["error"] else (
            "[green]ok[/]" if r["verified"] else "-")
        table.add_row(str(r["run_id"] or "?"), str(r["rank"]), r.get("copy", ""),
                      "" if r["slot"] is None else str(r["slot"]), r["state"],
                      "" if r["step"] is None else str(r["step"]),
                      "" if r["tensor_count"] is None else str(r["tensor_count"]),
                      _size(r["data_bytes"]), _size(r["bytes"]), check)
    console.print(table)
    if with_tensors:
        for r in rows:
            for t in r.get("tensors", []):
                label = f"r{r['rank']}" + ("" if r["slot"] is None else f"s{r['slot']}")
                console.print(f"  {label} {t['path']} {t['dtype']} "
                              f"{tuple(t['shape'])} {_size(t['nbytes'])}")


def _size(n: int | None) -> str:
    if n is None:
        return ""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)
