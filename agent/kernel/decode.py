"""The sampler's ring-buffer records (bpf/aiflame.h; agent/kernel/records.py mirrors their layout) decoded into
their Python form: `decode_record` gives a RawSample, a ProcEvent, a probe's CallRecord, RetRecord or
OpenRecord, or an off-CPU OffCpuStack or OffCpuEnd."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from aiflame.agent.kernel.records import CallRec, OffCpuEndRec, OpenRec, ProcRec, RecKind, RetRec, SampleRec, unpacker
from aiflame.core.raw import RawPyFrame, RawSample


@dataclass(frozen=True, slots=True)
class ProcEvent:
    kind: RecKind
    time_ns: int
    pid: int
    child: int
    comm: str


@dataclass(frozen=True, slots=True)
class CallRecord:
    """A probed call's entry as the BPF program saw it (raw registers; agent/runtimes names them)."""

    probe: int
    time_ns: int
    pid: int
    tid: int
    args: tuple[int, ...]  # rdi rsi rdx rcx r8 r9, sp, return address
    derefs: tuple[int | None, ...]  # None: the read failed
    string: bytes | None  # None: not asked for, or the read failed
    user: tuple[int, ...]  # leaf first
    user_err: int
    py: tuple[RawPyFrame, ...]
    py_flags: int
    calls: int = 1  # calls this record stands for (PROBE_SAMPLE: 1 + those counted without a record)


@dataclass(frozen=True, slots=True)
class RetRecord:
    probe: int
    time_ns: int
    pid: int
    tid: int
    ret: int
    out: int | None  # the value the call wrote at its out-pointer argument


@dataclass(frozen=True, slots=True)
class OpenRecord:
    """A target opened a shared library and is stopped (SIGSTOP) until the agent continues it."""

    time_ns: int
    pid: int
    tid: int
    path: bytes


ProbeRecord = CallRecord | RetRecord | OpenRecord


@dataclass(frozen=True, slots=True)
class OffCpuStack:
    """A target thread blocked at this stack at sample.time_ns; how long comes with its OffCpuEnd."""

    sample: RawSample


@dataclass(frozen=True, slots=True)
class OffCpuEnd:
    """The block of thread `tid` that began at `out_ns` (its OffCpuStack's time) ended at `end_ns`."""

    pid: int
    tid: int
    out_ns: int
    end_ns: int


_HEAD = unpacker(SampleRec, "data")  # sample_rec up to data[]
_P_HEAD = unpacker(ProcRec)
_C_HEAD = unpacker(CallRec, "data")  # call_rec up to data[]
_R_REC = unpacker(RetRec)
_O_HEAD = unpacker(OpenRec, "path")
_E_REC = unpacker(OffCpuEndRec)


def _py_frames(data: tuple[int, ...], base: int, count: int) -> tuple[RawPyFrame, ...]:
    count = min(count, (len(data) - base) // 2)
    return tuple(
        RawPyFrame(data[base + 2 * i], data[base + 2 * i + 1] & 0xFFFFFFFF, (data[base + 2 * i + 1] >> 32) & 0xFF,
                   (data[base + 2 * i + 1] >> 40) & 0xFF)
        for i in range(count)
    )


def _decode_call(buf: bytes) -> CallRecord:
    f = _C_HEAD.unpack_from(buf)
    _, _cpu, t, pid, tid, probe, ulen = f[:7]
    args, derefs = f[7:15], f[15:19]
    deref_ok, py_count, py_flags, str_len, calls, _pad, raw_str = f[19:26]
    words = (len(buf) - _C_HEAD.size) // 8
    data = struct.unpack_from(f"<{words}Q", buf, _C_HEAD.size) if words > 0 else ()
    nu = min(max(ulen, 0) // 8, len(data))
    string = raw_str[:max(str_len - 1, 0)] if str_len > 0 else None
    return CallRecord(
        probe, t, pid, tid, tuple(args), tuple(d if deref_ok >> i & 1 else None for i, d in enumerate(derefs)),
        string, tuple(data[:nu]), min(ulen, 0), _py_frames(data, nu, py_count), py_flags, max(calls, 1),
    )


def _decode_sample(buf: bytes) -> RawSample:
    _, cpu, t, pid, tid, ulen, klen, comm, py_count, py_flags, unwind, _pad = _HEAD.unpack_from(buf)
    words = (len(buf) - _HEAD.size) // 8
    data = struct.unpack_from(f"<{words}Q", buf, _HEAD.size) if words > 0 else ()
    nu = min(max(ulen, 0) // 8, len(data))
    nk = min(max(klen, 0) // 8, len(data) - nu)
    py = _py_frames(data, nu + nk, py_count)
    return RawSample(
        t, pid, tid, cpu, comm.split(b"\0", 1)[0].decode(errors="replace"), tuple(data[:nu]),
        tuple(data[nu:nu + nk]), min(ulen, 0), min(klen, 0), 1, py, py_flags, unwind,
    )


def decode_record(buf: bytes) -> RawSample | ProcEvent | ProbeRecord | OffCpuStack | OffCpuEnd | None:
    """Turn one ring-buffer record into its Python form (None for an unknown kind)."""
    kind = int.from_bytes(buf[:4], "little")
    if kind == RecKind.SAMPLE:
        return _decode_sample(buf)
    if kind == RecKind.OFFCPU:
        return OffCpuStack(_decode_sample(buf))
    if kind == RecKind.OFFCPU_END:
        _, _cpu, t, pid, tid, out_ns = _E_REC.unpack_from(buf)
        return OffCpuEnd(pid, tid, out_ns, t)
    if kind in (RecKind.FORK, RecKind.EXEC, RecKind.EXIT):
        _, _cpu, t, pid, child, comm = _P_HEAD.unpack_from(buf)
        return ProcEvent(RecKind(kind), t, pid, child, comm.split(b"\0", 1)[0].decode(errors="replace"))
    if kind == RecKind.CALL:
        return _decode_call(buf)
    if kind == RecKind.RET:
        _, _cpu, t, pid, tid, probe, out_ok, ret, out = _R_REC.unpack_from(buf)
        return RetRecord(probe, t, pid, tid, ret, out if out_ok else None)
    if kind == RecKind.OPEN:
        _, _cpu, t, pid, tid = _O_HEAD.unpack_from(buf)
        return OpenRecord(t, pid, tid, buf[_O_HEAD.size:].split(b"\0", 1)[0])
    return None
