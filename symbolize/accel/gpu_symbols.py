"""What `aiflame gpu-symbols` shows: the GPU kernels in a binary, and the SASS and source line at a kernel offset.

Pure functions over a file: a host ELF with device code (its `.nv_fatbin`), a fatbin file, or a cubin. Kernel
names may be given mangled, demangled, as the short demangled name (`demo::fill<int>`) or as a unique
substring. User mistakes raise a `BadInput` (`NothingToShow` for a kernel or code the file does not hold) with one
line that says what would have worked.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from aiflame.core.capture import is_capture
from aiflame.core.errors import BadInput, NothingToShow, Unreadable
from aiflame.symbolize.accel.cubin import Cubin, Kernel, parse_cubin
from aiflame.symbolize.accel.fatbin import FatbinEntry, iter_entries, read_fatbin_file
from aiflame.symbolize.accel.sass import disassemble, find_nvdisasm
from aiflame.symbolize.objfmt.demangle import demangle, short_name

__all__ = [
    "CubinInfo",
    "Instruction",
    "Inventory",
    "KernelInfo",
    "inventory",
    "lookup_instruction",
    "parse_arch",
    "resolve_kernel",
]

_INSN_BYTES = 16
# Above this a cubin is disassembled one function at a time: nvdisasm needs minutes for a 100 MiB NCCL cubin.
_WHOLE_CUBIN_SASS = 16 << 20
_ARCH = re.compile(r"^(?:sm_|compute_|sm)?(\d{2,3})[a-z]?$")


@dataclass(frozen=True)
class KernelInfo:
    """One function of one cubin."""

    name: str  # mangled
    demangled: str
    arch: int
    size: int
    entry: bool  # a __global__ kernel (else an out-of-line __device__ function)
    has_lines: bool


@dataclass(frozen=True)
class CubinInfo:
    """One cubin with code: its architecture, sha256 digest, size and functions (sorted by demangled name)."""

    arch: int
    digest: str
    size: int
    has_lines: bool
    kernels: tuple[KernelInfo, ...]


@dataclass(frozen=True)
class Inventory:
    """The device code of a file. `container` is "elf" (host binary), "fatbin" or "cubin"."""

    path: str
    container: str
    cubins: tuple[CubinInfo, ...]
    ptx_archs: tuple[int, ...]
    skipped: int  # cubins without code (nvcc emits some per translation unit)
    notes: tuple[str, ...] = ()  # entries that could not be read, line tables that could not be parsed

    @property
    def archs(self) -> list[int]:
        """Architectures that have SASS, ascending."""
        return sorted({c.arch for c in self.cubins})


@dataclass(frozen=True)
class Instruction:
    """The answer for one kernel offset in one cubin. `sass` is None when nvdisasm is absent (`sass_note`
    then says so) or was not asked for; `file`/`line` are None without line information."""

    kernel: str
    demangled: str
    arch: int
    offset: int
    kernel_size: int
    file: str | None
    line: int | None
    sass: str | None
    sass_note: str | None = None
    cubin_digest: str = field(default="", compare=False)


def parse_arch(text: str) -> int:
    """`sm_90`, `sm_90a`, `compute_90` or `90` -> 90; BadInput otherwise."""
    m = _ARCH.match(text.strip().lower())
    if not m:
        raise BadInput(f"bad architecture {text!r} (expected e.g. sm_90)")
    return int(m.group(1))


class _Source:
    """The device code of one file, readable more than once (a second pass decodes only what it needs)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fsdecode(path)
        self.stored: list[FatbinEntry] = []
        if _is_capture(path):
            self.container, self.data = "capture", b""
            self.stored = _capture_entries(path)
            if not self.stored:
                raise NothingToShow(f"{self.path}: the capture holds no GPU code (no kernel was launched)")
            return
        self.container, self.data = read_fatbin_file(path)
        if self.container == "elf" and not self.data:
            raise NothingToShow(f"{self.path}: no CUDA device code (no .nv_fatbin section)")

    def entries(self, only: set[int] | None = None) -> Iterator[FatbinEntry]:
        if self.container == "capture":
            yield from (e for e in self.stored if only is None or e.offset in only)
        elif self.container == "cubin":
            yield FatbinEntry("elf", 0, 0, self.data, hashlib.sha256(self.data).hexdigest(), 0)
        else:
            yield from iter_entries(self.data, label=self.path, only=only)

    def cubin(self, e: FatbinEntry) -> Cubin:
        return parse_cubin(e.data, label=f"{self.path}: cubin at {e.offset:#x}", digest=e.digest)


def _is_capture(path: str | os.PathLike[str]) -> bool:
    try:
        return is_capture(path)
    except Unreadable:
        return False  # read_fatbin_file says why


def _capture_entries(path: str | os.PathLike[str]) -> list[FatbinEntry]:
    """The cubins an aiflame capture stored (and those inside fatbins it copied from memory), numbered in order."""
    label = os.fsdecode(path)
    from aiflame.symbolize.road import read  # here: the road reaches this module through the views

    cap, _warnings = read(Path(path))  # the cubins of its CUPTI streams too
    out: list[FatbinEntry] = []
    for code in cap.gpu_code:
        if code.kind == "cubin" and code.data:
            out.append(FatbinEntry("elf", code.arch, 0, code.data, code.digest, len(out)))
        elif code.kind == "fatbin" and code.data:
            for entry in iter_entries(code.data, label=f"{label}: {code.origin}"):
                out.append(FatbinEntry(entry.kind, entry.arch, entry.flags, entry.data, entry.digest, len(out),
                                       entry.error))
    return out


def inventory(path: str | os.PathLike[str]) -> Inventory:
    """Every cubin with code in `path` and its kernels. Raises Unreadable on unreadable files."""
    src = _Source(path)
    cubins: list[CubinInfo] = []
    ptx: set[int] = set()
    notes: list[str] = []
    skipped = 0
    raw: list[tuple[Cubin, set[str]]] = []
    for e in src.entries():
        if e.error:
            notes.append(e.error)
            continue
        if e.kind == "ptx":
            ptx.add(e.arch)
            continue
        try:
            c = src.cubin(e)
        except Unreadable as err:
            notes.append(str(err))
            continue
        if not c.has_code:
            skipped += 1
            continue
        try:
            with_lines = set(c.lines().kernels())
        except Unreadable as err:
            notes.append(str(err))
            with_lines = set()
        raw.append((c, with_lines))
    names = demangle(k for c, _ in raw for k in c.kernels)
    for c, with_lines in raw:
        ks = tuple(
            sorted(
                (KernelInfo(k.name, names[k.name], c.arch, k.size, k.entry, k.name in with_lines)
                 for k in c.kernels.values()),
                key=lambda k: (k.demangled, k.name),
            )
        )
        cubins.append(CubinInfo(c.arch, c.digest, len(c.data), bool(with_lines), ks))
    cubins.sort(key=lambda c: c.arch)
    return Inventory(src.path, src.container, tuple(cubins), tuple(sorted(ptx)), skipped, tuple(notes))


def resolve_kernel(query: str, names: dict[str, str]) -> str:
    """The mangled name `query` designates among `names` (mangled -> demangled); NothingToShow when
    none does, BadInput when several do. Tried in turn: mangled, demangled, short demangled name, then a
    substring of either."""
    q = query.strip()
    if q in names:
        return q
    shorts = {m: short_name(d) for m, d in names.items()}
    for form in (names, shorts):
        hits = sorted(m for m in names if form[m] == q)
        if len(hits) == 1:
            return hits[0]
        if hits:
            raise _ambiguous(query, hits, names)
    hits = sorted(m for m in names if q in m or q in names[m])
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise _ambiguous(query, hits, names)
    close = difflib.get_close_matches(q, sorted(set(shorts.values())) + list(names), n=5, cutoff=0.5)
    shown = list(dict.fromkeys(shorts.get(c, c) for c in close))
    hint = f"; close: {', '.join(shown)}" if shown else f"; known: {_some(sorted(set(shorts.values())))}"
    raise NothingToShow(f"unknown kernel {query!r}{hint}")


def _ambiguous(query: str, hits: list[str], names: dict[str, str]) -> BadInput:
    return BadInput(f"kernel {query!r} is ambiguous: {_some(sorted(names[m] for m in hits))}")


def _some(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def lookup_instruction(
    path: str | os.PathLike[str],
    kernel: str,
    offset: int,
    *,
    arch: int | None = None,
    sass: bool = True,
    cache_dir: str | None = None,
) -> list[Instruction]:
    """The instruction at byte `offset` of `kernel`, in every cubin of `path` that has the kernel (just the
    `arch` ones when given), with its source line and, when nvdisasm is installed, its SASS text."""
    if offset < 0 or offset % _INSN_BYTES:
        raise BadInput(f"offset {offset:#x} is not a multiple of {_INSN_BYTES} (one SASS instruction)")
    src = _Source(path)
    # Pass 1: names only, remembering which entries hold which kernels; pass 2 decodes just those entries.
    where: dict[str, list[tuple[int, int, int]]] = {}  # mangled -> [(entry offset, arch, size)]
    for e in src.entries():
        if e.kind != "elf" or e.error:
            continue
        try:
            c = src.cubin(e)
        except Unreadable:
            continue
        for k in c.kernels.values():
            where.setdefault(k.name, []).append((e.offset, c.arch, k.size))
    if not where:
        raise NothingToShow(f"{src.path}: no GPU kernels found")
    names = demangle(where)
    mangled = resolve_kernel(kernel, names)
    shown = short_name(names[mangled])
    places = where[mangled]
    if arch is not None:
        present = sorted({a for _, a, _ in places})
        places = [p for p in places if p[1] == arch]
        if not places:
            raise NothingToShow(
                f"{shown} has no code for sm_{arch}; present: {', '.join(f'sm_{a}' for a in present)}"
            )
    inside = [p for p in places if offset < p[2]]
    if not inside:
        sizes = ", ".join(f"{s:#x} bytes on sm_{a}" for _, a, s in sorted(set(places), key=lambda p: p[1]))
        raise BadInput(f"offset {offset:#x} is outside {shown} ({sizes})")
    nvdisasm = find_nvdisasm() if sass else None
    out: list[Instruction] = []
    for e in src.entries(only={p[0] for p in inside}):
        c = src.cubin(e)
        k = c.kernels[mangled]
        try:
            where_line = c.lines().lookup(mangled, offset)
        except Unreadable:
            where_line = None
        text, note = _sass_text(c, k, offset, nvdisasm, sass, cache_dir)
        file, line = where_line if where_line else (None, None)
        out.append(Instruction(mangled, names[mangled], c.arch, offset, k.size, file, line, text, note, c.digest))
    out.sort(key=lambda i: i.arch)
    return out


def _sass_text(
    c: Cubin, k: Kernel, offset: int, nvdisasm: Path | None, wanted: bool, cache_dir: str | None
) -> tuple[str | None, str | None]:
    if not wanted:
        return None, None
    if nvdisasm is None:
        return None, "nvdisasm not found (pip install nvidia-cuda-nvdisasm, or put it on PATH)"
    try:
        fun = k.symbol_index if len(c.data) > _WHOLE_CUBIN_SASS else None
        table = disassemble(c.data, c.digest, cache_dir=cache_dir, nvdisasm=nvdisasm, function_index=fun)
    except Unreadable as e:
        return None, str(e)
    if table is None:
        return None, "nvdisasm not found"
    return table.get(k.name, {}).get(offset), None
