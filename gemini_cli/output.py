"""How the commands print: rich consoles whose tables are never cut to fit a pipe."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

#: The width a console takes where the output is not a terminal (a pipe, a file, a CI log):
#: rich would take 80 columns and cut or fold every wider cell; a table is as wide as its
#: content anyway, so nothing is padded to it.
PIPE_WIDTH = 1000


def console(**options: Any) -> Console:
    """A rich console on stdout: a terminal's width, or with output to a pipe or a file
    :data:`PIPE_WIDTH` columns (also where ``COLUMNS`` says less: shells and test runners
    export it for their own terminal, and a log would lose what does not fit)."""
    from rich.console import Console

    if "width" not in options and not sys.stdout.isatty():
        options["width"] = PIPE_WIDTH
    return Console(**options)
