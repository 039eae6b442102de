"""speedscope's JSON file format (https://www.speedscope.app/file-format-schema.json).

One `sampled` profile per process (all samples in one profile named "all" when pids are unknown), frames
shared and deduplicated. speedscope shows file and line itself, so names carry only the kind annotations
that have no other home (`_[k]`, `_[G]`, `_[g]`).
"""

from __future__ import annotations

import json
from typing import Any

from aiflame.core.model import Frame, FrameKind, Profile, Sample

from .base import Exporter

__all__ = ["SCHEMA", "SpeedscopeExporter"]

SCHEMA = "https://www.speedscope.app/file-format-schema.json"

# speedscope's ValueUnit values; anything else (samples, events, ...) is a plain count.
_UNITS = {
    "ns": "nanoseconds",
    "nanoseconds": "nanoseconds",
    "us": "microseconds",
    "microseconds": "microseconds",
    "ms": "milliseconds",
    "milliseconds": "milliseconds",
    "s": "seconds",
    "seconds": "seconds",
    "bytes": "bytes",
}
_SUFFIX = {
    FrameKind.KERNEL: "_[k]",
    FrameKind.ACCEL_SOURCE: "_[G]",
    FrameKind.ACCEL_INSTR: "_[g]",
    FrameKind.STALL: "_[g]",
}


class _FrameTable:
    """speedscope's shared frame list, deduplicated by what speedscope shows (name, file, line)."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self._by_key: dict[tuple[str, str, int], int] = {}
        self._by_frame: dict[Frame, int] = {}

    def index(self, frame: Frame) -> int:
        i = self._by_frame.get(frame)
        if i is None:
            # A line number without a file says nothing speedscope could show, so it does not split frames.
            line = frame.line if frame.file else 0
            key = (frame.name + _SUFFIX.get(frame.kind, ""), frame.file, line)
            i = self._by_key.get(key)
            if i is None:
                i = self._by_key[key] = len(self.entries)
                entry: dict[str, Any] = {"name": key[0]}
                if frame.file:
                    entry["file"] = frame.file
                if line:
                    entry["line"] = line
                self.entries.append(entry)
            self._by_frame[frame] = i
        return i


class SpeedscopeExporter(Exporter):
    """speedscope JSON: one sampled profile per process."""

    name = "speedscope"
    extension = ".speedscope.json"
    text = True
    description = "speedscope JSON (https://www.speedscope.app)"

    def render(self, profile: Profile) -> bytes:
        table = _FrameTable()
        groups: dict[int, list[Sample]] = {}
        for s in profile.samples:
            if s.weight > 0:
                groups.setdefault(s.pid, []).append(s)
        unit = _UNITS.get(profile.unit.lower(), "none")
        profiles = [
            self._profile(pid, samples, unit, table) for pid, samples in sorted(groups.items())
        ] or [self._profile(0, [], unit, table)]
        doc = {
            "$schema": SCHEMA,
            "shared": {"frames": table.entries},
            "profiles": profiles,
            "name": profile.meta.get("name", "aiflame"),
            "activeProfileIndex": 0,
            "exporter": "aiflame",
        }
        # Names from binaries may hold stray surrogates; replace rather than fail the export.
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8", errors="replace")

    @staticmethod
    def _profile(pid: int, samples: list[Sample], unit: str, table: _FrameTable) -> dict[str, Any]:
        if pid == 0:
            name = "all"
        else:
            comm = next((s.comm for s in samples if s.comm), "")
            name = f"{comm} (pid {pid})" if comm else f"pid {pid}"
        # Time order for speedscope's time-ordered view; aggregated samples (time 0) keep their order.
        ordered = sorted(samples, key=lambda s: s.time_ns)
        stacks: list[list[int]] = []
        weights: list[int] = []
        for s in ordered:
            ids = [table.index(f) for f in s.stack]
            if stacks and stacks[-1] == ids:
                weights[-1] += s.weight  # consecutive identical stacks: one entry keeps files small
            else:
                stacks.append(ids)
                weights.append(s.weight)
        return {
            "type": "sampled",
            "name": name,
            "unit": unit,
            "startValue": 0,
            "endValue": sum(weights),
            "samples": stacks,
            "weights": weights,
        }
