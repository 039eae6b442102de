"""What `aiflame annotate` shows, as data: one function's instructions, each with its samples, its source line and
its share of the function, the hottest ranked. Built by annotate/native.py (x86-64 code of a host binary) and
annotate/gpu.py (SASS of a GPU kernel, with stall reasons); rendered by the command.

Also the name matching both share, and the errors a user meets (each a BadInput with a one-line message).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.demangle import short_name

__all__ = [
    "ADDRESS",
    "Annotation",
    "BinaryNotFound",
    "Instruction",
    "match_names",
    "rank",
    "read_source",
    "some",
]

K = TypeVar("K")

_SOURCE_BYTES = 4 << 20  # source files larger than this are not read for their text

# Code named by where it is rather than by a symbol: `dso+0xOFFSET` or `dso+0xSTART-0xEND` (file offsets).
ADDRESS = re.compile(r"^(?P<dso>.+?)\+(?P<start>0x[0-9a-fA-F]+)(?:-(?P<end>0x[0-9a-fA-F]+))?$")


class BinaryNotFound(Unreadable):
    """The binary the capture names is not on this host, or is another build of it. `why` says which, briefly."""

    def __init__(self, message: str, why: str = "") -> None:
        super().__init__(message)
        self.why = why or message


@dataclass(frozen=True, slots=True)
class Instruction:
    """One instruction of the annotated function.

    `address` is the link-time address (native code) or the byte offset in the kernel (GPU); `text` is None when
    it could not be disassembled (SASS without nvdisasm). `hot` ranks the sampled instructions: 1 the hottest,
    0 not among the marked. `reasons` (GPU) are (stall reason, samples), most first.
    """

    address: int
    size: int
    text: str | None
    file: str = ""
    line: int = 0
    samples: int = 0
    percent: float = 0.0
    hot: int = 0
    reasons: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Annotation:
    """One function, annotated. `kind` is "native" or "gpu".

    `name` is the symbol as stored (mangled), `display` its demangled text; `binary` the host path of the binary
    (native) or the cubin's label (GPU); `start`/`size` the function's link-time range (GPU: 0 and its size).
    `samples` are those of the function (leaf samples for native code; stall samples for a kernel), `total` all
    of the capture's samples of that unit. `source` holds the text of the source lines shown, where the file is
    readable on this host; `reasons` (GPU) the kernel's stall reasons; `notes` what the reader should know (a
    missing disassembler, samples left out, a window shown instead of a whole function).
    """

    kind: str
    name: str
    display: str
    binary: str
    build_id: str
    arch: str
    start: int
    size: int
    unit: str
    samples: int
    total: int
    instructions: tuple[Instruction, ...]
    source: dict[tuple[str, int], str] = field(default_factory=dict)
    reasons: tuple[tuple[str, int], ...] = ()
    notes: tuple[str, ...] = ()

    def hottest(self) -> list[Instruction]:
        """The instructions that have samples, most first (lower address first among equals)."""
        return sorted((i for i in self.instructions if i.samples), key=lambda i: (-i.samples, i.address))

    def hot_count(self) -> int:
        """How many instructions are ranked hottest."""
        return sum(1 for i in self.instructions if i.hot)

    def lines(self) -> list[tuple[str, int, int]]:
        """(file, line, samples) of the source lines that have samples, most first."""
        by_line: dict[tuple[str, int], int] = {}
        for i in self.instructions:
            if i.samples and i.file:
                by_line[(i.file, i.line)] = by_line.get((i.file, i.line), 0) + i.samples
        return [(f, ln, n) for (f, ln), n in sorted(by_line.items(), key=lambda kv: (-kv[1], kv[0]))]


def rank(rows: Iterable[Instruction], hot: int) -> tuple[Instruction, ...]:
    """`rows` (samples set, in address order) with each one's percent of their total and the `hot` most sampled
    ranked 1..hot. Percentages of a function with samples sum to 100."""
    rows = list(rows)
    total = sum(r.samples for r in rows)
    order = sorted((r for r in rows if r.samples), key=lambda r: (-r.samples, r.address))
    ranks = {r.address: n for n, r in enumerate(order[: max(hot, 0)], 1)}
    out = []
    for r in rows:
        pct = 100.0 * r.samples / total if total else 0.0
        out.append(Instruction(r.address, r.size, r.text, r.file, r.line, r.samples, pct, ranks.get(r.address, 0),
                               r.reasons))
    return tuple(out)


def match_names(query: str, names: Mapping[K, tuple[str, str]]) -> list[K]:
    """The keys of `names` (key -> (name as stored, demangled)) that `query` designates, tried in turn: the stored
    name, the demangled text, the short demangled name (`ns::f<int>`), then a substring of either. The first way
    that matches anything decides; the caller reports none or several."""
    q = query.strip()
    if not q:
        return []
    shorts = {k: short_name(d) if d != raw else raw for k, (raw, d) in names.items()}
    for form in ({k: raw for k, (raw, _d) in names.items()}, {k: d for k, (_r, d) in names.items()}, shorts):
        hits = [k for k, text in form.items() if text == q]
        if hits:
            return hits
    return [k for k, (raw, d) in names.items() if q in raw or q in d]


def some(items: list[str], n: int = 8) -> str:
    """The first `n` items, comma-separated, and how many more there are."""
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def read_source(keys: Iterable[tuple[str, int]], *, strip: bool = True) -> dict[tuple[str, int], str]:
    """The text (stripped, or only its line end unless `strip`) of each (file, line) whose file is readable here;
    others are left out."""
    files: dict[str, list[str] | None] = {}
    out: dict[tuple[str, int], str] = {}
    for file, line in keys:
        if not file or line <= 0:
            continue
        if file not in files:
            files[file] = _lines_of(file)
        text = files[file]
        if text is not None and line <= len(text):
            out[(file, line)] = text[line - 1].strip() if strip else text[line - 1].rstrip()
    return out


def _lines_of(path: str) -> list[str] | None:
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > _SOURCE_BYTES:
            return None
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return None
