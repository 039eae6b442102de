"""Benchmark native symbolization of a large binary, cold (empty cache) and warm (disk cache, new process).

    python bench/bench_symbolize.py [BINARY] [--offsets N] [--debug-dir DIR] [--no-save]

Picks ~N file offsets spread evenly over the binary's executable segments, then runs one fresh subprocess with
an empty cache directory (cold) and another with the same directory (warm), so "warm" is what a new agent
process pays. Prints one JSON line: cold_s / warm_s are the time of the `symbolize()` call inside each
subprocess; cold_process_s / warm_process_s are the whole subprocess (interpreter start and imports included).
The same figures go to bench/results/symbolize.json unless --no-save.
Default binary: the largest ELF among libbcc.so.0 and libLLVM*.so* in /usr/lib/x86_64-linux-gnu.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

from common import conditions, save

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.elf import ElfFile, read_build_id

_LIBDIR = "/usr/lib/x86_64-linux-gnu"


def default_binary() -> str | None:
    """The largest ELF among the usual big libraries (symlinks resolved), if any is installed."""
    candidates = {
        os.path.realpath(p) for p in [f"{_LIBDIR}/libbcc.so.0", *glob.glob(f"{_LIBDIR}/libLLVM*.so*")]
    }
    elves = []
    for p in candidates:
        try:
            read_build_id(p)
        except Unreadable:
            continue
        elves.append(p)
    return max(elves, key=os.path.getsize) if elves else None


def spread_offsets(path: str, count: int) -> list[int]:
    """`count` file offsets evenly spaced over the bytes of the executable PT_LOAD segments."""
    with ElfFile.open(path) as elf:
        ranges = [
            (s.offset, s.offset + s.filesz) for s in elf.segments if s.type == 1 and s.flags & 1 and s.filesz
        ]
    total = sum(hi - lo for lo, hi in ranges)
    if not total:
        raise SystemExit(f"{path}: no executable segment")
    step = total / count
    out = []
    for i in range(count):
        pos = int(i * step + step / 2)
        for lo, hi in ranges:
            if pos < hi - lo:
                out.append(lo + pos)
                break
            pos -= hi - lo
    return out


def child(
    binary: str, build_id: str | None, cache_dir: str, offsets_file: str, debug_dirs: list[str]
) -> None:
    """One measured run in this (fresh) process; prints a JSON line."""
    from aiflame.core.model import FrameKind
    from aiflame.symbolize.native import NativeSymbolizer

    with open(offsets_file) as f:
        offsets = json.load(f)
    t = time.perf_counter()
    frames = NativeSymbolizer(cache_dir=cache_dir, debug_dirs=debug_dirs).symbolize(binary, build_id, offsets)
    elapsed = time.perf_counter() - t
    named = sum(1 for fr in frames.values() if fr.kind != FrameKind.UNKNOWN)
    lines = sum(1 for fr in frames.values() if fr.line)
    print(json.dumps({"symbolize_s": round(elapsed, 4), "named": named, "with_lines": lines}))


def run_child(args: list[str]) -> tuple[dict[str, float], float]:
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - t
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary", nargs="?", help="ELF file to symbolize (default: largest of libbcc/libLLVM)")
    ap.add_argument("--offsets", type=int, default=2000, help="number of file offsets (default 2000)")
    ap.add_argument(
        "--debug-dir", action="append", default=None, help="debug file root (default /usr/lib/debug)"
    )
    ap.add_argument("--no-save", action="store_true", help="don't write bench/results/symbolize.json")
    ap.add_argument(
        "--child",
        nargs=5,
        metavar=("BINARY", "BUILD_ID", "CACHE", "OFFSETS", "DEBUG_DIRS"),
        help=argparse.SUPPRESS,
    )
    args = ap.parse_args(argv)
    if args.child:
        binary, bid, cache, offs, dirs = args.child
        child(binary, bid or None, cache, offs, json.loads(dirs))
        return 0
    binary = os.path.realpath(args.binary) if args.binary else default_binary()
    if not binary:
        print("no binary given and none of libbcc/libLLVM found", file=sys.stderr)
        return 2
    debug_dirs = args.debug_dir or ["/usr/lib/debug"]
    build_id = read_build_id(binary) or ""
    offsets = spread_offsets(binary, args.offsets)
    with tempfile.TemporaryDirectory(prefix="aiflame-bench-") as tmp:
        offs_file = os.path.join(tmp, "offsets.json")
        with open(offs_file, "w") as f:
            json.dump(offsets, f)
        cache = os.path.join(tmp, "cache")
        child_args = [binary, build_id, cache, offs_file, json.dumps(debug_dirs)]
        cold, cold_wall = run_child(child_args)
        warm, warm_wall = run_child(child_args)
    if (cold["named"], cold["with_lines"]) != (warm["named"], warm["with_lines"]):
        print("warning: warm results differ from cold", file=sys.stderr)
    result = {
        "binary": binary,
        "size_mb": round(os.path.getsize(binary) / 2**20, 1),
        "offsets": len(offsets),
        "cold_s": cold["symbolize_s"],
        "warm_s": warm["symbolize_s"],
        "cold_process_s": round(cold_wall, 3),
        "warm_process_s": round(warm_wall, 3),
        "named": cold["named"],
        "with_lines": cold["with_lines"],
    }
    print(json.dumps(result))
    if not args.no_save:
        save("symbolize", {**result, "conditions": conditions()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
