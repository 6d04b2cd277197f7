"""Fixtures and helpers of the slot and worker-hook tests, shared by tests/unit/test_memory.py
and tests/integration/test_memory.py: a supervisor's slot owner and slot server in this
process, and a small model trained and saved through a real Checkpointer."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from launcher import contract, hook, memory
from launcher.slots import SlotOwner, SlotServer


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> Iterator[str]:
    rid = f"test-{os.getpid()}-{request.node.name}"
    yield rid
    for name in memory.list_segments(memory.PREFIX + memory.run_key(rid)):
        memory.unlink_segment(name)


@pytest.fixture
def supervisor(run_id: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[SlotServer]:
    """A slot owner and server as the supervisor runs them, and the worker environment."""
    owner = SlotOwner(run_id=run_id, host_id="h0", local_world_size=1)
    server = SlotServer(owner)
    monkeypatch.setenv(contract.ENV_SOCKET, server.env_address)
    monkeypatch.setenv(contract.ENV_PREFIX, owner.prefix)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv(contract.ENV_RESTORE_STEP, "-1")
    yield server
    server.close()
    owner.close()
    assert memory.list_segments(owner.prefix) == []


def _model(width: int = 8) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, model[0].in_features)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _save_two_steps() -> None:
    """Train and save steps 0 and 1 through a real Checkpointer, then close it."""
    model, opt = _model()
    ckpt = hook.Checkpointer(model=model, optimizer=opt)
    ckpt.restore()
    for step in range(2):
        _train(model, opt)
        ckpt.save(step)
    ckpt.close()
