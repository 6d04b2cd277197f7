"""``gemini export``: write a checkpoint as a torch.distributed.checkpoint directory."""

from __future__ import annotations

import click


@click.command("export", short_help="Write a checkpoint as a torch.distributed.checkpoint dir.")
def export_command() -> int:
    """Not built yet."""
    raise click.ClickException("gemini export is not built yet")
