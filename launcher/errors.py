"""The one exception family of gemini.

Every error that reaches a user derives from :class:`GeminiError`; infrastructure errors
are translated at the edge (``raise StoreError(...) from exc``). ``gemini_cli.errors``
maps each class to a documented exit code.
"""

from __future__ import annotations


class GeminiError(Exception):
    """Base class of every error gemini reports to a user."""


class ConfigError(GeminiError):
    """A flag, environment variable or config file value is invalid.

    ``field`` names the config key at fault, when there is one, so that the caller can
    say where the bad value came from.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class UsageError(ConfigError):
    """The command line itself is wrong (missing script, conflicting flags)."""


class TorchUnsupportedError(ConfigError):
    """The installed torch is older than gemini supports, or moved or changed one of the
    torch internals gemini relies on (``launcher.torch_boundary``). Like other bad input,
    only a change to the environment helps: another torch release."""


class StoreError(GeminiError):
    """The coordination store is unreachable or answered inconsistently."""


class StoreUnavailableError(StoreError):
    """The coordination store stayed unreachable for longer than the outage window
    (``--store-timeout``)."""


class StoreUncertainError(StoreError):
    """A write timed out: it may or may not have been applied; read it back."""


class StorageError(GeminiError):
    """Shared memory or persistent storage cannot hold or return a checkpoint."""


class ReplicationError(StorageError):
    """A peer host's transport failed, refused a request, or sent data that did not verify."""


class CheckpointError(GeminiError):
    """A checkpoint is missing, corrupt, or does not match the model."""


class ReplicasDivergedError(CheckpointError):
    """The data-parallel replicas' state disagrees (silent data corruption) and the run
    stops rather than train on (``--on-divergence stop``, or rollbacks that did not help)."""


class HostUnhealthyError(GeminiError):
    """This host cannot train any more (a GPU fell off the bus): its supervisor stops its
    workers and leaves the job, as a lost host would."""


class WorkerFailedError(GeminiError):
    """The worker group failed and no restarts are left.

    ``summary`` is torch elastic's failure report (rank, exit code or signal, error
    file, root cause), printed verbatim as torchrun prints it.
    """

    def __init__(self, summary: str) -> None:
        super().__init__(summary)
        self.summary = summary


class NoProgressError(GeminiError):
    """The workers failed the same way ``--max-same-failures`` times in a row without
    completing a new step (after one try of an older checkpoint): restarting again, or
    requeueing the job, would loop. Its own exit code tells a scheduler not to requeue."""


class Interrupted(GeminiError):
    """``gemini run`` was stopped by a signal; its workers were shut down."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum
