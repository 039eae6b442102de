"""Decoding ring-buffer records (the layout itself is checked against the C in the integration tests)."""

from __future__ import annotations

import ctypes

from aiflame.agent.records import ProcRec, RecKind, SampleRec
from aiflame.agent.sampler import ProcEvent, decode_record
from aiflame.raw import RawSample


def test_sample_record() -> None:
    rec = SampleRec(kind=RecKind.SAMPLE, cpu=1, time_ns=123, pid=10, tid=11, user_len=24, kern_len=-14,
                    comm=b"worker")
    rec.user[0], rec.user[1], rec.user[2] = 0x401000, 0x401100, 0x401200
    out = decode_record(bytes(rec))
    assert out == RawSample(123, 10, 11, 1, "worker", (0x401000, 0x401100, 0x401200), (), 0, -14)


def test_proc_record() -> None:
    rec = ProcRec(kind=RecKind.FORK, cpu=0, time_ns=5, pid=10, child=12, comm=b"sh")
    assert decode_record(bytes(rec)) == ProcEvent(RecKind.FORK, 5, 10, 12, "sh")
    assert ctypes.sizeof(ProcRec) == 40


def test_unknown_kind_is_ignored() -> None:
    assert decode_record(b"\x63\x00\x00\x00" + bytes(60)) is None
