"""`aiflame chakra check PREFIX|FILE...`: Chakra `.et` files against the input rules of ASTRA-sim's analytical
backend (exporters/chakra_check.py), one line per broken rule naming the node ids; exit 1 when one is an error."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from aiflame.exporters.chakra_check import Problem, check, errors, expand
from aiflame.exporters.chakra_nodes import ChakraError

NAME = "chakra"
HELP = "Chakra execution traces: check them against ASTRA-sim's input rules"
DESCRIPTION = ""
EXAMPLES = """examples:
  aiflame chakra check traces/job             the rules on traces/job.<rank>.et, one line per broken rule
"""
__all__ = ["DESCRIPTION", "EXAMPLES", "HELP", "NAME", "add_arguments", "print_problems", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    kinds = p.add_subparsers(dest="chakra", metavar="ACTION", required=True)
    c = kinds.add_parser("check", help="the simulator's input rules on .et files: one line per broken rule")
    c.add_argument("paths", nargs="+", metavar="PREFIX|FILE",
                   help="a prefix (its PREFIX.<rank>.et files) or .et files of one job")
    c.add_argument("--world", type=int, help="ranks of the job (the network's NPU count; default: from the files)")
    c.add_argument("--comm-groups", type=Path, metavar="JSON",
                   help="the simulator's --comm-group-configuration, whose group ids pg_name may name")
    c.add_argument("--splits", type=int, default=4,
                   help="preferred-dataset-splits of the system configuration (4)")
    c.add_argument("--roofline", action="store_true", help="also the rules of roofline mode (num_ops, tensor_size)")


def print_problems(problems: Sequence[Problem]) -> int:
    """One line per problem on stderr; a ChakraError (exit 1, printed once by cli.main) when one is an error."""
    err = Console(stderr=True)
    for p in problems:
        colour = "red" if p.severity == "error" else "yellow"
        err.print(f"[{colour}]{escape(str(p))}[/]", highlight=False, soft_wrap=True)
    bad = errors(problems)
    if bad:
        raise ChakraError(f"{len(bad)} of ASTRA-sim's input rules broken: the simulator would not run these "
                          "traces to the end")
    return 0


def run(args: argparse.Namespace) -> int:
    groups: list[int] = []
    if args.comm_groups is not None:
        try:
            groups = [int(k) for k in json.loads(args.comm_groups.read_text())]
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise ChakraError(f"{args.comm_groups}: not a comm-group configuration ({e})") from None
    files = expand(args.paths)
    problems = check(files, world=args.world, comm_groups=groups, splits=args.splits, roofline=args.roofline)
    code = print_problems(problems)
    if not problems:
        Console().print(f"{len(files)} file(s): every rule of ASTRA-sim's input holds", highlight=False)
    return code
