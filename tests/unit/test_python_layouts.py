"""The CPython layout table, its generator, and the `_Py_DebugOffsets` parser."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiflame.agent.python.debug_offsets import (
    SIZE_313,
    DebugOffsets,
    compare_with_table,
    encode_debug_offsets,
    layout_from_debug_offsets,
    parse_debug_offsets,
)
from aiflame.core.errors import HostError, Unreadable
from aiflame.core.python_layouts import known_versions, layout_for, layout_from_json
from aiflame.symbolize.objfmt.elf import ElfFile
from tests.conftest import REPO

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DATA = REPO / "core" / "python_layouts.json"
GENERATOR = REPO / "scripts" / "gen_python_layouts.py"
LIB313 = Path("/root/.pyenv/versions/3.13.0/lib/libpython3.13.so.1.0")

# The fact-sheet table (docs from CPython headers and DWARF), as an independent check of the generated JSON.
FACTS = {
    (3, 10): dict(runtime_interp_head=32, interp_tstate_head=8, tstate_next=8, tstate_thread_id=176,
                  tstate_native_thread_id=-1, tstate_frame=24, cframe_current_frame=-1, frame_code=32,
                  frame_back=24, frame_instr=96, frame_owner=-1, frame_is_entry=-1, code_filename=104,
                  code_name=112, code_qualname=-1, code_firstlineno=40, code_code_adaptive=-1,
                  unicode_ascii_size=48, unicode_compact_size=72),
    (3, 11): dict(runtime_interp_head=40, interp_tstate_head=16, tstate_next=8, tstate_thread_id=152,
                  tstate_native_thread_id=160, tstate_frame=56, cframe_current_frame=8, frame_code=32,
                  frame_back=48, frame_instr=56, frame_owner=69, frame_is_entry=68, code_filename=112,
                  code_name=120, code_qualname=128, code_firstlineno=72, code_code_adaptive=184,
                  unicode_ascii_size=48, unicode_compact_size=72),
    (3, 12): dict(runtime_interp_head=40, interp_tstate_head=72, tstate_next=8, tstate_thread_id=136,
                  tstate_native_thread_id=144, tstate_frame=56, cframe_current_frame=0, frame_code=0,
                  frame_back=8, frame_instr=56, frame_owner=70, frame_is_entry=-1, code_filename=112,
                  code_name=120, code_qualname=128, code_firstlineno=68, code_code_adaptive=192,
                  unicode_ascii_size=40, unicode_compact_size=56, owner_cstack=3),
    (3, 13): dict(runtime_interp_head=632, interp_tstate_head=7344, tstate_next=8, tstate_thread_id=152,
                  tstate_native_thread_id=160, tstate_frame=72, cframe_current_frame=-1, frame_code=0,
                  frame_back=8, frame_instr=56, frame_owner=70, frame_is_entry=-1, code_filename=112,
                  code_name=120, code_qualname=128, code_firstlineno=68, code_code_adaptive=200,
                  unicode_ascii_size=40, unicode_compact_size=56, owner_cstack=3),
}  # fmt: skip


@pytest.mark.parametrize("version", sorted(FACTS))
def test_table_matches_fact_sheet(version: tuple[int, int]) -> None:
    # Oracle: the fact sheet (FACTS), written by hand from CPython's headers and DWARF
    lay = layout_for(version)
    assert lay is not None and lay.version == version
    for name, want in FACTS[version].items():
        assert getattr(lay, name) == want, name


def test_unverified_versions_have_no_layout() -> None:
    assert known_versions() == [(3, 10), (3, 11), (3, 12), (3, 13)]
    for v in ((3, 9), (3, 14), (2, 7), (4, 0)):
        assert layout_for(v) is None


def test_generator_reproduces_checked_in_json(tmp_path: Path) -> None:
    """The JSON must be exactly what the generator writes from the DWARF of the builds on this machine."""
    out = tmp_path / "layouts.json"
    proc = subprocess.run([sys.executable, str(GENERATOR), "--quiet", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "no libpython" in proc.stderr:
        pytest.skip("no pyenv CPython with DWARF on this machine")
    assert proc.returncode == 0, proc.stderr
    generated = json.loads(out.read_text())
    checked_in = json.loads(DATA.read_text())
    assert generated, "generator found no libraries"
    for version, entry in generated.items():
        assert checked_in.get(version) == entry, f"python_layouts.json is stale for {version}: rerun {GENERATOR.name}"
    if set(generated) == set(checked_in):
        assert out.read_text() == DATA.read_text()


def test_layout_from_json_rejects_malformed() -> None:
    good = json.loads(DATA.read_text())["3.12"]
    assert layout_from_json(good) == layout_for((3, 12))
    bad_entries = [
        [], {**good, "version": [3]}, {**good, "version": ["3", "12"]}, {**good, "tstate_next": "8"},
        {**good, "tstate_next": -5}, {**good, "tstate_next": True}, {**good, "source": 3},
        {k: v for k, v in good.items() if k != "frame_code"},
    ]
    for bad in bad_entries:
        with pytest.raises(Unreadable):
            layout_from_json(bad)


# --- _Py_DebugOffsets ---------------------------------------------------------------------------------------


def _section_bytes() -> bytes | None:
    if not LIB313.exists():
        return None
    with ElfFile.open(LIB313) as elf:
        sec = elf.section(".PyRuntime")
        assert sec is not None
        return elf.read_section(sec)[:SIZE_313]


def _synthetic_313() -> bytes:
    """Debug offsets built from the 3.13 table, for machines without a 3.13 build."""
    lay = layout_for((3, 13))
    assert lay is not None
    big = {"size": 1 << 14}
    groups = {
        "runtime_state": {**big, "interpreters_head": lay.runtime_interp_head},
        "interpreter_state": {**big, "threads_head": lay.interp_tstate_head},
        "thread_state": {**big, "next": lay.tstate_next, "current_frame": lay.tstate_frame,
                         "thread_id": lay.tstate_thread_id, "native_thread_id": lay.tstate_native_thread_id},
        "interpreter_frame": {**big, "previous": lay.frame_back, "executable": lay.frame_code,
                              "instr_ptr": lay.frame_instr, "owner": lay.frame_owner},
        "code_object": {**big, "filename": lay.code_filename, "name": lay.code_name, "qualname": lay.code_qualname,
                        "linetable": lay.code_linetable, "firstlineno": lay.code_firstlineno,
                        "co_code_adaptive": lay.code_code_adaptive},
        "pyobject": {**big, "ob_type": lay.object_type},
        "type_object": {**big, "tp_name": lay.type_name},
        "bytes_object": {**big, "ob_size": lay.var_size, "ob_sval": lay.bytes_sval},
        "unicode_object": {**big, "state": lay.unicode_state, "length": lay.unicode_length,
                           "asciiobject_size": lay.unicode_ascii_size},
    }  # fmt: skip
    for name in ("tuple_object", "list_object", "dict_object", "float_object", "long_object", "gc"):
        groups[name] = dict(big)
    return encode_debug_offsets(DebugOffsets(0x030D00F0, False, groups))


VALID = _section_bytes() or _synthetic_313()


def test_debug_offsets_agree_with_table() -> None:
    # Oracle: CPython 3.13's own _Py_DebugOffsets (.PyRuntime of libpython3.13; without that build: none)
    dbg = parse_debug_offsets(VALID)
    assert dbg.version[:2] == (3, 13) and not dbg.free_threaded
    lay = layout_from_debug_offsets(dbg)
    assert lay.source == "debug_offsets"
    assert compare_with_table(lay) == []
    assert encode_debug_offsets(dbg) == VALID[:SIZE_313]


def test_debug_offsets_mismatch_is_reported() -> None:
    dbg = parse_debug_offsets(VALID)
    groups = {g: dict(f) for g, f in dbg.groups.items()}
    groups["thread_state"]["native_thread_id"] += 8
    lay = layout_from_debug_offsets(DebugOffsets(dbg.version_hex, False, groups))
    assert compare_with_table(lay) == ["tstate_native_thread_id: 168 != 160 (debug offsets != table)"]


def test_debug_offsets_errors() -> None:
    with pytest.raises(Unreadable, match="cookie"):
        parse_debug_offsets(b"ydebugpy" + VALID[8:])
    with pytest.raises(Unreadable, match="truncated"):
        parse_debug_offsets(VALID[:100])
    with pytest.raises(Unreadable, match="truncated"):
        parse_debug_offsets(VALID[:10])
    v314 = VALID[:8] + (0x030E00F0).to_bytes(8, "little") + VALID[16:]
    with pytest.raises(HostError, match="3.14"):
        parse_debug_offsets(v314)
    ft = VALID[:16] + (1).to_bytes(8, "little") + VALID[24:]
    with pytest.raises(HostError, match="free-threaded"):
        parse_debug_offsets(ft)
    dbg = parse_debug_offsets(VALID)
    groups = {g: dict(f) for g, f in dbg.groups.items()}
    groups["code_object"]["filename"] = 1 << 40
    with pytest.raises(Unreadable, match="outside"):
        parse_debug_offsets(encode_debug_offsets(dataclasses.replace(dbg, groups=groups)))


@FUZZ
@given(st.binary(max_size=700))
def test_debug_offsets_fuzz_random(data: bytes) -> None:
    try:
        parse_debug_offsets(data)
    except Unreadable:
        pass


@FUZZ
@given(st.lists(st.tuples(st.integers(0, SIZE_313 - 1), st.integers(0, 255)), max_size=12),
       st.integers(0, SIZE_313 + 8))
def test_debug_offsets_fuzz_mutated(edits: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(VALID[:SIZE_313])
    for pos, value in edits:
        data[pos] = value
    try:
        dbg = parse_debug_offsets(bytes(data[:cut]))
    except Unreadable:
        return
    lay = layout_from_debug_offsets(dbg)  # a parsed struct always makes a layout
    assert all(isinstance(d, str) for d in compare_with_table(lay))
