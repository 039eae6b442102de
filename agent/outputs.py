"""What a capture becomes next to it: its views (CPU samples, kernel launches, stall samples), each in the asked
formats, and Chakra traces (one file per rank). `aiflame profile` and the daemon both write through here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aiflame.core.model import EventKind, Profile
from aiflame.core.raw import Capture
from aiflame.exporters import REGISTRY, get_exporter
from aiflame.exporters.chakra import write_traces
from aiflame.symbolize.events import launch_profile

CHAKRA = "chakra"  # several files (one per rank), so not an Exporter of the registry
FORMATS = (*REGISTRY, CHAKRA)


@dataclass(frozen=True)
class View:
    """One profile of a capture and the file-name stem it is written under."""

    prefix: str  # e.g. "profile", "launches", "stalls"
    profile: Profile
    what: str  # its weight in words, e.g. "12 kernel launches"
    label: str  # flame-graph title suffix, e.g. " (launches)"


def capture_views(cap: Capture, prof: Profile, prefix: str = "profile") -> list[View]:
    """The CPU-sample view, plus the launch view when kernels were launched and the stall view (the AI flame
    graph) when the capture has stall samples."""
    views = [View(prefix, prof, f"{prof.total_weight} samples", "")]
    launches = launch_profile(prof)
    if launches.samples:  # which CPU stacks launched which kernels
        views.append(View("launches", launches, f"{launches.total_weight} kernel launches", " (launches)"))
    if cap.stalls:  # stall samples on the stacks that launched their kernels
        from aiflame.symbolize.stalls import stall_profile

        stalls = stall_profile(cap, prof)
        views.append(View("stalls", stalls, f"{stalls.total_weight} stall samples", " (stall samples)"))
    return views


def write_views(views: Sequence[View], formats: Sequence[str], out_dir: Path,
                svg_options: Callable[[View], dict[str, object]]) -> tuple[list[Path], list[str]]:
    """Write every view in every format into `out_dir` (Chakra once, from the first view's events); returns the
    files written and notes for the user (a format unknown here, Chakra warnings)."""
    written: list[Path] = []
    notes: list[str] = []
    if CHAKRA in formats:
        first = views[0]
        if any(e.kind != EventKind.OTHER for e in first.profile.events):
            files, traces = write_traces(first.profile, out_dir / first.prefix)
            written += files
            notes += [f"chakra: {w}" for w in traces.warnings]
        else:
            notes.append("chakra: no collectives, launches or copies in this capture, so no traces")
    for view in views:
        for name in formats:
            if name == CHAKRA:
                continue
            if name not in REGISTRY:
                notes.append(f"the {name} exporter is not available in this build")
                continue
            exporter = get_exporter(name, **(svg_options(view) if name == "svg" else {}))
            path = out_dir / f"{view.prefix}{exporter.extension}"
            exporter.write(view.profile, path)
            written.append(path)
    return written, notes
