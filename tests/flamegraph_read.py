"""Folded stacks read the way Brendan Gregg's flamegraph.pl reads them, the tests' oracle for folded files.

flamegraph.pl's input loop (decoded as UTF-8 by its `use open qw(:std :utf8)`): each line, without its "\\n", is
matched by `^(.*)\\s+?(\\d+(?:\\.\\d*)?)$`; a line that does not match is ignored ("Ignored N lines with invalid
format"); a stack that itself ends in whitespace and a number is taken for a differential file's first column; the
frames are `split ";", $stack`, which drops trailing empty fields. flamegraph.pl is not on these machines (no
registry ships it), so its rules are written out here, with Perl's `\\s`, never aiflame's own parse_folded. A line
flamegraph.pl would ignore, or read as differential, fails: aiflame writes neither."""

from __future__ import annotations

import re
from collections import Counter

__all__ = ["READ_AS_DIFFERENTIAL", "FlamegraphReadError", "read_folded_text"]

# Perl's \s on a character string: not Python's, which also takes \x1c-\x1f.
_PERL_SPACE = "[\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
_LINE = re.compile(rf"^(.*){_PERL_SPACE}+?(\d+(?:\.\d*)?)$")
# A stack text flamegraph.pl would take for a differential line's stack and first column.
READ_AS_DIFFERENTIAL = re.compile(rf"{_PERL_SPACE}\d+(?:\.\d*)?$")


class FlamegraphReadError(AssertionError):
    """A line flamegraph.pl would not read as aiflame meant it."""


def _perl_split(stack: str) -> tuple[str, ...]:
    """`split ";", $stack`: Perl drops the trailing empty fields (and gives nothing for an empty string)."""
    parts = stack.split(";")
    while parts and parts[-1] == "":
        parts.pop()
    return tuple(parts)


def read_folded_text(text: str) -> Counter[tuple[str, ...]]:
    """The weight of each stack (root first) as flamegraph.pl merges them."""
    out: Counter[tuple[str, ...]] = Counter()
    for number, line in enumerate(text.split("\n"), start=1):
        if line == "" and number == text.count("\n") + 1:
            break  # what follows the last newline
        m = _LINE.match(line)
        if m is None:
            raise FlamegraphReadError(f"line {number}: flamegraph.pl ignores it: {line!r}")
        stack, samples = m.groups()
        if _LINE.match(stack):
            raise FlamegraphReadError(f"line {number}: flamegraph.pl reads a differential column: {line!r}")
        out[_perl_split(stack)] += int(float(samples)) if "." in samples else int(samples)
    return out
