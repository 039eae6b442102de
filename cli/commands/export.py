"""`aiflame export`: a saved capture in any format of the exporter registry."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from aiflame.cli.commands import warn
from aiflame.cli.output import check_output, is_stdout, write_output
from aiflame.cli.stack_view import add_view_options, capture_files, load_job, load_view
from aiflame.core.errors import UsageError
from aiflame.exporters import REGISTRY, get_exporter, parse_option_values

NAME = "export"
HELP = "re-export a saved capture in another format"
DESCRIPTION = ""
EXAMPLES = ""
__all__ = ["DESCRIPTION", "EXAMPLES", "HELP", "NAME", "add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("capture", type=Path, nargs="+",
                   help="a .aiflame capture file; several (or a directory of them), one per host of a job: joined "
                        "into one job on one clock (chakra, perfetto, folded...)")
    p.add_argument("-f", "--format", required=True, help=f"one of: {', '.join(REGISTRY)}")
    p.add_argument("-o", "--output", type=Path,
                   help="output file (default: capture name + extension; its directory is made if missing); "
                        "- for stdout (text formats: folded, svg, speedscope, perfetto-json, comm-svg); "
                        "for chakra a prefix: PREFIX.<rank>.et")
    p.add_argument("--obfuscate", action="store_true",
                   help="replace function, kernel, file and process names with stable keyed hashes (for sharing)")
    p.add_argument("--key-file", type=Path, metavar="PATH",
                   help="obfuscation key, made (0600) if absent; it stays on this host "
                        "(default ~/.config/aiflame/obfuscate.key)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="exporter option, repeatable (e.g. --opt minwidth=0.5)")
    add_view_options(p)


def run(args: argparse.Namespace) -> int:
    cls = REGISTRY.get(args.format)
    if cls is None:
        raise UsageError(f"unknown format {args.format!r} (known: {', '.join(REGISTRY)})")
    if cls.whole_capture and args.view != "cpu":
        raise UsageError(f"format {cls.name} takes the whole capture (no --view)")
    check_output(cls, args.output)
    exporter = get_exporter(cls.name, **parse_option_values(cls, args.opt))
    captures = capture_files(args.capture)
    prof = load_job(captures, lambda path: load_view(path, args))
    if args.obfuscate:
        from aiflame.exporters.obfuscate import Obfuscator, default_key_path, load_key

        prof = Obfuscator(load_key(args.key_file or default_key_path())).profile(prof)
    written = write_output(exporter, prof, args.output or cls.output_path(captures[0].with_suffix("")))
    for w in exporter.warnings:
        warn(w)
    console = Console(stderr=is_stdout(args.output))  # stdout holds the export
    for out in written:
        console.print(f"wrote {out.path} ({out.summary})", highlight=False)
    return 0
