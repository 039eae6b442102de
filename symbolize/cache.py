"""On-disk cache of resolved symbols, one gzip'd JSON file per binary (keyed by build id), and beside it the
binary's function symbols as a SymbolIndex file (`KEY.sym`, symbolize/symindex.py) for offsets not yet resolved.

A later agent process symbolizing the same binary reads this instead of parsing ELF and DWARF again. The cache
is only an accelerator: a missing, unreadable, corrupt or other-version file reads as empty (and is rewritten
by the next store); writes are atomic (temp file + rename) and their failures are ignored.

Format, version 2 (an offset no symbol covers is stored as `+0xOFFSET`, see native.py; version 1 said
`[unknown]`)::

    {"format": "aiflame-symbols", "version": 2, "key": KEY, "debug_file": PATH or null,
     "names": [NAME, ...], "files": [FILE, ...],
     "entries": [[FILE_OFFSET, NAME_INDEX, FRAME_KIND, FILE_INDEX, LINE], ...]}
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiflame.core.errors import Refused, Unreadable
from aiflame.core.model import FrameKind
from aiflame.core.safe_files import OutputDir, read_regular, trusted_dir
from aiflame.symbolize.symindex import SymbolIndex

__all__ = ["FORMAT", "VERSION", "CachedSymbols", "Entry", "SymbolCache", "default_cache_dir", "read_cached",
           "read_json_gz", "write_cached", "write_json_gz"]

log = logging.getLogger(__name__)

FORMAT = "aiflame-symbols"
VERSION = 2

Entry = tuple[str, int, str, int]
"""A resolved file offset: (name, FrameKind value, source file, line)."""

_KINDS = frozenset(int(k) for k in FrameKind)
_SAFE_KEY = re.compile(r"^[0-9A-Za-z][0-9A-Za-z._-]{0,127}$")
MAX_FILE_BYTES = 1 << 30  # a cache file larger than this is not one we wrote


def default_cache_dir() -> str:
    """$AIFLAME_CACHE, else ~/.cache/aiflame/symbols."""
    env = os.environ.get("AIFLAME_CACHE")
    if env:
        return env
    return os.path.join(os.path.expanduser("~"), ".cache", "aiflame", "symbols")


def read_cached(path: str, what: str) -> bytes | None:
    """The bytes of cache file `path`; None (logged) when it is absent or unreadable, or when a directory it lies
    in could be changed by someone else than us or root (core/safe_files.py trusted_dir: what such a directory
    holds is nobody's cache we should trust, or read as root)."""
    try:
        os.close(trusted_dir(os.path.abspath(os.path.dirname(path)), create=False))
        return read_regular(path, MAX_FILE_BYTES, follow=False)
    except FileNotFoundError:
        return None
    except (OSError, Refused) as e:
        log.debug("%s %s unreadable: %s", what, path, e)
        return None


def write_cached(path: str, data: bytes | Iterable[bytes | bytearray | memoryview], what: str) -> None:
    """Write `data` (bytes, or pieces in turn) to cache file `path` atomically (temp file + rename, relative to the
    directory's descriptor), into a directory only we and root can change (created 0700 as needed); failures are
    logged and ignored."""
    try:
        with OutputDir.adopt(trusted_dir(os.path.abspath(os.path.dirname(path))), os.path.dirname(path)) as d:
            d.write_atomic(os.path.basename(path), data, 0o600)
    except (OSError, Refused) as e:
        log.debug("%s %s not written: %s", what, path, e)


def read_json_gz(path: str, what: str) -> object | None:
    """The JSON document in gzip cache file `path`; None (logged) when it is absent, unreadable or corrupt (see
    read_cached)."""
    raw = read_cached(path, what)
    if raw is None:
        return None
    try:
        doc: object = json.loads(gzip.decompress(raw))
        return doc
    except (OSError, EOFError, zlib.error, ValueError) as e:
        log.debug("%s %s ignored: %r", what, path, e)
        return None


def write_json_gz(path: str, doc: object, what: str) -> None:
    """Write `doc` as gzip'd JSON to cache file `path` (see write_cached)."""
    write_cached(path, gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), compresslevel=3), what)


@dataclass
class CachedSymbols:
    """What one cache file holds: resolved entries, and the debug file (if any) they were resolved with."""

    entries: dict[int, Entry] = field(default_factory=dict)
    debug_file: str | None = None


class SymbolCache:
    """Per-binary files under `cache_dir` (default: `default_cache_dir()`)."""

    def __init__(self, cache_dir: str | None = None) -> None:
        self.dir = cache_dir or default_cache_dir()

    def path_for(self, key: str, suffix: str = ".json.gz") -> str:
        """The file holding `key`; keys that are not plain names (build ids are) are hashed."""
        if not _SAFE_KEY.match(key):
            key = "h-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        return os.path.join(self.dir, key[:2], key + suffix)

    def load(self, key: str) -> CachedSymbols | None:
        """The cached symbols of `key`, or None when absent or unusable."""
        path = self.path_for(key)
        doc = read_json_gz(path, "symbol cache")
        if doc is None:
            return None
        try:
            return _decode(doc, key)
        except (ValueError, TypeError, KeyError, IndexError) as e:
            log.debug("symbol cache %s ignored: %r", path, e)
            return None

    def store(self, key: str, symbols: CachedSymbols) -> None:
        """Write all of `symbols` for `key` atomically; failures are logged and ignored."""
        write_json_gz(self.path_for(key), _encode(key, symbols), "symbol cache")


    def load_index(self, key: str) -> SymbolIndex | None:
        """The saved function symbols of `key` (symbolize/symindex.py), or None when absent or unusable."""
        path = self.path_for(key, ".sym")
        raw = read_cached(path, "symbol index")
        if raw is None:
            return None
        try:
            return SymbolIndex.from_bytes(raw)
        except Unreadable as e:
            log.debug("symbol index %s ignored: %s", path, e)
            return None

    def store_index(self, key: str, index: SymbolIndex) -> None:
        """Save `index` for `key` atomically; failures are logged and ignored."""
        write_cached(self.path_for(key, ".sym"), index.pieces(), "symbol index")


def _encode(key: str, symbols: CachedSymbols) -> dict[str, object]:
    names: dict[str, int] = {}
    files: dict[str, int] = {}
    rows = []
    for off, (name, kind, file, line) in sorted(symbols.entries.items()):
        n = names.setdefault(name, len(names))
        fi = files.setdefault(file, len(files))
        rows.append([off, n, kind, fi, line])
    return {
        "format": FORMAT,
        "version": VERSION,
        "key": key,
        "debug_file": symbols.debug_file,
        "names": list(names),
        "files": list(files),
        "entries": rows,
    }


def _decode(doc: object, key: str) -> CachedSymbols | None:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        return None
    if doc.get("key") != key:
        return None  # a hash collision or a copied file: not ours
    names, files, rows, dbg = doc["names"], doc["files"], doc["entries"], doc.get("debug_file")
    if not (isinstance(names, list) and isinstance(files, list) and isinstance(rows, list)):
        return None
    if not all(isinstance(x, str) for x in names) or not all(isinstance(x, str) for x in files):
        return None
    if dbg is not None and not isinstance(dbg, str):
        return None
    entries: dict[int, Entry] = {}
    for row in rows:
        off, n, kind, fi, line = row
        if not all(type(x) is int for x in (off, n, kind, fi, line)) or min(n, fi) < 0 or kind not in _KINDS:
            return None
        entries[off] = (names[n], kind, files[fi], line)
    return CachedSymbols(entries, dbg)
