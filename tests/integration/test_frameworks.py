"""gemini's checkpoints through the trainers people use (``launcher.integrations``): real
packages (the ``frameworks`` extra), two workers under ``gemini run``, CPU and gloo; a
worker is killed mid-run and the run resumes from memory."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import GEMINI, REPO, SCRIPTS, env_with, run

pytestmark = pytest.mark.frameworks


@pytest.mark.parametrize("example", ["hf_trainer.py", "lightning_fit.py", "accelerate_loop.py"])
def test_the_framework_examples_end_with_success(tmp_path: Path, example: str) -> None:
    """What a new user runs first: each example, as its docstring says, ends with exit 0
    (a process group left to the interpreter's exit can abort a finished worker)."""
    done = run([*GEMINI, "run", "--nproc-per-node", "2", str(REPO / "examples" / example),
                "--steps", "12"], env=env_with(tmp_path), timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.output[-4000:]


def _starts(stdout: str) -> dict[int, list[int]]:
    """rank -> the global steps its attempts started from."""
    found: dict[int, list[int]] = {}
    # No anchors: two workers' lines can interleave (python -u writes a line's text and
    # its newline separately).
    for rank, step in re.findall(r"resume rank=(\d+) from=(\d+)", stdout):
        found.setdefault(int(rank), []).append(int(step))
    return found


def test_a_hugging_face_trainer_resumes_from_memory(tmp_path: Path) -> None:
    """transformers.Trainer (a tiny GPT-2, 12 steps over 1.5 epochs, dropout on) with
    ``launcher.integrations.huggingface``: rank 1 is killed once step 10 is committed; both
    ranks restart and the Trainer resumes at global step 10 from memory, without
    ``resume_from_checkpoint``, in the second epoch (8 steps each). The final weights and
    every logged loss (the restored log history, then the steps after the resume) equal an
    unfailed run's."""
    script = [str(SCRIPTS / "train_hf.py"), "--steps", "12", "--output-dir",
              str(tmp_path / "hf")]
    ref = run([*GEMINI, "run", "--nproc-per-node", "2", *script, "--out",
               str(tmp_path / "ref.pt")], env=env_with(tmp_path), timeout=300)
    assert ref.returncode == 0, ref.output[-4000:]
    done = run([*GEMINI, "run", "--nproc-per-node", "2", "--max-restarts", "1", *script,
                "--kill", "1:10", "--out", str(tmp_path / "out.pt")],
               env=env_with(tmp_path), timeout=300)
    assert done.returncode == 0, done.output[-4000:]
    assert _starts(done.stdout) == {0: [0, 10], 1: [0, 10]}, done.stdout[-3000:]
    expected = torch.load(tmp_path / "ref.pt")
    got = torch.load(tmp_path / "out.pt")
    assert got["global_step"] == expected["global_step"] == 12
    assert got["losses"] == expected["losses"] and sorted(got["losses"]) == list(range(1, 13))
    assert sorted(got["weights"]) == sorted(expected["weights"])
    for key, tensor in expected["weights"].items():
        assert torch.equal(got["weights"][key], tensor), key


@pytest.mark.parametrize("sampler", ["generator", "seedable"])
def test_an_accelerate_loop_resumes_from_memory(tmp_path: Path, sampler: str) -> None:
    """accelerate (a prepared model, optimizer, scheduler and shuffled data loader, 8
    batches per epoch and rank, 20 steps; dropout) with ``launcher.integrations.accelerate``.
    Rank 1 is killed once step 13 is committed, in the second epoch: both ranks resume at
    step 14 from memory, the loader fast-forwarded with ``skip_first_batches`` over that
    epoch's order (drawn by the loader's own generator, or by accelerate's seedable
    sampler). With the generator, rank 0 is also killed once step 15, the second epoch's
    last, is committed: the third epoch draws a new order, as the unfailed run's did. Each
    time, the final weights and the losses of the steps after the resume equal an unfailed
    run's."""
    script = [str(SCRIPTS / "train_accelerate.py"), "--steps", "20", "--sampler", sampler]
    ref = run([*GEMINI, "run", "--nproc-per-node", "2", *script, "--out",
               str(tmp_path / "ref.pt")], env=env_with(tmp_path), timeout=300)
    assert ref.returncode == 0, ref.output[-4000:]
    expected = torch.load(tmp_path / "ref.pt")
    for rank, step in ((1, 13), (0, 15))[:2 if sampler == "generator" else 1]:
        out = tmp_path / f"out-{rank}-{step}.pt"
        done = run([*GEMINI, "run", "--nproc-per-node", "2", "--max-restarts", "1", *script,
                    "--kill", f"{rank}:{step}", "--out", str(out)],
                   env=env_with(tmp_path), timeout=300)
        assert done.returncode == 0, done.output[-4000:]
        starts = re.findall(r"resume rank=(\d+) start=(\d+)", done.stdout)  # see _starts
        resumed = str(step + 1)
        assert sorted(starts) == [("0", "0"), ("0", resumed), ("1", "0"), ("1", resumed)]
        got = torch.load(out)
        assert got["losses"] == {s: expected["losses"][s] for s in range(step + 1, 20)}, step
        for key, tensor in expected["weights"].items():
            assert torch.equal(got["weights"][key], tensor), (step, key)


def test_a_lightning_trainer_resumes_from_memory(tmp_path: Path) -> None:
    """A Lightning Trainer (DDP over gloo, 16 steps over 2 epochs of a plain DataLoader
    that Lightning gives a shuffling DistributedSampler; dropout, AdamW, a per-step LR
    schedule) with ``launcher.integrations.lightning``. Rank 1 is killed once step 11 is
    committed: both ranks restart and ``fit`` resumes at global step 11 from memory,
    without ``ckpt_path``, 3 batches into the second epoch (the loader fast-forwarded with
    that epoch's order). Rank 0 is killed once step 8, the first epoch's last, is
    committed: the second epoch starts its data anew after the resume, as the unfailed
    run's did. Each time, the final weights and the losses of the steps after the resume
    equal an unfailed run's."""
    script = [str(SCRIPTS / "train_lightning.py"), "--steps", "16", "--output-dir",
              str(tmp_path / "pl")]
    ref = run([*GEMINI, "run", "--nproc-per-node", "2", *script, "--out",
               str(tmp_path / "ref.pt")], env=env_with(tmp_path), timeout=300)
    assert ref.returncode == 0, ref.output[-4000:]
    expected = torch.load(tmp_path / "ref.pt")
    assert expected["global_step"] == 16 and sorted(expected["losses"]) == list(range(1, 17))
    for rank, step in ((1, 11), (0, 8)):
        out = tmp_path / f"out-{rank}-{step}.pt"
        done = run([*GEMINI, "run", "--nproc-per-node", "2", "--max-restarts", "1", *script,
                    "--kill", f"{rank}:{step}", "--out", str(out)],
                   env=env_with(tmp_path), timeout=300)
        assert done.returncode == 0, done.output[-4000:]
        assert _starts(done.stdout) == {0: [0, step], 1: [0, step]}, done.stdout[-3000:]
        got = torch.load(out)
        assert got["global_step"] == 16
        assert got["losses"] == {s: expected["losses"][s] for s in range(step + 1, 17)}, step
        assert sorted(got["weights"]) == sorted(expected["weights"])
        for key, tensor in expected["weights"].items():
            assert torch.equal(got["weights"][key], tensor), (step, key)


def _lightning_fit(loader: type | None = None, own_state_dict: bool = False,
                   check: Callable[..., bool] | None = None) -> list[bool]:
    """Fit a small LightningModule for 6 steps, with a validation every 2 steps, a
    scheduler and a batch norm's buffers (its train data in a ``loader`` DataLoader class,
    its own ``state_dict`` if asked); ``check(trainer, kept)`` (by default
    :func:`_read_as_lightning_reads`) at the end of every batch: what it said."""
    import lightning.pytorch as pl

    seen: list[bool] = []
    kept: list[Any] = []  # one loop-state reader for the whole fit: its plans are kept

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                                           torch.nn.Linear(4, 1))

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch: list[torch.Tensor], index: int) -> None:
            self.net(batch[0])

        def configure_optimizers(self) -> object:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 2)]

        def val_dataloader(self) -> torch.utils.data.DataLoader:
            data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
            return torch.utils.data.DataLoader(data, batch_size=4)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
            return (loader or torch.utils.data.DataLoader)(data, batch_size=4)

        if own_state_dict:
            def state_dict(self, *args: object, **kwargs: object) -> dict:
                return {"only": torch.zeros(1)}

    class Compare(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            seen.append((check or _read_as_lightning_reads)(trainer, kept))

    pl.Trainer(max_steps=6, val_check_interval=2, callbacks=[Compare()], accelerator="cpu",
               devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False).fit(Model())
    return seen


def _read_as_lightning_reads(trainer: Any, kept: list[Any]) -> bool:
    """Whether the fast readers are in use and give what Lightning gives: the loops'
    states (one reader, kept in ``kept``, for the whole fit) and the module's weights (its
    parameters themselves)."""
    from launcher.integrations.lightning import _LoopStates, _module_weights

    connector = trainer._checkpoint_connector
    if not kept:
        kept.append(_LoopStates.checked(trainer))
    weights, own = _module_weights(trainer)(), connector._get_lightning_module_state_dict()
    return (isinstance(kept[0], _LoopStates)
            and kept[0]() == connector._get_loops_state_dict()
            and list(weights) == list(own)
            and all(torch.equal(weights[k], own[k]) for k in own)
            and weights["net.0.weight"] is trainer.lightning_module.net[0].weight)


def test_lightning_loop_states_and_weights_are_read_as_lightning_reads_them() -> None:
    """The integration reads the loops' progress its own way (``_LoopStates``) and the
    module's state dict with ``model_state`` (``_module_weights``): at every step of a
    real fit both dicts equal Lightning's own, and the fast readers are the ones in use
    (a fallback to Lightning's slower ones would pass every resume test unseen); a module
    with its own ``state_dict`` is read Lightning's way."""
    from launcher.integrations.lightning import _module_weights

    assert _lightning_fit() == [True] * 6
    assert _lightning_fit(own_state_dict=True, check=lambda trainer, _: list(
        _module_weights(trainer)()) == ["only"]) == [True] * 6


def test_a_resumable_train_loaders_state_is_in_the_fit_loops_as_in_lightnings() -> None:
    """A train loader with ``state_dict`` and ``load_state_dict`` (which Lightning resumes
    itself): its state is in the fit loop's state the fast reader gives, equal to
    Lightning's."""
    import torch.utils.data

    from launcher.integrations.lightning import _LoopStates

    class Resumable(torch.utils.data.DataLoader):
        def state_dict(self) -> dict:
            return {"position": 3}

        def load_state_dict(self, state: dict) -> None:
            pass

    assert _lightning_fit(Resumable) == [True] * 6
    assert _lightning_fit(Resumable, check=lambda trainer, _: _LoopStates.checked(trainer)()[
        "fit_loop"]["state_dict"]["combined_loader"] == [{"position": 3}]) == [True] * 6


def test_a_lightning_checkpoints_tensorless_parts_are_one_pickle() -> None:
    """The parts of a Lightning checkpoint besides the model and optimizer states go into
    the slot as one pickle when they hold no tensor, and come back merged; a tensor among
    them (a ModelCheckpoint's best score, on the GPU say) keeps the per-value form, so it
    is copied as a tensor and never pickled."""
    from launcher.integrations.lightning import _LightningSnapshot, _pickled_without_tensors

    rest = {"loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 3}}}},
            "epoch": 1, "hparams": {"lr": 0.1, "kind": torch.float16}}
    blob = _pickled_without_tensors(rest)
    assert isinstance(blob, bytes)
    assert _pickled_without_tensors({**rest, "callbacks": {"best": torch.tensor(0.5)}}) is None

    class Connector:
        def __init__(self, checkpoint: dict) -> None:
            self.checkpoint = checkpoint

        def dump_checkpoint(self, weights_only: bool) -> dict:
            return self.checkpoint

    snapshot = _LightningSnapshot()
    snapshot.live, snapshot.loops = True, dict  # dict() stands in for the loops' reader
    snapshot.weights = dict  # and for the module's
    weights = {"w": torch.ones(2)}
    for checkpoint in ({**rest, "state_dict": weights},
                       {**rest, "state_dict": weights, "callbacks": {"best": torch.tensor(0.5)}}):
        snapshot.trainer = type("Trainer", (), {"_checkpoint_connector": Connector(checkpoint)})()
        state = snapshot.state_dict()
        assert state["state_dict"] is weights
        snapshot.load_state_dict(state)
        assert snapshot.loaded is not None and snapshot.loaded.keys() == checkpoint.keys()
        assert snapshot.loaded["loops"] == rest["loops"] and snapshot.loaded["hparams"] == rest["hparams"]
