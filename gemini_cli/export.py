"""``gemini export``: write a checkpoint as a torch.distributed.checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path

import click

SCHEMA = "gemini.export/v1"


@click.command("export", short_help="Write a checkpoint as a torch.distributed.checkpoint dir.")
@click.argument("out_dir", type=click.Path(path_type=Path, file_okay=True, dir_okay=True))
@click.option("--run-id", required=True, help="The run (its rdzv id).")
@click.option("--from-dir", "from_dir", type=click.Path(path_type=Path), default=None,
              help="Read the persistent tier under this directory instead of this host's "
                   "shared memory.")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="Export this step (default: the newest step that verifies).")
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="Whose checkpoint to export.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema gemini.export/v1).")
def export_command(out_dir: Path, run_id: str, from_dir: Path | None, step: int | None,
                   rank: int, as_json: bool) -> int:
    """Write one rank's checkpoint of a run, taken from this host's shared memory (its own
    slots) or from a persisted directory (--from-dir), to OUT_DIR as a standard
    torch.distributed.checkpoint directory. The newest step whose checksums verify is used,
    unless --step names one.

    In data-parallel training every rank holds the same model and optimizer, so rank 0
    (the default) is the whole model; with model parallelism each rank is one shard.

    The state dict is {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
    "extra": {...}, "step": N}: the optimizer keeps torch.optim's integer parameter ids,
    and values that are not tensors are stored as DCP byte items. Load it with
    torch.distributed.checkpoint.load(sd, checkpoint_id=OUT_DIR) into a dict of that
    layout (an optimizer's state must exist first, e.g. after one step), or convert it
    with torch.distributed.checkpoint.format_utils.dcp_to_torch_save.

    OUT_DIR's .metadata is a pickle that the loader unpickles: load an export only from a
    directory no other user can write. OUT_DIR, if it exists, must be yours and not
    writable by others; one that is created is mode 0700, and the files are mode 0600.
    --from-dir reads only your own files.

    Exit codes: 0 written; 2 OUT_DIR not empty; 4 a directory is unusable (missing, a
    link, another user's, or writable by others); 5 no step verifies.
    """
    from launcher import export

    result = export.export_checkpoint(out_dir, run_id, rank=rank, step=step,
                                       directory=from_dir)
    if as_json:
        click.echo(json.dumps({"schema": SCHEMA, "run_id": result.run_id, "rank": result.rank,
                               "step": result.step, "source": result.source,
                               "out_dir": str(result.out_dir), "tensors": result.tensors,
                               "bytes": result.nbytes}, indent=2))
    else:
        click.echo(f"exported step {result.step} of rank {result.rank} ({result.tensors} "
                   f"tensors, {result.nbytes} bytes) from {result.source} to {result.out_dir}")
    return 0
