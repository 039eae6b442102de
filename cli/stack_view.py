"""The stack view `profile`, `export` and `render` share: its options (`--group`, `--no-kernel`, `--python`,
`--native-interp`, `--debug-dir`, `--view`) and reading a capture (through symbolize/road.py), or a folded file,
as that view."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from aiflame.core.errors import Unreadable
from aiflame.symbolize.views import VIEWS

if TYPE_CHECKING:
    from aiflame.core.model import Profile
    from aiflame.symbolize.stacks import StackOptions


def add_view_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("stack view")
    g.add_argument("--group", choices=("process", "thread", "none"), default="process",
                   help="root frames: process name (default), process and thread, or none")
    g.add_argument("--no-kernel", action="store_true", help="leave kernel frames out")
    g.add_argument("--python", choices=("merged", "python", "native"), default="merged",
                   help="Python frames merged into native stacks (default), Python frames only, or native only")
    g.add_argument("--native-interp", action="store_true",
                   help="with merged Python frames, also show the interpreter's own native frames (its entry, "
                        "evaluator and call machinery); by default they fold into the Python frames")
    g.add_argument("--debug-dir", action="append", default=[], metavar="DIR",
                   help="extra directory of separate debug files (DIR/.build-id/xx/yyyy.debug); repeatable")
    g.add_argument("--view", choices=VIEWS, default="cpu",
                   help="cpu: CPU samples (default); launches: accelerator kernel launches, "
                        "<CPU stack> ; - ; <kernel>, weighted by launch count; stalls: accelerator stall samples "
                        "on their launch stacks (the AI flame graph); combined: CPU and stall samples together; "
                        "offcpu: where threads blocked, in ns (captures made with profile --off-cpu); wall: CPU and "
                        "blocked time in one graph, in ns (each CPU sample weighs one sampling period)")


def stack_options(args: argparse.Namespace) -> StackOptions:
    """The StackOptions of parsed view options."""
    from aiflame.symbolize.stacks import StackOptions

    return StackOptions(group=args.group, kernel=not args.no_kernel, python=args.python,
                        native_interp=args.native_interp)


def load_view(path: Path, args: argparse.Namespace, folded: bool = False) -> Profile:
    """`path` as the view the parsed options ask for (see `load_profile`)."""
    return load_profile(path, stack_options(args), args.view, args.debug_dir, folded)


def load_profile(path: Path, options: StackOptions | None = None, view: str = "cpu",
                 debug_dirs: Sequence[str] = (), folded: bool = False) -> Profile:
    """A capture symbolized as `view` (symbolize/views.py); with `folded`, a folded-stacks file is read too.
    Raises Unreadable, or the view's error when the capture has nothing for it."""
    from aiflame.core.capture import is_capture
    from aiflame.exporters.folded import parse_folded
    from aiflame.symbolize.road import open_capture, symbolizer

    if is_capture(path) or not folded:
        return open_capture(path, options, symbolizer(debug_dirs)).view(view)
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise Unreadable(f"{path}: neither an aiflame capture nor a folded-stacks file") from None
    return parse_folded(text)


def capture_files(paths: Sequence[Path]) -> list[Path]:
    """The captures named: files as given, a directory as the .aiflame files under it (sorted)."""
    from aiflame.core.errors import UsageError

    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(p.rglob("*.aiflame"))
            if not found:
                raise UsageError(f"{p}: no .aiflame captures in this directory")
            out += found
        else:
            out.append(p)
    return out


def load_job(captures: Sequence[Path], load: Callable[[Path], Profile]) -> Profile:
    """One capture loaded, or several (one per host of a job) joined on the first one's clock; how each host's
    clock moved, and the ranks missing, go to stderr."""
    if len(captures) == 1:
        return load(captures[0])
    from aiflame.cli.commands import warn
    from aiflame.exporters.job_join import join

    done = join([str(c) for c in captures], [load(c) for c in captures])
    for c in done.clocks[1:]:
        warn(f"{c.name}: clock {c.clock_ns / 1e6:+.3f} ms from the hosts' realtime clocks, then "
             f"{c.residual_ns / 1e3:+.1f} µs from {c.matched} collectives")
    for note in done.notes:
        warn(note)
    return done.profile
