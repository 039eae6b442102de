"""The one ELF file header decoder (symbolize/objfmt/elf_format.py `parse_header`): random bytes either decode or
raise one Unreadable line, and headers written field by field read back as written."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.elf_format import ELF_MAGIC, parse_header, sniff_header

FUZZ = settings(max_examples=500, deadline=None)
_U16, _U32, _U64 = st.integers(0, 0xFFFF), st.integers(0, 0xFFFFFFFF), st.integers(0, (1 << 64) - 1)


@FUZZ
@given(st.one_of(st.binary(max_size=96), st.binary(max_size=80).map(lambda b: ELF_MAGIC + b),
                 st.tuples(st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.binary(max_size=80))
                 .map(lambda t: ELF_MAGIC + bytes(t[:2]) + t[2])))
def test_random_bytes_decode_or_raise_one_line(data: bytes) -> None:
    try:
        h = parse_header(data, "blob")
    except Unreadable as e:
        assert str(e).startswith("blob: ") and "\n" not in str(e)
        assert sniff_header(data) is None
        return
    assert sniff_header(data) == h
    assert data[:4] == ELF_MAGIC and len(data) >= (64 if h.layout.is64 else 52)
    assert (h.layout.is64, h.little_endian) == (data[4] == 2, data[5] == 1)
    assert (h.osabi, h.abi_version) == (data[7], data[8])


@FUZZ
@given(is64=st.booleans(), little=st.booleans(), osabi=st.integers(0, 255), abi=st.integers(0, 255),
       e_type=_U16, machine=_U16, entry=_U64, phoff=_U64, shoff=_U64, flags=_U32, sizes=st.tuples(*[_U16] * 6),
       tail=st.binary(max_size=16))
def test_written_headers_read_back(is64: bool, little: bool, osabi: int, abi: int, e_type: int, machine: int,
                                   entry: int, phoff: int, shoff: int, flags: int,
                                   sizes: tuple[int, int, int, int, int, int], tail: bytes) -> None:
    # Oracle: by construction: the header is packed here field by field as the ELF specification lays it out
    bo = "<" if little else ">"
    if not is64:
        entry, phoff, shoff = entry & 0xFFFFFFFF, phoff & 0xFFFFFFFF, shoff & 0xFFFFFFFF
    fields = struct.pack(bo + ("HHIQQQIHHHHHH" if is64 else "HHIIIIIHHHHHH"), e_type, machine, 1, entry, phoff,
                         shoff, flags, *sizes)
    ident = ELF_MAGIC + bytes([2 if is64 else 1, 1 if little else 2, 1, osabi, abi]) + bytes(7)
    h = parse_header(ident + fields + tail, "x")
    _ehsize, phentsize, phnum, shentsize, shnum, shstrndx = sizes
    assert (h.layout.is64, h.little_endian, h.osabi, h.abi_version) == (is64, little, osabi, abi)
    assert (h.e_type, h.e_machine, h.e_flags, h.phoff, h.shoff) == (e_type, machine, flags, phoff, shoff)
    assert (h.phentsize, h.phnum, h.shentsize, h.shnum, h.shstrndx) == (phentsize, phnum, shentsize, shnum, shstrndx)


@pytest.mark.parametrize(("data", "why"), [
    (b"", "not an ELF file"),
    (b"MZ\x90\x00" + bytes(60), "not an ELF file"),
    (ELF_MAGIC + b"\x03\x01" + bytes(58), r"unsupported ELF class or byte order \(3, 1\)"),
    (ELF_MAGIC + b"\x02\x00" + bytes(58), r"unsupported ELF class or byte order \(2, 0\)"),
    (ELF_MAGIC + b"\x02\x01" + bytes(50), r"truncated ELF header \(56 of 64 bytes\)"),
    (ELF_MAGIC + b"\x01\x01" + bytes(40), r"truncated ELF header \(46 of 52 bytes\)"),
])
def test_malformed_headers_say_what_is_wrong(data: bytes, why: str) -> None:
    with pytest.raises(Unreadable, match=f"^hdr: {why}$"):
        parse_header(data, "hdr")
