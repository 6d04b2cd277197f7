"""The supervisor/worker contract: what gemini adds to the worker environment.

The supervisor (``launcher.agent``, ``launcher.slots``) sets these variables on top of
torchrun's; the worker's hook (``launcher.hook``) reads them. Both import this module,
which imports nothing, so the worker's side stays small.
"""

ENV_RUN_DIR = "GEMINI_RUN_DIR"
"""The run's directory (events, state) on this host."""
ENV_HOST_ID = "GEMINI_HOST_ID"
"""This host's id within the run."""
ENV_SUPERVISOR_PID = "GEMINI_SUPERVISOR_PID"
"""The supervisor's pid: a worker whose supervisor died exits instead of training on."""
ENV_SOCKET = "GEMINI_SLOT_SOCKET"
"""The supervisor's slot service (an abstract Unix socket, ``@name``)."""
ENV_PREFIX = "GEMINI_SLOT_PREFIX"
"""The name prefix of this run's and host's shared-memory segments."""
ENV_RESTORE_STEP = "GEMINI_RESTORE_STEP"
"""The step every rank restores (-1: start fresh)."""
ENV_RESTORE_VERIFIED = "GEMINI_RESTORE_VERIFIED"
"""``rank:seq,...``: the slots holding the restore step that the supervisor has just
verified; a worker whose slot still has that seq need not hash it again."""
ENV_RESTORE_RESHARD = "GEMINI_RESTORE_RESHARD"
"""The world size the restore step was written with when the job since shrank or grew and
its state is sharded (DTensors): each rank assembles its shard from the copies of all of
that world's ranks on its host. 0: no resharding."""
ENV_HEARTBEAT = "GEMINI_HEARTBEAT"
"""The segment of per-local-rank progress counters the worker bumps."""
ENV_SHM_DIR = "GEMINI_SHM_DIR"
"""Where shared memory lives (default /dev/shm); read by both sides."""
ENV_SHM_PRIVATE_DIR = "GEMINI_SHM_PRIVATE_DIR"
"""The private directory under ``GEMINI_SHM_DIR`` that the supervisor resolved and keeps
its segments in (``launcher.slots.SlotOwner`` sets it): its workers use this one, checked,
and never resolve or create one of their own (a name taken or freed meanwhile by another
user would otherwise send them elsewhere)."""
RAISED_DIR = "raised"
"""The folder in the run's directory where a worker that dies of its own uncaught error
leaves a file named after its pid before it exits: stopped by torch (SIGTERM) before it
has exited, it still counts as failing on its own (``launcher.rounds``)."""
