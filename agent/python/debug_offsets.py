"""`_Py_DebugOffsets`: the self-description CPython 3.13+ places at the start of `_PyRuntime`.

The struct is an 8-byte cookie (`xdebugpy`), the interpreter's PY_VERSION_HEX, a free-threaded flag, then
groups of uint64 offsets, each group opening with the size of the struct it describes. The struct's own
layout changes between minors (3.14 adds fields mid-group), so only layouts we have checked against a real
build are parsed: 3.13 (584 bytes, read from the DWARF of pyenv's 3.13.0). The bytes come from process memory
or from the ELF's `.PyRuntime` section; anything malformed raises `Unreadable`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from aiflame.core.errors import HostError, Unreadable
from aiflame.core.python_layouts import PyLayout, layout_for

__all__ = [
    "COOKIE",
    "SIZE_313",
    "DebugOffsets",
    "compare_with_table",
    "encode_debug_offsets",
    "layout_from_debug_offsets",
    "parse_debug_offsets",
    "read_header",
]

COOKIE = b"xdebugpy"
_HEADER = struct.Struct("<8sQQ")
HEADER_SIZE = _HEADER.size
_MAX_OFFSET = 1 << 20  # no CPython struct we read is anywhere near a megabyte

# Groups of the 3.13 struct, in order; every group starts with `size`.
_GROUPS_313: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("runtime_state", ("size", "finalizing", "interpreters_head")),
    ("interpreter_state", (
        "size", "id", "next", "threads_head", "gc", "imports_modules", "sysdict", "builtins", "ceval_gil",
        "gil_runtime_state", "gil_runtime_state_enabled", "gil_runtime_state_locked", "gil_runtime_state_holder",
    )),
    ("thread_state", (
        "size", "prev", "next", "interp", "current_frame", "thread_id", "native_thread_id", "datastack_chunk",
        "status",
    )),
    ("interpreter_frame", ("size", "previous", "executable", "instr_ptr", "localsplus", "owner")),
    ("code_object", (
        "size", "filename", "name", "qualname", "linetable", "firstlineno", "argcount", "localsplusnames",
        "localspluskinds", "co_code_adaptive",
    )),
    ("pyobject", ("size", "ob_type")),
    ("type_object", ("size", "tp_name", "tp_repr", "tp_flags")),
    ("tuple_object", ("size", "ob_item", "ob_size")),
    ("list_object", ("size", "ob_item", "ob_size")),
    ("dict_object", ("size", "ma_keys", "ma_values")),
    ("float_object", ("size", "ob_fval")),
    ("long_object", ("size", "lv_tag", "ob_digit")),
    ("bytes_object", ("size", "ob_size", "ob_sval")),
    ("unicode_object", ("size", "state", "length", "asciiobject_size")),
    ("gc", ("size", "collecting")),
)  # fmt: skip
SIZE_313 = HEADER_SIZE + 8 * sum(len(f) for _, f in _GROUPS_313)  # 584

# (group, field, width in bytes) of everything the walker dereferences: offset + width must fit in the group.
_USED: tuple[tuple[str, str, int], ...] = (
    ("runtime_state", "interpreters_head", 8),
    ("interpreter_state", "threads_head", 8),
    ("thread_state", "next", 8),
    ("thread_state", "current_frame", 8),
    ("thread_state", "thread_id", 8),
    ("thread_state", "native_thread_id", 8),
    ("interpreter_frame", "previous", 8),
    ("interpreter_frame", "executable", 8),
    ("interpreter_frame", "instr_ptr", 8),
    ("interpreter_frame", "owner", 1),
    ("code_object", "filename", 8),
    ("code_object", "name", 8),
    ("code_object", "qualname", 8),
    ("code_object", "linetable", 8),
    ("code_object", "firstlineno", 4),
    ("code_object", "co_code_adaptive", 2),
    ("pyobject", "ob_type", 8),
    ("type_object", "tp_name", 8),
    ("bytes_object", "ob_size", 8),
    ("bytes_object", "ob_sval", 1),
    ("unicode_object", "state", 4),
    ("unicode_object", "length", 8),
)


@dataclass(frozen=True, slots=True)
class DebugOffsets:
    """A parsed `_Py_DebugOffsets`: PY_VERSION_HEX, free-threaded flag and offsets by group and field."""

    version_hex: int
    free_threaded: bool
    groups: dict[str, dict[str, int]]

    @property
    def version(self) -> tuple[int, int, int]:
        return (self.version_hex >> 24) & 0xFF, (self.version_hex >> 16) & 0xFF, (self.version_hex >> 8) & 0xFF

    def get(self, group: str, field: str) -> int:
        return self.groups[group][field]


def read_header(data: bytes) -> tuple[int, bool]:
    """(PY_VERSION_HEX, free_threaded) from the first 24 bytes; Unreadable without the cookie."""
    if len(data) < HEADER_SIZE:
        raise Unreadable(f"_Py_DebugOffsets truncated: {len(data)} of {HEADER_SIZE} header bytes")
    cookie, version_hex, free_threaded = _HEADER.unpack_from(data, 0)
    if cookie != COOKIE:
        raise Unreadable(f"_PyRuntime does not start with the {COOKIE.decode()} cookie")
    if (version_hex >> 24) != 3 or free_threaded > 1:
        raise Unreadable(f"_Py_DebugOffsets header is implausible (version {version_hex:#x})")
    return version_hex, bool(free_threaded)


def parse_debug_offsets(data: bytes) -> DebugOffsets:
    """Parse the struct at the start of `data` (at least `SIZE_313` bytes for 3.13).

    Raises `HostError` for another minor or a free-threaded build, `Unreadable` for
    anything malformed (bad cookie, truncation, implausible sizes or offsets).
    """
    version_hex, free_threaded = read_header(data)
    minor = (version_hex >> 16) & 0xFF
    if minor != 13:
        raise HostError(f"no verified _Py_DebugOffsets layout for Python 3.{minor}")
    if free_threaded:
        raise HostError("free-threaded CPython builds are not supported")
    if len(data) < SIZE_313:
        raise Unreadable(f"_Py_DebugOffsets truncated: {len(data)} of {SIZE_313} bytes")
    groups: dict[str, dict[str, int]] = {}
    pos = HEADER_SIZE
    for group, fields in _GROUPS_313:
        values = struct.unpack_from(f"<{len(fields)}Q", data, pos)
        pos += 8 * len(fields)
        groups[group] = dict(zip(fields, values, strict=True))
    for group, size in ((g, v["size"]) for g, v in groups.items()):
        if not 0 < size < _MAX_OFFSET:
            raise Unreadable(f"_Py_DebugOffsets: implausible size {size} of {group}")
    for group, field, width in _USED:
        off, size = groups[group][field], groups[group]["size"]
        if off + width > size:
            raise Unreadable(f"_Py_DebugOffsets: {group}.{field} = {off} lies outside its struct ({size})")
    return DebugOffsets(version_hex, free_threaded, groups)


def encode_debug_offsets(dbg: DebugOffsets) -> bytes:
    """The bytes `parse_debug_offsets` reads back as `dbg` (3.13 layout); for tests and fixtures."""
    out = bytearray(_HEADER.pack(COOKIE, dbg.version_hex, int(dbg.free_threaded)))
    for group, fields in _GROUPS_313:
        out += struct.pack(f"<{len(fields)}Q", *(dbg.groups.get(group, {}).get(f, 0) for f in fields))
    return bytes(out)


def layout_from_debug_offsets(dbg: DebugOffsets) -> PyLayout:
    """A PyLayout from the debug offsets; what they lack (compact unicode size, owner values, state bits)
    comes from the table of the same minor. HostError when there is no such table entry."""
    major, minor, _ = dbg.version
    base = layout_for((major, minor))
    if base is None:
        raise HostError(f"no verified layout for Python {major}.{minor}")
    g = dbg.get
    return PyLayout(
        version=(major, minor),
        runtime_interp_head=g("runtime_state", "interpreters_head"),
        interp_tstate_head=g("interpreter_state", "threads_head"),
        tstate_next=g("thread_state", "next"),
        tstate_thread_id=g("thread_state", "thread_id"),
        tstate_native_thread_id=g("thread_state", "native_thread_id"),
        tstate_frame=g("thread_state", "current_frame"),
        cframe_current_frame=-1,
        frame_code=g("interpreter_frame", "executable"),
        frame_back=g("interpreter_frame", "previous"),
        frame_instr=g("interpreter_frame", "instr_ptr"),
        frame_owner=g("interpreter_frame", "owner"),
        frame_is_entry=-1,
        code_filename=g("code_object", "filename"),
        code_name=g("code_object", "name"),
        code_qualname=g("code_object", "qualname"),
        code_firstlineno=g("code_object", "firstlineno"),
        code_linetable=g("code_object", "linetable"),
        code_code_adaptive=g("code_object", "co_code_adaptive"),
        code_code=-1,
        unicode_ascii_size=g("unicode_object", "asciiobject_size"),
        unicode_compact_size=base.unicode_compact_size,
        owner_cstack=base.owner_cstack,
        source="debug_offsets",
        unicode_length=g("unicode_object", "length"),
        unicode_state=g("unicode_object", "state"),
        unicode_kind_shift=base.unicode_kind_shift,
        unicode_compact_shift=base.unicode_compact_shift,
        unicode_ascii_shift=base.unicode_ascii_shift,
        unicode_data_any=base.unicode_data_any,
        object_type=g("pyobject", "ob_type"),
        var_size=g("bytes_object", "ob_size"),
        type_name=g("type_object", "tp_name"),
        bytes_sval=g("bytes_object", "ob_sval"),
    )


def compare_with_table(layout: PyLayout) -> list[str]:
    """Fields where `layout` (from debug offsets) disagrees with the table of its minor, one line each."""
    base = layout_for(layout.version)
    if base is None:
        return [f"no table entry for Python {layout.version[0]}.{layout.version[1]}"]
    return [f"{d} (debug offsets != table)" for d in layout.differences(base)]
