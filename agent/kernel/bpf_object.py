"""A compiled and loaded BPF object, held as plain file descriptors: programs by name, maps with their sizes,
and the links attaching programs to perf events and tracepoints. The compile runs in a child process
(agent/bpf_compile.py), so BCC's LLVM is never loaded into the agent; once per host and program, after which
agent/kernel/bpf_cache.py loads the same programs and maps from its cache entry without compiling."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiflame.agent.kernel import bpf_cache, bpf_sys
from aiflame.agent.kernel.bpf_cache import BpfCache
from aiflame.agent.kernel.bpf_sys import PerfEventAttr
from aiflame.core.errors import HostError, Unreadable

log = logging.getLogger(__name__)

COMPILER = Path(__file__).with_name("bpf_compile.py")
BPF_MAP_TYPE_PERCPU_HASH, BPF_MAP_TYPE_PERCPU_ARRAY, BPF_MAP_TYPE_LRU_PERCPU_HASH = 5, 6, 10
_PERCPU = {BPF_MAP_TYPE_PERCPU_HASH, BPF_MAP_TYPE_PERCPU_ARRAY, BPF_MAP_TYPE_LRU_PERCPU_HASH}
COMPILE_TIMEOUT_S = 300
COMPILING = "compiling the BPF program (first run on this host with these options, ~10 s)"


@dataclass
class BpfMap:
    name: str
    fd: int
    type: int
    max_entries: int
    key_size: int
    value_size: int
    fields: list[tuple[str, int, int]]  # the value's C struct: (field, offset, size)

    @property
    def percpu_values(self) -> int:
        """How many values a lookup returns: one per possible CPU for per-CPU maps, else one."""
        return bpf_sys.possible_cpus() if self.type in _PERCPU else 1

    def lookup(self, key: bytes) -> bytes | None:
        n = self.percpu_values
        return bpf_sys.map_lookup(self.fd, key, ((self.value_size + 7) & ~7) * n if n > 1 else self.value_size)

    def lookup_percpu(self, key: bytes) -> list[bytes]:
        raw = self.lookup(key)
        if raw is None:
            return []
        step = (self.value_size + 7) & ~7
        return [raw[i:i + self.value_size] for i in range(0, len(raw), step)]

    def update(self, key: bytes, value: bytes) -> None:
        bpf_sys.map_update(self.fd, key, value)

    def delete(self, key: bytes) -> bool:
        return bpf_sys.map_delete(self.fd, key)

    def keys(self) -> list[bytes]:
        return bpf_sys.map_keys(self.fd, self.key_size)

    def clear(self) -> None:
        for k in self.keys():
            self.delete(k)


@dataclass
class BpfObject:
    progs: dict[str, int]
    maps: dict[str, BpfMap]
    uprobe_multi: bool = False  # "uprobe" programs take uprobe_multi links (else one perf event per probe)
    from_cache: bool = False  # loaded from the compile cache (else compiled now)
    _links: dict[str, list[int]] = field(default_factory=dict)  # attachment name -> link and perf fds

    def attach_perf_event(self, prog: str, ev_type: int, ev_config: int, frequency: int) -> None:
        """Run `prog` at `frequency` Hz on every online CPU, whatever runs there."""
        fds: list[int] = []
        try:
            for cpu in bpf_sys.cpu_list("online"):
                attr = PerfEventAttr(type=ev_type, config=ev_config, sample_period=frequency, flags=bpf_sys.ATTR_FREQ)
                fds.append(bpf_sys.perf_event_open(attr, -1, cpu))
                fds.append(bpf_sys.link_perf_event(self.progs[prog], fds[-1]))
        except OSError:
            bpf_sys.close_fds(fds)
            raise
        self._links[f"perf:{prog}"] = fds

    def attach_tracepoint(self, prog: str, category: str, event: str) -> None:
        attr = PerfEventAttr(type=bpf_sys.PERF_TYPE_TRACEPOINT, config=bpf_sys.tracepoint_id(category, event),
                             sample_period=1, wakeup_events=1)
        pfd = bpf_sys.perf_event_open(attr, -1, 0)  # a tracepoint's program runs on every CPU
        try:
            self._links[f"{category}:{event}"] = [pfd, bpf_sys.link_perf_event(self.progs[prog], pfd)]
        except OSError:
            os.close(pfd)
            raise

    def attach_tracepoints(self) -> None:
        """Attach every program named tracepoint__CATEGORY__EVENT to its tracepoint (as BCC would on load)."""
        for name in self.progs:
            if name.startswith("tracepoint__"):
                category, event = name[len("tracepoint__"):].split("__", 1)
                self.attach_tracepoint(name, category, event)

    def detach(self, name: str) -> None:
        """Detach "CATEGORY:EVENT" or "perf:PROG"; nothing when not attached."""
        bpf_sys.close_fds(self._links.pop(name, []))

    def close(self) -> None:
        for fds in self._links.values():
            bpf_sys.close_fds(fds)
        self._links.clear()
        bpf_sys.close_fds(list(self.progs.values()) + [m.fd for m in self.maps.values()])
        self.progs.clear()
        self.maps.clear()


def load(text: str, cflags: list[str], functions: dict[str, str], maps: list[str],
         on_compile: Callable[[str], None] | None = None, cache: BpfCache | None = None) -> BpfObject:
    """Compile and load `text` in the compiler process, or load it from the compile cache when compiled before
    (`cache`: BpfCache.from_env() when None). `functions`: program name -> "kprobe", "uprobe" (for uprobe_multi
    links where the kernel has them), "uprobe_session" (for uprobe session links), "perf_event" or "tracepoint"
    (tracepoint__* programs come anyway); `maps`: the names to hand over. `on_compile` is told (one line) before a
    compile starts."""
    request = {"text": text, "cflags": cflags, "functions": functions, "maps": maps}
    cache = cache if cache is not None else BpfCache.from_env()
    key = bpf_cache.cache_key(request) if cache.path is not None else ""
    if key:
        entry = cache.get(key)
        if entry is not None:
            try:
                meta, fds = bpf_cache.instantiate(entry)
                return _object(meta, fds, from_cache=True)
            except (OSError, ValueError, KeyError, TypeError, Unreadable) as e:  # Unreadable: a corrupt entry
                log.warning("the cached BPF program did not load (%s): compiling it again", e)
    if on_compile is not None:
        on_compile(COMPILING)
    meta, fds, entry = _compile(request | {"cache": bool(key)})
    obj = _object(meta, fds)
    if key and entry is not None:
        if entry.get("cacheable"):
            cache.put(key, entry)
        else:
            log.info("the BPF program cannot be cached: %s", entry.get("why"))
    return obj


def _object(meta: dict[str, Any], fds: list[int], from_cache: bool = False) -> BpfObject:
    """The object from the compiler's reply (or the cache's copy of it) and the descriptors it lists."""
    return BpfObject(
        progs={name: fds[i] for name, i in meta["progs"].items()},
        maps={name: BpfMap(name, fds[m["fd"]], m["type"], m["max_entries"], m["key_size"], m["value_size"],
                           [tuple(f) for f in m["fields"]]) for name, m in meta["maps"].items()},
        uprobe_multi=bool(meta.get("uprobe_multi")),
        from_cache=from_cache,
    )


def _compile(request: dict[str, Any]) -> tuple[dict[str, Any], list[int], dict[str, Any] | None]:
    """Run the compiler process: its reply, the descriptors, and its cache entry (None without one)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with ours, theirs:
            child = subprocess.Popen([sys.executable, str(COMPILER), str(theirs.fileno())], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=[theirs.fileno()])
            theirs.close()
            out, err = child.communicate(json.dumps(request).encode(), timeout=COMPILE_TIMEOUT_S)
            if child.returncode != 0:
                lines = err.decode(errors="replace").strip().splitlines()
                sys.stderr.write("\n".join(lines[:-1]) + ("\n" if len(lines) > 1 else ""))
                last = lines[-1].removeprefix("aiflame-bpf-compile: ") if lines else f"exit {child.returncode}"
                raise HostError(last)
            if err:
                sys.stderr.write(err.decode(errors="replace"))
            msg, fds, _, _ = socket.recv_fds(ours, 1 << 20, 256, socket.MSG_CMSG_CLOEXEC)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        raise HostError(f"the BPF compiler took over {COMPILE_TIMEOUT_S} s") from None
    if not msg:
        raise HostError("the BPF compiler exited without handing over the program")
    entry = None
    if out:
        try:
            entry = json.loads(out)
        except ValueError:
            log.warning("the BPF compiler's cache entry is not JSON: not cached")
    return json.loads(msg), fds, entry if isinstance(entry, dict) else None
