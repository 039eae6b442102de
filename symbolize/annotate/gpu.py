"""`annotate` for a GPU kernel: its SASS instructions with the capture's stall samples and their stall reasons.

The kernel is found among those with stall samples (by mangled, demangled or short name, or a unique part). Its
instructions come from the cubin the capture stored (symbolize/stalls.py's CodeIndex: source lines from the
cubin's line table, SASS text from nvdisasm when installed); without a stored cubin (e.g. Intel Xe samples) only
the sampled offsets show. A kernel sampled in several cubins (architectures) shows the one with the most samples.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from aiflame.core.errors import BadInput, NothingToShow
from aiflame.core.raw import Capture, RawStallSample
from aiflame.symbolize.accel.sass import find_nvdisasm
from aiflame.symbolize.annotate.result import (
    Annotation,
    Instruction,
    match_names,
    rank,
    read_source,
    some,
)
from aiflame.symbolize.objfmt.demangle import demangle, short_name
from aiflame.symbolize.stalls import STALL_UNIT, CodeIndex, reason_label
from aiflame.symbolize.vendor.xe_eu_stall import map_ips, xe_kernels_from_events

__all__ = ["annotate_gpu", "gpu_matches", "kernel_samples"]

SASS_BYTES = 16  # one SASS instruction (sm_70 and later)


def kernel_samples(cap: Capture) -> dict[str, list[RawStallSample]]:
    """The capture's stall samples by kernel (mangled), Xe raw IPs first placed in their launched kernels."""
    stalls = cap.stalls
    xe = xe_kernels_from_events(cap.events)
    if xe:
        stalls, _ = map_ips(stalls, xe)
    out: dict[str, list[RawStallSample]] = defaultdict(list)
    for s in stalls:
        if s.kernel and s.count > 0:
            out[s.kernel].append(s)
    return dict(out)


def gpu_matches(cap: Capture, query: str) -> list[str]:
    """The kernels with stall samples that `query` names (mangled names; several when ambiguous)."""
    kernels = kernel_samples(cap)
    names = demangle(kernels)
    return match_names(query, {k: (k, names[k]) for k in kernels})


def annotate_gpu(cap: Capture, query: str, *, hot: int = 5, sass: bool = True, source: bool = True,
                 cache_dir: str | None = None) -> Annotation:
    """Annotate the GPU kernel `query` names with its stall samples, per instruction and stall reason."""
    kernels = kernel_samples(cap)
    if not kernels:
        raise NothingToShow("the capture has no GPU stall samples (`aiflame import` adds records taken elsewhere)")
    names = demangle(kernels)
    hits = match_names(query, {k: (k, names[k]) for k in kernels})
    if not hits:
        known = sorted(kernels, key=lambda k: -sum(s.count for s in kernels[k]))
        raise NothingToShow(f"no GPU kernel matching {query.strip()!r} has stall samples (kernels: "
                            f"{some([short_name(names[k]) for k in known], 6)})")
    if len(hits) > 1:
        desc = [f"{names[k]} ({sum(s.count for s in kernels[k])} stall samples)" for k in sorted(hits)]
        raise BadInput(f"{query.strip()!r} matches {len(hits)} GPU kernels: {some(desc)}; give the full name")
    kernel = hits[0]
    index = CodeIndex(cap.gpu_code, sass=sass, cache_dir=cache_dir)
    by_cubin: dict[str, list[RawStallSample]] = defaultdict(list)
    for s in kernels[kernel]:
        c = index.locate(s.code, kernel)
        by_cubin[c.digest if c is not None and kernel in c.kernels else ""].append(s)
    digest = max(by_cubin, key=lambda d: (sum(s.count for s in by_cubin[d]), d != "", d))
    chosen = by_cubin[digest]
    notes: list[str] = []
    others = sum(s.count for d, ss in by_cubin.items() if d != digest for s in ss)
    if others:
        notes.append(f"{others} more stall samples of this kernel are in other code objects (other architectures "
                     "or builds) and not shown")
    per_offset: dict[int, Counter[str]] = defaultdict(Counter)
    for s in chosen:
        per_offset[s.offset][reason_label(s.reason)] += s.count
    cubin = index.cubin(digest) if digest else None
    rows: list[Instruction] = []
    if cubin is not None:
        size = cubin.kernels[kernel].size
        offsets = sorted(set(range(0, size, SASS_BYTES)) | set(per_offset))
        arch, label = f"sm_{cubin.arch}", f"cubin {digest[:12]} (sm_{cubin.arch})"
    else:
        size = 0
        offsets = sorted(per_offset)
        arch, label = chosen[0].source, f"{chosen[0].source} kernel (no code object in the capture)"
        notes.append("the capture holds no code object for this kernel: sampled offsets only, no SASS or lines")
    for off in offsets:
        text = index.instruction(cubin, kernel, off) if cubin is not None else None
        where = index.source(cubin, kernel, off) if cubin is not None else None
        file, line = where if where else ("", 0)
        reasons = per_offset.get(off, Counter())
        rows.append(Instruction(off, SASS_BYTES if cubin is not None else 0, text, file, line,
                                sum(reasons.values()), reasons=tuple(reasons.most_common())))
    if cubin is not None and size and any(off >= size for off in per_offset):
        notes.append("some samples lie past the kernel's end in its cubin (a different build?)")
    if cubin is not None and sass and find_nvdisasm() is None:
        notes.append("no SASS text: nvdisasm not found (pip install nvidia-cuda-nvdisasm, or put it on PATH)")
    notes.extend(dict.fromkeys(index.notes))
    ranked = rank(rows, hot)
    totals: Counter[str] = Counter()
    for r in ranked:
        totals.update(dict(r.reasons))
    src = read_source({(r.file, r.line) for r in ranked}) if source else {}
    stall_total = sum(s.count for s in cap.stalls if s.count > 0)
    return Annotation("gpu", kernel, names[kernel], label, digest, arch, 0, size, STALL_UNIT,
                      sum(r.samples for r in ranked), stall_total, ranked, src, tuple(totals.most_common()),
                      tuple(notes))
