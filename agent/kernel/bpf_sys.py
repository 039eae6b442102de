"""The few bpf(2) and perf_event_open(2) calls the agent makes itself (x86-64): map element operations, perf
events, BPF links with a cookie, and creating maps, BTF and programs from a compile cache entry
(agent/kernel/bpf_cache.py). Errors are OSError with the errno."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import struct
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

SYS_PERF_EVENT_OPEN = 298
SYS_BPF = 321
BPF_MAP_CREATE, BPF_PROG_LOAD, BPF_OBJ_GET_INFO_BY_FD, BPF_BTF_LOAD = 0, 5, 15, 18
BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_MAP_DELETE_ELEM, BPF_MAP_GET_NEXT_KEY = 1, 2, 3, 4
BPF_LINK_CREATE = 28
BPF_ENABLE_STATS = 32
BPF_PERF_EVENT = 41
BPF_TRACE_UPROBE_MULTI = 48
BPF_TRACE_UPROBE_SESSION = 57  # kernel 6.13+
BPF_PROG_TYPE_KPROBE = 2
BPF_F_UPROBE_MULTI_RETURN = 1
PERF_FLAG_FD_CLOEXEC = 8
PERF_TYPE_HARDWARE, PERF_TYPE_SOFTWARE, PERF_TYPE_TRACEPOINT = 0, 1, 2
PERF_COUNT_HW_CPU_CYCLES, PERF_COUNT_SW_CPU_CLOCK = 0, 0
ATTR_FREQ = 1 << 10  # perf_event_attr.freq: sample_period holds a frequency
TRACEFS = Path("/sys/kernel/tracing")


class PerfEventAttr(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),  # or sample_freq with ATTR_FREQ
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("wakeup_events", ctypes.c_uint32),
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),  # uprobe: path
        ("config2", ctypes.c_uint64),  # uprobe: file offset
        ("branch_sample_type", ctypes.c_uint64),
        ("sample_regs_user", ctypes.c_uint64),
        ("sample_stack_user", ctypes.c_uint32),
        ("clockid", ctypes.c_int32),
        ("sample_regs_intr", ctypes.c_uint64),
        ("aux_watermark", ctypes.c_uint32),
        ("sample_max_stack", ctypes.c_uint16),
        ("reserved2", ctypes.c_uint16),
        ("aux_sample_size", ctypes.c_uint32),
        ("reserved3", ctypes.c_uint32),
        ("sig_data", ctypes.c_uint64),
        ("config3", ctypes.c_uint64),
    ]


class _LinkCreate(ctypes.Structure):
    _fields_ = [
        ("prog_fd", ctypes.c_uint32),
        ("target_fd", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("bpf_cookie", ctypes.c_uint64),
        ("pad", ctypes.c_uint8 * 48),
    ]


class _LinkUprobeMulti(ctypes.Structure):
    _fields_ = [
        ("prog_fd", ctypes.c_uint32),
        ("target_fd", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("path", ctypes.c_uint64),
        ("offsets", ctypes.c_uint64),
        ("ref_ctr_offsets", ctypes.c_uint64),
        ("cookies", ctypes.c_uint64),
        ("cnt", ctypes.c_uint32),
        ("uprobe_flags", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class _MapCreate(ctypes.Structure):
    _fields_ = [
        ("map_type", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("inner_map_fd", ctypes.c_uint32),
        ("numa_node", ctypes.c_uint32),
        ("map_name", ctypes.c_char * 16),
        ("map_ifindex", ctypes.c_uint32),
        ("btf_fd", ctypes.c_uint32),
        ("btf_key_type_id", ctypes.c_uint32),
        ("btf_value_type_id", ctypes.c_uint32),
        ("btf_vmlinux_value_type_id", ctypes.c_uint32),
        ("map_extra", ctypes.c_uint64),
    ]


class _ProgLoad(ctypes.Structure):
    _fields_ = [
        ("prog_type", ctypes.c_uint32),
        ("insn_cnt", ctypes.c_uint32),
        ("insns", ctypes.c_uint64),
        ("license", ctypes.c_uint64),
        ("log_level", ctypes.c_uint32),
        ("log_size", ctypes.c_uint32),
        ("log_buf", ctypes.c_uint64),
        ("kern_version", ctypes.c_uint32),
        ("prog_flags", ctypes.c_uint32),
        ("prog_name", ctypes.c_char * 16),
        ("prog_ifindex", ctypes.c_uint32),
        ("expected_attach_type", ctypes.c_uint32),
        ("pad", ctypes.c_uint8 * 72),  # BTF func and line info, attach targets, CO-RE relocations: none here
    ]


class _BtfLoad(ctypes.Structure):
    _fields_ = [
        ("btf", ctypes.c_uint64),
        ("btf_log_buf", ctypes.c_uint64),
        ("btf_size", ctypes.c_uint32),
        ("btf_log_size", ctypes.c_uint32),
        ("btf_log_level", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class _ObjInfo(ctypes.Structure):
    _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint32), ("info", ctypes.c_uint64)]


class _MapElem(ctypes.Structure):
    _fields_ = [
        ("map_fd", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("key", ctypes.c_uint64),
        ("value", ctypes.c_uint64),  # or next_key
        ("flags", ctypes.c_uint64),
    ]


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def perf_event_open(attr: PerfEventAttr, pid: int, cpu: int) -> int:
    attr.size = ctypes.sizeof(attr)
    return _check(_libc.syscall(SYS_PERF_EVENT_OPEN, ctypes.byref(attr), pid, cpu, -1, PERF_FLAG_FD_CLOEXEC),
                  "perf_event_open")


def link_perf_event(prog_fd: int, perf_fd: int, cookie: int = 0) -> int:
    """Run `prog_fd` on each hit of the perf event; the link holds the attachment until closed."""
    link = _LinkCreate(prog_fd=prog_fd, target_fd=perf_fd, attach_type=BPF_PERF_EVENT, bpf_cookie=cookie)
    return _check(_libc.syscall(SYS_BPF, BPF_LINK_CREATE, ctypes.byref(link), ctypes.sizeof(link)),
                  "bpf link create")


def link_uprobe_multi(prog_fd: int, path: str, offsets: list[int], cookies: list[int], ref_ctrs: list[int],
                      ret: bool, session: bool = False) -> int:
    """One link probing every file offset of `path` (each with its cookie and USDT semaphore offset, 0 for
    none) in every process; closing it detaches them all after a single grace period. With `session` (the
    program loaded for BPF_TRACE_UPROBE_SESSION) the program runs at each call's entry and, unless its entry run
    returned non-zero, at that call's return."""
    n = len(offsets)
    path_buf = ctypes.create_string_buffer(os.fsencode(path))
    offs, cks, refs = (ctypes.c_uint64 * n)(*offsets), (ctypes.c_uint64 * n)(*cookies), (ctypes.c_uint64 * n)(*ref_ctrs)
    attach_type = BPF_TRACE_UPROBE_SESSION if session else BPF_TRACE_UPROBE_MULTI
    link = _LinkUprobeMulti(prog_fd=prog_fd, attach_type=attach_type, path=ctypes.addressof(path_buf),
                            offsets=ctypes.addressof(offs), cookies=ctypes.addressof(cks),
                            ref_ctr_offsets=ctypes.addressof(refs) if any(ref_ctrs) else 0, cnt=n,
                            uprobe_flags=BPF_F_UPROBE_MULTI_RETURN if ret and not session else 0)
    return _check(_libc.syscall(SYS_BPF, BPF_LINK_CREATE, ctypes.byref(link), ctypes.sizeof(link)),
                  "bpf link create (uprobe_multi)")


RETURN_0 = bytes.fromhex("b700000000000000" "9500000000000000")  # a program that does nothing: r0 = 0; exit


@functools.cache
def uprobe_session_supported() -> bool:
    """Whether the kernel takes uprobe session links (6.13+): a program loaded for them, linked to "/" (no
    regular file), fails with EBADF where the attach type is known and with EINVAL where it is not."""
    try:
        fd = prog_load(BPF_PROG_TYPE_KPROBE, RETURN_0, "GPL", name="aiflame_probe",
                       expected_attach_type=BPF_TRACE_UPROBE_SESSION)
    except OSError:
        return False
    try:
        os.close(link_uprobe_multi(fd, "/", [0], [0], [0], False, session=True))
    except OSError as e:
        return e.errno == errno.EBADF
    finally:
        os.close(fd)
    return True


def map_create(map_type: int, key_size: int, value_size: int, max_entries: int, flags: int = 0, name: str = "",
               btf_fd: int = 0, btf_key_type_id: int = 0, btf_value_type_id: int = 0, map_extra: int = 0) -> int:
    """A new map (its fd, close-on-exec as every bpf fd); `btf_fd` 0: without BTF type information."""
    attr = _MapCreate(map_type=map_type, key_size=key_size, value_size=value_size, max_entries=max_entries,
                      map_flags=flags, map_name=name.encode()[:15], btf_fd=btf_fd, btf_key_type_id=btf_key_type_id,
                      btf_value_type_id=btf_value_type_id, map_extra=map_extra)
    return _check(_libc.syscall(SYS_BPF, BPF_MAP_CREATE, ctypes.byref(attr), ctypes.sizeof(attr)),
                  f"bpf map create ({name})")


def btf_load(data: bytes) -> int:
    """Type information (raw BTF, as the kernel reports it for a loaded object) as a new fd."""
    buf = ctypes.create_string_buffer(data, len(data))
    attr = _BtfLoad(btf=ctypes.addressof(buf), btf_size=len(data))
    return _check(_libc.syscall(SYS_BPF, BPF_BTF_LOAD, ctypes.byref(attr), ctypes.sizeof(attr)), "bpf btf load")


def prog_load(prog_type: int, insns: bytes, license: str, *, name: str = "", kern_version: int = 0,
              expected_attach_type: int = 0, explain: bool = False) -> int:
    """Verify and load a program (8-byte instructions, map references already holding fds). With `explain`, a
    rejection is tried again with the verifier's log, whose last lines end the OSError's message (only then:
    a log that does not fit its buffer fails even a good program, with ENOSPC)."""
    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(license.encode())
    attr = _ProgLoad(prog_type=prog_type, insn_cnt=len(insns) // 8, insns=ctypes.addressof(code),
                     license=ctypes.addressof(lic), kern_version=kern_version, prog_name=name.encode()[:15],
                     expected_attach_type=expected_attach_type)
    ret = int(_libc.syscall(SYS_BPF, BPF_PROG_LOAD, ctypes.byref(attr), ctypes.sizeof(attr)))
    if ret >= 0:
        return ret
    err = ctypes.get_errno()
    tail = ""
    if explain:
        log = ctypes.create_string_buffer(4 << 20)
        attr.log_level, attr.log_size, attr.log_buf = 1, len(log), ctypes.addressof(log)
        ret = int(_libc.syscall(SYS_BPF, BPF_PROG_LOAD, ctypes.byref(attr), ctypes.sizeof(attr)))
        if ret >= 0:  # loaded this time after all
            return ret
        lines = log.value.decode(errors="replace").strip().splitlines()
        tail = ": " + " | ".join(lines[-3:]) if lines else ""
    raise OSError(err, f"bpf prog load ({name}): {os.strerror(err)}{tail}")


def obj_info(fd: int, size: int) -> bytes:
    """The kernel's bpf_{prog,map,btf}_info of a BPF fd (up to `size` bytes; pointer fields left 0)."""
    buf = ctypes.create_string_buffer(size)
    attr = _ObjInfo(bpf_fd=fd, info_len=size, info=ctypes.addressof(buf))
    _check(_libc.syscall(SYS_BPF, BPF_OBJ_GET_INFO_BY_FD, ctypes.byref(attr), ctypes.sizeof(attr)), "bpf obj info")
    return buf.raw[:attr.info_len]


def prog_runs(fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a loaded program: counted while run-time statistics are on (enable_stats)."""
    info = obj_info(fd, 208)
    if len(info) < 208:
        return 0, 0
    ns, cnt = struct.unpack_from("<QQ", info, 192)
    return ns, cnt


def enable_stats() -> int:
    """Turn on the kernel's run-time statistics of BPF programs (BPF_ENABLE_STATS) until the fd is closed."""
    attr = ctypes.c_uint32(0)  # BPF_STATS_RUN_TIME
    return _check(_libc.syscall(SYS_BPF, BPF_ENABLE_STATS, ctypes.byref(attr), ctypes.sizeof(attr)),
                  "bpf enable stats")


def _elem(cmd: int, map_fd: int, key: ctypes.Array[ctypes.c_char] | None, value: ctypes.Array[ctypes.c_char] | None,
          flags: int = 0) -> int:
    attr = _MapElem(map_fd=map_fd, key=ctypes.addressof(key) if key is not None else 0,
                    value=ctypes.addressof(value) if value is not None else 0, flags=flags)
    return int(_libc.syscall(SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr)))


def map_lookup(map_fd: int, key: bytes, value_size: int) -> bytes | None:
    """The value at `key`, or None when there is none."""
    k, v = ctypes.create_string_buffer(key, len(key)), ctypes.create_string_buffer(value_size)
    if _elem(BPF_MAP_LOOKUP_ELEM, map_fd, k, v) < 0:
        if ctypes.get_errno() == errno.ENOENT:
            return None
        _check(-1, "bpf map lookup")
    return v.raw


def map_update(map_fd: int, key: bytes, value: bytes) -> None:
    k, v = ctypes.create_string_buffer(key, len(key)), ctypes.create_string_buffer(value, len(value))
    _check(_elem(BPF_MAP_UPDATE_ELEM, map_fd, k, v), "bpf map update")


def map_delete(map_fd: int, key: bytes) -> bool:
    """Remove `key`; False when it was not there."""
    k = ctypes.create_string_buffer(key, len(key))
    if _elem(BPF_MAP_DELETE_ELEM, map_fd, k, None) < 0:
        if ctypes.get_errno() == errno.ENOENT:
            return False
        _check(-1, "bpf map delete")
    return True


def map_keys(map_fd: int, key_size: int) -> list[bytes]:
    """Every key, in the map's order (a snapshot: keys added or removed meanwhile may be missed)."""
    keys: list[bytes] = []
    nxt = ctypes.create_string_buffer(key_size)
    cur: ctypes.Array[ctypes.c_char] | None = None
    while _elem(BPF_MAP_GET_NEXT_KEY, map_fd, cur, nxt) == 0:
        keys.append(nxt.raw)
        cur = ctypes.create_string_buffer(nxt.raw, key_size)
    return keys


@functools.cache
def possible_cpus() -> int:
    """How many CPUs the kernel may ever bring up: a per-CPU map holds one value for each (fixed until reboot)."""
    return len(cpu_list("possible"))


def cpu_list(which: str) -> list[int]:
    """CPUs from /sys/devices/system/cpu/{online,possible} ("0-3,5")."""
    out: list[int] = []
    for part in Path(f"/sys/devices/system/cpu/{which}").read_text().strip().split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def tracepoint_id(category: str, event: str) -> int:
    try:
        return int((TRACEFS / "events" / category / event / "id").read_text())
    except (OSError, ValueError):
        raise OSError(2, f"no tracepoint {category}:{event} under {TRACEFS} (is tracefs mounted?)") from None


def close_fds(fds: list[int]) -> None:
    """Close each of `fds`, ignoring those already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
