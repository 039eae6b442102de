"""Folded stacks: frame labels, rendering, the separator option, and reading folded files back. The oracle for
what a folded file says is flamegraph.pl's reading of it (tests/flamegraph_read.py)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from aiflame.core.errors import BadInput
from aiflame.core.model import SEPARATOR, Frame, FrameKind, Profile, Sample, Stack
from aiflame.exporters.base import frame_label, sanitize_label
from aiflame.exporters.folded import FoldedExporter, parse_folded, with_separator
from tests.flamegraph_read import READ_AS_DIFFERENTIAL, read_folded_text

K = FrameKind


def native(name: str) -> Frame:
    return Frame(name, K.NATIVE)


def kernel(name: str) -> Frame:
    return Frame(name, K.KERNEL)


def render(profile: Profile, **options: bool | str) -> str:
    return FoldedExporter(**options).render(profile).decode("utf-8")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("frame", "label"),
    [
        (Frame("vfs_read", K.KERNEL), "vfs_read_[k]"),
        (Frame("gemm.cu", K.ACCEL_SOURCE), "gemm.cu_[G]"),
        (Frame("0x1a0", K.ACCEL_INSTR), "0x1a0_[g]"),
        (Frame("memory_dependency", K.STALL), "memory_dependency_[g]"),
        (Frame("anything", K.SEPARATOR), "-"),
        (Frame("forward", K.PYTHON, file="model.py", line=42), "py::forward (model.py:42)"),
        (Frame("forward", K.PYTHON, file="model.py"), "py::forward (model.py)"),
        (Frame("forward", K.PYTHON), "py::forward"),
        (Frame("malloc", K.NATIVE, file="malloc.c", line=7), "malloc"),
        (Frame("at::add", K.NATIVE_CPP), "at::add"),
        (Frame("[unknown]", K.UNKNOWN), "[unknown]"),
        (Frame("python3", K.PROCESS), "python3"),
    ],
)
def test_frame_label_by_kind(frame: Frame, label: str) -> None:
    # Oracle: flamegraph.pl's kernel suffix (_[k]) and iaprof's GPU ones (_[G], _[g]), written out here
    assert frame_label(frame) == label


def test_frame_label_lines_only_for_native_kinds() -> None:
    assert frame_label(Frame("malloc", file="malloc.c", line=7), lines=True) == "malloc [malloc.c:7]"
    assert frame_label(Frame("f", K.NATIVE_CPP, file="a.cc"), lines=True) == "f [a.cc]"
    assert frame_label(Frame("f", K.NATIVE), lines=True) == "f"
    assert frame_label(Frame("k", K.KERNEL, file="x.c", line=1), lines=True) == "k_[k]"
    assert frame_label(Frame("f", K.PYTHON, file="a.py", line=3), lines=True) == "py::f (a.py:3)"


def test_frame_label_is_separator_safe() -> None:
    assert frame_label(Frame("a;b\nc\rd\u2028e")) == "a:b c d e"
    assert frame_label(Frame("f", K.PYTHON, file="x;y.py", line=1)) == "py::f (x:y.py:1)"
    assert sanitize_label("plain") == "plain"


def test_render_merges_sorts_and_drops_empty_counts() -> None:
    # Oracle: by construction — the folded text written out by hand
    profile = Profile(
        samples=[
            Sample((native("main"), native("b")), 2),
            Sample((native("main"), native("a")), 3),
            Sample((native("main"), native("b")), 5),
            Sample((native("zero"),), 0),
            Sample((native("main"), kernel("read")), 1),
        ]
    )
    assert render(profile) == "main;a 3\nmain;b 7\nmain;read_[k] 1\n"


def test_render_empty_profile_is_empty() -> None:
    assert FoldedExporter().render(Profile()) == b""


def test_render_lines_option() -> None:
    profile = Profile(samples=[Sample((Frame("malloc", file="malloc.c", line=9),), 4)])
    assert render(profile) == "malloc 4\n"
    assert render(profile, lines=True) == "malloc [malloc.c:9] 4\n"


def test_lines_match_flamegraph_pl_regex() -> None:
    # Oracle: flamegraph.pl's own line pattern, copied here
    # The reference parser's pattern, from flamegraph.pl.
    pattern = re.compile(r"^(.*)\s+?(\d+(?:\.\d*)?)$")
    profile = Profile(
        samples=[
            Sample((native("a b"), native("c "), kernel("x")), 12),
            Sample((Frame("f", K.PYTHON, file="m.py", line=1),), 3),
        ]
    )
    lines = render(profile).splitlines()
    assert lines
    for line in lines:
        match = pattern.match(line)
        assert match is not None
        assert match.group(2) in {"12", "3"}


@pytest.mark.parametrize(
    ("stack", "expected"),
    [
        ((native("main"), kernel("sys_read"), kernel("vfs_read")), "main;-;sys_read_[k];vfs_read_[k]"),
        ((kernel("irq"), kernel("schedule")), "irq_[k];schedule_[k]"),  # kernel only: nothing to separate
        ((native("main"), native("work")), "main;work"),  # user only
        ((native("main"), SEPARATOR, kernel("read")), "main;-;read_[k]"),  # already separated
        ((native("main"), kernel("k"), native("cb")), "main;k_[k];cb"),  # kernel not on the leaf side
    ],
)
def test_separator_option(stack: Stack, expected: str) -> None:
    # Oracle: by construction — each stack's folded line written out by hand
    profile = Profile(samples=[Sample(stack, 1)])
    assert render(profile, separator=True) == f"{expected} 1\n"


def test_with_separator_returns_same_stack_when_nothing_to_do() -> None:
    stack = (native("a"), native("b"))
    assert with_separator(stack) is stack
    assert with_separator(()) == ()


def test_parse_folded_recognises_annotations() -> None:
    # Oracle: by construction — a line in flamegraph.pl's and iaprof's annotations, its frames by hand
    text = "python3;py::main (a.py:3);at::add;malloc;-;gemm.cu_[G];0x10_[g];sys_read_[k] 7\n"
    profile = parse_folded(text)
    assert len(profile.samples) == 1
    sample = profile.samples[0]
    assert sample.weight == 7
    assert [(f.name, f.kind) for f in sample.stack] == [
        ("python3", K.NATIVE),
        ("main (a.py:3)", K.PYTHON),
        ("at::add", K.NATIVE_CPP),
        ("malloc", K.NATIVE),
        ("-", K.SEPARATOR),
        ("gemm.cu", K.ACCEL_SOURCE),
        ("0x10", K.ACCEL_INSTR),
        ("sys_read", K.KERNEL),
    ]


def test_parse_folded_tolerates_blank_lines_crlf_bom_and_tabs() -> None:
    profile = parse_folded("\ufeffa;b 3\r\n\r\n  \na;c\t4  \n")
    got = [([f.name for f in s.stack], s.weight) for s in profile.samples]
    assert got == [(["a", "b"], 3), (["a", "c"], 4)]
    assert profile.unit == "samples"


def test_parse_folded_keeps_spaces_inside_names() -> None:
    # Oracle: flamegraph.pl's reading of the same line (tests/flamegraph_read.py)
    profile = parse_folded("a b;c  5\n")
    assert [f.name for f in profile.samples[0].stack] == ["a b", "c "]
    assert read_folded_text("a b;c  5\n") == Counter({("a b", "c "): 5})


def test_parse_folded_empty_stack_is_root_only_weight() -> None:
    # Oracle: flamegraph.pl's reading of the same text (tests/flamegraph_read.py)
    profile = parse_folded(" 5\na 1\n")
    assert profile.samples[0].stack == ()
    assert profile.total_weight == 6
    assert read_folded_text(" 5\na 1\n") == Counter({(): 5, ("a",): 1})


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("a;b 3\na;b\n", 2),
        ("a;b 1.5\n", 1),
        ("42\n", 1),
        ("a;b -3\n", 1),
        ("a;b 3x\n", 1),
        ("a;b \u0663\n", 1),  # an Arabic-Indic digit: int() would take it, folded readers do not
        ("ok 1\n\nbad\n", 3),
        ("a " + "9" * 30 + "\n", 1),
    ],
)
def test_parse_folded_malformed_line(text: str, line: int) -> None:
    with pytest.raises(BadInput, match=rf"^line {line}: ") as info:
        parse_folded(text)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text", ["", "\n\n", "   \n"])
def test_parse_folded_empty_input(text: str) -> None:
    with pytest.raises(BadInput, match="no stacks"):
        parse_folded(text)


def test_write_is_atomic_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    profile = Profile(samples=[Sample((native("a"),), 2)])
    target = tmp_path / "out.folded"
    target.write_text("old contents\n")
    FoldedExporter().write(profile, target)
    assert target.read_text() == "a 2\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.folded"]


def test_write_to_missing_directory_is_an_export_error(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="cannot write"):
        FoldedExporter().write(Profile(), tmp_path / "missing" / "out.folded")


# Names may hold anything a symbol table or a Python file can: separators, spaces, unicode, annotations.
names = st.text(min_size=1, max_size=12) | st.sampled_from(["-", "a;b", "x_[k]", "py::f", "a::b", " ", "\n"])
frames = st.builds(
    Frame,
    name=names,
    kind=st.sampled_from(list(FrameKind)),
    file=st.sampled_from(["", "a.py", "dir/b.c", "x;y"]),
    line=st.integers(min_value=0, max_value=5000),
)
stacks = st.lists(frames, min_size=1, max_size=6).map(tuple)
profiles = st.lists(st.tuples(stacks, st.integers(min_value=1, max_value=10**6)), max_size=15).map(
    lambda items: Profile(samples=[Sample(stack, weight) for stack, weight in items])
)


@settings(max_examples=300, deadline=None)
@given(profiles, st.booleans())
def test_round_trip_preserves_labels_and_counts(profile: Profile, lines: bool) -> None:
    expected: Counter[tuple[str, ...]] = Counter()
    for sample in profile.samples:
        expected[tuple(frame_label(f, lines) for f in sample.stack)] += sample.weight
    # Oracle: flamegraph.pl's reading of the file (tests/flamegraph_read.py), against the profile's own labels
    data = FoldedExporter(lines=lines).render(profile)
    if not expected:
        assert data == b""
        return
    assume(not any(READ_AS_DIFFERENTIAL.search(";".join(stack)) for stack in expected))  # the known gap below
    assert read_folded_text(data.decode("utf-8")) == expected
    parsed = parse_folded(data.decode("utf-8"))
    got: Counter[tuple[str, ...]] = Counter()
    for sample in parsed.samples:
        got[tuple(frame_label(f, lines) for f in sample.stack)] += sample.weight
    assert got == expected
    # Parsing is the inverse of rendering: a second render is byte-identical.
    assert FoldedExporter(lines=lines).render(parsed) == data


# A stack whose leaf label ends in whitespace and a number: flamegraph.pl would take that number for a differential
# file's first column (READ_AS_DIFFERENTIAL), so the folded writer joins it to the name with `_`.
def test_a_leaf_ending_in_a_number_is_read_by_flamegraph_pl_as_one_frame() -> None:
    """Oracle: flamegraph.pl's reading (tests/flamegraph_read.py) of a leaf such as `worker 2`."""
    data = FoldedExporter().render(Profile(samples=[Sample((native("main 1"), native("worker 2")), 5),
                                                    Sample((native("main"), native("w\t3.5")), 2)]))
    assert read_folded_text(data.decode()) == Counter({("main 1", "worker_2"): 5, ("main", "w_3.5"): 2})


def _looks_annotated(name: str) -> bool:
    label = sanitize_label(name)
    return label == "-" or label.startswith("py::") or re.search(r"_\[[kgG]\]$", label) is not None


plain_names = st.text(min_size=1, max_size=12).filter(lambda n: not _looks_annotated(n))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(plain_names, st.sampled_from([K.NATIVE, K.KERNEL, K.ACCEL_SOURCE])), min_size=1))
def test_round_trip_preserves_names_without_annotation(frames_: list[tuple[str, FrameKind]]) -> None:
    # Oracle: flamegraph.pl's reading of the names (tests/flamegraph_read.py); kinds by construction
    stack = tuple(Frame(name, kind) for name, kind in frames_)
    text = FoldedExporter().render(Profile(samples=[Sample(stack, 3)])).decode("utf-8")
    labels = tuple(frame_label(f) for f in stack)
    assume(not READ_AS_DIFFERENTIAL.search(";".join(labels)))
    assert read_folded_text(text) == Counter({labels: 3})
    parsed = parse_folded(text)
    [sample] = parsed.samples
    assert [f.name for f in sample.stack] == [sanitize_label(f.name) for f in stack]
    assert sample.weight == 3
    for original, back in zip(stack, sample.stack, strict=True):
        if original.kind != K.NATIVE:  # NATIVE may come back as NATIVE_CPP when the name has '::'
            assert back.kind == original.kind


folded_bits = st.sampled_from(["a", ";", " ", "1", "\n", "\t", "\r", "_[k]", "-", "0.5", "\ufeff", "\u0663"])


@settings(max_examples=500, deadline=None)
@given(st.text() | st.lists(folded_bits).map("".join))
def test_parse_folded_raises_only_export_error(text: str) -> None:
    try:
        profile = parse_folded(text)
    except BadInput as e:
        assert "\n" not in str(e)
    else:
        assert profile.samples
        assert all(s.weight >= 0 for s in profile.samples)
