"""Merge accelerator stall records saved elsewhere into a capture, so a GPU host's samples are joined offline with
the launch stacks the capture holds (`aiflame import`). The parsers are symbolize/vendor/xe_eu_stall.py,
symbolize/vendor/rocprof_pc.py and symbolize/vendor/cupti_stream.py (the stream aiflame's CUPTI injection library
writes, folded as `aiflame profile` folds it); another aiflame capture contributes its stall samples and GPU code."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aiflame.core.errors import BadInput
from aiflame.core.raw import Capture, CaptureFooter, GpuCode, RawStallSample
from aiflame.symbolize.vendor.xe_eu_stall import LAYOUTS, parse_records

if TYPE_CHECKING:
    from aiflame.symbolize.vendor.rocprof_pc import CodeObject

__all__ = ["FORMATS", "LAYOUTS", "ImportRecordsError", "ImportResult", "import_records"]

FORMATS = ("xe", "rocprof", "cupti", "capture")


class ImportRecordsError(BadInput):
    """Records cannot be imported as asked; the message is one line."""


@dataclass
class ImportResult:
    """What an import added."""

    samples: int
    stall_samples: int
    counters: dict[str, int]
    gpu_code: int


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
    # here, not at the top: `aiflame` imports this module for FORMATS and LAYOUTS when it builds its parser
    from aiflame.core.capture import read_capture, write_capture
    from aiflame.symbolize.vendor.rocprof_pc import code_object_from_elf
    from aiflame.symbolize.vendor.rocprof_pc import parse_file as parse_rocprof_file

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
    elif fmt == "cupti":
        from aiflame.agent.accel.cupti import stalls_from_stream
        from aiflame.symbolize.vendor.cupti_stream import parse_stream

        for path in records:
            stream = parse_stream(_read(path), name=str(path), keep_pcs=False)
            samples, cubins, counts = stalls_from_stream(stream)
            stalls.extend(s if not pid else _with_pid(s, pid) for s in samples)
            code.extend(cubins)
            add(dict(counts))
            if stream.problems or not stream.complete:  # cut short or records skipped: say so in the footer
                add({"cupti_stream_problems": len(stream.problems) + (not stream.complete)})
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
