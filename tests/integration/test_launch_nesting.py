"""A launch made inside a launch (cudart's cudaLaunchKernel reaching the driver's cuLaunchKernel) is one launch,
and a launch counted without a record costs one trap: with uprobe session links (kernel 6.13+) its return is not
probed, so the entry leaves its in_launch entry behind, and a later launch tells whether that one is still open
by its stack (bpf/runtime_probes.bpf.c, launch_open). Each round of the program launches four kernels: one
through a runtime call that calls the driver's, one that jumps to it as its last act, and two straight to the
driver's, from the same depth and from deeper. A launch whose stack walk cannot reach its finish program (a
failed tail call) is counted on without its record, as one the ring had no room for."""

from __future__ import annotations

import os
import struct
import subprocess
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from aiflame.agent.kernel import bpf_sys
from aiflame.agent.kernel.sampler import UW_PROGS, CallRecord, CpuSampler, ProbeRecord, RetRecord, SamplerConfig
from aiflame.agent.kernel.uprobes import ProbeSite
from aiflame.agent.process_table import ProcessTable
from aiflame.agent.runtimes.base import ARG0, ProbeSpec
from aiflame.agent.runtimes.manager import spec_rec
from aiflame.symbolize.objfmt.elf import ElfFile
from tests.conftest import PROGRAMS

ROUNDS = 20_000
PROBES = {"rt_launch": 0, "rt_tail": 1, "drv_launch": 2}


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe = tmp_path_factory.mktemp("nest") / "launch_nest"
    subprocess.run(["gcc", "-O2", "-fcf-protection=none", "-fno-inline", "-o", str(exe),
                    str(PROGRAMS / "launch_nest.c")], check=True)
    return exe


def _bare_return_probe(path: Path, offsets: list[int]) -> tuple[int, int]:
    """Another tool's return probes on `offsets` (a program that does nothing): while they are attached the
    kernel hijacks every return there, whatever our entry run asked. Returns the program and link fds."""
    prog = bpf_sys.prog_load(bpf_sys.BPF_PROG_TYPE_KPROBE, bpf_sys.RETURN_0, "GPL", name="bare_ret",
                             expected_attach_type=bpf_sys.BPF_TRACE_UPROBE_MULTI)
    return prog, bpf_sys.link_uprobe_multi(prog, str(path), offsets, [0] * len(offsets), [0] * len(offsets), True)


@dataclass
class Rounds:
    """What the probes saw of one run of the program: its records, the launches counted without one, the
    programs' runs (entries and returns), the counters, and whether session links were in effect."""

    pid: int
    records: list[ProbeRecord]
    unsent: list[tuple[int, int, int, int]]
    runs: int
    counters: dict[str, int]
    session: bool

    def counted(self) -> Counter[tuple[int, int]]:
        """Launches per (probe, kernel): those carried by records and those counted without one."""
        out: Counter[tuple[int, int]] = Counter()
        for r in self.records:
            if isinstance(r, CallRecord):
                out[(r.probe, r.args[0])] += r.calls
        for pid, probe, arg, n in self.unsent:
            assert pid == self.pid
            out[(probe, arg)] += n
        return out


def _offsets(program: Path) -> dict[str, int]:
    with ElfFile.open(program) as elf:
        at = {n: elf.vaddr_to_file_offset(a) for n, a in elf.function_addresses(set(PROBES)).items()}
    assert all(v is not None for v in at.values()) and len(at) == 3, at
    return {n: v or 0 for n, v in at.items()}


def _run_rounds(program: Path, config: SamplerConfig, stack: bool, launches: bool = True,
                prepare: Callable[[CpuSampler, int], None] = lambda sampler, pid: None) -> Rounds:
    """ROUNDS rounds of the program with the three launch functions probed (entries and returns; `launches`:
    as launches, the kernel the launch's key, else as plain calls); `prepare(sampler, pid)` runs once the
    sampler has started, before the probes."""
    at = _offsets(program)
    records: list[ProbeRecord] = []
    sampler = CpuSampler(config, lambda s: None, lambda e: None, records.append)
    proc = subprocess.Popen([str(program), str(ROUNDS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    stats = bpf_sys.enable_stats()
    try:
        sampler.start([proc.pid])
        prepare(sampler, proc.pid)
        for name, probe in PROBES.items():
            sampler.set_probe_spec(probe, spec_rec(ProbeSpec((name,), name, ret=True, stack=stack,
                                                             sample_arg=ARG0 if launches else -1)))
        sites = [ProbeSite(at[name], probe) for name, probe in PROBES.items()]
        assert sampler.attach_probes(str(program), sites) == {}
        assert sampler.attach_probes(str(program), sites, ret=True) == {}
        progs = {sampler.prog_fd(False), sampler.prog_fd(True)}
        before = sum(bpf_sys.prog_runs(fd)[1] for fd in progs)
        out, _ = proc.communicate("go\n", timeout=120)
        runs = sum(bpf_sys.prog_runs(fd)[1] for fd in progs) - before
        sampler.poll()
        rounds = Rounds(proc.pid, records, sampler.take_unsent_calls(), runs, sampler.counters(),
                        sampler.uprobe_session)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(stats)
        sampler.close()
    assert proc.returncode == 0 and out.strip() == str(ROUNDS * 15), out
    return rounds


# the driver's launches inside rt_launch (kernel 1) and rt_tail (kernel 4) are theirs, not counted again
EACH_ONCE = Counter({(PROBES["rt_launch"], 1): ROUNDS, (PROBES["drv_launch"], 2): ROUNDS,
                     (PROBES["drv_launch"], 3): ROUNDS, (PROBES["rt_tail"], 4): ROUNDS})


@pytest.mark.parametrize(("session", "other"), [(None, False), (False, False), (None, True)],
                         ids=["default", "no-session", "another-return-probe"])
def test_nested_launches_count_once_and_skipped_returns_cost_no_run(program: Path, session: bool | None,
                                                                     other: bool) -> None:
    # Oracle: the program's structure; each round launches kernels 1-4 once, 1 and 4 through the runtime's call
    at = _offsets(program)
    bare = _bare_return_probe(program, [at["rt_launch"], at["rt_tail"]]) if other else ()
    try:
        # 50 records a second per CPU (a burst of 64): nearly every launch is counted without a record
        r = _run_rounds(program, SamplerConfig(probes=True, frequency=1, call_rate=50, session_links=session),
                        stack=False)
    finally:
        for fd in bare:
            os.close(fd)
    assert r.counters["call_lost"] == 0, r.counters
    assert r.counted() == EACH_ONCE, r.counted()
    rets = sum(isinstance(x, RetRecord) for x in r.records)
    calls = sum(isinstance(x, CallRecord) for x in r.records)
    assert 0 < calls < 0.05 * 4 * ROUNDS and rets == calls, (calls, rets)  # each record its return
    entries = 6 * ROUNDS  # each round enters four launches and the two driver launches inside runtime ones
    if r.session:
        # a return runs the program only for the launches sent with a record: one run per launch counted
        assert r.runs == entries + rets, (r.runs, entries, rets)
    else:
        assert r.runs == 2 * entries, (r.runs, entries)  # on_ret runs at every return


def _fail_the_finish(walked: bool) -> Callable[[CpuSampler, int], None]:
    def prepare(sampler: CpuSampler, pid: int) -> None:
        if walked:
            snap = ProcessTable().read(pid, 0)
            assert snap is not None
            sampler.set_mappings(pid, snap.mappings)
        # no other way to make a tail call fail: the prog array is the sampler's own
        obj = sampler._obj  # noqa: SLF001
        finish = UW_PROGS["uw_call_progs"].index("call_finish")
        assert obj is not None and obj.maps["uw_call_progs"].delete(struct.pack("<I", finish))
    return prepare


@pytest.mark.parametrize(("walked", "session", "launches"),
                         [(False, None, True), (True, None, True), (True, False, True), (True, None, False)],
                         ids=["entry", "walk", "walk-no-session", "walk-plain-calls"])
def test_a_walk_that_cannot_finish_keeps_its_launches_counted_and_no_return(program: Path, walked: bool,
                                                                            session: bool | None,
                                                                            launches: bool) -> None:
    # Oracle: the program's structure; each round launches kernels 1-4 once, 1 and 4 through the runtime's call
    # (six calls of the three functions). The walk's finish program is taken out of its prog array, so every
    # call's tail call to it fails: launches are counted on without records (none lost, the launches an earlier
    # record would have carried kept too), plain calls are counted lost, and no return is kept for a call that
    # has no record. `walked`: the process has CFI tables, so the failure is in the walk's step program; else in
    # the entry's own program.
    config = SamplerConfig(probes=True, frequency=1, call_rate=0, session_links=session)  # 0: no record budget
    r = _run_rounds(program, config, stack=True, launches=launches, prepare=_fail_the_finish(walked))
    entries = 6 * ROUNDS
    if launches:
        assert r.counted() == EACH_ONCE, r.counted()
        assert r.counters["uw_tailcall_fail"] == 4 * ROUNDS and r.counters["call_lost"] == 0, r.counters
    else:
        assert r.counters["uw_tailcall_fail"] == entries and r.counters["call_lost"] == entries, r.counters
    # no call has a record, nor a return (a plain call's return still goes out with separate return probes)
    assert not [x for x in r.records if isinstance(x, CallRecord)]
    assert not [x for x in r.records if isinstance(x, RetRecord)] or not (launches or r.session)
    if r.session:
        assert r.runs == entries, r.runs  # entries only: no return kept
    else:
        assert r.runs == 2 * entries, r.runs  # on_ret runs at every return
