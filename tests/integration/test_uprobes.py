"""Runtime probes go in as one uprobe_multi link per file and direction where the kernel has them (detaching
perf-event uprobes one by one waited out a grace period each: 3-4 s for libtorch's 32), or one session link per
file for both directions (6.13+); one bad site costs only itself."""

from __future__ import annotations

import os
import platform

import pytest

from aiflame.agent.kernel.sampler import CpuSampler, SamplerConfig
from aiflame.agent.kernel.uprobes import ProbeSite
from aiflame.symbolize.objfmt.elf import ElfFile

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"


def _offsets(names: set[str]) -> dict[str, int]:
    elf = ElfFile.open(LIBC)
    try:
        return {n: off for n, a in elf.function_addresses(names).items()
                if (off := elf.vaddr_to_file_offset(a)) is not None}
    finally:
        elf.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _release() -> tuple[int, int]:
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return major, minor


@pytest.mark.parametrize("session", [None, False], ids=["default", "no-session"])
def test_sites_share_one_link_and_a_bad_site_fails_alone(session: bool | None) -> None:
    offs = _offsets({"getpid", "getppid", "write"})
    assert len(offs) == 3
    sampler = CpuSampler(SamplerConfig(probes=True, frequency=1, session_links=session), lambda s: None,
                         lambda e: None, lambda r: None)
    try:
        sampler.start([])
        assert sampler._bpf.uprobe_multi == (_release() >= (6, 6))
        assert sampler.uprobe_session == (session is None and _release() >= (6, 13))
        before = _open_fds()
        good = [ProbeSite(off, i) for i, off in enumerate(offs.values())]
        assert sampler.attach_probes(LIBC, good) == {}
        assert sampler.attach_probes(LIBC, good[:1], ret=True) == {}
        # a session link serves both directions; a perf event and a link per site without uprobe_multi
        links = 1 if sampler.uprobe_session else 2 if sampler._bpf.uprobe_multi else 4 * 2
        assert _open_fds() - before == links
        past_end = os.path.getsize(LIBC) + 0x1000
        failed = sampler.attach_probes(LIBC, [ProbeSite(past_end, 7), *good[1:]])
        assert list(failed) == [7] and f"{past_end:#x}" in failed[7], failed
        sampler.detach_probes()
        assert _open_fds() == before
    finally:
        sampler.close()
