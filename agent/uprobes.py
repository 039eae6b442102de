"""Uprobes with a BPF attach cookie: perf_event_open on the kernel's uprobe PMU, then BPF_LINK_CREATE with the
probe id as the cookie, so one BPF function serves every probe (BCC's attach_uprobe cannot set cookies)."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

SYS_PERF_EVENT_OPEN = 298  # x86-64
SYS_BPF = 321
BPF_LINK_CREATE = 28
BPF_PERF_EVENT = 41
PERF_FLAG_FD_CLOEXEC = 8
UPROBE_PMU = Path("/sys/bus/event_source/devices/uprobe")


class UprobeError(Exception):
    """A uprobe could not be attached; one line."""


class _PerfEventAttr(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("wakeup_events", ctypes.c_uint32),
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),  # uprobe_path
        ("config2", ctypes.c_uint64),  # probe_offset
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


def _pmu_type() -> int:
    try:
        return int((UPROBE_PMU / "type").read_text())
    except (OSError, ValueError):
        raise UprobeError("the kernel has no uprobe PMU (/sys/bus/event_source/devices/uprobe)") from None


def _retprobe_bit() -> int:
    # format/retprobe reads "config:0" on x86-64
    try:
        text = (UPROBE_PMU / "format" / "retprobe").read_text().strip()
        return 1 << int(text.split(":", 1)[1])
    except (OSError, ValueError, IndexError):
        return 1


@dataclass
class Uprobe:
    """An attached probe; close() detaches it."""

    path: str
    offset: int
    cookie: int
    ret: bool
    perf_fd: int
    link_fd: int

    def close(self) -> None:
        for fd in (self.link_fd, self.perf_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def attach_uprobe(prog_fd: int, path: str, offset: int, cookie: int, *, ret: bool = False,
                  ref_ctr: int = 0) -> Uprobe:
    """Probe file offset `offset` of `path` in every process (the BPF program filters pids). `ref_ctr`: the file
    offset of a USDT semaphore (u16) the kernel raises in every process mapping the file while attached."""
    attr = _PerfEventAttr()
    attr.type = _pmu_type()
    attr.size = ctypes.sizeof(attr)
    # format/ref_ctr_offset reads "config:32-63"
    attr.config = (_retprobe_bit() if ret else 0) | (ref_ctr << 32)
    attr.sample_period = 1
    attr.wakeup_events = 1
    path_buf = ctypes.create_string_buffer(os.fsencode(path))
    attr.config1 = ctypes.addressof(path_buf)
    attr.config2 = offset
    # pid -1 with cpu 0: the probe fires in every process on every CPU; the program runs on each hit.
    pfd = _libc.syscall(SYS_PERF_EVENT_OPEN, ctypes.byref(attr), -1, 0, -1, PERF_FLAG_FD_CLOEXEC)
    if pfd < 0:
        err = ctypes.get_errno()
        raise UprobeError(f"cannot probe {path}+{offset:#x}: {os.strerror(err)}")
    link = _LinkCreate(prog_fd=prog_fd, target_fd=pfd, attach_type=BPF_PERF_EVENT, bpf_cookie=cookie)
    lfd = _libc.syscall(SYS_BPF, BPF_LINK_CREATE, ctypes.byref(link), ctypes.sizeof(link))
    if lfd < 0:
        err = ctypes.get_errno()
        os.close(pfd)
        raise UprobeError(f"cannot link the BPF program to {path}+{offset:#x}: {os.strerror(err)}")
    return Uprobe(path, offset, cookie, ret, int(pfd), int(lfd))
