"""Decoding ring-buffer records (the layout itself is checked against the C in the integration tests)."""

from __future__ import annotations

import ctypes

from aiflame.agent.kernel.records import ProcRec, RecKind, SampleRec
from aiflame.agent.kernel.sampler import ProcEvent, decode_record
from aiflame.core.raw import RawPyFrame, RawSample


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
