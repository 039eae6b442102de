"""The Chakra exporter on hand-built profiles: collectives that match across ranks (type, size, order) and map to
what the simulator runs; compute nodes that hold only compute (not waiting, not blocking, not the start-up before
the last rank arrived); complete nodes whose dependencies point back; traces that pass the validator and replay
together to the end. Also: rank fallbacks, the decoder on malformed bytes, and a property test over random
collective jobs.

Past 400 lines by one `Oracle:` line per truth check (issue #30), kept in one file with its fixtures."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.agent.rank_env import VARIABLES, rank_args, rank_event
from aiflame.core.errors import BadInput, NothingToShow, Unreadable
from aiflame.core.model import EventKind, Frame, FrameKind, Profile, Sample, TraceEvent
from aiflame.exporters.chakra import decode_et, encode_rank, write_traces
from aiflame.exporters.chakra_check import check_nodes
from aiflame.exporters.chakra_nodes import COMM_COLL, COMP, P2P_TAG, UNTAGGED, build_traces
from tests.unit.test_chakra_replay import attrs, load, pb, replay

MAIN = Frame("train_step", FrameKind.PYTHON, file="train.py", line=3)
GEMM = Frame("sgemm_kernel", FrameKind.NATIVE, module="libblas.so")


def ev(rank: int, call: str, start: int, dur: int = 1000, kind: EventKind = EventKind.COLLECTIVE, tid: int = 0,
       **args: int | str) -> TraceEvent:
    pid = 100 + rank
    return TraceEvent(call, kind, start, dur, pid, tid or pid, rank,
                      args={"runtime": "gloo", "call": call, "rank": rank, "world_size": 2, **args})


def samples(rank: int, times: range | list[int], stack: tuple[Frame, ...] = (MAIN, GEMM)) -> list[Sample]:
    pid = 100 + rank
    proc = Frame("trainer_proc", FrameKind.PROCESS)
    return [Sample((proc, *stack), 1, pid, pid, "trainer_proc", 0, t) for t in times]


def gloo_job() -> Profile:
    """Two ranks: compute, an all-reduce, uneven send/recv with waits, reduce/gather/scatter, a barrier."""
    prof = Profile()
    for r in (0, 1):
        other = 1 - r
        prof.samples += samples(r, range(5000, 100_000, 10_000))
        prof.events += [
            ev(r, "allreduce", 100_000, 50_000, tid=7, bytes=4096),
            ev(r, "send" if r == 0 else "recv", 200_000, 2000, peer=other, tag=3, bytes=400, work=9),
            ev(r, "send_wait" if r == 0 else "recv_wait", 210_000, 5000, EventKind.SYNC, peer=other, work=9),
            ev(r, "reduce", 300_000, 3000, tid=7, bytes=800, root=1),
            ev(r, "gather", 310_000, 3000, tid=8, bytes=200, root=0),
            ev(r, "scatter", 320_000, 3000, tid=7, bytes=300, root=1),
            ev(r, "barrier", 330_000, 3000, tid=8, bytes=0),
            ev(r, "alltoallv", 340_000, 3000, tid=7, bytes=1000 * (r + 1)),
        ]
    prof.samples += samples(0, range(220_000, 300_000, 10_000), (MAIN,))
    return prof


MS = 1_000_000


def timed_job(world: int = 2) -> Profile:
    """A 2-rank job on a 1 ms sampling grid (1000 Hz): rank 1 arrives at the first all-reduce 2 ms after rank 0;
    compute 15-35 ms, a send/recv with waits 35-38 ms, compute 38-48 ms, reduce, gather, scatter, barrier and an
    uneven all-to-all 48-53 ms, compute 53-60 ms, a last all-reduce 60-61 ms. Rank 0 also computed before its
    first collective (start-up, 0-10 ms), which is not charged."""
    prof = Profile(meta={"frequency_hz": "1000"})
    for r in range(world):
        other = 1 - r
        prof.events += [
            ev(r, "allreduce", (10 + 2 * r) * MS, (5 - 2 * r) * MS, tid=7, bytes=4096),
            ev(r, "send" if r == 0 else "recv", 35 * MS, MS // 10, peer=other, tag=3, bytes=400, work=9),
            ev(r, "send_wait" if r == 0 else "recv_wait", 35 * MS + MS // 10, 3 * MS - MS // 10, EventKind.SYNC,
               peer=other, work=9),
            ev(r, "reduce", 48 * MS, MS, tid=7, bytes=800, root=1),
            ev(r, "gather", 49 * MS, MS, tid=8, bytes=200, root=0),
            ev(r, "scatter", 50 * MS, MS, tid=7, bytes=300, root=1),
            ev(r, "barrier", 51 * MS, MS, tid=8, bytes=0),
            ev(r, "alltoallv", 52 * MS, MS, tid=7, bytes=3200 if r == 0 else 7200,
               wire_sent=2000 if r == 0 else 2800),
            ev(r, "allreduce", 60 * MS, MS, tid=8, bytes=4096),
        ]
        busy = [*range(15, 35), *range(38, 48), *range(53, 60)]
        prof.samples += samples(r, [int((t + 0.5) * MS) for t in busy])
    prof.samples += samples(0, [int((t + 0.5) * MS) for t in range(0, 10)])
    return prof


def encoded(prof: Profile, tmp_path: Path) -> dict[int, list[Any]]:
    files, traces = write_traces(prof, tmp_path / "job")
    assert [f.name for f in files] == [f"job.{r}.et" for r in range(len(files))]
    assert not [str(p) for p in traces.problems if p.severity == "error"]
    return load(files)


def by_name(nodes: list[Any]) -> dict[str, Any]:
    return {n.name: n for n in nodes}


def test_collectives_match_across_ranks_and_map_to_what_the_simulator_runs(tmp_path: Path) -> None:
    # Oracle: mlc-chakra's schema and decoder; the replay written for the tests; timed_job by construction
    ranks = encoded(timed_job(), tmp_path)
    replay(ranks)
    colls = {r: [(n.name, attrs(n)["comm_type"], attrs(n)["comm_size"]) for n in nodes
                 if n.type == pb.COMM_COLL_NODE] for r, nodes in ranks.items()}
    assert colls[0] == colls[1] == [
        ("allreduce", pb.ALL_REDUCE, 4096), ("reduce", pb.ALL_REDUCE, 800), ("gather", pb.ALL_GATHER, 200),
        ("scatter", pb.ALL_GATHER, 300), ("barrier", pb.ALL_REDUCE, 1),
        ("alltoallv", pb.ALL_TO_ALL, 5600),  # N/(N-1) x the most a rank sent to the others (2800 B)
        ("allreduce", pb.ALL_REDUCE, 4096)]
    for r, nodes in ranks.items():
        a = {n.name: attrs(n) for n in nodes}
        assert a["alltoallv"]["aiflame_bytes"] == (3200, 7200)[r] and "uneven" in a["alltoallv"]["aiflame_mapped"]
        assert a["barrier"]["aiflame_mapped"] == "barrier as a 1-byte ALL_REDUCE"
        assert "reduce as an ALL_REDUCE" in a["reduce"]["aiflame_mapped"] and "aiflame_mapped" not in a["allreduce"]
        assert all(x.get("is_cpu_op") is False for x in a.values())
        assert not any(n.type in (pb.MEM_LOAD_NODE, pb.MEM_STORE_NODE, pb.METADATA_NODE) for n in nodes)
    send, recv = by_name(ranks[0])["send"], by_name(ranks[1])["recv"]
    assert (attrs(send)["comm_tag"], attrs(send)["comm_size"], attrs(send)["comm_dst"]) == (P2P_TAG + 3, 400, 1)
    assert (attrs(recv)["comm_tag"], attrs(recv)["comm_size"], attrs(recv)["comm_src"]) == (P2P_TAG + 3, 400, 0)


def test_compute_nodes_hold_only_compute(tmp_path: Path) -> None:
    # Oracle: by construction — timed_job's compute stretches (15-35, 38-48, 53-60 ms) on a 1 ms grid
    traces = build_traces(timed_job())
    for r, t in traces.ranks.items():
        comp = [n for n in t.nodes if n.type == COMP]
        # the three stretches without communication; nothing before the last rank's first call (12 ms)
        assert [(n.start_ns // MS, n.duration_ns // MS) for n in comp] == [(15, 20), (38, 10), (53, 7)]
        m = traces.timeline.ranks[r].measured
        assert (m.window_ns, m.compute_ns, m.exposed_ns, m.idle_ns) == (49 * MS, 37 * MS, 12 * MS, 0)
        assert traces.timeline.ranks[r].start_ns == 12 * MS
    assert traces.timeline.ranks[0].arrived_ns == 10 * MS
    # the early rank's first collective starts at the window: it absorbs no start-up skew
    first = next(n for n in traces.ranks[0].nodes if n.type == COMM_COLL)
    assert first.start_ns == 12 * MS and first.id == 1 and not first.data_deps


def test_compute_during_communication_counts_samples_at_the_run_fraction() -> None:
    """Outside communication the thread got half a CPU (a sample every other ms): inside, 3 samples in 10 ms count
    as 6 ms of compute; the rest is exposed communication."""
    # Oracle: by construction — half a CPU outside communication, 3 samples in 10 ms inside
    prof = Profile(meta={"frequency_hz": "1000"})
    for r in (0, 1):
        prof.events += [ev(r, "allreduce", 0, 2 * MS, tid=7, bytes=64),
                        ev(r, "allreduce", 20 * MS, 10 * MS, tid=7, bytes=64),
                        ev(r, "allreduce", 40 * MS, MS, tid=7, bytes=64)]
        prof.samples += samples(r, [int((t + 0.5) * MS) for t in (*range(2, 20, 2), *range(30, 40, 2))])
        prof.samples += samples(r, [int((t + 0.5) * MS) for t in (21, 24, 27)])
    tl = build_traces(prof).timeline
    m = tl.ranks[0].measured
    assert m.run_fraction == pytest.approx(0.5)
    inside = [c for c in tl.ranks[0].compute if c.in_comm and c.start_ns == 20 * MS][0]
    assert inside.compute_ns == 6 * MS
    assert m.compute_ns == (18 + 10 + 6) * MS and m.exposed_ns == (2 + 4 + 1) * MS


def test_long_sample_gaps_outside_communication_are_blocked_time() -> None:
    # Oracle: by construction — no sample from 100 to 300 ms at 1000 Hz
    prof = Profile(meta={"frequency_hz": "1000"})
    for r in (0, 1):
        prof.events += [ev(r, "allreduce", 0, MS, tid=7, bytes=64), ev(r, "allreduce", 400 * MS, MS, tid=7, bytes=64)]
        prof.samples += samples(r, [int((t + 0.5) * MS) for t in (*range(1, 100), *range(300, 400))])
    m = build_traces(prof).timeline.ranks[0].measured
    # 100-300 ms without a sample at 1000 Hz: blocked (sleep, I/O), not compute
    assert m.idle_ns == pytest.approx(200 * MS, rel=0.02) and m.compute_ns == pytest.approx(199 * MS, rel=0.02)


def replayed_finish(nodes: list[Any]) -> int:
    """When one rank's nodes finish if each starts once its dependencies have ended and lasts what it lasted in
    the capture (the simulator's replay of a rank whose collectives take their captured time)."""
    end: dict[int, int] = {}
    for n in sorted(nodes, key=lambda n: n.id):
        end[n.id] = max((end[d] for d in [*n.ctrl_deps, *n.data_deps]), default=nodes[0].start_ns) + n.duration_ns
    return max(end.values())


def test_a_collective_overlapping_compute_does_not_wait_for_it() -> None:
    """DDP's all-reduce of a gradient bucket runs on gloo's worker while the backward pass goes on computing: the
    compute piece that starts with the collective (the window is cut at its start) comes after it, so the
    collective depends on the compute before it only, and a replay at the captured durations takes the window,
    not the window plus the overlapped compute (it did: the collective waited for that compute, and the compute
    after the collective for the collective)."""
    # Oracle: by construction (samples through the all-reduce); replayed_finish, a replay written here
    prof = Profile(meta={"frequency_hz": "1000"})
    for r in (0, 1):
        prof.events += [ev(r, "allreduce", 0, MS, tid=7, bytes=64),
                        ev(r, "allreduce", 10 * MS, 10 * MS, tid=7, bytes=1 << 20),  # overlaps compute
                        ev(r, "allreduce", 40 * MS, MS, tid=7, bytes=64)]
        prof.samples += samples(r, [int((t + 0.5) * MS) for t in range(1, 40)])
    traces = build_traces(prof)
    for r, t in traces.ranks.items():
        comp = {n.start_ns // MS: n for n in t.nodes if n.type == COMP}
        bucket = next(n for n in t.nodes if n.type == COMM_COLL and n.start_ns == 10 * MS)
        assert sorted(comp) == [1, 10, 20] and comp[10].duration_ns == 10 * MS  # computed through the all-reduce
        assert bucket.data_deps == [comp[1].id] and bucket.id < comp[10].id
        assert bucket.id not in comp[10].data_deps and bucket.id in comp[20].data_deps
        assert replayed_finish(t.nodes) - t.nodes[0].start_ns == traces.timeline.ranks[r].measured.window_ns


def test_nodes_are_complete_and_dependencies_point_back(tmp_path: Path) -> None:
    # Oracle: mlc-chakra's decoder; timed_job's compute stretches (20, 10 and 7 ms) by construction
    for nodes in encoded(timed_job(), tmp_path).values():
        ids = {n.id for n in nodes}
        for n in nodes:
            deps = [*n.ctrl_deps, *n.data_deps]
            assert all(d < n.id and d in ids for d in deps)
            assert len(set(n.data_deps)) == len(n.data_deps) and len(set(n.ctrl_deps)) == len(n.ctrl_deps)
            assert n.duration_micros >= 1  # every node lasts (a COMP of 0 µs would be replayed as 1 ns)
        comp = [n for n in nodes if n.type == pb.COMP_NODE]
        assert [n.duration_micros for n in comp] == [20000, 10000, 7000]
        # compute after the send/recv waited for it; the send waited for the compute before it
        p2p = next(n for n in nodes if n.type in (pb.COMM_SEND_NODE, pb.COMM_RECV_NODE))
        assert comp[0].id in p2p.data_deps and p2p.id in comp[1].data_deps


def test_each_send_ends_at_its_own_wait_when_work_addresses_are_reused() -> None:
    """gloo frees a send's Work and the next send gets the same address: each post takes the wait after it."""
    # Oracle: by construction — each send's wait placed 2 µs after it, for 1 ms
    prof = Profile()
    for r in (0, 1):
        for i in range(3):
            t = i * 10 * MS
            call, wait = ("send", "send_wait") if r == 0 else ("recv", "recv_wait")
            prof.events += [ev(r, call, t, 1000, peer=1 - r, tag=i, bytes=64, work=42),
                            ev(r, wait, t + 2000, MS, EventKind.SYNC, peer=1 - r, work=42)]
    ops = build_traces(prof).timeline.ranks[0].ops
    assert [(op.start_ns // MS, op.end_ns - op.start_ns) for op in ops] == [(0, 2000 + MS), (10, 2000 + MS),
                                                                            (20, 2000 + MS)]


def test_gloo_job_replays(tmp_path: Path) -> None:
    # Oracle: the replay written for the tests (test_chakra_replay.replay), on mlc-chakra's decoding
    ranks = encoded(gloo_job(), tmp_path)
    finish = replay(ranks)
    assert set(finish) == {0, 1}
    assert not any(n.type == pb.COMP_NODE and attrs(n)["is_cpu_op"] for nodes in ranks.values() for n in nodes)


def test_cuda_launches_copies_and_syncs(tmp_path: Path) -> None:
    # Oracle: mlc-chakra's decoder; the calls' times, sizes and streams by construction
    prof = Profile(samples=samples(0, range(10_000, 50_000, 5000)), start_ns=10_000)

    def cuda(call: str, kind: EventKind, start: int, **a: int | str) -> TraceEvent:
        e = ev(0, call, start, 2000, kind)
        e.args.update(a)
        e.args["runtime"] = "cuda"
        e.args.pop("world_size")
        return e

    prof.events = [
        cuda("cudaMemcpy", EventKind.COPY, 10_000, bytes=1 << 20, direction="HtoD"),
        cuda("cudaLaunchKernel", EventKind.COMPUTE, 20_000, stream=5),
        cuda("cudaLaunchKernel", EventKind.COMPUTE, 22_000, stream=5, gpu_ns=7000),
        cuda("cudaStreamSynchronize", EventKind.SYNC, 30_000, stream=5),
        cuda("cudaMemcpyAsync", EventKind.COPY, 40_000, bytes=4096, direction="DtoH", stream=5),
        cuda("cudaDeviceSynchronize", EventKind.SYNC, 45_000),
    ]
    prof.events[1].name = prof.events[2].name = "scale_kernel"
    nodes = encoded(prof, tmp_path)[0]
    assert all(n.type == pb.COMP_NODE and attrs(n)["is_cpu_op"] is False for n in nodes)
    by = {(n.name, n.start_time_micros): n for n in nodes}
    load_ = by[("cudaMemcpy HtoD", 0)]
    assert attrs(load_)["tensor_size"] == 1 << 20 and load_.duration_micros == 2
    k1, k2 = by[("scale_kernel", 10)], by[("scale_kernel", 12)]
    assert k1.id in k2.ctrl_deps and k2.duration_micros == 7
    store = by[("cudaMemcpyAsync DtoH", 30)]
    assert k2.id in [*store.ctrl_deps, *store.data_deps]  # after the sync, it waits for the stream


def test_nccl_point_to_point_tags_pair_up(tmp_path: Path) -> None:
    # Oracle: the replay written for the tests, on mlc-chakra's decoding
    prof = Profile()
    for r in (0, 1):
        for i in range(3):
            e = ev(r, "ncclSend" if r == 0 else "ncclRecv", 1000 * (i + 1), peer=1 - r, bytes=64 * (i + 1))
            e.args["runtime"] = "nccl"
            prof.events.append(e)
    ranks = encoded(prof, tmp_path)
    replay(ranks)
    tags = [attrs(n)["comm_tag"] for n in ranks[0] if n.type == pb.COMM_SEND_NODE]
    assert tags == [UNTAGGED, UNTAGGED + 1, UNTAGGED + 2]


def test_worker_race_swaps_back_and_mismatches_are_warned() -> None:
    # Oracle: by construction — the two ranks issue the same two calls, 1 µs apart in opposite order
    prof = Profile()
    for r in (0, 1):
        calls = ["allreduce", "broadcast"] if r == 0 else ["broadcast", "allreduce"]  # two workers, 1 µs apart
        prof.events += [ev(r, c, 1000 * r + i, 500, tid=7 + i, bytes=64) for i, c in enumerate(calls)]
    traces = build_traces(prof)
    seqs = {r: [n.name for n in t.nodes if n.type == COMM_COLL] for r, t in traces.ranks.items()}
    assert seqs[0] == ["allreduce", "broadcast"] and [op.call for op in sorted(
        (o for o in traces.timeline.ranks[1].ops), key=lambda o: o.seq)] == ["allreduce", "broadcast"]
    prof.events.append(ev(0, "allgather", 5000, 500, bytes=64))
    traces = build_traces(prof)
    assert any("without a counterpart" in w for w in traces.warnings)
    assert [n.name for n in traces.ranks[0].nodes if n.type == COMM_COLL] == ["allreduce", "broadcast"]


def test_ranks_from_events_or_numbered_after(tmp_path: Path) -> None:
    prof = gloo_job()
    for e in prof.events:
        if e.pid == 101:
            e.rank = -1
    traces = build_traces(prof)
    assert sorted(traces.ranks) == [0, 1] and traces.ranks[1].pids == [101]
    assert any("no rank known" in w for w in traces.warnings)


def test_no_communication_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(NothingToShow, match="nothing for a Chakra trace"):
        write_traces(Profile(samples=samples(0, range(1, 4))), tmp_path / "x")
    with pytest.raises(BadInput, match="no such directory"):
        write_traces(gloo_job(), tmp_path / "missing" / "x")


def test_decoder_rejects_malformed_bytes() -> None:
    trace = build_traces(gloo_job()).ranks[0]
    data = encode_rank(trace, 0)
    meta, nodes = decode_et(data)
    assert meta.version and len(nodes) == len(trace.nodes)
    for bad in (b"", data[: len(data) - 3], b"\xff" * 12):
        with pytest.raises(Unreadable):
            decode_et(bad)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_decoder_fuzz(data: bytes) -> None:
    try:
        decode_et(data)
    except Unreadable:
        pass


OPS = ("allreduce", "allgather", "broadcast", "alltoallv", "reduce", "gather", "scatter", "barrier", "p2p")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 1), st.integers(0, 4096), st.integers(0, 20_000)),
                min_size=1, max_size=12), st.integers(2, 4))
def test_random_jobs_pass_the_validator_and_replay(job: list[tuple[str, int, int, int]], world: int) -> None:
    """Any sequence of collectives the ranks agree on, with random compute gaps and sizes (0 included), passes
    every rule of the validator and replays to the end."""
    # Oracle: the replay written for the tests, on mlc-chakra's decoding (the validator is ours)
    prof = Profile(meta={"frequency_hz": "997"})
    for r in range(world):
        t = 0
        for i, (op, root, size, gap) in enumerate(job):
            t += gap + 10 * r
            if op == "p2p":  # a ring step: send to the next rank, receive from the previous one
                for call, peer in (("send", (r + 1) % world), ("recv", (r - 1) % world)):
                    e = ev(r, call, t, 500, peer=peer, tag=i, bytes=size)
                    e.args["world_size"] = world
                    prof.events.append(e)
                    t += 600
                continue
            e = ev(r, op, t, 500, tid=7 + i % 2, bytes=size * (1 + r % 2 if op == "alltoallv" else 1),
                   root=root % world)
            e.args["world_size"] = world
            prof.events.append(e)
            t += 500
        prof.samples += samples(r, range(1, t, 997))
    traces = build_traces(prof)
    by_rank = {}
    for r, trace in traces.ranks.items():
        _, nodes = decode_et(encode_rank(trace, 0))
        by_rank[r] = nodes
    assert sorted(by_rank) == list(range(world))
    assert not [str(p) for p in check_nodes(by_rank, world=world) if p.severity == "error"]
    replay(by_rank)


def test_rank_environment_parsing() -> None:
    env = {"PATH": "/bin", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert rank_args(env) == {"rank": 3, "world_size": 4, "local_rank": 1, "local_world_size": 2}
    assert rank_args({"RANK": "3", "WORLD_SIZE": "2"}) == {}  # a rank outside its world places nothing
    assert rank_args({"RANK": "x", "WORLD_SIZE": "2"}) == {}
    assert rank_args({"RANK": "-1", "WORLD_SIZE": "2"}) == {}
    assert rank_args({"RANK": "\u0663", "WORLD_SIZE": "\u0664"}) == {}  # digits, but not ASCII ones
    assert rank_args({"RANK": "0"}) == {}


def test_rank_event_of_a_live_process() -> None:
    # Oracle: by construction — the child is started with RANK=1 WORLD_SIZE=2
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                          env=env) as child:
        # until the child has exec'd, /proc shows the environment it was forked with, not the one it was given
        end = time.monotonic() + 60
        while (ev := rank_event(child.pid, 5)) is None and time.monotonic() < end:
            time.sleep(0.01)
        assert child.stdin is not None
        child.stdin.close()
    assert ev is not None and ev.args == {"rank": 1, "world_size": 2} and ev.pid == child.pid
    assert rank_event(child.pid, 5) is None  # gone


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*VARIABLES, "PATH"]), st.text(max_size=10)))
def test_rank_environment_fuzz(env: dict[str, str]) -> None:
    out = rank_args(env)
    if "rank" in out:
        assert 0 <= out["rank"] < out["world_size"]
