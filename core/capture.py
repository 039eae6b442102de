"""The capture file: MAGIC, then varint-length-delimited `Record` protobuf messages (aiflame_capture.proto).

The writer streams records as they are collected (so a long capture's memory stays bounded) and ends with a
Footer; the reader rejects foreign, truncated or corrupt files with one clear Unreadable line. A capture cut
short (its writer killed) is read with `partial=True`, up to its last whole record; `recover_capture` writes
that as a complete capture (`aiflame recover`).

Over 400 lines on purpose: one format, read and written here: the framing, the limits and both directions of each
record's protobuf conversion stay side by side, so that a record changes in one file (#27: one definition per
record).
"""

from __future__ import annotations

import os
import platform
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from google.protobuf.message import DecodeError

from aiflame import __version__
from aiflame.core import aiflame_capture_pb2 as pb
from aiflame.core.errors import BadInput, Refused, Unreadable
from aiflame.core.raw import (
    Capture,
    CaptureFooter,
    CaptureHeader,
    CodeInfo,
    GpuCode,
    Mapping,
    ProcessSnapshot,
    PyCode,
    PyRuntimeInfo,
    RawEvent,
    RawPyFrame,
    RawSample,
    RawStallSample,
    RawStream,
)
from aiflame.core.safe_files import OutputDir

MAGIC = b"AIFLCAP\n"
FORMAT_VERSION = 1
# Captures holding off-CPU samples (`profile --off-cpu`): a reader of format 1 would count them as CPU samples.
OFF_CPU_FORMAT_VERSION = 2
READ_VERSION = OFF_CPU_FORMAT_VERSION  # the newest format this aiflame reads
# The largest record the writer writes and the reader takes (records are held whole in memory to decode). Code
# objects are split into pieces of MAX_PIECE (torch's modules hold cubins of over 64 MiB), stall batches end at
# STALL_BATCH samples or STALL_BATCH_BYTES, and any other record passing the limit is refused by the writer.
MAX_RECORD = 64 << 20
MAX_PIECE = 16 << 20
MAX_STREAM = 1 << 41  # a vendor stream's size: `profile --gpu-stream-limit` goes to 1 TiB


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def new_header(frequency_hz: int, event: str, argv: Sequence[str], target: str,
               meta: dict[str, str] | None = None, off_cpu: bool = False) -> CaptureHeader:
    """The header of a capture that starts now on this host: format and aiflame versions, host, kernel and
    machine, and the start on both clocks (samples carry CLOCK_MONOTONIC times). `off_cpu`: it will hold off-CPU
    samples (format 2; others stay format 1, which older aiflame versions read)."""
    extra = dict(meta or {})
    try:  # which boot of the host the monotonic times are of (captures of several hosts are joined by clock)
        extra.setdefault("boot_id", Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except OSError:
        pass
    return CaptureHeader(
        OFF_CPU_FORMAT_VERSION if off_cpu else FORMAT_VERSION, __version__, socket.gethostname(), platform.release(),
        platform.machine(), frequency_hz,
        event, time.time_ns(), time.clock_gettime_ns(time.CLOCK_MONOTONIC), list(argv), target, extra,
    )


def is_capture(path: str | os.PathLike[str]) -> bool:
    """Whether the file at `path` starts with the capture MAGIC; Unreadable when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError as e:
        raise Unreadable(f"{os.fsdecode(path)}: {e.strerror}") from None


def header_to_pb(h: CaptureHeader) -> pb.Header:
    m = pb.Header(
        format_version=h.format_version, aiflame_version=h.aiflame_version, host=h.host, kernel=h.kernel,
        machine=h.machine, frequency_hz=h.frequency_hz, event=h.event, start_wall_ns=h.start_wall_ns,
        start_mono_ns=h.start_mono_ns, target=h.target,
    )
    m.argv.extend(h.argv)
    m.meta.update(h.meta)
    return m


def header_from_pb(h: pb.Header) -> CaptureHeader:
    return CaptureHeader(h.format_version, h.aiflame_version, h.host, h.kernel, h.machine, h.frequency_hz, h.event,
                         h.start_wall_ns, h.start_mono_ns, list(h.argv), h.target, dict(h.meta))


def sample_to_pb(s: RawSample) -> pb.Sample:
    m = pb.Sample(
        time_ns=s.time_ns, pid=s.pid, tid=s.tid, cpu=s.cpu, comm=s.comm, user=s.user, kern=s.kern,
        user_err=s.user_err, kern_err=s.kern_err, weight=0 if s.weight == 1 else s.weight, py_flags=s.py_flags,
        unwind=s.unwind, off_cpu_ns=s.off_cpu_ns,
    )
    for f in s.py:
        m.py.add(code=f.code, instr=f.instr, owner=f.owner, is_entry=f.is_entry)
    return m


def process_to_pb(p: ProcessSnapshot) -> pb.Process:
    m = pb.Process(pid=p.pid, ppid=p.ppid, comm=p.comm, exe=p.exe, time_ns=p.time_ns, exec_seq=p.exec_seq)
    m.cmdline.extend(p.cmdline)
    for mp in p.mappings:
        m.mappings.add(start=mp.start, end=mp.end, file_offset=mp.file_offset, path=mp.path,
                       build_id=mp.build_id, perms=mp.perms)
    return m


def footer_to_pb(f: CaptureFooter) -> pb.Footer:
    m = pb.Footer(end_wall_ns=f.end_wall_ns, end_mono_ns=f.end_mono_ns, samples=f.samples,
                  stop_reason=f.stop_reason, agent_cpu_s=f.agent_cpu_s)
    m.counters.update(f.counters)
    return m


def event_to_pb(e: RawEvent) -> pb.Event:
    m = pb.Event(runtime=e.runtime, call=e.call, kind=e.kind, pid=e.pid, tid=e.tid, start_ns=e.start_ns,
                 end_ns=e.end_ns, user=e.user, user_err=e.user_err, py_flags=e.py_flags)
    for f in e.py:
        m.py.add(code=f.code, instr=f.instr, owner=f.owner, is_entry=f.is_entry)
    # args are sint64: a raw 64-bit register value above 2^63 wraps (user-space addresses never get there)
    m.args.update({k: v - (1 << 64) if v >= 1 << 63 else v for k, v in e.args.items()})
    m.strs.update(e.strs)
    return m


def event_from_pb(m: pb.Event) -> RawEvent:
    return RawEvent(
        m.runtime, m.call, m.kind, m.pid, m.tid, m.start_ns, m.end_ns, tuple(m.user), m.user_err,
        tuple(RawPyFrame(f.code, f.instr, f.owner, f.is_entry) for f in m.py), m.py_flags, dict(m.args),
        dict(m.strs),
    )


def stall_to_pb(s: RawStallSample) -> pb.StallSample:
    return pb.StallSample(source=s.source, pid=s.pid, device=s.device, code=s.code, kernel=s.kernel,
                          offset=s.offset, reason=s.reason, count=s.count, correlation_id=s.correlation_id,
                          time_ns=s.time_ns, not_issued=s.not_issued)


def stall_from_pb(m: pb.StallSample) -> RawStallSample:
    return RawStallSample(m.source, m.pid, m.device, m.code, m.kernel, m.offset, m.reason, m.count,
                          m.correlation_id, m.time_ns, m.not_issued)


STALL_BATCH = 4096  # samples per StallSamples record: bounded records, little framing
STALL_BATCH_BYTES = 8 << 20  # ... and at most about this many bytes (kernel names can be kilobytes long)


def _pieces(data: bytes) -> Iterator[tuple[int, bytes, int]]:
    """(offset, piece, size) for each record an object is stored in: itself whole (size 0), or pieces of
    MAX_PIECE whose first one carries the whole size (`_joined` puts them back together)."""
    if len(data) <= MAX_PIECE:
        yield 0, data, 0
        return
    view = memoryview(data)
    for off in range(0, len(data), MAX_PIECE):
        yield off, bytes(view[off:off + MAX_PIECE]), len(data) if off == 0 else 0


class CaptureWriter:
    """Streams records to `path` (written as `path.partial`, renamed on close so readers never see half a file).

    The output directory may be a user's: both names are used relative to the directory's descriptor, the
    partial file is created anew (O_EXCL|O_NOFOLLOW, a stale one or a symlink in its place removed first), so
    nothing planted there redirects the write (core/safe_files.py)."""

    def __init__(self, path: Path, header: CaptureHeader) -> None:
        self.path = path
        self._tmp = path.with_name(path.name + ".partial")
        try:
            self._dir = OutputDir.of_file(path)
        except Refused as e:
            raise BadInput(f"cannot write {path}: {e}") from None
        try:
            self._f: BinaryIO = self._dir.fdopen(self._dir.create(self._tmp.name, replace=True))
        except OSError as e:
            self._dir.close()
            raise BadInput(f"cannot write {path}: {e.strerror}") from None
        self._f.write(MAGIC)
        self.samples_written = 0
        self.events_written = 0
        self.stalls_written = 0
        self._gpu_digests: set[str] = set()
        self._write(pb.Record(header=header_to_pb(header)))

    def _write(self, rec: pb.Record) -> None:
        data = rec.SerializeToString()
        if len(data) > MAX_RECORD:
            raise Refused(f"cannot write {self.path}: a {rec.WhichOneof('body')} record of {len(data)} bytes "
                          f"passes the {MAX_RECORD >> 20} MiB record limit")
        self._f.write(_varint(len(data)))
        self._f.write(data)

    def add_samples(self, samples: Iterable[RawSample]) -> None:
        for s in samples:
            self._write(pb.Record(sample=sample_to_pb(s)))
            self.samples_written += 1

    def add_events(self, events: Iterable[RawEvent]) -> None:
        for e in events:
            self._write(pb.Record(event=event_to_pb(e)))
            self.events_written += 1

    def add_stalls(self, samples: Iterable[RawStallSample]) -> None:
        """Store accelerator stall samples (batched into StallSamples records)."""
        batch = pb.StallSamples()
        size = 0
        for s in samples:
            batch.samples.append(stall_to_pb(s))
            size += 64 + len(s.kernel) + len(s.reason) + len(s.code)
            if len(batch.samples) >= STALL_BATCH or size >= STALL_BATCH_BYTES:
                self._write(pb.Record(stalls=batch))
                self.stalls_written += len(batch.samples)
                batch = pb.StallSamples()
                size = 0
        if batch.samples:
            self._write(pb.Record(stalls=batch))
            self.stalls_written += len(batch.samples)

    def add_gpu_code(self, c: GpuCode) -> bool:
        """Store a code object once per digest; False when it was already there."""
        if c.digest in self._gpu_digests:
            return False
        self._gpu_digests.add(c.digest)
        for off, data, size in _pieces(c.data):
            first = off == 0
            self._write(pb.Record(gpu_code=pb.GpuCode(
                digest=c.digest, kind=c.kind if first else "", arch=c.arch if first else 0,
                origin=c.origin if first else "", data=data, size=size, offset=off)))
        return True

    def add_stream(self, st: RawStream) -> None:
        """Store a vendor's stall stream whole (in pieces of MAX_PIECE when larger)."""
        for off, data, size in _pieces(st.data):
            self._write(pb.Record(stream=pb.Stream(format=st.format if off == 0 else "", name=st.name, data=data,
                                                   size=size, offset=off)))

    def add_process(self, p: ProcessSnapshot) -> None:
        self._write(pb.Record(process=process_to_pb(p)))

    def add_py_code(self, c: PyCode) -> None:
        i = c.info
        self._write(pb.Record(py_code=pb.PyCode(
            pid=c.pid, addr=c.addr, time_ns=c.time_ns, qualname=i.qualname, filename=i.filename,
            firstlineno=i.firstlineno, line_table=i.line_table, version_major=i.version[0],
            version_minor=i.version[1], first_instr_offset=i.first_instr_offset,
        )))

    def add_py_runtime(self, r: PyRuntimeInfo) -> None:
        self._write(pb.Record(py_runtime=pb.PyRuntime(pid=r.pid, version=r.version, layout_source=r.layout_source,
                                                      binary=r.binary)))

    def add_kernel_symbols(self, symbols: dict[int, str]) -> None:
        ks = pb.KernelSymbols()
        for addr, name in sorted(symbols.items()):
            ks.symbols.add(addr=addr, name=name)
        self._write(pb.Record(kernel_symbols=ks))

    def flush(self) -> None:
        self._f.flush()

    def close(self, footer: CaptureFooter) -> None:
        footer.samples = self.samples_written
        self._write(pb.Record(footer=footer_to_pb(footer)))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._dir.rename(self._tmp.name, self.path.name)
        self._dir.close()


def write_capture(path: Path, cap: Capture) -> None:
    """Write a whole in-memory capture (tests, conversions)."""
    w = CaptureWriter(path, cap.header)
    write_records(w, cap)
    w.close(cap.footer or CaptureFooter())


def write_records(w: CaptureWriter, cap: Capture) -> None:
    """Every record of an in-memory capture into an open writer, which stays open (more may follow)."""
    for p in cap.processes:
        w.add_process(p)
    for r in cap.py_runtimes:
        w.add_py_runtime(r)
    for c in cap.py_codes:
        w.add_py_code(c)
    w.add_samples(cap.samples)
    w.add_events(cap.events)
    for g in cap.gpu_code:
        w.add_gpu_code(g)
    w.add_stalls(cap.stalls)
    for st in cap.streams:
        w.add_stream(st)
    if cap.kernel_symbols:
        w.add_kernel_symbols(cap.kernel_symbols)


class _Cut(Unreadable):
    """The data ends inside a record (a capture whose writer was killed): `iter_records` ends the records there
    when asked for what a cut capture holds (`recover`), and it is Unreadable like any other damage otherwise."""


def iter_records(data: bytes, name: str = "capture", *, partial: bool = False) -> Iterator[pb.Record]:
    """Decode the records of a capture held in memory; raises Unreadable on anything malformed. With `partial`,
    data that ends inside a record ends the records instead (what a killed writer leaves), and a whole record
    over MAX_RECORD (older writers stored large cubins whole) is taken, so that `recover` can rewrite it."""
    try:
        yield from _records(data, name, oversize=partial)
    except _Cut:
        if not partial:
            raise


def _records(data: bytes, name: str, *, oversize: bool) -> Iterator[pb.Record]:
    if not data.startswith(MAGIC):
        raise Unreadable(f"{name}: not an aiflame capture (bad magic)")
    pos, n = len(MAGIC), len(data)
    idx = 0
    while pos < n:
        length = shift = 0
        while True:
            if pos >= n:
                raise _Cut(f"{name}: truncated at record {idx}")
            b = data[pos]
            pos += 1
            length |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
            if shift > 63:
                raise Unreadable(f"{name}: corrupt record length at record {idx}")
        if pos + length > n:
            raise _Cut(f"{name}: truncated at record {idx}")
        if length > MAX_RECORD and not oversize:
            raise Refused(f"{name}: record {idx} is {length} bytes, over the {MAX_RECORD >> 20} MiB a record "
                          "may hold (an older aiflame stored large cubins whole): "
                          f"`aiflame recover {name}` rewrites it")
        rec = pb.Record()
        try:
            rec.ParseFromString(data[pos:pos + length])
        except DecodeError:
            raise Unreadable(f"{name}: corrupt record {idx}") from None
        pos += length
        idx += 1
        yield rec


def _pb_mapping(m: pb.Mapping) -> Mapping:
    return Mapping(m.start, m.end, m.file_offset, m.path, m.build_id, m.perms)


_Piece = pb.GpuCode | pb.Stream


def _joined(m: _Piece, key: str, pieces: dict[str, tuple[_Piece, bytearray]], name: str, what: str,
            most: int) -> tuple[_Piece, bytes] | None:
    """One GpuCode or Stream record: (its first record, the whole data) when it is whole or its last piece, None
    while pieces of it are still to come (joined in `pieces` by `key`; an object whose pieces stop early, in a
    capture cut short, is left out). `most`: the largest size that is not corruption (what is joined grows with
    the pieces read, never with the size a first piece declares)."""
    if not m.size and not m.offset:
        return m, bytes(m.data)
    if m.offset == 0:
        if m.size > most:
            raise Unreadable(f"{name}: corrupt capture (a {what} of {m.size} bytes)")
        pieces[key] = (m, bytearray())
    head = pieces.get(key)
    if head is None or len(head[1]) != m.offset or m.offset + len(m.data) > head[0].size:
        raise Unreadable(f"{name}: corrupt capture ({what} {key.partition(':')[2][:40]}: a piece out of order)")
    first, buf = head
    buf += m.data
    if len(buf) != first.size:
        return None
    del pieces[key]
    return first, bytes(buf)


def _add_gpu_code(cap: Capture, g: pb.GpuCode, pieces: dict[str, tuple[_Piece, bytearray]], name: str) -> None:
    got = _joined(g, "code:" + g.digest, pieces, name, "code object", MAX_RECORD << 4)
    if got is not None:
        first, data = got
        assert isinstance(first, pb.GpuCode)
        cap.gpu_code.append(GpuCode(first.digest, first.kind, first.arch, first.origin, data))


def _add_stream(cap: Capture, st: pb.Stream, pieces: dict[str, tuple[_Piece, bytearray]], name: str) -> None:
    got = _joined(st, "stream:" + st.name, pieces, name, "stream", MAX_STREAM)
    if got is not None:
        first, data = got
        assert isinstance(first, pb.Stream)
        cap.streams.append(RawStream(first.format, first.name, data))


def read_capture(path: Path, *, partial: bool = False) -> Capture:
    """Read a whole capture file; Unreadable for missing, foreign, newer, truncated or corrupt files. With
    `partial`, a capture cut short (no footer, a last record cut off) reads up to its last whole record, with
    `footer` None."""
    name = str(path)
    try:
        data = Path(path).read_bytes()
    except IsADirectoryError:
        raise Unreadable(f"{name}: is a directory, not a capture file") from None
    except OSError as e:
        raise Unreadable(f"{name}: {e.strerror}") from None
    cap: Capture | None = None
    pieces: dict[str, tuple[_Piece, bytearray]] = {}  # code objects and streams split over records, being joined
    for i, rec in enumerate(iter_records(data, name, partial=partial)):
        which = rec.WhichOneof("body")
        if i == 0:
            if which != "header":
                raise Unreadable(f"{name}: corrupt capture (no header)")
            h = rec.header
            if h.format_version > READ_VERSION:
                raise Unreadable(
                    f"{name}: capture format {h.format_version} is newer than this aiflame reads ({READ_VERSION})"
                )
            cap = Capture(header_from_pb(h))
            continue
        assert cap is not None
        if cap.footer is not None:
            raise Unreadable(f"{name}: corrupt capture (records after the footer)")
        if which == "sample":
            s = rec.sample
            cap.samples.append(RawSample(
                s.time_ns, s.pid, s.tid, s.cpu, s.comm, tuple(s.user), tuple(s.kern), s.user_err, s.kern_err,
                s.weight or 1, tuple(RawPyFrame(f.code, f.instr, f.owner, f.is_entry) for f in s.py), s.py_flags,
                s.unwind, s.off_cpu_ns,
            ))
        elif which == "process":
            p = rec.process
            cap.processes.append(ProcessSnapshot(
                p.pid, p.time_ns, [_pb_mapping(m) for m in p.mappings], p.ppid, p.comm, list(p.cmdline),
                p.exe, p.exec_seq,
            ))
        elif which == "py_code":
            c = rec.py_code
            cap.py_codes.append(PyCode(c.pid, c.addr, c.time_ns, CodeInfo(
                c.qualname, c.filename, c.firstlineno, bytes(c.line_table), (c.version_major, c.version_minor),
                c.first_instr_offset)))
        elif which == "py_runtime":
            r = rec.py_runtime
            cap.py_runtimes.append(PyRuntimeInfo(r.pid, r.version, r.layout_source, r.binary))
        elif which == "event":
            cap.events.append(event_from_pb(rec.event))
        elif which == "gpu_code":
            _add_gpu_code(cap, rec.gpu_code, pieces, name)
        elif which == "stalls":
            cap.stalls.extend(stall_from_pb(m) for m in rec.stalls.samples)
        elif which == "stream":
            _add_stream(cap, rec.stream, pieces, name)
        elif which == "kernel_symbols":
            cap.kernel_symbols.update((k.addr, k.name) for k in rec.kernel_symbols.symbols)
        elif which == "footer":
            f = rec.footer
            cap.footer = CaptureFooter(f.end_wall_ns, f.end_mono_ns, f.samples, dict(f.counters),
                                       f.stop_reason, f.agent_cpu_s)
        # Unknown record kinds (a newer minor writer) are skipped.
    if cap is None:
        raise Unreadable(f"{name}: empty capture")
    if cap.footer is None:
        if partial:
            return cap
        raise Unreadable(f"{name}: truncated capture (no footer; the capture did not finish): "
                         f"`aiflame recover {name}` writes what it holds as a complete capture")
    if cap.footer.samples != len(cap.samples):
        raise Unreadable(
            f"{name}: corrupt capture ({len(cap.samples)} samples, footer says {cap.footer.samples})"
        )
    return cap


def recover_capture(src: Path, dst: Path) -> Capture:
    """Write what the capture at `src` holds (its writer killed: no footer, perhaps a last record cut off) as a
    complete capture at `dst`, with a footer saying so (stop reason "recovered", its end the last record's
    time); the capture as written. A complete capture is copied as it is."""
    cap = read_capture(src, partial=True)
    if cap.footer is None:
        times = [s.time_ns for s in cap.samples] + [e.end_ns or e.start_ns for e in cap.events]
        end_mono = max(times, default=cap.header.start_mono_ns)
        cap.footer = CaptureFooter(cap.header.start_wall_ns + max(0, end_mono - cap.header.start_mono_ns), end_mono,
                                   len(cap.samples), {"recovered": 1}, "recovered")
    # Written under a name of its own and renamed: `src` may be the very `dst.partial` a writer of `dst` uses.
    tmp = dst.with_name(f".{dst.name}.recovering")
    write_capture(tmp, cap)
    try:
        with OutputDir.of_file(dst) as d:
            d.rename(tmp.name, dst.name)
    except (OSError, Refused) as e:
        raise BadInput(f"cannot write {dst}: {e}") from None
    return cap
