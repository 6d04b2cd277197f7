"""``gemini run``: torchrun's command line, plus gemini's flags."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import click

from launcher.config import gemini_flags


class _Parser(argparse.ArgumentParser):
    """torchrun's own argument parser, with gemini's flags added: it accepts exactly what
    torchrun accepts, unique prefixes of long flags included (``--nproc_per 2``)."""

    def __init__(self, torchrun: argparse.ArgumentParser) -> None:
        super().__init__(
            prog="gemini run", parents=[torchrun], add_help=False,
            usage="gemini run [TORCHRUN AND GEMINI FLAGS] SCRIPT|MODULE [ARGS]...",
            description="Launch SCRIPT on every worker, exactly as torchrun would, under "
            "gemini's supervisor. Every torchrun flag works with the same meaning and "
            "default. Values come from, in order of precedence: the command line, "
            "GEMINI_<KEY> (or torchrun's PET_<KEY>) environment variables, the --config "
            "file, the defaults.")
        self._torchrun = frozenset(a.dest for a in torchrun._actions)

    def _get_option_tuples(self, option_string: str) -> list[Any]:
        """The flags a prefix could mean: torchrun's only, one per flag (both spellings of
        one flag are one match), so that what torchrun accepts means here what it means
        there. gemini's own flags are never abbreviated: ``--store-password pw`` is an
        unknown flag, not ``--store-password-file`` reading (and naming in its error) a
        file called like the password."""
        first: dict[Any, Any] = {}
        for match in super()._get_option_tuples(option_string):
            if match[0].dest in self._torchrun:
                first.setdefault(match[0], match)
        return list(first.values())

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):  # name the flags, not their values (a password?)
            message = prefix + " ".join(arg.split("=", 1)[0] + ("=..." if "=" in arg else "")
                                        for arg in message[len(prefix):].split())
        raise click.UsageError(message, ctx=click.get_current_context(silent=True))


def _parser() -> _Parser:
    from torch.distributed.run import get_args_parser

    torchrun = get_args_parser()
    for action in torchrun._actions:
        if action.option_strings and action.dest != "help":
            if action.help and action.default not in (None, False, "", []):
                action.help = f"{action.help}  [default: {action.default}]"
            action.default = argparse.SUPPRESS  # only what the command line gave
            action.type = None  # converted once, with the environment's and the file's
        elif action.dest == "training_script":
            action.metavar = "SCRIPT|MODULE"
        elif action.dest == "training_script_args":
            action.metavar = "[ARGS]..."
    parser = _Parser(torchrun)
    group = parser.add_argument_group("gemini")
    group.add_argument("--config", dest="config_file", default=argparse.SUPPRESS,
                       metavar="FILE", help="gemini.yaml with defaults for any flag (see "
                       "`gemini template config`).")
    for flag in gemini_flags():  # RunConfig's fields: their docstrings are the help
        if flag.metavar:
            group.add_argument(*flag.names, dest=flag.key, help=flag.help,
                               metavar=flag.metavar, default=argparse.SUPPRESS)
        else:
            group.add_argument(*flag.names, dest=flag.key, help=flag.help,
                               action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS)
    return parser


@click.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    add_help_option=False,
    short_help="Launch training like torchrun, with in-memory checkpoints.",
)
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
def run_command(argv: tuple[str, ...]) -> int:
    """Launch SCRIPT on every worker, exactly as torchrun would (see gemini run --help)."""
    from launcher import config as cfg
    from launcher.agent import Command, launch

    # The supervisor's c10d stores log a C++ warning with a backtrace for every call to
    # a store that closed (a peer that finished first), where torchrun logs nothing; the
    # level is read as torch loads, so set it for this process only, not its workers.
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ and "torch" not in sys.modules
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        parser = _parser()
    finally:
        if quiet:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
    try:
        given = vars(parser.parse_args(argv))
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    script, script_args = given.pop("training_script"), given.pop("training_script_args")
    config_file = given.pop("config_file", None)
    flags = {a.dest: _flag(a.option_strings) for a in parser._actions if a.option_strings}
    cli_values = {
        key: value if isinstance(value, bool) else cfg.convert_value(key, value, flags[key])
        for key, value in given.items()
    }
    file_path = config_file or os.environ.get("GEMINI_CONFIG")
    file_values = cfg.read_config_file(file_path) if file_path else {}
    run_config = cfg.resolve(cli=cli_values, environ=os.environ, file_values=file_values)
    launch(run_config, Command(script=script, args=tuple(script_args)))
    return 0


def _flag(names: Sequence[str]) -> str:
    """The flag as an error names it: its first long spelling."""
    return next((n for n in names if n.startswith("--")), names[0])
