"""The road from a capture file to what is made of it, one module per step:

    read        core/capture.py       read_capture: the file → core.raw.Capture
                symbolize/vendor/cupti_stream.py   stream_stalls: the CUPTI streams it stores → stall samples
    symbolize   symbolize/stacks.py   symbolize_capture: addresses → names, the CPU profile (core.model.Profile)
    views       symbolize/views.py    the cpu, launches, stalls, combined, offcpu and wall views
    write       exporters/write.py    views × formats → files (`write_views`)

`open_capture` takes the first two steps and hands back a `SymbolizedCapture`, whose `view` and `views` take the
third; exporters/write.py takes the last, so a sample goes core → symbolize → exporters and never back. `profile`
and the daemon's windows write every view (`write_views`); `export`, `render`, `report` and `chakra calibrate`
take one view (their own destination: a file or stdout, cli/output.py); `top` the cpu view. The capture file is
where every caller enters: the agent streams it to disk while it collects."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aiflame.core.capture import read_capture
from aiflame.core.model import Profile
from aiflame.core.raw import Capture
from aiflame.symbolize.native import NativeSymbolizer
from aiflame.symbolize.objfmt.debugfiles import SYSTEM_DEBUG_DIRS
from aiflame.symbolize.stacks import StackOptions, symbolize_capture
from aiflame.symbolize.vendor.cupti_stream import stream_stalls
from aiflame.symbolize.views import View, capture_views, view

__all__ = ["SymbolizedCapture", "open_capture", "read", "symbolizer"]


@dataclass(frozen=True)
class SymbolizedCapture:
    """A capture read and symbolized: the raw capture and its CPU profile, from which every view is made."""

    path: Path
    capture: Capture  # its vendor streams converted into stall samples and code objects
    profile: Profile  # the cpu view
    warnings: tuple[str, ...] = ()  # one line each: what the vendor streams say went wrong while sampling

    def view(self, name: str, *, sass: bool = True) -> Profile:
        """The view `name` (symbolize/views.py `VIEWS`); an error of one line when the capture has nothing for it."""
        return view(self.capture, self.profile, name, sass=sass)

    def views(self, prefix: str = "profile") -> list[View]:
        """Every view the capture has anything for, the cpu view under the file-name stem `prefix`."""
        return capture_views(self.capture, self.profile, prefix)


def symbolizer(debug_dirs: Sequence[str] = ()) -> NativeSymbolizer:
    """The native symbolizer: separate debug files looked up in `debug_dirs`, then in the system's directory.
    Keep one for several captures (the daemon's windows, `top`'s updates): it caches what it has read."""
    return NativeSymbolizer(debug_dirs=[*debug_dirs, *SYSTEM_DEBUG_DIRS])


def open_capture(path: Path, options: StackOptions | None = None,
                 native: NativeSymbolizer | None = None) -> SymbolizedCapture:
    """Read the capture at `path` and symbolize it with `options` (default: StackOptions()) and `native` (default:
    `symbolizer()`); Unreadable when it cannot be read."""
    cap, warnings = read(path)
    prof = symbolize_capture(cap, native or symbolizer(), options=options or StackOptions())
    return SymbolizedCapture(path, cap, prof, tuple(warnings))


def read(path: Path) -> tuple[Capture, list[str]]:
    """The capture at `path` with the vendor streams it stores read and converted (stall samples, code objects,
    counters), and the one-line warnings they call for; Unreadable when it cannot be read."""
    cap = read_capture(path)
    if not cap.streams:
        return cap, []
    got = stream_stalls(cap.streams)
    return cap.converted(got.stalls, got.code, got.counters, got.left), got.warnings
