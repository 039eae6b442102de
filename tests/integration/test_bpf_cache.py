"""The BPF compile cache for real: a hit loads what a compile loads (same program tags, same maps, same layouts) and
samples alike; a damaged entry is compiled again and replaced; an entry or directory another user could have
written is never loaded (played as the unprivileged user of issue #20 would); another configuration misses."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiflame.agent.kernel import bpf_cache, bpf_sys
from aiflame.agent.kernel.bpf_cache import BpfCache
from aiflame.agent.kernel.bpf_object import BpfObject
from aiflame.agent.kernel.sampler import CpuSampler, SamplerConfig
from aiflame.agent.kernel.uprobes import ProbeSite
from aiflame.core.raw import RawSample
from tests.conftest import REPO
from tests.hostile import NOBODY, as_nobody, nobody_dir
from tests.integration.test_uprobes import LIBC, _offsets

SMALL = SamplerConfig(frequency=999, event="cpu-clock")  # no probes: the quickest compile


def _sample(config: SamplerConfig, seconds: float = 1.0) -> tuple[list[RawSample], BpfObject, dict[str, int]]:
    """Sample a busy child with `config`: the samples, the (closed) object it was loaded as, its counters."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    samples: list[RawSample] = []
    sampler = CpuSampler(config, samples.append, lambda e: None, lambda r: None)
    try:
        sampler.start([busy.pid])
        obj = sampler._bpf
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.05)
            sampler.poll()
        counters = sampler.counters()
    finally:
        sampler.close()
        busy.kill()
        busy.wait()
    return [s for s in samples if s.pid == busy.pid], obj, counters


def _entries(d: Path) -> list[Path]:
    return sorted(d.glob("*" + bpf_cache.SUFFIX))


def _describe(obj: BpfObject) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Each program's tag (the kernel's hash of its instructions, map references left out) and name; each
    handed-over map's type, sizes, flags, name and BTF type ids."""
    progs = {}
    for name in obj.progs:
        info = bpf_sys.obj_info(obj.progs[name], 80)
        progs[name] = info[8:16] + info[64:80]
    maps = {}
    for name, m in obj.maps.items():
        info = bpf_sys.obj_info(m.fd, 88)
        maps[name] = info[0:4] + info[8:40] + info[68:76] + info[80:88]
    return progs, maps


def test_a_hit_loads_and_samples_as_the_compile_did(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bpf_cache.ENV, str(tmp_path / "cache"))
    config = SamplerConfig(frequency=999, event="cpu-clock", probes=True)
    told: list[str] = []
    runs = []
    for _ in range(2):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        samples: list[RawSample] = []
        sampler = CpuSampler(config, samples.append, lambda e: None, lambda r: None)
        try:
            sampler.start([busy.pid], told.append)
            obj = sampler._bpf
            # The probes' programs take links with their attach type.
            sites = [ProbeSite(off, i) for i, off in enumerate(_offsets({"getpid", "getppid"}).values())]
            assert sampler.attach_probes(LIBC, sites) == {}
            assert sampler.attach_probes(LIBC, sites[:1], ret=True) == {}
            assert obj.maps["uw_call_progs"].lookup(b"\0\0\0\0") is not None  # its tail calls are in place
            runs.append((obj.from_cache, _describe(obj), sampler.layouts(), obj.uprobe_multi))
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                time.sleep(0.05)
                sampler.poll()
        finally:
            sampler.close()
            busy.kill()
            busy.wait()
        mine = [s for s in samples if s.pid == busy.pid]
        assert len(mine) > 200 and all(s.user for s in mine), len(mine)  # compiled or not, it samples
    assert len(told) == 1 and "compiling" in told[0], told  # told when compiling only
    (compiled, c_desc, c_layouts, c_multi), (hit, h_desc, h_layouts, h_multi) = runs
    assert (compiled, hit) == (False, True)
    assert h_desc == c_desc and h_layouts == c_layouts and h_multi == c_multi
    assert len(_entries(tmp_path / "cache")) == 1


def test_a_damaged_entry_is_compiled_again_and_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv(bpf_cache.ENV, str(cache))
    _, obj, _ = _sample(SMALL, 0.2)
    assert not obj.from_cache
    (entry,) = _entries(cache)
    good = entry.read_bytes()
    half = good[: len(good) // 2]
    flipped = bytearray(good)
    flipped[len(good) * 3 // 4] ^= 0x20
    for damaged in (half, bytes(flipped)):  # (more kinds of damage: tests/unit/test_bpf_cache.py)
        entry.write_bytes(damaged)
        samples, obj, _ = _sample(SMALL, 0.5)
        assert not obj.from_cache and samples
        assert entry.read_bytes() == good  # replaced by the new compile's (the same bytes)
    samples, obj, _ = _sample(SMALL, 0.5)
    assert obj.from_cache and samples


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A cache directory holding one real entry (SMALL's): (the entry, its key)."""
    d = tmp_path_factory.mktemp("bpfcache") / "cache"
    old = os.environ.get(bpf_cache.ENV)
    os.environ[bpf_cache.ENV] = str(d)
    try:
        _, obj, _ = _sample(SMALL, 0.1)
    finally:
        if old is None:
            del os.environ[bpf_cache.ENV]
        else:
            os.environ[bpf_cache.ENV] = old
    assert not obj.from_cache
    (entry,) = _entries(d)
    return entry, entry.name.removesuffix(bpf_cache.SUFFIX)


def test_an_entry_the_kernel_refuses_is_compiled_again(compiled: tuple[Path, str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Well formed, but its first program is a lone `exit` (r0 never set): the verifier says no, nothing it
    created stays open, and the compile's entry replaces it."""
    entry, key = compiled
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    bad = bpf_cache.parse_entry(entry.read_bytes(), key)
    del bad["key"]
    bad["progs"][0]["insns"] = base64.b64encode(bytes([0x95]) + bytes(7)).decode()
    (d / entry.name).write_bytes(bpf_cache.serialize_entry(key, bad))
    (d / entry.name).chmod(0o600)
    monkeypatch.setenv(bpf_cache.ENV, str(d))
    before = len(os.listdir("/proc/self/fd"))
    samples, obj, _ = _sample(SMALL, 0.5)
    assert not obj.from_cache and samples
    assert len(os.listdir("/proc/self/fd")) == before
    assert (d / entry.name).read_bytes() == entry.read_bytes()


def test_entries_another_user_could_write_are_refused(compiled: tuple[Path, str], tmp_path: Path) -> None:
    entry, key = compiled
    assert BpfCache(str(entry.parent)).get(key) is not None  # the untouched entry is used
    mine = tmp_path / "cache"
    mine.mkdir(mode=0o700)
    name = mine / entry.name
    cache = BpfCache(str(mine))

    def planted(how: str) -> None:
        if name.exists() or name.is_symlink():
            name.unlink()
        if how == "symlink":  # to a good entry: a name in the cache never leads elsewhere
            name.symlink_to(entry)
        else:
            shutil.copy(entry, name)
            if how == "nobody's":
                os.chown(name, NOBODY, NOBODY)
            elif how == "world-writable":
                name.chmod(0o666)
            elif how == "hard link":
                os.link(name, tmp_path / "other-name")

    for how in ("symlink", "nobody's", "world-writable", "hard link"):
        planted(how)
        assert cache.get(key) is None, how
    planted("ours")
    assert cache.get(key) is not None


def test_a_directory_another_user_controls_is_refused(compiled: tuple[Path, str], tmp_path: Path) -> None:
    """The attacker makes the cache directory (or one above it) theirs, or world-writable, or a symlink, with a
    good entry in it: nothing there is read, and the sampler compiles (the entry left as it was)."""
    entry, key = compiled
    attacker = nobody_dir("aiflame-bpfcache-")
    try:
        own = attacker / "cache"
        subprocess.run(as_nobody("mkdir", "-m", "0755", own), check=True)
        shutil.copy(entry, own / entry.name)  # nobody cannot read ours (0600): a copy of it stands in
        os.chown(own / entry.name, NOBODY, NOBODY)
        wide = tmp_path / "wide"
        wide.mkdir()
        shutil.copy(entry, wide / entry.name)
        wide.chmod(0o777)
        link = attacker / "link"
        subprocess.run(as_nobody("ln", "-s", entry.parent, link), check=True)
        for where in (own, wide, link, attacker / "new"):
            assert BpfCache(str(where)).get(key) is None, where
        env = {**os.environ, bpf_cache.ENV: str(own), "PYTHONWARNINGS": "ignore"}
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=REPO, env=env,
                             check=True)
        assert out.stdout.split() == ["compiled"], out
        assert "not caching compiled BPF programs" in out.stderr and "owned by uid" in out.stderr, out.stderr
        assert sorted(p.name for p in own.iterdir()) == [entry.name]
        assert (own / entry.name).read_bytes() == entry.read_bytes()
    finally:
        shutil.rmtree(attacker)


CHILD = """
from aiflame.agent.kernel.sampler import CpuSampler, SamplerConfig
s = CpuSampler(SamplerConfig(frequency=999, event="cpu-clock"), lambda r: None, lambda r: None)
s.start([])
print("hit" if s._bpf.from_cache else "compiled")
s.close()
"""


def test_another_configuration_misses(compiled: tuple[Path, str], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    entry, _ = compiled
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    shutil.copy(entry, d / entry.name)
    monkeypatch.setenv(bpf_cache.ENV, str(d))
    _, obj, _ = _sample(SMALL, 0.1)
    assert obj.from_cache
    _, obj, _ = _sample(SamplerConfig(frequency=999, event="cpu-clock", ringbuf_pages=64), 0.1)  # other cflags
    assert not obj.from_cache
    assert len(_entries(d)) == 2
    monkeypatch.setenv(bpf_cache.ENV, "off")
    _, obj, _ = _sample(SMALL, 0.1)
    assert not obj.from_cache


def test_profile_says_it_compiles_without_a_terminal_and_is_quiet_on_a_hit(tmp_path: Path) -> None:
    env = {**os.environ, bpf_cache.ENV: str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "aiflame", "profile", "-d", "1", "--formats", "folded", "--", sys.executable,
           "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"]
    runs = []
    for i, quiet in enumerate((False, False, True)):
        out = tmp_path / f"out{i}"
        proc = subprocess.run([*cmd[:4], *(["-q"] if quiet else []), "-o", str(out), *cmd[4:]], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120, check=True)
        runs.append(proc.stderr)
        assert (out / "profile.folded").read_text().strip(), proc.stderr  # samples either way
    lines = runs[0].splitlines()
    # one line per phase, in order, without a terminal
    assert lines[0] == "aiflame: starting BPF sampler…", runs[0]
    assert lines[1].startswith("aiflame: compiling the BPF program"), runs[0]
    phases = [ln for ln in runs[1].splitlines() if ln.startswith("aiflame: ")]
    assert [p.split()[1] for p in phases[:4]] == ["starting", "sampling", "symbolizing", "writing"], runs[1]
    assert "compiling" not in runs[1], runs[1]
    assert runs[2] == "", runs[2]
