"""`aiflame import`: merge accelerator stall records saved elsewhere into a capture
(symbolize/vendor/stall_import.py), so a GPU host's samples are joined offline with the launch stacks the capture
holds. (`import_`: `import` is a Python keyword.)"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from aiflame.cli.commands import warn
from aiflame.core.errors import UsageError
from aiflame.symbolize.vendor.stall_import import FORMATS, LAYOUTS

NAME = "import"
HELP = ("merge accelerator stall records (Xe EU stall, rocprofiler PC sampling, a CUPTI stream, another capture) "
        "into a capture")
DESCRIPTION = """\
Add stall samples recorded elsewhere to a capture; `aiflame export --view stalls` then attributes them to the
capture's launch stacks. The inputs are left as they are: the merged capture is a new file named after CAPTURE
(out/profile.aiflame -> out/profile.merged.aiflame), or -o PATH; --in-place replaces CAPTURE instead. Each records
file is checked for being of its --format: one of another kind (an ELF binary, text, a capture given as a stream,
bytes that are not whole records) is refused, one of the right kind without samples is imported with a warning."""
EXAMPLES = """examples:
  aiflame import out/profile.aiflame gpu0.eustall --format xe --platform xe2 --pid 4242  -> profile.merged.aiflame
  aiflame import out/profile.aiflame pc.bin --format rocprof --code-object 1=kernels.hsaco -o merged.aiflame
  aiflame import out/profile.aiflame cupti-4242.stream --format cupti --in-place
  aiflame import out/profile.aiflame gpuhost/profile.aiflame --format capture
"""
__all__ = ["DESCRIPTION", "EXAMPLES", "HELP", "NAME", "add_arguments", "run"]


def _code_object(text: str) -> tuple[int, Path]:
    ident, sep, path = text.partition("=")
    try:
        value = int(ident, 0)
    except ValueError:
        value = -1
    if not sep or value < 0 or not path:
        raise argparse.ArgumentTypeError(f"expected ID=PATH (e.g. 1=kernels.hsaco), got {text!r}")
    return value, Path(path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("capture", type=Path, help="the .aiflame capture to add to")
    p.add_argument("records", type=Path, nargs="+", help="files of vendor records (or captures)")
    p.add_argument("-f", "--format", choices=FORMATS, required=True,
                   help="xe: raw EU stall records; rocprof: rocprofiler-sdk PC-sampling records; "
                        "cupti: a stream of aiflame's CUPTI injection library (PC samples and cubins); "
                        "capture: the stall samples and GPU code of another aiflame capture")
    out = p.add_mutually_exclusive_group()
    out.add_argument("-o", "--output", type=Path,
                     help="write the merged capture here (default: CAPTURE's name with .merged.aiflame, beside it); "
                          "never one of the inputs")
    out.add_argument("--in-place", action="store_true", help="replace CAPTURE with the merged capture")
    p.add_argument("--platform", choices=sorted(LAYOUTS), help="Xe record layout (xe format)")
    p.add_argument("--record-size", type=int, default=64, help="Xe record size in bytes (default 64)")
    p.add_argument("--pid", type=int, default=0, help="the process the samples belong to (default: unknown)")
    p.add_argument("--device", type=int, default=-1, help="device ordinal of the samples")
    p.add_argument("--code-object", type=_code_object, action="append", default=[], metavar="ID=PATH",
                   help="rocprof: the code object (ELF) loaded with this id; repeatable")


def merged_path(capture: Path) -> Path:
    """Where the merged capture goes by default: beside CAPTURE, `profile.aiflame` -> `profile.merged.aiflame`."""
    stem = capture.name.removesuffix(".aiflame")
    return capture.with_name(f"{stem}.merged.aiflame")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:  # one does not exist (yet)
        return a.resolve() == b.resolve()


def _output(args: argparse.Namespace) -> Path:
    """The file to write: never an input, unless --in-place names CAPTURE as the one to replace."""
    if args.in_place:
        return Path(args.capture)
    out = args.output or merged_path(args.capture)
    inputs = [args.capture, *args.records, *(p for _, p in args.code_object)]
    for i, given in enumerate(inputs):
        if _same_file(out, given):
            hint = ", or --in-place to replace CAPTURE" if i == 0 else ""
            raise UsageError(f"the output {out} is the input {given}: give another -o PATH{hint}")
    return out


def run(args: argparse.Namespace) -> int:
    from aiflame.symbolize.vendor.stall_import import import_records

    out = _output(args)
    res = import_records(args.capture, args.records, args.format, output=out, platform=args.platform,
                         record_size=args.record_size, pid=args.pid, device=args.device,
                         code_objects=args.code_object)
    console = Console(highlight=False, soft_wrap=True)
    for note in res.notes:
        warn(f"no samples: {note}")
    drops = "  ".join(f"{k} {v}" for k, v in sorted(res.counters.items()))
    console.print(f"imported {res.stall_samples} stall samples ({res.samples} records after merging"
                  f"{f', {res.gpu_code} code objects' if res.gpu_code else ''}) into {escape(str(out))}")
    if drops:
        console.print(f"counters: {escape(drops)}")
    return 0
