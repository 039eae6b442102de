"""The daemon collector's bookkeeping that needs no BPF: warnings reach the daemon's log once each."""

from __future__ import annotations

from aiflame.agent.daemon.collector import Collector
from aiflame.agent.kernel.sampler import SamplerConfig


def test_each_warning_is_reported_once() -> None:
    c = Collector(SamplerConfig(), runtimes=False, label="t")
    c.pipeline.python.warnings.extend(["pid 1: no interpreter", "pid 1: no interpreter"])
    c.code_warnings.append("no cubin for kernel k")
    assert c._new_warnings() == ["pid 1: no interpreter", "no cubin for kernel k"]
    assert c._new_warnings() == []
    c.pipeline.python.warnings.append("pid 2: no interpreter")
    assert c._new_warnings() == ["pid 2: no interpreter"]
