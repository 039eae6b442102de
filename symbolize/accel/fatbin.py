"""NVIDIA fatbin containers: find them in host ELF files or raw bytes, and walk their PTX and cubin entries.

A host binary built by nvcc keeps its device code in `.nv_fatbin`: fatbin containers back to back, each a
16-byte header then entries (a header of its own size, then a payload padded to 8 bytes). Payloads may be raw,
an LZ4 block or a zstd frame. The layout (verified against `cuobjdump -xelf`, byte for byte) is in
shared/facts/nvidia.md; everything little-endian. A fatbin read from process memory starts at a container
header: `fatbin_size` says how many bytes to read.

Container-level damage (truncation, sizes pointing outside the data) raises `FatbinError`; a payload that cannot
be decoded (unknown compression, corrupt stream) only marks its own entry (`FatbinEntry.error`), so one odd
entry does not hide the others.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
from collections.abc import Container, Iterator
from dataclasses import dataclass
from typing import Literal

import lz4.block
import zstandard

from aiflame.symbolize.errors import SymbolizeError
from aiflame.symbolize.objfmt.elf import ElfFile

__all__ = [
    "FATBIN_MAGIC",
    "FatbinEntry",
    "FatbinError",
    "decompress_payload",
    "fatbin_size",
    "find_fatbins",
    "iter_entries",
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
# Bounds against lying headers: a cubin of a real library is a few MiB; LZ4 cannot expand more than ~255x.
_MAX_PAYLOAD = 1 << 30
_LZ4_MAX_RATIO = 255
_ELF64_HEADER = struct.Struct("<QQQIHHHHHH")  # e_entry .. e_shstrndx, from offset 0x18
_SHDR64 = struct.Struct("<IIQQQQIIQQ")
_SHT_NOBITS = 8


class FatbinError(SymbolizeError):
    """A fatbin container is truncated or malformed; the message is one line naming where."""


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
        raise FatbinError("fatbin header truncated")
    magic, _version, hsize, size = _HEADER.unpack_from(header, 0)
    if magic != FATBIN_MAGIC:
        raise FatbinError(f"not a fatbin (magic {magic:#010x})")
    if hsize < _HEADER.size:
        raise FatbinError(f"fatbin header size {hsize} too small")
    return int(hsize + size)


def find_fatbins(data: bytes | memoryview) -> list[tuple[int, int]]:
    """(offset, size) of each fatbin container in `data`, e.g. the contents of a `.nv_fatbin` section.

    Containers are 8-byte aligned; the gaps between them are scanned at that alignment for the magic.
    A container running past the end of `data` raises FatbinError.
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
            raise FatbinError(f"fatbin at {at:#x} runs past the end ({size} bytes, {n - at} left)")
        out.append((at, size))
        pos = at + ((size + 7) & ~7)
    return out


def iter_entries(
    data: bytes | memoryview, *, label: str = "fatbin", only: Container[int] | None = None
) -> Iterator[FatbinEntry]:
    """Every PTX and cubin entry of every fatbin container in `data`, in order.

    `data` is a `.nv_fatbin` section, a fatbin file, or bytes read from process memory starting at a container
    header. Entry kinds other than PTX and ELF (e.g. LTO IR) are skipped; with `only`, so is every entry whose
    `offset` is not in it (a second pass decompresses just the entries it needs). Raises FatbinError (one
    line, prefixed with `label`) on a truncated or malformed container.
    """
    raw = data if isinstance(data, bytes) else bytes(data)
    try:
        spans = find_fatbins(raw)
    except FatbinError as e:
        raise FatbinError(f"{label}: {e}") from None
    for start, size in spans:
        yield from _container_entries(raw, start, size, label, only)


def _container_entries(
    raw: bytes, start: int, size: int, label: str, only: Container[int] | None
) -> Iterator[FatbinEntry]:
    hsize = _HEADER.unpack_from(raw, start)[2]
    pos, end = start + hsize, start + size
    while pos < end:
        if pos + _ENTRY_MIN > end:
            raise FatbinError(f"{label}: entry header at {pos:#x} truncated")
        kind, _tag, ehsize, padded, csize, _opts, _minor, _major, arch, _no, _nl, flags = _ENTRY.unpack_from(raw, pos)
        (usize,) = struct.unpack_from("<Q", raw, pos + 0x38)
        if ehsize < _ENTRY_MIN:
            raise FatbinError(f"{label}: entry at {pos:#x} has header size {ehsize}")
        body = pos + ehsize
        if body + padded > end or padded > _MAX_PAYLOAD:
            raise FatbinError(f"{label}: entry at {pos:#x} runs past its fatbin ({padded} bytes)")
        if kind in _KINDS and (only is None or pos in only):
            yield _decode_entry(raw[body : body + padded], _KINDS[kind], arch, flags, csize, usize, pos)
        pos = body + padded


def _decode_entry(
    payload: bytes, kind: Literal["ptx", "elf"], arch: int, flags: int, csize: int, usize: int, offset: int
) -> FatbinEntry:
    try:
        data = decompress_payload(payload, flags, csize, usize)
    except FatbinError as e:
        return FatbinEntry(kind, arch, flags, b"", "", offset, f"{kind} sm_{arch} entry at {offset:#x}: {e}")
    data = data.rstrip(b"\0") if kind == "ptx" else data[: _elf_extent(data)]
    return FatbinEntry(kind, arch, flags, data, hashlib.sha256(data).hexdigest(), offset)


def decompress_payload(payload: bytes, flags: int, compressed_size: int, uncompressed_size: int) -> bytes:
    """The entry's payload decompressed per its header fields (padding kept); FatbinError when it cannot be."""
    if not compressed_size:
        return payload
    if compressed_size > len(payload):
        raise FatbinError(f"compressed size {compressed_size} exceeds the payload ({len(payload)} bytes)")
    src = payload[:compressed_size]
    if flags & _FLAG_ZSTD:
        return _zstd(src, uncompressed_size)
    if flags & _FLAG_LZ4:
        return _lz4(src, uncompressed_size)
    if flags & _FLAG_OLD_LZ:
        raise FatbinError("unsupported compression: older NVIDIA LZ (flag 0x1000); `cuobjdump -xelf` can extract it")
    raise FatbinError(f"compressed with unknown method (flags {flags:#x})")


def _zstd(src: bytes, usize: int) -> bytes:
    if not src.startswith(_ZSTD_MAGIC):
        raise FatbinError("zstd payload without a zstd frame")
    limit = usize if 0 < usize <= _MAX_PAYLOAD else _MAX_PAYLOAD
    chunks: list[bytes] = []
    got = 0
    try:
        # A stream reader bounds the output whatever the frame claims (decompress() trusts its content size).
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(src)) as reader:
            while got <= limit:
                chunk = reader.read(limit + 1 - got)
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
    except zstandard.ZstdError as e:
        raise FatbinError(f"corrupt zstd payload: {e}") from None
    if got > limit or (usize and got != usize) or not got:
        raise FatbinError(f"zstd payload decompressed to {got} bytes, header says {usize}")
    return b"".join(chunks)


def _lz4(src: bytes, usize: int) -> bytes:
    if not 0 < usize <= min(_MAX_PAYLOAD, len(src) * _LZ4_MAX_RATIO + 64):
        raise FatbinError(f"implausible uncompressed size {usize} for an LZ4 block of {len(src)} bytes")
    try:
        out: bytes = lz4.block.decompress(src, uncompressed_size=usize)
    except lz4.block.LZ4BlockError as e:
        raise FatbinError(f"corrupt LZ4 payload: {e}") from None
    if len(out) != usize:
        raise FatbinError(f"LZ4 payload decompressed to {len(out)} bytes, header says {usize}")
    return out


def _elf_extent(data: bytes) -> int:
    """End of the ELF image at the start of `data` (its headers and section contents), so that the zero padding
    after it can be cut; len(data) when it does not parse as a 64-bit little-endian ELF."""
    if len(data) < 0x40 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return len(data)
    phoff, shoff, _flags, _ehsize, phentsize, phnum, shentsize, shnum, _shstrndx = _ELF64_HEADER.unpack_from(
        data, 0x18
    )[1:]
    end = 0x40
    if phnum:
        end = max(end, phoff + phnum * phentsize)
    if shnum:
        end = max(end, shoff + shnum * shentsize)
        if shentsize >= _SHDR64.size and shoff + shnum * shentsize <= len(data):
            for i in range(shnum):
                f = _SHDR64.unpack_from(data, shoff + i * shentsize)
                if f[1] != _SHT_NOBITS:
                    end = max(end, f[4] + f[5])
    return min(end, len(data))


def read_fatbin_file(path: str | os.PathLike[str]) -> tuple[str, bytes]:
    """(what, bytes) of the device code in `path`: ("elf", its `.nv_fatbin`) for a host ELF; ("fatbin", the
    file) for a fatbin file; ("cubin", the file) for a cubin. A host ELF without device code gives ("elf", b"").
    Raises SymbolizeError when the file is unreadable or none of these.
    """
    label = os.fsdecode(path)
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        raise FatbinError(f"{label}: {e.strerror or e}") from None
    if len(head) >= 4 and struct.unpack_from("<I", head)[0] == FATBIN_MAGIC:
        return "fatbin", _read_all(path, label)
    if len(head) >= 20 and head[:4] == b"\x7fELF" and head[5] == 1 and struct.unpack_from("<H", head, 18)[0] == 190:
        return "cubin", _read_all(path, label)
    with ElfFile.open(path) as elf:
        sec = elf.section(".nv_fatbin")
        return "elf", elf.read_section(sec) if sec is not None else b""


def _read_all(path: str | os.PathLike[str], label: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise FatbinError(f"{label}: {e.strerror or e}") from None
