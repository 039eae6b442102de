"""The accelerator part of the summary: totals per copy direction, sync call and rank."""

from __future__ import annotations

from rich.console import Console

from aiflame.cli.summary_events import print_events
from aiflame.core.model import EventKind, Frame, Profile, TraceEvent


def test_tables_total_per_key() -> None:
    # Oracle: by construction — copies, syncs and collectives with their sizes and times put in here
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


def test_launch_records_count_the_launches_they_stand_for() -> None:
    """A record kept past the launch budget stands for the launches BPF counted since its kernel's last record
    (args "calls"): the launch view and the summary count launches, not records."""
    # Oracle: by construction — records standing for the launches BPF counted (args "calls")
    from aiflame.core.model import SEPARATOR
    from aiflame.symbolize.events import UNSAMPLED_LAUNCH, launch_profile

    a = (Frame("main"), Frame("launch_scale"))
    ev = [TraceEvent("scale", EventKind.COMPUTE, 1, 5, 1, 1, stack=a, args={"calls": 40}),
          TraceEvent("scale", EventKind.COMPUTE, 2, 5, 1, 1, stack=a),
          TraceEvent("scale", EventKind.COMPUTE, 9, 0, 1, 0, stack=(UNSAMPLED_LAUNCH,),
                     args={"calls": 3, "stackless": 1})]
    assert [e.calls for e in ev] == [40, 1, 3]
    view = launch_profile(Profile(events=ev))
    assert view.total_weight == 44
    assert {(s.stack[:-2], s.weight) for s in view.samples} == {(a, 40), (a, 1), ((UNSAMPLED_LAUNCH,), 3)}
    assert all(s.stack[-2] == SEPARATOR for s in view.samples)
    console = Console(width=160, record=True)
    print_events(console, Profile(events=ev))
    text = console.export_text()
    assert "Kernels by launches (44 launches)" in text and "41× main ; launch_scale" in text
