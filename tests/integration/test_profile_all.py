"""`aiflame profile -a`: the whole host, as `perf record -a` samples it. Two busy processes that aiflame was not told
about (different interpreters, one of them Debian's static 3.11) both show with their Python frames, in one
folded file with a tower per process; -a with a target is refused in one line."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.conftest import INTERPRETERS
from tests.integration.conftest import aiflame, read_folded

BUSY = textwrap.dedent('''
    def host_wide_{name}():
        x = 0
        while True:
            x += 1
    print("ready", flush=True)
    host_wide_{name}()
''')


def test_profile_all_samples_every_process(tmp_path: Path) -> None:
    # Oracle: by construction — two processes, each burning CPU in a named Python function
    procs = []
    try:
        for name, python in (("alpha", INTERPRETERS[2]), ("beta", "/usr/bin/python3")):
            script = tmp_path / f"{name}.py"
            script.write_text(BUSY.format(name=name))
            p = subprocess.Popen([python, str(script)], stdout=subprocess.PIPE, text=True)
            procs.append(p)
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        out = tmp_path / "out"
        r = aiflame("profile", "-a", "-d", "2", "-o", str(out), "--formats", "folded,svg", timeout=300)
        assert "all processes" in (out / "profile.svg").read_text(), r.stdout
        folded = read_folded(out / "profile.folded")
        for name in ("alpha", "beta"):
            mine = {st: n for st, n in folded.items() if f"py::host_wide_{name} " in st}
            assert sum(mine.values()) >= 10, (name, sorted(folded.items(), key=lambda kv: -kv[1])[:10])
        # one tower per process: each stack starts at its process's name, not at a shared frame
        roots = {st.split(";")[0] for st in folded}
        assert len(roots) >= 2, roots
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize("extra", [["--pid", "1"], ["--", "true"]])
def test_profile_all_with_a_target_is_one_line(extra: list[str], tmp_path: Path) -> None:
    r = aiflame("profile", "-a", "-o", str(tmp_path / "o"), *extra, check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "-a" in r.stderr and "Traceback" not in r.stderr
