"""Benchmark building CFI unwind tables (symbolize/objfmt/cfi/): cold, warm from the disk cache, peak RSS.

    python bench/bench_cfi.py [BINARY ...] [--python] [--no-save]

Every figure comes from a fresh subprocess with its own empty cache directory (AIFLAME_CACHE), so "cold" is a
new agent meeting the binary for the first time (the C engine already compiled: its one-time compile is the
`engine_compile_s` line) and "warm" is a new agent finding the table on disk. Times are the `load_or_build`
call inside the child, wall clock and CPU (user + sys; steadier on a shared machine); peak RSS is the child's
ru_maxrss (interpreter and imports included). --python also
times the pure-Python reference engine and checks that it gives the same table as the C one.
The figures go to bench/results/cfi.json unless --no-save.
Default binaries: libtorch_cpu.so of this venv's torch, /usr/bin/python3.11, libc.so.6.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from common import conditions, save

_DEFAULTS = ["torch/lib/libtorch_cpu.so", "/usr/bin/python3.11", "/lib/x86_64-linux-gnu/libc.so.6"]


def default_binaries() -> list[str]:
    out = []
    for p in _DEFAULTS:
        if not os.path.isabs(p):
            spec = importlib.util.find_spec("torch")
            if spec is None or not spec.submodule_search_locations:
                continue
            p = os.path.join(list(spec.submodule_search_locations)[0], p.split("/", 1)[1])
        if os.path.exists(p):
            out.append(os.path.realpath(p))
    return out


def child(mode: str, binary: str, cache: str) -> None:
    """One measured run in this (fresh) process; prints a JSON line."""
    from aiflame.symbolize.objfmt import cfi
    from aiflame.symbolize.objfmt.cfi import fast

    def cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    t, c = time.perf_counter(), cpu()
    if mode == "compile":
        ok = fast._fast_lib() is not None
        print(json.dumps({"s": round(time.perf_counter() - t, 3), "ok": ok}))
        return
    if mode == "python":
        table = cfi.build_table(binary, "python")
    else:
        table = cfi.load_or_build(binary, cache, engine="c")
    elapsed, cpu_s = time.perf_counter() - t, cpu() - c
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    digest = hashlib.sha256(table.rows + table.rules_bytes()).hexdigest()
    print(json.dumps({"s": round(elapsed, 3), "cpu_s": round(cpu_s, 3), "rss_mb": round(rss_mb, 1),
                      "stats": table.stats.to_json(), "digest": digest}))


def run_child(mode: str, binary: str, cache: str) -> dict[str, object]:
    env = {**os.environ, "AIFLAME_CACHE": cache}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, binary, cache],
                          capture_output=True, text=True, check=True, env=env)
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binaries", nargs="*", help="ELF files (default: libtorch_cpu.so, python3.11, libc.so.6)")
    ap.add_argument("--python", action="store_true", help="also time the Python reference and compare tables")
    ap.add_argument("--no-save", action="store_true", help="don't write bench/results/cfi.json")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "BINARY", "CACHE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    binaries = [os.path.realpath(b) for b in args.binaries] or default_binaries()
    if not binaries:
        print("no binaries given and none of the defaults found", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="aiflame-bench-cfi-") as tmp:
        engine_cache = os.path.join(tmp, "engine")
        compiled = run_child("compile", "", engine_cache)
        print(f"engine_compile_s {compiled['s']}  (cc of symbolize/objfmt/cfi/cfi_fast.c, once per source version)")
        for i, binary in enumerate(binaries):
            cache = os.path.join(tmp, f"b{i}")
            # The compiled engine is found under the cache dir: share the one compiled above.
            os.makedirs(os.path.join(cache, "cfi"), mode=0o700)
            for name in os.listdir(os.path.join(engine_cache, "cfi")):
                os.link(os.path.join(engine_cache, "cfi", name), os.path.join(cache, "cfi", name))
            cold = run_child("cold", binary, cache)
            warm = run_child("warm", binary, cache)
            stats = cold["stats"]
            assert isinstance(stats, dict)
            row: dict[str, object] = {
                "binary": binary,
                "size_mb": round(os.path.getsize(binary) / 2**20, 1),
                "fdes": stats["fdes"],
                "rows_raw": stats["rows_raw"],
                "rows": stats["rows"],
                "rules": stats["rules"],
                "table_mb": round((8 * int(stats["rows"]) + 12 * int(stats["rules"])) / 2**20, 1),
                "cold_s": cold["s"],
                "cold_cpu_s": cold["cpu_s"],
                "cold_rss_mb": cold["rss_mb"],
                "warm_s": warm["s"],
                "warm_cpu_s": warm["cpu_s"],
                "warm_rss_mb": warm["rss_mb"],
                "warm_equals_cold": warm["digest"] == cold["digest"],
                "cfa_kinds": stats["cfa_kinds"],
                "rbp_kinds": stats["rbp_kinds"],
            }
            if args.python:
                py = run_child("python", binary, cache)
                row.update(python_s=py["s"], python_cpu_s=py["cpu_s"], python_rss_mb=py["rss_mb"],
                           python_equals_c=py["digest"] == cold["digest"])
            results.append(row)
    cols = ["size_mb", "fdes", "rows_raw", "rows", "rules", "table_mb", "cold_s", "cold_cpu_s", "cold_rss_mb",
            "warm_s", "warm_cpu_s", "warm_rss_mb"]
    if args.python:
        cols += ["python_s", "python_cpu_s", "python_rss_mb", "python_equals_c"]
    print(f"{'binary':<16}" + "".join(f"{c:>{max(9, len(c) + 1)}}" for c in cols))
    for r in results:
        print(f"{os.path.basename(str(r['binary'])):<16}" + "".join(f"{r[c]!s:>{max(9, len(c) + 1)}}" for c in cols))
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if not all(r["warm_equals_cold"] for r in results) or not all(r.get("python_equals_c", True) for r in results):
        print("warning: tables differ between runs or engines", file=sys.stderr)
    if not args.no_save:
        doc = {"engine_compile_s": compiled["s"], "load_average": os.getloadavg()[0], "results": results,
               "conditions": conditions()}
        path = save("cfi", doc)
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
