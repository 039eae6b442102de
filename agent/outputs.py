"""What a capture becomes next to it: its views (CPU samples, kernel launches, off-CPU and wall time, stall
samples), each in the asked formats of the exporter registry; formats of the whole capture (Chakra, the comm plot)
once, from its CPU view. `aiflame profile` and the daemon both write through here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aiflame.core.model import Profile
from aiflame.core.raw import Capture
from aiflame.exporters import REGISTRY, NothingToExport, get_exporter
from aiflame.symbolize.events import launch_profile
from aiflame.symbolize.offcpu import offcpu_profile, sample_period_ns, wall_profile

FORMATS = tuple(REGISTRY)


@dataclass(frozen=True)
class View:
    """One profile of a capture and the file-name stem it is written under."""

    prefix: str  # e.g. "profile", "launches", "stalls"
    profile: Profile
    what: str  # its weight in words, e.g. "12 kernel launches"
    label: str  # flame-graph title suffix, e.g. " (launches)"


def capture_views(cap: Capture, prof: Profile, prefix: str = "profile") -> list[View]:
    """The CPU-sample view, plus the launch view when kernels were launched, the off-CPU and wall views when it
    recorded where threads blocked, and the stall view (the AI flame graph) when the capture has stall samples."""
    views = [View(prefix, prof, f"{prof.total_weight} samples", "")]
    launches = launch_profile(prof)
    if launches.samples:  # which CPU stacks launched which kernels
        views.append(View("launches", launches, f"{launches.total_weight} kernel launches", " (launches)"))
    if prof.off_cpu:  # where threads blocked (profile --off-cpu), alone and with the CPU samples, in ns
        period = sample_period_ns(prof)
        blocked = sum(s.weight for s in prof.off_cpu) / 1e9
        views.append(View("offcpu", offcpu_profile(prof), f"{blocked:.2f} s blocked", " (off-CPU)"))
        views.append(View("wall", wall_profile(prof), f"{prof.total_weight * period / 1e9 + blocked:.2f} s "
                          f"on and off CPU", " (on + off CPU)"))
    if cap.stalls:  # stall samples on the stacks that launched their kernels
        from aiflame.symbolize.stalls import stall_profile

        stalls = stall_profile(cap, prof)
        views.append(View("stalls", stalls, f"{stalls.total_weight} stall samples", " (stall samples)"))
    return views


def write_views(views: Sequence[View], formats: Sequence[str], out_dir: Path,
                svg_options: Callable[[View], dict[str, object]]) -> tuple[list[Path], list[str]]:
    """Write every view in every format into `out_dir`, a whole-capture format once from the first view; returns
    the files written and notes for the user (a format unknown here, what an exporter could not write)."""
    written: list[Path] = []
    notes = [f"the {name} exporter is not available in this build" for name in formats if name not in REGISTRY]
    known = [REGISTRY[name] for name in formats if name in REGISTRY]
    first = views[0]
    for cls in (c for c in known if c.whole_capture):
        exporter = get_exporter(cls.name)
        try:
            written += [o.path for o in exporter.write(first.profile, cls.output_path(out_dir / first.prefix))]
        except NothingToExport as e:
            notes.append(f"{cls.name}: {e}")
        notes += [f"{cls.name}: {w}" for w in exporter.warnings]
    for view in views:
        for cls in (c for c in known if not c.whole_capture):
            exporter = get_exporter(cls.name, **(svg_options(view) if cls.name == "svg" else {}))
            written += [o.path for o in exporter.write(view.profile, cls.output_path(out_dir / view.prefix))]
    return written, notes
