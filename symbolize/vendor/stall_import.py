"""Merge accelerator stall records saved elsewhere into a capture, so a GPU host's samples are joined offline with
the launch stacks the capture holds (`aiflame import`). Each format is read, checked and converted by its own module
beside this one, the one `aiflame profile` uses too: xe_eu_stall.py, rocprof_pc.py and cupti_stream.py (the stream
aiflame's CUPTI injection library writes); another aiflame capture contributes its stall samples and GPU code. This
module picks the files, refuses those of another kind and merges. It is below agent/ because it needs nothing of
the host: files in, a capture out, on any machine.

Every file is checked for being what its format says before anything is written: a file of another kind (an ELF
binary, a text file, a capture given as a stream, bytes that are not whole records of the layout) is refused with
one line naming what it looks like. A file of the right kind with no samples is imported and named in the notes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from aiflame.core.errors import BadInput, Unreadable
from aiflame.core.raw import Capture, CaptureFooter, GpuCode, RawStallSample
from aiflame.symbolize.vendor.xe_eu_stall import LAYOUTS, parse_records

if TYPE_CHECKING:
    from aiflame.symbolize.vendor.rocprof_pc import CodeObject

__all__ = ["FORMATS", "LAYOUTS", "ImportResult", "import_records"]

FORMATS = ("xe", "rocprof", "cupti", "capture")


@dataclass
class ImportResult:
    """What an import added."""

    samples: int
    stall_samples: int
    counters: dict[str, int]
    gpu_code: int
    notes: list[str] = field(default_factory=list)  # files of the right kind that held no samples


def import_records(
    capture: Path,
    records: list[Path],
    fmt: str,
    *,
    output: Path,
    platform: str | None = None,
    record_size: int = 64,
    pid: int = 0,
    device: int = -1,
    code_objects: list[tuple[int, Path]] | None = None,
) -> ImportResult:
    """Parse `records` and write `capture` plus their samples to `output` (atomically; `output` may be `capture`
    itself, replaced only when the caller says so). Raises BadInput (Unreadable for records or a capture that
    cannot be read), one line, before anything is written."""
    # here, not at the top: `aiflame` imports this module for FORMATS and LAYOUTS when it builds its parser
    from aiflame.core.capture import write_capture

    if fmt not in FORMATS:
        raise BadInput(f"unknown record format {fmt!r} (known: {', '.join(FORMATS)})")
    cap = _read_converted(capture)
    got = _Imported()
    if fmt == "xe":
        if platform is None:
            raise BadInput("--platform is required for Xe records (pvc, xe2 or xe3p)")
        _import_xe(got, records, platform, record_size, device, pid)
    elif fmt == "rocprof":
        _import_rocprof(got, records, code_objects or [], device, pid)
    elif fmt == "cupti":
        _import_cupti(got, records, pid)
    else:
        _import_captures(got, records)
    stalls, counters = got.stalls, got.counters
    before = {g.digest for g in cap.gpu_code}
    new_code = [g for g in got.code if g.digest not in before and g.data]
    merged = Capture(cap.header, cap.samples, cap.processes, cap.kernel_symbols, cap.py_codes, cap.py_runtimes,
                     cap.events, [*cap.gpu_code, *new_code], [*cap.stalls, *stalls],
                     cap.footer or CaptureFooter(), cap.streams)  # streams it could not convert stay
    assert merged.footer is not None
    for k, v in counters.items():
        merged.footer.counters[k] = merged.footer.counters.get(k, 0) + v
    merged.footer.counters["imported_stall_samples"] = (merged.footer.counters.get("imported_stall_samples", 0)
                                                        + sum(s.count for s in stalls))
    write_capture(output, merged)
    return ImportResult(len(stalls), sum(s.count for s in stalls), counters, len(new_code), got.notes)


@dataclass
class _Imported:
    """What the record files of one import hold, gathered file by file."""

    stalls: list[RawStallSample] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    code: list[GpuCode] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # files of the right kind that held no samples

    def add(self, more: dict[str, int]) -> None:
        for k, v in more.items():
            self.counters[k] = self.counters.get(k, 0) + v


def _import_xe(got: _Imported, records: list[Path], platform: str, record_size: int, device: int,
               pid: int) -> None:
    for path in records:
        data = _read(path, "Xe EU stall records")
        parsed = parse_records(data, platform, record_size=record_size, device=device)
        refusal = parsed.refusal(str(path), platform, record_size)
        if refusal:
            raise Unreadable(refusal)
        if not parsed.samples:
            got.notes.append(f"{path}: {parsed.records} EU stall records, none with a stall counted")
        got.stalls.extend(s if not pid else _with_pid(s, pid) for s in parsed.samples)
        got.add(parsed.counters())


def _import_rocprof(got: _Imported, records: list[Path], code_objects: list[tuple[int, Path]], device: int,
                    pid: int) -> None:
    from aiflame.symbolize.vendor.rocprof_pc import amdgpu_refusal, code_object_from_elf
    from aiflame.symbolize.vendor.rocprof_pc import parse_records as parse_rocprof_records

    cos: dict[int, CodeObject] = {}
    for ident, path in code_objects:
        data = _read(path, "an AMDGPU code object")
        refusal = amdgpu_refusal(data, str(path))
        if refusal:
            raise Unreadable(refusal)
        cos[ident] = code_object_from_elf(ident, data)
        got.code.append(cos[ident].gpu_code(data, str(path)))
    for path in records:
        parsed = parse_rocprof_records(_read(path, "rocprofiler PC-sampling records"), code_objects=cos,
                                       pid=pid, device=device, label=str(path))
        got.stalls.extend(parsed.samples)
        got.add(parsed.counters())


def _import_cupti(got: _Imported, records: list[Path], pid: int) -> None:
    from aiflame.symbolize.vendor.cupti_stream import parse_stream, stalls_from_stream

    for path in records:
        stream = parse_stream(_read(path, "a CUPTI stream"), name=str(path), keep_pcs=False)
        samples, cubins, counts = stalls_from_stream(stream)
        if not samples:
            got.notes.append(f"{path}: a CUPTI stream of pid {stream.pid} with no PC samples")
        got.stalls.extend(s if not pid else _with_pid(s, pid) for s in samples)
        got.code.extend(cubins)
        got.add(dict(counts))
        if stream.problems or not stream.complete:  # cut short or records skipped: say so in the footer
            got.add({"cupti_stream_problems": len(stream.problems) + (not stream.complete)})


def _read_converted(path: Path) -> Capture:
    """The capture at `path` with the stall samples of the CUPTI streams it stores, read on the road (what its
    `profile` already warned of)."""
    from aiflame.symbolize.road import read

    return read(path)[0]


def _import_captures(got: _Imported, records: list[Path]) -> None:
    for path in records:
        _read(path, "an aiflame capture")
        other = _read_converted(path)
        if not other.stalls:
            got.notes.append(f"{path}: a capture without stall samples")
        got.stalls.extend(other.stalls)
        got.code.extend(other.gpu_code)
        if other.footer:
            got.add({k: v for k, v in other.footer.counters.items()
                     if k.startswith(("stall", "cupti", "xe_", "rocprof"))})


def _with_pid(s: RawStallSample, pid: int) -> RawStallSample:
    from dataclasses import replace

    return replace(s, pid=pid)


# What a file of another kind starts with, to name it in the refusal.
_MAGICS = ((b"\x7fELF", "an ELF file"), (b"AIFLCAP\n", "an aiflame capture (--format capture)"),
           (b"AIFLCUPT", "a CUPTI stream (--format cupti)"), (b"\x1f\x8b", "a gzip file"),
           (b"PK\x03\x04", "a zip file"), (b"\x89PNG", "a PNG image"))
_EXPECTED_MAGIC = {"an AMDGPU code object": b"\x7fELF", "an aiflame capture": b"AIFLCAP\n",
                   "a CUPTI stream": b"AIFLCUPT"}


def _read(path: Path, what: str) -> bytes:
    """The bytes of `path`, which should hold `what` ("a CUPTI stream"): refused (one line) when it cannot be read,
    is empty, or is recognizably another kind of file (a magic of another format, or text where records are
    binary)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise Unreadable(f"{path}: {e.strerror}") from None
    if not data:
        raise Unreadable(f"{path}: empty file, not {what}")
    expected = _EXPECTED_MAGIC.get(what)
    for magic, kind in _MAGICS:
        if data.startswith(magic) and magic != expected:
            raise Unreadable(f"{path}: {kind}, not {what}")
    if not (expected and data.startswith(expected)) and _is_text(data):
        raise Unreadable(f"{path}: a text file, not {what}")
    return data


def _is_text(data: bytes) -> bool:
    """Printable UTF-8 (with line breaks and tabs) throughout its first 4 KiB: binary records always hold zero
    bytes (their unused high bits), text never does."""
    head = data[:4096]
    try:
        text = head.decode()
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # not only a character cut at the 4 KiB boundary
            return False
        text = head[:e.start].decode()
    return all(c.isprintable() or c in "\n\r\t" for c in text)
