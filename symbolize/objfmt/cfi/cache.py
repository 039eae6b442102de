"""The on-disk cache of built tables: one file per table, keyed by build id (else the content's SHA-256), written
atomically and checked whole when read back (`encode_table`, `decode_table`), and `load_or_build`."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile

from aiflame.core.errors import Unreadable
from aiflame.core.safe_files import read_regular
from aiflame.symbolize.cache import default_cache_dir
from aiflame.symbolize.objfmt.cfi.build import Engine, _build, _Opened
from aiflame.symbolize.objfmt.cfi.fast import _fast_lib, _private_dir
from aiflame.symbolize.objfmt.cfi.table import (
    CFA_KINDS,
    MAX_ROWS,
    MAX_RULES,
    NOT_COVERED,
    RBP_KINDS,
    ROW,
    RULE,
    CfiStats,
    Rule,
    UnwindTable,
)

log = logging.getLogger(__name__)

_MAGIC = b"AIFLCFI\0"
_FORMAT_VERSION = 2  # bump whenever the rows a file gives could change
_HEAD = struct.Struct("<8sIIIII32s")  # magic, version, key, stats, rules, rows lengths, SHA-256 of the rest
_SAFE_KEY = frozenset("0123456789abcdefghijklmnopqrstuvwxyz-")


def cache_path(key: str, cache_dir: str | None = None) -> str:
    """The cache file of a table keyed `key` (a build id, or "sha256-" and the file's digest)."""
    if not key or len(key) > 128 or not set(key) <= _SAFE_KEY:
        raise ValueError(f"bad cache key {key!r}")
    return os.path.join(cache_dir or default_cache_dir(), "cfi", key + ".cfi")


def encode_table(key: str, table: UnwindTable) -> bytes:
    """The cache file's bytes: header, key, stats (JSON), rules, rows."""
    k = key.encode()
    st = json.dumps(table.stats.to_json(), sort_keys=True).encode()
    rules = table.rules_bytes()
    body = k + st + rules + table.rows
    head = _HEAD.pack(_MAGIC, _FORMAT_VERSION, len(k), len(st), len(table.rules), len(table),
                      hashlib.sha256(body).digest())
    return head + body


def decode_table(data: bytes, key: str, check_with_c: bool = True) -> UnwindTable:
    """Inverse of encode_table, checking everything a BPF loader relies on; ValueError when anything is off.
    The row checks run in the C engine when it is there (`check_with_c`), else in Python."""
    if len(data) < _HEAD.size:
        raise ValueError("short header")
    magic, version, klen, slen, nrules, nrows, digest = _HEAD.unpack_from(data)
    if magic != _MAGIC or version != _FORMAT_VERSION:
        raise ValueError("other format or version")
    if not 0 < nrules <= MAX_RULES or nrows > MAX_ROWS:
        raise ValueError("counts out of range")
    at = _HEAD.size
    if len(data) != at + klen + slen + nrules * RULE.size + nrows * ROW.size:
        raise ValueError("length mismatch")
    body = memoryview(data)[at:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("checksum mismatch")
    if bytes(body[:klen]) != key.encode():
        raise ValueError("other key")
    stats = CfiStats.from_json(json.loads(bytes(body[klen : klen + slen])))
    at = klen + slen
    rules = tuple(Rule(*r) for r in RULE.iter_unpack(body[at : at + nrules * RULE.size]))
    rows = bytes(body[at + nrules * RULE.size :])
    if rules[0] != NOT_COVERED or len(set(rules)) != nrules:
        raise ValueError("rules")
    if any(r.cfa_type >= len(CFA_KINDS) or r.rbp_type >= len(RBP_KINDS) for r in rules):
        raise ValueError("rule kinds")
    if (stats.rows, stats.rules) != (nrows, nrules):
        raise ValueError("stats disagree with the table")
    lib = _fast_lib() if check_with_c else None
    bad = _check_rows_py(rows, nrows, nrules) if lib is None else lib.cfi_check_rows(rows, nrows, nrules)
    if bad:
        raise ValueError(_ROW_PROBLEMS[bad])
    return UnwindTable(rows, rules, stats)


_ROW_PROBLEMS = {1: "rows not strictly increasing", 2: "spare field set", 3: "row rule indices",
                 4: "repeated rows"}


def _check_rows_py(rows: bytes, nrows: int, nrules: int) -> int:
    """cfi_check_rows of cfi_fast.c (0 or a _ROW_PROBLEMS key), for when the C engine is not there. memoryview
    slices and map() keep it at ~0.3 s for libtorch_cpu.so's 2.6 M rows; the C one takes ~5 ms."""
    if not nrows:
        return 0
    pcs, idx = memoryview(rows).cast("I")[::2], memoryview(rows).cast("H")[2::4]
    if not all(map(int.__lt__, pcs, pcs[1:])):
        return 1
    if rows[6::8] != bytes(nrows) or rows[7::8] != bytes(nrows):
        return 2
    if max(idx) >= nrules:
        return 3
    if any(map(int.__eq__, idx, idx[1:])):
        return 4
    return 3 if idx[0] == 0 or idx[nrows - 1] != 0 else 0


def _read_cached(path: str, key: str) -> UnwindTable | None:
    limit = _HEAD.size + 4096 + MAX_RULES * RULE.size + MAX_ROWS * ROW.size
    try:
        _private_dir(os.path.dirname(path), create=False)
        data = read_regular(path, limit, follow=False)
    except FileNotFoundError:
        return None
    except (OSError, Unreadable) as e:  # Refused among them
        log.debug("CFI cache %s ignored: %s", path, e)
        return None
    try:
        return decode_table(data, key)
    except (ValueError, TypeError, struct.error) as e:
        log.info("CFI cache %s is corrupt (%s); rebuilding", path, e)
        return None


def _write_cached(path: str, key: str, table: UnwindTable) -> None:
    """Atomic (temp file + rename); failures are logged and ignored: the cache only saves time."""
    tmp = ""
    try:
        _private_dir(os.path.dirname(path))
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".cfi", dir=os.path.dirname(path))
        with os.fdopen(fd, "wb") as f:
            f.write(encode_table(key, table))
        os.replace(tmp, path)
        tmp = ""
    except (OSError, Unreadable) as e:
        log.debug("CFI cache %s not written: %s", path, e)
    finally:
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _content_key(fd: int) -> str:
    h = hashlib.sha256()
    off = 0
    while chunk := os.pread(fd, 1 << 20, off):
        h.update(chunk)
        off += len(chunk)
    return "sha256-" + h.hexdigest()


def _build_id_key(o: _Opened) -> str | None:
    """The cache key of an opened file with a build id (one safe as a file name), else None."""
    bid = o.elf.build_id
    return bid if bid and set(bid) <= _SAFE_KEY else None


def load_cached(path: str | os.PathLike[str], cache_dir: str | None = None) -> UnwindTable | None:
    """The table of `path` when the cache holds it, else None; never builds. Files with a build id only: the key
    of one without is a hash of its whole content, no quicker than a build."""
    with _Opened(path) as o:
        key = _build_id_key(o)
        return _read_cached(cache_path(key, cache_dir), key) if key else None


def load_or_build(path: str | os.PathLike[str], cache_dir: str | None = None, engine: Engine = "auto") -> UnwindTable:
    """The table of `path` from the cache under `cache_dir` (default: default_cache_dir()/cfi), keyed by
    build id or else the SHA-256 of the content; built and stored when absent, stale or corrupt."""
    with _Opened(path) as o:
        key = _build_id_key(o) or _content_key(o.fd)
        cpath = cache_path(key, cache_dir)
        table = _read_cached(cpath, key)
        if table is None:
            table = _build(o.inp, engine)
            _write_cached(cpath, key, table)
        return table
