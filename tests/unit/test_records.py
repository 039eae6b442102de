"""Decoding ring-buffer records, and the constants shared with bpf/aiflame.h (the struct layouts themselves are
checked against the compiled C in the integration tests)."""

from __future__ import annotations

import ctypes
import enum
import re

from aiflame.agent.kernel import records
from aiflame.agent.kernel.records import ProbeFlag, ProcRec, RecKind, SampleRec, TargetFlag
from aiflame.agent.kernel.sampler import BPF_DIR, ProcEvent, decode_record
from aiflame.core.raw import PyFlag, RawPyFrame, RawSample


def test_sample_record() -> None:
    rec = SampleRec(kind=RecKind.SAMPLE, cpu=1, time_ns=123, pid=10, tid=11, user_len=24, kern_len=-14,
                    comm=b"worker")
    rec.data[0], rec.data[1], rec.data[2] = 0x401000, 0x401100, 0x401200
    out = decode_record(bytes(rec))
    assert out == RawSample(123, 10, 11, 1, "worker", (0x401000, 0x401100, 0x401200), (), 0, -14)


def test_packed_sample_with_kernel_and_python_frames() -> None:
    rec = SampleRec(kind=RecKind.SAMPLE, cpu=0, time_ns=5, pid=3, tid=4, user_len=8, kern_len=16, comm=b"py",
                    py_count=2, py_flags=3)
    words = [0x10, 0xFFFF1, 0xFFFF2, 0xC0DE1, 56 | (3 << 32), 0xC0DE2, 70 | (1 << 40)]
    for i, w in enumerate(words):
        rec.data[i] = w
    size = SampleRec.data.offset + 8 * len(words)  # the BPF side copies only the used part
    out = decode_record(bytes(rec)[:size])
    assert isinstance(out, RawSample)
    assert out.user == (0x10,) and out.kern == (0xFFFF1, 0xFFFF2)
    assert out.py == (RawPyFrame(0xC0DE1, 56, 3, 0), RawPyFrame(0xC0DE2, 70, 0, 1))
    assert out.py_flags == 3


def test_truncated_record_does_not_overrun() -> None:
    rec = SampleRec(kind=RecKind.SAMPLE, user_len=800, kern_len=800, py_count=90)
    out = decode_record(bytes(rec)[: SampleRec.data.offset + 16])
    assert isinstance(out, RawSample) and len(out.user) == 2 and out.kern == () and out.py == ()


def test_proc_record() -> None:
    rec = ProcRec(kind=RecKind.FORK, cpu=0, time_ns=5, pid=10, child=12, comm=b"sh")
    assert decode_record(bytes(rec)) == ProcEvent(RecKind.FORK, 5, 10, 12, "sh")
    assert ctypes.sizeof(ProcRec) == 40


def test_unknown_kind_is_ignored() -> None:
    assert decode_record(b"\x63\x00\x00\x00" + bytes(60)) is None


def _header_values() -> dict[str, int]:
    """Every `#define NAME <number>` and `NAME = <number>` enum entry of bpf/aiflame.h."""
    text = re.sub(r"/\*.*?\*/", "", (BPF_DIR / "aiflame.h").read_text(), flags=re.S)
    found = re.findall(r"^\s*#define\s+(\w+)\s+(\d+)\s*$", text, re.M)
    found += re.findall(r"^\s*(\w+)\s*=\s*(\d+)\s*,", text, re.M)
    return {name: int(v) for name, v in found}


def _members(prefix: str, e: type[enum.Enum]) -> dict[str, int]:
    return {prefix + m.name: int(m.value) for m in e}


def test_flags_and_kinds_agree_with_the_c_header() -> None:
    c = _header_values()
    for prefix, mirror in (("PY_", PyFlag), ("TARGET_", TargetFlag), ("PROBE_", ProbeFlag), ("REC_", RecKind),
                           ("CNT_", records.Counter)):
        in_c = {k: v for k, v in c.items() if k.startswith(prefix) and k != "CNT_MAX"}
        assert in_c == _members(prefix, mirror), prefix
    assert c["CNT_MAX"] == records.COUNTER_SLOTS


def test_sizes_agree_with_the_c_header() -> None:
    c = _header_values()
    assert {name: c["AIFLAME_" + name] for name in ("MAX_STACK", "COMM_LEN", "MAX_PY_FRAMES", "MAX_PROBES",
                                                   "PROBE_ARGS", "PROBE_DEREFS", "PROBE_REGS", "CALL_STR",
                                                   "PATH_LEN")} == {
        "MAX_STACK": records.MAX_STACK, "COMM_LEN": records.COMM_LEN, "MAX_PY_FRAMES": records.MAX_PY_FRAMES,
        "MAX_PROBES": records.MAX_PROBES, "PROBE_ARGS": records.PROBE_ARGS, "PROBE_DEREFS": records.PROBE_DEREFS,
        "PROBE_REGS": records.PROBE_REGS, "CALL_STR": records.CALL_STR, "PATH_LEN": records.PATH_LEN,
    }


def test_the_decoder_reads_the_layouts_it_is_given() -> None:
    """The decoder's formats are derived from records.py (checked against the C by test_records_layout): padding
    the compiler inserts and a tail are skipped, arrays read as their elements, char arrays as bytes."""
    import ctypes

    from aiflame.agent.kernel.records import unpacker

    class Padded(ctypes.Structure):
        _fields_ = [("a", ctypes.c_uint32), ("b", ctypes.c_uint64), ("c", ctypes.c_int16 * 3),
                    ("name", ctypes.c_char * 5), ("d", ctypes.c_uint64)]

    u = unpacker(Padded)
    assert u.format == "<I4xQ3h5s5xQ" and u.size == ctypes.sizeof(Padded)
    rec = Padded(7, 2**40, (1, -2, 3), b"abc", 9)
    assert u.unpack(bytes(rec)) == (7, 2**40, 1, -2, 3, b"abc\0\0", 9)
    assert unpacker(Padded, "name").format == "<I4xQ3h"
