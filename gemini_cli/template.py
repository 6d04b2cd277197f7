"""``gemini template``: print a config or SLURM template to stdout."""

from __future__ import annotations

from importlib import resources

import click

TEMPLATES = {"config": "gemini.yaml", "slurm": "slurm.sbatch"}


@click.command("template", short_help="Print a gemini.yaml or SLURM sbatch template.")
@click.argument("kind", type=click.Choice(sorted(TEMPLATES)))
def template_command(kind: str) -> None:
    """Print the KIND template to stdout, e.g. `gemini template slurm > job.sbatch`."""
    text = resources.files("gemini_templates").joinpath(TEMPLATES[kind]).read_text("utf-8")
    click.echo(text, nl=False)
