"""The C engine: `cfi_fast.c` (next to this file) compiled on first use into a private directory of the cache,
loaded once per process and called through ctypes. It builds the same tables as the Python reference (parse.py),
and checks the rows of a table read back from the cache."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import stat
import subprocess
import tempfile
import threading
from array import array

from aiflame.core.errors import AiflameError, HostError, InternalError, Refused, Unreadable
from aiflame.core.safe_files import trusted_dir
from aiflame.symbolize.cache import default_cache_dir
from aiflame.symbolize.objfmt.cfi.parse import _Input
from aiflame.symbolize.objfmt.cfi.table import CFA_KINDS, RBP_KINDS, ROW, RULE, CfiStats, Rule, UnwindTable

log = logging.getLogger(__name__)

_C_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cfi_fast.c")
_C_FLAGS = ("-O2", "-std=c11", "-shared", "-fPIC")
_N_STATS = 7 + len(CFA_KINDS) + len(RBP_KINDS)


class _CInput(ctypes.Structure):
    """struct cfi_input of cfi_fast.c."""

    _fields_ = [
        ("eh", ctypes.c_char_p), ("eh_len", ctypes.c_uint64), ("eh_addr", ctypes.c_uint64),
        ("hdr", ctypes.c_char_p), ("hdr_len", ctypes.c_uint64), ("hdr_addr", ctypes.c_uint64),
        ("dbg", ctypes.c_char_p), ("dbg_len", ctypes.c_uint64),
        ("fd", ctypes.c_int64), ("ncode", ctypes.c_uint64), ("code", ctypes.POINTER(ctypes.c_uint64)),
        ("max_rows", ctypes.c_uint64),
    ]


class _CResult(ctypes.Structure):
    """struct cfi_result of cfi_fast.c."""

    _fields_ = [
        ("rows", ctypes.c_void_p), ("nrows", ctypes.c_uint64), ("rules", ctypes.c_void_p),
        ("nrules", ctypes.c_uint64), ("stats", ctypes.c_uint64 * _N_STATS), ("source", ctypes.c_char * 32),
        ("error", ctypes.c_char * 512),
    ]


class _FastState:
    """The compiled engine, loaded once per process; `error` says why it is not there."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tried = False
        self.lib: ctypes.CDLL | None = None
        self.error = ""


_fast_state = _FastState()


def _private_dir(path: str, create: bool = True) -> None:
    """Create `path` (0700) if needed; Refused unless only we (and root) can change it or any directory above
    it (core/safe_files.py trusted_dir): we load code from it, and a user who owns a directory on the way (a
    home directory kept by sudo) could otherwise swap in one of theirs. Paths under it are then stable."""
    try:
        os.close(trusted_dir(os.path.abspath(path), create=create, mode=0o700))
    except Refused as e:
        raise Refused(f"{path}: not a private directory ({e})") from None
    except OSError as e:
        raise Refused(f"{path}: not a private directory ({e.strerror or e})") from None


def _compiled_path(cache_dir: str | None = None) -> str:
    """Where the engine built from this exact source and these flags lives."""
    with open(_C_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + " ".join(_C_FLAGS).encode()).hexdigest()[:16]
    return os.path.join(cache_dir or default_cache_dir(), "cfi", f"cfi_fast-{digest}.so")


def _compile(so: str) -> None:
    """cc the engine to `so` atomically (temp name + rename), so a concurrent loader never sees half a file."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-cfi_fast-", suffix=".so", dir=os.path.dirname(so))
    os.close(fd)
    try:
        # -pipe and TMPDIR in the cache directory: under the daemon's unit the rest of the file system is read-only
        env = {**os.environ, "TMPDIR": os.path.dirname(so)}
        proc = subprocess.run(["cc", "-pipe", *_C_FLAGS, "-o", tmp, _C_SOURCE], capture_output=True, text=True,
                              timeout=120, env=env)
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["?"])[0]
            raise HostError(f"cc failed on {_C_SOURCE}: {first}")
        os.replace(tmp, so)
        tmp = ""
    finally:
        if tmp:
            os.unlink(tmp)


def _load_fast(cache_dir: str | None = None) -> ctypes.CDLL:
    so = _compiled_path(cache_dir)
    _private_dir(os.path.dirname(so))
    try:
        st = os.lstat(so)
    except FileNotFoundError:
        _compile(so)
        st = os.lstat(so)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise Refused(f"{so}: not a regular file only we can write to")
    lib = ctypes.CDLL(so)
    lib.cfi_build.argtypes = [ctypes.POINTER(_CInput), ctypes.POINTER(_CResult)]
    lib.cfi_build.restype = ctypes.c_int
    lib.cfi_free.argtypes = [ctypes.POINTER(_CResult)]
    lib.cfi_free.restype = None
    lib.cfi_sizes.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
    lib.cfi_sizes.restype = None
    lib.cfi_check_rows.argtypes = [ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64]
    lib.cfi_check_rows.restype = ctypes.c_int
    lib.cfi_renumber.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64]
    lib.cfi_renumber.restype = ctypes.c_int
    lib.cfi_page_index.argtypes = [ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint,
                                   ctypes.c_void_p, ctypes.c_uint64]
    lib.cfi_page_index.restype = ctypes.c_uint64
    sizes = (ctypes.c_uint64 * 2)()
    lib.cfi_sizes(sizes)
    if tuple(sizes) != (ctypes.sizeof(_CInput), ctypes.sizeof(_CResult)):
        raise InternalError(f"{so}: struct sizes {tuple(sizes)} differ from fast.py's")
    return lib


def _fast_lib() -> ctypes.CDLL | None:
    """The C engine, compiled on first use; None (with the reason logged once) when it cannot be had."""
    s = _fast_state
    with s.lock:
        if not s.tried:
            s.tried = True
            try:
                s.lib = _load_fast()
            except (OSError, subprocess.SubprocessError, AiflameError) as e:
                s.error = str(e)
                log.warning("CFI C engine unavailable, using the slower Python one: %s", e)
        return s.lib


def _build_c(lib: ctypes.CDLL, inp: _Input) -> UnwindTable:
    flat = [v for seg in inp.code for v in seg]
    code = (ctypes.c_uint64 * max(1, len(flat)))(*flat)
    cin = _CInput(inp.eh, len(inp.eh), inp.eh_addr, inp.hdr, len(inp.hdr), inp.hdr_addr, inp.dbg, len(inp.dbg),
                  inp.fd, len(inp.code), code, inp.max_rows)
    res = _CResult()
    if lib.cfi_build(ctypes.byref(cin), ctypes.byref(res)) != 0:
        raise Unreadable(res.error.decode("utf-8", "replace"))
    try:
        rows = ctypes.string_at(res.rows, res.nrows * ROW.size) if res.nrows else b""
        packed = ctypes.string_at(res.rules, res.nrules * RULE.size)
    finally:
        lib.cfi_free(ctypes.byref(res))
    rules = tuple(Rule(*r) for r in RULE.iter_unpack(packed))
    st = list(res.stats)
    n = len(CFA_KINDS)
    stats = CfiStats(res.source.decode(), st[0], st[1], st[2], st[3], st[4], st[5], st[6], tuple(st[7 : 7 + n]),
                     tuple(st[7 + n :]))
    return UnwindTable(rows, rules, stats)



def renumber_rules(rows: bytearray, rules: array[int]) -> bool | None:
    """Rewrite each row's rule index i (rows as ROW packs them) to rules[i], in place, in C: True, False when an
    index is out of range, None when the C engine is not there (the caller does it in Python)."""
    lib = _fast_lib()
    if lib is None:
        return None
    buf = (ctypes.c_char * len(rows)).from_buffer(rows)
    table = (ctypes.c_uint16 * len(rules)).from_buffer(rules) if rules else None
    return bool(lib.cfi_renumber(buf, len(rows) // ROW.size, table, len(rules)) == 0)


def page_starts(rows: bytes, base: int, shift: int, npages: int) -> tuple[array[int], int] | None:
    """(the first row at or above each of npages + 1 page starts from `base`, the most rows in one page), in C;
    None when the C engine is not there."""
    lib = _fast_lib()
    if lib is None:
        return None
    index = array("I", bytes(4 * (npages + 1)))
    buf = (ctypes.c_uint32 * len(index)).from_buffer(index)
    most = lib.cfi_page_index(rows, len(rows) // ROW.size, base, shift, buf, npages)
    return index, int(most)
