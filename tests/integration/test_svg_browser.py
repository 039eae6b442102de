"""The AI flame graph SVG in a real headless browser (Debian's chromium, installed by `make setup`): search
reports the matched share of a stall reason, zoom and reset, the inverted view, and differential colours. The
test appends a script that calls the SVG's own `aiflame` API and writes the results into the DOM, which
`chromium --dump-dom` prints."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from aiflame.exporters import get_exporter
from aiflame.exporters.folded import parse_folded
from aiflame.exporters.svg import SvgExporter

FOLDED = """\
train;py::step (t.py:3);launch_scale;-;scale_[G];k.cu:3_[G];+0x0010 FFMA R0, R1, R2, R3_[g];long_scoreboard_[g] 30
train;py::step (t.py:3);launch_scale;-;scale_[G];k.cu:4_[G];+0x0020 LDG.E R4, [R2]_[g];long_scoreboard_[g] 20
train;py::step (t.py:3);launch_scale;-;scale_[G];k.cu:4_[G];+0x0020 LDG.E R4, [R2]_[g];wait_[g] 10
train;py::eval (t.py:9);launch_add;-;add_[G];k.cu:9_[G];+0x0040 STS [R3], R4_[g];long_scoreboard_[g] 15
train;py::eval (t.py:9);launch_add;-;add_[G];k.cu:9_[G];+0x0040 STS [R3], R4_[g];barrier_[g] 25
"""

PROBE = """<script type="text/ecmascript"><![CDATA[
const steps = %s;
const out = [];
for (const [fn, arg] of steps) {
  const r = arg === undefined ? aiflame[fn]() : aiflame[fn](arg);
  out.push({fn: fn, ret: r === undefined ? null : r, matched: aiflame.matched(), visible: aiflame.visible()});
}
const t = document.createElementNS("http://www.w3.org/2000/svg", "text");
t.setAttribute("id", "probe-result");
t.textContent = JSON.stringify(out);
document.documentElement.appendChild(t);
]]></script>
</svg>
"""


def _browser() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium not found: `make setup` installs it (apt package chromium)")
    return exe


def _drive(svg: bytes, steps: list[list[Any]], tmp_path: Path) -> list[dict[str, Any]]:
    text = svg.decode()
    assert text.endswith("</svg>\n")
    page = tmp_path / "graph.svg"
    page.write_text(text[: -len("</svg>\n")] + PROBE % json.dumps(steps))
    proc = subprocess.run([_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                           page.as_uri()], capture_output=True, text=True, timeout=120)
    m = re.search(r'<text id="probe-result">(.*?)</text>', proc.stdout, re.S)
    assert m, f"no result in the DOM (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(m.group(1).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))  # type: ignore[no-any-return]


def _by_label(visible: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f["label"]: f for f in visible}


def test_search_zoom_and_reset(tmp_path: Path) -> None:
    # Oracle: Chromium running the SVG's script; the folded counts by construction (65 of 100 match)
    svg = get_exporter("svg", title="AI flame graph").render(parse_folded(FOLDED))
    res = _drive(svg, [["search", "long_scoreboard"], ["resetSearch"], ["search", "^\\+0x0020"],
                       ["zoomTo", "add_[G]"], ["unzoom"]], tmp_path)
    assert res[0]["matched"] == "Matched: 65.0%"  # (30 + 20 + 15) / 100
    assert any(f["fill"] == "rgb(230,0,230)" for f in res[0]["visible"])
    assert res[1]["matched"].strip() == "" and all(f["fill"] != "rgb(230,0,230)" for f in res[1]["visible"])
    assert res[2]["matched"] == "Matched: 30.0%"
    zoomed = _by_label(res[3]["visible"])
    assert res[3]["ret"] is True and "scale_[G]" not in zoomed
    assert zoomed["add_[G]"]["x"] == 10 and zoomed["add_[G]"]["w"] == 1180
    assert zoomed["barrier_[g]"]["w"] == pytest.approx(1180 * 25 / 40, abs=0.02)
    reset = _by_label(res[4]["visible"])
    assert reset["scale_[G]"]["w"] == pytest.approx(1180 * 0.6, abs=0.02) and reset["scale_[G]"]["x"] > 10
    assert reset["add_[G]"]["w"] == pytest.approx(1180 * 0.4, abs=0.02)


def test_inverted_view(tmp_path: Path) -> None:
    # Oracle: Chromium's layout of the inverted SVG
    prof = parse_folded(FOLDED)
    normal = _by_label(_drive(get_exporter("svg").render(prof), [["matched"]], tmp_path)[0]["visible"])
    inverted = _by_label(_drive(get_exporter("svg", inverted=True).render(prof), [["matched"]], tmp_path)[0]["visible"])
    assert normal["all"]["y"] > normal["wait_[g]"]["y"]  # root at the bottom
    assert inverted["all"]["y"] < inverted["wait_[g]"]["y"]  # root at the top


def test_differential_colours(tmp_path: Path) -> None:
    # Oracle: Chromium's rendering; the before and after counts by construction
    before = parse_folded(FOLDED)
    after = parse_folded(FOLDED.replace("barrier_[g] 25", "barrier_[g] 125").replace("wait_[g] 10", "wait_[g] 1"))
    exporter = SvgExporter(normalize=False)
    exporter.baseline = before
    svg = exporter.render(after)
    frames = _by_label(_drive(svg, [["search", "barrier"]], tmp_path)[0]["visible"])

    def rgb(label: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", frames[label]["fill"]))

    r, g, b = rgb("barrier_[g]")
    assert frames["barrier_[g]"]["fill"] == "rgb(230,0,230)"  # search highlight drawn over the diff colour
    r, g, b = rgb("add_[G]")
    assert r == 255 and g < 100 and b < 100  # grew by 100: deepest red
    r, g, b = rgb("wait_[g]")
    assert b == 255 and r < 255  # shrank: blue
    r, g, b = rgb("FFMA R0, R1, R2, R3".join(["+0x0010 ", "_[g]"]))
    assert (r, g, b) == (250, 250, 250)  # unchanged
    assert 'data-delta="100"' in svg.decode()
