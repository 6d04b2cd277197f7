"""What a test script reports about the host's shared memory: the bytes of one step in the
slots of every rank of the host, against the bytes of one copy of the state."""

import torch
import torch.distributed as dist

from launcher import Checkpointer, memory


def report(ckpt: Checkpointer, step: int, model: torch.nn.Module,
           optimizer: torch.optim.Optimizer) -> None:
    """Rank 0 prints ``slots bytes=B state=S``: B the data bytes of ``step`` in the host's
    own slots (every rank's, once each has committed it), S those of the model's
    parameters and the optimizer's state (DTensors counted whole)."""
    ckpt.wait()
    if dist.is_initialized():
        dist.barrier()  # every rank's step is committed
    if not dist.is_initialized() or dist.get_rank() == 0:
        held = [memory.inspect_slot(name, check=False).header
                for name in memory.list_segments(ckpt._prefix)
                if (parsed := memory.parse_slot_name(name)) and not parsed.replica]
        found = sum(h.data_len for h in held if h is not None and h.step == step)
        state = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
            v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
        print(f"slots bytes={found} state={state}", flush=True)
    if dist.is_initialized():
        dist.barrier()
