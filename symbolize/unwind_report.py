"""What the BPF unwinder did across a capture: how many samples it walked, why each walk ended, and the file
where most walks that ended early stopped (the one to look at: no CFI, stripped, JIT). Counters go into the
profile (`unwind_<reason>`), the worst file into its meta, and the summary prints both."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from aiflame.core.raw import RawSample
from aiflame.core.unwind import END, STOPS, USED_FP, USED_SCAN, stop_of

UNKNOWN_FILE = "[unknown]"  # where the outermost frame reached lies in no mapping (or one without a file)


def unwind_report(samples: Iterable[RawSample], where: Callable[[RawSample], str]) -> tuple[dict[str, int], str]:
    """(counters, worst) for `samples`; `where(s)` names the file holding the outermost frame the walk reached."""
    counters: Counter[str] = Counter()
    early: Counter[tuple[str, str]] = Counter()
    for s in samples:
        code = stop_of(s.unwind)
        if not code:
            continue
        counters["unwind_cfi"] += 1
        key = STOPS.get(code, (f"reason_{code}", ""))[0]
        counters[f"unwind_{key}"] += 1
        if s.unwind & USED_FP:
            counters["unwind_fp_frames"] += 1
        if s.unwind & USED_SCAN:
            counters["unwind_scanned"] += 1
        if code != END:
            early[(where(s), key)] += 1
    worst = ""
    if early:
        (path, key), n = early.most_common(1)[0]
        worst = f"{path or UNKNOWN_FILE} ({n} samples: {key.replace('_', ' ')})"
    return dict(counters), worst
