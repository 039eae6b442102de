"""MiniDebugInfo: the symbol table a stripped binary carries, xz-compressed, in its `.gnu_debugdata` section.

Fedora, RHEL and their derivatives strip binaries down to `.dynsym` but embed a small ELF file, compressed with
xz, whose `.symtab` lists the functions `.dynsym` lacks (static functions, such as most of an interpreter's
eval-loop helpers); gdb and perf read it too. The section comes from the profiled file and is untrusted: its
compressed size and the size it decompresses to are capped, the output is streamed into an anonymous memory file
(never held whole in Python), the nested file must be an ELF file of the same machine, and anything malformed
raises Unreadable naming the binary. The nested file's own sections are never decompressed again.
"""

from __future__ import annotations

import lzma
import os
import tempfile

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.elf import ElfFile
from aiflame.symbolize.objfmt.elf_symbols import Symbol

__all__ = ["MAX_COMPRESSED", "MAX_DECOMPRESSED", "SECTION", "inflate_xz", "minidebug_functions"]

SECTION = ".gnu_debugdata"
MAX_COMPRESSED = 32 << 20  # real sections are tens of KiB to a few MiB
MAX_DECOMPRESSED = 128 << 20
_MEMLIMIT = 128 << 20  # the decoder's own allocations (its dictionary size comes from the stream header)
_CHUNK = 1 << 20
_MAX_IDLE = 16  # decompressor calls in a row that neither produce output nor end: a stuck stream


def _anonymous_fd() -> int:
    """A read-write fd of a file with no name: a memfd, else an unlinked temporary file."""
    try:
        return os.memfd_create("aiflame-minidebug", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        fd, path = tempfile.mkstemp(prefix="aiflame-minidebug-")
        os.unlink(path)
        return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def inflate_xz(data: bytes, fd: int, limit: int, label: str) -> int:
    """Decompress the xz stream `data` into `fd`, at most `limit` bytes; returns the size written.

    Raises Unreadable on corrupt or truncated data and on output beyond `limit`."""
    d = lzma.LZMADecompressor(format=lzma.FORMAT_XZ, memlimit=_MEMLIMIT)
    total = idle = 0
    pending = data
    while not d.eof:
        try:
            out = d.decompress(pending, max_length=_CHUNK)
        except lzma.LZMAError as e:
            raise Unreadable(f"{label}: corrupt xz data ({e})") from None
        except MemoryError:
            raise Unreadable(f"{label}: xz data needs more memory than available") from None
        pending = b""
        total += len(out)
        if total > limit:
            raise Unreadable(f"{label}: decompresses to more than {limit} bytes")
        if out:
            idle = 0
            try:
                _write_all(fd, out)
            except OSError as e:
                raise Unreadable(f"{label}: cannot store decompressed data: {e.strerror or e}") from None
        elif not d.eof:
            idle += 1
            if d.needs_input or idle > _MAX_IDLE:
                raise Unreadable(f"{label}: truncated xz data")
    return total


def minidebug_functions(
    elf: ElfFile, max_compressed: int = MAX_COMPRESSED, max_decompressed: int = MAX_DECOMPRESSED
) -> list[Symbol]:
    """The function symbols of `elf`'s MiniDebugInfo ([] when it has none), at the binary's link-time addresses.

    Raises Unreadable when the section is there but unusable."""
    sec = elf.section(SECTION)
    if sec is None or sec.size == 0:
        return []
    label = f"{elf.path}: {SECTION}"
    if sec.size > max_compressed:
        raise Unreadable(f"{label}: {sec.size} bytes, more than the {max_compressed} read")
    data = elf.read_section(sec)
    if not data:
        return []  # NOBITS: nothing stored
    fd = _anonymous_fd()
    try:
        inflate_xz(data, fd, max_decompressed, label)
        try:
            inner = ElfFile.open(f"/proc/self/fd/{fd}")
        except Unreadable as e:
            # The nested file's errors name /proc/self/fd/N: say which binary it came from instead.
            raise Unreadable(f"{label}: {str(e).split(': ', 1)[-1]}") from None
    finally:
        os.close(fd)
    with inner:
        if (inner.machine, inner.is64, inner.little_endian) != (elf.machine, elf.is64, elf.little_endian):
            raise Unreadable(f"{label}: nested ELF file is for another machine")
        return inner.functions()
