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


def test_unwind_line_says_tables_evicted_again_and_brought_back() -> None:
    from aiflame.cli.summary import unwind_line
    from aiflame.core.model import Profile

    prof = Profile(unit="samples")
    prof.counters.update({"unwind_cfi": 100, "unwind_end": 90, "unwind_evicted": 10, "unwind_tables": 7,
                          "unwind_rows": 1 << 20, "unwind_tables_evicted": 20, "unwind_tables_evicted_again": 3,
                          "unwind_tables_reloaded": 5})
    line = unwind_line(prof)
    assert "7 file tables, 8 MiB in BPF, 20 evicted (3 of them again), 5 back when walks stopped at them" in line
    assert "evicted 10" in line  # the walks that stopped at an evicted table
    prof.counters.update({"unwind_tables_evicted_again": 0, "unwind_tables_reloaded": 0})
    assert "again" not in unwind_line(prof) and "back when" not in unwind_line(prof)


def test_the_summary_says_how_long_targets_were_held() -> None:
    prof = Profile(counters={"stops": 172, "stopped_ms": 1637})
    buf = io.StringIO()
    print_summary(Console(file=buf, width=300), prof)
    assert "targets held stopped 172 times, 1637 ms in all" in buf.getvalue()
    buf = io.StringIO()
    print_summary(Console(file=buf, width=300), Profile(counters={}))
    assert "held stopped" not in buf.getvalue()  # no probes, no stops: no line
