"""The compile cache's pure parts: what the key covers, the entry format and its checks (damage of every kind is a
miss, never an exception), map references patched, the toolchain check, and the store's own files."""

from __future__ import annotations

import base64
import os
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiflame.agent.kernel import bpf_cache
from aiflame.agent.kernel.bpf_cache import BpfCache, cache_key, parse_entry, serialize_entry
from aiflame.core.errors import Unreadable

REQUEST = {"text": "int x;", "cflags": ["-DA=1"], "functions": {"f": "perf_event"}, "maps": ["m"]}


def _insn(op: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", op, dst | src << 4, off, imm)


# r1 = map 0 (ld_imm64, BPF_PSEUDO_MAP_FD); r2 = 0x1_0000_0005 (a plain 64-bit constant); exit
CODE = _insn(0x18, 1, 1, imm=0) + _insn(0) + _insn(0x18, 2, 0, imm=5) + _insn(0, imm=1) + _insn(0x95)


def _entry(toolchain_file: Path) -> dict[str, Any]:
    st_ = toolchain_file.stat()
    return {
        "cacheable": True, "license": "GPL", "kern_version": 1, "btf": [],
        "maps": [{"name": "m", "type": 1, "key_size": 4, "value_size": 4, "max_entries": 8, "flags": 0,
                  "map_extra": 0, "btf": -1, "btf_key": 0, "btf_value": 0}],
        "progs": [{"name": "f", "kname": "f", "type": 7, "attach_type": 0, "insns": base64.b64encode(CODE).decode()}],
        "reply": {"progs": {"f": 0}, "maps": {"m": {"map": 0, "type": 1, "max_entries": 8, "key_size": 4,
                                                  "value_size": 4, "fields": []}}, "uprobe_multi": False},
        "toolchain": [[str(toolchain_file), st_.st_size, st_.st_mtime_ns, st_.st_ino]],
    }


def test_the_key_covers_the_request_and_the_included_headers(tmp_path: Path) -> None:
    base = cache_key(REQUEST)
    assert cache_key(dict(REQUEST)) == base
    for change in ({"cflags": ["-DA=2"]}, {"text": "int y;"}, {"functions": {"f": "kprobe"}}, {"maps": ["m", "n"]}):
        assert cache_key(REQUEST | change) != base, change
    (tmp_path / "a.h").write_text("#define X 1\n")
    with_dir = REQUEST | {"cflags": [f"-I{tmp_path}", "-DA=1"]}
    before = cache_key(with_dir)
    (tmp_path / "a.h").write_text("#define X 2\n")
    assert cache_key(with_dir) != before


def test_an_entry_reads_back(tmp_path: Path) -> None:
    entry = _entry(Path(__file__))
    data = serialize_entry("k", entry)
    assert parse_entry(data, "k") == {"key": "k", **entry}
    with pytest.raises(Unreadable, match="another key"):
        parse_entry(data, "other")


@given(st.data())
def test_any_damage_is_refused(data: st.DataObject) -> None:
    good = serialize_entry("k", _entry(Path(__file__)))
    cut = data.draw(st.integers(0, len(good) - 1))
    at = data.draw(st.integers(0, len(good) - 1))
    bit = data.draw(st.integers(0, 7))
    flipped = bytearray(good)
    flipped[at] ^= 1 << bit
    for damaged in (good[:cut], bytes(flipped)):
        with pytest.raises(Unreadable):
            parse_entry(damaged, "k")


@pytest.mark.parametrize("spoil", [
    lambda e: e["maps"][0].update(type="1"),
    lambda e: e["maps"][0].update(btf=0),  # no BTF blob 0
    lambda e: e["reply"]["maps"]["m"].update(map=3),
    lambda e: e["reply"]["progs"].update(g=1),
    lambda e: e.pop("progs"),
    lambda e: e.update(toolchain=[]),
    lambda e: e["progs"][0].update(attach_type=-1),
    lambda e: e["progs"][0].update(verified_insns="many"),
])
def test_a_well_formed_entry_of_the_wrong_shape_is_refused(spoil: Any) -> None:
    entry = _entry(Path(__file__))
    spoil(entry)
    with pytest.raises(Unreadable):
        parse_entry(serialize_entry("k", entry), "k")


def test_map_references_get_the_created_maps_fds() -> None:
    code = bytearray(CODE)
    bpf_cache._patch_maps(code, [42])
    assert struct.unpack_from("<i", code, 4)[0] == 42
    assert code[8:] == CODE[8:]  # the plain constant is left alone
    with pytest.raises(Unreadable, match="out of range"):
        bpf_cache._patch_maps(bytearray(CODE), [])


def test_the_costliest_programs_load_first() -> None:
    progs: list[dict[str, Any]] = [{"insns": "a" * 8, "verified_insns": 10}, {"insns": "a" * 80, "verified_insns": 5},
             {"insns": "a" * 16, "verified_insns": 900}, {"insns": "a" * 24}, {"insns": "a" * 40}]
    # by the instructions the compile's verification walked; without a count (an older entry), the longest first
    assert bpf_cache.load_order(progs) == [2, 0, 1, 4, 3]


def test_a_changed_toolchain_file_is_noticed(tmp_path: Path) -> None:
    lib = tmp_path / "libbcc.so.0"
    lib.write_bytes(b"x")
    entry = _entry(lib)
    assert bpf_cache.toolchain_changed(entry) == ""
    lib.write_bytes(b"xy")
    assert bpf_cache.toolchain_changed(entry) == str(lib)
    lib.unlink()
    assert bpf_cache.toolchain_changed(entry) == str(lib)


def test_the_store_keeps_its_own_files_only(tmp_path: Path) -> None:
    d = tmp_path / "cache"
    cache = BpfCache(str(d))
    entry = _entry(Path(__file__))
    assert cache.get("k") is None
    cache.put("k", entry)
    name = d / ("k" + bpf_cache.SUFFIX)
    assert os.stat(d).st_mode & 0o777 == 0o700 and name.stat().st_mode & 0o777 == 0o600
    assert cache.get("k") == {"key": "k", **entry}
    for damaged in (b"", b"garbage", name.read_bytes()[:-1]):
        name.write_bytes(damaged)
        assert cache.get("k") is None
    name.unlink()
    name.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_bytes(serialize_entry("k", entry))
    assert cache.get("k") is None  # a symlink in the cache is never followed
    cache.put("k", entry)  # replaces the symlink itself
    assert not name.is_symlink() and cache.get("k") is not None
    name.chmod(0o620)
    assert cache.get("k") is None  # others could have written it
    assert BpfCache(None).get("k") is None


def test_old_entries_are_pruned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bpf_cache, "KEEP_ENTRIES", 3)
    cache = BpfCache(str(tmp_path / "cache"))
    entry = _entry(Path(__file__))
    for i in range(5):
        cache.put(f"k{i}", entry)
        os.utime(tmp_path / "cache" / f"k{i}{bpf_cache.SUFFIX}", ns=(i * 10**9, i * 10**9))
    cache.put("k5", entry)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [f"k{i}{bpf_cache.SUFFIX}" for i in (3, 4, 5)]


def test_the_environment_turns_it_off_or_moves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bpf_cache.ENV, "off")
    assert BpfCache.from_env().path is None
    monkeypatch.setenv(bpf_cache.ENV, "/x/y")
    assert BpfCache.from_env().path == "/x/y"
    monkeypatch.delenv(bpf_cache.ENV)
    assert BpfCache.from_env().path == bpf_cache.DEFAULT_DIR
