"""The vDSO as a file, for the CFI unwinder: the kernel maps one vDSO image into every 64-bit process, with its
own .eh_frame, but no file on disk. The agent's copy (read from its own memory) is written once into the private
cache and stands for each target's [vdso] mapping of the same size, so walks go on through clock_gettime and
friends instead of stopping at them."""

from __future__ import annotations

import ctypes
import hashlib
import os

from aiflame.symbolize.cache import default_cache_dir, read_cached, write_cached

_ELF_MAGIC = b"\x7fELF"
_MAX_VDSO = 1 << 20  # the x86-64 vDSO is 8 KiB; anything near this is not one


def own_vdso() -> bytes | None:
    """This process's vDSO image (the same for every 64-bit process of this kernel), or None without one."""
    try:
        with open("/proc/self/maps") as f:
            line = next((ln for ln in f if ln.rstrip().endswith(" [vdso]")), None)
    except OSError:
        return None
    if line is None:
        return None
    lo, hi = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
    if not 0 < hi - lo <= _MAX_VDSO:
        return None
    image = ctypes.string_at(lo, hi - lo)
    return image if image.startswith(_ELF_MAGIC) else None


def vdso_file(cache_dir: str | None = None) -> tuple[str, int] | None:
    """(a file holding this kernel's vDSO image, the image's size), written into the cache's private `vdso`
    directory if not there yet (symbolize/cache.py: a directory only we and root can change); None when there is
    no vDSO, or no such place to keep it."""
    image = own_vdso()
    if image is None:
        return None
    path = os.path.join(cache_dir or default_cache_dir(), "vdso", f"vdso-{hashlib.sha256(image).hexdigest()[:16]}.so")
    if read_cached(path, "vDSO image") != image:
        write_cached(path, image, "vDSO image")
        if read_cached(path, "vDSO image") != image:
            return None
    return path, len(image)
