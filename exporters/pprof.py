"""pprof profiles (gzipped `profile.proto`, see exporters/pprof.proto) for `go tool pprof`, Pyroscope and Parca.

One location per distinct frame, one function per distinct (name, file) pair; samples list locations leaf first.
Labels say what the stack alone does not: the process (`pid`), the rank of the process in its job (`rank`, from
the runtime events) and, in the AI flame graph, the `stall_reason` and `kernel` of a stall sample, so
`pprof -tagfocus=stall_reason=long_scoreboard` or a Pyroscope label filter selects them.
"""

from __future__ import annotations

import gzip

from aiflame.core.model import Frame, FrameKind, Profile

from .base import Exporter, frame_label

__all__ = ["PprofExporter"]


class _Strings:
    def __init__(self) -> None:
        self.table: list[str] = [""]
        self._index: dict[str, int] = {"": 0}

    def __call__(self, s: str) -> int:
        i = self._index.get(s)
        if i is None:
            i = self._index[s] = len(self.table)
            self.table.append(s)
        return i


def _unit_name(unit: str) -> str:
    return unit.replace(" ", "_") or "samples"


class PprofExporter(Exporter):
    """Gzipped pprof protobuf with pid, rank, stall reason and kernel labels."""

    name = "pprof"
    extension = ".pb.gz"
    description = "pprof profile (go tool pprof, Pyroscope, Parca) with pid, rank and stall-reason labels"
    options = ()

    def render(self, profile: Profile) -> bytes:
        from . import pprof_pb2 as pb  # protobuf's runtime costs every command start-up a few tens of ms

        strings = _Strings()
        out = pb.Profile()
        unit = _unit_name(profile.unit)
        out.sample_type.add(type=strings(unit), unit=strings("count"))
        out.period_type.type, out.period_type.unit = strings(unit), strings("count")
        out.period = 1
        if profile.start_ns and profile.end_ns > profile.start_ns:
            out.duration_nanos = profile.end_ns - profile.start_ns
        ranks = {e.pid: e.rank for e in profile.events if e.rank >= 0}
        functions: dict[tuple[str, str, str], int] = {}
        locations: dict[Frame, int] = {}

        def location(f: Frame) -> int:
            loc = locations.get(f)
            if loc is None:
                fkey = (f.name, f.file or f.module, frame_label(f))
                fid = functions.get(fkey)
                if fid is None:
                    fid = functions[fkey] = len(functions) + 1
                    out.function.add(id=fid, name=strings(f.name), system_name=strings(fkey[2]),
                                     filename=strings(fkey[1]))
                loc = locations[f] = len(locations) + 1
                out.location.add(id=loc).line.add(function_id=fid, line=f.line)
            return loc

        k_pid, k_rank = strings("pid"), strings("rank")
        k_reason, k_kernel = strings("stall_reason"), strings("kernel")
        for s in profile.samples:
            if s.weight <= 0:
                continue
            m = out.sample.add()
            m.location_id.extend(location(f) for f in reversed(s.stack))
            m.value.append(s.weight)
            if s.pid:
                m.label.add(key=k_pid, num=s.pid)
                if s.pid in ranks:
                    m.label.add(key=k_rank, num=ranks[s.pid])
            stall = next((f for f in s.stack if f.kind == FrameKind.STALL), None)  # the reason, not `not issued`
            if stall is not None:
                m.label.add(key=k_reason, str=strings(stall.name))
                kernel = next((f for f in s.stack if f.kind == FrameKind.ACCEL_SOURCE), None)
                if kernel is not None:
                    m.label.add(key=k_kernel, str=strings(kernel.name))
        for text in (f"{k}={v}" for k, v in sorted(profile.counters.items()) if v):
            out.comment.append(strings(text))
        out.string_table.extend(strings.table)
        return gzip.compress(out.SerializeToString(), mtime=0)
