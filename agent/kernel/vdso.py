"""The vDSO as a file, for the CFI unwinder: the kernel maps one vDSO image into every 64-bit process, with its
own .eh_frame, but no file on disk. The agent's copy (read from its own memory) is written once into the private
cache and stands for each target's [vdso] mapping of the same size, so walks go on through clock_gettime and
friends instead of stopping at them."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os

from aiflame.core.errors import Refused
from aiflame.core.safe_files import trusted_dir
from aiflame.symbolize.cache import default_cache_dir

log = logging.getLogger(__name__)

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
    directory if not there yet; None when there is no vDSO or no private place to write it (logged)."""
    image = own_vdso()
    if image is None:
        return None
    d = os.path.join(cache_dir or default_cache_dir(), "vdso")
    name = f"vdso-{hashlib.sha256(image).hexdigest()[:16]}.so"
    try:
        fd = trusted_dir(os.path.abspath(d), create=True, mode=0o700)
    except (Refused, OSError) as e:
        log.info("vDSO not described to the unwinder: %s: %s", d, e)
        return None
    try:
        try:
            if os.stat(name, dir_fd=fd).st_size == len(image):
                return os.path.join(d, name), len(image)  # named by its content, in a directory only we write
        except FileNotFoundError:
            pass
        tmp = f".tmp-{name}-{os.getpid()}"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        try:
            view = memoryview(image)
            while view:
                view = view[os.write(out, view):]
        finally:
            os.close(out)
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        return os.path.join(d, name), len(image)
    except OSError as e:
        log.info("vDSO not described to the unwinder: %s: %s", d, e)
        return None
    finally:
        os.close(fd)
