"""Worker that writes its environment to DIR/env-RANK.json and what it sees of its own
process (main module, argv, path, priority, stdin, command line) to DIR/main-RANK.json: a torchrun-
compatibility probe. Arguments after DIR are only echoed (through sys.argv)."""

import json
import os
import sys

out = sys.argv[1]
rank = os.environ["RANK"]
with open(os.path.join(out, f"env-{rank}.json"), "w") as fh:
    json.dump(dict(os.environ), fh, sort_keys=True)
main = {
    "file": __file__,
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "path0": sys.path[0],
    "globals": sorted(globals()),
    "builtins": type(__builtins__).__name__,
    "loader": type(__loader__).__name__,
    "spec": repr(__spec__),
    "package": repr(__package__),
    "main_is_this_module": sys.modules["__main__"].__dict__ is globals(),
    "nice": os.getpriority(os.PRIO_PROCESS, 0),
    # the session's niceness, where sessions are scheduled as groups (autogroups)
    "group_nice": (open("/proc/self/autogroup").read().split()[-1]
                   if os.path.exists("/proc/self/autogroup") else None),
    "cwd": os.getcwd(),
    "stdin": [os.fstat(0).st_dev, os.fstat(0).st_ino],
    # what ps, pgrep -f and pkill -f match (NUL- or space-separated, as setproctitle does)
    "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\0").replace(b"\0", b" ")
    .decode(),
}
with open(os.path.join(out, f"main-{rank}.json"), "w") as fh:
    json.dump(main, fh, sort_keys=True)
