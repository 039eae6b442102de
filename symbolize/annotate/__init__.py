"""`aiflame annotate`: one function's instructions with the samples of a capture on them (see result.py).

`annotate(cap, symbol)` picks native code or a GPU kernel: `kind="auto"` takes the one the name designates, and
asks for `kind` when a name is both (a CUDA kernel and its host-side launch stub share a mangled name).
"""

from __future__ import annotations

from aiflame.core.raw import Capture
from aiflame.symbolize.annotate.result import (
    ADDRESS,
    AmbiguousSymbol,
    AnnotateError,
    Annotation,
    BinaryNotFound,
    BinaryNotInCapture,
    Instruction,
    SymbolNotFound,
)

__all__ = [
    "KINDS",
    "AmbiguousSymbol",
    "AnnotateError",
    "Annotation",
    "BinaryNotFound",
    "BinaryNotInCapture",
    "Instruction",
    "SymbolNotFound",
    "annotate",
]

KINDS = ("auto", "native", "gpu")


def annotate(
    cap: Capture,
    symbol: str,
    *,
    kind: str = "auto",
    dso: str | None = None,
    hot: int = 5,
    debug_dirs: tuple[str, ...] = ("/usr/lib/debug",),
    sass: bool = True,
    source: bool = True,
) -> Annotation:
    """Annotate `symbol` (a function name, a part of it, `dso+0xOFFSET` or `dso+0xSTART-0xEND`) with `cap`'s
    samples; `dso` restricts the search to one binary, `hot` is how many instructions are ranked hottest.

    Raises an AnnotateError (a BadInput) with one line: SymbolNotFound, AmbiguousSymbol (the line lists the
    candidates), BinaryNotInCapture, BinaryNotFound (not on this host, or another build of it)."""
    # Imported here: capstone and the GPU code readers cost every other command start-up time.
    from aiflame.symbolize.annotate.gpu import annotate_gpu, gpu_matches
    from aiflame.symbolize.annotate.native import annotate_native

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}")
    if kind == "gpu":
        return annotate_gpu(cap, symbol, hot=hot, sass=sass, source=source)
    native_only = kind == "native" or dso is not None or ADDRESS.match(symbol.strip()) is not None
    gpu = [] if native_only or not cap.stalls else gpu_matches(cap, symbol)
    if not gpu:
        return annotate_native(cap, symbol, dso=dso, hot=hot, debug_dirs=debug_dirs, source=source)
    try:
        found = annotate_native(cap, symbol, hot=hot, debug_dirs=debug_dirs, source=False)
    except AnnotateError:
        return annotate_gpu(cap, symbol, hot=hot, sass=sass, source=source)
    raise AmbiguousSymbol(f"{symbol.strip()!r} names a GPU kernel with stall samples and the native function "
                          f"{found.display} ({found.samples} samples); add --kind gpu or --kind native")
