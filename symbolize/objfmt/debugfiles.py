"""Finding the separate debug file of a binary, as gdb does: build id first, then .gnu_debuglink."""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Sequence

from aiflame.core.errors import Unreadable
from aiflame.symbolize.objfmt.elf import read_build_id

__all__ = ["SYSTEM_DEBUG_DIRS", "build_id_path", "find_debug_file"]

log = logging.getLogger(__name__)

_CRC_CHUNK = 1 << 20
SYSTEM_DEBUG_DIRS = ("/usr/lib/debug",)  # where the distribution installs separate debug files


def build_id_path(debug_dir: str, build_id: str) -> str:
    """`<debug_dir>/.build-id/ab/cdef….debug` for build id `abcdef…`."""
    return os.path.join(debug_dir, ".build-id", build_id[:2], build_id[2:] + ".debug")


def _crc32(path: str) -> int | None:
    crc = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CRC_CHUNK):
                crc = zlib.crc32(chunk, crc)
    except OSError:
        return None
    return crc


def _build_id_of(path: str) -> str | None:
    try:
        return read_build_id(path)
    except Unreadable:
        return None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def find_debug_file(
    binary_path: str,
    build_id: str | None,
    debuglink: tuple[str, int] | None,
    debug_dirs: Sequence[str] = SYSTEM_DEBUG_DIRS,
    *,
    root: str = "/",
) -> str | None:
    """The path of the separate debug file of `binary_path`, or None.

    Looks in `<debug_dir>/.build-id/ab/cdef….debug` first (its build id must match), then for the
    debuglink name in the binary's directory, its `.debug/` subdirectory and `<debug_dir>/<binary's dir>/`
    (its CRC32 must match the debuglink's, and its build id `build_id` where both are known).
    `binary_path` is the file as opened; `root` is the filesystem root it lives under (for a container's
    files, `/proc/PID/root`), so that `<debug_dir>/<binary's dir>` uses the path inside that root.
    """
    bid = build_id.lower() if build_id else None
    if bid and len(bid) > 2 and all(c in "0123456789abcdef" for c in bid):
        for d in debug_dirs:
            cand = build_id_path(d, bid)
            if os.path.isfile(cand) and _build_id_of(cand) == bid:
                return cand
    if not debuglink:
        return None
    name, crc = debuglink
    if not name or "/" in name or name in (".", ".."):
        return None  # a debuglink is a plain file name; anything else is not ours to follow
    bin_dir = os.path.dirname(binary_path)
    inner_dir = bin_dir
    root_abs = os.path.abspath(root)
    if root_abs != "/" and os.path.abspath(bin_dir).startswith(root_abs + "/"):
        inner_dir = os.path.abspath(bin_dir)[len(root_abs) :]
    candidates = [os.path.join(bin_dir, name), os.path.join(bin_dir, ".debug", name)]
    candidates += [os.path.join(d, inner_dir.lstrip("/"), name) for d in debug_dirs]
    for cand in candidates:
        if not os.path.isfile(cand) or _same_file(cand, binary_path):
            continue
        if _crc32(cand) != crc:
            log.debug("%s: debuglink CRC mismatch", cand)
            continue
        cand_bid = _build_id_of(cand)
        if bid and cand_bid and cand_bid != bid:
            continue
        return cand
    return None
