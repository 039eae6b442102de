"""The collective-balance report: totals per collective and rank, flags for ranks whose counts, sizes or times
stand out, the plot, and the CLI's one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from aiflame.cli.commands.report import report_comm
from aiflame.core.errors import NothingToShow
from aiflame.core.model import Profile
from aiflame.exporters.comm_plot import comm_totals, imbalance, plot_svg
from tests.unit.test_chakra import ev, gloo_job


def test_totals_and_flags_point_at_the_uneven_ranks() -> None:
    # Oracle: by construction — gloo_job's uneven all-to-all (1000 and 2000 bytes) and one-way send
    prof = gloo_job()
    totals = comm_totals(prof)
    assert (totals["alltoallv"][0].bytes, totals["alltoallv"][1].bytes) == (1000, 2000)
    assert totals["allreduce"][0].calls == totals["allreduce"][1].calls == 1
    flags = imbalance(totals, 0.1, 10.0)
    # uneven all-to-all splits; a send one way only (each rank made it or its peer's receive)
    assert {(f.collective, f.rank, f.what) for f in flags} == {
        ("alltoallv", 0, "bytes"), ("alltoallv", 1, "bytes"),
        *((c, r, w) for c in ("send", "recv") for r in (0, 1) for w in ("calls", "bytes"))}
    assert {round(f.deviation, 3) for f in flags if f.collective == "alltoallv"} == {-0.333, 0.333}


def test_count_mismatch_and_straggler_time_in_four_ranks() -> None:
    # Oracle: by construction — rank 0 makes one call more, rank 2 takes 9 times as long
    prof = Profile()
    for r in range(4):
        prof.events += [ev(r, "allreduce", 1000 * i, 100 if r != 2 else 900, bytes=64) for i in range(3 if r else 4)]
    flags = imbalance(comm_totals(prof), 0.1, 0.5, min_time_ms=0)
    assert {(f.rank, f.what) for f in flags} == {(0, "calls"), (0, "bytes"), (2, "time ms")}
    # the default floor (5 ms) keeps sub-microsecond jitter on a tiny collective from being flagged
    flags = imbalance(comm_totals(prof), 0.1, 0.5)
    assert {(f.rank, f.what) for f in flags} == {(0, "calls"), (0, "bytes")}


def test_report_prints_and_plots(tmp_path: Path) -> None:
    # Oracle: by construction — gloo_job's all-to-all: 2000 bytes against a median of 1500
    console = Console(record=True, width=140)
    plot = tmp_path / "comm.svg"
    flags = report_comm(gloo_job(), console, 0.1, 10.0, plot)
    text = console.export_text()
    assert "alltoallv: rank 1 bytes 2000 vs median 1500 (+33%)" in text and flags
    svg = plot.read_text()
    assert svg.startswith("<svg") and svg.count("<rect") == 2 * len(comm_totals(gloo_job()))
    assert svg.count('stroke="#d62728"') == 6  # alltoallv, send, recv on both ranks
    assert plot_svg({}, []).startswith("<svg")


def test_no_collectives_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(NothingToShow, match="no collectives"):
        report_comm(Profile(), Console(), 0.1, 0.5, None)
