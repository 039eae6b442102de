"""The `aiflame` command: `COMMANDS` is the one table of its subcommands (cli/commands/, one module each), and
`main(argv)`, callable from tests, parses, dispatches and is the one place an error becomes a line on stderr and
an exit status (README, "Exit status")."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from rich.console import Console
from rich.markup import escape

from aiflame import __version__
from aiflame.cli.commands import (
    EXAMPLES,
    Command,
    agent,
    annotate,
    chakra,
    doctor,
    dump,
    export,
    gpu_symbols,
    import_,
    profile,
    recover,
    render,
    report,
    status,
    top,
    trigger,
)
from aiflame.core.errors import AiflameError, UsageError

# In the order `aiflame --help` lists them.
COMMANDS: tuple[Command, ...] = (profile, export, render, report, chakra, annotate, import_, gpu_symbols,
                                 recover, doctor, agent, trigger, status, top,
                                 dump)

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


class _Parser(argparse.ArgumentParser):
    """argparse, except that a usage error is raised as a UsageError (one line, printed by `main`) rather than
    printed with the usage; the subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="aiflame", description="Low-overhead eBPF profiler for AI hosts: CPU stacks and flame graphs.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"aiflame {__version__}")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.NAME, help=cmd.HELP, description=cmd.DESCRIPTION or None,
                           epilog=cmd.EXAMPLES or None, formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd.add_arguments(p)
    return parser


def error(message: str, exit_code: int) -> int:
    """Print `aiflame: error: <message>` as one line on stderr; returns `exit_code`."""
    Console(stderr=True).print(f"[bold red]aiflame: error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command line (without the program name); its exit status. A usage error argparse finds is one
    line, `aiflame: error: <what> (see 'aiflame CMD --help')`, exit status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        return error(str(e), e.exit_code)
    except SystemExit as e:  # --help and --version (0): already printed
        return e.code if isinstance(e.code, int) else UsageError.exit_code
    if args.cmd is None:
        parser.print_help()
        return UsageError.exit_code
    args.argv = argv  # the command line as given, for the capture's header
    command = next(c for c in COMMANDS if c.NAME == args.cmd)
    try:
        return command.run(args)
    except AiflameError as e:
        return error(str(e), e.exit_code)
    except KeyboardInterrupt:
        return error("interrupted", INTERRUPTED)
    except BrokenPipeError:
        return 1


if __name__ == "__main__":
    sys.exit(main())
