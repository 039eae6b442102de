"""`aiflame annotate`: a function's disassembly with the samples of a capture on each instruction.

Only wiring and text: the work is in symbolize/annotate/. NAME, HELP, DESCRIPTION, EXAMPLES, `add_arguments` and `run`
are the shape of a command module (cli/commands). Colours only on a terminal.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from aiflame.cli import argtypes
from aiflame.symbolize.annotate import KINDS, Annotation, Instruction

if TYPE_CHECKING:
    from aiflame.symbolize.annotate.python import PythonAnnotation

__all__ = ["DESCRIPTION", "EXAMPLES", "HELP", "NAME", "add_arguments", "run"]

NAME = "annotate"
HELP = "a function's instructions or lines with their samples (x86-64 code, a GPU kernel's SASS, Python source)"
DESCRIPTION = ("Disassemble one function of a capture's binaries (x86-64), or a GPU kernel's SASS, and show\n"
               "the samples on each instruction (leaf frames only, as perf annotate counts them), its share of the\n"
               "function, its source line and, for a kernel, its stall reasons; the hottest instructions are marked.\n"
               "For a Python function, its source lines: the samples with the function on the stack at each line\n"
               "(total) and those with it the innermost Python frame (self), from the Python frames the capture holds.")

EXAMPLES = """examples:
  aiflame annotate out/profile.aiflame hot_loop              every instruction, source lines interleaved
  aiflame annotate out/profile.aiflame hot_loop -s samples   the sampled instructions, hottest first
  aiflame annotate out/profile.aiflame 'ns::Engine::run' --dso libengine.so
  aiflame annotate out/profile.aiflame prog+0x1190           code without symbols, by file offset
  aiflame annotate out/profile.aiflame prog+0x1180-0x11f0    a range of file offsets
  aiflame annotate out/profile.aiflame scale --kind gpu      a GPU kernel's SASS with its stall reasons
  aiflame annotate out/profile.aiflame train_step            a Python function, line by line
  aiflame annotate out/profile.aiflame Model.forward -s samples   its sampled lines, hottest first
"""

_REASONS_SHOWN = 3
_INDENT = 33  # where the instruction column starts (mark, percent, samples, address)
_LINES_SHOWN = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `annotate`."""
    p.add_argument("capture", help="a .aiflame capture file")
    p.add_argument("symbol", metavar="SYMBOL",
                   help="function or GPU kernel: mangled, demangled, short name or a unique part of it; a Python "
                        "function's qualified name (Model.forward), its last part, or FILE.py:QUALNAME; "
                        "or DSO+0xOFFSET / DSO+0xSTART-0xEND (file offsets) for code without symbols")
    p.add_argument("-s", "--sort", choices=("address", "samples"), default="address",
                   help="address: every instruction in order, source lines interleaved (default); samples: the "
                        "sampled instructions only, hottest first")
    p.add_argument("--hot", type=argtypes.int_range(0, 1000), default=5, metavar="N",
                   help="mark the N hottest instructions (default 5)")
    p.add_argument("--dso", metavar="BINARY", help="look only in this binary (path, file name, or its start: libc)")
    p.add_argument("--kind", choices=KINDS, default="auto",
                   help="native code, a GPU kernel or a Python function (default: whichever the name designates; "
                        "a Python function named exactly comes before native code)")
    p.add_argument("--debug-dir", action="append", default=[], metavar="DIR",
                   help="extra directory of separate debug files (DIR/.build-id/xx/yyyy.debug); repeatable")
    p.add_argument("--no-source", action="store_true", help="don't read source files for their text")
    p.add_argument("--no-sass", action="store_true", help="don't run nvdisasm for a kernel's SASS text")


def run(args: argparse.Namespace) -> int:
    """Execute the parsed `annotate` command; its errors (BadInput and its kinds) reach main as one line."""
    from aiflame.symbolize.annotate import annotate_any
    from aiflame.symbolize.road import read

    cap, _warnings = read(args.capture)  # `profile` told them
    ann = annotate_any(cap, args.symbol, kind=args.kind, dso=args.dso, hot=args.hot,
                   debug_dirs=(*args.debug_dir, "/usr/lib/debug"), sass=not args.no_sass, source=not args.no_source)
    console = Console(highlight=False, soft_wrap=True)
    if isinstance(ann, Annotation):
        render(console, ann, by_samples=args.sort == "samples")
    else:
        render_python(console, ann, by_samples=args.sort == "samples")
    return 0


def render_python(console: Console, ann: PythonAnnotation, *, by_samples: bool = False) -> None:
    """Print a Python function's lines: total (on the stack) and self (innermost Python frame) samples per line,
    the share of the function's total, the source text; the hottest lines marked."""
    console.print(f"[bold]{escape(ann.qualname)}[/]  {escape(ann.file)}:{ann.firstlineno} (Python)")
    share = f"{100 * ann.samples / ann.total:.1f}% of the capture's {ann.total}" if ann.total else "all"
    k = sum(1 for ln in ann.lines if ln.hot)
    marked = f"; the {k} hottest lines marked >1..>{k}" if k > 1 else "; the hottest marked >1" if k else ""
    console.print(f"{_count(ann.samples, 'samples')} with it on the stack ({share}), {ann.self_samples} with it "
                  f"the innermost Python frame{marked}")
    console.print()
    console.print(f"[bold]{'':3} {'percent':>7} {'total':>8} {'self':>8}  {'line':>6}  source[/]")
    rows = ann.hottest() if by_samples else list(ann.lines)
    for ln in rows:
        text = "" if ln.text is None else ln.text
        row = (f"{f'>{ln.hot}' if ln.hot else '':3} {f'{ln.percent:.2f}' if ln.total else '':>7} "
               f"{ln.total or '':>8} {ln.self_ or '':>8}  {ln.line:>6}  {text}")
        style = "bold red" if ln.hot else "yellow" if ln.percent >= 0.5 else "" if ln.total else "dim"
        line = escape(row.rstrip())
        console.print(f"[{style}]{line}[/]" if style else line)
    for note in ann.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")


def render(console: Console, ann: Annotation, *, by_samples: bool = False) -> None:
    """Print `ann`: a header, the instructions (address order with source interleaved, or hottest first), the
    hottest source lines and the notes."""
    _header(console, ann)
    rows = ann.hottest() if by_samples else list(ann.instructions)
    gpu = ann.kind == "gpu"
    width = max((len(_text(i, gpu)) for i in rows), default=11)
    src_width = max((len(_where(i)) for i in rows), default=0) if by_samples else 0
    head = f"{'':3} {'percent':>7} {'samples':>8}  {'offset' if gpu else 'address':<10} {'instruction':<{width}}"
    if src_width:
        head += f"  {'source':<{src_width}}"
    console.print(f"[bold]{escape(head.rstrip() + ('  stall reasons' if gpu else ''))}[/]")
    last: tuple[str, int] | None = None
    for i in rows:
        if not by_samples and i.file and (i.file, i.line) != last:
            last = (i.file, i.line)
            text = ann.source.get(last, "")
            tail = f"  [dim]{escape(text)}[/]" if text else ""
            console.print(f"[cyan]{'':{_INDENT}}{escape(_where(i))}[/]{tail}")
        line = (f"{_mark(i):3} {_pct(i):>7} {i.samples or '':>8}  {_addr(i, gpu):<10} "
                f"{_text(i, gpu):<{width}}")
        if src_width:
            line += f"  {_where(i):<{src_width}}"
        if gpu and i.reasons:
            line += "  " + _reasons(i.reasons, i.samples)
        console.print(_style(i, escape(line.rstrip())))
    lines = ann.lines()
    if lines and ann.samples:
        top = ", ".join(f"{os.path.basename(f)}:{n} {100 * c / ann.samples:.1f}%" for f, n, c in lines[:_LINES_SHOWN])
        console.print(f"\nhottest source lines: {escape(top)}")
    for note in ann.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")


def _header(console: Console, ann: Annotation) -> None:
    if ann.kind == "gpu":
        where = f"{ann.binary}, {ann.size} bytes" if ann.size else ann.binary
    else:
        bid = f", build id {ann.build_id[:12]}" if ann.build_id else ""
        where = f"{ann.binary}{bid}, {ann.arch} {ann.start:#x}-{ann.start + ann.size:#x} ({ann.size} bytes)"
    console.print(f"[bold]{escape(ann.display)}[/]  {escape(where)}")
    if ann.samples:
        share = f"{100 * ann.samples / ann.total:.1f}% of the capture's {ann.total}" if ann.total else "all"
        what = "on this kernel" if ann.kind == "gpu" else "in this code as the leaf frame"
        k = ann.hot_count()
        marked = f"; the {k} hottest marked >1..>{k}" if k > 1 else "; the hottest marked >1" if k else ""
        console.print(f"{_count(ann.samples, ann.unit)} {what} ({share}){marked}")
    else:
        console.print(f"no {ann.unit} in this code (the capture has {ann.total})")
    if ann.reasons:
        console.print("stall reasons: " + escape(_reasons(ann.reasons, ann.samples, n=6)))
    console.print()


def _count(n: int, unit: str) -> str:
    return f"{n} {unit.replace('samples', 'sample') if n == 1 else unit}"


def _text(i: Instruction, gpu: bool) -> str:
    if i.text is not None:
        return i.text
    return "" if gpu else "(undecodable)"


def _addr(i: Instruction, gpu: bool) -> str:
    return f"+{i.address:#06x}" if gpu else f"{i.address:#x}"


def _where(i: Instruction) -> str:
    return f"{os.path.basename(i.file)}:{i.line}" if i.file else ""


def _mark(i: Instruction) -> str:
    return f">{i.hot}" if i.hot else ""


def _pct(i: Instruction) -> str:
    return f"{i.percent:.2f}" if i.samples else ""


def _reasons(reasons: tuple[tuple[str, int], ...], total: int, n: int = _REASONS_SHOWN) -> str:
    shown = [f"{r} {100 * c / total:.0f}%" if total else f"{r} {c}" for r, c in reasons[:n]]
    return ", ".join(shown) + (f", +{len(reasons) - n} more" if len(reasons) > n else "")


def _style(i: Instruction, text: str) -> str:
    if i.hot:
        return f"[bold red]{text}[/]"
    if i.percent >= 0.5:
        return f"[yellow]{text}[/]"
    return text if i.samples else f"[dim]{text}[/]"
