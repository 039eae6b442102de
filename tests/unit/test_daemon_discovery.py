"""Discovery: accelerator runtimes in /proc maps and the selectors (pure), and scans of this host's real
processes that check what is read, and when."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.agent.daemon.config import WatchConfig
from aiflame.agent.daemon.discovery import Discovery, ProcInfo, Selector, accelerator_runtimes

MAPS = """\
55d0c0a00000-55d0c0a01000 r-xp 00000000 08:01 123 /usr/bin/python3.11
7f0000000000-7f0000100000 r-xp 00010000 08:01 456 /opt/venv/nvidia/nccl/lib/libnccl.so.2
7f0000200000-7f0000300000 r-xp 00010000 08:01 457 /usr/local/cuda/lib64/libcudart.so.12.4.99
7f0000400000-7f0000500000 r-xp 00010000 08:01 458 /usr/lib/x86_64-linux-gnu/libze_loader.so.1.8.0
7f0000600000-7f0000700000 r-xp 00010000 08:01 459 /site/torch/lib/libtorch_cpu.so
7f0000800000-7f0000900000 r-xp 00010000 08:01 460 /site/x/libcudart-8a1b2c3d.so.12 (deleted)
7f0000a00000-7f0000b00000 r-xp 00010000 08:01 461 /usr/lib/libcudartfake.so
7f0000c00000-7f0000d00000 rw-p 00000000 00:00 0 [heap]
"""


def test_accelerator_runtimes_in_maps() -> None:
    assert accelerator_runtimes(MAPS) == {"nccl", "cuda", "level_zero", "torch"}
    assert accelerator_runtimes("7f-8f r-xp 0 0:0 1 /usr/lib/libc.so.6\n") == set()


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400))
def test_accelerator_runtimes_any_text(text: str) -> None:
    assert accelerator_runtimes(text) <= {"cuda", "nccl", "level_zero", "torch", "hip"}


def _info(comm: str = "python", runtimes: frozenset[str] = frozenset(), cmdline: str = "python train.py",
          cgroup: str = "/user.slice", exe: str = "/usr/bin/python3.11") -> ProcInfo:
    return ProcInfo(42, 1, comm, exe, cmdline, cgroup, runtimes)


def test_selector_rules() -> None:
    default = Selector(WatchConfig())
    assert default.wants(_info(runtimes=frozenset({"cuda"})))
    assert not default.wants(_info())
    sel = Selector(WatchConfig(accelerators=False, names=("train*",), cmdlines=(r"--model\s",),
                               cgroups=("/system.slice/job.service",), exclude=("jupyter*",)))
    assert not sel.wants(_info(runtimes=frozenset({"cuda"})))
    assert sel.wants(_info(comm="trainer"))
    assert sel.wants(_info(exe="/opt/bin/train_llm"))
    assert sel.wants(_info(cmdline="python main.py --model gpt"))
    assert sel.wants(_info(cgroup="/system.slice/job.service/worker"))
    assert not sel.wants(_info(cgroup="/system.slice/job.service2"))
    assert not sel.wants(_info(comm="jupyter-lab", cmdline="jupyter --model x"))


def test_discovery_scan_finds_this_process_by_name() -> None:
    me = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    d = Discovery(Selector(WatchConfig(accelerators=False, names=(me,))))
    new, gone = d.scan()
    assert os.getpid() in {i.pid for i in new} and not gone
    again, _ = d.scan()
    assert os.getpid() not in {i.pid for i in again}  # known targets are not reported twice
    d.forget(os.getpid())
    assert os.getpid() not in d.targets


def test_discovery_reads_kernel_threads_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernel threads have no command line; a scan must not read their /proc files again every time."""
    from aiflame.agent.daemon import discovery

    kthreads = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_kthread(int(p))]
    assert kthreads, "no kernel thread visible in /proc"
    d = Discovery(Selector(WatchConfig(accelerators=True)))
    d.scan(now=100.0)
    reads = _count_reads(monkeypatch)
    d.scan(now=102.0)
    assert not {pid for pid, _ in reads} & set(kthreads)
    d.scan(now=100.0 + discovery.KTHREAD_RECHECK_S + 1)
    assert set(kthreads) & {pid for pid, _ in reads}, "kernel threads are still looked at, rarely"


def test_discovery_rereads_maps_only_when_the_size_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-check of a process that is not a target reads its maps again only when its virtual size changed."""
    from aiflame.agent.daemon import discovery

    idle = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.2)  # exec'd
        d = Discovery(Selector(WatchConfig(accelerators=True)))
        d.scan(now=100.0)
        reads = _count_reads(monkeypatch)
        d.scan(now=100.0 + d.recheck_s + 1)
        assert (idle.pid, True) not in reads  # looked at again, same size: maps not read
        size = discovery.vm_size(psutil.Process(idle.pid))
        assert size
        monkeypatch.setattr(discovery, "vm_size", lambda proc: size + 1 if proc.pid == idle.pid else None)
        d.scan(now=100.0 + 2 * (d.recheck_s + 1))
        assert (idle.pid, True) in reads  # it grew: maybe a library was loaded
    finally:
        idle.kill()
        idle.wait()


def test_discovery_looks_again_sooner_at_young_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in CI: a Python job scanned between its exec and its import of the runtime was not looked at again for
    10 s, and a job shorter than that was never watched. A process is re-checked after half its age, at most
    `recheck_s`: at once when it just started, every 10 s when it is old."""
    young = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.2)
        wall = time.time()
        d = Discovery(Selector(WatchConfig(accelerators=True)))
        d.scan(now=100.0)
        reads = _count_reads(monkeypatch)
        d.scan(now=101.0)  # one second later: the young one is looked at again; none older than ~2 s is
        checked = [pid for pid, _ in reads]
        assert young.pid in checked
        for pid in checked:
            try:
                created = psutil.Process(pid).create_time()
            except psutil.NoSuchProcess:
                continue
            assert wall - created < 3, pid
        # Processes that wait (kernel threads wait far longer and are left out).
        old = [p for p in d._seen if p not in checked and d._seen[p].next_check <= 100.0 + d.recheck_s]
        assert old, "no process old enough to wait"
        reads.clear()
        d.scan(now=100.0 + d.recheck_s + 1)
        assert set(old) & {pid for pid, _ in reads}  # old processes: every recheck_s
    finally:
        young.kill()
        young.wait()


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """From now on, every discovery.read_info call as (pid, whether the maps were read)."""
    from aiflame.agent.daemon import discovery

    reads: list[tuple[int, bool]] = []
    real = discovery.read_info

    def counting(proc: psutil.Process, maps: bool) -> ProcInfo | None:
        reads.append((proc.pid, maps))
        return real(proc, maps)

    monkeypatch.setattr(discovery, "read_info", counting)
    return reads


def _is_kthread(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() == b""
    except OSError:
        return False
