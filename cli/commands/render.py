"""`aiflame render`: a flame graph SVG from a capture or a folded file, or a differential one from two."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from aiflame.cli.output import check_output, is_stdout, write_output
from aiflame.cli.stack_view import add_view_options, load_view
from aiflame.core.errors import UsageError
from aiflame.exporters import REGISTRY, parse_option_values
from aiflame.exporters.svg import SvgExporter

NAME = "render"
HELP = "flame graph SVG from a capture or a folded file"
DESCRIPTION = ""
EXAMPLES = ""
__all__ = ["DESCRIPTION", "EXAMPLES", "HELP", "NAME", "add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", type=Path, nargs="?", help="a .aiflame capture or a folded-stacks file")
    p.add_argument("-o", "--output", type=Path, required=True,
                   help="SVG file to write (its directory is made if missing), or - for stdout")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="SVG option, repeatable")
    p.add_argument("--diff", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                   help="differential flame graph: AFTER's widths, coloured red where it grew and blue where it "
                        "shrank against BEFORE (captures or folded files; totals normalized, see --opt normalize)")
    add_view_options(p)


def run(args: argparse.Namespace) -> int:
    if (args.input is None) == (args.diff is None):
        raise UsageError("give one input, or --diff BEFORE AFTER")
    check_output(SvgExporter, args.output)
    exporter = SvgExporter(**parse_option_values(REGISTRY["svg"], args.opt))  # type: ignore[arg-type]
    if args.diff:
        exporter.baseline = load_view(args.diff[0], args, folded=True)
        prof = load_view(args.diff[1], args, folded=True)
    else:
        prof = load_view(args.input, args, folded=True)
    write_output(exporter, prof, args.output)
    if not is_stdout(args.output):
        Console().print(f"wrote {args.output}", highlight=False)
    return 0
