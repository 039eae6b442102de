"""Cost of one probed runtime call against a bare uprobe on the same function.

A C program calls a noinline function N times and times the loop. Runs: no probe; a bare uprobe (a BPF
program that returns at once), on entry and on entry + return; our entry probe (the cudaLaunchKernel spec:
two stack reads, caller stack, Python walk check, ring-buffer record); our entry + return probe. Per-call
cost = (loop time - unprobed loop time) / N, medians over repetitions, all in one run. The target is in the
pid map, so the probe does its full work. Goal: ours <= 1.2x the bare uprobe.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import conditions, save

from aiflame.agent.runtimes.base import SP, Deref, ProbeSpec
from aiflame.agent.runtimes.manager import spec_rec
from aiflame.agent.sampler import CpuSampler, SamplerConfig
from aiflame.agent.uprobes import attach_uprobe
from aiflame.symbolize.elf import ElfFile

STACK = True  # the launch probes capture the caller's stack
N = 200_000
REPS = 5
SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
__attribute__((noinline)) int probed_call(void *f, long grid, int z, long block, int bz, void **args) {
    __asm__ volatile("" ::: "memory");
    return (int)(grid + z + block + bz);
}
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    char line[16];
    while (fgets(line, sizeof line, stdin)) {   /* one timed loop per line read */
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        long s = 0;
        for (long i = 0; i < n; i++) s += probed_call(0, i, 1, 256, 1, 0);
        clock_gettime(CLOCK_MONOTONIC, &b);
        printf("%ld %ld\n", (b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec), s & 1);
        fflush(stdout);
    }
    return 0;
}
"""
BARE = "int bare(struct pt_regs *ctx) { return 0; }"


def main() -> int:
    from bcc import BPF

    work = Path(tempfile.mkdtemp(prefix="aiflame-uprobe-"))
    (work / "t.c").write_text(SOURCE)
    exe = work / "t"
    subprocess.run(["gcc", "-O1", "-fno-omit-frame-pointer", "-o", str(exe), str(work / "t.c")], check=True)
    with ElfFile.open(exe) as elf:
        offset = elf.vaddr_to_file_offset(elf.function_addresses({"probed_call"})["probed_call"])
    assert offset is not None
    proc = subprocess.Popen([str(exe), str(N)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin and proc.stdout

    def loop_ns() -> float:
        assert proc.stdin and proc.stdout
        proc.stdin.write("go\n")
        proc.stdin.flush()
        return float(proc.stdout.readline().split()[0])

    def timed(reps: int = REPS) -> float:
        loop_ns()  # warm
        return statistics.median(loop_ns() for _ in range(reps))

    sampler = CpuSampler(SamplerConfig(probes=True, frequency=1), lambda s: None, lambda e: None, lambda r: None)
    sampler.start([proc.pid])
    bare = BPF(text=BARE)
    bare_fd = bare.load_func("bare", BPF.KPROBE).fd
    spec = ProbeSpec(("probed_call",), "cudaLaunchKernel", derefs=(Deref(SP, 8), Deref(SP, 16)), stack=STACK)
    sampler.set_probe_spec(0, spec_rec(spec))
    sampler.set_probe_spec(1, spec_rec(ProbeSpec(("probed_call",), "ret", ret=True)))
    results: dict[str, float] = {}
    try:
        base = timed()
        results["unprobed_ns_per_call"] = base / N
        configs = (("bare_uprobe", bare_fd, 0, False), ("bare_uprobe_entry_return", bare_fd, 0, True),
                   ("aiflame_entry", -1, 0, False), ("aiflame_entry_return", -1, 1, True))
        for name, fd, cookie, ret in configs:
            probes = []
            if fd >= 0:
                probes.append(attach_uprobe(fd, str(exe), offset, cookie))
                if ret:
                    probes.append(attach_uprobe(fd, str(exe), offset, cookie, ret=True))
            else:
                sampler.attach_probe(str(exe), offset, cookie)
                if ret:
                    sampler.attach_probe(str(exe), offset, cookie, ret=True)
            t = timed()
            for p in probes:
                p.close()
            if fd < 0:
                sampler.detach_probes()
            sampler.poll()  # drain the records written
            results[f"{name}_ns_per_call"] = (t - base) / N
            print(f"{name}: {(t - base) / N:.0f} ns per call", flush=True)
    finally:
        proc.stdin.close()
        proc.wait()
        sampler.close()
        bare.cleanup()
    results["entry_vs_bare"] = results["aiflame_entry_ns_per_call"] / results["bare_uprobe_ns_per_call"]
    results["entry_return_vs_bare"] = (results["aiflame_entry_return_ns_per_call"]
                                       / results["bare_uprobe_entry_return_ns_per_call"])
    out = {"bench": "uprobe_cost", "calls_per_run": N, "reps": REPS, **results,
           "method": "one C loop, median of 5 timed loops per configuration, same run", **conditions()}
    print(json.dumps(out))
    save("uprobe_cost", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
