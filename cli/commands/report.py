"""`aiflame report comm CAPTURE`: the collective-balance report. Per collective and rank: calls, bytes and time;
ranks whose counts, sizes or times differ from their peers' beyond a threshold are flagged; and the comm plot
(exporters/comm_plot.py) shows where the imbalance is.

`aiflame report sim CAPTURE SIM_LOG`: ASTRA-sim's replay of the capture's Chakra traces beside the capture
(exporters/sim_report.py): per rank, simulated and measured time, and exposed communication."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aiflame.cli.commands import warn
from aiflame.core.errors import NothingToShow, UsageError
from aiflame.core.model import Profile
from aiflame.exporters.comm_plot import CommPlotExporter, Flag, comm_totals, imbalance
from aiflame.exporters.event_totals import human_bytes
from aiflame.exporters.sim_report import Row

NAME = "report"
HELP = "reports over a capture (comm: collective balance across ranks; sim: ASTRA-sim's replay beside it)"
DESCRIPTION = ""
EXAMPLES = ""
__all__ = ["DESCRIPTION", "EXAMPLES", "HELP", "NAME", "add_arguments", "report_comm", "report_sim", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    kinds = p.add_subparsers(dest="report", metavar="REPORT", required=True)
    c = kinds.add_parser("comm", help="collectives per rank: calls, bytes, time; flags imbalance; plots sizes")
    c.add_argument("capture", type=Path, nargs="+",
                   help="a .aiflame capture of a multi-rank job; several (or a directory), one per host: one job")
    c.add_argument("--threshold", type=float, default=0.1,
                   help="flag a rank whose bytes differ from the median rank's by more than this fraction (0.1)")
    c.add_argument("--time-threshold", type=float, default=0.5,
                   help="the same for time spent in the collective (0.5; times are noisier than sizes)")
    c.add_argument("--min-time-ms", type=float, default=5.0,
                   help="ignore time differences smaller than this many ms, whatever their ratio (5)")
    c.add_argument("--plot", type=Path, help="SVG plot of bytes per rank (default: next to the capture, .comm.svg)")
    c.add_argument("--no-plot", action="store_true", help="do not write the plot")
    s = kinds.add_parser("sim", help="ASTRA-sim's replay of the Chakra export beside the capture: per-rank time and "
                         "exposed communication, simulated and measured")
    s.add_argument("capture", type=Path, nargs="+",
                   help="the .aiflame capture the Chakra traces were exported from; several (or a directory), one "
                        "per host, for a job exported from them joined")
    s.add_argument("sim_log", type=Path, metavar="SIM_LOG",
                   help="the simulator's output saved to a file, or its --logging-folder (log.log)")
    s.add_argument("--network", type=Path, metavar="FILE",
                   help="the network file the simulator was given: says whether it was fitted on this capture "
                        "(a reproduction) or on another (a prediction), and counts a calibrated export's host costs "
                        "as communication")


def run(args: argparse.Namespace) -> int:
    from aiflame.cli.stack_view import capture_files, load_job, load_profile

    if args.report == "sim":
        report_sim(load_job(capture_files(args.capture), load_profile), args.sim_log, Console(), args.network)
        return 0
    if args.threshold < 0 or args.time_threshold < 0 or args.min_time_ms < 0:
        raise UsageError("thresholds must be >= 0")
    captures = capture_files(args.capture)
    prof = load_job(captures, load_profile)  # captures, never a folded file
    plot = None if args.no_plot else (args.plot or CommPlotExporter.output_path(captures[0].with_suffix("")))
    report_comm(prof, Console(), args.threshold, args.time_threshold, plot,
                title=f"Collective bytes per rank: {prof.meta.get('target', captures[0].name)}",
                min_time_ms=args.min_time_ms)
    return 0


def report_comm(prof: Profile, console: Console, size_threshold: float, time_threshold: float,
                plot: Path | None, title: str = "", min_time_ms: float = 5.0) -> list[Flag]:
    """Print the table and the flags; write the plot when `plot` is given. Returns the flags."""
    totals = comm_totals(prof)
    if not totals:
        raise NothingToShow("no collectives in this capture (taken with --no-runtimes, or no gloo/NCCL calls?)")
    flags = imbalance(totals, size_threshold, time_threshold, min_time_ms)
    marked = {(f.collective, f.rank, f.what) for f in flags}
    t = Table(title="Collectives per rank", title_justify="left")
    for col, right in (("collective", False), ("rank", True), ("calls", True), ("bytes", True),
                       ("largest", True), ("time ms", True)):
        t.add_column(col, justify="right" if right else "left")

    def cell(text: str, name: str, rank: int, what: str) -> str:
        return f"[bold red]{escape(text)}[/]" if (name, rank, what) in marked else escape(text)

    for name, per in sorted(totals.items()):
        for r, x in sorted(per.items()):
            t.add_row(escape(name), str(r), cell(str(x.calls), name, r, "calls"),
                      cell(human_bytes(x.bytes), name, r, "bytes"), human_bytes(x.max_bytes),
                      cell(f"{x.ns / 1e6:.3f}", name, r, "time ms"))
    console.print(t)
    if flags:
        console.print(f"[bold]imbalance[/] (bytes beyond {size_threshold:.0%}, time beyond {time_threshold:.0%} "
                      f"and {min_time_ms:g} ms of the median rank; any difference in calls):")
        for f in flags:
            console.print("  " + escape(f.text()), highlight=False)
    else:
        console.print("no imbalance: every rank made the same calls with sizes and times within the thresholds")
    if plot is not None:
        CommPlotExporter(title=title, threshold=size_threshold).write(prof, plot)
        console.print(f"wrote {plot}", highlight=False)
    return flags


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _ms(ns: int | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.1f}"


def report_sim(prof: Profile, sim_log: Path, console: Console, network: Path | None = None) -> list[Row]:
    """Print the simulated and measured figures per rank; returns the rows."""
    from aiflame.exporters.chakra_calibration import read_network_file
    from aiflame.exporters.rank_timeline import build_timeline
    from aiflame.exporters.sim_report import Provenance, compare, idle_notes, provenance, read_sim_log
    from aiflame.exporters.sim_report import problems as sim_problems

    timeline = build_timeline(prof)
    sim = read_sim_log(sim_log)
    origin = Provenance(None, "which network was simulated is not known: --network FILE says whether it was "
                        "fitted on this capture (a reproduction) or on another (a prediction)")
    if network is not None:
        origin = provenance(prof, read_network_file(network), str(network))
    rows = compare(timeline, sim, origin.host_ns)
    t = Table(title="ASTRA-sim vs capture, ms", title_justify="left")
    for col in ("rank", "time", "sim", "err", "exposed", "sim", "err", "compute", "idle"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r.rank), _ms(r.measured_ns), _ms(r.simulated_ns), _pct(r.step_error),
                  _ms(r.measured_exposed_ns), _ms(r.simulated_exposed_ns), _pct(r.exposed_error),
                  _ms(r.compute_ns), _ms(r.idle_ns))
    console.print(t)
    console.print("time: from the last rank's first communication call to the rank's last; exposed: communication "
                  "in flight while the rank did not compute; idle: blocked outside communication (not in the trace, "
                  "so not simulated); err: simulated vs measured. Time = compute + exposed + idle; the simulator's "
                  "exposed is its time less the same compute, so the two exposed figures differ by as many ms as "
                  "the simulated time and the time less idle do", highlight=False)
    if origin.host_ns:
        console.print("host costs of the calibrated export (compute nodes to the simulator) are counted in its "
                      "exposed figure: " + ", ".join(f"rank {r} {ns / 1e6:.1f} ms" for r, ns in
                                                     sorted(origin.host_ns.items())), highlight=False)
    console.print(("[bold]" if origin.held_out is False else "") + escape(origin.line) +
                  ("[/]" if origin.held_out is False else ""), highlight=False)
    for line in idle_notes(rows):
        console.print(line, highlight=False)
    for line in sim_problems(timeline, sim):
        warn(line)
    return rows
