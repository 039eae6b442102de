"""`aiflame annotate`: one function's instructions (or a Python function's lines) with a capture's samples on them
(see result.py, python.py).

`annotate_any(cap, symbol)` picks native code, a GPU kernel or a Python function; `kind="auto"` takes the one the
name designates (a Python function named exactly, by qualified name or its last part, before machine code; a part
of a name is tried on machine code first). `annotate` is the machine-code part: it asks for `kind` when a name is
both a GPU kernel and native code (a CUDA kernel and its host-side launch stub share a mangled name).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiflame.core.errors import BadInput, NothingToShow
from aiflame.core.raw import Capture
from aiflame.symbolize.annotate.result import (
    ADDRESS,
    Annotation,
    BinaryNotFound,
    Instruction,
)

__all__ = [
    "KINDS",
    "Annotation",
    "BinaryNotFound",
    "Instruction",
    "annotate",
    "annotate_any",
]

if TYPE_CHECKING:
    from aiflame.symbolize.annotate.python import PythonAnnotation

KINDS = ("auto", "native", "gpu", "python")


def annotate_any(
    cap: Capture,
    symbol: str,
    *,
    kind: str = "auto",
    dso: str | None = None,
    hot: int = 5,
    debug_dirs: tuple[str, ...] = ("/usr/lib/debug",),
    sass: bool = True,
    source: bool = True,
) -> Annotation | PythonAnnotation:
    """Annotate `symbol` (a function name, a part of it, `dso+0xOFFSET` or `dso+0xSTART-0xEND`) with `cap`'s
    samples; `dso` restricts the search to one binary, `hot` is how many instructions (or Python lines) are
    ranked hottest. With `kind="auto"`, a Python function named exactly comes first, then a GPU kernel or native
    code (`annotate`), then a Python function a part of the name designates.

    Raises, with one line: NothingToShow when nothing matches (the line lists the hottest functions of both
    kinds) or the capture has no such binary, BadInput when the name is ambiguous (it lists the candidates),
    BinaryNotFound (an Unreadable) when the binary is not on this host or is another build of it."""
    from aiflame.symbolize.annotate.python import annotate_python, hottest_python, python_functions, python_matches

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}")
    if kind == "python":
        return annotate_python(cap, symbol, hot=hot, source=source)
    native_only = kind != "auto" or dso is not None or ADDRESS.match(symbol.strip()) is not None
    py = {} if native_only else python_functions(cap)
    if python_matches(py, symbol, exact=True):
        return annotate_python(cap, symbol, hot=hot, source=source, funcs=py)
    try:
        return annotate(cap, symbol, kind=kind, dso=dso, hot=hot, debug_dirs=debug_dirs, sass=sass, source=source)
    except (NothingToShow, BinaryNotFound) as e:
        if not py:
            raise
        if python_matches(py, symbol, exact=False):
            return annotate_python(cap, symbol, hot=hot, source=source, funcs=py)
        total = sum(s.weight for s in cap.samples)
        raise type(e)(f"{e}; no Python function matching either (sampled Python functions: "
                      f"{hottest_python(py, total)})") from None


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
    """Annotate machine code: a native function or a GPU kernel (`kind` "auto", "native" or "gpu"), as
    `annotate_any` does without Python functions. Raises what it raises."""
    # Imported here: capstone and the GPU code readers cost every other command start-up time.
    from aiflame.symbolize.annotate.gpu import annotate_gpu, gpu_matches
    from aiflame.symbolize.annotate.native import annotate_native

    if kind not in ("auto", "native", "gpu"):
        raise ValueError(f"kind must be auto, native or gpu, not {kind!r}")
    if kind == "gpu":
        return annotate_gpu(cap, symbol, hot=hot, sass=sass, source=source)
    native_only = kind == "native" or dso is not None or ADDRESS.match(symbol.strip()) is not None
    gpu = [] if native_only or not cap.stalls else gpu_matches(cap, symbol)
    if not gpu:
        return annotate_native(cap, symbol, dso=dso, hot=hot, debug_dirs=debug_dirs, source=source)
    try:
        found = annotate_native(cap, symbol, hot=hot, debug_dirs=debug_dirs, source=False)
    except BadInput:  # the name is no native function here: the GPU kernel it names
        return annotate_gpu(cap, symbol, hot=hot, sass=sass, source=source)
    raise BadInput(f"{symbol.strip()!r} names a GPU kernel with stall samples and the native function "
                   f"{found.display} ({found.samples} samples); add --kind gpu or --kind native")
