"""Cost of one probed runtime call against a bare uprobe on the same function, and the BPF programs' own time.

A C program calls a noinline function N times and times the loop. Runs: no probe; a bare uprobe (a BPF
program that returns at once), on entry and on entry + return; our entry probe (the cudaLaunchKernel spec:
two stack reads, caller stack, Python walk check, ring-buffer record); our entry + return probe. Per-call
cost = (loop time - unprobed loop time) / N, medians over repetitions, all in one run. The target is in the
pid map, so the probe does its full work. Goal: ours <= 1.2x the bare uprobe.

The kernel's own cost depends on the probed instruction: it emulates push (the first instruction of libcudart's
calls) and single-steps most others out of line, endbr64 included. Bare uprobes on a function starting with
endbr64, 4 bytes past it (where aiflame probes such functions: agent/kernel/uprobes.py entry_offset), and on
one starting with lea show what that costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import conditions, save

from aiflame.agent.kernel.bpf_sys import enable_stats, prog_runs
from aiflame.agent.kernel.sampler import CpuSampler, SamplerConfig
from aiflame.agent.kernel.uprobes import ProbeSite, attach_uprobe, entry_offset
from aiflame.agent.runtimes.base import ARG0, SP, Deref, ProbeSpec
from aiflame.agent.runtimes.manager import spec_rec
from aiflame.symbolize.objfmt.elf import ElfFile

STACK = True  # the launch probes capture the caller's stack
N = 50_000  # ~300 bytes per record: 15 MB per loop, inside the 32 MiB ring
REPS = 5
ROUNDS = 7
SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
/* Three copies of a 6-argument call, each with its own first instruction (what the kernel does at a uprobe
 * depends on it: it emulates push and nops, and single-steps most others out of line):
 * probed_call starts with push %rbp as libcudart's cudaLaunchKernel does; probed_cet with endbr64 and then
 * the push (gcc -fcf-protection, Ubuntu's default); probed_lea with a lea, as gcc -O1 makes of a leaf. */
#define BODY "lea (%rdi,%rsi),%rax\n add %rdx,%rax\n add %rcx,%rax\n add %r8,%rax\n"
__asm__(".globl probed_call\n.type probed_call,@function\nprobed_call:\n"
        "push %rbp\n mov %rsp,%rbp\n" BODY "pop %rbp\n ret\n.size probed_call,.-probed_call\n"
        ".globl probed_cet\n.type probed_cet,@function\nprobed_cet:\n"
        "endbr64\n push %rbp\n mov %rsp,%rbp\n" BODY "pop %rbp\n ret\n.size probed_cet,.-probed_cet\n"
        ".globl probed_lea\n.type probed_lea,@function\nprobed_lea:\n"
        BODY "ret\n.size probed_lea,.-probed_lea\n");
long probed_call(void *f, long grid, int z, long block, int bz, void **args);
long probed_cet(void *f, long grid, int z, long block, int bz, void **args);
long probed_lea(void *f, long grid, int z, long block, int bz, void **args);
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    char line[16];
    while (fgets(line, sizeof line, stdin)) {   /* one timed loop per line read: its letter picks the copy */
        long (*fn)(void *, long, int, long, int, void **) =
            line[0] == 'c' ? probed_cet : line[0] == 'l' ? probed_lea : probed_call;
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        long s = 0;
        for (long i = 0; i < n; i++) s += fn(0, i, 1, 256, 1, 0);
        clock_gettime(CLOCK_MONOTONIC, &b);
        printf("%ld %ld\n", (b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec), s & 1);
        fflush(stdout);
    }
    return 0;
}
"""
BARE = "int bare(struct pt_regs *ctx) { return 0; }"


def main(argv: list[str] | None = None) -> int:
    from bcc import BPF

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--separate-return-probes", action="store_true",
                    help="our probes' returns attached on their own (as before uprobe session links, kernel 6.13)")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="aiflame-uprobe-"))
    (work / "t.c").write_text(SOURCE)
    exe = work / "t"
    subprocess.run(["gcc", "-O1", "-fno-omit-frame-pointer", "-o", str(exe), str(work / "t.c")], check=True)
    with ElfFile.open(exe) as elf:
        names = {"probed_call", "probed_cet", "probed_lea"}
        at = {n: elf.vaddr_to_file_offset(a) or 0 for n, a in elf.function_addresses(names).items()}
        past_endbr = entry_offset(elf.pread(at["probed_cet"], 4))
    assert all(at.values()) and past_endbr == 4
    proc = subprocess.Popen([str(exe), str(N)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin and proc.stdout

    def loop_ns(fn: str) -> float:
        assert proc.stdin and proc.stdout
        proc.stdin.write({"probed_cet": "c\n", "probed_lea": "l\n"}.get(fn, "p\n"))
        proc.stdin.flush()
        ns = float(proc.stdout.readline().split()[0])
        # Drain between loops (untimed): a loop's records fit the ring, so the probe never takes its cheaper
        # drop path; a Python consumer could not keep up with a call every ~5 us while the loop runs.
        sampler.poll()
        return ns

    def timed(fn: str = "probed_call", reps: int = REPS) -> float:
        loop_ns(fn)  # warm
        return statistics.median(loop_ns(fn) for _ in range(reps))

    session = False if args.separate_return_probes else None
    sampler = CpuSampler(SamplerConfig(probes=True, frequency=1, ringbuf_pages=8192, session_links=session),
                         lambda s: None, lambda e: None, lambda r: None)
    sampler.start([proc.pid])
    bare = BPF(text=BARE)
    bare_fd = bare.load_func("bare", BPF.KPROBE).fd
    derefs = (Deref(SP, 8), Deref(SP, 16))
    # entry: the cudaLaunchKernel spec; entry + return: the same reads plus a return probe sharing its id, as
    # the sync probes have
    sampler.set_probe_spec(0, spec_rec(ProbeSpec(("probed_call",), "launch", derefs=derefs, stack=STACK)))
    sampler.set_probe_spec(1, spec_rec(ProbeSpec(("probed_call",), "sync", derefs=derefs, stack=STACK, ret=True)))
    # the launch spec as it is (cuda.py cudaLaunchKernel): entry + return, counted per kernel in BPF past the
    # record budget (--launch-stacks, 300 a second per CPU): nearly every call of the loop takes that path
    sampler.set_probe_spec(2, spec_rec(ProbeSpec(("probed_call",), "launch", derefs=derefs, stack=STACK, ret=True,
                                                 sample_arg=ARG0)))
    # (name, program fd or -1 for ours, cookie, with a return probe, function, bytes past its first)
    configs = (("bare_uprobe", bare_fd, 0, False, "probed_call", 0),
               ("bare_uprobe_entry_return", bare_fd, 0, True, "probed_call", 0),
               ("aiflame_entry", -1, 0, False, "probed_call", 0),
               ("aiflame_entry_return", -1, 1, True, "probed_call", 0),
               ("aiflame_launch_past_budget", -1, 2, True, "probed_call", 0),
               ("bare_uprobe_on_endbr64", bare_fd, 0, False, "probed_cet", 0),
               ("bare_uprobe_past_endbr64", bare_fd, 0, False, "probed_cet", past_endbr),
               ("bare_uprobe_on_lea", bare_fd, 0, False, "probed_lea", 0))
    loops: dict[str, list[float]] = {name: [] for name, *_ in configs}
    prog_ns: dict[str, list[float]] = {name: [] for name, *_ in configs}
    bases: list[float] = []
    stats = enable_stats()  # run-time statistics until closed
    try:
        # Rounds interleave the configurations, so a slow phase of the VM hits all of them alike.
        for _ in range(ROUNDS):
            bases.append(timed())
            for name, fd, cookie, ret, fn, past in configs:
                offset = at[fn] + past
                probes = []
                if fd >= 0:
                    probes.append(attach_uprobe(fd, str(exe), offset, cookie))
                    if ret:
                        probes.append(attach_uprobe(fd, str(exe), offset, cookie, ret=True))
                    fds = [fd]
                else:
                    failed = sampler.attach_probes(str(exe), [ProbeSite(offset, cookie)])
                    if ret:
                        failed |= sampler.attach_probes(str(exe), [ProbeSite(offset, cookie)], ret=True)
                    if failed:
                        raise SystemExit("; ".join(failed.values()))
                    fds = list({sampler.prog_fd(False), sampler.prog_fd(ret)})  # one program with session links
                before = [prog_runs(f) for f in fds]
                loops[name].append(timed(fn))
                after = [prog_runs(f) for f in fds]
                # per call: a session link runs one program at entry and (when asked) return
                prog_ns[name].append(sum(a[0] - b[0] for a, b in zip(after, before, strict=True)) / ((REPS + 1) * N))
                for p in probes:
                    p.close()
                if fd < 0:
                    sampler.detach_probes()
    finally:
        lost = sampler.counters().get("call_lost", 0)
        os.close(stats)
        proc.stdin.close()
        proc.wait()
        sampler.close()
        bare.cleanup()
    base = statistics.median(bases)
    results: dict[str, float] = {"unprobed_ns_per_call": base / N, "records_lost": lost}
    for name, *_ in configs:
        results[f"{name}_ns_per_call"] = (statistics.median(loops[name]) - base) / N
        results[f"{name}_bpf_ns_per_call"] = statistics.median(prog_ns[name])
        print(f"{name}: {results[f'{name}_ns_per_call']:.0f} ns per call "
              f"(BPF program {results[f'{name}_bpf_ns_per_call']:.0f} ns)", flush=True)
    results["entry_vs_bare"] = results["aiflame_entry_ns_per_call"] / results["bare_uprobe_ns_per_call"]
    results["entry_return_vs_bare"] = (results["aiflame_entry_return_ns_per_call"]
                                       / results["bare_uprobe_entry_return_ns_per_call"])
    print(f"entry {results['entry_vs_bare']:.2f}x, entry + return {results['entry_return_vs_bare']:.2f}x "
          f"a bare uprobe; {lost} records lost", flush=True)
    out = {"bench": "uprobe_cost", "uprobe_session": sampler.uprobe_session, "calls_per_run": N, "reps": REPS,
           "rounds": ROUNDS, **results,
           "method": f"one C loop; {ROUNDS} interleaved rounds of every configuration, each the median of {REPS} "
                     "timed loops; medians over rounds; BPF program time from the kernel's run-time statistics "
                     "(BPF_ENABLE_STATS)",
           **conditions()}
    print(json.dumps(out))
    save("uprobe_cost_separate" if args.separate_return_probes else "uprobe_cost", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
