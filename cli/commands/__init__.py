"""The `aiflame` subcommands, one module each, all of one shape (`Command`). `aiflame.cli.main.COMMANDS` lists
them; a new command is its module plus one entry there.

A command only wires parts together: it declares its arguments, runs the work that lives in the layers below, and
prints the result. It reports a failure by raising an `AiflameError` of the right kind (a misuse the parser could
not see: `UsageError`; core/errors.py has them all); `aiflame.cli.main` prints it as one line and exits with the
kind's status. Imports that cost start-up time stay inside `run`, so `aiflame status` does not load the symbolizer.
"""

from __future__ import annotations

import argparse
from typing import Protocol

from rich.console import Console
from rich.markup import escape

__all__ = ["EXAMPLES", "Command", "warn"]

# The examples of `aiflame --help` (and of `aiflame profile --help`, where a newcomer starts).
EXAMPLES = """examples:
  aiflame profile --pid 1234 -d 30            profile a running process for 30 s
  aiflame profile -F 999 -- ./train.sh --fast start a command and profile it until it exits
  aiflame profile --off-cpu --pid 1234 -d 30  also where its threads block: offcpu.svg, wall.svg (on + off CPU)
  aiflame export out/profile.aiflame --view wall -f folded -o wall.folded
  aiflame export out/profile.aiflame --format speedscope -o prof.json
  aiflame export out/profile.aiflame --format chakra -o traces/job   one traces/job.<rank>.et per rank
  aiflame report comm out/profile.aiflame     collectives per rank, imbalance flagged, plot
  aiflame report sim out/profile.aiflame sim.log   ASTRA-sim's replay of the Chakra traces beside the capture
  aiflame chakra check traces/job             the simulator's input rules on traces/job.<rank>.et
  aiflame render out/profile.folded -o flame.svg --opt title="my job"
  aiflame doctor                              what this host supports
  aiflame dump --pid 1234                     every thread's stack now (Python merged), state, GIL holder
  aiflame profile -a -d 10                    the whole host, every process
"""


class Command(Protocol):
    """One subcommand: a module with these names."""

    NAME: str  # as typed: "gpu-symbols"
    HELP: str  # its line in `aiflame --help`
    DESCRIPTION: str  # the paragraph at the top of `aiflame NAME --help` ("" for none)
    EXAMPLES: str  # the epilog of `aiflame NAME --help`, "examples:\n  ..." ("" for none)

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        """Declare the command's arguments on its own parser."""

    def run(self, args: argparse.Namespace) -> int:
        """Do it; the exit status (0), or raise an AiflameError. `args.argv` is the whole command line."""


def warn(message: str) -> None:
    """One warning line on stderr: the result is written, but something in it is not as asked."""
    Console(stderr=True).print(f"[yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)
