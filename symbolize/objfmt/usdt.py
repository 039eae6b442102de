"""SystemTap SDT (USDT) probe notes: `.note.stapsdt` entries of owner "stapsdt", type 3, as <sys/sdt.h> emits
them (https://sourceware.org/systemtap/wiki/UserSpaceProbeImplementation).

A note's descriptor holds three addresses (probe pc, the link-time address of `.stapsdt.base`, the semaphore or
0), then provider, name and the argument string, each NUL-terminated. When prelink (or any later relocation)
moved the file, the actual `.stapsdt.base` section address differs from the recorded one, and the pc and the
semaphore move by that difference. Arguments are gas operands with a size prefix, x86-64 here: `8@%rdi`
(register), `-4@$5` (constant), `8@-16(%rbp)` (memory at register + displacement); a negative size is signed.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.elf import ElfFile

__all__ = ["REGISTERS", "UsdtArg", "UsdtNote", "parse_args", "parse_notes", "read_notes"]

NOTE_OWNER = b"stapsdt"
NT_STAPSDT = 3

# The 16 general registers in the order the probe BPF captures them (bpf/runtime_probes.bpf.c, PROBE_REGS).
REGISTERS = ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13",
             "r14", "r15")
_ALIASES: dict[str, int] = {}
for _i, _r in enumerate(REGISTERS[:4]):  # rax: eax ax al ah
    _c = _r[1]
    _ALIASES.update({_r: _i, f"e{_c}x": _i, f"{_c}x": _i, f"{_c}l": _i, f"{_c}h": _i})
for _i, _r in enumerate(REGISTERS[4:8], 4):  # rsi: esi si sil
    _b = _r[1:]
    _ALIASES.update({_r: _i, f"e{_b}": _i, _b: _i, f"{_b}l": _i})
for _i, _r in enumerate(REGISTERS[8:], 8):  # r8: r8d r8w r8b
    _ALIASES.update({_r: _i, f"{_r}d": _i, f"{_r}w": _i, f"{_r}b": _i})


@dataclass(frozen=True, slots=True)
class UsdtArg:
    """One probe argument: a register's value, 8 bytes... at register + offset, or a constant."""

    size: int  # bytes, 1/2/4/8
    signed: bool
    kind: str  # "reg", "mem" or "const"
    reg: int = -1  # index into REGISTERS (reg, mem)
    offset: int = 0  # displacement (mem)
    value: int = 0  # the constant (const)

    def cut(self, raw: int) -> int:
        """A raw 64-bit value read for this argument, cut to its size and sign."""
        bits = 8 * self.size
        v = raw & ((1 << bits) - 1)
        if self.signed and v >> (bits - 1):
            v -= 1 << bits
        return v


@dataclass(frozen=True, slots=True)
class UsdtNote:
    provider: str
    name: str
    pc: int  # adjusted link-time address of the probe site
    semaphore: int  # adjusted link-time address of the semaphore (u16), 0 for none
    args_text: str
    offset: int = -1  # file offset of pc (where the uprobe goes), -1 unknown
    semaphore_offset: int = -1  # file offset of the semaphore, -1 none or unknown

    @property
    def args(self) -> tuple[UsdtArg, ...]:
        """The parsed arguments; Unreadable for a form we do not read. Parsed on use, so that one site's odd
        argument (libcufile's 16-byte '16@80(%rsp)') refuses that site alone, not every note of its file."""
        return parse_args(self.args_text)


_ARG = re.compile(r"^(?:(-?\d+)@)?(.+)$")
_MEM = re.compile(r"^(-?(?:0x[0-9a-fA-F]+|\d+))?\(%(\w+)\)$")
_IMM = re.compile(r"^\$(-?(?:0x[0-9a-fA-F]+|\d+))$")


def _parse_arg(text: str) -> UsdtArg:
    m = _ARG.match(text)
    if m is None:
        raise Unreadable(f"USDT argument {text!r}: empty")
    size_text, op = m.groups()
    size = int(size_text) if size_text is not None else 8
    if abs(size) not in (1, 2, 4, 8):
        raise Unreadable(f"USDT argument {text!r}: size {size} is not 1, 2, 4 or 8")
    signed, size = size < 0, abs(size)
    if op.startswith("%"):
        reg = _ALIASES.get(op[1:])
        if reg is None:
            raise Unreadable(f"USDT argument {text!r}: unknown register {op}")
        return UsdtArg(size, signed, "reg", reg)
    if (imm := _IMM.match(op)) is not None:
        return UsdtArg(size, signed, "const", value=int(imm.group(1), 0))
    if (mem := _MEM.match(op)) is not None:
        reg = _ALIASES.get(mem.group(2))
        if reg is None:
            raise Unreadable(f"USDT argument {text!r}: unsupported base register %{mem.group(2)}")
        return UsdtArg(size, signed, "mem", reg, int(mem.group(1) or "0", 0))
    raise Unreadable(f"USDT argument {text!r}: unsupported operand (symbols, %rip and index forms are not read)")


def parse_args(text: str) -> tuple[UsdtArg, ...]:
    """The arguments of an SDT argument string (space-separated operands)."""
    return tuple(_parse_arg(t) for t in text.split())


def _cstr(data: bytes, pos: int, what: str) -> tuple[str, int]:
    end = data.find(b"\0", pos)
    if end < 0:
        raise Unreadable(f"SDT note: {what} is not NUL-terminated")
    return data[pos:end].decode("utf-8", "replace"), end + 1


def parse_notes(data: bytes, *, is64: bool = True, little: bool = True,
                base_addr: int | None = None) -> list[UsdtNote]:
    """Every stapsdt note in the contents of a `.note.stapsdt` section. `base_addr` is the actual address of
    `.stapsdt.base` (None: the section is absent, no adjustment). Notes of other owners are skipped; a malformed
    stapsdt note (or a truncated section) raises Unreadable; an argument string is parsed when used
    (UsdtNote.args). Offsets are left -1 (see read_notes)."""
    bo = "<" if little else ">"
    head = struct.Struct(bo + "III")
    word = 8 if is64 else 4
    addrs = struct.Struct(bo + ("QQQ" if is64 else "III"))
    out: list[UsdtNote] = []
    pos = 0
    while pos + head.size <= len(data):
        namesz, descsz, ntype = head.unpack_from(data, pos)
        name_at = pos + head.size
        desc_at = name_at + ((namesz + 3) & ~3)
        end = desc_at + ((descsz + 3) & ~3)
        if desc_at + descsz > len(data):
            raise Unreadable(f"SDT note at {pos:#x}: runs past the section end")
        owner = data[name_at:name_at + namesz].rstrip(b"\0")
        pos = end
        if owner != NOTE_OWNER or ntype != NT_STAPSDT:
            continue
        desc = data[desc_at:desc_at + descsz]
        if len(desc) < 3 * word:
            raise Unreadable(f"SDT note at {desc_at:#x}: descriptor of {descsz} bytes is too short")
        pc, base, sem = addrs.unpack_from(desc)
        provider, p = _cstr(desc, 3 * word, "provider")
        name, p = _cstr(desc, p, "name")
        args_text, _ = _cstr(desc, p, "argument string") if p < len(desc) else ("", p)
        if base_addr is not None and base:
            delta = base_addr - base
            pc += delta
            if sem:
                sem += delta
        mask = (1 << (8 * word)) - 1
        out.append(UsdtNote(provider, name, pc & mask, sem & mask, args_text))
    if pos < len(data) and any(data[pos:]):
        raise Unreadable(f"SDT notes: {len(data) - pos} stray bytes at the section end")
    return out


def read_notes(elf: ElfFile) -> list[UsdtNote]:
    """The SDT notes of an open ELF file, with the file offsets of their sites and semaphores."""
    sec = elf.section(".note.stapsdt")
    if sec is None:
        return []
    base = elf.section(".stapsdt.base")
    notes = parse_notes(elf.read_section(sec), is64=elf.is64, little=elf.little_endian,
                        base_addr=base.addr if base is not None else None)
    out = []
    for n in notes:
        off = elf.vaddr_to_file_offset(n.pc)
        sem = elf.vaddr_to_file_offset(n.semaphore) if n.semaphore else None
        out.append(UsdtNote(n.provider, n.name, n.pc, n.semaphore, n.args_text,
                            -1 if off is None else off, -1 if sem is None else sem))
    return out
