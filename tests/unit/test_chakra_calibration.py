"""A network calibrated on one capture and checked on another (exporters/chakra_calibration.py): hand-built jobs
whose calls cost a known host part (per call and per byte, different for each kind, as gloo's do) plus a known
link (latency per step, bandwidth); the calibration on a size sweep recovers both parts; a second job exported
with it gets a host-cost node before each call, passes ASTRA-sim's input rules, and each of its calls is predicted
(host node + the simulator's link time) as long as it took; `report sim` tells a prediction from a reproduction;
the calibration line in the network file is refused in one line when it is not one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.core.errors import NothingToShow, Unreadable
from aiflame.core.model import Profile
from aiflame.exporters.chakra import ChakraExporter, write_traces
from aiflame.exporters.chakra_calibration import (
    MARK,
    calibrate,
    calibration_yaml,
    capture_id,
    load_calibration,
    read_calibration,
)
from aiflame.exporters.chakra_network import GIB, fit_network, network_yaml
from aiflame.exporters.chakra_nodes import COMP, build_traces
from aiflame.exporters.sim_report import compare, parse_sim_log, provenance
from tests.unit.test_chakra import MS, ev, samples, timed_job

LATENCY_NS = 2000.0  # per step of the simulator's model
LINK_NS_PER_B = 0.8
# kind -> (latency steps L, host ns per call, host ns per simulated byte); 2 ranks, 4 splits
KINDS = {"allreduce": (16, 300_000.0, 0.7), "allgather": (8, 120_000.0, 2.5), "broadcast": (8, 0.0, 0.2),
         "send/recv": (2, 60_000.0, 0.0)}
SIZES = (4096, 65536, 1 << 20, 4 << 20, 16 << 20)


def truth(kind: str, nbytes: int) -> int:
    steps, per_call, per_byte = KINDS[kind]
    return round(per_call + per_byte * nbytes + steps * LATENCY_NS + LINK_NS_PER_B * nbytes)


def job(calls: list[tuple[str, int]], compute_ns: int = 0, start_wall: int = 1) -> Profile:
    """Two ranks making `calls` in order, each taking its true time (rank 1 arrives 50 µs late at collectives,
    so the last arriver's time is the call's); with `compute_ns`, both compute that long before each call."""
    prof = Profile(meta={"frequency_hz": "1000", "host": "h", "boot_id": "b", "start_wall_ns": str(start_wall)})
    t = MS
    tag = 0
    for kind, size in calls:
        if compute_ns:
            for r in (0, 1):
                prof.samples += samples(r, range(t + MS // 2, t + compute_ns, MS))
            t += compute_ns
        dur = truth(kind, size)
        if kind == "send/recv":
            tag += 1
            for r in (0, 1):
                prof.events.append(ev(r, "send" if r == 0 else "recv", t, dur, tid=7, bytes=size, peer=1 - r, tag=tag))
        else:
            for r in (0, 1):
                late = 50_000 * r
                prof.events.append(ev(r, kind, t + late, dur + 50_000 * (1 - r), tid=7, bytes=size))
        t += dur + 100_000
    return prof


def sweep() -> Profile:
    calls = [(k, s) for s in SIZES for k in KINDS for _ in range(3)]
    prof = job(calls)
    # one call in each kind's largest size twice as long (preempted): the medians keep it from moving the line
    slow = {k: False for k in KINDS}
    for e in prof.events:
        kind = "send/recv" if e.name in ("send", "recv") else e.name
        if e.args.get("bytes") == SIZES[-1] and not slow[kind] and e.name != "recv":
            e.duration_ns *= 2
            slow[kind] = True
    return prof


def test_calibration_separates_the_host_from_the_link() -> None:
    # Oracle: by construction — truth(): each call's host cost and link time are set here per kind
    cal = calibrate(build_traces(sweep()), "sweep", "gloo")
    assert 1e9 / (cal.bandwidth_gibps * GIB) == pytest.approx(LINK_NS_PER_B, rel=0.02)  # the fastest kind's rate
    assert cal.latency_ns == pytest.approx(LATENCY_NS, rel=0.05)  # the kind with no per-call host cost
    for kind, (_, per_call, per_byte) in KINDS.items():
        h = cal.host[kind]
        assert h.per_call_ns == pytest.approx(per_call, abs=3000), kind
        assert h.per_byte_ns == pytest.approx(per_byte, abs=0.02), kind
        assert h.sizes == len(SIZES)
    assert cal.world == 2 and cal.transport == "gloo"


def test_calibrated_on_a_sweep_it_predicts_another_job(tmp_path: Path) -> None:
    """Fit on one capture, check on another: each held-out call's host node plus the link time of the
    simulator's model is what the call took (the simulator's own run is by hand: docs/chakra.md)."""
    # Oracle: by construction — truth() on a held-out job (ASTRA-sim's own run is by hand: docs/chakra.md)
    cal = calibrate(build_traces(sweep()), "sweep", "gloo")
    other = job([("allreduce", 40_000), ("allgather", 4000), ("broadcast", 10_000), ("send/recv", 4096),
                 ("allreduce", 4 << 20), ("broadcast", 1 << 20), ("send/recv", 120_000)] * 3,
                compute_ns=2 * MS, start_wall=2)
    files, traces = write_traces(other, tmp_path / "job", calibration=cal)
    assert traces.problems == [] and len(files) == 2
    text = (tmp_path / "job.network.yml").read_text()
    assert read_calibration(text) == cal and "calibrated by aiflame on capture sweep" in text
    link_ns_per_b = 1e9 / (cal.bandwidth_gibps * GIB)
    for t in traces.ranks.values():
        by_id = {n.id: n for n in t.nodes}
        calls = [n for n in t.nodes if n.type != COMP]
        assert len(calls) == 21
        for n in calls:
            (host,) = [by_id[d] for d in n.data_deps if "aiflame_host_cost" in by_id[d].attrs]
            assert host.type == COMP and host.name == f"host: {n.name}"
            kind = "send/recv" if n.name in ("send", "recv") else n.name
            size = int(n.attrs["aiflame_bytes"][1])
            steps = KINDS[kind][0]
            predicted = host.duration_ns + steps * cal.latency_ns + size * link_ns_per_b
            assert predicted == pytest.approx(truth(kind, size), rel=0.03), (kind, size)


def test_a_network_fitted_to_one_job_does_not_predict_another() -> None:
    """The trap the calibration avoids: one bandwidth and latency fitted to small calls puts gloo's per-call cost
    into the bandwidth, and a job of large calls runs many times too long with it."""
    # Oracle: by construction — truth() of the large calls the small-call fit mispredicts
    small = job([("allreduce", 40_000), ("allgather", 4000), ("send/recv", 4096)] * 5)
    fit = fit_network(build_traces(small))
    assert fit is not None
    took = sum(truth(k, s) for k, s in [("allreduce", 16 << 20), ("broadcast", 4 << 20)])
    per_b = 1e9 / (fit.bandwidth_gibps * GIB)
    with_fit = 16 * fit.latency_ns + (16 << 20) * per_b + 8 * fit.latency_ns + (4 << 20) * per_b
    assert with_fit > 3 * took


def test_report_sim_tells_a_prediction_from_a_reproduction() -> None:
    # Oracle: by construction — which capture each network file was made from; a simulator log written here
    prof = timed_job()
    prof.meta.update(host="h", boot_id="b", start_wall_ns="7")
    fit = fit_network(build_traces(prof))
    assert fit is not None
    own = provenance(prof, network_yaml(fit, 2, capture_id(prof)), "net.yml")
    assert own.held_out is False and "reproduces the job by construction" in own.line
    other = provenance(prof, network_yaml(fit, 2, "h/other/1"), "net.yml")
    assert other.held_out is True and "held out" in other.line
    assert provenance(prof, "topology: [ Switch ]\n", "hand.yml").held_out is None

    cal = calibrate(build_traces(sweep()), "sweep", "gloo")
    p = provenance(prof, calibration_yaml(cal, 2), "cal.yml")
    assert p.held_out is True and set(p.host_ns) == {0, 1} and all(v > 0 for v in p.host_ns.values())
    hosts = build_traces(prof, host=cal.host_ns)
    assert p.host_ns[0] == sum(n.duration_ns for n in hosts.ranks[0].nodes if "aiflame_host_cost" in n.attrs)
    log = "".join(f"sys[{r}] finished, {60 * MS} cycles, exposed communication {10 * MS} cycles.\n" for r in (0, 1))
    plain, counted = compare(hosts.timeline, parse_sim_log(log)), compare(hosts.timeline, parse_sim_log(log),
                                                                           p.host_ns)
    assert [(c.simulated_exposed_ns or 0) - (a.simulated_exposed_ns or 0)
            for a, c in zip(plain, counted, strict=True)] == [p.host_ns[0], p.host_ns[1]]
    same = calibrate(build_traces(sweep()), capture_id(prof), "gloo")
    assert provenance(prof, calibration_yaml(same, 2), "cal.yml").held_out is False


def test_a_call_not_calibrated_is_costed_as_the_kind_the_simulator_runs_it_as() -> None:
    cal = calibrate(build_traces(sweep()), "sweep", "gloo")
    assert cal.host_ns("reduce", 1000) == cal.host_ns("allreduce", 1000)
    assert cal.host_ns("gather", 1000) == cal.host_ns("allgather", 1000)
    assert cal.host_ns("alltoallv", 1000) is None and cal.host_ns("ncclSend", 10) is None
    assert cal.stand_ins({"reduce", "allreduce", "alltoall"}) == [
        "alltoall: not in the calibration, no host cost (the link's time only)",
        "reduce: not in the calibration, costed as allreduce"]


def test_too_few_sizes_is_refused_in_one_line() -> None:
    with pytest.raises(NothingToShow, match="no call kind was made at 3 or more sizes"):
        calibrate(build_traces(job([("allreduce", 4096)] * 4)), "x")


def test_the_exporter_takes_a_calibrated_network_file(tmp_path: Path) -> None:
    cal = calibrate(build_traces(sweep()), "sweep", "gloo")
    net = tmp_path / "host.network.yml"
    net.write_text(calibration_yaml(cal, 2))
    out = ChakraExporter(network=str(net)).write(job([("allreduce", 1 << 20)] * 2, compute_ns=MS), tmp_path / "j")
    assert "calibrated on capture sweep" in out[-1].summary
    fitted = tmp_path / "fitted.yml"
    fitted.write_text(network_yaml(fit_network(build_traces(sweep())) or pytest.fail("no fit"), 2, "x"))
    for bad, msg in ((fitted, "no aiflame-calibration line"), (tmp_path / "none.yml", "No such file")):
        with pytest.raises(Unreadable, match=msg):
            ChakraExporter(network=str(bad)).write(job([("allreduce", 1 << 20)] * 2), tmp_path / "k")
    huge = tmp_path / "huge.yml"
    huge.write_bytes(b"#" * ((1 << 20) + 1))
    with pytest.raises(Unreadable, match="not a network file"):
        load_calibration(huge)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=200), st.builds(json.dumps, st.dictionaries(
    st.sampled_from(["bandwidth_gibps", "latency_ns", "host", "source", "transport", "calls", "world", "notes"]),
    st.one_of(st.none(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=5),
              st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))))))
def test_a_malformed_calibration_line_is_refused_in_one_line(body: str) -> None:
    """Whatever follows the mark: a calibration whose costs are all non-negative, or Unreadable."""
    try:
        cal = read_calibration(f"topology: [ Switch ]\n{MARK}{body}\n")
    except Unreadable as e:
        assert "\n" not in str(e)
        return
    assert cal is not None and cal.bandwidth_gibps > 0 and cal.latency_ns >= 0


def test_the_calls_tail_is_kept_as_a_per_call_cost() -> None:
    """Calls not scheduled at once (here one small call in six takes 3 ms more, as on a busy 2-core host) come at
    random, whatever the kind: the typical line comes from the medians, and the average excess of the small calls
    is added to every kind's per-call cost, so the sweep's total time is kept."""
    # Oracle: by construction — one small call in six made 3 ms longer here
    prof = sweep()
    small = [e for e in prof.events if e.name != "recv" and int(e.args["bytes"]) <= 64 << 10]
    for e in small[::6]:
        e.duration_ns += 3 * MS
    for e in prof.events:  # a receive ends with its send
        if e.name == "recv":
            (send,) = [s for s in prof.events if s.name == "send" and s.args["tag"] == e.args["tag"]]
            e.duration_ns = send.duration_ns
    plain = calibrate(build_traces(sweep()), "a")
    spiky = calibrate(build_traces(prof), "b")
    calls_small = len(small)
    spikes = len(small[::6])
    for kind in KINDS:
        assert spiky.host[kind].per_call_ns - plain.host[kind].per_call_ns == \
            pytest.approx(3 * MS * spikes / calls_small, rel=0.25), kind
