"""The BPF compiler process: BCC (with its LLVM) compiles and loads the program here, then this process hands
the program and map file descriptors to the agent over a Unix socket and exits, so LLVM's ~100 MB never lives in
the agent. Run by agent/bpf_object.py as `python bpf_compile.py SOCKET_FD`, the request as JSON on stdin:

    {"text": C source, "cflags": [...],
     "functions": {name: "kprobe"|"uprobe"|"uprobe_session"|"perf_event"|"tracepoint"}, "maps": [...]}

Functions named tracepoint__CATEGORY__EVENT are loaded too. "uprobe" functions are kprobe programs loaded for
uprobe_multi links (expected attach type BPF_TRACE_UPROBE_MULTI) when the kernel takes that (6.6 and later), else
as plain kprobe programs for one perf event per probe; the reply's "uprobe_multi" says which, for all of them
(their tail-called programs must be loaded alike). "uprobe_session" functions are loaded for uprobe session links
(BPF_TRACE_UPROBE_SESSION; the caller asks for them only where the kernel has them). The reply is one message:
JSON metadata (below) with the descriptors attached, in the order it lists them. Compile errors go to stderr,
exit status 1.

On stdout (stray output of BCC and LLVM goes to stderr instead) it writes, as JSON, what loading the same programs
without BCC takes (agent/kernel/bpf_cache.py keeps it): each program's instructions as BCC produced them, with
every map reference (ld_imm64, src_reg BPF_PSEUDO_MAP_FD) holding the map's index instead of its fd, and the
instructions the verifier walked to load it (what a load costs); each map as
the kernel describes it (type, sizes, flags, name, BTF type ids); the BTF the maps were created with; the reply
above with map indices for fds; and the toolchain files this compile used, to notice an upgrade. "cacheable" is
false (with the reason) when the programs hold something that list cannot carry (other pseudo sources, BPF calls).
Imports only the standard library and bcc: it runs as a file, outside the aiflame package."""

import base64
import ctypes
import json
import os
import re
import socket
import struct
import sys
from typing import Any

BPF_TRACE_UPROBE_MULTI, BPF_TRACE_UPROBE_SESSION = 48, 57  # enum bpf_attach_type
BPF_PSEUDO_MAP_FD = 1
LD_IMM64, CALL = 0x18, 0x85
_SYS_BPF, _OBJ_GET_INFO_BY_FD, _BTF_GET_FD_BY_ID = 321, 15, 19
# Map types holding other maps or kernel objects by BTF id: their creation takes more than an entry carries.
_UNCACHED_MAP_TYPES = {12, 13, 26}  # array_of_maps, hash_of_maps, struct_ops
TOOLCHAIN = re.compile(r"/lib(bcc|bpf|LLVM|clang)[^/]*\.so[^/]*$")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _InfoAttr(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_uint32), ("len", ctypes.c_uint32), ("info", ctypes.c_uint64)]


def _info(fd: int, size: int, buf: Any = None) -> bytes:
    """BPF_OBJ_GET_INFO_BY_FD: the kernel's bpf_*_info of `fd`, `size` bytes (into `buf` when given)."""
    buf = buf if buf is not None else ctypes.create_string_buffer(size)
    attr = _InfoAttr(fd, size, ctypes.addressof(buf))
    if _libc.syscall(_SYS_BPF, _OBJ_GET_INFO_BY_FD, ctypes.byref(attr), ctypes.sizeof(attr)) < 0:
        raise OSError(ctypes.get_errno(), "bpf obj info")
    return bytes(buf.raw[:attr.len])


def _btf_blob(btf_id: int) -> bytes:
    """The raw BTF the kernel holds as `btf_id` (bpf_btf_info: btf pointer, btf_size)."""
    attr = struct.pack("<I", btf_id).ljust(16, b"\0")
    fd = _libc.syscall(_SYS_BPF, _BTF_GET_FD_BY_ID, ctypes.c_char_p(attr), len(attr))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "bpf btf get fd")
    try:
        size = struct.unpack_from("<I", _info(fd, 32), 8)[0]
        data = ctypes.create_string_buffer(size)
        info = ctypes.create_string_buffer(struct.pack("<QI", ctypes.addressof(data), size), 32)
        _info(fd, 32, info)
        return data.raw
    finally:
        os.close(fd)


def _map_refs(code: bytes) -> tuple[list[tuple[int, int]], str]:
    """(offset of each map reference's imm, fd), and why `code` cannot be cached ("" when it can)."""
    refs: list[tuple[int, int]] = []
    i = 0
    while i < len(code):
        op, regs, _, imm = struct.unpack_from("<BBhi", code, i)
        src = regs >> 4
        if op == LD_IMM64:
            if src == BPF_PSEUDO_MAP_FD:
                refs.append((i + 4, imm))
            elif src:
                return refs, f"ld_imm64 with pseudo source {src}"
            i += 16
            continue
        if op == CALL and src:
            return refs, "a BPF-to-BPF call or kfunc"
        i += 8
    return refs, ""


def _verified_insns(prog_fd: int) -> int:
    """How many instructions the verifier walked to load the program (its fdinfo, Linux 5.16+; 0 if not there):
    what loading it again will cost, by which a cached load schedules its programs."""
    try:
        with open(f"/proc/self/fdinfo/{prog_fd}") as f:
            for line in f:
                if line.startswith("verified_insns:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _toolchain(bcc_file: str) -> list[list[Any]]:
    """The files this compile's output depends on beside its request: BCC (library and Python package), LLVM,
    libbpf, the kernel headers BCC compiles against; as [path, size, mtime_ns, inode]."""
    paths = {bcc_file, os.path.join(os.path.dirname(bcc_file), "version.py")}
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split(None, 5)[-1].strip() if line.count(" ") >= 5 else ""
            if TOOLCHAIN.search(path):
                paths.add(path)
    build = f"/lib/modules/{os.uname().release}/build"
    paths |= {f"{build}/Makefile", f"{build}/include/generated/autoconf.h",
              f"{build}/include/generated/uapi/linux/version.h"}
    out = []
    for p in sorted(paths):
        try:
            st = os.stat(p)
        except OSError:
            continue
        out.append([p, st.st_size, st.st_mtime_ns, st.st_ino])
    return out


def _cache_entry(bpf: Any, loaded: list[tuple[str, int, int, int]], reply: dict[str, Any],
                 map_fds: dict[str, int], bcc_file: str) -> dict[str, Any]:
    """What loading `loaded` [(name, prog type, expected attach type, fd)] again without BCC takes."""
    from bcc.libbcc import lib

    indices: dict[int, int] = {}  # map fd in this process -> index in "maps"
    progs = []
    why = ""
    for name, prog_type, attach_type, fd in loaded:
        code = bytearray(bpf.dump_func(name.encode()))
        refs, why = _map_refs(bytes(code))
        if why:
            break
        for at, map_fd in refs:
            struct.pack_into("<i", code, at, indices.setdefault(map_fd, len(indices)))
        kname = _info(fd, 80)[64:80].split(b"\0", 1)[0].decode()
        progs.append({"name": name, "kname": kname, "type": prog_type, "attach_type": attach_type,
                      "insns": base64.b64encode(code).decode(), "verified_insns": _verified_insns(fd)})
    if why:
        return {"cacheable": False, "why": why}
    out_maps = {}
    for name, m in reply["maps"].items():
        out_maps[name] = dict(m)
        del out_maps[name]["fd"]
        out_maps[name]["map"] = indices.setdefault(map_fds[name], len(indices))
    btfs: dict[int, int] = {}  # kernel BTF id -> index in "btf"
    maps = []
    for map_fd in indices:  # in index order
        info = _info(map_fd, 88)
        mtype, _, key_size, value_size, max_entries, flags = struct.unpack_from("<6I", info, 0)
        vmlinux_value, = struct.unpack_from("<I", info, 44)
        btf_id, btf_key, btf_value = struct.unpack_from("<3I", info, 64)
        map_extra, = struct.unpack_from("<Q", info, 80)
        if mtype in _UNCACHED_MAP_TYPES or vmlinux_value:
            return {"cacheable": False, "why": f"map type {mtype}"}
        maps.append({"name": info[24:40].split(b"\0", 1)[0].decode(), "type": mtype, "key_size": key_size,
                     "value_size": value_size, "max_entries": max_entries, "flags": flags, "map_extra": map_extra,
                     "btf": btfs.setdefault(btf_id, len(btfs)) if btf_id else -1, "btf_key": btf_key,
                     "btf_value": btf_value})
    return {"cacheable": True, "license": lib.bpf_module_license(bpf.module).decode(),
            "kern_version": lib.bpf_module_kern_version(bpf.module),
            "btf": [base64.b64encode(_btf_blob(i)).decode() for i in btfs], "maps": maps, "progs": progs,
            "reply": {"progs": {name: i for i, (name, *_) in enumerate(loaded)}, "maps": out_maps,
                      "uprobe_multi": reply["uprobe_multi"]},
            "toolchain": _toolchain(bcc_file)}


def _fields(leaf: Any) -> list[list[Any]]:
    return [[name, getattr(leaf, name).offset, getattr(leaf, name).size] for name, *_ in leaf._fields_]


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    req = json.load(sys.stdin)
    cache_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what BCC or LLVM print goes to stderr; stdout carries the cache entry only
    import bcc
    from bcc import BPF
    from bcc.libbcc import lib

    kinds = {"kprobe": BPF.KPROBE, "uprobe": BPF.KPROBE, "uprobe_session": BPF.KPROBE, "perf_event": BPF.PERF_EVENT,
             "tracepoint": BPF.TRACEPOINT}
    try:
        bpf = BPF(text=req["text"], cflags=req["cflags"])
        functions = dict(req["functions"])
        for i in range(lib.bpf_num_functions(bpf.module)):
            name = lib.bpf_function_name(bpf.module, i).decode()
            if name.startswith("tracepoint__"):
                functions[name] = "tracepoint"
        fds: list[int] = []
        progs: dict[str, int] = {}
        maps: dict[str, dict[str, Any]] = {}
        loaded: list[tuple[str, int, int, int]] = []  # (name, prog type, expected attach type, fd), in load order
        multi = False
        uprobes = [name for name, kind in functions.items() if kind == "uprobe"]
        if uprobes:
            try:  # the first one tells whether the kernel knows the attach type
                progs[uprobes[0]] = len(fds)
                fds.append(bpf.load_func(uprobes[0].encode(), BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI).fd)
                loaded.append((uprobes[0], BPF.KPROBE, BPF_TRACE_UPROBE_MULTI, fds[-1]))
                multi = True
            except Exception:
                del progs[uprobes[0]]
        for name, kind in functions.items():
            if name in progs:
                continue
            progs[name] = len(fds)
            attach_type = (BPF_TRACE_UPROBE_SESSION if kind == "uprobe_session" else
                           BPF_TRACE_UPROBE_MULTI if kind == "uprobe" and multi else 0)
            if attach_type:
                fds.append(bpf.load_func(name.encode(), BPF.KPROBE, attach_type=attach_type).fd)
            else:
                fds.append(bpf.load_func(name.encode(), kinds[kind]).fd)
            loaded.append((name, kinds[kind], attach_type, fds[-1]))
        multi = multi or "uprobe_session" in functions.values()  # session links are uprobe_multi links
        map_fds: dict[str, int] = {}
        for name in req["maps"]:
            try:
                table = bpf[name]
            except KeyError:
                continue  # not in this build (e.g. the runtime probes' maps without probes)
            map_id = lib.bpf_table_id(bpf.module, name.encode())
            leaf = getattr(table, "sLeaf", table.Leaf)  # per-CPU maps: BCC's Leaf is an array of one per CPU
            maps[name] = {"fd": len(fds), "type": lib.bpf_table_type_id(bpf.module, map_id),
                          "max_entries": lib.bpf_table_max_entries_id(bpf.module, map_id),
                          "key_size": ctypes.sizeof(table.Key), "value_size": ctypes.sizeof(leaf),
                          "fields": _fields(leaf) if hasattr(leaf, "_fields_") else []}
            map_fds[name] = table.map_fd
            fds.append(table.map_fd)
    except Exception as e:  # BCC raises bare Exception for compile and load failures
        print(f"aiflame-bpf-compile: {e}", file=sys.stderr)
        return 1
    reply = {"progs": progs, "maps": maps, "uprobe_multi": multi}
    socket.send_fds(sock, [json.dumps(reply).encode()], fds)
    if req.get("cache"):
        try:
            entry = _cache_entry(bpf, loaded, reply, map_fds, bcc.__file__)
        except Exception as e:  # the programs are handed over: a failure here costs only the cache entry
            entry = {"cacheable": False, "why": f"{type(e).__name__}: {e}"}
        json.dump(entry, cache_out)
    cache_out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
