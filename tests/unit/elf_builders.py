"""Real ELF files for the symbolizer tests, compiled once per test session with gcc/g++ and binutils.

Oracles are the binutils tools (nm, readelf, addr2line, c++filt), never our own parser, so the tests are not circular.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TOOLS = ("gcc", "g++", "strip", "objcopy", "readelf", "objdump", "addr2line")

C_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>

/* A function with no .size: the symbolizer must extend it to the next symbol. */
__asm__(".text\n.globl zero_size_fn\n.type zero_size_fn,@function\nzero_size_fn:\n"
        "nop\nnop\nnop\nnop\nnop\nnop\nnop\nnop\nret\n");

static int static_helper(int x) {
    return x * 7 + 3;
}

int add_numbers(int a, int b) {
    int s = a + b;   /* MARK:add_body */
    s = s * 2 + static_helper(a);
    return s;
}

long loop_sum(long n) {
    long acc = 0;
    for (long i = 0; i < n; i++) {
        acc += i ^ (acc >> 3);   /* MARK:loop_body */
    }
    return acc;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 10;
    printf("%d %ld\n", add_numbers(argc, 2), loop_sum(n));
    puts("done");
    return 0;
}
"""

LIB_SOURCE = r"""
static int lib_private(int x) {
    return x + 11;
}

int lib_exported(int x) {
    int y = lib_private(x);   /* MARK:lib_body */
    return y * 3;
}
"""

CPP_SOURCE = r"""
#include <cstdio>
#include <vector>

namespace demo {
namespace detail {
template <typename T>
T scaled_sum(const std::vector<T>& v, T factor) {
    T s = 0;
    for (const T& x : v) s += x * factor;   // MARK:cpp_body
    return s;
}
}  // namespace detail

class Engine {
  public:
    int run(int n) const;
};

int Engine::run(int n) const {
    std::vector<int> v(n, 2);
    return detail::scaled_sum<int>(v, 3);
}
}  // namespace demo

int main() {
    demo::Engine e;
    std::printf("%d %f\n", e.run(4), demo::detail::scaled_sum<double>({1.0, 2.0}, 0.5));
    return 0;
}
"""


@dataclass
class Built:
    """Paths of everything built, and the build ids readelf reports."""

    dir: Path
    src: Path
    prog: Path  # -g -O0 PIE
    prog_nog: Path  # -O0, no -g
    prog_nopie: Path  # -g -O0 -no-pie
    prog_nobid: Path  # linked with --build-id=none
    prog_stripped: Path  # strip --strip-all of prog (only .dynsym left)
    prog_linked: Path  # stripped + .gnu_debuglink to prog_linked.debug in the same directory
    prog_linked_sub: Path  # stripped + debuglink; its debug file lives in <dir>/.debug/
    prog_bid: Path  # stripped; its debug file lives only in bid_debug_dir/.build-id/
    bid_debug_dir: Path
    lib: Path  # -shared -fPIC -g
    lib_stripped: Path
    cpp: Path  # g++ -g -O0
    cpp_src: Path
    lib_src: Path
    build_ids: dict[str, str] = field(default_factory=dict)


def have_tools() -> bool:
    return all(shutil.which(t) for t in TOOLS)


def run(*cmd: str | Path, cwd: Path | None = None) -> str:
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True, cwd=cwd).stdout


def marker_line(src: Path, mark: str) -> int:
    """1-based line of the source line carrying `MARK:<mark>`."""
    for i, line in enumerate(src.read_text().splitlines(), 1):
        if f"MARK:{mark}" in line:
            return i
    raise KeyError(mark)


def line_of(src: Path, text: str) -> int:
    for i, line in enumerate(src.read_text().splitlines(), 1):
        if text in line:
            return i
    raise KeyError(text)


def readelf_build_id(path: Path) -> str | None:
    m = re.search(r"Build ID:\s*([0-9a-f]+)", run("readelf", "-n", path))
    return m.group(1) if m else None


def readelf_functions(path: Path, dynamic: bool = False) -> dict[str, tuple[int, int]]:
    """Defined FUNC/IFUNC symbols of .symtab (or .dynsym) as name -> (address, size), from readelf."""
    out = run("readelf", "-W", "--dyn-syms" if dynamic else "--syms", path)
    syms: dict[str, tuple[int, int]] = {}
    for line in out.splitlines():
        parts = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(parts) >= 8 and parts[3] in ("FUNC", "IFUNC") and parts[6] != "UND" and int(parts[1], 16):
            size = int(parts[2], 16) if parts[2].startswith("0x") else int(parts[2])
            syms.setdefault(parts[7].split("@")[0], (int(parts[1], 16), size))
    return syms


def plt_stubs(path: Path) -> dict[str, int]:
    """`name@plt` -> address, as objdump labels the PLT."""
    out = run("objdump", "-d", "-j", ".plt", "-j", ".plt.sec", path)
    return {m.group(2): int(m.group(1), 16) for m in re.finditer(r"^([0-9a-f]+) <(\S+@plt)>:", out, re.M)}


def section_offset(path: Path, name: str) -> int:
    """File offset of section `name`, from readelf."""
    for line in run("readelf", "-SW", path).splitlines():
        parts = line.replace("[ ", "[").split()
        if len(parts) > 4 and parts[1] == name:
            return int(parts[4], 16)
    raise KeyError(name)


def load_segments(path: Path) -> list[tuple[int, int, int]]:
    """(offset, vaddr, filesz) of each PT_LOAD, from readelf."""
    segs = []
    for line in run("readelf", "-lW", path).splitlines():
        parts = line.split()
        if parts and parts[0] == "LOAD":
            segs.append((int(parts[1], 16), int(parts[2], 16), int(parts[4], 16)))
    return segs


def vaddr_to_offset(path: Path, vaddr: int) -> int:
    """The file offset a profiler would compute for link-time address `vaddr` (mapping-relative)."""
    for off, va, filesz in load_segments(path):
        if va <= vaddr < va + filesz:
            return vaddr - va + off
    raise ValueError(f"{vaddr:#x} is not in a PT_LOAD of {path}")


def addr2line(path: Path, vaddrs: list[int]) -> list[tuple[str, int] | None]:
    out = run("addr2line", "-e", path, *[hex(a) for a in vaddrs]).splitlines()
    res: list[tuple[str, int] | None] = []
    for line in out:
        file, _, num = line.partition(":")
        num = num.split()[0] if num.split() else ""
        res.append((file, int(num)) if file != "??" and num.isdigit() and int(num) else None)
    return res


def cxxfilt(names: list[str]) -> dict[str, str]:
    """name -> what binutils' c++filt makes of it (a name it cannot demangle comes back unchanged)."""
    out = subprocess.run(["c++filt"], input="\n".join(names) + "\n", check=True, capture_output=True,
                         text=True).stdout.splitlines()
    return dict(zip(names, out, strict=True))


def decoded_lines(path: Path) -> dict[int, int]:
    """Address -> line of the last row at that address in readelf's decoded line table."""
    rows: dict[int, int] = {}
    for line in run("readelf", "--debug-dump=decodedline", path).splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1].isdigit() and parts[2].startswith("0x"):
            rows[int(parts[2], 16)] = int(parts[1])
    return rows


def build_all(base: Path) -> Built:
    base.mkdir(parents=True, exist_ok=True)
    src = base / "demo.c"
    src.write_text(C_SOURCE)
    lib_src = base / "libdemo.c"
    lib_src.write_text(LIB_SOURCE)
    cpp_src = base / "demo.cpp"
    cpp_src.write_text(CPP_SOURCE)
    cflags = ("-O0", "-fno-omit-frame-pointer", "-Wl,--build-id=sha1")

    prog = base / "prog"
    run("gcc", "-g", *cflags, "-o", prog, src)
    prog_nog = base / "prog_nog"
    run("gcc", *cflags, "-o", prog_nog, src)
    prog_nopie = base / "prog_nopie"
    run("gcc", "-g", "-no-pie", "-fno-pie", *cflags, "-o", prog_nopie, src)
    prog_nobid = base / "prog_nobid"
    run("gcc", "-O0", "-Wl,--build-id=none", "-o", prog_nobid, src)
    prog_stripped = base / "prog_stripped"
    run("strip", "--strip-all", "-o", prog_stripped, prog)

    prog_linked = base / "prog_linked"
    run("objcopy", "--only-keep-debug", prog, base / "prog_linked.debug")
    run("strip", "--strip-all", "-o", prog_linked, prog)
    run("objcopy", f"--add-gnu-debuglink={base / 'prog_linked.debug'}", prog_linked)

    sub = base / "sub"
    (sub / ".debug").mkdir(parents=True, exist_ok=True)
    prog_linked_sub = sub / "prog_sub"
    run("objcopy", "--only-keep-debug", prog, sub / ".debug" / "prog_sub.debug")
    run("strip", "--strip-all", "-o", prog_linked_sub, prog)
    # objcopy reads the debug file for its CRC and stores only its base name.
    run("objcopy", f"--add-gnu-debuglink={sub / '.debug' / 'prog_sub.debug'}", prog_linked_sub)

    prog_bid = base / "prog_bid"
    run("strip", "--strip-all", "-o", prog_bid, prog)
    bid = readelf_build_id(prog)
    assert bid
    bid_debug_dir = base / "debugroot"
    dest = bid_debug_dir / ".build-id" / bid[:2] / f"{bid[2:]}.debug"
    dest.parent.mkdir(parents=True, exist_ok=True)
    run("objcopy", "--only-keep-debug", prog, dest)

    lib = base / "libdemo.so"
    run("gcc", "-g", "-shared", "-fPIC", *cflags, "-o", lib, lib_src)
    lib_stripped = base / "libdemo_stripped.so"
    run("strip", "--strip-all", "-o", lib_stripped, lib)

    cpp = base / "cppdemo"
    run("g++", "-g", *cflags, "-o", cpp, cpp_src)

    built = Built(
        base,
        src,
        prog,
        prog_nog,
        prog_nopie,
        prog_nobid,
        prog_stripped,
        prog_linked,
        prog_linked_sub,
        prog_bid,
        bid_debug_dir,
        lib,
        lib_stripped,
        cpp,
        cpp_src,
        lib_src,
    )
    for p in (prog, prog_nog, prog_nopie, prog_stripped, lib, cpp):
        b = readelf_build_id(p)
        assert b, p
        built.build_ids[p.name] = b
    return built


_BUILT: dict[str, Built] = {}


def get_built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """Build once per session (test modules share this module, hence this memo rather than a fixture)."""
    if not have_tools():
        pytest.skip("needs gcc, g++ and binutils")
    if "all" not in _BUILT:
        _BUILT["all"] = build_all(tmp_path_factory.mktemp("elves"))
    return _BUILT["all"]
