"""The Level Zero plug-in on calls built by hand: registers as the x86-64 SysV ABI lays the loader's arguments
out, the probe's reads through ze_module_desc_t / ze_kernel_desc_t / ze_group_count_t (offsets from ze_api.h),
module binaries read from the target's memory, failed reads, unknown handles and garbage."""

from __future__ import annotations

import hashlib
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.agent.runtimes.base import Call, Library, TargetMemory
from aiflame.agent.runtimes.level_zero import SPECS, LevelZeroRuntime, module_kind
from aiflame.core.raw import GpuCode, RawEvent

PID, TID = 5151, 5152
SP = 0x7FFD_0000_1000
UNINIT = 0x78000001  # ZE_RESULT_ERROR_UNINITIALIZED: what every call returns without a driver
LIST, QUEUE, EVENT, FENCE = 0x3000, 0x4000, 0x5000, 0x6000
MODULE, KERNEL = 0x7000, 0x8000
IMAGE, FLAGS_STR, NAME_STR = 0x60_0000, 0x60_1000, 0x60_2000
ZEBIN = b"\x7fELF\x02\x01\x01" + bytes(57) + b"zebin" + bytes(187)
SPIRV = struct.pack("<5I", 0x07230203, 0x10000, 0, 8, 0) + bytes(44)
SPEC = {s.call: s for s in SPECS}


class FakeMemory(TargetMemory):
    """Memory of a target: {address: bytes}; everything else is unreadable."""

    def __init__(self, regions: dict[int, bytes] | None = None) -> None:
        super().__init__()
        self.regions = regions or {}
        self.reads = 0

    def read(self, pid: int, addr: int, size: int) -> bytes | None:
        self.reads += 1
        for start, data in self.regions.items():
            if start <= addr and addr + size <= start + len(data):
                return data[addr - start:addr - start + size]
        return None


def call(name: str, regs: tuple[int, ...] = (), derefs: tuple[int | None, ...] = (), *, ret: int | None = 0,
         out: int | None = None, string: bytes | None = None) -> Call:
    args = (*regs, *([0] * (6 - len(regs))), SP, 0x401234)
    return Call(SPEC[name], PID, TID, 1000, args, (*derefs, *([None] * (4 - len(derefs)))), string,
                user=(0x401000, 0x401234), end_ns=2000 if ret is not None else 0, ret=ret, out=out)


def split(out: list[RawEvent | GpuCode]) -> tuple[list[RawEvent], list[GpuCode]]:
    evs = [e for e in out if isinstance(e, RawEvent)]
    code = [e for e in out if isinstance(e, GpuCode)]
    assert len(evs) + len(code) == len(out)
    return evs, code


def one(rt: LevelZeroRuntime, c: Call, mem: TargetMemory | None = None) -> RawEvent:
    evs, code = split(rt.decode(c, mem or FakeMemory()))
    assert len(evs) == 1 and not code
    return evs[0]


def module_call(image: int | None = IMAGE, size: int | None = len(ZEBIN), fmt: int | None = 1, *,
                ret: int = 0, out: int | None = MODULE, flags: bytes | None = b"-g") -> Call:
    # (hContext, hDevice, desc, phModule, phBuildLog); derefs: desc->format, inputSize, pInputModule, pBuildFlags
    return call("zeModuleCreate", (0x1000, 0x2000, 0x7FFD_0000_0800, 0x7FFD_0000_0900, 0), (
        None if fmt is None else (0xAAAA_0000_0000 | fmt), size, image, FLAGS_STR), ret=ret, out=out, string=flags)


def kernel_call(name: bytes | None, *, ptr: int | None = NAME_STR, out: int | None = KERNEL, ret: int = 0,
                module: int = MODULE) -> Call:
    # (hModule, desc, phKernel); derefs: desc->pKernelName, desc->flags; string: *pKernelName
    return call("zeKernelCreate", (module, 0x7FFD_0000_0A00, 0x7FFD_0000_0B00), (ptr, 0), ret=ret, out=out,
                string=name)


def launch_call(kernel: int = KERNEL, groups: tuple[int, int, int] | None = (64, 2, 1),
                name: str = "zeCommandListAppendLaunchKernel") -> Call:
    # (hCommandList, hKernel, pLaunchFuncArgs, hSignalEvent, numWaitEvents, phWaitEvents); derefs: x|y, y|z
    derefs: tuple[int | None, ...] = (None, None)
    if groups is not None:
        x, y, z = groups
        derefs = (x | y << 32, y | z << 32)
    return call(name, (LIST, kernel, 0x7FFD_0000_0C00, EVENT, 0xFFFF_FFFF_0000_0002, 0), derefs, ret=UNINIT)


def test_specs_and_library() -> None:
    rt = LevelZeroRuntime()
    assert rt.wants(Library("/usr/lib/x86_64-linux-gnu/libze_loader.so.1"))
    assert not rt.wants(Library("/usr/lib/x86_64-linux-gnu/libze_intel_gpu.so.1"))
    assert not rt.wants(Library("/usr/lib/x86_64-linux-gnu/libze_tracing_layer.so.1"))
    module = SPEC["zeModuleCreate"]
    assert [(d.src, d.offset) for d in module.derefs] == [(2, 16), (2, 24), (2, 32), (2, 40)]
    assert (module.out_arg, module.string) == (3, 11)  # phModule; the string at DEREF3 = pBuildFlags
    kernel = SPEC["zeKernelCreate"]
    assert [(d.src, d.offset) for d in kernel.derefs][0] == (1, 24) and kernel.string == 8  # chain: DEREF0


def test_module_create_keeps_the_zebin() -> None:
    # Oracle: by construction — zeModuleCreate's registers and ze_module_desc_t (ze_api.h offsets); hashlib's sha256
    rt = LevelZeroRuntime()
    evs, code = split(rt.decode(module_call(ret=UNINIT), FakeMemory({IMAGE: ZEBIN})))
    (ev,) = evs
    (gc,) = code
    digest = hashlib.sha256(ZEBIN).hexdigest()
    assert (ev.kind, ev.call) == ("meta", "zeModuleCreate")
    assert ev.args == {"context": 0x1000, "device": 0x2000, "ret": UNINIT, "format": 1, "size": len(ZEBIN),
                       "image": IMAGE, "module": MODULE}
    assert ev.strs == {"build_flags": "-g", "image": "zebin", "digest": digest}
    assert gc == GpuCode(digest, "zebin", 0, f"memory of pid {PID}", ZEBIN)


def test_module_kinds() -> None:
    # Oracle: by construction — a zebin (ELF) and SPIR-V's magic word, with the descriptor's format
    assert module_kind(ZEBIN, 1) == "zebin"
    assert module_kind(SPIRV, 0) == "spirv" and module_kind(SPIRV, 1) == "spirv"
    assert module_kind(b"\x01\x02\x03\x04", 0) == "spirv"  # IL format: SPIR-V by the descriptor's word
    assert module_kind(b"\x01\x02\x03\x04", 1) is None
    assert module_kind(b"", None) is None


def test_module_create_spirv_and_unknown_native() -> None:
    # Oracle: by construction — a SPIR-V image and an unknown native one
    rt = LevelZeroRuntime()
    evs, code = split(rt.decode(module_call(size=len(SPIRV), fmt=0), FakeMemory({IMAGE: SPIRV})))
    assert code[0].kind == "spirv" and evs[0].strs["image"] == "spirv"
    evs, code = split(rt.decode(module_call(size=8, fmt=1), FakeMemory({IMAGE: b"CTNI\x00\x00\x00\x00"})))
    assert not code and evs[0].strs["image_error"] == "unknown format"


def test_module_create_failed_reads() -> None:
    rt = LevelZeroRuntime()
    mem = FakeMemory()
    ev = one(rt, module_call(), mem)  # the image is not mapped
    assert ev.strs["image_error"] == "unreadable" and "digest" not in ev.strs
    ev = one(rt, module_call(image=None, size=None, fmt=None, flags=None, out=None), mem)
    assert ev.strs == {"image_error": "descriptor unreadable"}
    assert set(ev.args) == {"context", "device", "ret"}
    reads = mem.reads
    ev = one(rt, module_call(size=2**63), mem)
    assert ev.strs["image_error"].startswith("implausible size") and mem.reads == reads  # not even tried
    assert -(2**63) <= ev.args["size"] < 2**63
    ev = one(rt, module_call(size=0), mem)
    assert ev.strs["image_error"] == "implausible size 0"


def test_kernel_names_reach_launches() -> None:
    # Oracle: by construction — zeKernelCreate's ze_kernel_desc_t name, then launches of that handle
    rt = LevelZeroRuntime()
    split(rt.decode(module_call(), FakeMemory({IMAGE: ZEBIN})))
    meta = one(rt, kernel_call(b"vector_add"))
    assert (meta.kind, meta.strs, meta.args) == ("meta", {"name": "vector_add"},
                                                 {"module": MODULE, "ret": 0, "flags": 0, "kernel": KERNEL})
    ev = one(rt, launch_call())
    assert (ev.kind, ev.call) == ("compute", "zeCommandListAppendLaunchKernel")
    assert ev.args == {"command_list": LIST, "kernel": KERNEL, "signal_event": EVENT, "wait_events": 2,
                       "ret": UNINIT, "group_x": 64, "group_y": 2, "group_z": 1}
    assert ev.strs == {"name": "vector_add", "module_digest": hashlib.sha256(ZEBIN).hexdigest()}
    coop = one(rt, launch_call(groups=(7, 5, 3), name="zeCommandListAppendLaunchCooperativeKernel"))
    assert (coop.args["group_x"], coop.args["group_y"], coop.args["group_z"]) == (7, 5, 3)
    assert coop.strs["name"] == "vector_add"


def test_unknown_kernel_and_unread_group_counts() -> None:
    rt = LevelZeroRuntime()
    ev = one(rt, launch_call(kernel=0xBAD, groups=None))
    assert ev.strs == {} and ev.args["kernel"] == 0xBAD
    assert not {"group_x", "group_y", "group_z"} & set(ev.args)
    indirect = one(rt, call("zeCommandListAppendLaunchKernelIndirect", (LIST, 0xBAD, 0x1000, 0, 0, 0)))
    assert indirect.kind == "compute" and indirect.args["indirect"] == 1 and "group_x" not in indirect.args


def test_kernel_name_falls_back_to_process_memory() -> None:
    # Oracle: by construction — the kernel name placed in the target's memory here
    rt = LevelZeroRuntime()
    mem = FakeMemory({NAME_STR: b"from_memory\0"})
    assert one(rt, kernel_call(None), mem).strs == {"name": "from_memory"}  # the probe's read failed
    long_name = b"_ZTS" + b"k" * 200
    mem = FakeMemory({NAME_STR: long_name + b"\0"})
    ev = one(rt, kernel_call(long_name[:127], out=KERNEL + 1), mem)  # cut at the probe's buffer
    assert ev.strs["name"] == long_name.decode()
    ev = one(rt, kernel_call(b"short", out=KERNEL + 2), FakeMemory())  # complete: memory not needed
    assert ev.strs["name"] == "short"
    nothing = one(rt, kernel_call(None, ptr=None, out=KERNEL + 3), FakeMemory())
    assert nothing.strs == {}
    assert one(rt, launch_call(kernel=KERNEL + 3)).strs == {}


def test_failed_create_never_renames_a_known_handle() -> None:
    # Oracle: by construction — a failed create leaves the caller's handle as it was
    rt = LevelZeroRuntime()
    one(rt, kernel_call(b"first"))
    # a failed create leaves the caller's variable (still KERNEL) untouched: the old name stays
    one(rt, kernel_call(b"second", ret=UNINIT))
    assert one(rt, launch_call()).strs["name"] == "first"
    # a failed create with a fresh value: the program will launch with it, so it is named
    one(rt, kernel_call(b"third", ret=UNINIT, out=KERNEL + 0x10))
    assert one(rt, launch_call(kernel=KERNEL + 0x10)).strs["name"] == "third"
    # a success replaces (handles are reused after zeKernelDestroy)
    assert rt.decode(call("zeKernelDestroy", (KERNEL,)), FakeMemory()) == []
    assert one(rt, launch_call()).strs == {}
    one(rt, kernel_call(b"fourth"))
    assert one(rt, launch_call()).strs["name"] == "fourth"
    one(rt, kernel_call(b"fifth", out=None))  # the out read failed: nothing to name
    one(rt, kernel_call(b"sixth", out=0))
    assert one(rt, launch_call()).strs["name"] == "fourth"


def test_module_destroy_and_forget() -> None:
    rt = LevelZeroRuntime()
    split(rt.decode(module_call(), FakeMemory({IMAGE: ZEBIN})))
    one(rt, kernel_call(b"k"))
    assert rt.decode(call("zeModuleDestroy", (MODULE,)), FakeMemory()) == []
    assert one(rt, launch_call()).strs == {"name": "k"}  # the kernel is known, its module's code no longer
    rt.forget(PID + 1)
    assert one(rt, launch_call()).strs == {"name": "k"}
    rt.forget(PID)
    assert one(rt, launch_call()).strs == {}


def test_copies_submission_and_syncs() -> None:
    # Oracle: by construction — each call's SysV registers in ze_api.h's argument order
    rt = LevelZeroRuntime()
    # (hCommandList, dst, src, size, hSignalEvent, numWaitEvents, phWaitEvents)
    cp = one(rt, call("zeCommandListAppendMemoryCopy", (LIST, 0xD000, 0x5000, 4096, 0, 0xFFFF_0000_0000_0001)))
    assert (cp.kind, cp.strs) == ("copy", {"direction": "copy"})
    assert cp.args == {"bytes": 4096, "dst": 0xD000, "src": 0x5000, "command_list": LIST, "signal_event": 0,
                       "wait_events": 1, "ret": 0}
    # (hCommandList, ptr, pattern, pattern_size, size, hSignalEvent, ...)
    fill = one(rt, call("zeCommandListAppendMemoryFill", (LIST, 0xD000, 0x7000, 4, 1024, EVENT)))
    assert (fill.kind, fill.args["bytes"], fill.args["pattern_size"], fill.strs["direction"]) == (
        "copy", 1024, 4, "memset")
    # (hCommandQueue, numCommandLists, phCommandLists, hFence); deref: phCommandLists[0]
    ex = one(rt, call("zeCommandQueueExecuteCommandLists", (QUEUE, 0xFFFF_0000_0000_0001, 0x7FFD0000, FENCE),
                      (LIST,)))
    assert (ex.kind, ex.args) == ("other", {"command_queue": QUEUE, "num_lists": 1, "fence": FENCE,
                                            "ret": 0, "command_list": LIST})
    assert "command_list" not in one(rt, call("zeCommandQueueExecuteCommandLists", (QUEUE, 1, 0, 0))).args
    for name, handle, key in (("zeCommandQueueSynchronize", QUEUE, "command_queue"),
                              ("zeEventHostSynchronize", EVENT, "event"),
                              ("zeFenceHostSynchronize", FENCE, "fence"),
                              ("zeCommandListHostSynchronize", LIST, "command_list")):
        ev = one(rt, call(name, (handle, 2**64 - 1), ret=UNINIT))
        assert (ev.kind, ev.call, ev.args[key], ev.args["ret"]) == ("sync", name, handle, UNINIT)
        assert ev.args["timeout"] == -1  # UINT64_MAX, as the capture's sint64 stores it
        assert ev.end_ns - ev.start_ns == 1000


_u64 = st.integers(0, 2**64 - 1)


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.sampled_from(sorted(SPEC)), min_size=1, max_size=6),
    st.lists(st.tuples(st.lists(_u64, min_size=6, max_size=6), st.lists(st.none() | _u64, min_size=4, max_size=4),
                       st.none() | st.binary(max_size=130), st.none() | _u64, st.none() | _u64),
             min_size=6, max_size=6),
    st.dictionaries(st.integers(0, 2**48), st.binary(max_size=300), max_size=3),
)
def test_decode_never_raises(names: list[str], raw: list[tuple[list[int], list[int | None], bytes | None,
                                                             int | None, int | None]],
                             regions: dict[int, bytes]) -> None:
    rt = LevelZeroRuntime()
    mem = FakeMemory(regions)
    for name, (regs, derefs, string, ret, out) in zip(names, raw, strict=False):
        evs, code = split(rt.decode(call(name, tuple(regs), tuple(derefs), ret=ret, out=out, string=string), mem))
        for ev in evs:
            assert ev.kind in ("compute", "copy", "sync", "other", "meta")
            assert all(isinstance(v, int) and -(2**63) <= v < 2**63 for v in ev.args.values())
            assert all(isinstance(v, str) for v in ev.strs.values())
        for gc in code:
            assert gc.kind in ("zebin", "spirv") and gc.digest == hashlib.sha256(gc.data).hexdigest()
