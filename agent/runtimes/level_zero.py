"""Level Zero (oneAPI, Intel GPUs) through its loader: module creation (the SPIR-V or zebin it was given is kept
as GpuCode), kernel creation (handle -> name), kernel launches (group counts), copies and fills, command-list
submission and host synchronization. Where a library carries the USDT probes of iaprof's patched compute
runtime, `level_zero:launch_kernel(iba, start VA, size, name)` and `level_zero:compile_kernel(debug zebin
path)`, their sites are probed too: kernel placements for mapping Xe EU-stall IPs (symbolize/vendor/xe_eu_stall.py).

Only libze_loader is probed: the driver (libze_intel_gpu) and the layers are reached through the loader's
dispatch tables, not by exported names, so each API call is one event. Struct offsets below are from
level_zero/ze_api.h (libze-dev 1.8) and were checked with offsetof on x86-64.
"""

from __future__ import annotations

import hashlib
from typing import ClassVar, TypeVar

from aiflame.agent.runtimes.base import (
    ARG0,
    ARG1,
    ARG2,
    ARG3,
    ARG4,
    ARG5,
    DEREF0,
    DEREF3,
    Call,
    Deref,
    Library,
    ProbeSpec,
    Runtime,
    TargetMemory,
    copy_refused,
    drop_pid,
)
from aiflame.core.raw import GpuCode, RawEvent
from aiflame.symbolize.objfmt.elf_format import ELF_MAGIC

RUNTIME = "level_zero"
ZE_RESULT_SUCCESS = 0
# ze_module_desc_t: stype u32 @0, pNext @8, format u32 @16, inputSize @24, pInputModule @32, pBuildFlags @40
MODULE_FORMAT, MODULE_SIZE, MODULE_INPUT, MODULE_FLAGS = 16, 24, 32, 40
FORMAT_IL_SPIRV, FORMAT_NATIVE = 0, 1
# ze_kernel_desc_t: stype u32 @0, pNext @8, flags u32 @16, pKernelName @24
KERNEL_FLAGS, KERNEL_NAME = 16, 24
SPIRV_MAGIC = b"\x03\x02\x23\x07"  # 0x07230203 little-endian
USDT_LAUNCH, USDT_COMPILE = "level_zero:launch_kernel", "level_zero:compile_kernel"
CALL_STR_MAX = 127  # bytes of a string the probe can read (bpf/aiflame.h AIFLAME_CALL_STR, less the NUL)


_T = TypeVar("_T")


def _spec(call: str, **kw: object) -> ProbeSpec:
    return ProbeSpec((call,), call, **kw)  # type: ignore[arg-type]


# ze_group_count_t {u32 x, y, z}: two 8-byte reads inside its 12 bytes, x|y<<32 at 0 and y|z<<32 at 4
_GROUPS = (Deref(ARG2, 0), Deref(ARG2, 4))
LAUNCHES = ("zeCommandListAppendLaunchKernel", "zeCommandListAppendLaunchCooperativeKernel")
SYNCS = {  # call -> the handle argument's name; (handle, uint64 timeout)
    "zeCommandQueueSynchronize": "command_queue",
    "zeCommandListHostSynchronize": "command_list",
    "zeEventHostSynchronize": "event",
    "zeFenceHostSynchronize": "fence",
}

SPECS = [
    # (hContext, hDevice, const ze_module_desc_t *desc, ze_module_handle_t *phModule, phBuildLog)
    _spec("zeModuleCreate", ret=True, out_arg=ARG3, string=DEREF3,
          derefs=(Deref(ARG2, MODULE_FORMAT), Deref(ARG2, MODULE_SIZE), Deref(ARG2, MODULE_INPUT),
                  Deref(ARG2, MODULE_FLAGS))),
    # (hModule, const ze_kernel_desc_t *desc, ze_kernel_handle_t *phKernel): the name through desc->pKernelName
    _spec("zeKernelCreate", ret=True, stack=False, out_arg=ARG2, string=DEREF0,
          derefs=(Deref(ARG1, KERNEL_NAME), Deref(ARG1, KERNEL_FLAGS))),
    _spec("zeModuleDestroy", stack=False),
    _spec("zeKernelDestroy", stack=False),
    # (hCommandList, hKernel, const ze_group_count_t *, hSignalEvent, numWaitEvents, phWaitEvents)
    *(_spec(c, ret=True, derefs=_GROUPS, sample_arg=ARG1) for c in LAUNCHES),
    # the group counts live in device-visible memory the GPU may still write: not read
    _spec("zeCommandListAppendLaunchKernelIndirect", ret=True),
    # (hCommandList, void *dst, const void *src, size_t size, hSignalEvent, numWaitEvents, phWaitEvents)
    _spec("zeCommandListAppendMemoryCopy", ret=True),
    # (hCommandList, void *ptr, const void *pattern, size_t pattern_size, size_t size, hSignalEvent, ...)
    _spec("zeCommandListAppendMemoryFill", ret=True),
    # (hCommandQueue, uint32_t numCommandLists, ze_command_list_handle_t *phCommandLists, hFence)
    _spec("zeCommandQueueExecuteCommandLists", ret=True, derefs=(Deref(ARG2, 0),)),
    *(_spec(c, ret=True) for c in SYNCS),
]


def _i64(v: int) -> int:
    """A value as the capture stores it (sint64): garbage above 2^63 wraps instead of failing the write."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >> 63 else v


def _u32(v: int | None) -> int | None:
    return None if v is None else v & 0xFFFFFFFF


def _event(call: Call, kind: str, args: dict[str, int], strs: dict[str, str] | None = None) -> RawEvent:
    ev = call.event(RUNTIME, kind)
    ev.args = {k: _i64(v) for k, v in args.items()}
    if strs:
        ev.strs.update(strs)
    return ev


def module_kind(data: bytes, fmt: int | None) -> str | None:
    """"zebin" (an ELF), "spirv" (by magic, or any IL-format input), None when neither."""
    if data.startswith(ELF_MAGIC):
        return "zebin"
    if data[:4] == SPIRV_MAGIC or fmt == FORMAT_IL_SPIRV:
        return "spirv"
    return None


class LevelZeroRuntime(Runtime):
    name: ClassVar[str] = RUNTIME

    def __init__(self) -> None:
        self._modules: dict[tuple[int, int], str] = {}  # (pid, module) -> digest of its code ("" unknown)
        self._kernels: dict[tuple[int, int], tuple[str, int]] = {}  # (pid, kernel) -> (name, module)

    def specs(self) -> list[ProbeSpec]:
        return list(SPECS)

    def wants(self, lib: Library) -> bool:
        return lib.basename.startswith("libze_loader.so")

    def usdt(self) -> dict[tuple[str, str], tuple[str, int]]:
        return {("level_zero", "launch_kernel"): (USDT_LAUNCH, 3), ("level_zero", "compile_kernel"): (USDT_COMPILE, 0)}

    def forget(self, pid: int) -> None:
        drop_pid(self._modules, pid)
        drop_pid(self._kernels, pid)

    def decode(self, call: Call, mem: TargetMemory) -> list[RawEvent | GpuCode]:
        name = call.spec.call
        ret = {} if call.ret is None else {"ret": call.ret & 0xFFFFFFFF}  # ze_result_t: codes like 0x78000001
        if name in (USDT_LAUNCH, USDT_COMPILE):
            return [self._usdt(call, mem)]
        if name == "zeModuleCreate":
            return self._module(call, mem, ret)
        if name == "zeKernelCreate":
            return self._kernel(call, mem, ret)
        if name == "zeModuleDestroy":
            self._modules.pop((call.pid, call.arg(ARG0)), None)
            return []
        if name == "zeKernelDestroy":
            self._kernels.pop((call.pid, call.arg(ARG0)), None)
            return []
        if name in LAUNCHES or name == "zeCommandListAppendLaunchKernelIndirect":
            return [self._launch(call, ret)]
        if name == "zeCommandListAppendMemoryCopy":
            args = {"bytes": call.arg(ARG3), "dst": call.arg(ARG1), "src": call.arg(ARG2),
                    "command_list": call.arg(ARG0), "signal_event": call.arg(ARG4),
                    "wait_events": call.arg(ARG5, 32), **ret}
            return [_event(call, "copy", args, {"direction": "copy"})]
        if name == "zeCommandListAppendMemoryFill":
            args = {"bytes": call.arg(ARG4), "dst": call.arg(ARG1), "pattern_size": call.arg(ARG3),
                    "command_list": call.arg(ARG0), "signal_event": call.arg(ARG5), **ret}
            return [_event(call, "copy", args, {"direction": "memset"})]
        if name == "zeCommandQueueExecuteCommandLists":
            # a submission, not a wait: what was submitted is in the appends before it
            args = {"command_queue": call.arg(ARG0), "num_lists": call.arg(ARG1, 32), "fence": call.arg(ARG3),
                    **ret}
            first = call.deref(0)
            if first is not None:
                args["command_list"] = first
            return [_event(call, "other", args)]
        if name in SYNCS:
            return [_event(call, "sync", {SYNCS[name]: call.arg(ARG0), "timeout": call.arg(ARG1), **ret})]
        return []

    def _module(self, call: Call, mem: TargetMemory, ret: dict[str, int]) -> list[RawEvent | GpuCode]:
        fmt = _u32(call.deref(0))
        size = call.deref(1)
        image = call.deref(2)
        args = {"context": call.arg(ARG0), "device": call.arg(ARG1), **ret}
        strs: dict[str, str] = {}
        if fmt is not None:
            args["format"] = fmt
        if size is not None:
            args["size"] = size
        if image is not None:
            args["image"] = image
        if call.out:
            args["module"] = call.out
        if call.string:
            strs["build_flags"] = call.string.decode("utf-8", "replace")
        out: list[RawEvent | GpuCode] = []
        data = None
        if size is None or image is None:
            strs["image_error"] = "descriptor unreadable"
        elif size <= 0:
            strs["image_error"] = f"implausible size {size}"
        elif refused := copy_refused(size, f"pid {call.pid}: module image at {image:#x}"):
            strs["image_error"] = refused
        else:
            # Read now, while the process lives: the caller may free its buffer once the call returned.
            data = mem.read(call.pid, image, size)
            if data is None:
                strs["image_error"] = "unreadable"
        digest = ""
        if data is not None:
            kind = module_kind(data, fmt)
            if kind is None:
                strs["image_error"] = "unknown format"
            else:
                digest = hashlib.sha256(data).hexdigest()
                strs["image"], strs["digest"] = kind, digest
                out.append(GpuCode(digest, kind, 0, f"memory of pid {call.pid}", data))
        self._remember(self._modules, (call.pid, call.out or 0), digest, call.ret)
        return [_event(call, "meta", args, strs), *out]

    def _kernel(self, call: Call, mem: TargetMemory, ret: dict[str, int]) -> list[RawEvent | GpuCode]:
        module = call.arg(ARG0)
        name = call.string.decode("utf-8", "replace") if call.string else None
        ptr = call.deref(0)
        if ptr and (name is None or len(call.string or b"") >= CALL_STR_MAX):
            # the probe's read failed (page not resident) or was cut at its buffer: read it from user space
            name = mem.read_cstr(call.pid, ptr) or name
        args = {"module": module, **ret}
        flags = _u32(call.deref(1))
        if flags is not None:
            args["flags"] = flags
        if call.out:
            args["kernel"] = call.out
        if name:
            self._remember(self._kernels, (call.pid, call.out or 0), (name, module), call.ret)
        return [_event(call, "meta", args, {"name": name} if name else None)]

    @staticmethod
    def _remember(table: dict[tuple[int, int], _T], key: tuple[int, int], value: _T, ret: int | None) -> None:
        """A created handle. A failed create leaves the caller's handle variable as it was: keep that only if
        nothing is known of it (a program that ignores the error still launches with it), never overwrite."""
        if not key[1]:
            return
        if ret is not None and ret & 0xFFFFFFFF == ZE_RESULT_SUCCESS:
            table[key] = value
        else:
            table.setdefault(key, value)

    def _launch(self, call: Call, ret: dict[str, int]) -> RawEvent:
        kernel = call.arg(ARG1)
        args = {"command_list": call.arg(ARG0), "kernel": kernel, "signal_event": call.arg(ARG3),
                "wait_events": call.arg(ARG4, 32), **ret}
        if call.spec.call == "zeCommandListAppendLaunchKernelIndirect":
            args["indirect"] = 1
        else:
            xy, yz = call.deref(0), call.deref(1)
            if xy is not None:
                args["group_x"], args["group_y"] = xy & 0xFFFFFFFF, xy >> 32
            if yz is not None:
                args["group_z"] = yz >> 32
        strs: dict[str, str] = {}
        known = self._kernels.get((call.pid, kernel))
        if known is not None:
            strs["name"] = known[0]
            digest = self._modules.get((call.pid, known[1]))
            if digest:
                strs["module_digest"] = digest
        return _event(call, "compute", args, strs)

    @staticmethod
    def _usdt(call: Call, mem: TargetMemory) -> RawEvent:
        """A USDT site: launch_kernel gives a kernel placement (meta: the API launch already counts it), and
        compile_kernel the path of the debug zebin it wrote."""
        values = [v.value(call) for v in call.spec.usdt]
        launch = call.spec.call == USDT_LAUNCH
        text_at = 3 if launch else 0
        ptr = values[text_at] if len(values) > text_at else None
        text = call.string.decode("utf-8", "replace") if call.string else None
        if ptr and (text is None or len(call.string or b"") >= CALL_STR_MAX):
            text = mem.read_cstr(call.pid, ptr) or text
        args: dict[str, int] = {}
        strs: dict[str, str] = {}
        if launch:
            for key, v in zip(("iba", "kernel_va", "kernel_size"), values, strict=False):
                if v is not None:
                    args[key] = v
            if text:
                strs["name"] = text
        elif text:
            strs["debug_zebin"] = text
        return _event(call, "meta", args, strs)
