"""speedscope JSON: schema fields, shared frames, one sampled profile per process."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.core.model import Frame, FrameKind, Profile, Sample
from aiflame.exporters.speedscope import SCHEMA, SpeedscopeExporter

K = FrameKind
MAIN = Frame("main", K.PYTHON, file="train.py", line=10)
STEP = Frame("step", K.PYTHON, file="train.py", line=20)
MATMUL = Frame("at::matmul", K.NATIVE_CPP, module="libtorch.so")
READ = Frame("sys_read", K.KERNEL)


def export(profile: Profile) -> dict[str, Any]:
    doc = json.loads(SpeedscopeExporter().render(profile))
    assert isinstance(doc, dict)
    return doc


def names_of(doc: dict[str, Any], stack: list[int]) -> tuple[str, ...]:
    return tuple(doc["shared"]["frames"][i]["name"] for i in stack)


PROFILE = Profile(
    samples=[
        Sample((MAIN, STEP, MATMUL), 5, pid=42, comm="python3"),
        Sample((MAIN, STEP, READ), 2, pid=42, comm="python3"),
        Sample((MAIN,), 1, pid=7),
        Sample((MAIN, STEP), 3, pid=0),
    ],
    meta={"name": "training run"},
)


def test_top_level_fields() -> None:
    # Oracle: speedscope's file-format schema (speedscope.app/file-format-schema.json), field by field
    doc = export(PROFILE)
    assert doc["$schema"] == SCHEMA == "https://www.speedscope.app/file-format-schema.json"
    assert doc["exporter"] == "aiflame"
    assert doc["activeProfileIndex"] == 0
    assert doc["name"] == "training run"
    assert set(doc) == {"$schema", "shared", "profiles", "name", "activeProfileIndex", "exporter"}


def test_shared_frames_are_deduplicated_with_file_and_line() -> None:
    # Oracle: speedscope's file format: shared frames with file and line; PROFILE by construction
    doc = export(PROFILE)
    frames = doc["shared"]["frames"]
    assert len(frames) == 4
    assert len({json.dumps(f, sort_keys=True) for f in frames}) == 4
    by_name = {f["name"]: f for f in frames}
    assert by_name["main"] == {"name": "main", "file": "train.py", "line": 10}
    assert by_name["at::matmul"] == {"name": "at::matmul"}
    assert by_name["sys_read_[k]"] == {"name": "sys_read_[k]"}  # kernel frames keep their annotation


def test_one_sampled_profile_per_pid() -> None:
    # Oracle: speedscope's file format (sampled profiles); PROFILE's pids by construction
    doc = export(PROFILE)
    profiles = doc["profiles"]
    assert [p["name"] for p in profiles] == ["all", "pid 7", "python3 (pid 42)"]
    for p in profiles:
        assert p["type"] == "sampled"
        assert p["unit"] == "none"
        assert p["startValue"] == 0
        assert p["endValue"] == sum(p["weights"])
        assert len(p["samples"]) == len(p["weights"])
        for sample in p["samples"]:
            assert all(0 <= i < len(doc["shared"]["frames"]) for i in sample)
    python3 = profiles[2]
    got = {names_of(doc, s): w for s, w in zip(python3["samples"], python3["weights"], strict=True)}
    assert got == {("main", "step", "at::matmul"): 5, ("main", "step", "sys_read_[k]"): 2}  # root -> leaf
    assert sum(sum(p["weights"]) for p in profiles) == PROFILE.total_weight


@pytest.mark.parametrize(
    ("unit", "expected"),
    [("samples", "none"), ("ns", "nanoseconds"), ("microseconds", "microseconds"), ("bytes", "bytes"),
     ("events", "none")],
)
def test_units(unit: str, expected: str) -> None:
    # Oracle: speedscope's file format: its ValueUnit names
    doc = export(Profile(samples=[Sample((MAIN,), 1)], unit=unit))
    assert doc["profiles"][0]["unit"] == expected


def test_time_order_and_merged_neighbours() -> None:
    # Oracle: by construction — samples given out of time order
    profile = Profile(
        samples=[
            Sample((MAIN, STEP), 1, pid=1, time_ns=300),
            Sample((MAIN, MATMUL), 1, pid=1, time_ns=100),
            Sample((MAIN, MATMUL), 1, pid=1, time_ns=200),
        ]
    )
    doc = export(profile)
    [p] = doc["profiles"]
    assert [names_of(doc, s) for s in p["samples"]] == [("main", "at::matmul"), ("main", "step")]
    assert p["weights"] == [2, 1]


def test_non_positive_weights_are_dropped() -> None:
    # Oracle: by construction — weights 0, -1 and 4
    doc = export(Profile(samples=[Sample((MAIN,), 0), Sample((STEP,), -1), Sample((READ,), 4)]))
    [p] = doc["profiles"]
    assert p["weights"] == [4]
    assert p["endValue"] == 4


def test_empty_profile_is_still_a_valid_document() -> None:
    # Oracle: speedscope's file format: a sampled profile with no samples
    doc = export(Profile())
    assert doc["shared"]["frames"] == []
    assert doc["profiles"] == [
        {"type": "sampled", "name": "all", "unit": "none", "startValue": 0, "endValue": 0, "samples": [],
         "weights": []}
    ]


def test_unusual_names_survive() -> None:
    odd = Frame('a;b\n"c" \u00e9\u4e2d\ud800')
    doc = export(Profile(samples=[Sample((odd,), 1)]))
    assert doc["shared"]["frames"][0]["name"] == 'a;b\n"c" \u00e9\u4e2d?'  # a lone surrogate cannot be UTF-8


frames = st.builds(
    Frame,
    name=st.sampled_from(["a", "b", "c", "a::b"]),
    kind=st.sampled_from(list(FrameKind)),
    file=st.sampled_from(["", "x.py"]),
    line=st.integers(0, 3),
)
samples = st.builds(
    Sample,
    stack=st.lists(frames, max_size=5).map(tuple),
    weight=st.integers(1, 100),
    pid=st.sampled_from([0, 1, 2]),
    comm=st.sampled_from(["", "python3"]),
    time_ns=st.integers(0, 5),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(samples, max_size=20))
def test_weights_and_stacks_match_the_profile(items: list[Sample]) -> None:
    # Oracle: speedscope's file format, read back by the test (frame indices into shared frames)
    profile = Profile(samples=items)
    doc = export(profile)
    frame_count = len(doc["shared"]["frames"])
    got: Counter[tuple[tuple[str, str, int], ...]] = Counter()
    for p in doc["profiles"]:
        assert p["endValue"] == sum(p["weights"])
        for stack, weight in zip(p["samples"], p["weights"], strict=True):
            assert all(0 <= i < frame_count for i in stack)
            entries = [doc["shared"]["frames"][i] for i in stack]
            got[tuple((e["name"], e.get("file", ""), e.get("line", 0)) for e in entries)] += weight
    suffix = {K.KERNEL: "_[k]", K.ACCEL_SOURCE: "_[G]", K.ACCEL_INSTR: "_[g]", K.STALL: "_[g]"}
    expected: Counter[tuple[tuple[str, str, int], ...]] = Counter()
    for s in items:
        key = tuple((f.name + suffix.get(f.kind, ""), f.file, f.line if f.file else 0) for f in s.stack)
        expected[key] += s.weight
    assert got == expected
