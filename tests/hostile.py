"""The hostile local user of issue #20, for the tests that play it: an unprivileged account (`nobody`), a stand-in
`libcudart.so.12` that any user can build with gcc (a process that maps it is watched by the daemon and probed by
`aiflame profile`), an attacker program with one mode per attack, and the bombs (compressed ELF sections, zstd
cubins) built without holding their inflated size in memory."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
import textwrap
import time
import zlib
from pathlib import Path

import zstandard

NOBODY = 65534
PYTHON = "/usr/bin/python3"  # the attacker's interpreter: a system one any user can run


def as_nobody(*argv: str | Path) -> list[str]:
    """argv run as nobody (no groups, no capabilities)."""
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all", "--",
            *map(str, argv)]


def nobody_dir(prefix: str) -> Path:
    """A fresh directory under /tmp owned by nobody: the attacker's own."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chown(path, NOBODY, NOBODY)
    os.chmod(path, 0o755)
    return path


STANDIN_C = r"""
/* A stand-in CUDA runtime anyone can build: the symbols aiflame probes, doing nothing. */
#include <stdint.h>
#include <stddef.h>
#define API __attribute__((visibility("default"), noinline))
API void **__cudaRegisterFatBinary(void *wrapper) { __asm__ volatile(""); return (void **)wrapper; }
API void __cudaRegisterFunction(void **handle, const char *host, char *dev, const char *name, int limit,
                                void *a, void *b, void *c, void *d, int *e) { __asm__ volatile(""); }
API int cudaLaunchKernel(const void *func, uint64_t grid, uint32_t gz, uint64_t block, uint32_t bz,
                         void **args, size_t shmem, void *stream) { __asm__ volatile(""); return 0; }
API int cuModuleLoadData(void **module, const void *image) { *module = (void *)image; return 0; }
API int cudaDeviceSynchronize(void) { __asm__ volatile(""); return 0; }
"""


def build_standin(directory: Path) -> Path:
    """`directory`/libcudart.so.12, built with gcc as nobody would, owned by nobody; and a copy named
    libcuda.so.1 beside it, where the driver's calls are probed."""
    src = directory / "standin.c"
    src.write_text(STANDIN_C)
    lib = directory / "libcudart.so.12"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-g", "-o", str(lib), str(src)], check=True)
    shutil.copy(lib, directory / "libcuda.so.1")
    for p in (src, lib, directory / "libcuda.so.1"):
        os.chown(p, NOBODY, NOBODY)
    return lib


# The attacker: `python3 attacker.py LIB MODE ARGS...`. It maps the stand-in runtime (so it is watched), prints
# "ready" once set up, then attacks; progress lines go to stdout.
ATTACKER = textwrap.dedent(r'''
    import ctypes, mmap, os, struct, sys, threading, time
    lib = ctypes.CDLL(sys.argv[1])
    mode, args = sys.argv[2], sys.argv[3:]

    def say(*a):
        print(*a, flush=True)

    def spin(seconds):
        end = time.time() + seconds
        x = 0
        while time.time() < end:
            for i in range(5000):
                x += i

    if mode == "spin":                      # just a watched process, busy
        say("ready")
        spin(float(args[0]))
    elif mode == "opens":                   # library opens (each stops us): progress while stopped is the test
        d = args[0]
        say("ready")
        n = 0
        end = time.time() + float(args[1])
        while time.time() < end:
            path = f"{d}/lib{n}-{os.getpid()}.so"  # a new file: an open that fails stops nobody
            try:
                os.close(os.open(path, os.O_RDONLY | os.O_CREAT, 0o600))
                os.unlink(path)
            except OSError:
                pass
            n += 1
            say("opened", n, time.monotonic())
    elif mode == "pty":                     # a library path that is our terminal, then ^C into it
        master, slave = os.openpty()
        name = os.ttyname(slave)
        link = os.path.join(args[0], "libhijack.so")
        os.symlink(name, link)
        say("ready", name)
        for _ in range(int(args[1])):
            try:
                os.close(os.open(link, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK))
            except OSError:
                pass
            time.sleep(0.5)
            os.write(master, b"\x03\x1c")   # ^C and ^\ to whoever took this terminal
        say("done")
        time.sleep(float(args[2]))
    elif mode == "fatbin":                  # registrations whose fatbin holds a 1 GiB zstd cubin, and launches
        blob = open(args[0], "rb").read()
        buf = ctypes.create_string_buffer(blob, len(blob))
        wrapper = (ctypes.c_uint64 * 3)(0x466243B1 | (1 << 32), ctypes.addressof(buf), 0)
        lib.__cudaRegisterFatBinary.restype = ctypes.c_void_p
        host = ctypes.create_string_buffer(16)
        say("ready")
        end = time.time() + float(args[1])
        while time.time() < end:
            handle = lib.__cudaRegisterFatBinary(ctypes.byref(wrapper))
            lib.__cudaRegisterFunction(ctypes.c_void_p(handle), host, b"bomb", b"bomb", -1, None, None, None,
                                       None, None)
            lib.cudaLaunchKernel(host, ctypes.c_uint64(1), 1, ctypes.c_uint64(1), 1, None, ctypes.c_size_t(0),
                                 None)
            say("registered")
            spin(0.5)
    elif mode == "module":                  # cuModuleLoadData of an image that claims ~500 MiB, again and again
        size = 600 << 20
        m = mmap.mmap(-1, size)
        hdr = bytearray(64)
        hdr[:4] = b"\x7fELF"
        hdr[4], hdr[5], hdr[6] = 2, 1, 1
        struct.pack_into("<Q", hdr, 0x28, 500 << 20)      # e_shoff
        struct.pack_into("<HH", hdr, 0x3A, 64, 16)          # e_shentsize, e_shnum
        m[:64] = bytes(hdr)
        image = ctypes.addressof(ctypes.c_char.from_buffer(m))
        mod = ctypes.c_void_p()
        driver = ctypes.CDLL(os.path.join(os.path.dirname(sys.argv[1]), "libcuda.so.1"))
        say("ready")
        end = time.time() + float(args[0])
        while time.time() < end:
            driver.cuModuleLoadData(ctypes.byref(mod), ctypes.c_void_p(image))
            say("loaded")
            spin(0.5)
    elif mode == "threads":                 # a flood of short-lived threads
        say("ready")
        n = int(args[0])
        for i in range(0, n, 100):
            ts = [threading.Thread(target=lambda: None) for _ in range(min(100, n - i))]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        say("threads done", n)
        spin(float(args[1]))
    elif mode == "forks":                   # many children that stay (each one followed, until the map is full)
        n = int(args[0])
        say("ready")
        while not os.path.exists("go"):     # the test creates it once the daemon watches this process
            time.sleep(0.05)
        kids = []
        for i in range(n):
            pid = os.fork()
            if pid == 0:
                time.sleep(float(args[1]))
                os._exit(0)
            kids.append(pid)
        say("forked", n)
        for pid in kids:
            os.waitpid(pid, 0)
    elif mode == "elf":                     # map a library carrying a compressed-section bomb
        ctypes.CDLL(args[0])
        say("ready")
        spin(float(args[1]))
    else:
        sys.exit(f"unknown mode {mode}")
''')


def write_attacker(directory: Path) -> Path:
    path = directory / "attacker.py"
    path.write_text(ATTACKER)
    os.chown(path, NOBODY, NOBODY)
    return path


# --- bombs ---------------------------------------------------------------------------------------------------------

_CHUNK = 1 << 20


def zlib_zeros(n: int) -> bytes:
    """zlib stream of `n` zero bytes, made in 1 MiB steps."""
    c = zlib.compressobj(9)
    zero = bytes(_CHUNK)
    out = [c.compress(zero[: min(_CHUNK, n - i)]) for i in range(0, n, _CHUNK)]
    out.append(c.flush())
    return b"".join(out)


def zstd_zeros(n: int, content_size: bool = True) -> bytes:
    """A zstd frame of `n` zero bytes (declaring its size when `content_size`), made in 1 MiB steps."""
    c = zstandard.ZstdCompressor(write_content_size=content_size).compressobj(size=n if content_size else -1)
    zero = bytes(_CHUNK)
    out = [c.compress(zero[: min(_CHUNK, n - i)]) for i in range(0, n, _CHUNK)]
    out.append(c.flush())
    return b"".join(out)


def compressed_section(declared: int, real: int) -> bytes:
    """The bytes of an SHF_COMPRESSED ELF64 section: its Chdr says `declared`, its zlib stream holds `real`."""
    return struct.pack("<IIQQ", 1, 0, declared, 1) + zlib_zeros(real)


def add_compressed_section(lib: Path, out: Path, name: str, declared: int, real: int) -> Path:
    """`lib` with a section `name` that is a compressed-section bomb (objcopy adds it, the flag is set by hand)."""
    payload = out.with_suffix(".payload")
    payload.write_bytes(compressed_section(declared, real))
    subprocess.run(["objcopy", "--add-section", f"{name}={payload}", "--set-section-flags", f"{name}=readonly",
                    str(lib), str(out)], check=True)
    payload.unlink()
    data = bytearray(out.read_bytes())
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    stroff = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)[0]
    for i in range(shnum):
        at = shoff + i * shentsize
        sh_name = struct.unpack_from("<I", data, at)[0]
        end = data.index(b"\0", stroff + sh_name)
        if data[stroff + sh_name:end] == name.encode():
            flags = struct.unpack_from("<Q", data, at + 8)[0]
            struct.pack_into("<Q", data, at + 8, flags | 0x800)  # SHF_COMPRESSED
            break
    else:
        raise AssertionError(f"{name} not added")
    out.write_bytes(bytes(data))
    return out


def fatbin_zstd_cubin(declared: int) -> bytes:
    """A fatbin container holding one sm_80 cubin entry: a zstd frame of `declared` zero bytes."""
    frame = zstd_zeros(declared)
    padded = (len(frame) + 7) & ~7
    entry = struct.pack("<HHIQIIHHIIIQ", 2, 0x0101, 0x40, padded, len(frame), 0, 0, 0, 80, 0, 0, 0x8000 | 0x11)
    entry += struct.pack("<Q", declared)
    entry = entry.ljust(0x40, b"\0")
    body = entry + frame.ljust(padded, b"\0")
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def rss_peak_mb(pid: int) -> float:
    """VmHWM of `pid` (peak resident set), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for {pid}")


def state(pid: int) -> str:
    """The process state letter (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _switches(pid: int) -> int:
    """Context switches of `pid`'s main thread so far; a stopped thread makes none."""
    n = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
            n += int(line.split()[1])
    return n


def longest_stop(pid: int, seconds: float) -> float:
    """Watch `pid` for `seconds`: the longest it stayed stopped (state T), in seconds. A single look is not enough:
    a probe stops a target at each library open for a moment, by design (and another agent on the host may too).
    Two looks that both see T belong to one stop only if the process did not run in between (its context-switch
    count is unchanged): a target that opens a library in a loop is stopped for microseconds each time, and back
    to back those stops must not read as one long one."""
    longest, since, seen = 0.0, None, -1
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        now = time.monotonic()
        try:
            stopped, switches = state(pid) == "T", _switches(pid)
        except (OSError, ValueError):
            break  # the process is gone
        if stopped and since is not None and switches == seen:
            longest = max(longest, now - since)
        elif stopped:
            since = now
        else:
            since = None
        seen = switches
        time.sleep(0.02)
    return longest


class MemoryCgroup:
    """A memory cgroup limited to `limit` bytes, for a process to run under as a unit's MemoryMax= puts it: cgroup
    v2 where the memory controller is on, else v1 (this CI machine kind). `enter()` is a preexec_fn."""

    def __init__(self, limit: int) -> None:
        v2 = Path("/sys/fs/cgroup/unified") if Path("/sys/fs/cgroup/unified").is_dir() else Path("/sys/fs/cgroup")
        name = f"aiflame-test-{os.getpid()}-{time.monotonic_ns()}"
        controllers = v2 / "cgroup.controllers"
        if controllers.exists() and "memory" in controllers.read_text().split():
            self.path, self.v2 = v2 / name, True
            self.path.mkdir()
            (self.path / "memory.max").write_text(str(limit))
            (self.path / "memory.swap.max").write_text("0")
        else:
            rel = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                       if line.split(":")[1] == "memory")
            self.path, self.v2 = Path("/sys/fs/cgroup/memory") / rel.lstrip("/") / name, False
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            if (self.path / "memory.memsw.limit_in_bytes").exists():
                (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit))

    def enter(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def oom_kills(self) -> int:
        text = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        return next((int(line.split()[1]) for line in text.splitlines() if line.startswith("oom_kill ")), 0)

    def close(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)  # its last processes are still being reaped
