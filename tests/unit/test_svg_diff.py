"""Differential flame graphs: widths from the profile drawn, colours from the change against the baseline."""

from __future__ import annotations

import re

from aiflame.core.model import Profile
from aiflame.exporters.folded import FoldedExporter, parse_folded
from aiflame.exporters.svg import SvgExporter

BEFORE = "main;a 50\nmain;b 50\n"
AFTER = "main;a 150\nmain;b 50\nmain;c 100\n"


def _frames(svg: bytes) -> dict[str, tuple[str, str]]:
    out = {}
    for m in re.finditer(r'data-delta="(-?\d+)"><title>([^ ]+) [^<]*</title><rect [^>]*fill="([^"]+)"', svg.decode()):
        out[m.group(2)] = (m.group(1), m.group(3))
    return out


def _diff(before: Profile, normalize: bool) -> SvgExporter:
    e = SvgExporter(normalize=normalize)
    e.baseline = before
    return e


def test_raw_and_normalized_deltas() -> None:
    # Oracle: by construction — the before and after folded texts differ by known counts
    before, after = parse_folded(BEFORE), parse_folded(AFTER)
    raw = _frames(_diff(before, False).render(after))
    assert raw["a"] == ("100", "rgb(255,150,150)")  # half of the largest change (the root, +200)
    assert raw["all"][1] == "rgb(255,45,45)"
    assert raw["c"][0] == "100" and raw["b"] == ("0", "rgb(250,250,250)")
    assert raw["all"][0] == "200"
    norm = _frames(_diff(before, True).render(after))  # baseline scaled x3 to 300 samples
    assert norm["a"][0] == "0" and norm["b"][0] == "-100" and norm["b"][1] == "rgb(45,45,255)"
    assert norm["all"][0] == "0"


def test_tooltip_says_the_change_and_plain_graphs_do_not() -> None:
    # Oracle: by construction — a frame that went from 50 to 150 samples
    svg = _diff(parse_folded(BEFORE), False).render(parse_folded(AFTER)).decode()
    assert "(150 samples, 50.00%; +100 vs baseline)" in svg and '"differential": true' in svg
    plain = SvgExporter().render(parse_folded(AFTER)).decode()
    assert "data-delta" not in plain and "vs baseline" not in plain


def test_java_palette_folded() -> None:
    # Oracle: flamegraph.pl's java palette annotations (_[i] inlined, _[j] JIT), written out here
    prof = parse_folded("main;-;k_[G];k.cu:3_[G];+0x0010 FFMA_[g];wait_[g] 2\nmain;do_sys_[k] 1\n")
    text = FoldedExporter(palette="java").render(prof).decode()
    assert text.splitlines() == ["main;-;k_[i];k.cu:3_[i];+0x0010 FFMA_[j];wait_[j] 2", "main;do_sys_[k] 1"]
    gpu = FoldedExporter().render(prof).decode().splitlines()[0]
    assert gpu == "main;-;k_[G];k.cu:3_[G];+0x0010 FFMA_[g];wait_[g] 2"
