"""The probe manager without BPF: a fake sampler records what would be attached, and records are fed by hand."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.agent.kernel.records import ProbeFlag, ProbeSpecRec
from aiflame.agent.kernel.sampler import CallRecord, OpenRecord, RetRecord
from aiflame.agent.kernel.uprobes import ProbeSite
from aiflame.agent.procmaps import MapEntry, read_maps
from aiflame.agent.runtimes import base as runtimes_base
from aiflame.agent.runtimes.base import ARG0, ARG3, SP, Call, Deref, Library, ProbeSpec, Runtime, TargetMemory
from aiflame.agent.runtimes.cuda import CudaRuntime, code_object_size
from aiflame.agent.runtimes.manager import ProbeManager, fnv1a, spec_rec
from aiflame.core.raw import GpuCode, RawEvent
from aiflame.symbolize.objfmt.elf import ElfFile

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"


class FakeBpf:
    def __init__(self) -> None:
        self.specs: dict[int, ProbeSpecRec] = {}
        self.attached: list[tuple[str, int, int, bool]] = []
        self.seen: set[int] = set()
        self.resumed_pids: list[int] = []
        self.unsent: list[tuple[int, int, int, int]] = []  # what BPF counted without records, for take_unsent

    def set_probe_spec(self, probe: int, spec: ProbeSpecRec) -> None:
        self.specs[probe] = spec

    def attach_probes(self, path: str, sites: Sequence[ProbeSite], *, ret: bool = False) -> dict[int, str]:
        self.attached += [(path, s.offset, s.cookie, ret) for s in sites]
        return {}

    def mark_library_seen(self, path_hash: int) -> None:
        self.seen.add(path_hash)

    def resumed(self, pid: int, stopped_ns: int) -> None:
        self.resumed_pids.append(pid)

    def take_unsent_calls(self) -> list[tuple[int, int, int, int]]:
        out, self.unsent = self.unsent, []
        return out


class Libc(Runtime):
    """A test runtime probing two libc functions, one with a return probe."""

    name = "libc-test"

    def specs(self) -> list[ProbeSpec]:
        return [ProbeSpec(("write",), "write", ret=True), ProbeSpec(("no_such_function", "getpid"), "getpid")]

    def wants(self, lib: Library) -> bool:
        return lib.basename.startswith("libc.so")

    def decode(self, call: Call, mem: TargetMemory) -> list[RawEvent | GpuCode]:
        return [call.event("libc-test", "other", bytes=call.arg(2))]


def _call(probe: int, tid: int = 7, t: int = 100, args: tuple[int, ...] = (1, 2, 3, 0, 0, 0, 0, 0)) -> CallRecord:
    return CallRecord(probe, t, 5, tid, args, (None,) * 4, None, (0x1000, 0x2000), 0, (), 0)


def test_spec_rec_encodes_derefs_string_out_and_flags() -> None:
    rec = spec_rec(ProbeSpec(("f",), "f", ret=True, derefs=(Deref(SP, 8), Deref(9, -4)), string=ARG3, out_arg=ARG0))
    assert rec.flags == ProbeFlag.STACK | ProbeFlag.STR | ProbeFlag.OUT | ProbeFlag.RET
    assert list(rec.src) == [SP, 9, -1, -1] and list(rec.off)[:2] == [8, -4]
    assert (rec.str_src, rec.out_arg) == (ARG3, ARG0)


def test_fnv1a_matches_the_bpf_hash() -> None:
    assert fnv1a(b"") == 0xCBF29CE484222325
    assert fnv1a(b"a") == 0xAF63DC4C8601EC8C  # FNV-1a 64 test vector


def test_attaches_present_symbols_once_per_file(tmp_path: Path) -> None:
    bpf = FakeBpf()
    mgr = ProbeManager([Libc()], bpf)
    assert mgr.consider(LIBC) is not None
    mgr.consider(LIBC)  # the same file again: nothing new
    calls = {(probe, ret) for _, _, probe, ret in bpf.attached if bpf.specs[probe].flags != ProbeFlag.STOP}
    assert calls == {(0, False), (0, True), (1, False)}  # write entry + return, getpid via its second name
    assert len({off for _, off, _, _ in bpf.attached}) == 3  # write, getpid, exit
    assert mgr.consider(str(tmp_path / "missing.so")) is None


@pytest.mark.parametrize("cet", [False, True])
def test_entry_probes_go_past_a_leading_endbr64(tmp_path: Path, cet: bool) -> None:
    """A uprobe on endbr64 is single-stepped (~10 us a call here), the push after it emulated (~0.9 us): a function
    that starts with endbr64 (gcc -fcf-protection, the default on Ubuntu) is probed 4 bytes in, where the
    arguments, sp and the return address at it are what they were at the entry."""
    src = tmp_path / "fake.c"
    src.write_text("long write(int fd, const void *p, long n) { return fd + n; }\nint getpid(void) { return 7; }\n")
    lib = tmp_path / "libc.so.6"
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", f"-fcf-protection={'full' if cet else 'none'}", "-o", str(lib),
                    str(src)], check=True)
    with ElfFile.open(lib) as elf:
        starts = {n: off for n, a in elf.function_addresses({"write", "getpid"}).items()
                  if (off := elf.vaddr_to_file_offset(a)) is not None}
        assert len(starts) == 2
        assert all(elf.pread(off, 4) == b"\xf3\x0f\x1e\xfa" for off in starts.values()) == cet  # as gcc wrote them
    bpf = FakeBpf()
    assert ProbeManager([Libc()], bpf).consider(str(lib)) is not None
    placed = {(off, ret) for _, off, _, ret in bpf.attached}
    want = {off + (4 if cet else 0) for off in starts.values()}
    assert placed == {(off, False) for off in want} | {(off + (4 if cet else 0), True) for off in [starts["write"]]}


def test_a_file_that_could_not_be_opened_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in a soak: the first process mapping libnccl exited between stat and open of its /proc/PID/root
    path, and the library stayed unprobed for the daemon's lifetime."""
    real_open = ElfFile.open
    fails = [OSError(3, "No such process")]

    def flaky_open(path: str) -> ElfFile:
        if fails:
            raise fails.pop()
        return real_open(path)

    monkeypatch.setattr(ElfFile, "open", staticmethod(flaky_open))
    bpf = FakeBpf()
    mgr = ProbeManager([Libc()], bpf)
    assert mgr.consider(LIBC) is None and not bpf.attached
    assert mgr.consider(LIBC) is not None and bpf.attached



def test_probes_go_in_through_the_open_file(tmp_path: Path) -> None:
    """Found in the next soak: the first process exited after its /proc/PID/root path was opened but before the
    probes went in by that path; every attach failed and the file was remembered as unprobed. Probes now go in
    through the open file, which outlives its path."""
    lib = tmp_path / Path(LIBC).name
    shutil.copy(LIBC, lib)

    class PathGoneBpf(FakeBpf):
        def attach_probes(self, path: str, sites: Sequence[ProbeSite], *, ret: bool = False) -> dict[int, str]:
            lib.unlink(missing_ok=True)  # the path dies at the first attach
            if not os.path.exists(path):  # as the kernel resolves it
                return {s.cookie: f"cannot probe {path}+{s.offset:#x}: No such file or directory" for s in sites}
            return super().attach_probes(path, sites, ret=ret)

    bpf = PathGoneBpf()
    mgr = ProbeManager([Libc()], bpf)
    placed = mgr.consider(str(lib))
    assert placed is not None and placed.path == str(lib) and set(placed.calls) == {"write", "getpid", "exit"}
    assert not mgr.warnings

def test_calls_pair_with_returns_per_thread() -> None:
    mgr = ProbeManager([Libc()], FakeBpf())
    mgr.on_record(_call(0, tid=7, t=100))
    mgr.on_record(_call(0, tid=8, t=110))
    mgr.on_record(_call(1, tid=7, t=120))  # no return probe: finished at once
    mgr.on_record(RetRecord(0, 200, 5, 7, 3, None))
    events, _ = mgr.take()
    assert [(e.call, e.tid, e.start_ns, e.end_ns) for e in events] == [("getpid", 7, 120, 0), ("write", 7, 100, 200)]
    mgr.finish()  # tid 8 never returned: kept, without an end
    events, _ = mgr.take()
    assert [(e.tid, e.end_ns) for e in events] == [(8, 0)]


def test_return_address_completes_the_stack() -> None:
    mgr = ProbeManager([Libc()], FakeBpf())
    mgr.on_record(_call(1, args=(0, 0, 0, 0, 0, 0, 0x7FF0, 0x1234)))
    (e,), _ = mgr.take()
    assert e.user == (0x1000, 0x1234, 0x2000)


def test_orphaned_calls_are_kept_and_counted() -> None:
    mgr = ProbeManager([Libc()], FakeBpf())
    mgr.on_record(_call(0, t=1))
    mgr.on_record(_call(0, t=2))  # nested write whose return is lost
    mgr.on_record(RetRecord(0, 9, 5, 7, 0, None))  # returns the innermost
    mgr.finish()
    events, _ = mgr.take()
    assert sorted((e.start_ns, e.end_ns) for e in events) == [(1, 0), (2, 9)]


def _cuda_call(name: str, args: list[int], derefs: tuple[int | None, ...] = (None,) * 4, **kw: object) -> Call:
    spec = next(s for s in CudaRuntime().specs() if s.symbols[0] == name)
    full = tuple(args + [0] * (8 - len(args)))
    return Call(spec, 5, 7, 100, full, derefs, None, end_ns=200, **kw)  # type: ignore[arg-type]


def test_cuda_launch_decodes_grid_block_shmem_stream() -> None:
    rt = CudaRuntime()
    call = _cuda_call("cudaLaunchKernel", [0x401000, 4 | 2 << 32, 3, 256 | 1 << 32, 1], (128, 0xABC, None, None),
                      ret=35)
    (ev,) = rt.decode(call, TargetMemory())
    assert isinstance(ev, RawEvent) and ev.kind == "compute"
    assert {k: ev.args[k] for k in ("func", "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shmem",
                                    "stream", "ret")} == {"func": 0x401000, "grid_x": 4, "grid_y": 2, "grid_z": 3,
                                                          "block_x": 256, "block_y": 1, "block_z": 1, "shmem": 128,
                                                          "stream": 0xABC, "ret": 35}


def test_cuda_get_kernel_handle_maps_back_to_the_host_stub() -> None:
    rt = CudaRuntime()
    rt.decode(_cuda_call("__cudaGetKernel", [0x7000, 0x401000], out=0xDEAD), TargetMemory())
    (ev,) = rt.decode(_cuda_call("cudaLaunchKernel", [0xDEAD]), TargetMemory())
    assert isinstance(ev, RawEvent) and ev.args["func"] == 0x401000


def test_driver_launch_inside_a_runtime_launch_is_not_counted_twice() -> None:
    rt = CudaRuntime()
    inner = _cuda_call("cuLaunchKernel", [0x55, 1, 1, 1, 32, 1], parent="cudaLaunchKernel")
    assert rt.decode(inner, TargetMemory()) == []
    alone = _cuda_call("cuLaunchKernel", [0x55, 8, 1, 1, 32, 1], (1, 64, 0x9, None))
    (ev,) = rt.decode(alone, TargetMemory())
    assert isinstance(ev, RawEvent) and (ev.args["grid_x"], ev.args["block_x"], ev.args["shmem"]) == (8, 32, 64)


def test_cuda_memcpy_direction_and_bytes() -> None:
    (ev,) = CudaRuntime().decode(_cuda_call("cudaMemcpy", [0x1, 0x2, 4096, 2]), TargetMemory())
    assert isinstance(ev, RawEvent) and (ev.kind, ev.args["bytes"], ev.strs["direction"]) == ("copy", 4096, "DtoH")


def test_code_object_size() -> None:
    fatbin = (0xBA55ED50).to_bytes(4, "little") + (1).to_bytes(2, "little") + (16).to_bytes(2, "little")
    fatbin += (100).to_bytes(8, "little")
    assert code_object_size(fatbin) == ("fatbin", 116)
    elf = bytearray(64)
    elf[:6] = b"\x7fELF\x02\x01"
    elf[0x28:0x30] = (1000).to_bytes(8, "little")
    elf[0x3A:0x3E] = (64).to_bytes(2, "little") + (5).to_bytes(2, "little")
    assert code_object_size(bytes(elf)) == ("cubin", 1320)
    assert code_object_size(b"junk" * 20) is None


class NoMemory(TargetMemory):
    def read(self, pid: int, addr: int, size: int) -> bytes | None:
        return None


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 25), st.lists(st.integers(0, 2**64 - 1), min_size=8, max_size=8),
       st.lists(st.one_of(st.none(), st.integers(0, 2**64 - 1)), min_size=4, max_size=4),
       st.one_of(st.none(), st.binary(max_size=64)), st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_cuda_decode_never_raises(i: int, args: list[int], derefs: list[int | None], string: bytes | None,
                                  out: int | None) -> None:
    rt = CudaRuntime()
    spec = rt.specs()[i]
    call = Call(spec, 5, 7, 1, tuple(args), tuple(derefs), string, ret=args[0], out=out)
    for item in rt.decode(call, NoMemory()):
        assert isinstance(item, RawEvent | GpuCode)


def test_process_memory_reads_our_own_process() -> None:
    import ctypes
    import os

    buf = ctypes.create_string_buffer(b"hello aiflame")
    mem = TargetMemory()
    assert mem.read_cstr(os.getpid(), ctypes.addressof(buf)) == "hello aiflame"
    assert mem.read(os.getpid(), 0, 8) is None
    assert mem.file_of(os.getpid(), ctypes.addressof(buf)) is None  # heap: anonymous
    libc = ctypes.CDLL(None)
    where = mem.file_of(os.getpid(), ctypes.cast(libc.getpid, ctypes.c_void_p).value or 0)
    assert where is not None and "libc.so" in where[0] and where[1] > 0


def test_each_stop_tells_the_session_why_and_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The session re-reads a stopped target's maps: at a library open, in the loader (the Loader plug-in's
    _dl_debug_state, BPF stopping only after opens: PROBE_IF_OPENED) or in exit(); every stop is continued
    and counted with the time it was held."""
    stops: list[tuple[int, str]] = []
    continued: list[int] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: continued.append(pid))
    bpf = FakeBpf()
    mem = CountingMemory()
    m = ProbeManager([], bpf, mem, on_stop=lambda pid, why: stops.append((pid, why)))
    probe = {spec.call: i for i, (_, spec) in enumerate(m._specs)}
    assert ProbeFlag(bpf.specs[probe["_dl_debug_state"]].flags) == ProbeFlag.STOP | ProbeFlag.IF_OPENED
    assert ProbeFlag(bpf.specs[probe["exit"]].flags) == ProbeFlag.STOP
    now = time.monotonic_ns()
    m.on_record(OpenRecord(now, 41, 41, b"/nonexistent/libx.so"))
    m.on_record(CallRecord(probe["_dl_debug_state"], now, 41, 42, (0,) * 8, (), None, (), 0, (), 0))
    m.on_record(CallRecord(probe["exit"], now, 41, 41, (0,) * 8, (), None, (), 0, (), 0))
    assert stops == [(41, "open"), (41, "loader"), (41, "process")]
    assert continued == [41, 41, 41] and m.stops == 3 and m.stopped_ns >= 0
    assert mem.forgotten == [(41, "maps")] * 3  # a stop may follow a mapping: the maps kept for file_of go
    m.forget(41)
    assert mem.forgotten[-1] == (41, "all")


class CountingMemory(TargetMemory):
    def __init__(self) -> None:
        super().__init__()
        self.forgotten: list[tuple[int, str]] = []

    def forget_maps(self, pid: int) -> None:
        self.forgotten.append((pid, "maps"))

    def forget(self, pid: int) -> None:
        self.forgotten.append((pid, "all"))



_EXEC_CHILD = r"""
import ctypes, os, sys
buf = ctypes.create_string_buffer(sys.argv[1].encode())
print(ctypes.addressof(buf), flush=True)
sys.stdin.readline()
if sys.argv[1] == "before-exec":
    os.execv(sys.executable, [sys.executable, __file__, "after-exec"])
"""


def test_a_kept_reader_follows_its_process_through_exec(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(_EXEC_CHILD)
    p = subprocess.Popen([sys.executable, str(script), "before-exec"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdin is not None
        mem = TargetMemory()
        first = int(p.stdout.readline())
        assert mem.read_cstr(p.pid, first) == "before-exec"
        reader = mem._readers[p.pid]
        assert mem.read_cstr(p.pid, first) == "before-exec" and mem._readers[p.pid] is reader  # kept
        p.stdin.write("\n")
        p.stdin.flush()
        second = int(p.stdout.readline())  # the same pid, a new image
        assert mem.read_cstr(p.pid, second) == "after-exec"
        assert mem._readers[p.pid] is not reader
        mem.forget(p.pid)
        assert p.pid not in mem._readers
    finally:
        p.kill()
        p.wait()


def test_readers_kept_are_bounded_and_closed() -> None:
    buf = ctypes.create_string_buffer(b"x" * 8)
    mem = TargetMemory()
    mem.KEEP = 2
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        for p in sleepers:
            mem.read(p.pid, 0x1000, 8)  # unmapped: None, but the reader stays
        assert list(mem._readers) == [p.pid for p in sleepers[1:]]
        assert mem.read(os.getpid(), ctypes.addressof(buf), 8) == b"x" * 8
        assert len(mem._readers) == 2
        fds = [r._fd for r in mem._readers.values()]
        mem.close()
        assert not mem._readers
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)  # type: ignore[arg-type]
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def test_file_of_keeps_maps_until_told_and_reads_again_on_a_miss(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    reads: list[int] = []

    def counted(pid: int) -> list[MapEntry] | None:
        reads.append(pid)
        return read_maps(pid)

    monkeypatch.setattr(runtimes_base, "read_maps", counted)
    mem = TargetMemory()
    pid = os.getpid()
    libc_fn = ctypes.cast(ctypes.CDLL(None).getpid, ctypes.c_void_p).value
    assert libc_fn
    path, off = mem.file_of(pid, libc_fn) or ("", 0)
    assert os.path.basename(path).startswith("libc") and off > 0
    assert mem.file_of(pid, libc_fn) == (path, off) and len(reads) == 1  # from the kept maps
    data = tmp_path / "mapped.bin"
    data.write_bytes(b"\0" * 8192)
    with open(data, "rb") as f, mmap.mmap(f.fileno(), 8192, prot=mmap.PROT_READ):
        start = _mapping_start(pid, str(data))
        assert mem.file_of(pid, start + 4100) == (str(data), 4100)  # mapped since: a miss reads them again
        assert len(reads) == 2
        heap = ctypes.addressof(ctypes.create_string_buffer(64))  # anonymous memory
        assert mem.file_of(pid, heap) is None and len(reads) == 3  # not a file in the kept maps: read again
        assert mem.file_of(pid, start + 4100) == (str(data), 4100) and len(reads) == 3  # kept, and still mapped
        # Another file mapped over the same range with no stop between (munmap and mmap stop nothing): the kept
        # maps' answer is checked against the process's map_files, and read again.
        other = tmp_path / "other.bin"
        other.write_bytes(b"\1" * 8192)
        with open(other, "rb") as g:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_long]
            map_fixed = 0x10
            assert libc.mmap(start, 8192, mmap.PROT_READ, mmap.MAP_PRIVATE | map_fixed, g.fileno(), 0) == start
        assert mem.file_of(pid, start + 4100) == (str(other), 4100) and len(reads) == 4
    mem.forget_maps(pid)
    assert mem.file_of(pid, libc_fn) == (path, off) and len(reads) == 5


def _mapping_start(pid: int, path: str) -> int:
    return next(m[0] for m in read_maps(pid) or [] if m[6] == path)
