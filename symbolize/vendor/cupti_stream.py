"""Reader of the stream aiflame's CUPTI injection library (agent/accel/cupti_inject.c) writes in each sampled
process: CUDA contexts, stall-reason tables, cubins keyed by CUPTI's CRC, and batches of PC records as
`cuptiPCSamplingGetData` returned them, with the library's drop counters.

Format version 1, little-endian (the C file's header comment is the other half of this definition)::

    header  "AIFLCUPT" u16 version u16 header_size u32 pid u64 start_ns
    record  u16 type u16 flags u32 payload_size, payload      str = u16 length + bytes

PC records are summed as they are read into `totals`, per context, cubin, instruction, function and launch
(CUPTI hands the same hot PCs over in every batch: a training job's millions of records are tens of thousands
of instructions); `keep_pcs` also keeps every record in its batch, for tests of the format. A stream cut short
(the process was killed) reads up to its last whole record and says so (`complete` is False). A record whose
payload does not match its type is skipped and named in `problems`; a foreign file or an unknown version raises
Unreadable.

`stalls_from_stream` turns a parsed stream into the capture's records (RawStallSample, GpuCode). The live
collector (agent/accel/cupti.py) stores each process's stream in the capture as it is (core.raw.RawStream);
`stream_stalls` reads and converts them on the road (symbolize/road.py), and `aiflame import` converts a stream
file the same way.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from aiflame.core.errors import Unreadable
from aiflame.core.raw import GpuCode, RawStallSample, RawStream
from aiflame.symbolize.accel.cubin import cubin_arch

__all__ = ["MAGIC", "NOT_ISSUED_SUFFIX", "VERSION", "CubinRecord", "CuptiStream", "PcBatch", "PcRecord", "PcTotal",
           "RecordType", "StreamError", "StreamStalls", "parse_stream", "reason_counts", "stalls_from_stream",
           "stream_stalls"]

MAGIC = b"AIFLCUPT"
# CUPTI names the subset of a reason's samples in which no instruction issued `<reason>` + this suffix.
NOT_ISSUED_SUFFIX = "_not_issued"
VERSION = 1
_HEADER = struct.Struct("<8sHHIQ")
_RECORD = struct.Struct("<HHI")


class RecordType:
    INFO = 1
    ERROR = 2
    CONTEXT = 3
    REASONS = 4
    CUBIN = 5
    PCS = 6
    COUNTERS = 7
    END = 8


@dataclass(frozen=True, slots=True)
class StreamError:
    """A failure the library reported from inside the target (the target ran on, unsampled from there)."""

    stage: str  # the call or step that failed, e.g. "cuptiSubscribe", "no_driver"
    code: int  # CUptiResult or errno, 0 when none
    message: str


@dataclass(frozen=True, slots=True)
class PcRecord:
    """One CUpti_PCSamplingPCData: samples per stall-reason index at one instruction."""

    crc: int
    pc_offset: int
    function_index: int
    correlation_id: int
    function: str
    reasons: tuple[tuple[int, int], ...]  # (stall reason index, samples)


@dataclass(frozen=True, slots=True)
class PcBatch:
    """One CUpti_PCSamplingData as CUPTI filled it (GetData, or the configured buffer at unload/Disable)."""

    ctx: int
    time_ns: int
    range_id: int
    total_samples: int
    dropped_samples: int
    non_user_samples: int
    hardware_buffer_full: bool
    from_config_buffer: bool
    remaining_pcs: int
    pcs: tuple[PcRecord, ...]


@dataclass(slots=True)
class PcTotal:
    """An instruction's samples summed over the stream: per stall-reason index, and the first batch's time."""

    reasons: dict[int, int]
    time_ns: int


PcKey = tuple[int, int, int, str, int]  # (context, cubin CRC, pc offset, function name, correlation id)


@dataclass(frozen=True, slots=True)
class CubinRecord:
    ctx: int
    module_id: int
    crc: int
    data: bytes


@dataclass(slots=True)
class CuptiStream:
    pid: int
    start_ns: int
    info: dict[str, str] = field(default_factory=dict)
    errors: list[StreamError] = field(default_factory=list)
    devices: dict[int, int] = field(default_factory=dict)  # context id -> device ordinal
    reasons: dict[int, dict[int, str]] = field(default_factory=dict)  # context id -> index -> name
    cubins: list[CubinRecord] = field(default_factory=list)
    batches: list[PcBatch] = field(default_factory=list)  # headers; their pcs only with keep_pcs
    totals: dict[PcKey, PcTotal] = field(default_factory=dict)  # every batch's PC records, summed
    counters: dict[str, int] = field(default_factory=dict)
    complete: bool = False  # the END record was read
    problems: list[str] = field(default_factory=list)  # records skipped, with why


class _Reader:
    def __init__(self, data: bytes | memoryview) -> None:
        self.d = memoryview(data)
        self.i = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.i + n > len(self.d):
            raise Unreadable("record cut short")
        v = self.d[self.i:self.i + n]
        self.i += n
        return v

    def unpack(self, s: struct.Struct) -> tuple[int, ...]:
        return s.unpack(self.take(s.size))

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "little")

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "little")

    def str(self) -> str:
        n = int.from_bytes(self.take(2), "little")
        return bytes(self.take(n)).decode("utf-8", "replace")

    def done(self) -> bool:
        return self.i == len(self.d)


_ERR = struct.Struct("<i")
_CTX = struct.Struct("<IIQ")
_CUBIN = struct.Struct("<IIQQ")
_PCS = struct.Struct("<IIQQQQQBBHI")
_PC = struct.Struct("<QQIII")
_PAIR = struct.Struct("<II")
_MAX_COUNT = 1 << 24  # counts beyond this cannot fit a record's u32 size anyway


def _count(r: _Reader, per_item: int) -> int:
    n = r.u32()
    if n > _MAX_COUNT or n * per_item > len(r.d) - r.i:
        raise Unreadable("count past the record end")
    return n


def _end(r: _Reader) -> None:
    if not r.done():
        raise Unreadable("bytes after the record fields")


def _pcs_record(s: CuptiStream, r: _Reader, totals: dict[tuple[int, int, int, bytes, int], PcTotal],
                keep_pcs: bool) -> None:
    """A batch: its header into `s.batches`, its PC records summed into `totals` (whole or not at all)."""
    ctx, n, t, rng, total, dropped, non_user, full, from_cfg, _pad, remaining = r.unpack(_PCS)
    d, i, end = r.d, r.i, len(r.d)
    if n > _MAX_COUNT or n * (_PC.size + 2) > end - i:
        raise Unreadable("PC count past the record end")
    parsed: list[tuple[int, int, int, int, bytes, memoryview]] = []
    for _ in range(n):
        if i + _PC.size + 2 > end:
            raise Unreadable("PC record cut short")
        crc, off, fidx, corr, k = _PC.unpack_from(d, i)
        i += _PC.size
        ln = d[i] | d[i + 1] << 8
        i += 2
        stop = i + ln + k * _PAIR.size
        if k > _MAX_COUNT or stop > end:
            raise Unreadable("PC record cut short")
        parsed.append((crc, off, fidx, corr, bytes(d[i:i + ln]), d[i + ln:stop]))
        i = stop
    r.i = i
    _end(r)
    pcs = []
    for crc, off, fidx, corr, fname, raw in parsed:
        key = (ctx, crc, off, fname, corr)
        tot = totals.get(key)
        if tot is None:
            tot = totals[key] = PcTotal({}, t)
        reasons = tot.reasons
        for idx, cnt in _PAIR.iter_unpack(raw):
            reasons[idx] = reasons.get(idx, 0) + cnt
        if keep_pcs:
            pcs.append(PcRecord(crc, off, fidx, corr, fname.decode("utf-8", "replace"),
                                tuple((int(a), int(b)) for a, b in _PAIR.iter_unpack(raw))))
    s.batches.append(PcBatch(ctx, t, rng, total, dropped, non_user, bool(full), bool(from_cfg), remaining,
                             tuple(pcs)))


def _record(s: CuptiStream, rtype: int, r: _Reader, totals: dict[tuple[int, int, int, bytes, int], PcTotal],
            keep_pcs: bool) -> None:
    """Apply one record to `s`; nothing is changed when the payload is malformed (raises Unreadable)."""
    if rtype == RecordType.INFO:
        key, value = r.str(), r.str()
        _end(r)
        s.info[key] = value
    elif rtype == RecordType.ERROR:
        (code,) = r.unpack(_ERR)
        stage, message = r.str(), r.str()
        _end(r)
        s.errors.append(StreamError(stage, code, message))
    elif rtype == RecordType.CONTEXT:
        ctx, device, _t = r.unpack(_CTX)
        _end(r)
        s.devices[ctx] = -1 if device == 0xFFFFFFFF else device
    elif rtype == RecordType.REASONS:
        ctx = r.u32()
        table: dict[int, str] = {}
        for _ in range(_count(r, 6)):
            idx = r.u32()
            table[idx] = r.str()
        _end(r)
        s.reasons[ctx] = table
    elif rtype == RecordType.CUBIN:
        ctx, module_id, crc, size = r.unpack(_CUBIN)
        cubin = CubinRecord(ctx, module_id, crc, bytes(r.take(size)))
        _end(r)
        s.cubins.append(cubin)
    elif rtype == RecordType.PCS:
        _pcs_record(s, r, totals, keep_pcs)
    elif rtype == RecordType.COUNTERS:
        counters: list[tuple[str, int]] = []
        for _ in range(_count(r, 10)):
            cname = r.str()
            counters.append((cname, r.u64()))
        _end(r)
        for cname, v in counters:
            s.counters[cname] = s.counters.get(cname, 0) + v
    elif rtype == RecordType.END:
        _end(r)
        s.complete = True
    else:
        raise KeyError(rtype)


def parse_stream(data: bytes, name: str = "stream", *, keep_pcs: bool = True) -> CuptiStream:
    """Parse one process's stream. Raises Unreadable for a foreign, empty or newer-version file.
    `keep_pcs=False` keeps only the sums (`totals`) of the PC records, not each batch's records."""
    if len(data) < _HEADER.size:
        raise Unreadable(f"{name}: too short for a CUPTI stream ({len(data)} bytes)")
    magic, version, header_size, pid, start = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise Unreadable(f"{name}: not an aiflame CUPTI stream (bad magic)")
    if version != VERSION:
        raise Unreadable(f"{name}: CUPTI stream version {version}, this aiflame reads {VERSION}")
    if header_size < _HEADER.size or header_size > len(data):
        raise Unreadable(f"{name}: bad header size {header_size}")
    s = CuptiStream(pid, start)
    totals: dict[tuple[int, int, int, bytes, int], PcTotal] = {}
    view = memoryview(data)
    i = header_size
    while i < len(data):
        if i + _RECORD.size > len(data):
            s.problems.append(f"{name}: {len(data) - i} trailing bytes (the stream was cut short)")
            break
        rtype, _flags, size = _RECORD.unpack_from(data, i)
        body = i + _RECORD.size
        if body + size > len(data):
            s.problems.append(f"{name}: record of type {rtype} at {i} cut short ({len(data) - body} of {size} "
                              "bytes)")
            break
        try:
            _record(s, rtype, _Reader(view[body:body + size]), totals, keep_pcs)
        except Unreadable:
            s.problems.append(f"{name}: malformed record of type {rtype} at offset {i} skipped")
        except KeyError:
            s.problems.append(f"{name}: unknown record type {rtype} at offset {i} skipped")
        i = body + size
        if s.complete:
            if i != len(data):
                s.problems.append(f"{name}: {len(data) - i} bytes after the end record ignored")
            break
    for (ctx, crc, off, fname, corr), tot in totals.items():
        key = (ctx, crc, off, fname.decode("utf-8", "replace"), corr)
        had = s.totals.get(key)  # two undecodable names may read the same
        if had is None:
            s.totals[key] = tot
        else:
            for idx, cnt in tot.reasons.items():
                had.reasons[idx] = had.reasons.get(idx, 0) + cnt
    return s


def stalls_from_stream(s: CuptiStream) -> tuple[list[RawStallSample], list[GpuCode], Counter[str]]:
    """One stream's stall samples and cubins. Nothing is dropped: a sample whose cubin was not captured keeps
    code "" and one whose reason index is not in its context's table gets the name `stall_reason_<index>`;
    both are counted.

    Samples of the same instruction, reason and launch come summed over the stream's batches (the reader's
    `totals`; each keeps the time of the first batch that had it)."""
    counts: Counter[str] = Counter()
    digests: dict[int, str] = {}
    code: list[GpuCode] = []
    for c in s.cubins:
        digest = hashlib.sha256(c.data).hexdigest()
        if c.crc not in digests:
            digests[c.crc] = digest
            code.append(GpuCode(digest, "cubin", cubin_arch(c.data), f"memory of pid {s.pid} (CUPTI)", c.data))
    samples: list[RawStallSample] = []
    for (ctx, crc, offset, function, corr), tot in s.totals.items():
        digest = digests.get(crc, "")
        device = s.devices.get(ctx, -1)
        for reason, n, not_issued in reason_counts(tot.reasons.items(), s.reasons.get(ctx, {}), counts):
            if not digest:
                counts["cupti_samples_without_cubin"] += n
            samples.append(RawStallSample("cupti", s.pid, device, digest, function, offset, reason, n, corr,
                                          tot.time_ns, not_issued))
            counts["cupti_samples"] += n
    for b in s.batches:
        counts["cupti_dropped_samples"] += b.dropped_samples
        counts["cupti_hw_buffer_full"] += int(b.hardware_buffer_full)
    for name in ("samples_dropped", "pcs_dropped", "batches_dropped", "cubins_dropped", "getdata_errors",
                 "write_errors"):
        if s.counters.get(name):
            counts[f"cupti_{name}"] += s.counters[name]
    return samples, code, counts


def reason_counts(pairs: Iterable[tuple[int, int]], table: Mapping[int, str], counts: Counter[str]
                  ) -> list[tuple[str, int, bool]]:
    """One PC record's (reason, samples, not issued) by CUPTI's definitions: `<reason>_not_issued` counts the
    subset of `<reason>`'s samples in which the scheduler issued no instruction, so it splits `<reason>` into an
    issued and a not-issued part instead of adding samples (each sample counts once). A `_not_issued` count above
    its reason's (never seen) counts in full and is counted in `cupti_not_issued_over_reason`. Reason indices
    missing from the context's table read `stall_reason_<index>` (counted)."""
    by_name: dict[str, int] = {}
    for idx, n in pairs:
        if n == 0:
            continue
        name = table.get(idx)
        if name is None:
            name = f"stall_reason_{idx}"
            counts["cupti_unknown_reason_samples"] += n
        by_name[name] = by_name.get(name, 0) + n
    names = set(table.values())
    out: list[tuple[str, int, bool]] = []
    for name, n in by_name.items():
        if name.endswith(NOT_ISSUED_SUFFIX) and name[:-len(NOT_ISSUED_SUFFIX)] in names:
            continue  # taken with its reason below
        sub = by_name.get(name + NOT_ISSUED_SUFFIX, 0) if name + NOT_ISSUED_SUFFIX in names else 0
        if sub > n:
            counts["cupti_not_issued_over_reason"] += sub - n
        if n > sub:
            out.append((name, n - sub, False))
        if sub:
            out.append((name, sub, True))
            counts["cupti_not_issued_samples"] += sub
    for name, sub in by_name.items():  # a not-issued count whose reason has no samples at this PC
        base = name[:-len(NOT_ISSUED_SUFFIX)]
        if name.endswith(NOT_ISSUED_SUFFIX) and base in names and base not in by_name:
            counts["cupti_not_issued_over_reason"] += sub
            counts["cupti_not_issued_samples"] += sub
            out.append((base, sub, True))
    return out


@dataclass
class StreamStalls:
    """What a capture's stored streams hold, read and converted (`stream_stalls`)."""

    stalls: list[RawStallSample] = field(default_factory=list)
    code: list[GpuCode] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)  # cupti_*: for the capture's footer
    warnings: list[str] = field(default_factory=list)  # one line each
    left: list[RawStream] = field(default_factory=list)  # not converted (unreadable, another format): kept


def stream_stalls(streams: Sequence[RawStream]) -> StreamStalls:
    """Read and convert the streams the live collector stored in a capture (core.raw.Capture `streams`): their
    samples, cubins and `cupti_*` counters, and the one-line warnings they call for (errors the injection
    library met, records skipped, streams cut short or unreadable, samples dropped). `Capture.converted` puts
    them in the capture."""
    out = StreamStalls()
    counts: Counter[str] = Counter()
    errors: dict[tuple[str, str], list[int]] = {}
    for st in streams:
        if st.format != "cupti":
            out.warnings.append(f"{st.name}: a stall stream of format {st.format!r}, which this aiflame does not "
                                "read, left out")
            out.left.append(st)
            continue
        try:
            stream = parse_stream(st.data, st.name, keep_pcs=False)
        except Unreadable as e:
            out.warnings.append(str(e))
            counts["cupti_streams_unreadable"] += 1
            out.left.append(st)
            continue
        samples, cubins, c = stalls_from_stream(stream)
        counts.update(c)
        out.stalls += samples
        out.code += cubins
        for err in stream.errors:
            errors.setdefault((err.stage, err.message), []).append(stream.pid)
        out.warnings += _stream_problems(stream)
        counts["cupti_records_skipped"] += len(stream.problems)
        counts["cupti_streams_cut_short"] += not stream.complete
    for (stage, message), pids in errors.items():
        who = f"pid {pids[0]}" if len(pids) == 1 else f"{len(pids)} processes"
        out.warnings.append(f"NVIDIA stall sampling in {who}: {stage}: {message}")
    dropped = counts["cupti_samples_dropped"] + counts["cupti_dropped_samples"]
    if dropped:
        out.warnings.append(f"{dropped} GPU stall samples were dropped (CUPTI buffer or aiflame stream limits); "
                            "see the capture's cupti_* counters")
    out.counters = {k: v for k, v in counts.items() if v}
    return out


def _stream_problems(stream: CuptiStream) -> list[str]:
    out: list[str] = []
    if stream.problems:
        more = f" (+{len(stream.problems) - 1} more)" if len(stream.problems) > 1 else ""
        out.append(f"CUPTI stream of pid {stream.pid}: {stream.problems[0]}{more}")
    if not stream.complete and (stream.batches or stream.cubins):
        out.append(f"CUPTI stream of pid {stream.pid} was cut short (the process did not exit normally): its last "
                   "samples may be missing")
    return out
