"""Xe EU stall records built bit by bit per platform (the fact sheet's layouts), and IPs mapped to kernels."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.core.errors import BadInput
from aiflame.core.model import EventKind, Frame, FrameKind, Profile, TraceEvent
from aiflame.core.raw import Capture, CaptureFooter, CaptureHeader, RawEvent, RawStallSample
from aiflame.symbolize.stalls import stall_profile
from aiflame.symbolize.vendor.xe_eu_stall import (
    LAYOUTS,
    XeKernel,
    layout_for,
    map_ips,
    parse_records,
    xe_kernels_from_events,
)

# Bit positions written out from the fact sheet, independently of the module's tables.
SPEC = {
    "pvc": (29, {"active": 29, "other": 37, "control": 45, "pipestall": 53, "send": 61, "dist_acc": 69, "sbid": 77,
                 "sync": 85, "inst_fetch": 93}),
    "xe2": (29, {"tdr": 29, "other": 37, "control": 45, "pipestall": 53, "send": 61, "dist_acc": 69, "sbid": 77,
                 "sync": 85, "inst_fetch": 93, "active": 101}),
    "xe3p": (61, {"tdr": 61, "other": 69, "control": 77, "pipestall": 85, "send": 93, "dist_acc": 101,
                  "sbid": 109, "sync": 117, "inst_fetch": 125, "active": 133}),
}
FLAGS = {"xe2": (109, 112), "xe3p": (141, 144)}  # ex_id (3 bits), end_flag


def record(platform: str, ip: int, counts: dict[str, int], ex_id: int = 0, end: int = 0) -> bytes:
    ip_bits, pos = SPEC[platform]
    assert ip < 1 << ip_bits
    v = ip
    for name, c in counts.items():
        v |= c << pos[name]
    if platform in FLAGS:
        v |= ex_id << FLAGS[platform][0] | end << FLAGS[platform][1]
    return v.to_bytes(64, "little")


@pytest.mark.parametrize("platform", ["pvc", "xe2", "xe3p"])
def test_every_field_of_every_platform(platform: str) -> None:
    # Oracle: by construction — records built bit by bit from the fact sheet's layouts (xe_eu_stall.c)
    ip_bits, pos = SPEC[platform]
    recs = []
    for i, name in enumerate(pos):
        ip = (1 << ip_bits) - 1 - i  # high IP bits set: a field off by one would pick them up
        recs.append(record(platform, ip, {name: 255 - i}, ex_id=5, end=1))
    parsed = parse_records(b"".join(recs), platform, device=1, time_ns=99)
    got = {(s.offset, s.reason): s.count for s in parsed.samples}
    assert got == {((1 << ip_bits) - 1 - i, name): 255 - i for i, name in enumerate(pos)}
    assert all(s.source == "xe" and s.device == 1 and s.time_ns == 99 and not s.kernel for s in parsed.samples)
    assert parsed.records == len(pos) and not parsed.foreign and not parsed.empty


def test_counts_sum_per_ip_and_reason_and_drops_are_counted() -> None:
    # Oracle: by construction — records built bit by bit here
    data = (record("xe2", 0x100, {"sbid": 3, "send": 1}) + record("xe2", 0x100, {"sbid": 4})
            + bytes(64) + (1 << 200).to_bytes(64, "little") + b"\x01" * 10)
    p = parse_records(data, "xe2")
    assert {(s.offset, s.reason): s.count for s in p.samples} == {(0x100, "sbid"): 7, (0x100, "send"): 1}
    assert (p.records, p.empty, p.foreign, p.partial_bytes) == (4, 1, 1, 10)
    assert p.counters() == {"xe_records": 4, "xe_empty_records": 1, "xe_foreign_records": 1, "xe_partial_bytes": 10}
    assert p.refusal("f", "xe2", 64) == ("f: 266 bytes are not whole 64-byte records (not EU stall data, or a wrong "
                                         "--platform / --record-size)")


def test_more_than_one_foreign_record_in_a_hundred_is_refused() -> None:
    good, foreign = record("xe2", 0x100, {"sbid": 3}), (1 << 200).to_bytes(64, "little")
    assert parse_records(good * 100 + foreign, "xe2").refusal("f", "xe2", 64) is None
    assert parse_records(good * 99 + foreign * 2, "xe2").refusal("f", "xe2", 64) == (
        "f: 2 of 101 records are not xe2 EU stall records (not EU stall data, or a wrong --platform / --record-size)")


def test_pvc_record_read_as_pvc_not_xe2() -> None:
    """The same bits mean `active` on PVC and `tdr` on Xe2."""
    # Oracle: by construction — the fact sheet's PVC and Xe2 layouts
    data = record("pvc", 0x40, {"active": 9})
    assert [s.reason for s in parse_records(data, "pvc").samples] == ["active"]
    assert [s.reason for s in parse_records(data, "xe2").samples] == ["tdr"]


def test_platform_and_size_errors() -> None:
    assert layout_for((12, 60)) is LAYOUTS["pvc"] and layout_for((20, 4)) is LAYOUTS["xe2"]
    assert layout_for((35, 11)) is LAYOUTS["xe3p"]
    with pytest.raises(BadInput, match="no EU stall sampling"):
        layout_for((12, 55))
    with pytest.raises(BadInput, match="unknown Xe platform"):
        parse_records(b"", "gen9")
    with pytest.raises(BadInput, match="record size 8"):
        parse_records(b"", "pvc", record_size=8)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64 * 6 + 20), st.sampled_from(sorted(LAYOUTS)))
def test_fuzzed_buffers_never_raise_and_account_for_every_record(data: bytes, platform: str) -> None:
    p = parse_records(data, platform)
    assert p.records == len(data) // 64 and p.partial_bytes == len(data) % 64
    assert p.foreign + p.empty <= p.records
    assert all(0 < s.count for s in p.samples)


KERNELS = [XeKernel("gemm", 0x10000, 0x800, 0x8000, pid=5, code="z1"), XeKernel("relu", 0x10800, 0x100, 0x8000, 5)]


def test_map_ips_to_kernel_offsets() -> None:
    # Oracle: by construction — IPs of kernels at known addresses above a known instruction base
    def ip(va: int) -> int:
        return (va - 0x8000) >> 3

    samples = [RawStallSample("xe", 0, 0, "", "", ip(0x10040), "sbid", 3),
               RawStallSample("xe", 0, 0, "", "", ip(0x10810), "send", 1),
               RawStallSample("xe", 0, 0, "", "", ip(0x20000), "sbid", 2),
               RawStallSample("cupti", 1, 0, "", "k", 0x10, "wait", 1)]
    mapped, unmapped = map_ips(samples, KERNELS)
    assert [(s.kernel, s.offset, s.pid, s.code) for s in mapped[:2]] == [("gemm", 0x40, 5, "z1"), ("relu", 0x10, 5, "")]
    assert mapped[2] == samples[2] and mapped[3] == samples[3] and unmapped == 2


def test_xe_samples_through_the_merge() -> None:
    # Oracle: by construction — a launch event with its kernel's address and size
    ev = RawEvent("level_zero", "launch_kernel", "meta", 5, 5, 1, args={"kernel_va": 0x10000, "kernel_size": 0x800,
                                                                        "iba": 0x8000}, strs={"name": "gemm"})
    assert xe_kernels_from_events([ev]) == [XeKernel("gemm", 0x10000, 0x800, 0x8000, 5)]
    stack = (Frame("main"), Frame("py_step", FrameKind.PYTHON), Frame("zeCommandListAppendLaunchKernel"))
    launches = [TraceEvent("gemm", EventKind.COMPUTE, 2, pid=5, stack=stack)]
    data = record("xe2", (0x10040 - 0x8000) >> 3, {"sbid": 6, "inst_fetch": 1}) + record("xe2", 0x7, {"send": 2})
    cap = Capture(CaptureHeader(1), events=[ev], stalls=parse_records(data, "xe2").samples, footer=CaptureFooter())
    prof = stall_profile(cap, Profile(events=launches), sass=False)
    got = {tuple(f.name for f in s.stack): s.weight for s in prof.samples}
    assert got == {
        ("main", "py_step", "zeCommandListAppendLaunchKernel", "-", "gemm", "[unknown source]", "+0x0040", "sbid"): 6,
        ("main", "py_step", "zeCommandListAppendLaunchKernel", "-", "gemm", "[unknown source]", "+0x0040",
         "inst_fetch"): 1,
        ("[unknown launch]", "-", "[unknown kernel]", "[unknown source]", "+0x0007", "send"): 2,
    }
    assert prof.counters["stall_xe_unmapped"] == 2 and prof.counters["stall_unknown_launch"] == 2
