"""The road from a capture file to its files (symbolize/road.py, written by exporters/write.py): one set of view
names (symbolize/views.py), the views a capture has written in every format under the names `profile` and the
daemon have always used, and each view written by the road the same as `export --view` writes it."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from aiflame.cli.main import build_parser, main
from aiflame.core.capture import OFF_CPU_FORMAT_VERSION, write_capture
from aiflame.core.errors import NothingToShow
from aiflame.core.raw import Capture, CaptureFooter, CaptureHeader, Mapping, ProcessSnapshot, RawEvent, RawSample
from aiflame.exporters.write import write_views
from aiflame.symbolize.road import open_capture
from aiflame.symbolize.stacks import StackOptions
from aiflame.symbolize.views import VIEWS, WRITTEN, capture_views, view

TRUE = shutil.which("true") or "/bin/true"


def _capture(*, off_cpu: bool = True, launches: bool = True) -> Capture:
    """Two CPU samples, one blocked stack (25 ms) and two kernel launches of one process."""
    cap = Capture(CaptureHeader(OFF_CPU_FORMAT_VERSION, target="test", frequency_hz=100))
    cap.processes = [ProcessSnapshot(7, 1, [Mapping(0x400000, 0x410000, 0, TRUE)], comm="t")]
    cap.samples = [RawSample(5, 7, 7, 0, "t", (0x401000,), ()), RawSample(6, 7, 7, 0, "t", (0x401010,), ())]
    if off_cpu:
        cap.samples.append(RawSample(8, 7, 7, 0, "t", (0x401000,), (), off_cpu_ns=25_000_000))
    if launches:
        cap.events = [RawEvent("cuda", "cudaLaunchKernel", "compute", 7, 7, t, t + 50, (0x401020,)) for t in (10, 20)]
    cap.footer = CaptureFooter()
    return cap


def test_one_set_of_view_names() -> None:
    """`--view` of every command that takes it lists the views of symbolize/views.py, in its order."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name in ("profile", "export", "render"):
        (choices,) = [a.choices for a in commands[name]._actions if a.dest == "view"]
        assert tuple(choices or ()) == VIEWS, name
    assert set(WRITTEN) == set(VIEWS) - {"combined"}  # the combined view is asked for, never written beside


def test_the_views_a_capture_has_in_the_order_they_are_written(tmp_path: Path) -> None:
    path = tmp_path / "c.aiflame"
    write_capture(path, _capture())
    capture = open_capture(path, StackOptions(group="none"))
    views = capture.views()
    assert [(v.name, v.stem, v.what, v.label) for v in views] == [
        ("cpu", "profile", "2 samples", ""),
        ("launches", "launches", "2 kernel launches", " (launches)"),
        ("offcpu", "offcpu", "0.03 s blocked", " (off-CPU)"),
        ("wall", "wall", "0.04 s on and off CPU", " (on + off CPU)"),
    ]
    assert views[0].profile is capture.profile  # the cpu view is the symbolized capture itself
    assert [v.stem for v in capture_views(capture.capture, capture.profile, "window")][:2] == ["window", "launches"]


def test_a_view_the_capture_has_nothing_for_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cap = _capture(off_cpu=False, launches=False)
    path = tmp_path / "c.aiflame"
    write_capture(path, cap)
    capture = open_capture(path)
    assert [v.name for v in capture.views()] == ["cpu"]
    with pytest.raises(NothingToShow, match="no kernel launches in this capture"):
        view(cap, capture.profile, "launches")
    with pytest.raises(ValueError, match="unknown view 'profile'"):
        capture.view("profile")
    for name, what in (("launches", "no kernel launches"), ("stalls", "no accelerator stall samples"),
                       ("combined", "no accelerator stall samples"), ("offcpu", "no off-CPU samples"),
                       ("wall", "no off-CPU samples")):
        assert main(["export", str(path), "--view", name, "-f", "folded", "-o", str(tmp_path / "x.folded")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("aiflame: error: ") and what in err and err.count("\n") == 1, (name, err)


def test_the_road_writes_what_export_writes(tmp_path: Path) -> None:
    """Every view in every format next to the capture, under the names `profile` and the daemon write; each
    view's folded file as `export --view` makes it."""
    path = tmp_path / "c.aiflame"
    write_capture(path, _capture())
    done = write_views(open_capture(path).views(), ["folded", "svg"], path.parent,
                       svg_options=lambda v: {"title": f"t ({v.stem})"})
    stems = ("profile", "launches", "offcpu", "wall")
    assert [p.name for p in done.files] == [f"{s}.{ext}" for s in stems for ext in ("folded", "svg")]
    assert all(p.parent == tmp_path for p in done.files) and done.notes == []
    assert "t (launches)" in (tmp_path / "launches.svg").read_text()
    for name, stem in zip(("cpu", "launches", "offcpu", "wall"), stems, strict=True):
        out = tmp_path / "export" / f"{name}.folded"
        assert main(["export", str(path), "--view", name, "-f", "folded", "-o", str(out)]) == 0
        assert out.read_text() == (tmp_path / f"{stem}.folded").read_text(), name


def test_a_whole_capture_format_is_written_once_and_an_unknown_one_noted(tmp_path: Path) -> None:
    path = tmp_path / "c.aiflame"
    write_capture(path, _capture())
    (tmp_path / "out").mkdir()
    done = write_views(open_capture(path).views("window"), ["folded", "nosuch", "comm-svg"], tmp_path / "out")
    assert done.notes == ["the nosuch exporter is not available in this build"]
    assert [p.name for p in done.files] == ["window.comm.svg", "window.folded", "launches.folded", "offcpu.folded",
                                            "wall.folded"]
    assert all(p.parent == tmp_path / "out" for p in done.files)
