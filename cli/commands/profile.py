"""`aiflame profile`: capture a process or a command (agent/session.py), write the asked formats of every view
next to the capture (symbolize/road.py, exporters/write.py), and print the summary."""

from __future__ import annotations

import argparse
import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from aiflame.cli import argtypes
from aiflame.cli.commands import EXAMPLES, warn
from aiflame.cli.stack_view import add_view_options, stack_options
from aiflame.core.errors import BadInput, UsageError
from aiflame.core.limits import LAUNCH_STACKS
from aiflame.exporters import REGISTRY

if TYPE_CHECKING:
    from aiflame.agent.kernel.sampler import SamplerConfig
    from aiflame.agent.session import SessionConfig, SessionResult, SessionStats
    from aiflame.core.model import Profile
    from aiflame.exporters.write import Written
    from aiflame.symbolize.road import SymbolizedCapture
    from aiflame.symbolize.views import View

NAME = "profile"
HELP = "capture CPU stacks of a process or a command"
DESCRIPTION = ""
USAGE = "aiflame profile [options] (--pid PID | -a | -- CMD [ARGS...])"
__all__ = ["DESCRIPTION", "EXAMPLES", "HELP", "NAME", "add_arguments", "run"]


def _delay(text: str) -> float | str:
    """--delay: seconds (> 0), or 'collective'."""
    return "collective" if text == "collective" else argtypes.positive_float(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = USAGE
    tgt = p.add_argument_group("target")
    tgt.add_argument("-p", "--pid", type=int, help="profile this running process and all its threads")
    tgt.add_argument("-a", "--all", action="store_true",
                     help="the whole host: every process (as perf record -a), one flame graph with a tower per "
                          "process; no runtime probes or GPU samples")
    tgt.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS: start CMD and follow its children")
    tgt.add_argument("--keep-running", action="store_true",
                     help="with -- CMD: leave the command running when profile ends or is killed (by default it "
                          "gets SIGTERM then)")
    smp = p.add_argument_group("sampling")
    smp.add_argument("-d", "--duration", type=argtypes.positive_float,
                     help="seconds to capture (default: until exit/Ctrl-C)")
    smp.add_argument("--delay", type=_delay, default=0.0, metavar="SECONDS|collective",
                     help="leave out the CPU samples of the first SECONDS (start-up, imports) to see steady state, "
                          "or with 'collective' those before the first collective call (training started); "
                          "targets are followed and runtime calls recorded from the start; -d counts after it")
    smp.add_argument("-F", "--frequency", type=argtypes.frequency, default=99, help="samples per second per CPU (99)")
    smp.add_argument("--event", choices=("auto", "cpu-clock", "cycles"), default="cpu-clock",
                     help="perf event to sample on: cpu-clock (default), cycles, or auto (cycles if the PMU has it)")
    smp.add_argument("--off-cpu", action="store_true",
                     help="also record where the targets' threads block and for how long (from going to sleep to "
                          "their wakeup, at the sched_switch tracepoint): offcpu.folded/.svg show the blocked "
                          "time, wall.folded/.svg CPU and blocked time in one graph (ns); blocks in CUDA "
                          "synchronization or NCCL end in [off-cpu: cuda sync] or [off-cpu: nccl]. Costs a stack "
                          "walk per block")
    out = p.add_argument_group("output")
    out.add_argument("-o", "--output", type=Path,
                     help="output directory, made if missing (default ./aiflame-YYYYmmdd-HHMMSS); one that already "
                          "holds a capture is refused unless --force")
    out.add_argument("--force", action="store_true",
                     help="replace the capture (and the exports of the same names) an earlier run left in -o DIR")
    out.add_argument("--formats", default="folded,svg",
                     help=f"exports written next to the capture, comma-separated (default folded,svg; "
                          f"known: {', '.join(REGISTRY)})")
    out.add_argument("--title", help="flame graph title")
    out.add_argument("-q", "--quiet", action="store_true", help="no progress line or summary")
    out.add_argument("--print-bpf", action="store_true", help="print the BPF program as compiled and exit")
    rt = p.add_argument_group("accelerator runtimes")
    rt.add_argument("--no-runtimes", action="store_true",
                    help="do not probe CUDA, NCCL, gloo or Level Zero calls (CPU sampling only)")
    rt.add_argument("--launch-stacks", type=argtypes.int_range(0, 1_000_000), default=LAUNCH_STACKS, metavar="N",
                    help=f"kernel launches recorded with their stack per second per CPU (default {LAUNCH_STACKS}; "
                         "0: all); "
                         "launches beyond are counted per GPU kernel in BPF and carried by the next record of "
                         "the same kernel, so counts stay exact and nothing is lost")
    rt.add_argument("--separate-return-probes", action="store_true",
                    help="attach each probed call's return on its own, as on kernels before 6.13, instead of one "
                         "uprobe session link that skips the return of launches counted without a record "
                         "(for comparison)")
    gs = p.add_argument_group("accelerator stall samples (NVIDIA CUPTI in targets started with -- CMD; Intel xe)")
    gs.add_argument("--no-gpu-samples", action="store_true",
                    help="do not load the CUPTI PC-sampling collector into the command, nor open Xe EU stall streams")
    gs.add_argument("--gpu-sample-period", type=argtypes.int_range(5, 31), default=20, metavar="N",
                    help="one sample per SM every 2^N cycles (5-31, default 20: ~1,600 per SM per second at 1.7 GHz)")
    gs.add_argument("--gpu-hw-buffer", type=argtypes.int_range(1 << 20, 1 << 34), default=64 << 20, metavar="BYTES",
                    help="device memory for CUPTI's sample buffer (default 64 MiB; CUPTI's own default is 512 MiB)")
    gs.add_argument("--gpu-stream-limit", type=argtypes.int_range(1 << 20, 1 << 40), default=1 << 30, metavar="BYTES",
                    help="most bytes of samples and cubins one process may write (1 GiB; beyond that, counted drops)")
    add_view_options(p)


def _check_target(pid: int | None) -> None:
    """Root (HostError) and a live target (TargetGone) before anything starts; the session checks them again."""
    from aiflame.agent.session import check_pid, check_root

    check_root()
    if pid is not None:
        check_pid(pid)


def _regular_file(path: Path) -> bool:
    """A file a run of ours wrote (captures are written as regular files, never through a link: something else
    planted under the name is replaced safely, core/safe_files.py)."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def _check_out_dir(out_dir: Path, *, force: bool) -> None:
    """Refuse `-o -` (a directory is written, not a stream), and a directory holding an earlier capture (or one
    cut short) unless `force`: a second run into the same DIR would silently replace the first."""
    from aiflame.agent.session import SessionConfig
    from aiflame.cli.output import is_stdout

    if is_stdout(out_dir):
        raise UsageError("-o names the output directory of profile, not a stream: '-' (stdout) cannot hold a "
                         "capture; export it with `aiflame export CAPTURE -f folded -o -`")
    if force:
        return
    capture = f"{SessionConfig.prefix}.aiflame"
    earlier = [name for name in (capture, f"{capture}.partial") if _regular_file(out_dir / name)]
    if earlier:
        raise BadInput(f"{out_dir} already holds a capture ({earlier[0]}): give another -o DIR, or --force to "
                       "replace it")


def run(args: argparse.Namespace) -> int:
    from aiflame.agent.kernel.sampler import SamplerConfig, bpf_source
    from aiflame.agent.session import Session
    from aiflame.core import limits

    limits.use(limits.AGENT_LIMITS)  # we read what the targets point us at, as root
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.all and (args.pid is not None or command):
        raise UsageError("-a profiles every process: give it without --pid or a command")
    if args.all and args.off_cpu:
        raise UsageError("--off-cpu records where the targets' threads block: give it with --pid or -- CMD, not -a")
    if args.all and args.delay == "collective":
        raise UsageError("--delay collective needs the runtime probes, which -a does not use")
    runtimes = not args.no_runtimes and not args.all  # probes stop a target at library opens: never host-wide
    sampler = SamplerConfig(frequency=args.frequency, event=args.event, follow_children=bool(command),
                            probes=runtimes, call_rate=args.launch_stacks, all_processes=args.all,
                            off_cpu=args.off_cpu, session_links=False if args.separate_return_probes else None)
    if args.print_bpf:
        print(bpf_source(sampler))
        return 0
    if args.pid is not None and command:
        raise UsageError("give either --pid PID or -- CMD, not both")
    if args.pid is None and not command and not args.all:
        raise UsageError("nothing to profile: give --pid PID, -a (every process) or -- CMD ARGS")
    formats = [f for f in args.formats.split(",") if f]
    for f in formats:
        if f not in REGISTRY:
            raise UsageError(f"unknown format {f!r} (known: {', '.join(REGISTRY)})")
    out_dir = args.output or Path(time.strftime("aiflame-%Y%m%d-%H%M%S"))
    _check_out_dir(out_dir, force=args.force)
    _check_target(args.pid)
    if args.delay == "collective" and args.no_runtimes:
        raise UsageError("--delay collective needs the runtime probes (it waits for a gloo or NCCL call)")
    cfg = _session_config(args, out_dir, command, sampler)
    progress = _Progress(Console(stderr=True), quiet=args.quiet)
    with progress:
        result = Session(cfg, on_progress=progress.update, on_status=progress.status).run()
    capture, done = _write_views(args, cfg, result, formats, progress)
    if not args.quiet:
        _report(Console(), capture.profile, result, done)
    return 0


def _session_config(args: argparse.Namespace, out_dir: Path, command: list[str],
                    sampler: SamplerConfig) -> SessionConfig:
    from aiflame.agent.accel.cupti import CuptiOptions
    from aiflame.agent.session import SessionConfig

    return SessionConfig(out_dir=out_dir, pid=args.pid, command=command, duration_s=args.duration,
                         delay_s=0.0 if args.delay == "collective" else args.delay,
                         from_first_collective=args.delay == "collective",
                         sampler=sampler, argv=["aiflame", *args.argv], runtimes=sampler.probes,
                         gpu_samples=not args.no_gpu_samples and not args.all, keep_running=args.keep_running,
                         all_processes=args.all,
                         cupti=CuptiOptions(period_log2=args.gpu_sample_period, hw_buffer_bytes=args.gpu_hw_buffer,
                                            max_stream_bytes=args.gpu_stream_limit))


def _write_views(args: argparse.Namespace, cfg: SessionConfig, result: SessionResult, formats: list[str],
                 progress: _Progress) -> tuple[SymbolizedCapture, Written]:
    """The capture just written, symbolized, and its views in `formats` beside it (symbolize/road.py,
    exporters/write.py); what the exporters could not write joins the session's warnings."""
    from aiflame.exporters.write import write_views
    from aiflame.symbolize.road import open_capture, symbolizer

    progress.phase(f"symbolizing {result.stats.samples} samples")
    capture = open_capture(result.capture, stack_options(args), symbolizer(args.debug_dir))
    result.warnings.extend(capture.warnings)
    target = cfg.command and " ".join(cfg.command) or ("all processes" if args.all else f"pid {args.pid}")

    def svg_options(v: View) -> dict[str, object]:
        rate = f" at {args.frequency} Hz" if v.name == "cpu" else ""
        return {"title": args.title or f"aiflame: {target}{v.label}",
                "subtitle": f"{v.what}{rate}, {result.stats.elapsed_s:.1f} s, {result.stop_reason}"}

    progress.phase(f"writing {', '.join(formats) or 'the capture'} to {cfg.out_dir}")
    done = write_views(capture.views(cfg.prefix), formats, cfg.out_dir, svg_options)
    result.warnings.extend(done.notes)
    return capture, done


def _report(console: Console, prof: Profile, result: SessionResult, done: Written) -> None:
    """The summary, what was probed, the warnings, why it stopped and the files written."""
    from aiflame.cli.summary import print_summary

    stalls = next((v.profile for v in done.views if v.name == "stalls"), None)
    print_summary(console, prof, agent_cpu_s=result.agent_cpu_s, elapsed_s=result.stats.elapsed_s, stalls=stalls)
    probed = [a for a in result.probed if a.runtime != "process"]
    if probed:
        libs = (f"{os.path.basename(a.path)} ({a.runtime}, {len(a.calls)} entry points)" for a in probed)
        console.print("probed: " + "; ".join(libs), highlight=False)
    for w in result.warnings:
        warn(w)
    console.print(f"stopped: {result.stop_reason} after {result.stats.elapsed_s:.1f} s")
    for p in [result.capture, *done.files]:
        console.print(f"wrote {p}", highlight=False)
    if result.exit_code not in (None, 0):
        console.print(f"[yellow]the command exited with status {result.exit_code}[/]")


class _Progress:
    """A one-line live status on stderr: elapsed time, samples, lost samples, processes. Without a terminal, one
    line per phase (starting the sampler, compiling, sampling, symbolizing, writing); nothing with -q."""

    def __init__(self, console: Console, quiet: bool) -> None:
        self.console = console
        self.silent = quiet
        self.quiet = quiet or not console.is_terminal
        self._status = None if self.quiet else console.status("starting BPF sampler…")
        self._sampling = False

    def phase(self, line: str) -> None:
        """A new phase: its line printed once without a terminal (the live status has ended by then)."""
        if not self.silent and not self._status:
            self.console.print(f"aiflame: {line}…", highlight=False, markup=False, soft_wrap=True)

    def status(self, line: str) -> None:
        """What start-up is waiting for (e.g. compiling the BPF program: seconds)."""
        if self.silent:
            return
        if self._status:
            self._status.update(line + "…")
        else:
            self.console.print(f"aiflame: {line}…", highlight=False, markup=False, soft_wrap=True)

    def __enter__(self) -> _Progress:
        if self._status:
            self._status.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status:
            self._status.__exit__(None, None, None)

    def update(self, s: SessionStats) -> None:
        if not self._sampling:
            self._sampling = True
            self.phase("sampling (Ctrl-C to stop)")
        if self._status:
            self._status.update(f"profiling  {s.elapsed_s:6.1f} s  samples {s.samples}  lost {s.lost}  "
                                f"processes {s.pids}  (Ctrl-C to stop)")
