"""Output formats. `REGISTRY` is the one list of them: a new format is its module plus one line here."""

from __future__ import annotations

from collections.abc import Sequence

from aiflame.core.errors import BadInput

from .base import Exporter, Option, Output, frame_label
from .chakra import ChakraExporter
from .comm_plot import CommPlotExporter
from .folded import FoldedExporter
from .perfetto import PerfettoExporter, PerfettoJsonExporter
from .pprof import PprofExporter
from .speedscope import SpeedscopeExporter
from .svg import SvgExporter

__all__ = [
    "REGISTRY",
    "Exporter",
    "Option",
    "Output",
    "frame_label",
    "get_exporter",
    "parse_option_values",
]

REGISTRY: dict[str, type[Exporter]] = {
    cls.name: cls
    for cls in (
        FoldedExporter,
        SvgExporter,
        SpeedscopeExporter,
        PprofExporter,
        ChakraExporter,
        CommPlotExporter,
        PerfettoExporter,
        PerfettoJsonExporter,
    )
}


def _exporter_class(name: str) -> type[Exporter]:
    cls = REGISTRY.get(name)
    if cls is None:
        raise BadInput(f"unknown format {name!r}; choose from: {', '.join(sorted(REGISTRY))}")
    return cls


def _option(cls: type[Exporter], key: str) -> Option:
    for opt in cls.options:
        if opt.name == key:
            return opt
    valid = ", ".join(o.name for o in cls.options) or "none"
    raise BadInput(f"format {cls.name!r} has no option {key!r}; valid options: {valid}")


def get_exporter(name: str, **options: object) -> Exporter:
    """An exporter for format `name` configured with `options`; raises BadInput for bad names/options."""
    cls = _exporter_class(name)
    checked = {key: _option(cls, key).check(value) for key, value in options.items()}
    return cls(**checked)


def parse_option_values(cls: type[Exporter], pairs: Sequence[str]) -> dict[str, object]:
    """Convert CLI `key=value` strings to typed keyword arguments for `cls`; raises BadInput if bad."""
    values: dict[str, object] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise BadInput(f"option {pair!r}: expected key=value")
        opt = _option(cls, key.strip())
        values[opt.name] = opt.parse(text)
    return values
