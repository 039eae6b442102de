"""pprof export read back with Google's own profile.proto (tests/pprof_read.py: string table, leaf-first
locations, values, labels, and the validity rules of pprof's reader), and with protoc's schema-less decoder
against profile.proto's field numbers; our copy of the schema checked field by field against Google's."""

from __future__ import annotations

import gzip
from typing import Any

from aiflame.core.model import SEPARATOR, EventKind, Frame, FrameKind, Profile, Sample, TraceEvent
from aiflame.exporters import get_exporter
from aiflame.exporters import pprof_pb2 as ours
from tests.pprof_read import _schema, read_pprof

MAIN = Frame("main", FrameKind.NATIVE, module="app")
STEP = Frame("step", FrameKind.PYTHON, module="t.py", file="/w/t.py", line=3)
KERNEL = Frame("scale", FrameKind.ACCEL_SOURCE)
SRC = Frame("k.cu:4", FrameKind.ACCEL_SOURCE, file="/w/k.cu", line=4)
INSN = Frame("+0x0020 LDG.E R4, [R2]", FrameKind.ACCEL_INSTR)
WAIT = Frame("wait", FrameKind.STALL)


def _decode(prof: Profile) -> Any:
    return read_pprof(get_exporter("pprof").render(prof))


def test_stall_samples_decode_with_labels() -> None:
    # Oracle: Google's profile.proto and pprof's validity rules (tests/pprof_read.py); the profile by construction
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
    # Oracle: Google's profile.proto and pprof's validity rules (tests/pprof_read.py)
    p = _decode(Profile())
    assert list(p.string_table)[0] == "" and len(p.sample) == 0


def _decode_raw(data: bytes) -> list[tuple[int, object]]:
    """The message as `protoc --decode_raw` reads it (no schema: field numbers and values), as nested lists: an
    independent decoder, so the field numbers are checked against pprof's profile.proto, not our copy of it."""
    import ast
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "--decode_raw"], input=data,
                         capture_output=True, check=True).stdout.decode()
    stack: list[list[tuple[int, object]]] = [[]]
    for line in out.splitlines():
        line = line.strip()
        if line.endswith("{"):
            child: list[tuple[int, object]] = []
            stack[-1].append((int(line[:-1]), child))
            stack.append(child)
        elif line == "}":
            stack.pop()
        elif line:
            num, value = line.split(": ", 1)
            v: object = ast.literal_eval("b" + value) if value.startswith('"') else int(value)
            stack[-1].append((int(num), v))
    return stack[0]


def _varints(b: object) -> list[int]:
    assert isinstance(b, bytes)
    out, cur, shift = [], 0, 0
    for byte in b:
        cur |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            out.append(cur)
            cur, shift = 0, 0
    return out


def test_wire_format_matches_pprof_field_numbers() -> None:
    """profile.proto: sample_type 1 {type 1, unit 2}, sample 2 {location_id 1, value 2, label 3 {key 1, num 3}},
    location 4 {id 1, line 4 {function_id 1}}, function 5 {id 1, name 2}, string_table 6, duration_nanos 10,
    comment 13 (indices into string_table).

    Oracle: `protoc --decode_raw`, which reads the wire format with no schema at all."""
    prof = Profile(samples=[Sample((MAIN, Frame("leaf", FrameKind.NATIVE)), 7, pid=42)], start_ns=10, end_ns=110,
                   counters={"lost": 2})
    msg = _decode_raw(gzip.decompress(get_exporter("pprof").render(prof)))
    strings = [bytes(v).decode() for f, v in msg if f == 6 and isinstance(v, bytes)]
    assert strings[0] == ""
    (vt,) = [v for f, v in msg if f == 1]
    assert isinstance(vt, list) and [strings[x] for _, x in vt if isinstance(x, int)] == ["samples", "count"]
    functions = {dict(v)[1]: strings[dict(v)[2]] for f, v in msg if f == 5 and isinstance(v, list)}
    locations = {dict(v)[1]: dict(dict(v)[4])[1] for f, v in msg if f == 4 and isinstance(v, list)}
    (sample,) = [dict(v) for f, v in msg if f == 2 and isinstance(v, list)]
    assert [functions[locations[i]] for i in _varints(sample[1])] == ["leaf", "main"]  # leaf first
    assert _varints(sample[2]) == [7]
    label = dict(sample[3])
    assert strings[label[1]] == "pid" and label[3] == 42
    assert dict(msg)[10] == 100
    assert [strings[i] for i in _varints(dict(msg)[13])] == ["lost=2"]


# Fields pprof added after the 2021 profile.proto Debian ships (upstream: Line.column in 2023, doc_url in 2024).
NEWER_THAN_DEBIANS = {("Profile", 15, "doc_url"), ("Line", 3, "column")}


def test_our_schema_is_googles() -> None:
    """Oracle: Google's profile.proto (tests/pprof_read.py): every field of our copy has its name, number, type
    and cardinality there, but the two pprof added after Debian's copy."""
    google = _schema()
    for name, mine in ours.DESCRIPTOR.message_types_by_name.items():
        theirs = google.DESCRIPTOR.message_types_by_name[name]
        for f in mine.fields:
            if (name, f.number, f.name) in NEWER_THAN_DEBIANS:
                assert f.number not in theirs.fields_by_number, (name, f.name)
                continue
            t = theirs.fields_by_number[f.number]
            assert (t.name, t.type, t.is_repeated) == (f.name, f.type, f.is_repeated), (name, f.name)
