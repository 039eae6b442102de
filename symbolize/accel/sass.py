"""SASS instruction text of a cubin, from NVIDIA's `nvdisasm` when it is installed (optional: the `sass` extra).

One nvdisasm call per cubin (each costs ~0.3-0.8 s, mostly start-up), its output parsed to {kernel: {offset:
text}} and kept on disk per cubin digest, so a later process pays a small gzip'd JSON read instead. The cache
follows cache.py: atomic writes, and a missing, unreadable or foreign file reads as a miss.

Format, version 1::

    {"format": "aiflame-sass", "version": 1, "key": DIGEST or DIGEST.fINDEX, "kernels": {NAME: [[OFFSET, TEXT], ...]}}
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from aiflame.core.errors import Unreadable
from aiflame.symbolize.cache import default_cache_dir, read_json_gz, write_json_gz

__all__ = ["Sass", "default_sass_dir", "disassemble", "find_nvdisasm", "parse_nvdisasm"]


FORMAT = "aiflame-sass"
VERSION = 1

Sass = dict[str, dict[int, str]]
"""Kernel (mangled name) -> byte offset in the kernel -> instruction text (`@P0 EXIT`, `FFMA R0, R1, R2, R3`)."""

_SECTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)")
_INSN = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s*(.*?)\s*;?\s*(?:/\*.*\*/)?\s*$")
_LABEL = re.compile(r"^(\.L_\w+):\s*$")
_TARGET = re.compile(r"`\((\.L_\w+)\)|(\.L_\w+)")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_TIMEOUT_S = 300


def find_nvdisasm() -> Path | None:
    """nvdisasm from PATH, else from the `nvidia-cuda-nvdisasm` wheel (nvidia/cu13/bin) in this environment."""
    hit = shutil.which("nvdisasm")
    if hit:
        return Path(hit)
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}
    for root in sorted(r for r in roots if r):
        for sub in ("cu13", "cu12", "cuda_nvdisasm"):
            p = Path(root) / "nvidia" / sub / "bin" / "nvdisasm"
            if p.is_file() and os.access(p, os.X_OK):
                return p
    return None


def default_sass_dir() -> str:
    """Where disassemblies are cached: `sass/` under cache.py's directory ($AIFLAME_CACHE or ~/.cache/...)."""
    return os.path.join(default_cache_dir(), "sass")


def parse_nvdisasm(text: str) -> Sass:
    """Parse `nvdisasm -c` output (with or without -g: annotations are comments and skipped).

    Branch targets come out as offsets (`BRA 0x230`, as `nvdisasm -json` writes them) rather than nvdisasm's
    `.L_x_N` labels, whose numbers depend on what else was disassembled in the same call.
    """
    out: Sass = {}
    current: dict[int, str] | None = None
    labels: dict[str, int] = {}
    pending: list[str] = []  # labels waiting for the next instruction's offset
    for line in text.splitlines():
        m = _SECTION.match(line)
        if m:
            current = out.setdefault(m.group(1), {})
            pending = []
            continue
        if current is None:
            continue
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        if "/*" not in line:
            continue
        m = _INSN.match(line)
        if m:
            off = int(m.group(1), 16)
            current[off] = m.group(2)
            for name in pending:
                labels[name] = off
            pending = []
    if labels:

        def target(m: re.Match[str]) -> str:
            off = labels.get(m.group(1) or m.group(2))
            return m.group(0) if off is None else f"{off:#x}"

        for rows in out.values():
            for off, insn in rows.items():
                if ".L_" in insn:
                    rows[off] = _TARGET.sub(target, insn)
    return out


def disassemble(
    cubin: bytes,
    digest: str,
    *,
    cache_dir: str | None = None,
    nvdisasm: Path | None = None,
    use_cache: bool = True,
    function_index: int | None = None,
) -> Sass | None:
    """SASS of every kernel in `cubin` (whose sha256 hex is `digest`); None when nvdisasm is not installed.

    `function_index` (a symbol table index, `Kernel.symbol_index`) disassembles that one function only: a
    whole NCCL cubin (100 MiB, 6 million instructions) takes nvdisasm minutes, one of its kernels seconds.
    Raises Unreadable when nvdisasm fails on the cubin (e.g. an architecture it does not know).
    """
    key = digest if function_index is None else f"{digest}.f{function_index}"
    cache = _Cache(cache_dir or default_sass_dir()) if use_cache and _DIGEST.match(digest) else None
    if cache is not None:
        hit = cache.load(key)
        if hit is not None:
            return hit
    tool = nvdisasm or find_nvdisasm()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory(prefix="aiflame-sass-") as tmp:
        path = os.path.join(tmp, "code.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        try:
            fun = [] if function_index is None else ["-fun", str(function_index)]
            proc = subprocess.run(
                [str(tool), "-c", *fun, path], capture_output=True, text=True, errors="replace", timeout=_TIMEOUT_S
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Unreadable(f"nvdisasm failed: {e}") from None
    if proc.returncode != 0:
        msg = next((ln.strip() for ln in proc.stderr.splitlines() if ln.strip()), f"exit status {proc.returncode}")
        raise Unreadable(f"nvdisasm failed: {msg}")
    sass = parse_nvdisasm(proc.stdout)
    if cache is not None:
        cache.store(key, sass)
    return sass


class _Cache:
    """One gzip'd JSON file per cubin digest (or digest and function) under `dir`."""

    def __init__(self, directory: str) -> None:
        self.dir = directory

    def path_for(self, key: str) -> str:
        return os.path.join(self.dir, key[:2], key + ".json.gz")

    def load(self, key: str) -> Sass | None:
        doc = read_json_gz(self.path_for(key), "SASS cache")
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
            return None
        kernels = doc.get("kernels")
        if doc.get("key") != key or not isinstance(kernels, dict):
            return None
        out: Sass = {}
        for name, rows in kernels.items():
            if not isinstance(rows, list):
                return None
            table: dict[int, str] = {}
            for row in rows:
                if not (isinstance(row, list) and len(row) == 2 and type(row[0]) is int and isinstance(row[1], str)):
                    return None
                table[row[0]] = row[1]
            out[name] = table
        return out

    def store(self, key: str, sass: Sass) -> None:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "key": key,
            "kernels": {k: [[off, text] for off, text in sorted(rows.items())] for k, rows in sass.items()},
        }
        write_json_gz(self.path_for(key), doc, "SASS cache")
