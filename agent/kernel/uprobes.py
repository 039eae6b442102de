"""Uprobes with a BPF attach cookie: perf_event_open on the kernel's uprobe PMU, then BPF_LINK_CREATE with the
probe id as the cookie, so one BPF function serves every probe (BCC's attach_uprobe cannot set cookies)."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

from aiflame.agent.kernel.bpf_sys import PerfEventAttr, link_perf_event, perf_event_open
from aiflame.core.errors import HostError

UPROBE_PMU = Path("/sys/bus/event_source/devices/uprobe")


class UprobeError(HostError):
    """A uprobe could not be attached; one line."""


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
    attr = PerfEventAttr()
    attr.type = _pmu_type()
    # format/ref_ctr_offset reads "config:32-63"
    attr.config = (_retprobe_bit() if ret else 0) | (ref_ctr << 32)
    attr.sample_period = 1
    attr.wakeup_events = 1
    path_buf = ctypes.create_string_buffer(os.fsencode(path))
    attr.config1 = ctypes.addressof(path_buf)
    attr.config2 = offset
    # pid -1 with cpu 0: the probe fires in every process on every CPU; the program runs on each hit.
    try:
        pfd = perf_event_open(attr, -1, 0)
    except OSError as e:
        raise UprobeError(f"cannot probe {path}+{offset:#x}: {os.strerror(e.errno or 0)}") from None
    try:
        lfd = link_perf_event(prog_fd, pfd, cookie)
    except OSError as e:
        os.close(pfd)
        raise UprobeError(f"cannot link the BPF program to {path}+{offset:#x}: {os.strerror(e.errno or 0)}") from None
    return Uprobe(path, offset, cookie, ret, pfd, lfd)
