"""``gemini plan``: placement groups, recovery probability and memory per host."""

from __future__ import annotations

import click


@click.command("plan", short_help="Show the replica placement for N hosts.")
def plan_command() -> int:
    """Not built yet."""
    raise click.ClickException("gemini plan is not built yet")
