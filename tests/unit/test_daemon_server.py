"""What the daemon itself does between its parts, with fakes for them: which processes the collector samples
(the target limit, exits), the answers to `latest`, and the status a client sees."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from aiflame.agent.daemon.config import (
    ContinuousConfig,
    ControlConfig,
    DaemonConfig,
    LimitsConfig,
    OutputConfig,
    load_config,
)
from aiflame.agent.daemon.discovery import ProcInfo
from aiflame.agent.daemon.protocol import LatestRequest, StatusRequest
from aiflame.agent.daemon.server import Daemon
from aiflame.agent.kernel.sampler import SamplerConfig


class FakeDiscovery:
    def __init__(self, new: list[ProcInfo], gone: list[int]) -> None:
        self.new, self.gone = new, gone
        self.targets: dict[int, ProcInfo] = {}
        self.forgotten: list[int] = []

    def scan(self) -> tuple[list[ProcInfo], list[int]]:
        self.targets.update((i.pid, i) for i in self.new)
        return self.new, self.gone

    def forget(self, pid: int) -> None:
        self.forgotten.append(pid)
        self.targets.pop(pid, None)


class FakeCollector:
    def __init__(self, targets: list[int]) -> None:
        self.targets = list(targets)
        self.exited: list[int] = []
        self.removed: list[int] = []
        self.window_samples = 5
        self.probed_libraries = 3
        self.targets_refused = 0

    def add_target(self, pid: int) -> bool:
        if pid not in self.targets:
            self.targets.append(pid)
        return True

    def samples(self, pid: int) -> bool:
        return pid in self.targets

    def remove_target(self, pid: int) -> None:
        self.removed.append(pid)
        self.targets.remove(pid)


def _info(pid: int, uid: int = 1000) -> ProcInfo:
    return ProcInfo(pid, 0.0, f"job{pid}", "/bin/job", "job", "/", frozenset({"cuda"}), uid)


@pytest.fixture
def daemon(tmp_path: Path) -> Daemon:
    cfg = DaemonConfig(continuous=ContinuousConfig(frequency=7), output=OutputConfig(dir=tmp_path / "out"),
                       limits=LimitsConfig(max_targets=2), control=ControlConfig(socket=tmp_path / "agent.sock"))
    return Daemon(cfg)


def test_scan_samples_new_targets_up_to_the_limit(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    disc = FakeDiscovery([_info(1), _info(2), _info(3)], gone=[9])
    coll = FakeCollector([9])
    monkeypatch.setattr(daemon, "discovery", disc)
    monkeypatch.setattr(daemon, "collector", coll)
    daemon._scan()
    assert coll.removed == [9] and coll.targets == [1, 2]
    assert disc.forgotten == [3] and daemon.too_many_targets == 1
    coll.exited = [1, 42]  # a target and a child of one
    daemon._handle_exits(coll.exited)
    assert disc.forgotten == [3, 1, 42] and coll.exited == [] and list(disc.targets) == [2]


def test_no_user_crowds_out_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One user's processes fill their share only; children a target forked count for no limit (issue #20)."""
    cfg = DaemonConfig(output=OutputConfig(dir=tmp_path / "out"), control=ControlConfig(socket=tmp_path / "s"),
                       limits=LimitsConfig(max_targets=3, max_targets_per_user=2))
    daemon = Daemon(cfg)
    coll = FakeCollector([7])  # 7: a child of a target, followed since its fork; 8, forked by 7, not yet drained
    disc = FakeDiscovery([_info(7, 666), _info(1, 666), _info(2, 666), replace(_info(8, 666), ppid=7),
                          _info(3, 666), _info(4, 1000)], gone=[])
    monkeypatch.setattr(daemon, "discovery", disc)
    monkeypatch.setattr(daemon, "collector", coll)
    daemon._scan()
    assert coll.targets == [7, 1, 2, 8, 4] and disc.forgotten == [3] and daemon.too_many_targets == 1
    disc.new = [_info(5, 0)]
    daemon._scan()
    assert coll.targets == [7, 1, 2, 8, 4] and disc.forgotten == [3, 5]  # the three slots are taken


def test_latest_windows_and_status(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    daemon.out.prepare()
    for name in ("20260101T000000Z-000001", "20260101T000100Z-000002"):
        (daemon.out.windows / name).mkdir()
    latest = daemon._handle(LatestRequest(1))
    assert latest.data == {"windows": [str(daemon.out.windows / "20260101T000100Z-000002")]}
    disc = FakeDiscovery([], [])
    disc.targets[1] = _info(1)
    monkeypatch.setattr(daemon, "discovery", disc)
    monkeypatch.setattr(daemon, "collector", FakeCollector([1, 2]))
    monkeypatch.setattr(daemon, "windows", SimpleNamespace(written=4, samples=100, lost={"lost": 2}))
    monkeypatch.setattr(daemon, "captures", SimpleNamespace(written=1, running=False))
    daemon.status.publish(daemon._status())
    monkeypatch.setattr(daemon.status, "_wait_s", 0.01)  # no main loop here: the client gets the last status
    s = daemon._handle(StatusRequest()).data
    assert s["pid"] == os.getpid() and s["frequency_hz"] == 7 and s["target_count"] == 2
    assert s["targets"] == [{"pid": 1, "comm": "job1", "runtimes": ["cuda"], "via": "selector"},
                            {"pid": 2, "comm": "", "runtimes": [], "via": "child"}]
    assert s["windows_written"] == 4 and s["samples_total"] == 105 and s["counters"] == {"lost": 2}
    assert s["captures_written"] == 1 and s["probed_libraries"] == 3 and s["rss_mb"] > 0
    assert s["agent_cpu_s"] >= 0


@dataclass
class _Made:
    """What the daemon did with its collectors (a fake Collector): their sampler configs and runtimes flags as
    made, and the configs of those it closed."""

    made: list[tuple[SamplerConfig, bool]] = field(default_factory=list)
    closed: list[SamplerConfig] = field(default_factory=list)


def _fake_collectors(monkeypatch: pytest.MonkeyPatch) -> _Made:
    seen = _Made()

    class Made(FakeCollector):
        def __init__(self, sampler: SamplerConfig, runtimes: bool, label: str, max_probed_libraries: int) -> None:
            super().__init__([])
            seen.made.append((sampler, runtimes))
            self.config = sampler
            self.sampler = SimpleNamespace(watch=lambda fd: None)

        def start(self) -> None:
            pass

        def drain_interval(self, poll_s: float) -> float:
            return poll_s

        def close(self) -> None:
            seen.closed.append(self.config)

    monkeypatch.setattr("aiflame.agent.daemon.server.Collector", Made)
    return seen


def test_continuous_sampler_takes_the_launch_stack_rate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _fake_collectors(monkeypatch)
    cfg = DaemonConfig(continuous=ContinuousConfig(frequency=19, launch_stacks=5), output=OutputConfig(dir=tmp_path),
                       control=ControlConfig(socket=tmp_path / "agent.sock"))
    Daemon(cfg)._new_collector()
    (sampler, runtimes), = seen.made
    assert runtimes and sampler.call_rate == 5 and sampler.frequency == 19


class _Windows:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def reconfigure(self, cfg: DaemonConfig, out: object) -> None:
        self.calls.append("reconfigure")

    def close(self, reason: str) -> None:
        self.calls.append(f"close {reason}")

    def open(self, collector: object) -> None:
        self.calls.append("open")


@pytest.mark.parametrize(("change", "resampled"), [("launch_stacks = 7", True),
                                                   ("launch_stacks = 5\nwindow_s = 9", False)])
def test_a_reload_resamples_when_the_launch_stack_rate_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                change: str, resampled: bool) -> None:
    seen = _fake_collectors(monkeypatch)
    conf = tmp_path / "aiflame.toml"
    base = (f'[continuous]\nlaunch_stacks = 5\n[output]\ndir = "{tmp_path / "out"}"\n'
            f'[control]\nsocket = "{tmp_path / "s"}"\n')
    conf.write_text(base)
    daemon = Daemon(load_config(conf), conf)
    first = daemon._new_collector()
    windows = _Windows()
    monkeypatch.setattr(daemon, "collector", first)
    monkeypatch.setattr(daemon, "windows", windows)
    monkeypatch.setattr(daemon, "captures", SimpleNamespace(reconfigure=lambda cfg, out: None))
    conf.write_text(base.replace("launch_stacks = 5", change))
    daemon._reload()
    made = [sampler for sampler, _ in seen.made]
    assert [m.call_rate for m in made] == ([5, 7] if resampled else [5])
    assert seen.closed == made[:1] if resampled else not seen.closed
    assert (daemon.collector is not first) == resampled
    assert windows.calls == (["reconfigure", "close reload", "open"] if resampled else ["reconfigure"])
