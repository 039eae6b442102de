"""SDT note and argument parsing (symbolize/usdt.py) on built notes; the real notes of a compiled program are
checked against readelf in tests/integration/test_runtime_level_zero_usdt.py."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiflame.agent.runtimes.usdt import usdt_spec
from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.usdt import REGISTERS, UsdtArg, parse_args, parse_notes


def _note(pc: int, base: int, sem: int, provider: bytes, name: bytes, args: bytes, owner: bytes = b"stapsdt",
          ntype: int = 3) -> bytes:
    desc = struct.pack("<QQQ", pc, base, sem) + provider + b"\0" + name + b"\0" + args + b"\0"
    own = owner + b"\0"

    def pad(b: bytes) -> bytes:
        return b + bytes(-len(b) % 4)

    return struct.pack("<III", len(own), len(desc), ntype) + pad(own) + pad(desc)


def test_args() -> None:
    # Oracle: by construction — SDT argument strings in GNU as's operand syntax (SystemTap's sdt.h)
    assert parse_args("8@%rdi -4@$5 8@-16(%rbp) 2@(%r12) 8@%eax") == (
        UsdtArg(8, False, "reg", REGISTERS.index("rdi")), UsdtArg(4, True, "const", value=5),
        UsdtArg(8, False, "mem", REGISTERS.index("rbp"), -16), UsdtArg(2, False, "mem", REGISTERS.index("r12")),
        UsdtArg(8, False, "reg", 0))
    assert UsdtArg(4, True, "reg").cut(0xFFFFFFFF_FFFFFFFE) == -2


@pytest.mark.parametrize("bad", ["3@%rdi", "8@%xmm0", "8@foo(%rip)", "8@(%rax,%rbx,8)", "8@"])
def test_bad_args(bad: str) -> None:
    with pytest.raises(Unreadable):
        parse_args(bad)


def test_notes_and_base_adjustment() -> None:
    # Oracle: by construction — stapsdt notes laid out here as SystemTap documents them
    data = _note(0x1000, 0x2000, 0x4000, b"level_zero", b"launch_kernel", b"8@%rdi 8@%rax") + \
        _note(0, 0, 0, b"x", b"y", b"", owner=b"GNU") + _note(0x1100, 0x2000, 0, b"p", b"n", b"")
    notes = parse_notes(data, base_addr=0x2100)  # prelinked 0x100 higher
    assert [(n.provider, n.name, n.pc, n.semaphore) for n in notes] == [
        ("level_zero", "launch_kernel", 0x1100, 0x4100), ("p", "n", 0x1200, 0)]
    assert parse_notes(data)[0].pc == 0x1000


def test_malformed() -> None:
    good = _note(0x1000, 0x2000, 0, b"p", b"n", b"8@%rdi")
    with pytest.raises(Unreadable):
        parse_notes(good[:-8])
    with pytest.raises(Unreadable):
        parse_notes(struct.pack("<III", 8, 8, 3) + b"stapsdt\0" + bytes(8))


def test_an_odd_argument_refuses_its_site_alone() -> None:
    # Oracle: by construction — libcufile.so.0 (CUDA 13) has a site with a 16-byte argument, '16@80(%rsp)': reading
    # the file's notes must not fail on it, only that site's probe (usdt_spec), so other sites stay usable
    data = _note(0x1000, 0x2000, 0, b"cufile", b"odd", b"8@%rdi 16@80(%rsp)") + \
        _note(0x1100, 0x2000, 0, b"level_zero", b"launch_kernel", b"8@%rdi -4@$5")
    odd, good = parse_notes(data)
    assert good.args == (UsdtArg(8, False, "reg", REGISTERS.index("rdi")), UsdtArg(4, True, "const", value=5))
    with pytest.raises(Unreadable, match="size 16"):
        usdt_spec(odd, "odd")
    assert usdt_spec(good, "launch_kernel").usdt[1].const == 5


@given(st.binary(max_size=256))
def test_fuzz_never_crashes(data: bytes) -> None:
    try:
        notes = parse_notes(data)
    except Unreadable:
        return
    for n in notes:
        try:
            assert all(a.size in (1, 2, 4, 8) for a in n.args)
        except Unreadable:
            pass


@given(st.text(max_size=40))
def test_fuzz_args(text: str) -> None:
    try:
        parse_args(text)
    except Unreadable:
        pass
