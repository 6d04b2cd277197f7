"""``gemini clean``: remove shared-memory segments left by runs whose supervisor is gone."""

from __future__ import annotations

import json

import click

SCHEMA = "gemini.clean/v1"


@click.command("clean", short_help="Remove leftover shared memory of dead runs.")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema gemini.clean/v1).")
def clean_command(dry_run: bool, as_json: bool) -> None:
    """Remove the checkpoint segments of every run on this host whose supervisor is no
    longer running. Segments of live runs are never touched."""
    from launcher.slots import clean

    removed = clean(dry_run=dry_run)
    names = sorted(n for group in removed.values() for n in group)
    if as_json:
        click.echo(json.dumps({"schema": SCHEMA, "dry_run": dry_run, "segments": names}))
        return
    verb = "would remove" if dry_run else "removed"
    for name in names:
        click.echo(f"{verb} {name}")
    click.echo(f"{verb} {len(names)} segment(s) of {len(removed)} dead run(s)", err=True)
