"""The views of a capture, under one set of names: what `--view` asks for, what `profile` and the daemon write
next to a capture, what `top` shows (the cpu view). Each view is a Profile made from the capture and its CPU
profile (symbolize/stacks.py); nothing here reads or writes a file (symbolize/road.py composes the steps).

    cpu       the CPU samples, as symbolized
    launches  accelerator kernel launches on the CPU stacks that made them (symbolize/events.py)
    stalls    accelerator stall samples on their launch stacks, the AI flame graph (symbolize/stalls.py)
    combined  CPU and stall samples in one graph
    offcpu    where threads blocked, in ns (symbolize/offcpu.py)
    wall      CPU and blocked time in one graph, in ns
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiflame.core.errors import NothingToShow
from aiflame.core.model import EventKind, Profile
from aiflame.core.raw import Capture
from aiflame.symbolize.events import launch_profile
from aiflame.symbolize.offcpu import offcpu_profile, sample_period_ns, wall_profile

__all__ = ["VIEWS", "WRITTEN", "View", "capture_views", "has_view", "view"]


@dataclass(frozen=True)
class View:
    """One view of a capture as it is written: its name, the file-name stem, the profile and how it is titled."""

    name: str  # one of VIEWS
    stem: str  # file-name stem: the capture's prefix for the cpu view, else the view's name
    profile: Profile
    what: str  # its weight in words, e.g. "12 kernel launches"
    label: str  # flame-graph title suffix, e.g. " (launches)"


def _cpu(cap: Capture, prof: Profile, sass: bool) -> Profile:
    return prof


def _launches(cap: Capture, prof: Profile, sass: bool) -> Profile:
    if not _launched(cap, prof):
        raise NothingToShow("no kernel launches in this capture (the launch view is empty)")
    return launch_profile(prof)


def _stalls(cap: Capture, prof: Profile, sass: bool) -> Profile:
    from aiflame.symbolize.stalls import stall_profile  # cubins, SASS: only for captures with stalls

    if not _stalled(cap, prof):
        raise NothingToShow("no accelerator stall samples in this capture (the stall view is empty; "
                            "`aiflame import` adds records saved elsewhere)")
    return stall_profile(cap, prof, sass=sass)


def _combined(cap: Capture, prof: Profile, sass: bool) -> Profile:
    from aiflame.symbolize.stalls import combined_profile

    return combined_profile(prof, _stalls(cap, prof, sass))


def _offcpu(cap: Capture, prof: Profile, sass: bool) -> Profile:
    return offcpu_profile(prof)


def _wall(cap: Capture, prof: Profile, sass: bool) -> Profile:
    return wall_profile(prof)


def _launched(cap: Capture, prof: Profile) -> bool:
    return any(e.kind == EventKind.COMPUTE for e in prof.events)


def _stalled(cap: Capture, prof: Profile) -> bool:
    return bool(cap.stalls)


def _blocked(cap: Capture, prof: Profile) -> bool:
    return bool(prof.off_cpu)


@dataclass(frozen=True)
class _Kind:
    build: Callable[[Capture, Profile, bool], Profile]  # (capture, CPU profile, sass) -> the view
    present: Callable[[Capture, Profile], bool]  # whether the capture has anything for it
    label: str  # flame-graph title suffix


# The one table of views, in the order `--view` lists them.
_KINDS = {
    "cpu": _Kind(_cpu, lambda cap, prof: True, ""),
    "launches": _Kind(_launches, _launched, " (launches)"),
    "stalls": _Kind(_stalls, _stalled, " (stall samples)"),
    "combined": _Kind(_combined, _stalled, " (CPU + stall samples)"),
    "offcpu": _Kind(_offcpu, _blocked, " (off-CPU)"),
    "wall": _Kind(_wall, _blocked, " (on + off CPU)"),
}
VIEWS = tuple(_KINDS)
# The views written next to a capture when it has what they show, in the order they are written.
WRITTEN = ("cpu", "launches", "offcpu", "wall", "stalls")


def _kind(name: str) -> _Kind:
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown view {name!r} (known: {', '.join(VIEWS)})")
    return kind


def view(cap: Capture, prof: Profile, name: str, *, sass: bool = True) -> Profile:
    """The view `name` of `cap`, whose CPU profile is `prof`. A view the capture has nothing for is an error of
    one line (NothingToShow); the cpu view is `prof` itself. `sass`: the stall
    views show each instruction's SASS text (nvdisasm)."""
    return _kind(name).build(cap, prof, sass)


def has_view(cap: Capture, prof: Profile, name: str) -> bool:
    """Whether `cap` has anything for the view `name` (the cpu view always, though it may be empty)."""
    return _kind(name).present(cap, prof)


def _what(name: str, prof: Profile, profile: Profile) -> str:
    """The weight of the view `name` (`profile`) in words; `prof` is the CPU profile."""
    if name in ("offcpu", "wall"):
        blocked = sum(s.weight for s in prof.off_cpu) / 1e9
        if name == "offcpu":
            return f"{blocked:.2f} s blocked"
        return f"{prof.total_weight * sample_period_ns(prof) / 1e9 + blocked:.2f} s on and off CPU"
    units = {"cpu": "samples", "launches": "kernel launches", "stalls": "stall samples"}
    return f"{profile.total_weight} {units.get(name, profile.unit)}"


def capture_views(cap: Capture, prof: Profile, prefix: str = "profile") -> list[View]:
    """The views written next to a capture (WRITTEN), those it has anything for: the cpu view under `prefix`
    (the capture's own file-name stem), each other view under its name."""
    out = []
    for name in WRITTEN:
        if has_view(cap, prof, name):
            profile = view(cap, prof, name)
            out.append(View(name, prefix if name == "cpu" else name, profile, _what(name, prof, profile),
                            _KINDS[name].label))
    return out
