"""CUDA runtime and driver: kernel registration, launches (grid, block, shared memory, stream), copies, syncs,
and modules loaded from memory.

Launch paths: CUDA 13's `<<<>>>` calls __cudaGetKernel(&handle, hostFun) and then __cudaLaunchKernel, which
jumps into cudaLaunchKernel; only cudaLaunchKernel (and its _ptsz/ExC variants) is probed, so each launch is
one event. cudart reaches the driver's cuLaunchKernel inside the runtime call on a real GPU: driver launches
made inside a runtime launch are dropped for the same reason. A kernel is named by its host stub (`func`), whose
ELF symbol is the kernel's mangled name, or by the name it was looked up with (cuModuleGetFunction).
"""

from __future__ import annotations

import hashlib
import struct
from typing import ClassVar

from aiflame.agent.runtimes.base import (
    ARG0,
    ARG1,
    ARG2,
    ARG3,
    SP,
    Call,
    Deref,
    Library,
    ProbeSpec,
    Runtime,
    TargetMemory,
    copy_refused,
    drop_pid,
)
from aiflame.core.errors import Unreadable
from aiflame.core.raw import GpuCode, RawEvent
from aiflame.symbolize.accel.fatbin import FATBIN_MAGIC, fatbin_size
from aiflame.symbolize.objfmt.elf_format import sniff_header

RUNTIME_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel")
MEMCPY_KINDS = {0: "HtoH", 1: "HtoD", 2: "DtoH", 3: "DtoD", 4: "default"}
STR_MAX = 128  # AIFLAME_CALL_STR: a string this long (with its NUL) may have been cut
DRIVER = ("libcuda.so",)  # the driver API lives there only (a static cudart reaches it through dlopen)


def _spec(names: str, call: str = "", **kw: object) -> ProbeSpec:
    symbols = tuple(names.split())
    return ProbeSpec(symbols, call or symbols[0], **kw)  # type: ignore[arg-type]


SPECS = [
    # registration: which fatbin a host stub's kernel lives in, and its device name
    _spec("__cudaRegisterFatBinary", ret=True, stack=False, derefs=(Deref(ARG0, 8),)),
    _spec("__cudaRegisterFunction", stack=False, string=ARG3),
    _spec("__cudaGetKernel", ret=True, stack=False, out_arg=ARG0),
    # runtime launches: grid x|y<<32 in rsi, grid z in edx, block in rcx/r8d, shmem and stream on the stack
    # (launches name their kernel in `sample_arg`: past the record budget they are counted per kernel in BPF)
    _spec("cudaLaunchKernel", ret=True, derefs=(Deref(SP, 8), Deref(SP, 16)), sample_arg=ARG0),
    _spec("cudaLaunchKernel_ptsz", "cudaLaunchKernel", ret=True, derefs=(Deref(SP, 8), Deref(SP, 16)),
          sample_arg=ARG0),
    _spec("cudaLaunchCooperativeKernel", ret=True, derefs=(Deref(SP, 8), Deref(SP, 16)), sample_arg=ARG0),
    # cudaLaunchKernelExC(const cudaLaunchConfig_t *config, func, args): grid, block, shmem, stream in config
    _spec("cudaLaunchKernelExC", ret=True, derefs=(Deref(ARG0, 0), Deref(ARG0, 8), Deref(ARG0, 16),
                                                   Deref(ARG0, 24)), sample_arg=ARG0 + 1),
    _spec("cudaLaunchKernelExC_ptsz", "cudaLaunchKernelExC", ret=True,
          derefs=(Deref(ARG0, 0), Deref(ARG0, 8), Deref(ARG0, 16), Deref(ARG0, 24)), sample_arg=ARG0 + 1),
    # copies: (dst, src, count, kind[, stream])
    _spec("cudaMemcpy", ret=True),
    _spec("cudaMemcpy_ptds", "cudaMemcpy", ret=True),
    _spec("cudaMemcpyAsync", ret=True),
    _spec("cudaMemcpyAsync_ptsz", "cudaMemcpyAsync", ret=True),
    _spec("cudaMemset", ret=True),
    _spec("cudaMemsetAsync", ret=True),
    # syncs, timed by their return
    _spec("cudaDeviceSynchronize", ret=True),
    _spec("cudaStreamSynchronize", ret=True),
    _spec("cudaStreamSynchronize_ptsz", "cudaStreamSynchronize", ret=True),
    _spec("cudaEventSynchronize", ret=True),
    # driver: launches, modules from memory, function lookups
    _spec("cuLaunchKernel cuLaunchKernel_ptsz", "cuLaunchKernel", ret=True, libs=DRIVER,
          derefs=(Deref(SP, 8), Deref(SP, 16), Deref(SP, 24)), sample_arg=ARG0),
    _spec("cuLaunchKernelEx cuLaunchKernelEx_ptsz", "cuLaunchKernelEx", ret=True, libs=DRIVER,
          derefs=(Deref(ARG0, 0), Deref(ARG0, 8), Deref(ARG0, 16), Deref(ARG0, 24)), sample_arg=ARG0 + 1),
    _spec("cuModuleLoadData", ret=True, libs=DRIVER, out_arg=ARG0),
    _spec("cuModuleLoadDataEx", ret=True, libs=DRIVER, out_arg=ARG0),
    _spec("cuModuleLoadFatBinary", ret=True, libs=DRIVER, out_arg=ARG0),
    _spec("cuLibraryLoadData", ret=True, libs=DRIVER, out_arg=ARG0),
    _spec("cuModuleGetFunction", ret=True, libs=DRIVER, stack=False, out_arg=ARG0, string=ARG2),
    _spec("cuLibraryGetKernel", ret=True, libs=DRIVER, stack=False, out_arg=ARG0, string=ARG2),
]


def _lo(v: int | None) -> int:
    return 0 if v is None else v & 0xFFFFFFFF


def _hi(v: int | None) -> int:
    return 0 if v is None else (v >> 32) & 0xFFFFFFFF


def _signed32(v: int | None) -> int:
    if v is None:
        return 0
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >> 31 else v


def _string(call: Call, mem: TargetMemory, arg: int) -> str | None:
    """The probe's string, or /proc/PID/mem when BPF could not read it or cut it (long mangled names)."""
    if call.string is not None and len(call.string) < STR_MAX - 1:
        return call.string.decode("utf-8", "replace")
    full = mem.read_cstr(call.pid, call.arg(arg))
    return full if full else (call.string.decode("utf-8", "replace") if call.string else None)


def code_object_size(head: bytes) -> tuple[str, int] | None:
    """Kind and total size of a code object from its first 64 bytes: a fatbin (header + entries) or an ELF
    cubin (the section header table ends it)."""
    if len(head) >= 16 and struct.unpack_from("<I", head)[0] == FATBIN_MAGIC:
        try:
            return "fatbin", fatbin_size(head[:16])
        except Unreadable:
            return None
    h = sniff_header(head)
    if h is not None and h.layout.is64:
        return "cubin", h.shoff + h.shentsize * h.shnum
    return None


class CudaRuntime(Runtime):
    name: ClassVar[str] = "cuda"

    def __init__(self) -> None:
        self._handles: dict[tuple[int, int], int] = {}  # (pid, kernel handle) -> host stub
        self._functions: dict[tuple[int, int], str] = {}  # (pid, CUfunction/CUkernel) -> name

    def specs(self) -> list[ProbeSpec]:
        return list(SPECS)

    def wants(self, lib: Library) -> bool:
        base = lib.basename
        # static cudart lives in any binary with device code; shared cudart and the driver by name
        return (base.startswith(("libcudart.so", "libcuda.so")) or ".nv_fatbin" in lib.sections
                or ".nvFatBinSegment" in lib.sections)

    def forget(self, pid: int) -> None:
        drop_pid(self._handles, pid)
        drop_pid(self._functions, pid)

    def decode(self, call: Call, mem: TargetMemory) -> list[RawEvent | GpuCode]:
        name = call.spec.call
        pid = call.pid
        ret = {} if call.ret is None else {"ret": _signed32(call.ret)}
        if name == "__cudaRegisterFatBinary":
            return self._register_fatbin(call, mem)
        if name == "__cudaRegisterFunction":
            ev = call.event("cuda", "meta", handle=call.arg(ARG0), func=call.arg(ARG1))
            kernel = _string(call, mem, ARG3)
            if kernel:
                ev.strs["name"] = kernel
            return [ev]
        if name == "__cudaGetKernel":
            if call.out is not None:
                self._handles[(pid, call.out)] = call.arg(ARG1)
            return []
        if name in ("cudaLaunchKernel", "cudaLaunchCooperativeKernel"):
            func = self._handles.get((pid, call.arg(ARG0)), call.arg(ARG0))
            return [call.event(
                "cuda", "compute", name, func=func, grid_x=_lo(call.args[ARG1]), grid_y=_hi(call.args[ARG1]),
                grid_z=_lo(call.args[2]), block_x=_lo(call.args[ARG3]), block_y=_hi(call.args[ARG3]),
                block_z=_lo(call.args[4]), shmem=call.deref(0) or 0, stream=call.deref(1) or 0, **ret)]
        if name == "cudaLaunchKernelExC":
            func = self._handles.get((pid, call.arg(ARG1)), call.arg(ARG1))
            d = call.derefs
            return [call.event(
                "cuda", "compute", name, func=func, grid_x=_lo(d[0]), grid_y=_hi(d[0]), grid_z=_lo(d[1]),
                block_x=_hi(d[1]), block_y=_lo(d[2]), block_z=_hi(d[2]), shmem=d[3] or 0, **ret)]
        if name in ("cudaMemcpy", "cudaMemcpyAsync"):
            kind = _lo(call.args[ARG3])
            ev = call.event("cuda", "copy", name, bytes=call.arg(ARG2), dst=call.arg(ARG0), src=call.arg(ARG1),
                            copy_kind=kind, **ret)
            ev.strs["direction"] = MEMCPY_KINDS.get(kind, f"kind {kind}")
            if name == "cudaMemcpyAsync":
                ev.args["stream"] = call.arg(4)
            return [ev]
        if name in ("cudaMemset", "cudaMemsetAsync"):
            ev = call.event("cuda", "copy", name, bytes=call.arg(ARG2), dst=call.arg(ARG0), **ret)
            ev.strs["direction"] = "memset"
            return [ev]
        if name in ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"):
            ev = call.event("cuda", "sync", name, **ret)
            if name != "cudaDeviceSynchronize":
                ev.args["stream" if "Stream" in name else "event"] = call.arg(ARG0)
            return [ev]
        if name in ("cuLaunchKernel", "cuLaunchKernelEx"):
            if call.parent in RUNTIME_LAUNCHES:
                return []  # the runtime launch around it is the event
            return [self._driver_launch(call, ret)]
        if name in ("cuModuleGetFunction", "cuLibraryGetKernel"):
            kernel = _string(call, mem, ARG2)
            if call.out is not None and kernel:
                self._functions[(pid, call.out)] = kernel
            return []
        if name in ("cuModuleLoadData", "cuModuleLoadDataEx", "cuModuleLoadFatBinary", "cuLibraryLoadData"):
            return self._module_load(call, mem, ret)
        return []

    def _register_fatbin(self, call: Call, mem: TargetMemory) -> list[RawEvent | GpuCode]:
        """Where the fatbin lives, so its cubins can be read after the process is gone: a file and offset, or
        (JIT, embedded in anonymous memory) a copy of it."""
        fatbin = call.deref(0) or 0
        ev = call.event("cuda", "meta", wrapper=call.arg(ARG0), fatbin=fatbin, handle=call.ret or 0)
        out: list[RawEvent | GpuCode] = [ev]
        head = mem.read(call.pid, fatbin, 16)
        found = code_object_size(head) if head else None
        if found is None:
            ev.strs["fatbin_error"] = "unreadable" if head is None else "no fatbin header"
            return out
        ev.args["fatbin_size"] = found[1]
        where = mem.file_of(call.pid, fatbin)
        if where is not None:
            ev.strs["fatbin_file"], ev.args["fatbin_file_offset"] = where
            return out
        refused = copy_refused(found[1], f"pid {call.pid}: fatbin at {fatbin:#x}")
        if refused:
            ev.strs["fatbin_error"] = refused
            return out
        data = mem.read(call.pid, fatbin, found[1])
        if data is None:
            ev.strs["fatbin_error"] = "unreadable"
            return out
        digest = hashlib.sha256(data).hexdigest()
        ev.strs["digest"] = digest
        out.append(GpuCode(digest, "fatbin", 0, f"memory of pid {call.pid}", data))
        return out

    def _driver_launch(self, call: Call, ret: dict[str, int]) -> RawEvent:
        fn = call.arg(ARG0)
        if call.spec.call == "cuLaunchKernel":
            a, d = call.args, call.derefs
            ev = call.event("cuda", "compute", "cuLaunchKernel", function=fn, grid_x=_lo(a[1]), grid_y=_lo(a[2]),
                            grid_z=_lo(a[3]), block_x=_lo(a[4]), block_y=_lo(a[5]), block_z=_lo(d[0]),
                            shmem=_lo(d[1]), stream=d[2] or 0, **ret)
        else:
            fn = call.arg(ARG1)
            d = call.derefs
            ev = call.event("cuda", "compute", "cuLaunchKernelEx", function=fn, grid_x=_lo(d[0]), grid_y=_hi(d[0]),
                            grid_z=_lo(d[1]), block_x=_hi(d[1]), block_y=_lo(d[2]), block_z=_hi(d[2]),
                            shmem=_lo(d[3]), **ret)
        kernel = self._functions.get((call.pid, fn))
        if kernel:
            ev.strs["name"] = kernel
        return ev

    def _module_load(self, call: Call, mem: TargetMemory, ret: dict[str, int]) -> list[RawEvent | GpuCode]:
        image = call.arg(ARG1)
        ev = call.event("cuda", "meta", call.spec.call, image=image, module=call.out or 0, **ret)
        out: list[RawEvent | GpuCode] = [ev]
        head = mem.read(call.pid, image, 64)
        found = code_object_size(head) if head else None
        if found is None:
            text = mem.read_cstr(call.pid, image, 1 << 20) if head else None
            if text and ".version" in text[:4096]:
                found = ("ptx", len(text.encode()))
        if found is None:
            ev.strs["image"] = "unreadable" if head is None else "unknown format"
            return out
        kind, size = found
        if size <= 0:
            ev.strs["image"] = f"implausible {kind} size {size}"
            return out
        refused = copy_refused(size, f"pid {call.pid}: {kind} at {image:#x}")
        if refused:
            ev.strs["image"] = refused
            return out
        data = mem.read(call.pid, image, size)
        if data is None:
            ev.strs["image"] = "unreadable"
            return out
        digest = hashlib.sha256(data).hexdigest()
        ev.strs["image"] = kind
        ev.strs["digest"] = digest
        out.append(GpuCode(digest, kind, 0, f"memory of pid {call.pid}", data))
        return out
