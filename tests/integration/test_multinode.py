"""A training job across two "nodes" (issue #29), for real: two network namespaces joined by a veth pair, a 2×2-rank
gloo DDP job started by `torchrun --nnodes 2` in them, each node profiled by its own `aiflame profile`; the two
captures joined by `aiflame export` (Chakra, Perfetto) and `aiflame report comm` are one 4-rank job: every rank's
trace, the same collectives on every rank, the simulator's input rules kept, the clocks aligned. Only addresses
inside the namespaces made here are used; they are removed whatever happens. aiflame runs outside the namespaces
(`ip netns exec` mounts a sysfs of the namespace, without tracefs) and follows the command into them."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiflame.exporters.chakra import decode_et
from tests.conftest import REPO
from tests.integration.conftest import HANG_S, aiflame
from tests.perfetto_read import read as read_pftrace
from tests.unit.test_chakra_replay import attrs

# the accel-test extra installs torch (make setup), so it is there in CI. Never imported here: a pytest process that
# maps libtorch becomes a process the daemon tests' daemon watches and probes
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")

STEPS = 30
NET = "10.231.{}.{}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def nodes() -> Iterator[list[tuple[str, str, str]]]:
    """Two namespaces joined by a veth pair: [(namespace, interface, address)] for node 0 (the master) and 1."""
    tag = f"af{os.getpid() % 100000}"
    subnet = os.getpid() % 250 + 1
    made = [(f"{tag}n{i}", f"{tag}v{i}", NET.format(subnet, i + 1)) for i in range(2)]
    try:
        for ns, _, _ in made:
            _ip("netns", "add", ns)
        _ip("link", "add", made[0][1], "type", "veth", "peer", "name", made[1][1])
        for ns, ifc, addr in made:
            _ip("link", "set", ifc, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifc)
            _ip("-n", ns, "link", "set", ifc, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield made
    finally:
        for ns, _, _ in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_nodes_join_into_one_four_rank_job(nodes: list[tuple[str, str, str]], tmp_path: Path) -> None:
    # Oracle: torchrun's 4 ranks and the job's own step count; both namespaces share one real clock
    master = nodes[0][2]
    port = str(29000 + os.getpid() % 1000)
    runs = []
    for i, (ns, ifc, _) in enumerate(nodes):
        cmd = [sys.executable, "-m", "aiflame", "profile", "-q", "-F", "199", "-o", str(tmp_path / f"node{i}"), "--",
               "ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={ifc}", sys.executable, "-m",
               "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(i),
               "--master-addr", master, "--master-port", port, str(REPO / "tests" / "programs" / "ddp_nodes.py"),
               str(STEPS)]
        runs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [r.communicate(timeout=HANG_S)[0] for r in runs]
    for r, out in zip(runs, outs, strict=True):
        assert r.returncode == 0, out[-3000:]
    ran = sorted(int(m) for out in outs for m in re.findall(r"rank (\d) of 4 ran 30 steps", out))
    assert ran == [0, 1, 2, 3], outs  # the job itself: 4 ranks over the two namespaces

    captures = [str(tmp_path / f"node{i}" / "profile.aiflame") for i in range(2)]
    joined = aiflame("export", *captures, "-f", "chakra", "-o", str(tmp_path / "job"))
    clock = re.search(r"clock ([-+][\d.]+) ms from the hosts' realtime clocks, then ([-+][\d.]+) µs from (\d+) "
                      r"collectives", joined.stderr)
    assert clock, joined.stderr
    # one host here: the realtime clocks agree, and the collectives confirm it to well under a millisecond
    assert abs(float(clock[1])) < 1 and abs(float(clock[2])) < 1000 and int(clock[3]) >= STEPS, joined.stderr
    ets = sorted(tmp_path.glob("job.*.et"))
    assert [p.name for p in ets] == [f"job.{r}.et" for r in range(4)]
    assert "every rule" in aiflame("chakra", "check", str(tmp_path / "job")).stdout
    colls = {}
    for p in ets:
        nodes_ = decode_et(p.read_bytes())[1]
        colls[p.name] = [(attrs(n).get("comm_type"), attrs(n).get("comm_size")) for n in nodes_
                         if "comm_type" in attrs(n)]
    first = next(iter(colls.values()))
    assert len(first) >= STEPS and all(c == first for c in colls.values())  # identical collectives on every rank

    report = aiflame("report", "comm", *captures, "--no-plot").stdout
    for rank in range(4):
        assert re.search(rf"│ allreduce\s+│\s+{rank} │", report), report
    aiflame("export", *captures, "-f", "perfetto", "-o", str(tmp_path / "job.pftrace"))
    _, tracks, info, _ = read_pftrace((tmp_path / "job.pftrace").read_bytes())
    assert sorted(t["name"] for t in tracks.values() if t["name"].startswith("rank ")) == \
        [f"rank {r}" for r in range(4)] and info["world_size"] == 4
