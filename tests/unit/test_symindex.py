"""The compact function-symbol index: the same answers as the symbol list it came from, saved and read back
byte for byte, and anything else read back is refused with one line."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.elf import ElfFile
from aiflame.symbolize.objfmt.elf_symbols import Symbol
from aiflame.symbolize.symindex import SymbolIndex

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"

symbols = st.lists(st.builds(Symbol, st.integers(0, 1 << 40), st.integers(0, 1 << 16),
                             st.text(max_size=30)), max_size=40)


def _reference(lists: list[list[Symbol]], vaddr: int) -> str | None:
    """What the index must answer: the nearest of the 16 preceding symbols (first list wins) that covers it."""
    by_addr: dict[int, Symbol] = {}
    for syms in lists:
        for s in syms:
            by_addr.setdefault(s.addr, s)
    preceding = [by_addr[a] for a in sorted(by_addr) if a <= vaddr][-16:]
    for s in reversed(preceding):
        if vaddr < s.addr + max(s.size, 1):
            return s.name
    return None


@given(st.lists(symbols, min_size=1, max_size=3), st.lists(st.integers(0, 1 << 40), max_size=20))
def test_answers_as_the_symbols_do_and_round_trips(lists: list[list[Symbol]], probes: list[int]) -> None:
    index = SymbolIndex.merged(*lists, source="/usr/lib/debug/x.debug")
    back = SymbolIndex.from_bytes(index.to_bytes())
    assert back.source == "/usr/lib/debug/x.debug" and len(back) == len(index)
    for vaddr in probes + [s.addr for syms in lists for s in syms]:
        assert index.find(vaddr) == back.find(vaddr) == _reference(lists, vaddr)


def test_libc_names_match_its_symbol_list() -> None:
    elf = ElfFile.open(LIBC)
    try:
        funcs = elf.functions()
    finally:
        elf.close()
    index = SymbolIndex.from_bytes(SymbolIndex.merged(funcs).to_bytes())
    assert len(index) == len(funcs) > 1000
    for s in funcs[::97]:
        assert index.find(s.addr) is not None and index.find(s.addr + s.size // 2) is not None
    assert any(index.find(s.addr) == s.name for s in funcs)


@pytest.mark.parametrize("cut", [0, 7, 20, -1])
def test_truncated_files_are_refused(cut: int) -> None:
    data = SymbolIndex.merged([Symbol(0x1000, 16, "f"), Symbol(0x2000, 8, "g")]).to_bytes()
    with pytest.raises(Unreadable, match="^symbol index: "):
        SymbolIndex.from_bytes(data[:cut])


def test_out_of_order_addresses_are_refused() -> None:
    data = bytearray(SymbolIndex.merged([Symbol(0x1000, 16, "f"), Symbol(0x2000, 8, "g")]).to_bytes())
    data[20:28], data[28:36] = data[28:36], data[20:28]  # swap the two start addresses
    with pytest.raises(Unreadable, match="out of order"):
        SymbolIndex.from_bytes(bytes(data))


@given(st.binary(max_size=200))
def test_any_bytes_read_as_an_index_or_one_error(data: bytes) -> None:
    try:
        index = SymbolIndex.from_bytes(b"AIFLSYM1" + data)
    except Unreadable:
        return
    index.find(0x1000)
