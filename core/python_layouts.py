"""CPython struct layouts, as data: the offsets an out-of-process stack walker needs, per minor version.

The table lives in python_layouts.json, generated from the DWARF of real builds by scripts/gen_python_layouts.py
(x86-64, glibc, default non-free-threaded builds). A version absent from the table has no verified layout:
`layout_for` returns None and callers must refuse to walk rather than guess. On 3.13+ the interpreter also
describes itself through `_Py_DebugOffsets` (debug_offsets.py), which detection prefers when present.

Offsets are in bytes; -1 means "no such field in this version".
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiflame.core.errors import Unreadable

__all__ = ["PyLayout", "known_versions", "layout_for", "layout_from_json"]

_DATA = Path(__file__).with_name("python_layouts.json")


@dataclass(frozen=True, slots=True)
class PyLayout:
    """Offsets into CPython's runtime, thread, frame, code and string structs for one minor version."""

    version: tuple[int, int]
    runtime_interp_head: int  # _PyRuntime -> interpreters.head
    interp_tstate_head: int  # PyInterpreterState -> threads.head (3.10: tstate_head)
    tstate_next: int
    tstate_thread_id: int  # pthread_t (pthread_self())
    tstate_native_thread_id: int  # kernel tid; -1 on 3.10
    tstate_frame: int  # 3.10: frame; 3.11/3.12: cframe; 3.13: current_frame
    cframe_current_frame: int  # 3.11/3.12: _PyCFrame.current_frame; -1 otherwise
    frame_code: int  # 3.10-3.12 f_code, 3.13 f_executable
    frame_back: int  # 3.10 f_back, 3.11+ previous
    frame_instr: int  # 3.10 f_lasti (int, code units); 3.11/3.12 prev_instr; 3.13 instr_ptr (pointers)
    frame_owner: int  # char; -1 on 3.10
    frame_is_entry: int  # char, 3.11 only; -1 otherwise
    code_filename: int
    code_name: int
    code_qualname: int  # -1 on 3.10
    code_firstlineno: int
    code_linetable: int  # co_linetable (a bytes object): 3.10 line table, 3.11+ location table
    code_code_adaptive: int  # inline bytecode (3.11+); -1 on 3.10
    code_code: int  # 3.10 co_code (a bytes object); -1 otherwise
    unicode_ascii_size: int  # sizeof(PyASCIIObject): where compact ASCII data starts
    unicode_compact_size: int  # sizeof(PyCompactUnicodeObject): where other compact data starts
    owner_cstack: int  # frame owner value of a C-stack shim frame (3.12/3.13); -1 when n/a
    source: str  # "dwarf:<path>" or "debug_offsets"
    # Generic object layout, stable across 3.10-3.13 but kept as data like the rest.
    unicode_length: int = 16
    unicode_state: int = 32
    unicode_kind_shift: int = 2
    unicode_compact_shift: int = 5
    unicode_ascii_shift: int = 6
    unicode_data_any: int = -1  # PyUnicodeObject.data.any (legacy, non-compact strings)
    object_type: int = 8
    var_size: int = 16
    type_name: int = 24
    bytes_sval: int = 32

    @property
    def has_cframe(self) -> bool:
        """3.11/3.12: tstate_frame points at a _PyCFrame, one more hop to the current frame."""
        return self.cframe_current_frame >= 0

    def differences(self, other: PyLayout) -> list[str]:
        """`field: mine != theirs` for every offset that differs (version and source are not compared)."""
        out = []
        for f in dataclasses.fields(self):
            if f.name in ("version", "source"):
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                out.append(f"{f.name}: {a} != {b}")
        return out


_INT_FIELDS = tuple(f.name for f in dataclasses.fields(PyLayout) if f.name not in ("version", "source"))


def layout_from_json(obj: Any) -> PyLayout:
    """A PyLayout from one entry of layouts_data.json; Unreadable when it is malformed."""
    if not isinstance(obj, dict):
        raise Unreadable("layout entry is not an object")
    version = obj.get("version")
    if (
        not isinstance(version, list)
        or len(version) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in version)
    ):
        raise Unreadable(f"layout entry has a bad version: {version!r}")
    source = obj.get("source", "")
    if not isinstance(source, str):
        raise Unreadable("layout entry has a bad source")
    kwargs: dict[str, int] = {}
    for name in _INT_FIELDS:
        if name not in obj:
            continue  # defaulted fields may be absent
        v = obj[name]
        if not isinstance(v, int) or isinstance(v, bool) or v < -1 or v > 1 << 20:
            raise Unreadable(f"layout {version[0]}.{version[1]}: bad {name}: {v!r}")
        kwargs[name] = v
    try:
        return PyLayout(version=(version[0], version[1]), source=source, **kwargs)
    except TypeError as e:
        raise Unreadable(f"layout {version[0]}.{version[1]}: {e}") from None


@functools.cache
def _table() -> dict[tuple[int, int], PyLayout]:
    try:
        raw = json.loads(_DATA.read_text())
    except (OSError, ValueError) as e:
        raise Unreadable(f"{_DATA}: {e}") from None
    if not isinstance(raw, dict):
        raise Unreadable(f"{_DATA}: not a JSON object")
    out = {}
    for entry in raw.values():
        lay = layout_from_json(entry)
        out[lay.version] = lay
    return out


def layout_for(version: tuple[int, int]) -> PyLayout | None:
    """The verified layout of CPython `version` (major, minor); None when we have none (3.14, older, unknown).

    Free-threaded builds are never covered: callers detect them (e.g. via `_Py_DebugOffsets`) and refuse.
    """
    return _table().get((version[0], version[1]))


def known_versions() -> list[tuple[int, int]]:
    """The minor versions the table covers, oldest first."""
    return sorted(_table())
