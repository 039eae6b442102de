"""The two ways the daemon is deployed say the same thing: the Kubernetes DaemonSet (deploy/kubernetes) grants the
capabilities, memory and CPU of the systemd unit (deploy/aiflame-agent.service), sees the node's processes, mounts
what BCC and uprobes need from the node, and runs with a configuration the daemon accepts whose output and
control socket lie on the node's disk."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from aiflame.agent.daemon.config import parse_config
from tests.conftest import REPO

DEPLOY = REPO / "deploy"


def _unit() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (DEPLOY / "aiflame-agent.service").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _manifest() -> dict[str, dict[str, Any]]:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "aiflame-agent.yaml").read_text()))
    return {d["kind"]: d for d in docs}


def _under(path: Path, mounts: dict[str, str]) -> str | None:
    """The volume a path in the container lies on, by the longest mount path above it."""
    best = None
    for name, at in mounts.items():
        if path == Path(at) or Path(at) in path.parents:
            if best is None or len(at) > len(mounts[best]):
                best = name
    return best


def test_the_daemonset_grants_what_the_unit_grants() -> None:
    unit = _unit()
    pod = _manifest()["DaemonSet"]["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    sec = agent["securityContext"]
    assert pod["hostPID"] is True
    assert sec["capabilities"]["drop"] == ["ALL"]
    assert {"CAP_" + c for c in sec["capabilities"]["add"]} == set(unit["CapabilityBoundingSet"].split())
    assert sec["privileged"] is False and sec["allowPrivilegeEscalation"] is False
    mem = re.fullmatch(r"(\d+)M", unit["MemoryMax"])
    assert mem and agent["resources"]["limits"]["memory"] == f"{mem[1]}Mi"
    quota = re.fullmatch(r"(\d+)%", unit["CPUQuota"])
    assert quota and agent["resources"]["limits"]["cpu"] == f"{int(quota[1]) * 10}m"
    env = {e["name"]: e["value"] for e in agent["env"]}
    unit_env = dict(kv.split("=", 1) for kv in unit["Environment"].split())
    assert env == unit_env


def test_the_daemonset_mounts_what_the_agent_reads_and_writes() -> None:
    m = _manifest()
    pod = m["DaemonSet"]["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {vm["name"]: vm["mountPath"] for vm in agent["volumeMounts"]}
    assert set(mounts) == set(volumes)
    host = {n: v["hostPath"]["path"] for n, v in volumes.items() if "hostPath" in v}
    # BCC's headers, uprobe detach through tracefs: the node's own, at the same paths
    for path in ("/lib/modules", "/usr/src", "/sys/kernel/tracing"):
        name = _under(Path(path), mounts)
        assert name and host.get(name) == mounts[name] == path, path
    ro = {vm["name"] for vm in agent["volumeMounts"] if vm.get("readOnly")}
    assert {_under(Path(p), mounts) for p in ("/lib/modules", "/usr/src")} <= ro

    (text,) = m["ConfigMap"]["data"].values()
    cfg = parse_config(text, "configmap")
    assert agent["args"] == ["agent", "--config", f"{mounts['config']}/aiflame.toml"]
    # windows, captures, the control socket and the caches on the node's disk, where `aiflame` on the node and the
    # join of a job's captures find them; all writable (the root filesystem is not)
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    paths = [cfg.output.dir, cfg.control.socket.parent, Path(agent["env"][0]["value"])]
    for where in paths:
        name = _under(where, mounts)
        assert name is not None and name in host and name not in ro, where
        assert Path(host[name]) / where.relative_to(mounts[name]) == where, where
    assert {_under(Path(p), mounts) for p in ("/var/lib/aiflame", "/run/aiflame")} <= set(host)


def test_the_configmap_keeps_the_shipped_defaults() -> None:
    """The ConfigMap's keys are deploy/aiflame.toml's, with the same values: one set of defaults."""
    (text,) = _manifest()["ConfigMap"]["data"].values()
    shipped = parse_config((DEPLOY / "aiflame.toml").read_text(), "config")
    assert parse_config(text, "config") == shipped
