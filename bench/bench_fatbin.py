"""Benchmark GPU-symbol extraction: fatbin walk + decompression, cubin parsing, line tables.

    python bench/bench_fatbin.py [BINARY] [--runs N] [--no-lines-build] [--no-save]

BINARY defaults to the NCCL library of the accel-test extra (nvidia/nccl/lib/libnccl.so.2: ~100 MiB of zstd
cubins). Each run reads `.nv_fatbin`, decodes every entry (zstd/LZ4, sha256), parses every cubin and its line
tables; the figures are medians over the runs. NCCL is built without -lineinfo, so unless --no-lines-build a
generated program (128 kernels, 64-way unrolled loops with inlined calls, `-lineinfo`, sm_90) is compiled with
the wheel's nvcc (~20 s) to time line-table parsing on ~40k line ranges. Prints one JSON line; the same figures
go to bench/results/fatbin.json unless --no-save.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from common import conditions, save

from aiflame.core.errors import Unreadable
from aiflame.symbolize.accel.cubin import parse_cubin
from aiflame.symbolize.accel.fatbin import find_fatbins, iter_entries, read_fatbin_file

GENERATED = r"""
template <int N>
__device__ __forceinline__ float step(float x, float k) {
    float y = x * k + N;
    if (y > 10.f) y = y * 0.5f - k;
    return y;
}
template <int N>
__global__ void work(float *p, float k, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float acc = p[i];
#pragma unroll
    for (int j = 0; j < 64; j++) {
        acc = step<N>(acc, k + j);
        if (acc > 1000.f) acc -= p[(i + j) % n];
    }
    p[i] = acc;
}
template <int N> void launch(float *p) { work<N><<<1, 32>>>(p, 1.f, 32); }
#define L4(b) launch<b>(p); launch<b+1>(p); launch<b+2>(p); launch<b+3>(p);
#define L16(b) L4(b) L4(b+4) L4(b+8) L4(b+12)
void all(float *p) { L16(0) L16(16) L16(32) L16(48) L16(64) L16(80) L16(96) L16(112) }
"""


def wheel_dir(*parts: str) -> Path | None:
    """A path inside the installed `nvidia` wheels (site-packages/nvidia/...), if present."""
    for root in sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}):
        p = Path(root, "nvidia", *parts)
        if p.exists():
            return p
    return None


def one_run(path: str) -> dict[str, float | int]:
    """Time the three stages once; counts describe what was processed."""
    t0 = time.perf_counter()
    _kind, data = read_fatbin_file(path)
    t1 = time.perf_counter()
    entries = list(iter_entries(data, label=path))
    t2 = time.perf_counter()
    cubins = code = kernels = with_lines = ranges = 0
    for e in entries:
        if e.kind != "elf" or e.error:
            continue
        cubins += 1
        try:
            c = parse_cubin(e.data, digest=e.digest)
            lines = c.lines()
        except Unreadable:
            continue
        code += c.has_code
        kernels += len(c.kernels)
        with_lines += bool(lines.kernels())
        ranges += sum(len(lines.table(k)) for k in lines.kernels())
    t3 = time.perf_counter()
    return {
        "read_s": t1 - t0,
        "decode_s": t2 - t1,
        "parse_s": t3 - t2,
        "total_s": t3 - t0,
        "fatbin_bytes": len(data),
        "containers": len(find_fatbins(data)),
        "entries": len(entries),
        "entry_errors": sum(1 for e in entries if e.error),
        "decoded_bytes": sum(len(e.data) for e in entries),
        "cubins": cubins,
        "cubins_with_code": code,
        "kernels": kernels,
        "cubins_with_lines": with_lines,
        "line_ranges": ranges,
    }


def measure(path: str, runs: int) -> dict[str, object]:
    results = [one_run(path) for _ in range(runs)]
    out: dict[str, object] = {"binary": path, "file_mb": round(os.path.getsize(path) / 2**20, 1), "runs": runs}
    for key in results[0]:
        values = [r[key] for r in results]
        out[key] = round(statistics.median(values), 4) if key.endswith("_s") else values[0]
    return out


def build_generated(tmp: str) -> str | None:
    """Compile GENERATED into a host binary with -lineinfo; None when nvcc is not installed."""
    bindir = wheel_dir("cu13", "bin")
    if bindir is None or not (bindir / "nvcc").exists():
        return None
    src, out = os.path.join(tmp, "gen.cu"), os.path.join(tmp, "gen.o")
    Path(src).write_text(GENERATED)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    # An object file is enough: it has the .nv_fatbin section, and no link step is needed.
    subprocess.run([str(bindir / "nvcc"), "-c", "-lineinfo", "-gencode", "arch=compute_90,code=sm_90", "-o", out,
                    src], check=True, env=env, capture_output=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary", nargs="?", help="host ELF with device code (default: the NCCL wheel's libnccl.so.2)")
    ap.add_argument("--runs", type=int, default=3, help="runs per binary; medians are reported (default 3)")
    ap.add_argument("--no-lines-build", action="store_true", help="skip the generated -lineinfo program")
    ap.add_argument("--no-save", action="store_true", help="don't write bench/results/fatbin.json")
    args = ap.parse_args(argv)
    nccl = wheel_dir("nccl", "lib", "libnccl.so.2")
    binary = args.binary or (str(nccl) if nccl else None)
    if not binary:
        print("no binary given and no nvidia-nccl wheel installed (pip install '.[accel-test]')", file=sys.stderr)
        return 2
    result: dict[str, object] = measure(os.path.realpath(binary), args.runs)
    if not args.no_lines_build:
        with tempfile.TemporaryDirectory(prefix="aiflame-bench-") as tmp:
            t = time.perf_counter()
            gen = build_generated(tmp)
            if gen is not None:
                build_s = time.perf_counter() - t
                lines = measure(gen, args.runs)
                lines.pop("binary")
                result["lineinfo_program"] = {"nvcc_s": round(build_s, 1), **lines}
    print(json.dumps(result))
    if not args.no_save:
        save("fatbin", {**result, "conditions": conditions()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
