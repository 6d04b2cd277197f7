"""Reading a checkpoint out of gemini: the newest verified step of a rank, from this
host's shared memory or the persistent tier (:func:`open_checkpoint`, behind ``gemini
inspect``), written as a ``torch.distributed.checkpoint`` directory
(:func:`export_checkpoint`, behind ``gemini export``)."""

from __future__ import annotations

import mmap
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher import memory
from launcher.errors import CheckpointError, StorageError, UsageError
from launcher.persist import check_run_dir, read_slot_file, scan, slot_path

#: What gemini export writes last: DCP's metadata, a pickle its loader unpickles; the
#: directory is complete (loadable) only once it is there.
METADATA = ".metadata"


def _snapshot(segment: memory.Segment) -> memory.SlotImage | None:
    """A private copy of the committed slot ``segment`` holds, verified; None if the slot
    changed during the copy. Raises CheckpointError if it does not verify."""
    buf = segment.view
    header = memory.read_header(buf)
    if not memory.committed(header):
        return None
    end = header.meta_offset + header.meta_len
    if header.meta_offset < memory.HEADER_SIZE + header.data_len or end > len(buf):
        raise CheckpointError("malformed header")
    copy = mmap.mmap(-1, end)
    try:
        with memoryview(copy) as dst, memoryview(buf) as src:
            dst[:end] = src[:end]
        if not memory.unchanged(buf, header):
            copy.close()
            return None
        meta = memory.read_meta(copy, header)
        memory.verify(copy, header, meta)
    except (ValueError, KeyError, TypeError) as exc:
        copy.close()
        raise CheckpointError(f"malformed metadata: {exc}") from None
    except CheckpointError:
        copy.close()
        raise
    return memory.SlotImage(f"memory:{segment.name}", header, meta, copy)


# Complexity above 10: each tier in turn, with a reason for each miss.
def open_checkpoint(run_id: str, *, rank: int = 0, step: int | None = None,  # noqa: C901
                    directory: Path | None = None) -> memory.SlotImage:
    """The newest step (or ``step``) of ``rank`` that verifies: from this host's shared
    memory (the run's own slots, not replicas of peers), or from the persisted files under
    ``directory``. Raises CheckpointError when none verifies, StorageError when
    ``directory`` is not a directory."""
    reasons: list[str] = []
    if directory is not None:
        directory = Path(directory)
        if not directory.is_dir():
            raise StorageError(f"{directory} is not a directory")
        where = str(directory)
        check_run_dir(directory, run_id)  # another user's: refused, not merely skipped
        steps = sorted(scan(directory, run_id).get(rank, []), reverse=True)
        for found in steps:
            if step is not None and found != step:
                continue
            try:
                return read_slot_file(slot_path(directory, run_id, rank, found))
            except CheckpointError as exc:
                reasons.append(f"step {found}: {exc}")
    else:
        where = f"shared memory ({memory.SHM_DIR})"
        for _ in range(3):  # a slot a live run rewrote meanwhile: look again
            changed = False
            for name in _memory_candidates(run_id, rank, step):
                try:
                    segment = memory.attach_segment(name, populate=False)
                except StorageError as exc:
                    reasons.append(str(exc))
                    continue
                try:
                    image = _snapshot(segment)
                except CheckpointError as exc:
                    reasons.append(f"{name}: {exc}")
                    continue
                finally:
                    segment.close()
                if image is not None and (step is None or image.header.step == step):
                    return image
                if image is not None:
                    image.close()
                changed = True
            if not changed:
                break
    what = f"rank {rank}" + ("" if step is None else f" step {step}")
    detail = f" ({'; '.join(reasons[:3])})" if reasons else ""
    raise CheckpointError(f"no verified checkpoint of run {run_id!r} {what} in {where}{detail}")


def _memory_candidates(run_id: str, rank: int, step: int | None) -> list[str]:
    """Names of this run's own committed slots of ``rank`` on this host, newest first: by
    step, and of one step the later commit (as ``memory.by_step`` picks)."""
    found = []
    for info in memory.run_slots(run_id, check=False):
        header = info.header
        if (not info.replica and info.rank == rank and info.valid_step is not None
                and memory.committed(header, step=step, run_id=run_id)):
            found.append(((header.step, header.seq), info.name))
    return [name for _, name in sorted(found, reverse=True)]


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_checkpoint` wrote."""

    run_id: str
    rank: int
    step: int
    source: str
    """``memory:<segment>`` or the persisted file."""
    out_dir: Path
    tensors: int
    nbytes: int
    """Tensor bytes written."""


def export_checkpoint(out_dir: Path, run_id: str, *, rank: int = 0, step: int | None = None,
                      directory: Path | None = None) -> ExportResult:
    """Write the newest verified step (or ``step``) of ``rank`` as a
    ``torch.distributed.checkpoint`` directory at ``out_dir`` (created; must be empty).

    The state dict is ``{"model": model.state_dict(), "optimizer": optimizer.state_dict(),
    "extra": {...}, "step": N}`` (keys the script did not checkpoint are left out): the
    optimizer keeps torch.optim's layout with integer parameter ids, and values that are
    not tensors are stored by DCP as pickled bytes. Load it with
    ``torch.distributed.checkpoint.load`` into a dict of the same layout (an optimizer's
    state must exist first, e.g. after one step) or convert it with
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``.

    DCP's ``.metadata`` is a pickle, which its loader unpickles: whoever can replace it runs
    code as the user who loads the export. So ``out_dir``, when it exists, must be a
    directory of the caller that no other user can write (a link is not followed); one
    that is made is made mode 0700; the files are written mode 0600 in a private staging
    directory inside it and moved into place, ``.metadata`` last, so nobody else can read,
    replace or pre-plant any of them.

    Raises UsageError if ``out_dir`` is not empty, StorageError if it or ``directory`` is
    not usable (another user's, or writable by others), CheckpointError if no step
    verifies.
    """
    out_dir = Path(out_dir)
    if os.path.lexists(out_dir):
        _check_out_dir(out_dir)
    with open_checkpoint(run_id, rank=rank, step=step, directory=directory) as image, \
            ExitStack() as others:
        import warnings

        import torch
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        from launcher.codec import load_state

        found = image.header.step

        def resolve(owner: int) -> tuple[Any, dict[str, Any]]:
            """The same step of another rank of the host, which keeps shares of it."""
            other = others.enter_context(open_checkpoint(run_id, rank=owner, step=found,
                                                         directory=directory))
            return other.buf, other.meta

        state = load_state(image.buf, image.meta, resolve)
        source = image.source
    state_dict: dict[str, Any] = {k: state[k] for k in ("model", "optimizer", "extra")
                                  if k in state}
    state_dict["step"] = found
    tensors = [t for t in _leaves(state_dict) if isinstance(t, torch.Tensor)]

    def write(staging: Path) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
            save(state_dict, storage_writer=FileSystemWriter(staging), no_dist=True)

    try:
        _write_private(out_dir, write)
    except OSError as exc:
        raise StorageError(f"cannot write {out_dir}: {exc.strerror or exc}") from None
    except CheckpointException as exc:
        raise StorageError(f"cannot write {out_dir}: {' '.join(str(exc).split())}") from None
    return ExportResult(run_id, rank, found, source, out_dir, len(tensors),
                        sum(t.numel() * t.element_size() for t in tensors))


def _out_dir_refusal(info: os.stat_result) -> str | None:
    """Why a directory with ``info`` (from ``lstat``/``fstat``) must not receive an
    export, or None."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link; export into a directory of yours"
    if not stat.S_ISDIR(info.st_mode):
        return "exists and is not a directory"
    if info.st_uid != os.geteuid():
        return f"belongs to uid {info.st_uid}; export into a directory of yours"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"is writable by other users (mode {stat.S_IMODE(info.st_mode):o}), who "
                "could replace the export's pickled .metadata; chmod go-w it or export "
                "into a new directory")
    return None


def _check_out_dir(out_dir: Path) -> None:
    """StorageError unless the existing ``out_dir`` is a directory of the caller that
    others cannot write; UsageError if it is not empty."""
    why = _out_dir_refusal(os.lstat(out_dir))
    if why is not None:
        raise StorageError(f"{out_dir} {why}")
    if any(out_dir.iterdir()):
        raise UsageError(f"{out_dir} is not empty; export into a new or empty directory")


def _open_out_dir(out_dir: Path) -> int:
    """A descriptor of ``out_dir``, made mode 0700 if missing, checked as
    :func:`_check_out_dir` checks it (also if another user made it meanwhile)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(out_dir, 0o700)
    except FileExistsError:
        _check_out_dir(out_dir)
    try:
        fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        _check_out_dir(out_dir)  # replaced by a link or a file: says so
        raise
    why = _out_dir_refusal(os.fstat(fd))
    if why is not None:
        os.close(fd)
        raise StorageError(f"{out_dir} {why}")
    return fd


def _write_private(out_dir: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(staging)`` on a new private directory (mode 0700) inside ``out_dir``,
    then make what it wrote mode 0600 (directories 0700) and move it into ``out_dir``,
    :data:`METADATA` last; the staging directory is removed in any case. DCP's writer
    opens its files by name with the umask's mode: in the staging directory nobody else
    can see, pre-plant or replace them."""
    out_fd = _open_out_dir(out_dir)
    try:
        staging = Path(tempfile.mkdtemp(prefix=".gemini-export-", dir=out_dir))
        try:
            write(staging)
            for folder, dirs, files in os.walk(staging):
                for name in dirs:
                    os.chmod(os.path.join(folder, name), 0o700)
                for name in files:
                    os.chmod(os.path.join(folder, name), 0o600)
            names = sorted(os.listdir(staging), key=lambda name: name == METADATA)
            staging_fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                 | os.O_CLOEXEC)
            try:
                for name in names:
                    os.rename(name, name, src_dir_fd=staging_fd, dst_dir_fd=out_fd)
            finally:
                os.close(staging_fd)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        os.close(out_fd)


def _leaves(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        for value in obj.values():
            yield from _leaves(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _leaves(value)
    else:
        yield obj
