"""aiflame installed as a tool: `pip install` of the checkout into a fresh venv outside the repository (one that
sees the system's BCC: --system-site-packages on /usr/bin/python3) puts `aiflame` on the venv's PATH, and it
profiles from /tmp with everything it reads at run time (BPF sources and headers, layouts, the flame graph's
script, the CFI engine's C source) coming from the installed package, none from the checkout.

Offline-safe: the wheel is built from a copy of the checkout (its package parts only, so the build leaves nothing
in the checkout and needs nothing else) by the development venv's pip and setuptools (--no-build-isolation
--no-index: Debian's setuptools 66 predates the license expressions pyproject.toml uses), and installed with
--no-index --no-deps; the dependencies are the ones the development venv already holds (a .pth line makes them
visible, as a user's index would install them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.conftest import REPO

SYSTEM_PYTHON = "/usr/bin/python3"
PACKAGE_PARTS = ("pyproject.toml", "README.md", "aiflame", "agent", "bpf", "cli", "core", "exporters", "symbolize")
# a fixed amount of work, not of time
BUSY = "def busy_installed():\n    x = 0\n    for i in range(20_000_000):\n        x += i\nbusy_installed()\n"


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_pip_install_into_a_fresh_venv_profiles_from_tmp(tmp_path: Path) -> None:
    assert str(tmp_path).startswith("/tmp/") and not str(tmp_path).startswith(str(REPO))
    src = tmp_path / "src"
    src.mkdir()
    for part in PACKAGE_PARTS:
        p = REPO / part
        if p.is_dir():
            shutil.copytree(p, src / part, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(p, src / part)
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    env["PATH"] = f"{venv / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin"
    _run([SYSTEM_PYTHON, "-m", "venv", "--system-site-packages", str(venv)], tmp_path, env)
    site = Path(_run([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp_path, env).strip())
    (site / "zz_aiflame_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # the dev venv's deps
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-index", "--no-deps", "--no-build-isolation", "-w",
          str(wheels), str(src)], tmp_path, env)
    (wheel,) = wheels.glob("aiflame-*.whl")
    _run([str(venv / "bin/pip"), "install", "-q", "--no-index", "--no-deps", str(wheel)], tmp_path, env)
    shutil.rmtree(src)  # nothing of the checkout is left to lean on

    work = tmp_path / "work"
    work.mkdir()
    assert shutil.which("aiflame", path=env["PATH"]) == str(venv / "bin/aiflame")
    where = _run([str(venv / "bin/python"), "-c", "import aiflame, bcc; print(aiflame.__file__)"], work, env)
    assert where.startswith(str(site)), where
    assert _run(["aiflame", "--version"], work, env).startswith("aiflame ")
    out = work / "out"
    script = work / "busy.py"
    script.write_text(BUSY)
    _run(["aiflame", "profile", "-q", "-o", str(out), "--formats", "folded,svg", "--",
          SYSTEM_PYTHON, str(script)], work, env)
    folded = (out / "profile.folded").read_text()
    assert "busy_installed" in folded, folded[:2000]
    svg = (out / "profile.svg").read_text()
    assert "<svg" in svg and "busy_installed" in svg  # the flame graph's script and style came with the package
    # an export and the help from the installed tool, still from /tmp
    _run(["aiflame", "export", str(out / "profile.aiflame"), "-f", "speedscope", "-o", str(work / "p.json")], work,
         env)
    assert (work / "p.json").stat().st_size > 0
