"""NVIDIA fatbin containers: find them in host ELF files or raw bytes, and walk their PTX and cubin entries.

A host binary built by nvcc keeps its device code in `.nv_fatbin`: fatbin containers back to back, each a
16-byte header then entries (a header of its own size, then a payload padded to 8 bytes). Payloads may be raw,
an LZ4 block or a zstd frame. The layout (verified against `cuobjdump -xelf`, byte for byte) is in
shared/facts/nvidia.md; everything little-endian. A fatbin read from process memory starts at a container
header: `fatbin_size` says how many bytes to read.

Container-level damage (truncation, sizes pointing outside the data) raises `Unreadable`; a payload that cannot
be decoded (unknown compression, corrupt stream) only marks its own entry (`FatbinEntry.error`), so one odd
entry does not hide the others.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from typing import Literal

from aiflame.core import limits
from aiflame.core.errors import Refused, Unreadable
from aiflame.core.safe_files import open_regular
from aiflame.symbolize.accel.cubin import EM_CUDA
from aiflame.symbolize.objfmt.elf import ElfFile
from aiflame.symbolize.objfmt.elf_format import SHT_NOBITS, sniff_header
from aiflame.symbolize.objfmt.inflate import inflate_lz4, inflate_zstd

__all__ = [
    "FATBIN_MAGIC",
    "FatbinEntry",
    "decompress_payload",
    "fatbin_size",
    "find_fatbins",
    "iter_entries",
    "iter_file_entries",
    "read_fatbin_file",
]

FATBIN_MAGIC = 0xBA55ED50
_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries
# kind, 0x0101, header size, padded payload size, compressed size, options offset, minor, major, arch,
# name offset, name length, flags; the uncompressed size follows at +0x38.
_ENTRY = struct.Struct("<HHIQIIHHIIIQ")
_ENTRY_MIN = 0x40  # the smallest header that still holds the uncompressed size
_KINDS: dict[int, Literal["ptx", "elf"]] = {1: "ptx", 2: "elf"}
_FLAG_OLD_LZ = 0x1000
_FLAG_LZ4 = 0x2000
_FLAG_ZSTD = 0x8000
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass(frozen=True)
class FatbinEntry:
    """One decoded entry of a fatbin.

    `data` is the payload decompressed and without padding: a cubin ELF file, or PTX text without its trailing
    NULs (what `cuobjdump -xelf` / `-xptx` write). `digest` is the sha256 hex of `data`. When the payload cannot
    be decoded, `error` says why in one line and `data`/`digest` are empty.
    """

    kind: Literal["ptx", "elf"]
    arch: int  # SM number: 80 for sm_80 / compute_80
    flags: int
    data: bytes
    digest: str
    offset: int  # of the entry header within the bytes it was read from
    error: str | None = None


def fatbin_size(header: bytes) -> int:
    """Total size in bytes (header included) of the container whose first 16 bytes are `header`."""
    if len(header) < _HEADER.size:
        raise Unreadable("fatbin header truncated")
    magic, _version, hsize, size = _HEADER.unpack_from(header, 0)
    if magic != FATBIN_MAGIC:
        raise Unreadable(f"not a fatbin (magic {magic:#010x})")
    if hsize < _HEADER.size:
        raise Unreadable(f"fatbin header size {hsize} too small")
    return int(hsize + size)


def find_fatbins(data: bytes | memoryview) -> list[tuple[int, int]]:
    """(offset, size) of each fatbin container in `data`, e.g. the contents of a `.nv_fatbin` section.

    Containers are 8-byte aligned; the gaps between them are scanned at that alignment for the magic.
    A container running past the end of `data` raises Unreadable.
    """
    raw = data if isinstance(data, bytes) else bytes(data)
    out: list[tuple[int, int]] = []
    magic = struct.pack("<I", FATBIN_MAGIC)
    pos, n = 0, len(raw)
    while pos + _HEADER.size <= n:
        at = raw.find(magic, pos)
        if at < 0:
            break
        if at % 8:
            pos = at + 1
            continue
        size = fatbin_size(raw[at : at + _HEADER.size])
        if at + size > n:
            raise Unreadable(f"fatbin at {at:#x} runs past the end ({size} bytes, {n - at} left)")
        out.append((at, size))
        pos = at + ((size + 7) & ~7)
    return out


def iter_entries(
    data: bytes | memoryview, *, label: str = "fatbin", only: Container[int] | None = None
) -> Iterator[FatbinEntry]:
    """Every PTX and cubin entry of every fatbin container in `data`, in order.

    `data` is a `.nv_fatbin` section, a fatbin file, or bytes read from process memory starting at a container
    header. Entry kinds other than PTX and ELF (e.g. LTO IR) are skipped; with `only`, so is every entry whose
    `offset` is not in it (a second pass decompresses just the entries it needs). Raises Unreadable (one
    line, prefixed with `label`) on a truncated or malformed container.
    """
    raw = data if isinstance(data, bytes) else bytes(data)
    try:
        spans = find_fatbins(raw)
    except Unreadable as e:
        raise Unreadable(f"{label}: {e}") from None

    def read(off: int, n: int) -> bytes:
        return raw[off : off + n]

    for start, size in spans:
        yield from _container_entries(read, start, size, label, only)


def iter_file_entries(fd: int, offset: int, *, label: str = "fatbin", limit: int | None = None,
                      only: Container[int] | None = None) -> Iterator[FatbinEntry]:
    """The entries of the one fatbin container at `offset` of the open file `fd`, read one payload at a time:
    only the entry being decoded is ever in memory, never the container (a registration may name hundreds of
    MiB). `limit`: the most bytes the container may span (e.g. what its registration said). Offsets in the
    entries are relative to `offset`. Unreadable as iter_entries."""
    try:
        file_size = os.fstat(fd).st_size
    except OSError as e:
        raise Unreadable(f"{label}: {e.strerror or e}") from None

    def read(off: int, n: int) -> bytes:
        try:
            data = os.pread(fd, n, offset + off)
        except OSError as e:
            raise Unreadable(f"{label}: read failed: {e.strerror or e}") from None
        if len(data) != n:
            raise Unreadable(f"{label}: truncated at {off:#x}")
        return data

    header = read(0, _HEADER.size)  # its errors name `label` already
    try:
        size = fatbin_size(header)
    except Unreadable as e:
        raise Unreadable(f"{label}: {e}") from None
    if offset + size > file_size or (limit is not None and size > limit):
        raise Unreadable(f"{label}: fatbin at {offset:#x} runs past its file or registration ({size} bytes)")
    yield from _container_entries(read, 0, size, label, only)


def _container_entries(
    read: Callable[[int, int], bytes], start: int, size: int, label: str, only: Container[int] | None
) -> Iterator[FatbinEntry]:
    hsize = _HEADER.unpack(read(start, _HEADER.size))[2]
    pos, end = start + hsize, start + size
    cap = limits.current().payload_bytes
    while pos < end:
        if pos + _ENTRY_MIN > end:
            raise Unreadable(f"{label}: entry header at {pos:#x} truncated")
        head = read(pos, _ENTRY_MIN)
        kind, _tag, ehsize, padded, csize, _opts, _minor, _major, arch, _no, _nl, flags = _ENTRY.unpack_from(head, 0)
        (usize,) = struct.unpack_from("<Q", head, 0x38)
        if ehsize < _ENTRY_MIN:
            raise Unreadable(f"{label}: entry at {pos:#x} has header size {ehsize}")
        body = pos + ehsize
        if body + padded > end:
            raise Unreadable(f"{label}: entry at {pos:#x} runs past its fatbin ({padded} bytes)")
        if kind in _KINDS and (only is None or pos in only):
            if (csize or padded) > cap:
                yield FatbinEntry(_KINDS[kind], arch, flags, b"", "", pos,
                                  f"{_KINDS[kind]} sm_{arch} entry at {pos:#x}: {csize or padded} bytes, more than "
                                  f"the {cap} read of one entry")
            else:
                payload = read(body, min(padded, csize) if csize else padded)
                yield _decode_entry(payload, _KINDS[kind], arch, flags, csize, usize, pos)
        pos = body + padded


def _decode_entry(
    payload: bytes, kind: Literal["ptx", "elf"], arch: int, flags: int, csize: int, usize: int, offset: int
) -> FatbinEntry:
    try:
        data = decompress_payload(payload, flags, csize, usize)
    except Unreadable as e:
        return FatbinEntry(kind, arch, flags, b"", "", offset, f"{kind} sm_{arch} entry at {offset:#x}: {e}")
    data = data.rstrip(b"\0") if kind == "ptx" else data[: _elf_extent(data)]
    return FatbinEntry(kind, arch, flags, data, hashlib.sha256(data).hexdigest(), offset)


def decompress_payload(payload: bytes, flags: int, compressed_size: int, uncompressed_size: int) -> bytes:
    """The entry's payload decompressed per its header fields (padding kept); Unreadable when it cannot be,
    or when it would be larger than core/limits.py allows (payload_bytes, and the served process's allowance)."""
    if not compressed_size:
        return payload
    if compressed_size > len(payload):
        raise Unreadable(f"compressed size {compressed_size} exceeds the payload ({len(payload)} bytes)")
    src = payload[:compressed_size]
    cap = limits.current().payload_bytes
    if flags & _FLAG_ZSTD:
        if not src.startswith(_ZSTD_MAGIC):
            raise Unreadable("zstd payload without a zstd frame")
        return inflate_zstd(src, uncompressed_size, cap, "zstd payload")
    if flags & _FLAG_LZ4:
        return inflate_lz4(src, uncompressed_size, cap, "LZ4 payload")
    if flags & _FLAG_OLD_LZ:
        raise Unreadable("unsupported compression: older NVIDIA LZ (flag 0x1000); `cuobjdump -xelf` can extract it")
    raise Unreadable(f"compressed with unknown method (flags {flags:#x})")


def _elf_extent(data: bytes) -> int:
    """End of the ELF image at the start of `data` (its headers and section contents), so that the zero padding
    after it can be cut; len(data) when it does not parse as a 64-bit little-endian ELF."""
    h = sniff_header(data)
    if h is None or not h.layout.is64 or not h.little_endian:
        return len(data)
    end = 0x40
    if h.phnum:
        end = max(end, h.phoff + h.phnum * h.phentsize)
    if h.shnum:
        end = max(end, h.shoff + h.shnum * h.shentsize)
        shdr = h.layout.shdr
        if h.shentsize >= shdr.size and h.shoff + h.shnum * h.shentsize <= len(data):
            for i in range(h.shnum):
                f = shdr.unpack_from(data, h.shoff + i * h.shentsize)
                if f[1] != SHT_NOBITS:
                    end = max(end, f[4] + f[5])
    return min(end, len(data))


def read_fatbin_file(path: str | os.PathLike[str]) -> tuple[str, bytes]:
    """(what, bytes) of the device code in `path`: ("elf", its `.nv_fatbin`) for a host ELF; ("fatbin", the
    file) for a fatbin file; ("cubin", the file) for a cubin. A host ELF without device code gives ("elf", b"").
    Raises Unreadable when the file is unreadable, larger than a payload may be, or none of these.
    """
    label = os.fsdecode(path)
    try:
        fd, st = open_regular(path)
    except OSError as e:
        raise Unreadable(f"{label}: {e.strerror or e}") from None
    try:
        head = os.pread(fd, 64, 0)
        h = sniff_header(head)
        is_cubin = h is not None and h.little_endian and h.e_machine == EM_CUDA
        if is_cubin or (len(head) >= 4 and struct.unpack_from("<I", head)[0] == FATBIN_MAGIC):
            cap = limits.current().payload_bytes
            if st.st_size > cap:
                raise Refused(f"{label}: {st.st_size} bytes, more than a fatbin or cubin is read ({cap})")
            data = os.pread(fd, st.st_size, 0)
            if len(data) != st.st_size:
                raise Unreadable(f"{label}: changed while read")
            return ("cubin" if is_cubin else "fatbin"), data
    except OSError as e:
        raise Unreadable(f"{label}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    with ElfFile.open(path) as elf:
        sec = elf.section(".nv_fatbin")
        return "elf", elf.read_section(sec) if sec is not None else b""
