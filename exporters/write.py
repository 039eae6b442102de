"""The write step of the road (symbolize/road.py): a capture's views into files in a directory, in the asked
formats of the registry. A whole-capture format (Chakra, the comm plot) is written once, from the first view
(the cpu view); every other format once per view, under the view's file-name stem."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aiflame.core.errors import NothingToShow
from aiflame.exporters import REGISTRY, get_exporter
from aiflame.symbolize.views import View

__all__ = ["Written", "write_views"]


@dataclass(frozen=True)
class Written:
    """What `write_views` made: the views, the files, notes for the user."""

    views: list[View]
    files: list[Path]
    notes: list[str]


def write_views(views: Sequence[View], formats: Sequence[str], out_dir: Path,
                svg_options: Callable[[View], dict[str, object]] = lambda v: {}) -> Written:
    """Write every view in every format into `out_dir` (e.g. profile.folded, launches.svg), a whole-capture format
    (chakra) once from the first view; returns the files written and notes for the user (a format unknown here,
    what an exporter could not write). `svg_options`: the svg exporter's options (title, subtitle) for a view."""
    written: list[Path] = []
    notes = [f"the {name} exporter is not available in this build" for name in formats if name not in REGISTRY]
    known = [REGISTRY[name] for name in formats if name in REGISTRY]
    first = views[0]
    for cls in (c for c in known if c.whole_capture):
        exporter = get_exporter(cls.name)
        try:
            written += [o.path for o in exporter.write(first.profile, cls.output_path(out_dir / first.stem))]
        except NothingToShow as e:  # nothing this format writes: a note here, an error when asked for alone
            notes.append(f"{cls.name}: {e}")
        notes += [f"{cls.name}: {w}" for w in exporter.warnings]
    for view in views:
        for cls in (c for c in known if not c.whole_capture):
            exporter = get_exporter(cls.name, **(svg_options(view) if cls.name == "svg" else {}))
            written += [o.path for o in exporter.write(view.profile, cls.output_path(out_dir / view.stem))]
    return Written(list(views), written, notes)
