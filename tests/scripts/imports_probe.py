"""Says which modules this worker found imported before it imported anything itself:
``yaml`` (an installed package it imports) and ``xml.dom.minidom`` (stdlib, imported by
nobody here; ``--preload`` names it). Saves one step, then on its first attempt waits to
be killed; a restarted attempt ends at once.

Prints "attempt=A yaml=B minidom=B"."""

import os
import sys
import time

preloaded = {"yaml": "yaml" in sys.modules, "minidom": "xml.dom.minidom" in sys.modules}

import torch  # noqa: E402
import yaml  # noqa: E402, F401

from launcher import Checkpointer  # noqa: E402

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"attempt={attempt} yaml={preloaded['yaml']} minidom={preloaded['minidom']}", flush=True)
ckpt = Checkpointer(extra={"w": torch.zeros(4)})
ckpt.restore()
ckpt.save(0)
ckpt.wait()
if attempt == 0:
    time.sleep(120)
ckpt.close()
