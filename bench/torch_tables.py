"""The CFI unwind tables of a torch process, as the agent builds them (issue #25): start PYTHON importing torch
(a side venv with the CUDA build maps libtorch_cuda, cuBLAS(Lt), cuDNN, NCCL with no GPU), read its executable
file mappings, build each file's table as the sampler does (symbolize/objfmt/cfi, a fresh cache directory: cold
build times), and print per file its .eh_frame size, rows, pool bytes (8 per row), page-index entries and build
time, with the totals against the BPF pool's capacity (bpf/unwind.h). Results: bench/results/torch_tables.json.

    python bench/torch_tables.py [--python /work/torchcuda-venv/bin/python] [--top 25] [--extra .../libcudnn_*.so.9]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from common import REPO, RESULTS

sys.path.insert(0, str(REPO))

from aiflame.agent.kernel.unwind import page_index  # noqa: E402
from aiflame.agent.procmaps import read_maps  # noqa: E402
from aiflame.symbolize.objfmt.cfi import load_or_build  # noqa: E402
from aiflame.symbolize.objfmt.elf import ElfFile  # noqa: E402

_CHILD = "import torch, sys; torch.ones(4) @ torch.ones(4); print('ready', flush=True); sys.stdin.read()"


def _define(name: str) -> int:
    text = (REPO / "aiflame" / "bpf" / "unwind.h").read_text()
    m = re.search(rf"#define {name} \(1 << (\d+)\)", text)
    if m is None:
        raise SystemExit(f"{name} not found in bpf/unwind.h")
    return 1 << int(m.group(1))


def _eh_frame_bytes(path: str) -> int:
    with ElfFile.open(path) as elf:
        sec = elf.section(".eh_frame")
        return sec.size if sec is not None else 0



def _measure(path: str, open_path: str, cache: str) -> dict[str, Any]:
    """One file's table built the agent's way (through `open_path`): rows, pool bytes, index entries, build time."""
    t0 = time.perf_counter()
    try:
        table = load_or_build(open_path, cache_dir=cache)
        err = ""
    except Exception as e:  # noqa: BLE001 - a bench reports every failure and goes on
        table, err = None, str(e)
    build_s = time.perf_counter() - t0
    n = len(table) if table is not None else 0
    paged = page_index(table.rows) if table is not None and n else None
    return {"file": os.path.basename(path), "path": path, "eh_frame_bytes": _eh_frame_bytes(open_path), "rows": n,
            "pool_bytes": 8 * n, "index_entries": len(paged[2]) if paged else 0,
            "rules": len(table.rules) if table is not None else 0, "build_s": build_s, "error": err}

def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable, help="the Python whose torch is measured")
    ap.add_argument("--top", type=int, default=25, help="files printed, largest first (25)")
    ap.add_argument("--extra", nargs="*", default=[],
                    help="files measured too though the import does not map them (cuDNN's are loaded at first use)")
    a = ap.parse_args(argv)
    child = subprocess.Popen([a.python, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            raise SystemExit("the child did not import torch")
        maps = read_maps(child.pid) or []
        files: dict[str, tuple[int, int]] = {}
        for lo, hi, perms, _off, _dev, inode, path in maps:
            if "x" in perms and path.startswith("/") and inode and path not in files:
                files[path] = (lo, hi)
        rows: list[dict[str, Any]] = []
        with tempfile.TemporaryDirectory(prefix="aiflame-cfi-") as cache:
            for path, (lo, hi) in files.items():
                rows.append(_measure(path, f"/proc/{child.pid}/map_files/{lo:x}-{hi:x}", cache))
            for path in a.extra:
                rows.append(_measure(path, path, cache) | {"file": os.path.basename(path) + " (not mapped)",
                                                           "mapped": False})
    finally:
        child.kill()
        child.wait()
    rows.sort(key=lambda r: -r["rows"])
    cap_rows, cap_index = _define("AIFLAME_UNWIND_ROWS"), _define("AIFLAME_UNWIND_INDEX")
    total = sum(r["rows"] for r in rows if r.get("mapped", True))
    total_index = sum(r["index_entries"] for r in rows if r.get("mapped", True))
    print(f"{'file':44} {'.eh_frame':>10} {'rows':>10} {'pool MiB':>9} {'index':>8} {'build s':>8}")
    for r in rows[:a.top]:
        print(f"{r['file'][:44]:44} {r['eh_frame_bytes'] / 2**20:9.1f}M {r['rows']:10,} {r['pool_bytes'] / 2**20:9.1f} "
              f"{r['index_entries']:8,} {r['build_s']:8.2f} {r['error'][:40]}")
    mapped = sum(1 for r in rows if r.get("mapped", True))
    print(f"{mapped} executable files mapped: {total:,} rows ({8 * total / 2**20:.1f} MiB) and {total_index:,} index "
          f"entries; pool capacity {cap_rows:,} rows ({8 * cap_rows / 2**20:.0f} MiB), {cap_index:,} index entries; "
          f"build {sum(r['build_s'] for r in rows):.1f} s cold")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"python": a.python, "pool_rows": cap_rows, "pool_index": cap_index, "total_rows": total,
           "total_index": total_index, "files": rows}
    (RESULTS / "torch_tables.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
