"""The exporter registry and option handling the CLI relies on."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from aiflame.core.model import Frame, FrameKind, Profile, Sample
from aiflame.exporters import REGISTRY, Exporter, ExportError, Option, get_exporter, parse_option_values
from aiflame.exporters.folded import FoldedExporter
from aiflame.exporters.speedscope import SpeedscopeExporter
from aiflame.exporters.svg import SvgExporter

PROFILE = Profile(
    samples=[
        Sample((Frame("main"), Frame("work"), Frame("read", FrameKind.KERNEL)), 3, pid=1, comm="app"),
        Sample((Frame("main"),), 1, pid=1, comm="app"),
    ]
)


def test_registry_holds_the_formats() -> None:
    assert {"folded", "svg", "speedscope"} <= set(REGISTRY)
    assert REGISTRY["folded"] is FoldedExporter
    assert REGISTRY["svg"] is SvgExporter
    assert REGISTRY["speedscope"] is SpeedscopeExporter


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


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_exporter_renders_and_writes(name: str, tmp_path: Path) -> None:
    exporter = get_exporter(name)
    assert isinstance(exporter, Exporter)
    data = exporter.render(PROFILE)
    assert data
    path = tmp_path / f"out{exporter.extension}"
    exporter.write(PROFILE, path)
    assert path.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    exporter.render(Profile())  # an empty profile is not an error


def test_unknown_format_lists_the_valid_ones() -> None:
    with pytest.raises(ExportError, match="unknown format 'flame'") as info:
        get_exporter("flame")
    for name in REGISTRY:
        assert name in str(info.value)


def test_unknown_option_lists_the_valid_ones() -> None:
    with pytest.raises(ExportError, match="no option 'colour'") as info:
        get_exporter("svg", colour="red")
    assert "minwidth" in str(info.value) and "title" in str(info.value)
    with pytest.raises(ExportError, match="valid options: none"):
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
    with pytest.raises(ExportError, match=message):
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
    with pytest.raises(ExportError, match=message) as info:
        parse_option_values(SvgExporter, [pair])
    assert "\n" not in str(info.value)


def test_export_error_is_a_value_error() -> None:
    assert issubclass(ExportError, ValueError)


def test_option_is_immutable() -> None:
    opt = Option("x", int, 1, "help")
    with pytest.raises(AttributeError):
        opt.name = "y"  # type: ignore[misc]
