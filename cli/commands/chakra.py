"""`aiflame chakra check PREFIX|FILE...`: Chakra `.et` files against the input rules of ASTRA-sim's analytical
backend (exporters/chakra_check.py), one line per broken rule naming the node ids; exit 1 when one is an error.
`aiflame chakra calibrate CAPTURE`: a network for this host and transport from a capture of calls across sizes
(exporters/chakra_calibration.py), for exports that predict other jobs."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from aiflame.core.errors import Unreadable
from aiflame.exporters.chakra_check import Problem, check, errors, expand

NAME = "chakra"
HELP = "Chakra execution traces: check them against ASTRA-sim's input rules; calibrate a network"
DESCRIPTION = ""
EXAMPLES = """examples:
  aiflame chakra check traces/job             the rules on traces/job.<rank>.et, one line per broken rule
  aiflame profile -o out/sweep --formats folded -- python examples/comm_jobs.py sweep
  aiflame chakra calibrate out/sweep/profile.aiflame -o host.network.yml
                                              a network for this host and transport, calibrated once
  aiflame export out/job/profile.aiflame -f chakra -o out/job/sim --opt network=host.network.yml
                                              traces that predict: host costs as compute, the calibrated link
"""
__all__ = ["DESCRIPTION", "EXAMPLES", "HELP", "NAME", "add_arguments", "print_problems", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    kinds = p.add_subparsers(dest="chakra", metavar="ACTION", required=True)
    c = kinds.add_parser("check", help="the simulator's input rules on .et files: one line per broken rule")
    c.add_argument("paths", nargs="+", metavar="PREFIX|FILE",
                   help="a prefix (its PREFIX.<rank>.et files) or .et files of one job")
    c.add_argument("--world", type=int, help="ranks of the job (the network's NPU count; default: from the files)")
    c.add_argument("--comm-groups", type=Path, metavar="JSON",
                   help="the simulator's --comm-group-configuration, whose group ids pg_name may name")
    c.add_argument("--splits", type=int, default=4,
                   help="preferred-dataset-splits of the system configuration (4)")
    c.add_argument("--roofline", action="store_true", help="also the rules of roofline mode (num_ops, tensor_size)")
    k = kinds.add_parser("calibrate", help="a network for this host and transport, from a capture of calls at "
                         "several sizes (e.g. examples/comm_jobs.py sweep), to export other jobs with")
    k.add_argument("capture", type=Path, help="an .aiflame capture whose calls span sizes")
    k.add_argument("-o", "--output", type=Path,
                   help="the network file to write (default: calibrated.network.yml beside the capture)")
    k.add_argument("--force", action="store_true", help="replace an existing output file")


def print_problems(problems: Sequence[Problem]) -> int:
    """One line per problem on stderr; an Unreadable (exit 1, printed once by cli.main) when one is an error."""
    err = Console(stderr=True)
    for p in problems:
        colour = "red" if p.severity == "error" else "yellow"
        err.print(f"[{colour}]{escape(str(p))}[/]", highlight=False, soft_wrap=True)
    bad = errors(problems)
    if bad:
        raise Unreadable(f"{len(bad)} of ASTRA-sim's input rules broken: the simulator would not run these "
                         "traces to the end")
    return 0


def calibrate(args: argparse.Namespace) -> int:
    from aiflame.cli.stack_view import load_profile
    from aiflame.core.errors import UsageError
    from aiflame.exporters.base import write_atomic
    from aiflame.exporters.chakra_calibration import calibrate as fit
    from aiflame.exporters.chakra_calibration import calibration_yaml, capture_id
    from aiflame.exporters.chakra_nodes import build_traces

    out = args.output or args.capture.parent / "calibrated.network.yml"
    if out.exists() and not args.force:
        raise UsageError(f"{out} exists (--force replaces it)")
    prof = load_profile(args.capture)
    traces = build_traces(prof)
    runtimes = sorted({str(op.event.args.get("runtime", "")) for t in traces.timeline.ranks.values()
                       for op in t.ops} - {""})
    cal = fit(traces, capture_id(prof), "/".join(runtimes))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, calibration_yaml(cal, cal.world).encode())
    con = Console()
    con.print(f"link {cal.bandwidth_gibps:.3g} GiB/s, {cal.latency_ns / 1e3:.1f} µs per step; host cost per call "
              f"kind (per call + per byte):", highlight=False)
    for kind, h in sorted(cal.host.items()):
        con.print(f"  {escape(kind):<14} {h.per_call_ns / 1e3:8.1f} µs + {h.per_byte_ns:.3g} ns/B  "
                  f"({h.calls} calls, {h.sizes} sizes)", highlight=False)
    for note in cal.notes:
        con.print(f"  note: {escape(note)}", highlight=False)
    con.print(f"wrote {escape(str(out))}", highlight=False)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.chakra == "calibrate":
        return calibrate(args)
    groups: list[int] = []
    if args.comm_groups is not None:
        try:
            groups = [int(k) for k in json.loads(args.comm_groups.read_text())]
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise Unreadable(f"{args.comm_groups}: not a comm-group configuration ({e})") from None
    files = expand(args.paths)
    problems = check(files, world=args.world, comm_groups=groups, splits=args.splits, roofline=args.roofline)
    code = print_problems(problems)
    if not problems:
        Console().print(f"{len(files)} file(s): every rule of ASTRA-sim's input holds", highlight=False)
    return code
