"""The compile cache of BPF objects: BCC compiles a program text once per host and toolchain; later loads create
the maps and load the programs with bpf(2) directly (no BCC, no clang: tens of milliseconds instead of seconds).

The compiler process (bpf_compile.py) describes what it loaded: each program's instructions as BCC produced them,
map references turned into map indices, each map as the kernel reports it, the maps' BTF, and its reply to the
agent with map indices for fds. An entry holds that description, under a key over everything the output depends
on that is known before compiling: the request (text, cflags, programs, maps), the headers in the -I directories,
the compiler script, the kernel (release and build), the Python running the compiler. The toolchain (BCC, LLVM,
libbpf, kernel headers) is checked when an entry is used: it records the files the compile used (size, mtime,
inode), and a file changed since is a miss.

Entries are code the kernel runs as root: they live in a directory only root can change, all the way up
(core/safe_files.trusted_dir), are written through a temporary file renamed into place, and are read only when
they are regular files we own that nobody else can write. An entry that is truncated, corrupt or does not load is
a miss: the caller compiles and the entry is replaced. $AIFLAME_BPF_CACHE=off turns the cache off; an absolute
path puts it there instead of /var/cache/aiflame/bpf (the daemon unit's CacheDirectory)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
import stat
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiflame.agent.kernel import bpf_sys
from aiflame.core.errors import Refused, Unreadable
from aiflame.core.safe_files import OutputDir, open_regular, trusted_dir

__all__ = ["DEFAULT_DIR", "ENV", "BpfCache", "cache_key", "instantiate", "load_order", "parse_entry",
           "serialize_entry"]

log = logging.getLogger(__name__)

ENV = "AIFLAME_BPF_CACHE"
DEFAULT_DIR = "/var/cache/aiflame/bpf"
MAGIC = b"aiflame-bpf-cache 1\n"
SUFFIX = ".bpfc"
MAX_ENTRY_BYTES = 64 << 20
KEEP_ENTRIES = 32  # the most recently used; older ones (other kernels, old options) are removed on a write
COMPILER = Path(__file__).with_name("bpf_compile.py")
LD_IMM64, BPF_PSEUDO_MAP_FD = 0x18, 1


def cache_key(request: dict[str, Any]) -> str:
    """The entry name for a compile request {text, cflags, functions, maps}."""
    h = hashlib.sha256(MAGIC)

    def part(b: bytes) -> None:
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)

    part(json.dumps(request, sort_keys=True).encode())
    part(COMPILER.read_bytes())
    uname = os.uname()
    part(f"{uname.release}\0{uname.version}\0{uname.machine}\0{sys.version}\0{os.path.realpath(sys.executable)}"
         .encode())
    for flag in request.get("cflags", []):
        if flag.startswith("-I"):  # the program's #include "..." come from these
            d = Path(flag[2:])
            for header in sorted(d.glob("*.h")):
                part(header.name.encode())
                part(header.read_bytes())
    return h.hexdigest()


def serialize_entry(key: str, entry: dict[str, Any]) -> bytes:
    body = json.dumps({"key": key, **entry}, separators=(",", ":")).encode()
    return MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def parse_entry(data: bytes, key: str) -> dict[str, Any]:
    """The entry in `data`, checked whole (digest, key, shape); Unreadable otherwise."""
    if not data.startswith(MAGIC):
        raise Unreadable("not a cache entry of this format")
    digest, nl, body = data[len(MAGIC):].partition(b"\n")
    if not nl or hashlib.sha256(body).hexdigest().encode() != digest:
        raise Unreadable("digest mismatch (truncated or altered)")
    try:
        entry = json.loads(body)
    except ValueError:
        raise Unreadable("not JSON") from None
    if not isinstance(entry, dict) or entry.get("key") != key:
        raise Unreadable("written for another key")
    _check_shape(entry)
    return entry


def _ints(d: Any, *names: str) -> None:
    for n in names:
        if not isinstance(d[n], int) or isinstance(d[n], bool) or not 0 <= d[n] < 1 << 64:
            raise Unreadable(f"field {n} is not a count")


def _check_shape(e: dict[str, Any]) -> None:
    try:
        if not isinstance(e["license"], str) or not isinstance(e["btf"], list) or not e["progs"]:
            raise Unreadable("missing parts")
        _ints(e, "kern_version")
        for m in e["maps"]:
            _ints(m, "type", "key_size", "value_size", "max_entries", "flags", "map_extra", "btf_key", "btf_value")
            if not isinstance(m["name"], str) or not isinstance(m["btf"], int) or not -1 <= m["btf"] < len(e["btf"]):
                raise Unreadable("bad map")
        for p in e["progs"]:
            _ints(p, "type", "attach_type")
            if "verified_insns" in p:  # entries of older compilers lack it
                _ints(p, "verified_insns")
            if not all(isinstance(p[k], str) for k in ("name", "kname", "insns")):
                raise Unreadable("bad program")
        reply = e["reply"]
        if sorted(reply["progs"].values()) != list(range(len(e["progs"]))):
            raise Unreadable("reply names other programs")
        for m in reply["maps"].values():
            _ints(m, "type", "max_entries", "key_size", "value_size")
            if not isinstance(m["map"], int) or not 0 <= m["map"] < len(e["maps"]):
                raise Unreadable("reply names another map")
            if not all(isinstance(f, list) and len(f) == 3 for f in m["fields"]):
                raise Unreadable("bad fields")
        if not isinstance(reply["uprobe_multi"], bool) or not e["toolchain"]:
            raise Unreadable("missing parts")
        for t in e["toolchain"]:
            if not (isinstance(t, list) and len(t) == 4 and isinstance(t[0], str)):
                raise Unreadable("bad toolchain file")
    except (KeyError, TypeError, AttributeError):
        raise Unreadable("missing or mistyped fields") from None


def toolchain_changed(entry: dict[str, Any]) -> str:
    """The first toolchain file the entry was compiled with that has changed since ("" when none has)."""
    for path, size, mtime_ns, ino in entry["toolchain"]:
        try:
            st = os.stat(path)
        except OSError:
            return str(path)
        if (st.st_size, st.st_mtime_ns, st.st_ino) != (size, mtime_ns, ino):
            return str(path)
    return ""


def _patch_maps(code: bytearray, map_fds: list[int]) -> None:
    """Each map reference's imm: its index in the entry -> the fd of the map created for it."""
    i = 0
    while i + 8 <= len(code):
        op, regs, _, imm = struct.unpack_from("<BBhi", code, i)
        if op == LD_IMM64:
            if regs >> 4 == BPF_PSEUDO_MAP_FD:
                if not 0 <= imm < len(map_fds):
                    raise Unreadable(f"map reference {imm} out of range")
                struct.pack_into("<i", code, i + 4, map_fds[imm])
            i += 16
        else:
            i += 8


def instantiate(entry: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """Create the entry's maps and load its programs: (the compiler's reply, its descriptors), as a compile
    would hand them over. OSError when the kernel refuses something (Unreadable for a bad entry); nothing
    is left open then."""
    opened: list[int] = []
    try:
        btf_fds = []
        for blob in entry["btf"]:
            btf_fds.append(bpf_sys.btf_load(base64.b64decode(blob, validate=True)))
            opened.append(btf_fds[-1])
        map_fds = []
        for m in entry["maps"]:
            map_fds.append(bpf_sys.map_create(
                m["type"], m["key_size"], m["value_size"], m["max_entries"], m["flags"], m["name"],
                btf_fd=btf_fds[m["btf"]] if m["btf"] >= 0 else 0, btf_key_type_id=m["btf_key"],
                btf_value_type_id=m["btf_value"], map_extra=m["map_extra"]))
            opened.append(map_fds[-1])
        codes = []
        for p in entry["progs"]:
            code = bytearray(base64.b64decode(p["insns"], validate=True))
            if not code or len(code) % 8:
                raise Unreadable(f"program {p['name']}: {len(code)} bytes")
            _patch_maps(code, map_fds)
            codes.append(bytes(code))
        prog_fds = _load_programs(entry, codes, opened)
    except binascii.Error:
        bpf_sys.close_fds(opened)
        raise Unreadable("bad base64") from None
    except BaseException:
        bpf_sys.close_fds(opened)
        raise
    reply = entry["reply"]
    fds = list(prog_fds)
    maps: dict[str, dict[str, Any]] = {}
    handed = set()
    for name, m in reply["maps"].items():
        maps[name] = {k: v for k, v in m.items() if k != "map"} | {"fd": len(fds)}
        fds.append(map_fds[m["map"]])
        handed.add(m["map"])
    # The programs hold the maps they use; the BTF is held by the maps made with it.
    bpf_sys.close_fds(btf_fds + [fd for i, fd in enumerate(map_fds) if i not in handed])
    return {"progs": dict(reply["progs"]), "maps": maps, "uprobe_multi": reply["uprobe_multi"]}, fds


def load_order(progs: list[dict[str, Any]]) -> list[int]:
    """The programs' indices in the order to load them: the costliest to verify first (the compile recorded what
    each cost, in instructions walked; the longest first where it did not), so that on parallel threads none
    of the costly ones starts last."""
    return sorted(range(len(progs)), key=lambda i: (-progs[i].get("verified_insns", 0), -len(progs[i]["insns"])))


def _load_programs(entry: dict[str, Any], codes: list[bytes], opened: list[int]) -> list[int]:
    """Load every program, on parallel threads (each is verified on its own, and the kernel's verifier is most
    of a cached start). All are loaded before this returns, as a compile hands them over: every target is
    probed at once (libc's exit), so the probes' programs are needed from its first library open. The fds go to
    `opened`; the first failure is raised."""
    def one(i: int) -> int:
        p = entry["progs"][i]
        return bpf_sys.prog_load(p["type"], codes[i], entry["license"], name=p["kname"],
                                 kern_version=entry["kern_version"], expected_attach_type=p["attach_type"],
                                 explain=True)

    fds: dict[int, int] = {}
    errors: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=max(1, min(len(codes), os.cpu_count() or 1))) as pool:
        futures = {i: pool.submit(one, i) for i in load_order(entry["progs"])}
        for i, f in futures.items():
            try:
                fds[i] = f.result()
                opened.append(fds[i])
            except BaseException as e:  # noqa: BLE001, PERF203 - every load is waited for, its fd closed
                errors.append(e)
    if errors:
        raise errors[0]
    return [fds[i] for i in range(len(codes))]


class BpfCache:
    """The cache directory (None: off). `get` and `put` never raise for what is on disk: a problem there is a
    miss, or an entry not written, logged."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._refused = False

    @classmethod
    def from_env(cls) -> BpfCache:
        value = os.environ.get(ENV, "").strip()
        if value.lower() in ("off", "0", "no", "false"):
            return cls(None)
        return cls(value or DEFAULT_DIR)

    def _open(self) -> OutputDir | None:
        if self.path is None or self._refused:
            return None
        try:
            return OutputDir.adopt(trusted_dir(self.path, mode=0o700), self.path)
        except (Refused, OSError) as e:
            self._refused = True
            log.warning("not caching compiled BPF programs: %s", e)
            return None

    def get(self, key: str) -> dict[str, Any] | None:
        """The entry for `key` when there is a usable one."""
        d = self._open()
        if d is None:
            return None
        name = key + SUFFIX
        with d:
            try:
                fd, st = open_regular(name, follow=False, dir_fd=d.fd)
            except FileNotFoundError:
                return None
            except (Refused, OSError) as e:
                log.warning("BPF cache entry %s/%s refused: %s", d.path, name, e)
                return None
            try:
                if st.st_uid != os.geteuid() or st.st_mode & 0o022 or st.st_nlink != 1:
                    log.warning("BPF cache entry %s/%s refused: not a file only we can write", d.path, name)
                    return None
                if st.st_size > MAX_ENTRY_BYTES:
                    raise Unreadable(f"{st.st_size} bytes")
                with os.fdopen(os.dup(fd), "rb") as f:
                    data = f.read(MAX_ENTRY_BYTES + 1)
                entry = parse_entry(data, key)
            except (Unreadable, OSError) as e:
                log.warning("BPF cache entry %s/%s unusable (%s): compiling again", d.path, name, e)
                return None
            finally:
                os.close(fd)
            changed = toolchain_changed(entry)
            if changed:
                log.info("BPF cache entry %s/%s: %s changed since: compiling again", d.path, name, changed)
                return None
            try:
                os.utime(name, dir_fd=d.fd, follow_symlinks=False)  # recently used: kept by _prune
            except OSError:
                pass
            return entry

    def put(self, key: str, entry: dict[str, Any]) -> None:
        """Store `entry` (from the compiler) as `key`'s, replacing any there."""
        d = self._open()
        if d is None:
            return
        with d:
            try:
                d.write_atomic(key + SUFFIX, serialize_entry(key, entry), mode=0o600)
                self._prune(d)
            except OSError as e:
                log.warning("cannot write the BPF cache entry in %s: %s", d.path, e)

    @staticmethod
    def _prune(d: OutputDir) -> None:
        aged: list[tuple[int, str]] = []
        for name in os.listdir(d.fd):
            if name.endswith(SUFFIX):
                try:
                    st = os.stat(name, dir_fd=d.fd, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    aged.append((st.st_mtime_ns, name))
        for _, name in sorted(aged, reverse=True)[KEEP_ENTRIES:]:
            d.unlink(name)
