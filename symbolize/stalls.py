"""The AI flame graph: accelerator stall samples attributed to the CPU stacks that launched their kernels.

Each stall sample (aiflame.core.raw.RawStallSample) becomes a model sample whose stack is

    <CPU launch stack with Python> ; - ; <kernel>_[G] ; <file:line>_[G] ; <+offset instruction>_[g] ; <reason>_[g]

weighted by stall samples; samples in which no instruction issued (CUPTI's `<reason>_not_issued`, a subset of the
reason's samples) end in one more frame, `not issued`_[g], under their reason: counted once, never added.

Launch stacks come from the capture's runtime events (symbolize/events.py): a sample whose vendor gave a launch
correlation id goes to the launch with that id; otherwise a kernel's samples are shared over the stacks that
launched it, in proportion to their launch counts (integer shares that keep every total exact). Samples of
kernels never seen launched stay, under an explicit `[unknown launch]` frame. Kernel, source line and SASS text
come from the cubins the capture stored (GpuCode records, by digest); without a code object the kernel and
offset still show. Nothing is dropped silently: every fallback is counted in the profile's counters, which the
summary prints.
"""

from __future__ import annotations

import math
import os
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace

from aiflame.core.errors import Unreadable
from aiflame.core.model import SEPARATOR, EventKind, Frame, FrameKind, Profile, Sample, Stack, TraceEvent
from aiflame.core.raw import Capture, GpuCode
from aiflame.symbolize.accel.cubin import Cubin, parse_cubin
from aiflame.symbolize.accel.fatbin import iter_entries
from aiflame.symbolize.accel.sass import disassemble, find_nvdisasm
from aiflame.symbolize.objfmt.demangle import demangle, short_name
from aiflame.symbolize.vendor.cupti_stream import NOT_ISSUED_SUFFIX
from aiflame.symbolize.vendor.xe_eu_stall import map_ips, xe_kernels_from_events

__all__ = [
    "STALL_UNIT",
    "UNKNOWN_LAUNCH",
    "CodeIndex",
    "combined_profile",
    "reason_label",
    "share",
    "stall_profile",
]

STALL_UNIT = "stall samples"
UNKNOWN_LAUNCH = Frame("[unknown launch]", FrameKind.UNKNOWN)
UNKNOWN_KERNEL = "[unknown kernel]"
UNKNOWN_SOURCE = "[unknown source]"
UNKNOWN_REASON = "[unknown reason]"
NOT_ISSUED_FRAME = "not issued"

# Vendors' prefixes that only repeat what the layer says (Nsight Compute's metric names for CUPTI's reasons).
_REASON_PREFIXES = ("smsp__pcsamp_warps_issue_stalled_", "smsp__pcsamp_", "warps_issue_stalled_")


def reason_label(reason: str) -> str:
    """The stall reason as a frame shows it: CUPTI's `smsp__pcsamp_warps_issue_stalled_long_scoreboard` reads
    `long_scoreboard`; other vendors' names are kept; empty reads `[unknown reason]`."""
    text = reason.strip()
    for p in _REASON_PREFIXES:
        if text.startswith(p) and len(text) > len(p):
            return text[len(p):]
    return text or UNKNOWN_REASON


def instruction_label(offset: int, text: str | None) -> str:
    """`+0x0040 FFMA R0, R1, R2, R3`: the offset first and zero-padded, so sorted labels follow code order."""
    head = f"+{offset:#06x}"
    return f"{head} {text}" if text else head


def share(total: int, weights: list[int]) -> list[int]:
    """`total` split in proportion to `weights` (largest remainder): integers summing exactly to `total`."""
    wsum = sum(weights)
    if wsum <= 0:
        raise ValueError("share needs a positive weight")
    base = [total * w // wsum for w in weights]
    rest = total - sum(base)
    order = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % wsum), i))
    for i in order[:rest]:
        base[i] += 1
    return base


class CodeIndex:
    """The capture's cubins by digest and by kernel, parsed, line-mapped and disassembled on first use."""

    def __init__(self, gpu_code: Iterable[GpuCode], *, sass: bool = True, cache_dir: str | None = None) -> None:
        self._data: dict[str, bytes] = {}
        self._arch: dict[str, int] = {}
        for c in gpu_code:
            if not c.data:
                continue
            if c.kind == "cubin":
                self._data.setdefault(c.digest, c.data)
                self._arch.setdefault(c.digest, c.arch)
            elif c.kind == "fatbin":
                try:
                    for e in iter_entries(c.data, label=c.origin):
                        if e.kind == "elf" and not e.error:
                            self._data.setdefault(e.digest, e.data)
                            self._arch.setdefault(e.digest, e.arch)
                except Unreadable:
                    continue
        self._cubins: dict[str, Cubin | None] = {}
        self._by_kernel: dict[str, list[str]] | None = None
        self._sass_wanted = sass
        self._nvdisasm = find_nvdisasm() if sass else None
        self._sass: dict[str, dict[str, dict[int, str]] | None] = {}
        self._cache_dir = cache_dir
        self.notes: list[str] = []

    def cubin(self, digest: str) -> Cubin | None:
        if digest not in self._cubins:
            data = self._data.get(digest)
            c = None
            if data is not None:
                try:
                    c = parse_cubin(data, label=f"cubin {digest[:12]}", digest=digest)
                except Unreadable as e:
                    self.notes.append(str(e))
            self._cubins[digest] = c
        return self._cubins[digest]

    def with_kernel(self, kernel: str) -> list[str]:
        """Digests of the cubins defining `kernel` (mangled)."""
        if self._by_kernel is None:
            self._by_kernel = defaultdict(list)
            for d in sorted(self._data):
                c = self.cubin(d)
                if c is not None:
                    for k in c.kernels:
                        self._by_kernel[k].append(d)
        return self._by_kernel.get(kernel, [])

    def locate(self, digest: str, kernel: str) -> Cubin | None:
        """The cubin a sample names, else the only cubin defining its kernel (several: ambiguous, None)."""
        c = self.cubin(digest) if digest else None
        if c is not None:
            return c
        if kernel:
            cands = self.with_kernel(kernel)
            if len(cands) == 1:
                return self.cubin(cands[0])
        return None

    def source(self, c: Cubin, kernel: str, offset: int) -> tuple[str, int] | None:
        try:
            return c.lines().lookup(kernel, offset)
        except Unreadable as e:
            self.notes.append(str(e))
            return None

    def instruction(self, c: Cubin, kernel: str, offset: int) -> str | None:
        if self._nvdisasm is None:
            return None
        if c.digest not in self._sass:
            try:
                self._sass[c.digest] = disassemble(c.data, c.digest, cache_dir=self._cache_dir,
                                                   nvdisasm=self._nvdisasm)
            except Unreadable as e:
                self.notes.append(str(e))
                self._sass[c.digest] = None
        table = self._sass[c.digest]
        return table.get(kernel, {}).get(offset) if table else None


@dataclass(frozen=True, slots=True)
class _Key:
    """Stall samples that land on the same flame graph leaf path (summed before attribution)."""

    pid: int
    kernel: str  # mangled as reported
    code: str
    offset: int
    reason: str
    correlation_id: int
    source: str
    not_issued: bool = False


def _gpu_frames(key: _Key, names: dict[str, str], index: CodeIndex) -> tuple[str, Stack]:
    """(short kernel name, to match launches by; the four GPU frames)."""
    kname = short_name(names.get(key.kernel, key.kernel)) if key.kernel else ""
    cubin = index.locate(key.code, key.kernel) if key.kernel else None
    src: tuple[str, int] | None = None
    text: str | None = None
    if cubin is not None and key.kernel in cubin.kernels:
        src = index.source(cubin, key.kernel, key.offset)
        text = index.instruction(cubin, key.kernel, key.offset)
    kframe = Frame(kname or UNKNOWN_KERNEL, FrameKind.ACCEL_SOURCE if kname else FrameKind.UNKNOWN, module=key.source)
    if src is not None:
        file, line = src
        sframe = Frame(f"{os.path.basename(file)}:{line}", FrameKind.ACCEL_SOURCE, module=key.source, file=file,
                       line=line)
    else:
        sframe = Frame(UNKNOWN_SOURCE, FrameKind.ACCEL_SOURCE, module=key.source)
    iframe = Frame(instruction_label(key.offset, text), FrameKind.ACCEL_INSTR, module=key.source)
    rframe = Frame(reason_label(key.reason), FrameKind.STALL, module=key.source)
    if key.not_issued:
        return kname, (kframe, sframe, iframe, rframe, Frame(NOT_ISSUED_FRAME, FrameKind.STALL, module=key.source))
    return kname, (kframe, sframe, iframe, rframe)


def _split_legacy_not_issued(agg: Counter[_Key], counters: Counter[str]) -> None:
    """Captures written before aiflame split CUPTI's `<reason>_not_issued` hold it as samples of a reason of its
    own, next to its reason's full count: move it under its reason (as the not-issued part), so that a sample
    counts once in those captures too."""
    legacy = [k for k in agg if k.source == "cupti" and not k.not_issued and k.reason.endswith(NOT_ISSUED_SUFFIX)]
    for k in legacy:
        base = replace(k, reason=k.reason[:-len(NOT_ISSUED_SUFFIX)])
        if base not in agg:
            continue  # no such reason beside it: a reason of its own after all
        m = agg.pop(k)
        agg[base] -= min(m, agg[base])
        if not agg[base]:
            del agg[base]
        agg[replace(base, not_issued=True)] += m
        counters["stall_legacy_not_issued"] += m


def _launch_tables(events: list[TraceEvent]) -> tuple[
    dict[tuple[int, str], Counter[Stack]], dict[str, Counter[Stack]], dict[tuple[int, int], Stack]
]:
    by_pid: dict[tuple[int, str], Counter[Stack]] = defaultdict(Counter)
    by_name: dict[str, Counter[Stack]] = defaultdict(Counter)
    by_corr: dict[tuple[int, int], Stack] = {}
    for ev in events:
        if ev.kind != EventKind.COMPUTE:
            continue
        by_pid[(ev.pid, ev.name)][ev.stack] += ev.calls
        by_name[ev.name][ev.stack] += ev.calls
        corr = ev.args.get("correlation_id")
        if isinstance(corr, int) and corr:
            by_corr[(ev.pid, corr)] = ev.stack
    return by_pid, by_name, by_corr


def stall_profile(
    cap: Capture,
    prof: Profile,
    *,
    sass: bool = True,
    cache_dir: str | None = None,
    index: CodeIndex | None = None,
) -> Profile:
    """The AI flame graph of `cap`: its stall samples on the launch stacks of `prof` (the capture symbolized by
    symbolize/stacks.py, whose events carry the launch stacks). Unit: stall samples."""
    out = Profile(unit=STALL_UNIT, meta=dict(prof.meta), counters={}, start_ns=prof.start_ns, end_ns=prof.end_ns)
    counters: Counter[str] = Counter()
    if cap.footer:
        for k, v in cap.footer.counters.items():
            if k.startswith(("stall", "cupti", "xe_", "rocprof")):
                counters[k] += v
    agg: Counter[_Key] = Counter()
    first_time: dict[_Key, int] = {}
    stalls = cap.stalls
    xe_kernels = xe_kernels_from_events(cap.events)
    if xe_kernels:  # Xe samples arrive as raw IPs: place them in the launched kernels first
        stalls, _ = map_ips(stalls, xe_kernels)
    for s in stalls:
        if s.source == "xe" and not s.kernel:
            counters["stall_xe_unmapped"] += s.count
        if s.count <= 0:
            counters["stall_records_empty"] += 1
            continue
        key = _Key(s.pid, s.kernel, s.code, s.offset, s.reason, s.correlation_id, s.source, s.not_issued)
        agg[key] += s.count
        if s.time_ns and key not in first_time:
            first_time[key] = s.time_ns
    _split_legacy_not_issued(agg, counters)
    index = index or CodeIndex(cap.gpu_code, sass=sass, cache_dir=cache_dir)
    names = demangle({k.kernel for k in agg if k.kernel})
    by_pid, by_name, by_corr = _launch_tables(prof.events)

    # Group leaf paths per kernel (and pid) so each kernel's samples are shared over its launch stacks at once.
    groups: dict[tuple[int, str], list[tuple[_Key, Stack, int]]] = defaultdict(list)
    for key in sorted(agg, key=lambda k: (k.pid, k.kernel, k.code, k.offset, k.reason, k.correlation_id,
                                          k.not_issued)):
        n = agg[key]
        counters["stall_samples"] += n
        kname, gpu = _gpu_frames(key, names, index)
        if gpu[1].name == UNKNOWN_SOURCE:
            counters["stall_no_source"] += n
        if not kname:
            counters["stall_unknown_kernel"] += n
        if key.correlation_id and (key.pid, key.correlation_id) in by_corr:
            stack = by_corr[(key.pid, key.correlation_id)]
            out.samples.append(Sample((*stack, SEPARATOR, *gpu), n, key.pid, time_ns=first_time.get(key, 0)))
            counters["stall_by_correlation"] += n
            continue
        groups[(key.pid, kname)].append((key, gpu, n))

    for (pid, kname), leaves in groups.items():
        launches = (by_pid.get((pid, kname)) if pid else by_name.get(kname)) if kname else None
        if not launches:
            for key, gpu, n in leaves:
                root = (Frame(f"[unknown launch pid {pid}]", FrameKind.UNKNOWN) if pid else UNKNOWN_LAUNCH,)
                out.samples.append(Sample((*root, SEPARATOR, *gpu), n, pid, time_ns=first_time.get(key, 0)))
                counters["stall_unknown_launch"] += n
            continue
        stacks = sorted(launches, key=lambda st: (-launches[st], tuple(f.name for f in st)))
        weights = [launches[st] for st in stacks]
        for key, gpu, n, parts in _diffuse(leaves, weights):
            for stack, part in zip(stacks, parts, strict=True):
                if part:
                    out.samples.append(Sample((*stack, SEPARATOR, *gpu), part, pid,
                                              time_ns=first_time.get(key, 0)))
            if len(stacks) > 1:
                counters["stall_shared_by_launches"] += n
    out.counters = dict(counters)
    out.meta["stall_notes"] = "; ".join(dict.fromkeys(index.notes))[:2000] if index.notes else ""
    if not out.meta["stall_notes"]:
        del out.meta["stall_notes"]
    return out


def _diffuse(
    leaves: list[tuple[_Key, Stack, int]], weights: list[int]
) -> Iterable[tuple[_Key, Stack, int, list[int]]]:
    """Split each leaf's count over the launch stacks by `weights` so that every leaf keeps its exact count and
    every stack's running total stays within one sample of its exact share. Whole rounds of sum(weights) samples
    go out exactly by weight; each remaining sample goes to the stack furthest below its share (largest
    deficit), which holds the bound (clamped floors with carried errors did not: the property test found a
    leaf of 2 split into parts summing to 8)."""
    g = 0
    for w in weights:
        g = math.gcd(g, w)
    w_red = [w // g for w in weights] if g else list(weights)
    wsum = sum(w_red)
    got = [0] * len(w_red)
    seen = 0
    for key, gpu, n in leaves:
        rounds, rest = divmod(n, wsum)
        parts = [rounds * w for w in w_red]
        seen += rounds * wsum
        for _ in range(rest):
            seen += 1
            i = max(range(len(w_red)), key=lambda j: (seen * w_red[j] - (got[j] + parts[j]) * wsum, -j))
            parts[i] += 1
        got = [a + b for a, b in zip(got, parts, strict=True)]
        yield key, gpu, n, parts


def combined_profile(cpu: Profile, stalls: Profile) -> Profile:
    """CPU samples and stall samples in one view (the `combined` view): different units side by side, so the
    flame graph's widths compare only within each layer."""
    out = Profile(samples=[*cpu.samples, *stalls.samples], events=cpu.events, unit="CPU + stall samples",
                  meta={**cpu.meta, **stalls.meta}, counters={**cpu.counters, **stalls.counters},
                  start_ns=cpu.start_ns, end_ns=cpu.end_ns)
    return out

