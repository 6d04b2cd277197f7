"""gemini's library: supervisor, memory, replication, recovery and the worker-side hook.

``from launcher import Checkpointer`` is the training-script API; it is imported lazily so
that importing the package (as ``gemini --help`` does) does not import torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Checkpointer", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Checkpointer":
        from launcher.hook import Checkpointer

        return Checkpointer
    raise AttributeError(f"module 'launcher' has no attribute {name!r}")
