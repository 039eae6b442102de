#!/usr/bin/env python3
"""Regenerate core/python_layouts.json from the DWARF of the CPython shared libraries on this machine.

Usage: gen_python_layouts.py [--out FILE] [LIBPYTHON ...]

Without arguments it reads every pyenv `libpython3.X.so.1.0` under /root/.pyenv/versions (or $PYENV_ROOT)
for the minors we support (3.10 to 3.13). Each library must carry DWARF (pyenv builds with -g). The JSON maps
"3.X" to the PyLayout fields; the checked-in file must be exactly what this script writes, which a unit test
re-checks for the versions present on the machine. Output is deterministic: sorted keys, one trailing newline.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from elftools.dwarf.die import DIE
from elftools.elf.elffile import ELFFile

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "core" / "python_layouts.json"
SUPPORTED = ((3, 10), (3, 11), (3, 12), (3, 13))

# Struct tags and typedef names we need; typedefs of anonymous structs (PyASCIIObject) are found by name.
WANTED = {
    "pyruntimestate", "_is", "_ts", "_frame", "_PyInterpreterFrame", "_PyCFrame", "PyCodeObject",
    "PyASCIIObject", "PyCompactUnicodeObject", "_object", "PyVarObject", "_typeobject", "PyBytesObject",
}  # fmt: skip
WANTED_ENUMERATORS = {"FRAME_OWNED_BY_CSTACK"}
_SKIP_TAGS = {"DW_TAG_typedef", "DW_TAG_const_type", "DW_TAG_volatile_type", "DW_TAG_atomic_type"}


class LayoutGenError(Exception):
    """The DWARF lacks something we need; the message names it."""


def _name(die: DIE) -> str | None:
    a = die.attributes.get("DW_AT_name")
    return a.value.decode() if a is not None else None


def _strip(die: DIE) -> DIE:
    """Follow typedefs and qualifiers to the underlying type."""
    for _ in range(16):
        if die.tag not in _SKIP_TAGS or "DW_AT_type" not in die.attributes:
            return die
        die = die.get_DIE_from_attribute("DW_AT_type")
    return die


def _members(struct: DIE) -> Iterator[DIE]:
    for c in struct.iter_children():
        if c.tag == "DW_TAG_member":
            yield c


def _member_offset(m: DIE) -> int:
    loc = m.attributes.get("DW_AT_data_member_location")
    if loc is None:
        return 0  # union members
    if not isinstance(loc.value, int):
        raise LayoutGenError(f"member {_name(m)}: non-constant location")
    return loc.value


def _find_member(struct: DIE, name: str) -> tuple[int, DIE] | None:
    """(offset, member DIE) of `name`, looking through anonymous struct/union members."""
    for m in _members(struct):
        mname = _name(m)
        if mname == name:
            return _member_offset(m), m
        if mname is None:
            inner = _strip(m.get_DIE_from_attribute("DW_AT_type"))
            found = _find_member(inner, name)
            if found is not None:
                return _member_offset(m) + found[0], found[1]
    return None


class Types:
    """The struct definitions and enumerators we want, from one pass over a library's compile units."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.structs: dict[str, DIE] = {}
        self.enumerators: dict[str, int] = {}
        # pyelftools parses lazily: the file stays open until close().
        self._file = open(path, "rb")
        elf = ELFFile(self._file)
        if not elf.has_dwarf_info():
            self.close()
            raise LayoutGenError(f"{path}: no DWARF")
        for cu in elf.get_dwarf_info().iter_CUs():
            self._scan(cu.get_top_DIE())
            if WANTED <= self.structs.keys() and WANTED_ENUMERATORS <= self.enumerators.keys():
                break

    def close(self) -> None:
        self._file.close()

    def _scan(self, top: DIE) -> None:
        for die in top.iter_children():
            if die.tag == "DW_TAG_enumeration_type":
                for e in die.iter_children():
                    n = _name(e)
                    if n in WANTED_ENUMERATORS and n not in self.enumerators:
                        self.enumerators[n] = int(e.attributes["DW_AT_const_value"].value)
                continue
            name = _name(die)
            if name not in WANTED or name in self.structs:
                continue
            target = _strip(die) if die.tag == "DW_TAG_typedef" else die
            if target.tag != "DW_TAG_structure_type" or "DW_AT_declaration" in target.attributes:
                continue
            if "DW_AT_byte_size" not in target.attributes:
                continue
            self.structs[name] = target


class Extractor:
    """Looks up `struct.member.member` paths in one library's types; records what it read."""

    def __init__(self, types: Types) -> None:
        self.t = types

    def struct(self, name: str) -> DIE:
        s = self.t.structs.get(name)
        if s is None:
            raise LayoutGenError(f"{self.t.path}: struct {name} not found")
        return s

    def has(self, name: str) -> bool:
        return name in self.t.structs

    def size(self, name: str) -> int:
        return int(self.struct(name).attributes["DW_AT_byte_size"].value)

    def offset(self, struct: str, path: str, required: bool = True) -> int:
        die = self.struct(struct)
        total = 0
        parts = path.split(".")
        for i, part in enumerate(parts):
            found = _find_member(die, part)
            if found is None:
                if required:
                    raise LayoutGenError(f"{self.t.path}: {struct}.{path} not found")
                return -1
            total += found[0]
            if i + 1 < len(parts):
                die = _strip(found[1].get_DIE_from_attribute("DW_AT_type"))
        return total

    def first(self, struct: str, *paths: str) -> int:
        for p in paths:
            off = self.offset(struct, p, required=False)
            if off >= 0:
                return off
        raise LayoutGenError(f"{self.t.path}: none of {struct}.{'/'.join(paths)} found")

    def bit_position(self, struct: str, state: str, bit: str) -> int:
        """Bit index (from the least significant bit of the state word) of bitfield `state.bit`."""
        found = _find_member(self.struct(struct), state)
        if found is None:
            raise LayoutGenError(f"{self.t.path}: {struct}.{state} not found")
        inner = _strip(found[1].get_DIE_from_attribute("DW_AT_type"))
        m = _find_member(inner, bit)
        if m is None:
            raise LayoutGenError(f"{self.t.path}: {struct}.{state}.{bit} not found")
        attrs = m[1].attributes
        if "DW_AT_data_bit_offset" in attrs:
            return int(attrs["DW_AT_data_bit_offset"].value) - 8 * m[0]
        # DWARF 2/3: DW_AT_bit_offset counts from the most significant bit of the storage unit.
        storage = int(attrs["DW_AT_byte_size"].value) * 8
        return storage - int(attrs["DW_AT_bit_offset"].value) - int(attrs["DW_AT_bit_size"].value)


def layout_from_dwarf(path: str, version: tuple[int, int]) -> dict[str, Any]:
    """The PyLayout fields (as a JSON object) of the libpython at `path`, which is CPython `version`."""
    types = Types(path)
    try:
        return _extract(Extractor(types), path, version)
    finally:
        types.close()


def _extract(x: Extractor, path: str, version: tuple[int, int]) -> dict[str, Any]:
    v311 = version >= (3, 11)
    out: dict[str, Any] = {"version": list(version)}
    out["runtime_interp_head"] = x.offset("pyruntimestate", "interpreters.head")
    out["interp_tstate_head"] = x.first("_is", "threads.head", "tstate_head")
    out["tstate_next"] = x.offset("_ts", "next")
    out["tstate_thread_id"] = x.offset("_ts", "thread_id")
    out["tstate_native_thread_id"] = x.offset("_ts", "native_thread_id", required=False)
    if version == (3, 10):
        out["tstate_frame"] = x.offset("_ts", "frame")
        out["cframe_current_frame"] = -1
        frame = "_frame"
        out["frame_code"] = x.offset(frame, "f_code")
        out["frame_back"] = x.offset(frame, "f_back")
        out["frame_instr"] = x.offset(frame, "f_lasti")
    else:
        frame = "_PyInterpreterFrame"
        if x.offset("_ts", "cframe", required=False) >= 0:
            out["tstate_frame"] = x.offset("_ts", "cframe")
            out["cframe_current_frame"] = x.offset("_PyCFrame", "current_frame")
        else:
            out["tstate_frame"] = x.offset("_ts", "current_frame")
            out["cframe_current_frame"] = -1
        out["frame_code"] = x.first(frame, "f_code", "f_executable")
        out["frame_back"] = x.offset(frame, "previous")
        out["frame_instr"] = x.first(frame, "prev_instr", "instr_ptr")
    out["frame_owner"] = x.offset(frame, "owner", required=False)
    out["frame_is_entry"] = x.offset(frame, "is_entry", required=False)
    out["code_filename"] = x.offset("PyCodeObject", "co_filename")
    out["code_name"] = x.offset("PyCodeObject", "co_name")
    out["code_qualname"] = x.offset("PyCodeObject", "co_qualname", required=False)
    out["code_firstlineno"] = x.offset("PyCodeObject", "co_firstlineno")
    out["code_linetable"] = x.offset("PyCodeObject", "co_linetable")
    out["code_code_adaptive"] = x.offset("PyCodeObject", "co_code_adaptive", required=False)
    out["code_code"] = -1 if v311 else x.offset("PyCodeObject", "co_code")
    out["unicode_ascii_size"] = x.size("PyASCIIObject")
    out["unicode_compact_size"] = x.size("PyCompactUnicodeObject")
    out["unicode_length"] = x.offset("PyASCIIObject", "length")
    out["unicode_state"] = x.offset("PyASCIIObject", "state")
    out["unicode_kind_shift"] = x.bit_position("PyASCIIObject", "state", "kind")
    out["unicode_compact_shift"] = x.bit_position("PyASCIIObject", "state", "compact")
    out["unicode_ascii_shift"] = x.bit_position("PyASCIIObject", "state", "ascii")
    out["unicode_data_any"] = out["unicode_compact_size"]  # PyUnicodeObject.data follows the compact header
    out["object_type"] = x.offset("_object", "ob_type")
    out["var_size"] = x.offset("PyVarObject", "ob_size")
    out["type_name"] = x.offset("_typeobject", "tp_name")
    out["bytes_sval"] = x.offset("PyBytesObject", "ob_sval")
    out["owner_cstack"] = x.t.enumerators.get("FRAME_OWNED_BY_CSTACK", -1)
    out["source"] = "dwarf:" + path
    return out


def _version_of(path: str) -> tuple[int, int]:
    m = re.search(r"libpython(\d+)\.(\d+)(t?)\.so", os.path.basename(path))
    if m is None or m.group(3):
        raise LayoutGenError(f"{path}: cannot tell the Python version from the file name")
    return int(m.group(1)), int(m.group(2))


def default_libraries() -> list[str]:
    """The newest pyenv libpython of each supported minor found on this machine."""
    root = os.environ.get("PYENV_ROOT", "/root/.pyenv")
    found: dict[tuple[int, int], str] = {}
    for p in sorted(glob.glob(os.path.join(root, "versions", "3.*", "lib", "libpython3.*.so.1.0"))):
        m = re.search(r"libpython3\.(\d+)(t?)\.so", os.path.basename(p))
        if m is None or m.group(2):
            continue  # free-threaded builds (libpython3.13t) are not supported
        v = (3, int(m.group(1)))
        if v in SUPPORTED:
            found[v] = p  # sorted glob: the last one wins (lexical order, good enough for one patch each)
    return [found[v] for v in sorted(found)]


def generate(libraries: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for lib in libraries:
        v = _version_of(lib)
        out[f"{v[0]}.{v[1]}"] = layout_from_dwarf(lib, v)
    return out


def render(data: dict[str, dict[str, Any]]) -> str:
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON file to write (default: %(default)s)")
    ap.add_argument("--quiet", action="store_true", help="don't print the table")
    ap.add_argument("libraries", nargs="*", help="libpython3.X.so files with DWARF (default: pyenv's)")
    args = ap.parse_args(argv)
    libs = args.libraries or default_libraries()
    if not libs:
        print("no libpython with DWARF found", file=sys.stderr)
        return 1
    try:
        data = generate(libs)
    except LayoutGenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        fields = [k for k in next(iter(data.values())) if k not in ("version", "source")]
        print(f"{'field':28}" + "".join(f"{v:>8}" for v in data))
        for k in fields:
            print(f"{k:28}" + "".join(f"{data[v][k]:>8}" for v in data))
        for v, d in data.items():
            print(f"{v}: {d['source']}")
    Path(args.out).write_text(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
