"""`annotate` for Python code: one Python function's source lines with the capture's samples on them.

The capture holds, per sample, the Python frames the BPF walker read (code object and instruction) and the code
objects themselves, so each frame has a function (qualified name, file, first line) and a line. A sample counts
on a line of the function twice over: `total` where the function is anywhere on the stack (its innermost call,
at the line running: the call the time went into), and `self` where it is the innermost Python frame (the line
itself running, or native code it called, such as a builtin). The source text comes from the file on this host.
"""

from __future__ import annotations

import ast
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from aiflame.core.errors import BadInput, NothingToShow
from aiflame.core.python_layouts import layout_for
from aiflame.core.raw import Capture, PyCode, RawSample
from aiflame.symbolize.annotate.result import match_names, read_source, some
from aiflame.symbolize.python.code import line_for
from aiflame.symbolize.python.merge import python_runs

__all__ = ["PyFunction", "PythonAnnotation", "PythonLine", "annotate_python", "python_functions", "python_matches"]

FuncKey = tuple[str, str, int]  # qualname, file, first line


@dataclass
class PyFunction:
    """A Python function of the capture and its samples per line."""

    qualname: str
    file: str
    firstlineno: int
    total: Counter[int] = field(default_factory=Counter)  # line -> samples with the function on the stack
    self_: Counter[int] = field(default_factory=Counter)  # line -> samples with it the innermost Python frame

    @property
    def samples(self) -> int:
        return sum(self.total.values())

    @property
    def self_samples(self) -> int:
        return sum(self.self_.values())

    def where(self) -> str:
        return f"{os.path.basename(self.file)}:{self.firstlineno}"


@dataclass(frozen=True)
class PythonLine:
    """One source line of the function: its samples (total, self), share of the function's total, hot rank."""

    line: int
    text: str | None  # None: the file is not readable here
    total: int = 0
    self_: int = 0
    percent: float = 0.0
    hot: int = 0


@dataclass(frozen=True)
class PythonAnnotation:
    """A Python function, annotated line by line. `samples` have it on the stack, `self_samples` have it
    innermost, `total` is all of the capture's samples."""

    qualname: str
    file: str
    firstlineno: int
    samples: int
    self_samples: int
    total: int
    lines: tuple[PythonLine, ...]
    notes: tuple[str, ...] = ()

    def hottest(self) -> list[PythonLine]:
        return sorted((ln for ln in self.lines if ln.total), key=lambda ln: (-ln.total, ln.line))


def _frames(cap: Capture) -> Iterator[tuple[RawSample, list[tuple[PyCode, int]]]]:
    """Each sample with Python frames, and its frames newest first as (code object record, instruction)."""
    codes: dict[tuple[int, int], list[PyCode]] = {}
    for c in cap.py_codes:
        codes.setdefault((c.pid, c.addr), []).append(c)
    for lst in codes.values():
        lst.sort(key=lambda c: c.time_ns)
    versions: dict[int, tuple[tuple[int, int], int]] = {}
    for r in cap.py_runtimes:
        major, minor = (int(x) for x in r.version.split(".")[:2])
        lay = layout_for((major, minor))
        versions[r.pid] = ((major, minor), lay.owner_cstack if lay else -1)
    for s in cap.samples:
        if not s.py or s.pid not in versions:
            continue
        version, owner = versions[s.pid]
        frames = []
        for run in reversed(python_runs(s.py, version, owner)):  # runs oldest first, each oldest first
            for f in reversed(run):
                cands = codes.get((s.pid, f.code))
                if not cands:
                    continue
                # the record in force at the sample's time (an address can be reused by a later code object)
                code = next((c for c in reversed(cands) if c.time_ns <= s.time_ns), cands[0])
                frames.append((code, f.instr))
        if frames:
            yield s, frames


def python_functions(cap: Capture) -> dict[FuncKey, PyFunction]:
    """Every Python function in the capture's samples, with its samples per line."""
    funcs: dict[FuncKey, PyFunction] = {}
    for s, frames in _frames(cap):
        seen: set[FuncKey] = set()
        for depth, (code, instr) in enumerate(frames):
            info = code.info
            key = (info.qualname, info.filename, info.firstlineno)
            fn = funcs.get(key)
            if fn is None:
                fn = funcs[key] = PyFunction(*key)
            line = line_for(info, instr)
            if depth == 0:
                fn.self_[line] += s.weight
            if key not in seen:  # recursion: the innermost call counts, once
                seen.add(key)
                fn.total[line] += s.weight
    return funcs


def python_matches(funcs: dict[FuncKey, PyFunction], query: str, *, exact: bool) -> list[FuncKey]:
    """The functions `query` names: by qualified name or its last part (`Model.forward`, `forward`); unless
    `exact`, also by a part of the qualified name."""
    q = query.strip()
    hits = [k for k in funcs if q in (k[0], k[0].rsplit(".", 1)[-1], f"{os.path.basename(k[1])}:{k[0]}")]
    if hits or exact:
        return hits
    return match_names(q, {k: (k[0], k[0]) for k in funcs})


def hottest_python(funcs: dict[FuncKey, PyFunction], total: int, n: int = 6) -> str:
    """The Python functions that are most often the innermost Python frame, with that share of the capture's
    `total` samples (`inner 99.6%, outer 0.3%`), as the native list ranks leaf functions."""
    ranked = sorted((f for f in funcs.values() if f.self_samples), key=lambda f: (-f.self_samples, f.qualname))
    return some([f"{f.qualname} {100 * f.self_samples / total:.1f}%" if total else f.qualname for f in ranked], n)


def annotate_python(cap: Capture, query: str, *, hot: int = 5, source: bool = True,
                    funcs: dict[FuncKey, PyFunction] | None = None) -> PythonAnnotation:
    """Annotate the Python function `query` names with `cap`'s samples, line by line."""
    funcs = python_functions(cap) if funcs is None else funcs
    total = sum(s.weight for s in cap.samples)
    hits = python_matches(funcs, query, exact=False)
    if not hits:
        raise NothingToShow(f"no Python function matching {query.strip()!r} (sampled: "
                            f"{hottest_python(funcs, total) or 'none'})")
    if len(hits) > 1:
        hits.sort(key=lambda k: -funcs[k].samples)
        desc = [f"{k[0]} ({funcs[k].where()}, {funcs[k].samples} samples)" for k in hits]
        raise BadInput(f"{query.strip()!r} matches {len(hits)} Python functions: {some(desc)}; give the "
                       "full qualified name, or FILE.py:NAME")
    fn = funcs[hits[0]]
    notes: list[str] = []
    last = _last_line(fn) if source else None
    sampled = set(fn.total) | set(fn.self_)
    if last is None:
        last = max(sampled | {fn.firstlineno})
        if source:
            notes.append(f"{fn.file} is not readable here (or has no function at line {fn.firstlineno}): lines "
                         "without samples past the last sampled one are not shown")
    numbers = sorted(set(range(fn.firstlineno, last + 1)) | sampled)
    text = read_source(((fn.file, n) for n in numbers), strip=False) if source else {}
    ranked = sorted((n for n in numbers if fn.total[n]), key=lambda n: (-fn.total[n], n))[:max(hot, 0)]
    ranks = {n: r for r, n in enumerate(ranked, 1)}
    lines = tuple(PythonLine(n, text.get((fn.file, n)) if text else None, fn.total[n], fn.self_[n],
                             100 * fn.total[n] / fn.samples if fn.samples else 0.0, ranks.get(n, 0))
                  for n in numbers)
    return PythonAnnotation(fn.qualname, fn.file, fn.firstlineno, fn.samples, fn.self_samples, total, lines,
                            tuple(notes))


def _last_line(fn: PyFunction) -> int | None:
    """The function's last source line, from the file on this host: the def (or class, or module) whose code
    object starts at `firstlineno` (a decorated def's code starts at its first decorator)."""
    try:
        with open(fn.file, encoding="utf-8", errors="replace") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    if fn.qualname == "<module>":
        return max((getattr(n, "end_lineno", 0) or 0 for n in tree.body), default=None)
    name = fn.qualname.rsplit(".", 1)[-1]
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if first == fn.firstlineno and node.end_lineno:
                return node.end_lineno
    return None
