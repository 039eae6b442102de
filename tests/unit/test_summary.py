"""The end-of-capture summary's unwinder line: where most early walks stopped, named even when no file holds it."""

from __future__ import annotations

import io

from rich.console import Console

from aiflame.cli.summary import print_summary
from aiflame.core.model import Profile
from aiflame.core.raw import RawSample
from aiflame.core.unwind import END, STOPS
from aiflame.symbolize.unwind_report import unwind_report

NO_MAPPING = next(code for code, (key, _) in STOPS.items() if key == "no_mapping")


def _sample(unwind: int) -> RawSample:
    return RawSample(0, 1, 1, 0, "p", (0x1000, 0xdead0000), (), unwind=unwind)


def test_a_walk_that_stopped_in_no_file_is_named_unknown() -> None:
    counters, worst = unwind_report([_sample(NO_MAPPING), _sample(END)], lambda s: "")
    assert worst == "[unknown] (1 samples: no mapping)"
    assert counters["unwind_cfi"] == 2 and counters["unwind_no_mapping"] == 1 and counters["unwind_end"] == 1


def test_the_summary_prints_bracketed_names_as_text() -> None:
    """Rich read `[no mapping]` as markup and printed `most in  (1 samples: no mapping)`."""
    prof = Profile(counters={"unwind_cfi": 2, "unwind_end": 1, "unwind_no_mapping": 1},
                   meta={"unwind_worst": "[unknown] (1 samples: no mapping)"})
    buf = io.StringIO()
    print_summary(Console(file=buf, width=300), prof)
    out = buf.getvalue()
    assert "stopped early: no mapping 1; most in [unknown] (1 samples: no mapping)" in out
