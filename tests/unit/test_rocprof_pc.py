"""rocprofiler-sdk PC-sampling records built with ctypes in the C layouts of `rocprofiler-sdk/pc_sampling.h`
(bit fields included), parsed back; code objects are real ELF files built with gcc."""

from __future__ import annotations

import ctypes
import struct
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.core.errors import Unreadable
from aiflame.core.raw import GpuCode
from aiflame.symbolize.vendor.rocprof_pc import (
    HOST_TRAP_SIZE,
    STOCHASTIC_SIZE,
    CodeObject,
    amdgpu_refusal,
    code_object_from_elf,
    parse_file,
    parse_records,
)
from tests.unit.elf_builders import readelf_functions

c_u8, c_u32, c_u64 = ctypes.c_uint8, ctypes.c_uint32, ctypes.c_uint64


class PC(ctypes.Structure):
    _fields_ = [("code_object_id", c_u64), ("code_object_offset", c_u64)]


class Dim3(ctypes.Structure):
    _fields_ = [("x", c_u32), ("y", c_u32), ("z", c_u32)]


class Corr(ctypes.Structure):
    _fields_ = [("internal", c_u64), ("external", c_u64)]


class HwId(ctypes.Structure):
    _fields_ = [("chiplet", c_u64, 6), ("wave_id", c_u64, 7), ("simd_id", c_u64, 2), ("pipe_id", c_u64, 4),
                ("cu_or_wgp_id", c_u64, 4), ("shader_array_id", c_u64, 1), ("shader_engine_id", c_u64, 5),
                ("workgroup_id", c_u64, 7), ("vm_id", c_u64, 6), ("queue_id", c_u64, 4),
                ("microengine_id", c_u64, 2), ("reserved0", c_u64, 16)]


class HostTrap(ctypes.Structure):
    _fields_ = [("size", c_u64), ("hw_id", HwId), ("pc", PC), ("exec_mask", c_u64), ("timestamp", c_u64),
                ("dispatch_id", c_u64), ("correlation_id", Corr), ("workgroup_id", Dim3),
                ("wave_in_group", c_u32, 8), ("reserved0", c_u32, 24)]


class Snapshot(ctypes.Structure):
    _fields_ = [("reason_not_issued", c_u32, 4), ("rest", c_u32, 28)]


class Stochastic(ctypes.Structure):
    _fields_ = [("size", c_u64), ("flags", c_u8), ("wave_in_group", c_u8), ("wave_issued", c_u8, 1),
                ("inst_type", c_u8, 5), ("reserved", c_u8, 2), ("hw_id", HwId), ("pc", PC), ("exec_mask", c_u64),
                ("workgroup_id", Dim3), ("wave_count", c_u32), ("timestamp", c_u64), ("dispatch_id", c_u64),
                ("correlation_id", Corr), ("snapshot", Snapshot), ("memory_counters", c_u32)]


def host_trap(co: int, off: int, corr: int = 0) -> bytes:
    r = HostTrap(size=ctypes.sizeof(HostTrap), exec_mask=2**64 - 1, timestamp=123, dispatch_id=9)
    r.hw_id.wave_id, r.hw_id.reserved0 = 77, 0xFFFF
    r.pc.code_object_id, r.pc.code_object_offset = co, off
    r.correlation_id.internal, r.correlation_id.external = corr, 2**63
    r.workgroup_id.x, r.wave_in_group = 5, 31
    return bytes(r)


def stochastic(co: int, off: int, reason: int, issued: int = 0, inst: int = 0, corr: int = 0) -> bytes:
    r = Stochastic(size=ctypes.sizeof(Stochastic), flags=1, wave_in_group=3, wave_issued=issued, inst_type=inst,
                   reserved=3, exec_mask=2**64 - 1, wave_count=40, timestamp=5, dispatch_id=8,
                   memory_counters=2**32 - 1)
    r.hw_id.chiplet, r.hw_id.reserved0 = 63, 0xFFFF
    r.pc.code_object_id, r.pc.code_object_offset = co, off
    r.correlation_id.internal, r.correlation_id.external = corr, 2**64 - 1
    r.snapshot.reason_not_issued, r.snapshot.rest = reason, 2**28 - 1
    return bytes(r)


def test_sizes_match_the_c_layouts() -> None:
    assert (ctypes.sizeof(HostTrap), ctypes.sizeof(Stochastic)) == (HOST_TRAP_SIZE, STOCHASTIC_SIZE)


CO = CodeObject(1, "d" * 64, ((0x1000, 0x200, "gemm_kernel"), (0x1200, 0x100, "relu")))


def test_host_trap_and_stochastic_records() -> None:
    # Oracle: by construction — records laid out here in rocprofiler-sdk's pc_sampling.h structs
    data = (host_trap(1, 0x1040, corr=11) + host_trap(1, 0x1040, corr=11) + stochastic(1, 0x1210, 3, corr=12)
            + stochastic(1, 0x1210, 0, issued=1, inst=2, corr=12) + stochastic(1, 0x1008, 15)
            + stochastic(2, 0x99, 5) + host_trap(0, 0x7F0000001000))
    p = parse_records(data, code_objects={1: CO}, pid=42, device=3)
    got = {(s.code[:1], s.kernel, s.offset, s.reason, s.correlation_id): s.count for s in p.samples}
    assert got == {
        ("d", "gemm_kernel", 0x40, "host_trap", 11): 2,
        ("d", "relu", 0x10, "WAITCNT", 12): 1,
        ("d", "relu", 0x10, "issued MATRIX", 12): 1,
        ("d", "gemm_kernel", 0x8, "reason_15", 0): 1,
        ("", "", 0x99, "BARRIER_WAIT", 0): 1,
        ("", "", 0x7F0000001000, "host_trap", 0): 1,
    }
    assert all(s.source == "rocprof" and s.pid == 42 and s.device == 3 for s in p.samples)
    assert p.counters() == {"rocprof_host_trap_records": 3, "rocprof_stochastic_records": 4,
                            "rocprof_unknown_reason": 1, "rocprof_unknown_kernel": 2}


def test_malformed_files(tmp_path: Path) -> None:
    good = host_trap(1, 0)
    with pytest.raises(Unreadable, match="byte 88 has size 12, not a host-trap"):
        parse_records(good + (12).to_bytes(8, "little") + bytes(20))
    with pytest.raises(Unreadable, match="truncated record at byte 88 .40 of 104"):
        parse_records(good + stochastic(1, 0, 0)[:40])
    with pytest.raises(Unreadable, match="truncated record at byte 0"):
        parse_records(b"\x58\x00")
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(Unreadable, match="empty file"):
        parse_file(tmp_path / "empty")
    with pytest.raises(Unreadable, match="No such file"):
        parse_file(tmp_path / "nope")
    with pytest.raises(Unreadable, match="not a readable ELF"):
        code_object_from_elf(3, b"\x7fELF" + bytes(10))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([host_trap(1, 0x1000), stochastic(1, 0x1200, 2)]), max_size=5), st.binary(max_size=40))
def test_fuzzed_tails_give_one_line_errors(recs: list[bytes], junk: bytes) -> None:
    try:
        p = parse_records(b"".join(recs) + junk, code_objects={1: CO})
    except Unreadable as e:
        assert "\n" not in str(e)
    else:
        assert sum(s.count for s in p.samples) == p.host_trap + p.stochastic >= len(recs)


def test_code_object_kernels_from_a_real_elf(tmp_path: Path) -> None:
    # Oracle: readelf -s of the code object built here with gcc
    src = tmp_path / "k.c"
    src.write_text("int gemm_kernel(int a){return a*3+1;}\nint relu(int a){return a>0?a:0;}\n")
    so = tmp_path / "k.so"
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-nostdlib", "-o", str(so), str(src)], check=True)
    co = code_object_from_elf(4, so.read_bytes())
    funcs = readelf_functions(so)
    assert {k[2] for k in co.kernels} >= {"gemm_kernel", "relu"}
    start, _size = funcs["relu"]
    assert co.find(start + 2) == ("relu", 2)
    p = parse_records(host_trap(4, start + 2), code_objects={4: co})
    assert [(s.kernel, s.offset, s.code) for s in p.samples] == [("relu", 2, co.digest)]
    assert co.gpu_code(b"elf", "k.so") == GpuCode(co.digest, "amdgpu-elf", 0, "k.so", b"elf")


def test_only_an_amdgpu_elf_is_a_code_object() -> None:
    """The ELF header, read by the one decoder (elf_format.parse_header), says which machine the code is for."""
    # Oracle: by construction: e_machine 224 (EM_AMDGPU) or 62 (EM_X86_64) packed at its offset
    def header(machine: int) -> bytes:
        return b"\x7fELF\x02\x01\x01\x40\x03" + bytes(7) + struct.pack("<HHI", 3, machine, 1) + bytes(40)

    assert amdgpu_refusal(header(224), "co") is None
    assert amdgpu_refusal(header(62), "co") == ("co: an ELF file for machine 62, not an AMDGPU code object "
                                                "(e_machine 224)")
    assert amdgpu_refusal(header(224)[:40], "co") == "co: truncated ELF header (40 of 64 bytes)"
    assert amdgpu_refusal(b"\0" + header(224)[1:], "co") == "co: not an ELF file"
