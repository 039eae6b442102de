"""The `aiflame` command. Subcommands only wire parts together; `main(argv)` is callable from tests."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from aiflame import __version__
from aiflame.agent.accel.cupti import CuptiOptions
from aiflame.agent.kernel.sampler import SamplerConfig, SamplerError, bpf_source
from aiflame.agent.outputs import CHAKRA, FORMATS, View, capture_views, write_views
from aiflame.agent.session import Session, SessionConfig, SessionError, SessionStats
from aiflame.cli import argtypes
from aiflame.cli.report_cmd import ReportError
from aiflame.core.capture import MAGIC, CaptureError, read_capture
from aiflame.core.model import EventKind, Profile
from aiflame.exporters import REGISTRY, get_exporter, parse_option_values
from aiflame.exporters.base import ExportError
from aiflame.exporters.chakra import node_types, write_traces
from aiflame.exporters.folded import parse_folded
from aiflame.exporters.obfuscate import ObfuscateError
from aiflame.exporters.svg import SvgExporter
from aiflame.symbolize.annotate import AnnotateError
from aiflame.symbolize.errors import SymbolizeError
from aiflame.symbolize.events import launch_profile
from aiflame.symbolize.native import NativeSymbolizer
from aiflame.symbolize.stacks import StackOptions, symbolize_capture

USER_ERRORS = (CaptureError, SamplerError, SessionError, ExportError, SymbolizeError, ObfuscateError, ReportError,
               AnnotateError)

EXAMPLES = """examples:
  aiflame profile --pid 1234 -d 30            profile a running process for 30 s
  aiflame profile -F 999 -- ./train.sh --fast start a command and profile it until it exits
  aiflame export out/profile.aiflame --format speedscope -o prof.json
  aiflame export out/profile.aiflame --format chakra -o traces/job   one traces/job.<rank>.et per rank
  aiflame report comm out/profile.aiflame     collectives per rank, imbalance flagged, plot
  aiflame annotate out/profile.aiflame hot_loop   a function's instructions with their samples
  aiflame render out/profile.folded -o flame.svg --opt title="my job"
  aiflame doctor                              what this host supports
"""


def _add_view_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("stack view")
    g.add_argument("--group", choices=("process", "thread", "none"), default="process",
                   help="root frames: process name (default), process and thread, or none")
    g.add_argument("--no-kernel", action="store_true", help="leave kernel frames out")
    g.add_argument("--python", choices=("merged", "python", "native"), default="merged",
                   help="Python frames merged into native stacks (default), Python frames only, or native only")
    g.add_argument("--debug-dir", action="append", default=[], metavar="DIR",
                   help="extra directory of separate debug files (DIR/.build-id/xx/yyyy.debug); repeatable")
    g.add_argument("--view", choices=("cpu", "launches", "stalls", "combined"), default="cpu",
                   help="cpu: CPU samples (default); launches: accelerator kernel launches, "
                        "<CPU stack> ; - ; <kernel>, weighted by launch count; stalls: accelerator stall samples "
                        "on their launch stacks (the AI flame graph); combined: CPU and stall samples together")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiflame", description="Low-overhead eBPF profiler for AI hosts: CPU stacks and flame graphs.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"aiflame {__version__}")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")

    p = sub.add_parser("profile", help="capture CPU stacks of a process or a command",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                       usage="aiflame profile [options] (--pid PID | -- CMD [ARGS...])")
    tgt = p.add_argument_group("target")
    tgt.add_argument("-p", "--pid", type=int, help="profile this running process and all its threads")
    tgt.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS: start CMD and follow its children")
    smp = p.add_argument_group("sampling")
    smp.add_argument("-d", "--duration", type=argtypes.positive_float,
                     help="seconds to capture (default: until exit/Ctrl-C)")
    smp.add_argument("-F", "--frequency", type=argtypes.frequency, default=99, help="samples per second per CPU (99)")
    smp.add_argument("--event", choices=("auto", "cpu-clock", "cycles"), default="cpu-clock",
                     help="perf event to sample on: cpu-clock (default), cycles, or auto (cycles if the PMU has it)")
    out = p.add_argument_group("output")
    out.add_argument("-o", "--output", type=Path, help="output directory (default ./aiflame-YYYYmmdd-HHMMSS)")
    out.add_argument("--formats", default="folded,svg",
                     help=f"exports written next to the capture, comma-separated (default folded,svg; "
                          f"known: {', '.join(FORMATS)})")
    out.add_argument("--title", help="flame graph title")
    out.add_argument("-q", "--quiet", action="store_true", help="no progress line or summary")
    out.add_argument("--print-bpf", action="store_true", help="print the BPF program as compiled and exit")
    rt = p.add_argument_group("accelerator runtimes")
    rt.add_argument("--no-runtimes", action="store_true",
                    help="do not probe CUDA, NCCL, gloo or Level Zero calls (CPU sampling only)")
    gs = p.add_argument_group("accelerator stall samples (NVIDIA CUPTI in targets started with -- CMD; Intel xe)")
    gs.add_argument("--no-gpu-samples", action="store_true",
                    help="do not load the CUPTI PC-sampling collector into the command, nor open Xe EU stall streams")
    gs.add_argument("--gpu-sample-period", type=argtypes.int_range(5, 31), default=20, metavar="N",
                    help="one sample per SM every 2^N cycles (5-31, default 20: ~1,600 per SM per second at 1.7 GHz)")
    gs.add_argument("--gpu-hw-buffer", type=argtypes.int_range(1 << 20, 1 << 34), default=64 << 20, metavar="BYTES",
                    help="device memory for CUPTI's sample buffer (default 64 MiB; CUPTI's own default is 512 MiB)")
    gs.add_argument("--gpu-stream-limit", type=argtypes.int_range(1 << 20, 1 << 40), default=1 << 30, metavar="BYTES",
                    help="most bytes of samples and cubins one process may write (1 GiB; beyond that, counted drops)")
    _add_view_options(p)

    e = sub.add_parser("export", help="re-export a saved capture in another format")
    e.add_argument("capture", type=Path, help="a .aiflame capture file")
    e.add_argument("-f", "--format", required=True, help=f"one of: {', '.join(FORMATS)}")
    e.add_argument("-o", "--output", type=Path,
                   help="output file (default: capture name + extension); for chakra a prefix: PREFIX.<rank>.et")
    e.add_argument("--obfuscate", action="store_true",
                   help="replace function, kernel, file and process names with stable keyed hashes (for sharing)")
    e.add_argument("--key-file", type=Path, metavar="PATH",
                   help="obfuscation key, made (0600) if absent; it stays on this host "
                        "(default ~/.config/aiflame/obfuscate.key)")
    e.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="exporter option, repeatable (e.g. --opt minwidth=0.5)")
    _add_view_options(e)

    r = sub.add_parser("render", help="flame graph SVG from a capture or a folded file")
    r.add_argument("input", type=Path, nargs="?", help="a .aiflame capture or a folded-stacks file")
    r.add_argument("-o", "--output", type=Path, required=True, help="SVG file to write")
    r.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="SVG option, repeatable")
    r.add_argument("--diff", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                   help="differential flame graph: AFTER's widths, coloured red where it grew and blue where it "
                        "shrank against BEFORE (captures or folded files; totals normalized, see --opt normalize)")
    _add_view_options(r)

    from aiflame.cli import annotate_cmd, daemon_cmd, gpu_symbols_cmd, import_cmd
    annotate_cmd.add_parser(sub)
    gpu_symbols_cmd.add_parser(sub)
    import_cmd.add_parser(sub)
    daemon_cmd.add_parser(sub)
    from aiflame.cli import report_cmd
    report_cmd.add_parser(sub)
    sub.add_parser("doctor", help="check what this host supports and what to fix")
    return parser


def _fail(_console: Console, msg: str, code: int = 1) -> int:
    """One line on stderr and the exit status."""
    from rich.markup import escape

    Console(stderr=True).print(f"[bold red]aiflame: error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    return code


def _view(args: argparse.Namespace) -> StackOptions:
    return StackOptions(group=args.group, kernel=not args.no_kernel, python=args.python)


def _load_profile(path: Path, args: argparse.Namespace) -> Profile:
    """A capture file, or (for render) a folded file."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise CaptureError(f"{path}: {e.strerror}") from None
    if head == MAGIC or args.cmd == "export":
        native = NativeSymbolizer(debug_dirs=[*args.debug_dir, "/usr/lib/debug"])
        cap = read_capture(path)
        prof = symbolize_capture(cap, native, options=_view(args))
        if args.view in ("stalls", "combined"):
            from aiflame.symbolize.stalls import stall_view

            return stall_view(cap, prof, args.view)
        if args.view == "launches":
            if not any(e.kind == EventKind.COMPUTE for e in prof.events):
                raise CaptureError(f"{path}: no kernel launches in this capture (the launch view is empty)")
            return launch_profile(prof)
        return prof
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise CaptureError(f"{path}: neither an aiflame capture nor a folded-stacks file") from None
    return parse_folded(text)


def cmd_profile(args: argparse.Namespace, argv: Sequence[str], console: Console) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    sampler = SamplerConfig(frequency=args.frequency, event=args.event, follow_children=bool(command),
                            probes=not args.no_runtimes)
    if args.print_bpf:
        print(bpf_source(sampler))
        return 0
    if args.pid is not None and command:
        return _fail(console, "give either --pid PID or -- CMD, not both", 2)
    if args.pid is None and not command:
        return _fail(console, "nothing to profile: give --pid PID or -- CMD ARGS", 2)
    formats = [f for f in args.formats.split(",") if f]
    for f in formats:
        if f not in FORMATS:
            return _fail(console, f"unknown format {f!r} (known: {', '.join(FORMATS)})", 2)
    out_dir = args.output or Path(time.strftime("aiflame-%Y%m%d-%H%M%S"))
    cfg = SessionConfig(out_dir=out_dir, pid=args.pid, command=command, duration_s=args.duration,
                        sampler=sampler, argv=["aiflame", *argv], runtimes=not args.no_runtimes,
                        gpu_samples=not args.no_gpu_samples,
                        cupti=CuptiOptions(period_log2=args.gpu_sample_period, hw_buffer_bytes=args.gpu_hw_buffer,
                                           max_stream_bytes=args.gpu_stream_limit))
    err = Console(stderr=True)
    progress = _Progress(err, quiet=args.quiet)
    with progress:
        result = Session(cfg, on_progress=progress.update).run()
    native = NativeSymbolizer(debug_dirs=[*args.debug_dir, "/usr/lib/debug"])
    cap = read_capture(result.capture)
    prof = symbolize_capture(cap, native, options=_view(args))
    written = [result.capture]
    target = cfg.command and " ".join(cfg.command) or f"pid {args.pid}"
    views = capture_views(cap, prof, cfg.prefix)

    def svg_options(v: View) -> dict[str, object]:
        rate = f" at {args.frequency} Hz" if v.profile is prof else ""
        return {"title": args.title or f"aiflame: {target}{v.label}",
                "subtitle": f"{v.what}{rate}, {result.stats.elapsed_s:.1f} s, {result.stop_reason}"}

    files, notes = write_views(views, formats, out_dir, svg_options)
    written += files
    result.warnings.extend(notes)
    stalls = next((v.profile for v in views if v.prefix == "stalls"), None)
    if not args.quiet:
        from aiflame.cli.summary import print_summary

        print_summary(console, prof, agent_cpu_s=result.agent_cpu_s, elapsed_s=result.stats.elapsed_s,
                      stalls=stalls)
        probed = [a for a in result.probed if a.runtime != "process"]
        if probed:
            libs = (f"{os.path.basename(a.path)} ({a.runtime}, {len(a.calls)} entry points)" for a in probed)
            console.print("probed: " + "; ".join(libs), highlight=False)
        for w in result.warnings:
            err.print(f"[yellow]warning:[/] {escape(w)}", highlight=False, soft_wrap=True)
        console.print(f"stopped: {result.stop_reason} after {result.stats.elapsed_s:.1f} s")
        for p in written:
            console.print(f"wrote {p}", highlight=False)
    if result.exit_code not in (None, 0) and not args.quiet:
        console.print(f"[yellow]the command exited with status {result.exit_code}[/]")
    return 0


class _Progress:
    """A one-line live status on stderr: elapsed time, samples, lost samples, processes."""

    def __init__(self, console: Console, quiet: bool) -> None:
        self.console = console
        self.quiet = quiet or not console.is_terminal
        self._status = None if self.quiet else console.status("starting BPF sampler…")

    def __enter__(self) -> _Progress:
        if self._status:
            self._status.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status:
            self._status.__exit__(None, None, None)

    def update(self, s: SessionStats) -> None:
        if self._status:
            self._status.update(f"profiling  {s.elapsed_s:6.1f} s  samples {s.samples}  lost {s.lost}  "
                                f"processes {s.pids}  (Ctrl-C to stop)")


def _obfuscated(prof: Profile, args: argparse.Namespace) -> Profile:
    from aiflame.exporters.obfuscate import Obfuscator, default_key_path, load_key

    return Obfuscator(load_key(args.key_file or default_key_path())).profile(prof)


def cmd_export(args: argparse.Namespace, console: Console) -> int:
    if args.format not in FORMATS:
        return _fail(console, f"unknown format {args.format!r} (known: {', '.join(FORMATS)})", 2)
    if args.format == CHAKRA:
        return _export_chakra(args, console)
    cls = REGISTRY[args.format]
    exporter = get_exporter(args.format, **parse_option_values(cls, args.opt))
    prof = _load_profile(args.capture, args)
    if args.obfuscate:
        prof = _obfuscated(prof, args)
    out = args.output or args.capture.with_suffix(cls.extension)
    try:
        exporter.write(prof, out)
    except OSError as e:
        raise ExportError(f"cannot write {out}: {e.strerror}") from None
    console.print(f"wrote {out} ({prof.total_weight} samples)", highlight=False)
    return 0


def _export_chakra(args: argparse.Namespace, console: Console) -> int:
    if args.opt:
        return _fail(console, "format chakra has no options", 2)
    if args.view != "cpu":
        return _fail(console, "format chakra takes the whole capture (no --view)", 2)
    prof = _load_profile(args.capture, args)
    if args.obfuscate:
        prof = _obfuscated(prof, args)
    files, traces = write_traces(prof, args.output or args.capture.with_suffix(""))
    for w in traces.warnings:
        Console(stderr=True).print(f"[yellow]warning:[/] {escape(w)}", highlight=False, soft_wrap=True)
    for path, (rank, t) in zip(files, sorted(traces.ranks.items()), strict=True):
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(node_types(t.nodes).items()))
        console.print(f"wrote {path} (rank {rank}: {kinds})", highlight=False)
    return 0


def cmd_report(args: argparse.Namespace, console: Console) -> int:
    from aiflame.cli.report_cmd import report_comm

    if args.threshold < 0 or args.time_threshold < 0 or args.min_time_ms < 0:
        return _fail(console, "thresholds must be >= 0", 2)
    args.cmd, args.view = "export", "cpu"  # a capture, never a folded file
    args.group, args.no_kernel, args.python, args.debug_dir = "process", False, "merged", []
    prof = _load_profile(args.capture, args)
    plot = None if args.no_plot else (args.plot or args.capture.with_suffix(".comm.svg"))
    report_comm(prof, console, args.threshold, args.time_threshold, plot,
                title=f"Collective bytes per rank: {prof.meta.get('target', args.capture.name)}",
                min_time_ms=args.min_time_ms)
    return 0


def cmd_render(args: argparse.Namespace, console: Console) -> int:
    if (args.input is None) == (args.diff is None):
        return _fail(console, "give one input, or --diff BEFORE AFTER", 2)
    exporter = SvgExporter(**parse_option_values(REGISTRY["svg"], args.opt))  # type: ignore[arg-type]
    if args.diff:
        exporter.baseline = _load_profile(args.diff[0], args)
        prof = _load_profile(args.diff[1], args)
    else:
        prof = _load_profile(args.input, args)
    try:
        exporter.write(prof, args.output)
    except OSError as e:
        raise ExportError(f"cannot write {args.output}: {e.strerror}") from None
    console.print(f"wrote {args.output}", highlight=False)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
    err = Console(stderr=True)
    try:
        if args.cmd == "profile":
            return cmd_profile(args, argv, console)
        if args.cmd == "export":
            return cmd_export(args, console)
        if args.cmd == "render":
            return cmd_render(args, console)
        if args.cmd == "report":
            return cmd_report(args, console)
        if args.cmd in ("agent", "trigger", "status", "top"):
            from aiflame.cli import daemon_cmd
            return daemon_cmd.run(args)
        if args.cmd == "import":
            from aiflame.cli import import_cmd
            return import_cmd.run(args)
        if args.cmd == "annotate":
            from aiflame.cli import annotate_cmd
            return annotate_cmd.run(args)
        if args.cmd == "gpu-symbols":
            from aiflame.cli import gpu_symbols_cmd
            return gpu_symbols_cmd.run(args)
        if args.cmd == "doctor":
            from aiflame.cli.doctor import doctor

            return doctor(console)
        parser.print_help()
        return 2
    except USER_ERRORS as e:
        return _fail(err, str(e))
    except KeyboardInterrupt:
        return _fail(err, "interrupted", 130)
    except BrokenPipeError:
        return 1


if __name__ == "__main__":
    sys.exit(main())
