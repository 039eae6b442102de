"""`aiflame recover`: a capture whose writer was killed (no footer, a last record cut off) made complete again."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from aiflame.core.errors import UsageError

NAME = "recover"
HELP = "make a capture cut short (its profiler killed) readable again"
DESCRIPTION = ("Reads a capture up to its last whole record and writes it as a complete capture, with a footer "
               "whose stop reason is \"recovered\"; every other command then reads it. A killed `aiflame profile` "
               "leaves its capture as PROFILE.aiflame.partial in its output directory.")
EXAMPLES = """examples:
  aiflame recover out/profile.aiflame.partial        writes out/profile.aiflame
  aiflame recover out/profile.aiflame.partial -o saved.aiflame
  aiflame export out/profile.aiflame --format svg"""
__all__ = ["DESCRIPTION", "EXAMPLES", "HELP", "NAME", "add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("capture", type=Path, help="the capture cut short (e.g. profile.aiflame.partial)")
    p.add_argument("-o", "--output", type=Path,
                   help="where to write the complete capture (default: the name without .partial, or NAME.recovered"
                        ".aiflame)")


def run(args: argparse.Namespace) -> int:
    from aiflame.core.capture import recover_capture

    src: Path = args.capture
    out: Path = args.output or (src.with_name(src.name.removesuffix(".partial")) if src.name.endswith(".partial")
                                else src.with_name(src.stem + ".recovered.aiflame"))
    if out.resolve() == src.resolve():
        raise UsageError(f"the output would overwrite {src}: give -o")
    cap = recover_capture(src, out)
    note = "complete already" if cap.footer is None or cap.footer.stop_reason != "recovered" else "recovered"
    Console().print(f"wrote {out} ({len(cap.samples)} samples, {len(cap.events)} events, "
                    f"{len(cap.processes)} process snapshots; {note})", highlight=False)
    return 0
