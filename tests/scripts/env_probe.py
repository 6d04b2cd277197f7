"""Worker that writes its environment to DIR/env-RANK.json (a torchrun-compatibility probe)."""

import json
import os
import sys

out = sys.argv[1]
with open(os.path.join(out, f"env-{os.environ['RANK']}.json"), "w") as fh:
    json.dump(dict(os.environ), fh, sort_keys=True)
