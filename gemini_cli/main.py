"""Entry point of the ``gemini`` console script.

Errors end as one line on stderr, ``gemini: error: <reason>``, and the exit code from
:mod:`gemini_cli.errors`. Commands import torch only when they run, never for ``--help``
(but ``gemini run --help``: torchrun's flags are torch's own parser's).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from gemini_cli.clean import clean_command
from gemini_cli.errors import INTERNAL_EXIT, USAGE_EXIT, exit_code, printable
from gemini_cli.export import export_command
from gemini_cli.inspect import inspect_command
from gemini_cli.plan import plan_command
from gemini_cli.run import run_command
from gemini_cli.status import status_command
from gemini_cli.template import template_command
from launcher import __version__
from launcher.errors import GeminiError, WorkerFailedError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="gemini")
def cli() -> None:
    """gemini: fast failure recovery for distributed PyTorch training.

    A torchrun replacement that keeps every worker's checkpoint in memory, so a failed
    job resumes in seconds and loses at most one iteration.
    """


cli.add_command(run_command)
cli.add_command(status_command)
cli.add_command(inspect_command)
cli.add_command(clean_command)
cli.add_command(template_command)
cli.add_command(plan_command)
cli.add_command(export_command)


def _fail(message: str, code: int) -> int:
    # One line, printable: a message may quote input (a flag, a value from a file).
    click.echo(f"gemini: error: {printable(' '.join(message.split()))}", err=True)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code (``sys.exit`` is left to the caller)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        result = cli.main(args=args or ["--help"], prog_name="gemini",
                          standalone_mode=False)
    except click.UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelp" and exc.ctx is not None:
            click.echo(exc.ctx.get_help(), err=True)
            return USAGE_EXIT
        where = f"{exc.ctx.command_path}: " if exc.ctx is not None else ""
        return _fail(where + " ".join(exc.format_message().split()), USAGE_EXIT)
    except click.Abort:
        return _fail("aborted", 130)
    except WorkerFailedError as exc:
        click.echo(exc.summary, err=True)
        return exit_code(exc)
    except GeminiError as exc:
        return _fail(" ".join(str(exc).split()) or type(exc).__name__, exit_code(exc))
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except click.ClickException as exc:
        return _fail(exc.format_message(), exc.exit_code)
    return result if isinstance(result, int) else 0


def entry() -> None:
    """Console-script entry point."""
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException as exc:  # a bug: say so in one line, keep the traceback opt-in
        import os
        import traceback

        if os.environ.get("GEMINI_DEBUG"):
            traceback.print_exc()
        click.echo(f"gemini: internal error: {type(exc).__name__}: {printable(str(exc))} "
                   "(set GEMINI_DEBUG=1 for the traceback)", err=True)
        sys.exit(INTERNAL_EXIT)
