"""The BPF compiler process: BCC (with its LLVM) compiles and loads the program here, then this process hands
the program and map file descriptors to the agent over a Unix socket and exits, so LLVM's ~100 MB never lives in
the agent. Run by agent/bpf_object.py as `python bpf_compile.py SOCKET_FD`, the request as JSON on stdin:

    {"text": C source, "cflags": [...], "functions": {name: "kprobe"|"uprobe"|"perf_event"|"tracepoint"}, "maps": [...]}

Functions named tracepoint__CATEGORY__EVENT are loaded too. "uprobe" functions are kprobe programs loaded for
uprobe_multi links (expected attach type BPF_TRACE_UPROBE_MULTI) when the kernel takes that (6.6 and later), else
as plain kprobe programs for one perf event per probe; the reply's "uprobe_multi" says which, for all of them
(their tail-called programs must be loaded alike). The reply is one message: JSON metadata (below) with
the descriptors attached, in the order it lists them. Compile errors go to stderr, exit status 1.
Imports only the standard library and bcc: it runs as a file, outside the aiflame package."""

import ctypes
import json
import socket
import sys
from typing import Any

BPF_TRACE_UPROBE_MULTI = 48  # enum bpf_attach_type


def _fields(leaf: Any) -> list[list[Any]]:
    return [[name, getattr(leaf, name).offset, getattr(leaf, name).size] for name, *_ in leaf._fields_]


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    req = json.load(sys.stdin)
    from bcc import BPF
    from bcc.libbcc import lib

    kinds = {"kprobe": BPF.KPROBE, "uprobe": BPF.KPROBE, "perf_event": BPF.PERF_EVENT, "tracepoint": BPF.TRACEPOINT}
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
        multi = False
        uprobes = [name for name, kind in functions.items() if kind == "uprobe"]
        if uprobes:
            try:  # the first one tells whether the kernel knows the attach type
                progs[uprobes[0]] = len(fds)
                fds.append(bpf.load_func(uprobes[0].encode(), BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI).fd)
                multi = True
            except Exception:
                del progs[uprobes[0]]
        for name, kind in functions.items():
            if name in progs:
                continue
            progs[name] = len(fds)
            if kind == "uprobe" and multi:
                fds.append(bpf.load_func(name.encode(), BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI).fd)
            else:
                fds.append(bpf.load_func(name.encode(), kinds[kind]).fd)
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
            fds.append(table.map_fd)
    except Exception as e:  # BCC raises bare Exception for compile and load failures
        print(f"aiflame-bpf-compile: {e}", file=sys.stderr)
        return 1
    socket.send_fds(sock, [json.dumps({"progs": progs, "maps": maps, "uprobe_multi": multi}).encode()], fds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
