"""Bounded decompression of what files and processes hand us: zlib (ELF compressed sections), zstd and LZ4
(fatbin payloads). The size a header declares is checked against core/limits.py before anything is inflated,
and the output can never pass it, whatever the stream really holds; each result is built in one buffer (no
joined chunks, no second copy), so a bomb costs at most one capped buffer.
"""

from __future__ import annotations

import zlib

import lz4.block
import zstandard

from aiflame.core.errors import Unreadable
from aiflame.core.limits import charge

__all__ = ["inflate_lz4", "inflate_zlib", "inflate_zstd"]

_CHUNK = 1 << 20
_LZ4_MAX_RATIO = 255  # an LZ4 block cannot expand more than this


def inflate_zlib(data: bytes | memoryview, size: int, cap: int, what: str) -> bytes:
    """The zlib stream `data` inflated, which must come to exactly `size` bytes (<= `cap`).

    A first pass inflates into a small reused window only to measure the stream, stopping just past `size`; the
    second, knowing the stream fits, inflates into one buffer of exactly `size` (CPython hands that buffer back
    without copying). Twice the CPU of one pass, never more than `size` bytes of output held."""
    charge(size, what, cap)
    d = zlib.decompressobj()
    got = 0
    try:
        want = min(_CHUNK, size + 1)
        chunk = d.decompress(data, want)
        while True:
            got += len(chunk)
            if got > size or d.eof or not (d.unconsumed_tail or len(chunk) == want):
                break
            want = min(_CHUNK, size + 1 - got)
            chunk = d.decompress(d.unconsumed_tail, want)
    except zlib.error:
        raise Unreadable(f"{what}: corrupt zlib stream") from None
    if got != size or not d.eof:
        raise Unreadable(f"{what}: inflates to {'more than ' if got > size else ''}{got} bytes, header says {size}")
    try:
        out = zlib.decompress(data, zlib.MAX_WBITS, max(size, 1))
    except zlib.error:
        raise Unreadable(f"{what}: corrupt zlib stream") from None
    if len(out) != size:
        raise Unreadable(f"{what}: inflates to {len(out)} bytes, header says {size}")
    return out


def inflate_zstd(src: bytes, size: int, cap: int, what: str) -> bytes:
    """The first zstd frame of `src` decompressed. `size` is what the container declares (0: unknown); the
    output must match it and stay within `cap`. The frame's own content size, when present, is checked
    first: zstd writes exactly that many bytes into one buffer, or fails."""
    try:
        declared = zstandard.frame_content_size(src)
    except zstandard.ZstdError as e:
        raise Unreadable(f"{what}: corrupt zstd frame: {e}") from None
    if declared >= 0 and size and declared != size:
        raise Unreadable(f"{what}: the zstd frame says {declared} bytes, header says {size}")
    limit = declared if declared >= 0 else (size or cap)
    charge(limit, what, cap)
    try:
        out: bytes = zstandard.ZstdDecompressor().decompress(src, max_output_size=max(limit, 1))
    except zstandard.ZstdError as e:
        raise Unreadable(f"{what}: corrupt or larger than {limit} bytes: {e}") from None
    if not out or len(out) > limit or (size and len(out) != size):
        raise Unreadable(f"{what}: zstd payload decompressed to {len(out)} bytes, header says {size or limit}")
    return out


def inflate_lz4(src: bytes, size: int, cap: int, what: str) -> bytes:
    """The LZ4 block `src` decompressed to exactly `size` bytes (<= `cap`, and no more than LZ4 can expand)."""
    if not 0 < size <= len(src) * _LZ4_MAX_RATIO + 64:
        raise Unreadable(f"{what}: implausible uncompressed size {size} for an LZ4 block of {len(src)} bytes")
    charge(size, what, cap)
    try:
        out: bytes = lz4.block.decompress(src, uncompressed_size=size)
    except lz4.block.LZ4BlockError as e:
        raise Unreadable(f"{what}: corrupt LZ4 payload: {e}") from None
    if len(out) != size:
        raise Unreadable(f"{what}: LZ4 payload decompressed to {len(out)} bytes, header says {size}")
    return out
