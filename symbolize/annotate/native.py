"""`annotate` for native code: a host function's x86-64 instructions (capstone) with the capture's samples on them.

Each sample counts once, at its leaf user PC (self samples, as `perf annotate` counts), on the instruction that
holds it; samples taken in the kernel count separately (a note says how many fell under the function). The
function is found by name among the binaries that have samples (exactly by its stored name in any of them, else
by demangled name or a part of it among the sampled functions), or by `dso+0xOFFSET` (a file offset, as nameless
frames read) or `dso+0xSTART-0xEND` for code without symbols. Code bytes come from the binary on this host, which
must be the build that ran (same build id); source lines from its DWARF or its separate debug file.
"""

from __future__ import annotations

import bisect
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import capstone

from aiflame.core.errors import BadInput, NothingToShow, Unreadable
from aiflame.core.raw import Capture, Mapping, ProcessSnapshot
from aiflame.symbolize.annotate.result import (
    ADDRESS,
    Annotation,
    BinaryNotFound,
    Instruction,
    match_names,
    rank,
    read_source,
    some,
)
from aiflame.symbolize.objfmt.debugfiles import find_debug_file
from aiflame.symbolize.objfmt.demangle import demangle, short_name
from aiflame.symbolize.objfmt.dwarf_lines import LineTable
from aiflame.symbolize.objfmt.elf import EM_X86_64, ElfFile
from aiflame.symbolize.objfmt.elf_format import Section
from aiflame.symbolize.objfmt.elf_symbols import Symbol

__all__ = ["Module", "annotate_native", "leaf_samples"]

_SHF_EXECINSTR = 0x4
_SHT_NOBITS = 8
_MAX_CODE = 1 << 20  # bytes disassembled at most (a function, or an explicit range)
_WINDOW = 256  # bytes shown either side of an address no symbol covers
_SWEEP = 1 << 16  # decode from the start of unnamed code only when it is this close (else from 4 KiB before)
_LOOKBACK = 16  # preceding symbols that may still cover an address (nested or overlapping symbols)


@dataclass
class Module:
    """One binary of the capture (a path and the build id it had): the leaf samples at each file offset."""

    path: str
    build_id: str
    user: Counter[int] = field(default_factory=Counter)  # file offset -> samples taken in user mode
    kernel: Counter[int] = field(default_factory=Counter)  # file offset of the user PC under a kernel sample

    @property
    def samples(self) -> int:
        return sum(self.user.values())


def leaf_samples(cap: Capture) -> dict[tuple[str, str], Module]:
    """Every executable file mapping of the capture, keyed (path, build id), with its leaf samples."""
    modules: dict[tuple[str, str], Module] = {}
    for p in cap.processes:
        for m in p.mappings:
            if m.path.startswith("/"):
                modules.setdefault((m.path, m.build_id), Module(m.path, m.build_id))
    by_pid: dict[int, list[ProcessSnapshot]] = defaultdict(list)
    for p in cap.processes:
        by_pid[p.pid].append(p)
    times: dict[int, list[int]] = {}
    for pid, snaps in by_pid.items():
        snaps.sort(key=lambda s: s.time_ns)
        times[pid] = [x.time_ns for x in snaps]
    found: dict[tuple[int, int, int], Mapping | None] = {}
    for s in cap.samples:
        if not s.user:
            continue
        snaps = by_pid.get(s.pid, [])
        k = bisect.bisect_right(times[s.pid], s.time_ns) if len(snaps) > 1 else 0
        key = (s.pid, s.user[0], k)
        if key not in found:
            # The latest snapshot taken before the sample first, then later ones (as symbolize/stacks.py does).
            order = [*range(k - 1, -1, -1), *range(k, len(snaps))]
            found[key] = next((hit for i in order if (hit := snaps[i].find(s.user[0])) is not None), None)
        where = found[key]
        if where is None or not where.path.startswith("/"):
            continue
        mod = modules[(where.path, where.build_id)]
        (mod.kernel if s.kern else mod.user)[s.user[0] - where.start + where.file_offset] += s.weight
    return modules


class _Binary:
    """A binary as found on this host: the file that ran (for its code) and its debug file (for lines)."""

    def __init__(self, mod: Module, debug_dirs: tuple[str, ...]) -> None:
        self.mod = mod
        clean = mod.path.removesuffix(" (deleted)")
        try:
            self.main = ElfFile.open(clean)
        except Unreadable as e:
            why = str(e).removeprefix(f"{clean}: ")
            raise BinaryNotFound(f"{clean}: not readable on this host ({why}); annotate needs the binary that ran",
                                 why=why) from None
        want = mod.build_id.lower()
        if want and self.main.build_id != want:
            self.main.close()
            raise BinaryNotFound(f"{clean}: this host's file has build id {self.main.build_id or 'none'}, the "
                                 f"capture's has {want}: not the build that ran", why="another build")
        self.debug: ElfFile | None = None
        dbg = find_debug_file(clean, want or self.main.build_id, self.main.debuglink, debug_dirs)
        if dbg is not None:
            try:
                self.debug = ElfFile.open(dbg)
            except Unreadable:
                self.debug = None
        by_addr: dict[int, Symbol] = {}
        for f in (self.debug, self.main):  # the debug file's full .symtab first
            for sym in f.functions() if f is not None else []:
                by_addr.setdefault(sym.addr, sym)
        self.symbols = [by_addr[a] for a in sorted(by_addr)]
        self._addrs = [s.addr for s in self.symbols]
        line_src = self.debug if self.debug is not None and self.debug.has_dwarf_lines else self.main
        self.lines = LineTable(line_src) if line_src.has_dwarf_lines else None

    def close(self) -> None:
        for f in (self.main, self.debug):
            if f is not None:
                f.close()

    def covering(self, vaddr: int) -> Symbol | None:
        """The function symbol whose range holds `vaddr`."""
        i = bisect.bisect_right(self._addrs, vaddr) - 1
        for j in range(i, max(i - _LOOKBACK, -1), -1):
            s = self.symbols[j]
            if vaddr < s.addr + max(s.size, 1):
                return s
        return None

    def exact(self, name: str) -> list[Symbol]:
        """Functions stored under exactly `name` (symbol versions aside), aliases included."""
        hits = [s for s in self.symbols if s.name == name or s.name.split("@", 1)[0] == name]
        if not hits:  # an alias of a symbol functions() kept under another name
            addr = self.main.function_addresses({name}).get(name)
            s = self.covering(addr) if addr is not None else None
            hits = [Symbol(s.addr, s.size, name)] if s is not None and s.addr == addr else []
        return hits

    def vaddr(self, off: int) -> int | None:
        return self.main.file_offset_to_vaddr(off)

    def sampled_functions(self) -> Counter[Symbol]:
        """Functions that hold leaf samples, with their samples."""
        out: Counter[Symbol] = Counter()
        for off, n in self.mod.user.items():
            v = self.vaddr(off)
            s = self.covering(v) if v is not None else None
            if s is not None:
                out[s] += n
        return out

    def exec_section(self, vaddr: int) -> Section | None:
        return next((s for s in self.main.sections if s.flags & _SHF_EXECINSTR and s.addr <= vaddr < s.addr + s.size
                     and s.type != _SHT_NOBITS), None)

    def unnamed_span(self, vaddr: int, sec: Section) -> tuple[int, int]:
        """The code no symbol covers around `vaddr` (which none does): from the end of the symbol before (or the
        section's start) to the start of the one after (or the section's end)."""
        i = bisect.bisect_right(self._addrs, vaddr)
        before = [s.addr + s.size for s in self.symbols[max(i - _LOOKBACK, 0):i] if s.addr + s.size <= vaddr]
        after = [s.addr for s in self.symbols[i:i + 1]]
        return max([sec.addr, *before]), min([sec.addr + sec.size, *after])

    def code(self, start: int, end: int) -> bytes:
        sec = self.exec_section(start)
        if sec is None:
            raise NothingToShow(f"{self.mod.path}: {start:#x} is not in an executable section")
        return self.main.read_section_range(sec, start - sec.addr, min(end, sec.addr + sec.size) - start)


def annotate_native(cap: Capture, query: str, *, dso: str | None = None, hot: int = 5,
                    debug_dirs: tuple[str, ...] = ("/usr/lib/debug",), source: bool = True) -> Annotation:
    """Annotate the function `query` names (or the code `dso+0xOFFSET[-0xEND]` names) with `cap`'s samples."""
    modules = leaf_samples(cap)
    total = sum(s.weight for s in cap.samples)
    m = ADDRESS.match(query.strip())
    if m and dso is None:
        mod = _one_module(modules, m.group("dso"))
        b = _Binary(mod, debug_dirs)
        try:
            return _by_address(b, m.group("dso"), int(m.group("start"), 16),
                               int(m.group("end"), 16) if m.group("end") else None, hot, total, source)
        finally:
            b.close()
    if dso is not None:
        chosen = _modules_named(modules, dso)
        if not chosen:
            raise NothingToShow(f"the capture has no binary {dso!r} (binaries with samples: "
                                f"{some(_sampled_names(modules)) or 'none'})")
    else:
        chosen = [mod for mod in modules.values() if mod.user]
        if not chosen:
            raise NothingToShow("the capture has no user-mode samples in any binary")
    binaries: list[_Binary] = []
    unreadable: list[str] = []
    try:
        for mod in sorted(chosen, key=lambda x: -x.samples):
            try:
                binaries.append(_Binary(mod, debug_dirs))
            except BinaryNotFound as e:
                if dso is not None and len(chosen) == 1:
                    raise
                unreadable.append(f"{os.path.basename(mod.path)} ({e.why})")
        b, sym = _find(binaries, query, unreadable, total)
        return _annotate(b, sym.addr, sym.addr + sym.size, sym.name, hot, total, source, ())
    finally:
        for b in binaries:
            b.close()


def _sampled_names(modules: dict[tuple[str, str], Module]) -> list[str]:
    mods = sorted((m for m in modules.values() if m.user), key=lambda m: -m.samples)
    return list(dict.fromkeys(os.path.basename(m.path) for m in mods))


def _modules_named(modules: dict[tuple[str, str], Module], dso: str) -> list[Module]:
    """The capture's binaries `dso` names: by path, by file name, else by file name start (`libc` -> libc.so.6)."""
    def named(m: Module, how: int) -> bool:
        path = m.path.removesuffix(" (deleted)")
        name = os.path.basename(path)
        return (path == dso, name == dso, name.startswith(dso + "."))[how]

    for how in range(3):
        hits = [m for m in modules.values() if named(m, how)]
        if hits:
            return hits
    return []


def _one_module(modules: dict[tuple[str, str], Module], dso: str) -> Module:
    hits = _modules_named(modules, dso)
    if not hits:
        raise NothingToShow(f"the capture has no binary {dso!r} (binaries with samples: "
                            f"{some(_sampled_names(modules)) or 'none'})")
    if len({m.path for m in hits}) > 1:
        raise BadInput(f"{dso!r} names {len(hits)} binaries: {some(sorted({m.path for m in hits}))}; "
                       "give its path")
    return max(hits, key=lambda m: m.samples)  # a path that ran in several builds: the one with most samples


def _find(binaries: list[_Binary], query: str, unreadable: list[str], total: int) -> tuple[_Binary, Symbol]:
    """The one function `query` names: by stored name in any binary, else among the sampled functions (the error
    lists the hottest of them, with their share of the capture's `total` samples)."""
    q = query.strip()
    sampled = [b.sampled_functions() for b in binaries]
    hits = [(n, s) for n, b in enumerate(binaries) for s in b.exact(q)]
    if not hits:
        cands = [(n, s) for n, fs in enumerate(sampled) for s in fs]
        shown = demangle(s.name for _n, s in cands)
        hits = match_names(q, {k: (k[1].name, shown[k[1].name]) for k in cands})
        if not hits:
            share: Counter[str] = Counter()
            for n, s in cands:
                share[_short(shown[s.name])] += sampled[n][s]
            known = some([f"{name} {100 * c / total:.1f}%" if total else name for name, c in share.most_common()], 6)
            where = f"; binaries not readable here: {some(unreadable, 4)}" if unreadable else ""
            raise (BinaryNotFound if unreadable else NothingToShow)(
                f"no function matching {q!r} in the binaries with samples (sampled functions: {known or 'none'})"
                f"{where}")
    if len(hits) > 1:
        counts = [{s.addr: c for s, c in fs.items()} for fs in sampled]
        hits.sort(key=lambda k: (-counts[k[0]].get(k[1].addr, 0), k[1].name))
        desc = [f"{_short(demangle([s.name])[s.name])} in {os.path.basename(binaries[n].mod.path)} "
                f"({counts[n].get(s.addr, 0)} samples)" for n, s in hits]
        raise BadInput(f"{q!r} matches {len(hits)} functions: {some(desc)}; give the full name, or the "
                       "binary with --dso")
    n, sym = hits[0]
    return binaries[n], sym


def _short(text: str) -> str:
    return short_name(text) if "(" in text else text


def _by_address(b: _Binary, dso: str, start_off: int, end_off: int | None, hot: int, total: int,
                source: bool) -> Annotation:
    start = b.vaddr(start_off)
    if start is None:
        raise NothingToShow(f"{dso}+{start_off:#x} is outside the loaded segments of {b.mod.path}")
    if end_off is not None:
        end = b.vaddr(end_off - 1)
        if end is None or end_off <= start_off:
            raise NothingToShow(f"{dso}+{start_off:#x}-{end_off:#x} is not a range of {b.mod.path}'s code")
        return _annotate(b, start, end + 1, f"{dso}+{start_off:#x}-{end_off:#x}", hot, total, source, (),
                         function=False)
    sym = b.covering(start)
    if sym is not None:
        return _annotate(b, sym.addr, sym.addr + sym.size, sym.name, hot, total, source,
                         (f"{dso}+{start_off:#x} is {sym.name}+{start - sym.addr:#x}",))
    sec = b.exec_section(start)
    if sec is None:
        raise NothingToShow(f"{dso}+{start_off:#x} is not in an executable section of {b.mod.path}")
    lo, hi = b.unnamed_span(start, sec)
    w_lo, w_hi = max(lo, start - _WINDOW), min(hi, start + _WINDOW)
    note = (f"no symbol covers {dso}+{start_off:#x}: {w_lo:#x}-{w_hi:#x} of the unnamed code at {lo:#x}-{hi:#x} "
            f"shown; {dso}+0xSTART-0xEND (file offsets) shows another range")
    sweep = lo if w_lo - lo <= _SWEEP else w_lo - 4096  # x86 decoding resynchronizes within a few instructions
    return _annotate(b, sweep, w_hi, f"{dso}+{start_off:#x}", hot, total, source, (note,), show_from=w_lo,
                     function=False)


def _annotate(b: _Binary, start: int, end: int, name: str, hot: int, total: int, source: bool,
              notes: tuple[str, ...], show_from: int | None = None, function: bool = True) -> Annotation:
    """Disassemble [start, end) of `b` (showing it from `show_from`) and put the samples on it. `function`: the
    range is one function, so branches inside it are labelled by their offset from its start."""
    if b.main.machine != EM_X86_64:
        raise BadInput(f"{b.mod.path}: annotate disassembles x86-64 code; this binary is ELF machine "
                       f"{b.main.machine}")
    if end - start > _MAX_CODE:
        raise BadInput(f"{name} spans {end - start} bytes; annotate shows at most {_MAX_CODE}")
    code = b.code(start, end)
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.skipdata = True  # bytes that are no instruction show as .byte and decoding goes on
    insns = [i for i in md.disasm_lite(code, start) if show_from is None or i[0] >= show_from]
    lo = insns[0][0] if insns else start
    starts = [a for a, *_ in insns]
    counts: Counter[int] = Counter()
    in_kernel = 0
    for off, n in b.mod.user.items():
        v = b.vaddr(off)
        if v is not None and lo <= v < end and starts:
            counts[starts[bisect.bisect_right(starts, v) - 1]] += n
    for off, n in b.mod.kernel.items():
        v = b.vaddr(off)
        if v is not None and lo <= v < end:
            in_kernel += n
    names = demangle([name])
    rows = []
    for addr, size, mnemonic, ops in insns:
        where = b.lines.lookup(addr) if b.lines is not None else None
        file, line = where if where else ("", 0)
        text = f"{mnemonic} {_target(b, ops, start, end, function) if _branch(mnemonic) else ops}".rstrip()
        rows.append(Instruction(addr, size, text, file, line, counts.get(addr, 0)))
    ranked = rank(rows, hot)
    if in_kernel:
        were = "1 more sample was" if in_kernel == 1 else f"{in_kernel} more samples were"
        notes += (f"{were} taken in the kernel while this code was the user-mode leaf (system calls, page "
                  "faults); not counted",)
    if b.lines is None:
        notes += (f"no source lines: {os.path.basename(b.mod.path)} has no DWARF line table and no debug file "
                  "was found (--debug-dir adds places to look)",)
    src = read_source({(r.file, r.line) for r in ranked}) if source else {}
    return Annotation("native", name, names[name], b.mod.path, b.mod.build_id or (b.main.build_id or ""), "x86-64",
                      lo, end - lo, "samples", sum(counts.values()), total, ranked, src, (), notes)


def _branch(mnemonic: str) -> bool:
    return mnemonic.startswith(("call", "j", "notrack j", "bnd j"))


def _target(b: _Binary, ops: str, start: int, end: int, function: bool) -> str:
    """A direct branch's target, named: `0x1189 <+0x29>` inside the function, `0x1050 <puts@plt>` outside."""
    if not ops.startswith("0x"):
        return ops
    try:
        t = int(ops, 16)
    except ValueError:
        return ops
    if start <= t < end:
        return f"{ops} <+{t - start:#x}>" if function else ops
    s = b.covering(t)
    if s is None:
        return ops
    label = _short(demangle([s.name])[s.name])
    return f"{ops} <{label}{f'+{t - s.addr:#x}' if t != s.addr else ''}>"
