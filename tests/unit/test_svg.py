"""The interactive flame graph SVG: layout, labels, options, escaping and the embedded script.

Past 400 lines by one `Oracle:` line per truth check (issue #30), kept in one file with its fixtures."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.core.errors import BadInput
from aiflame.core.model import SEPARATOR, Frame, FrameKind, Profile, Sample
from aiflame.exporters.base import frame_label
from aiflame.exporters.svg import FONT_SIZE, FONT_WIDTH, FRAME_HEIGHT, XPAD, SvgExporter

K = FrameKind
NS = "{http://www.w3.org/2000/svg}"


@dataclass
class Drawn:
    label: str
    title: str
    kind: str
    samples: int
    x: float
    width: float
    y: float
    text: str
    fill: str


def frames_of(root: ET.Element) -> list[Drawn]:
    out = []
    for g in root.iter(f"{NS}g"):
        if g.get("class") != "f":
            continue
        title = g.find(f"{NS}title")
        rect = g.find(f"{NS}rect")
        text = g.find(f"{NS}text")
        assert title is not None and rect is not None and text is not None
        samples = int(g.get("data-samples", "-1"))
        title_text = title.text or ""
        out.append(
            Drawn(
                label=title_text[: title_text.rindex(f" ({samples} ")],
                title=title_text,
                kind=g.get("data-kind", ""),
                samples=samples,
                x=float(rect.get("x", "nan")),
                width=float(rect.get("width", "nan")),
                y=float(rect.get("y", "nan")),
                text=text.text or "",
                fill=rect.get("fill", ""),
            )
        )
    return out


def render(profile: Profile, **options: object) -> tuple[ET.Element, list[Drawn]]:
    root = ET.fromstring(SvgExporter(**options).render(profile))  # type: ignore[arg-type]
    return root, frames_of(root)


def stack(*names: str) -> tuple[Frame, ...]:
    return tuple(Frame(n) for n in names)


# main;a;b 30  main;a;c 10  main;a 10  main;d;a 20  main;d;A 20  other 10
KNOWN = Profile(
    samples=[
        Sample(stack("main", "a", "b"), 30),
        Sample(stack("main", "a", "c"), 10),
        Sample(stack("main", "a"), 10),
        Sample(stack("main", "d", "a"), 20),
        Sample(stack("main", "d", "A"), 20),
        Sample(stack("other"), 10),
    ]
)


def test_root_frame_has_total_and_full_percentage() -> None:
    # Oracle: by construction — KNOWN holds 100 samples
    _, drawn = render(KNOWN)
    roots = [f for f in drawn if f.label == "all"]
    assert len(roots) == 1
    assert roots[0].samples == 100
    assert roots[0].title == "all (100 samples, 100.00%)"
    assert roots[0].kind == "root"
    assert roots[0].x == XPAD
    assert roots[0].width == pytest.approx(1200 - 2 * XPAD)


def test_known_profile_layout() -> None:
    # Oracle: by construction — KNOWN's weights in pixels at flamegraph.pl's layout (1200 px, 10 px pads)
    _, drawn = render(KNOWN)
    px = (1200 - 2 * XPAD) / 100  # pixels per sample
    root_y = max(f.y for f in drawn)
    got = sorted((round((root_y - f.y) / FRAME_HEIGHT), f.label, f.samples, f.x, f.width) for f in drawn)
    # Children ordered by label (uppercase first), left-aligned in their parent; self time is the gap.
    expected = sorted(
        [
            (0, "all", 100, XPAD, 100 * px),
            (1, "main", 90, XPAD, 90 * px),
            (1, "other", 10, XPAD + 90 * px, 10 * px),
            (2, "a", 50, XPAD, 50 * px),
            (2, "d", 40, XPAD + 50 * px, 40 * px),
            (3, "b", 30, XPAD, 30 * px),
            (3, "c", 10, XPAD + 30 * px, 10 * px),
            (3, "A", 20, XPAD + 50 * px, 20 * px),
            (3, "a", 20, XPAD + 70 * px, 20 * px),
        ]
    )
    assert [g[:3] for g in got] == [e[:3] for e in expected]
    for g, e in zip(got, expected, strict=True):
        assert g[3] == pytest.approx(e[3], abs=0.01)
        assert g[4] == pytest.approx(e[4], abs=0.01)
    titles = {f.title for f in drawn}
    assert "main (90 samples, 90.00%)" in titles
    assert "c (10 samples, 10.00%)" in titles


def check_geometry(drawn: list[Drawn], total: int, width: int, inverted: bool = False) -> None:
    """Widths proportional to counts; every frame inside a parent one row nearer the root."""
    px = (width - 2 * XPAD) / total
    rows: dict[float, list[Drawn]] = {}
    for f in drawn:
        assert f.width == pytest.approx(f.samples * px, abs=0.01)
        rows.setdefault(f.y, []).append(f)
    step = -FRAME_HEIGHT if inverted else FRAME_HEIGHT
    for f in drawn:
        if f.label == "all" and f.kind == "root":
            continue
        parents = [
            p
            for p in rows.get(f.y + step, [])
            if p.x - 0.021 <= f.x and f.x + f.width <= p.x + p.width + 0.021 and p.samples >= f.samples
        ]
        assert len(parents) == 1, f"{f.title} has {len(parents)} parents"
    for row in rows.values():  # frames of one row never overlap
        row.sort(key=lambda f: f.x)
        for left, right in zip(row, row[1:], strict=False):
            assert left.x + left.width <= right.x + 0.021


def test_children_lie_within_parents_one_row_up() -> None:
    # Oracle: flame graph geometry (check_geometry): each child inside its parent, one row up
    _, drawn = render(KNOWN)
    check_geometry(drawn, 100, 1200)


def test_inverted_flips_rows() -> None:
    # Oracle: by construction — the same frames, rows mirrored
    _, normal = render(KNOWN)
    _, inverted = render(KNOWN, inverted=True)
    root_n = next(f for f in normal if f.label == "all")
    root_i = next(f for f in inverted if f.label == "all")
    assert root_n.y == max(f.y for f in normal)  # root at the bottom
    assert root_i.y == min(f.y for f in inverted)  # root at the top
    check_geometry(inverted, 100, 1200, inverted=True)
    # Same frames, same x positions: only the rows move.
    assert sorted((f.label, f.x) for f in normal) == sorted((f.label, f.x) for f in inverted)
    b_n = next(f for f in normal if f.label == "b")
    b_i = next(f for f in inverted if f.label == "b")
    assert root_n.y - b_n.y == b_i.y - root_i.y == 3 * FRAME_HEIGHT


def test_title_subtitle_and_svg_attributes() -> None:
    root, _ = render(KNOWN, title="My <title> & \"more\"", subtitle="sub 'title'", width=800)
    assert root.tag == f"{NS}svg"
    assert root.get("width") == "800"
    texts = {t.get("id"): t.text for t in root.iter(f"{NS}text") if t.get("id")}
    assert texts["title"] == 'My <title> & "more"'
    assert texts["subtitle"] == "sub 'title'"
    assert texts["search"] == "Search"
    assert texts["unzoom"] == "Reset Zoom"
    assert texts["ignorecase"] == "ic"
    assert "details" in texts and "matched" in texts


def test_no_subtitle_element_by_default() -> None:
    root, _ = render(KNOWN)
    assert all(t.get("id") != "subtitle" for t in root.iter(f"{NS}text"))
    assert next(t.text for t in root.iter(f"{NS}text") if t.get("id") == "title") == "Flame Graph"


def test_width_option_scales_everything() -> None:
    # Oracle: flame graph geometry (check_geometry) at 500 px
    _, drawn = render(KNOWN, width=500)
    check_geometry(drawn, 100, 500)
    assert next(f for f in drawn if f.label == "all").width == pytest.approx(500 - 2 * XPAD)


def test_names_are_escaped() -> None:
    # Oracle: the XML parser (xml.etree) reads the names back whole
    nasty = "op<T>&\"quoted\" 'x' ]]> </script>"
    profile = Profile(samples=[Sample((Frame(nasty), Frame("ctl\x01\x1f")), 5)])
    data = SvgExporter().render(profile)
    _, drawn = render(profile)
    labels = {f.label for f in drawn}
    assert nasty in labels
    assert "ctl\ufffd\ufffd" in labels  # XML cannot carry control characters at all
    assert b"</script> (" not in data


def test_minwidth_prunes_narrow_frames_but_keeps_their_weight() -> None:
    # Oracle: by construction — one sample in 100,001 is narrower than the minimum width
    profile = Profile(
        samples=[Sample(stack("main", "big"), 100_000), Sample(stack("main", "tiny", "deeper"), 1)]
    )
    _, drawn = render(profile)
    labels = {f.label for f in drawn}
    assert "tiny" not in labels and "deeper" not in labels
    main = next(f for f in drawn if f.label == "main")
    assert main.samples == 100_001
    _, all_drawn = render(profile, minwidth=0.0)
    assert {"tiny", "deeper"} <= {f.label for f in all_drawn}
    _, wide = render(profile, minwidth=600.0)
    assert {f.label for f in wide} == {"all", "main", "big"}


def test_data_kinds_and_colours() -> None:
    profile = Profile(
        samples=[
            Sample(
                (
                    Frame("python3", K.PROCESS),
                    Frame("train", K.PYTHON, file="t.py", line=3),
                    Frame("at::matmul", K.NATIVE_CPP),
                    Frame("cudaLaunchKernel", K.NATIVE),
                    SEPARATOR,
                    Frame("gemm.cu", K.ACCEL_SOURCE),
                    Frame("0x40", K.ACCEL_INSTR),
                    Frame("memory_dependency", K.STALL),
                ),
                10,
            ),
            Sample((Frame("python3", K.PROCESS), Frame("??", K.UNKNOWN), Frame("sys_read", K.KERNEL)), 10),
        ]
    )
    _, drawn = render(profile)
    kinds = {f.label: f.kind for f in drawn}
    assert kinds == {
        "all": "root",
        "python3": "process",
        "py::train (t.py:3)": "python",
        "at::matmul": "native_cpp",
        "cudaLaunchKernel": "native",
        "-": "separator",
        "gemm.cu_[G]": "accel_source",
        "0x40_[g]": "accel_instr",
        "memory_dependency_[g]": "stall",
        "??": "unknown",
        "sys_read_[k]": "kernel",
    }
    rgb = {f.kind: tuple(int(c) for c in re.findall(r"\d+", f.fill)) for f in drawn}
    r, g, b = rgb["kernel"]
    assert r > g > b  # orange
    r, g, b = rgb["accel_instr"]
    assert g > r and g > b  # green
    r, g, b = rgb["accel_source"]
    assert g > r and b > r  # aqua
    r, g, b = rgb["native"]
    assert r > g and r > b  # red
    r, g, b = rgb["separator"]
    assert r == g == b  # grey
    r, g, b = rgb["process"]
    assert b > g and r > g  # purple
    # Colours are a pure function of kind and label.
    _, again = render(profile)
    assert [f.fill for f in drawn] == [f.fill for f in again]


def test_labels_are_cut_to_fit() -> None:
    long = "a_really_long_function_name_that_cannot_fit_" * 3
    profile = Profile(samples=[Sample(stack("main", long), 10), Sample(stack("main", "x"), 990)])
    _, drawn = render(profile)
    for f in drawn:
        assert len(f.text) * FONT_SIZE * FONT_WIDTH <= max(f.width - 3, 0) + 1e-9
        cut = f.text.endswith("..") and f.label.startswith(f.text[:-2])
        assert f.text == f.label or f.text == "" or cut
    assert next(f for f in drawn if f.label == "main").text == "main"


def test_countname_and_unit() -> None:
    # Oracle: by construction — 1500 ns in one frame
    profile = Profile(samples=[Sample(stack("f"), 1500)], unit="ns")
    _, drawn = render(profile)
    assert next(f for f in drawn if f.label == "f").title == "f (1500 ns, 100.00%)"
    _, drawn = render(profile, countname="nanoseconds")
    assert next(f for f in drawn if f.label == "f").title == "f (1500 nanoseconds, 100.00%)"


def test_lines_option() -> None:
    profile = Profile(samples=[Sample((Frame("malloc", file="malloc.c", line=12),), 1)])
    _, drawn = render(profile, lines=True)
    assert "malloc [malloc.c:12]" in {f.label for f in drawn}


@pytest.mark.parametrize(
    "profile",
    [Profile(), Profile(samples=[Sample(stack("a"), 0)]), Profile(samples=[Sample(stack("a"), -3)])],
)
def test_empty_profile_says_no_samples(profile: Profile) -> None:
    root, drawn = render(profile)
    assert drawn == []
    assert "No samples" in [t.text for t in root.iter(f"{NS}text")]


def test_empty_stack_counts_in_root_only() -> None:
    # Oracle: by construction — 3 samples with an empty stack, 1 in a
    _, drawn = render(Profile(samples=[Sample((), 3), Sample(stack("a"), 1)]))
    assert {(f.label, f.samples) for f in drawn} == {("all", 4), ("a", 1)}


@pytest.mark.parametrize(("options", "message"), [({"width": 50}, "width"), ({"minwidth": -1.0}, "minwidth")])
def test_bad_options(options: dict[str, object], message: str) -> None:
    with pytest.raises(BadInput, match=message):
        SvgExporter(**options)  # type: ignore[arg-type]


def script_of(data: bytes) -> str:
    match = re.search(rb"<script[^>]*><!\[CDATA\[(.*?)\]\]></script>", data, re.DOTALL)
    assert match is not None
    return match.group(1).decode("utf-8")


def test_script_is_embedded_with_zoom_and_search() -> None:
    data = SvgExporter().render(KNOWN)
    assert b"http" not in data.replace(b"http://www.w3.org/2000/svg", b"")  # nothing external
    script = script_of(data)
    for needle in ("function zoom(", "function unzoom(", "function search(", "function resetSearch(",
                   "function matchedPercent(", "Matched: ", "Function: ", "ctrlKey", "aiflameInit({"):
        assert needle in script
    config = re.search(r"aiflameInit\((\{.*\})\);", script)
    assert config is not None and '"total": 100' in config.group(1)


def test_script_config_cannot_close_cdata() -> None:
    # Oracle: the XML parser (xml.etree) accepts the document
    data = SvgExporter(countname="x]]><b>&").render(KNOWN)
    assert data.count(b"]]>") == 2  # the style's and the script's own CDATA ends
    ET.fromstring(data)


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_script_is_valid_javascript(tmp_path: Path) -> None:
    # Oracle: node --check (V8's parser)
    path = tmp_path / "flamegraph.js"
    path.write_text(script_of(SvgExporter(countname="it's \"q\"").render(KNOWN)), encoding="utf-8")
    result = subprocess.run(["node", "--check", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


names = st.sampled_from(["a", "b", "c", "A", "main", "x;y", "<&>"])
kinds = st.sampled_from(list(FrameKind))
frames = st.builds(Frame, name=names, kind=kinds)
random_profiles = st.lists(
    st.tuples(st.lists(frames, max_size=6).map(tuple), st.integers(min_value=1, max_value=1000)),
    min_size=1,
    max_size=25,
).map(lambda items: Profile(samples=[Sample(s, w) for s, w in items]))


@settings(max_examples=150, deadline=None)
@given(random_profiles, st.booleans())
def test_layout_matches_a_prefix_tree(profile: Profile, inverted: bool) -> None:
    # Oracle: a prefix tree of label paths, built here the slow obvious way
    # Reference: weight of every label path, computed the slow obvious way.
    paths: Counter[tuple[str, ...]] = Counter()
    for sample in profile.samples:
        labels = tuple(frame_label(f) for f in sample.stack)
        for depth in range(len(labels) + 1):
            paths[labels[:depth]] += sample.weight
    total = profile.total_weight
    _, drawn = render(profile, minwidth=0.0, inverted=inverted)
    check_geometry(drawn, total, 1200, inverted=inverted)
    expected = Counter((len(p), p[-1] if p else "all", w) for p, w in paths.items())
    root_y = next(f.y for f in drawn if f.kind == "root")
    got = Counter((round(abs(f.y - root_y) / FRAME_HEIGHT), f.label, f.samples) for f in drawn)
    assert got == expected


def test_large_profile_renders_quickly() -> None:
    pool = [Frame(f"fn_{i}", K.NATIVE if i % 3 else K.PYTHON, file="f.py", line=i) for i in range(2000)]
    samples = []
    for i in range(100_000):
        # 100k distinct stacks (the last two frames say which), 10 to 25 deep, branching more near the leaf.
        depth = 10 + i % 16
        prefix = [pool[(i >> max(0, 17 - j)) % 2000] for j in range(depth - 2)]
        samples.append(Sample((*prefix, pool[i // 2000], pool[i % 2000]), 1 + i % 5))
    profile = Profile(samples=samples)
    assert len(profile.aggregate()) == 100_000
    start = time.perf_counter()
    data = SvgExporter().render(profile)
    elapsed = time.perf_counter() - start
    assert elapsed < 20, f"rendering took {elapsed:.1f}s"
    ET.fromstring(data)
