"""The one table from exceptions to exit codes (documented in the README)."""

from __future__ import annotations

from launcher.errors import (
    CheckpointError,
    ConfigError,
    GeminiError,
    HostUnhealthyError,
    Interrupted,
    NoProgressError,
    StorageError,
    StoreError,
    WorkerFailedError,
)

#: Checked in order; the first matching class gives the exit code.
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (WorkerFailedError, 1),  # torchrun's code for a failed worker group
    (ConfigError, 2),  # bad flags, config file or environment (UsageError too)
    (StoreError, 3),
    (StorageError, 4),
    (CheckpointError, 5),
    (HostUnhealthyError, 6),
    (NoProgressError, 7),  # do not requeue: it would fail the same way again
    (GeminiError, 1),
)
USAGE_EXIT = 2
INTERNAL_EXIT = 70  # an unexpected bug in gemini (EX_SOFTWARE)


def exit_code(exc: BaseException) -> int:
    """The exit code for ``exc``; a signal stop exits 128 + the signal number."""
    if isinstance(exc, Interrupted):
        return 128 + exc.signum
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return INTERNAL_EXIT


def code_for(kind: type[BaseException]) -> int:
    """The exit code of errors of ``kind``, for a command that reports one without
    raising it (``gemini inspect`` prints every slot, then exits as for a corrupt one)."""
    return next((code for cls, code in EXIT_CODES if issubclass(kind, cls)), INTERNAL_EXIT)


def printable(text: str) -> str:
    """``text`` with every character that is not printable written as a visible escape
    (``\\x1b``, ``\\u202e``): what gemini prints of text it does not control (values from
    the coordination store, error messages that quote input) cannot drive the terminal
    (ESC starts the sequences that set the clipboard or clear the screen; bidi overrides
    reorder what is shown)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
