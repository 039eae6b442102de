"""What a wheel carries: every package directory of the source tree is listed in pyproject.toml's packages, and every
file besides Python sources (BPF programs, headers, layouts, the flame graph's script, protos, the CUDA shim) is
matched by its package's package-data globs, so that an installed aiflame (tests/integration/test_install.py)
finds what the checkout has."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

from tests.conftest import REPO

PARTS = ("agent", "bpf", "cli", "core", "exporters", "symbolize")
SOURCE_ONLY = (".py",)


def _config() -> tuple[set[str], dict[str, list[str]]]:
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    st = doc["tool"]["setuptools"]
    return set(st["packages"]), dict(st["package-data"])


def _package_dirs() -> list[Path]:
    inits = (p for part in PARTS for p in (REPO / part).rglob("__init__.py"))
    return sorted(p.parent for p in inits if "__pycache__" not in p.parts)


def test_every_package_directory_is_listed() -> None:
    packages, _ = _config()
    for d in _package_dirs():
        name = "aiflame." + ".".join(d.relative_to(REPO).parts)
        assert name in packages, f"{name} is missing from [tool.setuptools] packages"


def test_every_data_file_is_package_data() -> None:
    _, data = _config()
    dirs = _package_dirs()
    missed = []
    for part in PARTS:
        for f in (REPO / part).rglob("*"):
            if not f.is_file() or "__pycache__" in f.parts or f.suffix in SOURCE_ONLY or f.suffix == ".pyc":
                continue
            # the innermost package holding the file, and the file's path relative to it
            pkg = max((d for d in dirs if d in f.parents), key=lambda d: len(d.parts))
            name = "aiflame." + ".".join(pkg.relative_to(REPO).parts)
            rel = f.relative_to(pkg).as_posix()
            # as setuptools globs: `*` stays within one directory
            if not any(fnmatch.fnmatch(rel, g) and g.count("/") == rel.count("/") for g in data.get(name, [])):
                missed.append(f"{f.relative_to(REPO)} (package {name})")
    assert not missed, "files an installed aiflame would lack: " + ", ".join(missed)
