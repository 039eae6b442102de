"""The exporter registry and option handling the CLI relies on."""

from __future__ import annotations

import inspect
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from aiflame.core.errors import BadInput, NothingToShow
from aiflame.core.model import Frame, FrameKind, Profile, Sample
from aiflame.exporters import (
    REGISTRY,
    Exporter,
    Option,
    Output,
    get_exporter,
    parse_option_values,
)
from aiflame.exporters.chakra import ChakraExporter, write_traces
from aiflame.exporters.comm_plot import CommPlotExporter, comm_totals, imbalance, plot_svg
from aiflame.exporters.folded import FoldedExporter
from aiflame.exporters.speedscope import SpeedscopeExporter
from aiflame.exporters.svg import SvgExporter
from tests.unit.test_chakra import gloo_job

PROFILE = Profile(
    samples=[
        Sample((Frame("main"), Frame("work"), Frame("read", FrameKind.KERNEL)), 3, pid=1, comm="app"),
        Sample((Frame("main"),), 1, pid=1, comm="app"),
    ]
)


def test_registry_holds_the_formats() -> None:
    assert {"folded", "svg", "speedscope", "pprof", "chakra", "comm-svg"} <= set(REGISTRY)
    assert REGISTRY["folded"] is FoldedExporter
    assert REGISTRY["svg"] is SvgExporter
    assert REGISTRY["speedscope"] is SpeedscopeExporter
    assert REGISTRY["chakra"] is ChakraExporter
    assert REGISTRY["comm-svg"] is CommPlotExporter


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_exporter_declarations_are_consistent(name: str) -> None:
    cls = REGISTRY[name]
    assert cls.name == name
    assert cls.extension.startswith(".") and cls.extension == cls.extension.lower()
    assert cls.description and "\n" not in cls.description
    # `options` must describe the constructor exactly: the CLI builds keyword arguments from it.
    params = {
        p.name: p.default
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    assert {o.name: o.default for o in cls.options} == params
    for opt in cls.options:
        assert opt.type in (int, float, str, bool)
        assert type(opt.default) is opt.type
        assert opt.help


@pytest.mark.parametrize("name", sorted(n for n, cls in REGISTRY.items() if not cls.writes_many))
def test_every_exporter_renders_and_writes(name: str, tmp_path: Path) -> None:
    exporter = get_exporter(name)
    assert isinstance(exporter, Exporter)
    data = exporter.render(PROFILE)
    assert data
    path = exporter.output_path(tmp_path / "out")
    assert path == tmp_path / f"out{exporter.extension}"
    assert exporter.write(PROFILE, path) == [Output(path, exporter.summary(PROFILE))]
    assert path.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    exporter.render(Profile())  # an empty profile is not an error


def test_chakra_through_the_registry(tmp_path: Path) -> None:
    """One file per rank under a prefix, the same bytes as write_traces, a summary of node types per file."""
    exporter = get_exporter("chakra")
    assert exporter.writes_many and exporter.whole_capture
    prefix = exporter.output_path(tmp_path / "job")
    assert prefix == tmp_path / "job"
    written = exporter.write(gloo_job(), prefix)
    assert [o.path.name for o in written] == ["job.0.et", "job.1.et", "job.network.yml"]
    ets = written[:2]
    assert all(o.summary.startswith(f"rank {r}: ") and "COMM_COLL" in o.summary for r, o in enumerate(ets))
    files, _ = write_traces(gloo_job(), tmp_path / "direct")
    assert [f.read_bytes() for f in files] == [o.path.read_bytes() for o in ets]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["job.0.et", "job.1.et", "job.network.yml", *(f.name for f in files), "direct.network.yml"])
    with pytest.raises(BadInput, match="one file per rank"):
        exporter.render(gloo_job())
    with pytest.raises(NothingToShow, match="nothing for a Chakra trace"):
        exporter.write(PROFILE, tmp_path / "none")


def test_comm_plot_through_the_registry(tmp_path: Path) -> None:
    """The comm plot is an exporter like the others: options, default path, the report's plot byte for byte."""
    exporter = get_exporter("comm-svg", **parse_option_values(CommPlotExporter, ["title=job", "threshold=0.1"]))
    assert exporter.whole_capture and not exporter.writes_many
    path = exporter.output_path(tmp_path / "profile")
    assert path.name == "profile.comm.svg"
    [out] = exporter.write(gloo_job(), path)
    assert out == Output(path, "8 collectives on 2 ranks")
    totals = comm_totals(gloo_job())
    assert path.read_text() == plot_svg(totals, imbalance(totals, 0.1), "job")
    svg = path.read_text()
    assert svg.startswith("<svg") and 'font-family: Verdana, sans-serif' in svg and "<title>job" not in svg
    assert svg.count('stroke="#d62728"') == 6
    ET.fromstring(svg)  # well-formed
    with pytest.raises(BadInput, match="option threshold"):
        get_exporter("comm-svg", threshold=-1.0)


def test_comm_plot_escapes_names() -> None:
    prof = gloo_job()
    for e in prof.events:
        e.name = "all<reduce>&\x01"
    root = ET.fromstring(CommPlotExporter(title="a<b").render(prof))
    texts = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "a<b" in texts and "all<reduce>&\ufffd" in texts


def test_unknown_format_lists_the_valid_ones() -> None:
    with pytest.raises(BadInput, match="unknown format 'flame'") as info:
        get_exporter("flame")
    for name in REGISTRY:
        assert name in str(info.value)


def test_unknown_option_lists_the_valid_ones() -> None:
    with pytest.raises(BadInput, match="no option 'colour'") as info:
        get_exporter("svg", colour="red")
    assert "minwidth" in str(info.value) and "title" in str(info.value)
    with pytest.raises(BadInput, match="valid options: none"):
        get_exporter("speedscope", title="x")


def test_get_exporter_configures_the_instance() -> None:
    svg = get_exporter("svg", title="T", minwidth=2, inverted=True)
    assert isinstance(svg, SvgExporter)
    assert svg.title == "T" and svg.inverted is True
    assert svg.minwidth == 2.0 and isinstance(svg.minwidth, float)  # ints are fine for floats


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"width": "800"}, "option width: expected int"),
        ({"width": True}, "option width: expected int"),
        ({"minwidth": False}, "option minwidth: expected float"),
        ({"inverted": 1}, "option inverted: expected bool"),
        ({"title": 3}, "option title: expected str"),
    ],
)
def test_get_exporter_checks_types(options: dict[str, object], message: str) -> None:
    with pytest.raises(BadInput, match=message):
        get_exporter("svg", **options)


def test_parse_option_values_converts_by_type() -> None:
    values = parse_option_values(
        SvgExporter, ["minwidth=0.5", "width=800", "inverted=yes", "title=a=b c", "lines=0"]
    )
    assert values == {"minwidth": 0.5, "width": 800, "inverted": True, "title": "a=b c", "lines": False}
    exporter = get_exporter("svg", **values)
    assert isinstance(exporter, SvgExporter) and exporter.title == "a=b c"
    assert parse_option_values(SvgExporter, []) == {}


@pytest.mark.parametrize(("text", "value"), [("1", True), ("TRUE", True), ("Yes", True), ("on", True),
                                             ("0", False), ("false", False), ("no", False), ("off", False)])
def test_bool_words(text: str, value: bool) -> None:
    assert parse_option_values(FoldedExporter, [f"separator={text}"]) == {"separator": value}


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        ("minwidth", "expected key=value"),
        ("colour=red", "no option 'colour'"),
        ("width=wide", "option width: expected an integer"),
        ("width=1.5", "option width: expected an integer"),
        ("minwidth=x", "option minwidth: expected a number"),
        ("inverted=maybe", "option inverted: expected a boolean"),
    ],
)
def test_parse_option_values_rejects(pair: str, message: str) -> None:
    with pytest.raises(BadInput, match=message) as info:
        parse_option_values(SvgExporter, [pair])
    assert "\n" not in str(info.value)


def test_option_is_immutable() -> None:
    opt = Option("x", int, 1, "help")
    with pytest.raises(AttributeError):
        opt.name = "y"  # type: ignore[misc]
