"""The accelerator part of the summary: totals per copy direction, sync call and rank."""

from __future__ import annotations

from rich.console import Console

from aiflame.cli.summary_events import print_events
from aiflame.core.model import EventKind, Frame, Profile, TraceEvent


def test_tables_total_per_key() -> None:
    ev = [
        TraceEvent("scale", EventKind.COMPUTE, 1, 5, 1, 1, stack=(Frame("main"), Frame("launch_scale"))),
        TraceEvent("cudaMemcpy", EventKind.COPY, 2, 2_000_000, 1, 1, args={"bytes": 4096, "direction": "HtoD"}),
        TraceEvent("cudaMemcpy", EventKind.COPY, 3, 1_000_000, 1, 1, args={"bytes": 1024, "direction": "HtoD"}),
        TraceEvent("cudaDeviceSynchronize", EventKind.SYNC, 4, 3_000_000, 1, 1),
        TraceEvent("cudaDeviceSynchronize", EventKind.SYNC, 5, 1_000_000, 1, 1),
        TraceEvent("allreduce", EventKind.COLLECTIVE, 6, 2_000_000, 2, 2, rank=1, args={"bytes": 2048}),
        TraceEvent("allreduce", EventKind.COLLECTIVE, 6, 2_000_000, 3, 3, rank=0, args={"bytes": 2048}),
    ]
    console = Console(width=160, record=True)
    print_events(console, Profile(events=ev))
    lines = [" ".join(line.replace("│", " ").split()) for line in console.export_text().splitlines()]
    assert "1 scale 1× main ; launch_scale" in lines
    assert "HtoD 2 5.0 KiB 3.000" in lines
    assert "cudaDeviceSynchronize 2 4.000 3.000" in lines
    ranks = [line for line in lines if line.startswith("rank ")]
    assert ranks == ["rank 0 allreduce 1 2.0 KiB 2.000", "rank 1 allreduce 1 2.0 KiB 2.000"]


def test_stall_counters_keep_their_bracketed_names() -> None:
    """On the H100 the line read `14586 under  (kernel never seen launched)`: rich took `[unknown launch]` for
    markup."""
    from aiflame.cli.summary_events import print_stalls

    console = Console(width=200, record=True)
    print_stalls(console, Profile(unit="stall samples", counters={"stall_unknown_launch": 7,
                                                                   "cupti_not_issued_samples": 3}))
    text = console.export_text()
    assert "7 under [unknown launch] (kernel never seen launched)" in text
    assert "3 in which no instruction issued (counted once, under their reason)" in text
