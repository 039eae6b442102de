"""`aiflame import`: merge accelerator stall records saved elsewhere into a capture, so a GPU host's samples are
joined offline with the launch stacks the capture holds.

Only wiring: the parsers are symbolize/xe_eu_stall.py and symbolize/rocprof_pc.py; another aiflame capture
contributes its stall samples and GPU code. `add_parser` registers the subcommand; `run` executes it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from aiflame.core.capture import CaptureError, read_capture, write_capture
from aiflame.core.errors import BadInput
from aiflame.core.raw import Capture, CaptureFooter, GpuCode, RawStallSample
from aiflame.symbolize.errors import SymbolizeError
from aiflame.symbolize.vendor.rocprof_pc import CodeObject, code_object_from_elf
from aiflame.symbolize.vendor.rocprof_pc import parse_file as parse_rocprof_file
from aiflame.symbolize.vendor.xe_eu_stall import LAYOUTS, parse_records

__all__ = ["ImportRecordsError", "add_parser", "import_records", "run"]

FORMATS = ("xe", "rocprof", "capture")
EXAMPLES = """examples:
  aiflame import out/profile.aiflame gpu0.eustall --format xe --platform xe2 --pid 4242
  aiflame import out/profile.aiflame pc.bin --format rocprof --code-object 1=kernels.hsaco -o merged.aiflame
  aiflame import out/profile.aiflame gpuhost/profile.aiflame --format capture
"""


class ImportRecordsError(BadInput):
    """Records cannot be imported as asked; the message is one line."""


@dataclass
class ImportResult:
    """What an import added."""

    samples: int
    stall_samples: int
    counters: dict[str, int]
    gpu_code: int


def _code_object(text: str) -> tuple[int, Path]:
    ident, sep, path = text.partition("=")
    try:
        value = int(ident, 0)
    except ValueError:
        value = -1
    if not sep or value < 0 or not path:
        raise argparse.ArgumentTypeError(f"expected ID=PATH (e.g. 1=kernels.hsaco), got {text!r}")
    return value, Path(path)


def add_parser(subparsers: Any) -> None:
    """Register `import` on the `add_subparsers()` object of the aiflame parser."""
    p = subparsers.add_parser(
        "import",
        help="merge accelerator stall records (Xe EU stall, rocprofiler PC sampling, another capture) into a capture",
        description="Add stall samples recorded elsewhere to a capture; `aiflame export --view stalls` then "
        "attributes them to the capture's launch stacks.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("capture", type=Path, help="the .aiflame capture to add to")
    p.add_argument("records", type=Path, nargs="+", help="files of vendor records (or captures)")
    p.add_argument("-f", "--format", choices=FORMATS, required=True,
                   help="xe: raw EU stall records; rocprof: rocprofiler-sdk PC-sampling records; "
                        "capture: the stall samples and GPU code of another aiflame capture")
    p.add_argument("-o", "--output", type=Path, help="write the merged capture here (default: replace CAPTURE)")
    p.add_argument("--platform", choices=sorted(LAYOUTS), help="Xe record layout (xe format)")
    p.add_argument("--record-size", type=int, default=64, help="Xe record size in bytes (default 64)")
    p.add_argument("--pid", type=int, default=0, help="the process the samples belong to (default: unknown)")
    p.add_argument("--device", type=int, default=-1, help="device ordinal of the samples")
    p.add_argument("--code-object", type=_code_object, action="append", default=[], metavar="ID=PATH",
                   help="rocprof: the code object (ELF) loaded with this id; repeatable")


def import_records(
    capture: Path,
    records: list[Path],
    fmt: str,
    *,
    output: Path | None = None,
    platform: str | None = None,
    record_size: int = 64,
    pid: int = 0,
    device: int = -1,
    code_objects: list[tuple[int, Path]] | None = None,
) -> ImportResult:
    """Parse `records` and write `capture` plus their samples to `output` (default: `capture`, replaced
    atomically). Raises ImportRecordsError, CaptureError or a SymbolizeError, each one line."""
    if fmt not in FORMATS:
        raise ImportRecordsError(f"unknown record format {fmt!r} (known: {', '.join(FORMATS)})")
    cap = read_capture(capture)
    stalls: list[RawStallSample] = []
    counters: dict[str, int] = {}
    code: list[GpuCode] = []

    def add(more: dict[str, int]) -> None:
        for k, v in more.items():
            counters[k] = counters.get(k, 0) + v

    if fmt == "xe":
        if platform is None:
            raise ImportRecordsError("--platform is required for Xe records (pvc, xe2 or xe3p)")
        for path in records:
            data = _read(path)
            parsed = parse_records(data, platform, record_size=record_size, device=device)
            if parsed.records and parsed.foreign == parsed.records:
                raise ImportRecordsError(f"{path}: no record is a {platform} EU stall record (wrong --platform or "
                                         "not EU stall data)")
            stalls.extend(s if not pid else _with_pid(s, pid) for s in parsed.samples)
            add(parsed.counters())
    elif fmt == "rocprof":
        cos: dict[int, CodeObject] = {}
        for ident, path in code_objects or []:
            data = _read(path)
            cos[ident] = code_object_from_elf(ident, data)
            code.append(GpuCode(cos[ident].digest, "amdgpu-elf", 0, str(path), data))
        for path in records:
            parsed_r = parse_rocprof_file(path, code_objects=cos, pid=pid, device=device)
            stalls.extend(parsed_r.samples)
            add(parsed_r.counters())
    else:
        for path in records:
            other = read_capture(path)
            stalls.extend(other.stalls)
            code.extend(other.gpu_code)
            if other.footer:
                add({k: v for k, v in other.footer.counters.items()
                     if k.startswith(("stall", "cupti", "xe_", "rocprof"))})
    before = {g.digest for g in cap.gpu_code}
    new_code = [g for g in code if g.digest not in before and g.data]
    merged = Capture(cap.header, cap.samples, cap.processes, cap.kernel_symbols, cap.py_codes, cap.py_runtimes,
                     cap.events, [*cap.gpu_code, *new_code], [*cap.stalls, *stalls],
                     cap.footer or CaptureFooter())
    assert merged.footer is not None
    for k, v in counters.items():
        merged.footer.counters[k] = merged.footer.counters.get(k, 0) + v
    merged.footer.counters["imported_stall_samples"] = (merged.footer.counters.get("imported_stall_samples", 0)
                                                        + sum(s.count for s in stalls))
    write_capture(output or capture, merged)
    return ImportResult(len(stalls), sum(s.count for s in stalls), counters, len(new_code))


def _with_pid(s: RawStallSample, pid: int) -> RawStallSample:
    from dataclasses import replace

    return replace(s, pid=pid)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ImportRecordsError(f"{path}: {e.strerror}") from None


def run(args: argparse.Namespace) -> int:
    """Execute the parsed `import` command; 0 on success, 1 on an error (printed as one line)."""
    console = Console(highlight=False, soft_wrap=True)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        res = import_records(args.capture, args.records, args.format, output=args.output, platform=args.platform,
                             record_size=args.record_size, pid=args.pid, device=args.device,
                             code_objects=args.code_object)
    except (ImportRecordsError, CaptureError, SymbolizeError) as e:
        err.print(f"[bold red]aiflame: error:[/] {escape(str(e))}")
        return 1
    out = args.output or args.capture
    drops = "  ".join(f"{k} {v}" for k, v in sorted(res.counters.items()))
    console.print(f"imported {res.stall_samples} stall samples ({res.samples} records after merging"
                  f"{f', {res.gpu_code} code objects' if res.gpu_code else ''}) into {escape(str(out))}")
    if drops:
        console.print(f"counters: {escape(drops)}")
    return 0
