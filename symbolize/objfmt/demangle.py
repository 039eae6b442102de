"""C++ (Itanium ABI) demangling through libstdc++'s `__cxa_demangle`, and shortening names for flame graphs.

No new dependency: the demangler every C++ toolchain ships is called through ctypes. Without libstdc++ the
names are returned unchanged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import threading
from collections.abc import Callable, Iterable

__all__ = ["demangle", "is_mangled", "short_name"]

_lock = threading.Lock()
_loaded = False
_cxa: Callable[..., int | None] | None = None
_free: Callable[[int], None] | None = None

# Symbol version suffixes (foo@@GLIBCXX_3.4, foo@plt) are not part of the mangled name.
_SUFFIX = re.compile(r"@.*$")
_RUST_HASH = re.compile(r"::h[0-9a-f]{16}$")


def _load() -> None:
    global _loaded, _cxa, _free
    with _lock:
        if _loaded:
            return
        _loaded = True
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            fn = lib.__cxa_demangle
            free = libc.free
        except (OSError, AttributeError):
            return
        fn.restype = ctypes.c_void_p  # a malloc'd buffer we must free, so not c_char_p
        fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        free.restype = None
        free.argtypes = [ctypes.c_void_p]
        _cxa, _free = fn, free


def is_mangled(name: str) -> bool:
    """Whether `name` looks like an Itanium C++ mangled function name."""
    return name.startswith("_Z") or name.startswith("__Z")


def _demangle_one(name: str) -> str | None:
    assert _cxa is not None and _free is not None
    core = _SUFFIX.sub("", name)
    suffix = name[len(core) :]
    if core.startswith("__Z"):
        core = core[1:]  # Mach-O style extra underscore
    try:
        raw = core.encode("utf-8")
    except UnicodeEncodeError:
        return None
    status = ctypes.c_int(0)
    ptr = _cxa(raw, None, None, ctypes.byref(status))
    if not ptr:
        return None
    try:
        if status.value != 0:
            return None
        out = ctypes.string_at(ptr).decode("utf-8", "replace")
    finally:
        _free(ptr)
    # Rust's legacy mangling is Itanium-compatible but ends in a hash that only adds noise.
    return _RUST_HASH.sub("", out) + suffix


def demangle(names: Iterable[str]) -> dict[str, str]:
    """Map each name to its demangled text; names not mangled, or failing to demangle, map to themselves."""
    _load()
    out: dict[str, str] = {}
    for name in names:
        if name in out:
            continue
        text = _demangle_one(name) if _cxa is not None and is_mangled(name) else None
        out[name] = text if text else name
    return out


_QUALIFIERS = ("const", "volatile", "&&", "&", "noexcept")
_OPERATOR_SYMBOLS = ("()", "[]", "<=>", "<<=", ">>=", "->*", "->", "<<", ">>", "<=", ">=", "<", ">")


def short_name(text: str) -> str:
    """Demangled text without argument lists, cv/ref qualifiers and return type; template args are kept.

    `void ns::f<int>(int) const` -> `ns::f<int>`; `foo(int)::{lambda()#1}::operator()() const` ->
    `foo::{lambda()#1}::operator()`; `(anonymous namespace)::g(int)` -> `(anonymous namespace)::g`.
    Clone suffixes (` [clone .cold]`) are kept: they are distinct code.
    """
    clones = ""
    while text.endswith("]"):
        i = text.rfind(" [clone ")
        if i < 0:
            break
        clones = text[i:] + clones
        text = text[:i]

    out: list[str] = []
    depth = 0  # nesting of <> [] {} and of () groups we keep
    return_type_end = -1  # index in `out` just past the last top-level space before any operator name
    in_operator = False
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("operator", i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            j = i + 8
            if j < n and (text[j].isalnum() or text[j] == "_"):
                out.append(c)  # an identifier that merely starts with "operator"
                i += 1
                continue
            # Copy the operator's own symbol so its '<', '>' or '()' are not taken for brackets.
            sym = next((s for s in _OPERATOR_SYMBOLS if text.startswith(s, j)), "")
            out.append(text[i : j + len(sym)])
            i = j + len(sym)
            if depth == 0:
                in_operator = True
            continue
        if c == "(" and depth == 0 and not text.startswith("(anonymous namespace)", i):
            # An argument list: skip it and the qualifiers that follow.
            level, i = 1, i + 1
            while i < n and level:
                level += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            while True:
                rest = text[i:].lstrip(" ")
                q = next((q for q in _QUALIFIERS if rest.startswith(q)), None)
                if q is None:
                    break
                i = n - len(rest) + len(q)
            continue
        if c in "<[{(":
            depth += 1
        elif c in ">]})":
            depth = max(0, depth - 1)
        elif c == " " and depth == 0 and not in_operator:
            return_type_end = len(out) + 1
        out.append(c)
        i += 1
    name = "".join(out[return_type_end:] if return_type_end > 0 else out).strip()
    return (name or text) + clones
