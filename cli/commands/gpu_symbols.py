"""`aiflame gpu-symbols`: list the GPU kernels of a binary, or show the SASS and source line at a kernel offset.
The work is in symbolize/accel/gpu_symbols.py."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from aiflame.core.errors import BadInput, NothingToShow, UsageError

if TYPE_CHECKING:
    from aiflame.symbolize.accel.gpu_symbols import Instruction, Inventory

NAME = "gpu-symbols"
HELP = "list GPU kernels of a binary, or show SASS and file:line at a kernel offset"
DESCRIPTION = ("GPU kernels in a host binary (its .nv_fatbin), a fatbin or a cubin, per architecture; with "
               "--kernel and --offset, the instruction (when nvdisasm is installed) and its source line.")
EXAMPLES = """examples:
  aiflame gpu-symbols ./train                          kernels per GPU architecture, with sizes
  aiflame gpu-symbols libnccl.so.2 | grep AllReduce    find a kernel's exact name
  aiflame gpu-symbols ./train --kernel scale --offset 0x40
                                                       SASS instruction and file:line at scale+0x40
  aiflame gpu-symbols k.cubin --kernel _Z5scalePffi --offset 0x1f0 --arch sm_90
"""
__all__ = ["DESCRIPTION", "EXAMPLES", "HELP", "NAME", "add_arguments", "run"]


def _offset(text: str) -> int:
    try:
        v = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an offset: {text!r} (e.g. 0x40)") from None
    if v < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return v


def _arch(text: str) -> int:
    from aiflame.symbolize.accel.gpu_symbols import parse_arch

    try:
        return parse_arch(text)
    except BadInput as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("binary", metavar="BINARY", help="host ELF with CUDA device code, a .fatbin or a .cubin file")
    q = p.add_argument_group("look up one instruction")
    q.add_argument("--kernel", metavar="NAME", help="kernel name: mangled, demangled, or a unique part of it")
    q.add_argument("--offset", type=_offset, metavar="0xNN", help="byte offset in the kernel (multiple of 16)")
    q.add_argument("--arch", type=_arch, metavar="sm_NN", help="only this architecture (default: every one)")
    q.add_argument("--no-sass", action="store_true", help="don't run nvdisasm for the instruction text")


def run(args: argparse.Namespace) -> int:
    from aiflame.symbolize.accel.gpu_symbols import inventory, lookup_instruction

    if (args.kernel is None) != (args.offset is None):
        raise UsageError("--kernel and --offset go together")
    console = Console(highlight=False, soft_wrap=True)
    if args.kernel is None:
        _print_inventory(console, inventory(args.binary), args.arch)
    else:
        found = lookup_instruction(args.binary, args.kernel, args.offset, arch=args.arch, sass=not args.no_sass)
        _print_instructions(console, found)
    return 0


def _print_inventory(console: Console, inv: Inventory, arch: int | None) -> None:

    cubins = [c for c in inv.cubins if arch is None or c.arch == arch]
    if arch is not None and not cubins:
        present = ", ".join(f"sm_{a}" for a in inv.archs) or "none"
        raise NothingToShow(f"{inv.path}: no code for sm_{arch}; present: {present}")
    what = {"elf": "host binary", "fatbin": "fatbin", "cubin": "cubin", "capture": "aiflame capture"}[inv.container]
    parts = [f"{len(inv.cubins)} cubin(s) with code"]
    if inv.ptx_archs:
        parts.append("PTX for " + ", ".join(f"compute_{a}" for a in inv.ptx_archs))
    if inv.skipped:
        parts.append(f"{inv.skipped} without kernels skipped")
    console.print(f"{escape(inv.path)}: {what}, {'; '.join(parts)}")
    for c in cubins:
        lines = "with line info" if c.has_lines else "no line info (build with -lineinfo)"
        console.print(f"\nsm_{c.arch}  cubin {c.digest[:12]}  {c.size} bytes  {len(c.kernels)} functions  {lines}")
        console.print(f"  {'SIZE':>8}  {'LINES':5}  {'KIND':6}  NAME")
        for k in c.kernels:
            kind = "kernel" if k.entry else "device"
            console.print(f"  {k.size:#8x}  {'yes' if k.has_lines else 'no':5}  {kind:6}  {escape(k.demangled)}")
    for note in inv.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")


def _print_instructions(console: Console, found: list[Instruction]) -> None:
    for i in found:
        console.print(f"sm_{i.arch}  {escape(i.demangled)} +{i.offset:#x}  (kernel size {i.kernel_size:#x})")
        source = f"{i.file}:{i.line}" if i.file else "no line info (build with -lineinfo)"
        console.print(f"  source  {escape(source)}")
        if i.sass is not None:
            console.print(f"  sass    {escape(i.sass)}")
        elif i.sass_note:
            console.print(f"  sass    [dim]{escape(i.sass_note)}[/]")
