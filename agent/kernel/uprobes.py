"""Uprobes with a BPF attach cookie (the probe id), so one BPF function serves every probe (BCC's attach_uprobe
cannot set cookies). Two ways in:
- uprobe_multi links (kernel 6.6+): one link per file and direction holds all its probes, and closing it waits
  out one kernel grace period for all of them (32 perf-event uprobes in libtorch took 3-4 s to detach here,
  one uprobe_multi link 0.1 s);
- else one perf event on the kernel's uprobe PMU per probe, linked with BPF_LINK_CREATE.
Where the kernel has uprobe session links (6.13+), one link serves both directions: the program runs at a call's
return only when its entry run asked for it (bpf/runtime_probes.bpf.c), and a call whose return nobody wants
costs one trap instead of two."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aiflame.agent.kernel.bpf_sys import PerfEventAttr, link_perf_event, link_uprobe_multi, perf_event_open
from aiflame.core.errors import HostError

UPROBE_PMU = Path("/sys/bus/event_source/devices/uprobe")
ENDBR64 = b"\xf3\x0f\x1e\xfa"  # CET's landing pad for indirect branches


def entry_offset(code: bytes) -> int:
    """Where in a function's first bytes (x86-64) its entry probe goes: past a leading endbr64, which changes no
    register and no memory, so the probe sees what it would at the entry (arguments, sp and the return address
    at it). The kernel emulates the probed instruction or single-steps it out of line; 6.18 does not emulate
    endbr64, and emulates the `push` that usually follows: a uprobe on endbr64 cost 9.5-11.4 us a call on the
    2-vCPU VM, on the push after it 0.8-0.9 us (bench/bench_uprobe.py)."""
    return len(ENDBR64) if code.startswith(ENDBR64) else 0


@dataclass(frozen=True)
class ProbeSite:
    """A place to probe: a file offset, the probe id the program gets as its cookie, and the file offset of a
    USDT semaphore (u16) the kernel raises in every process mapping the file while attached (0: none)."""

    offset: int
    cookie: int
    ref_ctr: int = 0


@dataclass
class Uprobe:
    """Attached probes (one perf event, or one uprobe_multi link for many sites); close() detaches them."""

    path: str
    sites: tuple[ProbeSite, ...]
    ret: bool
    fds: tuple[int, ...]

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass


def _pmu_type() -> int:
    try:
        return int((UPROBE_PMU / "type").read_text())
    except (OSError, ValueError):
        raise HostError("the kernel has no uprobe PMU (/sys/bus/event_source/devices/uprobe)") from None


def _retprobe_bit() -> int:
    # format/retprobe reads "config:0" on x86-64
    try:
        text = (UPROBE_PMU / "format" / "retprobe").read_text().strip()
        return 1 << int(text.split(":", 1)[1])
    except (OSError, ValueError, IndexError):
        return 1


def attach_uprobe(prog_fd: int, path: str, offset: int, cookie: int, *, ret: bool = False,
                  ref_ctr: int = 0) -> Uprobe:
    """Probe file offset `offset` of `path` in every process (the BPF program filters pids) through a perf event
    of the uprobe PMU; `prog_fd` is a plain kprobe program."""
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
        raise HostError(f"cannot probe {path}+{offset:#x}: {os.strerror(e.errno or 0)}") from None
    try:
        lfd = link_perf_event(prog_fd, pfd, cookie)
    except OSError as e:
        os.close(pfd)
        raise HostError(f"cannot link the BPF program to {path}+{offset:#x}: {os.strerror(e.errno or 0)}") from None
    return Uprobe(path, (ProbeSite(offset, cookie, ref_ctr),), ret, (lfd, pfd))


def attach_multi(prog_fd: int, path: str, sites: Sequence[ProbeSite], *, ret: bool = False,
                 session: bool = False) -> Uprobe:
    """Probe every site of `path` in every process with one uprobe_multi link; `prog_fd` was loaded with the
    expected attach type BPF_TRACE_UPROBE_MULTI (BPF_TRACE_UPROBE_SESSION with `session`). One bad site fails
    the whole link."""
    try:
        fd = link_uprobe_multi(prog_fd, path, [s.offset for s in sites], [s.cookie for s in sites],
                               [s.ref_ctr for s in sites], ret, session)
    except OSError as e:
        where = f"{path}+{sites[0].offset:#x}" if len(sites) == 1 else f"{len(sites)} sites of {path}"
        raise HostError(f"cannot probe {where}: {os.strerror(e.errno or 0)}") from None
    return Uprobe(path, tuple(sites), ret, (fd,))


def attach_sites(prog_fd: int, path: str, sites: Sequence[ProbeSite], *, ret: bool = False,
                 multi: bool = True, session: bool = False) -> tuple[list[Uprobe], dict[int, str]]:
    """Attach `sites` of `path` (as one uprobe_multi link with `multi`, a session link with `session`, else a
    perf event each). Returns what went in and, by cookie, the one-line reason each site that did not. A batch
    that fails is tried site by site, so one bad offset costs only itself."""
    if not sites:
        return [], {}
    if multi and len(sites) > 1:
        try:
            return [attach_multi(prog_fd, path, sites, ret=ret, session=session)], {}
        except HostError:
            pass
    done: list[Uprobe] = []
    failed: dict[int, str] = {}
    for s in sites:
        try:
            done.append(attach_multi(prog_fd, path, [s], ret=ret, session=session) if multi else
                        attach_uprobe(prog_fd, path, s.offset, s.cookie, ret=ret, ref_ctr=s.ref_ctr))
        except HostError as e:
            failed[s.cookie] = str(e)
    return done, failed
