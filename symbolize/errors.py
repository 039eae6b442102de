"""The one exception type the symbolizer lets escape."""

from __future__ import annotations

from aiflame.core.errors import BadInput


class SymbolizeError(BadInput):
    """A binary or debug file could not be read; the message is one user-facing line.

    Example: ``SymbolizeError("libfoo.so: not an ELF file")``.
    """
