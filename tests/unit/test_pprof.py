"""pprof export decoded back with our schema: string table, leaf-first locations, values and labels."""

from __future__ import annotations

import gzip

from aiflame.core.model import SEPARATOR, EventKind, Frame, FrameKind, Profile, Sample, TraceEvent
from aiflame.exporters import get_exporter
from aiflame.exporters import pprof_pb2 as pb

MAIN = Frame("main", FrameKind.NATIVE, module="app")
STEP = Frame("step", FrameKind.PYTHON, module="t.py", file="/w/t.py", line=3)
KERNEL = Frame("scale", FrameKind.ACCEL_SOURCE)
SRC = Frame("k.cu:4", FrameKind.ACCEL_SOURCE, file="/w/k.cu", line=4)
INSN = Frame("+0x0020 LDG.E R4, [R2]", FrameKind.ACCEL_INSTR)
WAIT = Frame("wait", FrameKind.STALL)


def _decode(prof: Profile) -> pb.Profile:
    out = pb.Profile()
    out.ParseFromString(gzip.decompress(get_exporter("pprof").render(prof)))
    return out


def test_stall_samples_decode_with_labels() -> None:
    prof = Profile(samples=[Sample((MAIN, STEP, SEPARATOR, KERNEL, SRC, INSN, WAIT), 7, pid=42),
                            Sample((MAIN, STEP), 3, pid=43)],
                   events=[TraceEvent("x", EventKind.COLLECTIVE, 0, pid=42, rank=1)], unit="stall samples",
                   counters={"stall_unknown_launch": 2}, start_ns=10, end_ns=110)
    p = _decode(prof)
    st = list(p.string_table)
    assert st[0] == "" and st[p.sample_type[0].type] == "stall_samples" and st[p.sample_type[0].unit] == "count"
    assert p.duration_nanos == 100 and [st[c] for c in p.comment] == ["stall_unknown_launch=2"]
    funcs = {f.id: f for f in p.function}
    locs = {loc.id: loc for loc in p.location}
    first = p.sample[0]
    names = [st[funcs[locs[i].line[0].function_id].name] for i in first.location_id]
    assert names == ["wait", "+0x0020 LDG.E R4, [R2]", "k.cu:4", "scale", "-", "step", "main"]  # leaf first
    src_line = locs[first.location_id[2]].line[0]
    assert src_line.line == 4 and st[funcs[src_line.function_id].filename] == "/w/k.cu"
    assert st[funcs[locs[first.location_id[5]].line[0].function_id].system_name] == "py::step (/w/t.py:3)"
    labels = {st[lab.key]: st[lab.str] if lab.str else lab.num for lab in first.label}
    assert labels == {"pid": 42, "rank": 1, "stall_reason": "wait", "kernel": "scale"}
    assert list(first.value) == [7] and list(p.sample[1].value) == [3]
    assert {st[lab.key] for lab in p.sample[1].label} == {"pid"}
    # Shared frames get one location each
    assert p.sample[1].location_id[-1] == first.location_id[-1]


def test_empty_profile_is_valid() -> None:
    p = _decode(Profile())
    assert list(p.string_table)[0] == "" and len(p.sample) == 0
