"""The Chakra exporter on hand-built profiles: every runtime event kind becomes the node the simulator runs, with
its attributes in the typed slots, dependencies that make a DAG, and traces whose ranks replay together to the
end. Also: rank fallbacks, the decoder on malformed bytes, and a property test over random collective jobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.agent.rank_env import parse_environ
from aiflame.core.model import EventKind, Frame, FrameKind, Profile, Sample, TraceEvent
from aiflame.exporters.chakra import decode_et, encode_rank, write_traces
from aiflame.exporters.chakra_nodes import DECOMPOSED_TAG, P2P_TAG, ChakraError, build_traces
from tests.unit.test_chakra_replay import attrs, check_trace, load, pb, replay

MAIN = Frame("train_step", FrameKind.PYTHON, file="train.py", line=3)
GEMM = Frame("sgemm_kernel", FrameKind.NATIVE, module="libblas.so")


def ev(rank: int, call: str, start: int, dur: int = 1000, kind: EventKind = EventKind.COLLECTIVE, tid: int = 0,
       **args: int | str) -> TraceEvent:
    pid = 100 + rank
    return TraceEvent(call, kind, start, dur, pid, tid or pid, rank,
                      args={"runtime": "gloo", "call": call, "rank": rank, "world_size": 2, **args})


def samples(rank: int, times: range, stack: tuple[Frame, ...] = (MAIN, GEMM)) -> list[Sample]:
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


def encoded(prof: Profile, tmp_path: Path) -> dict[int, list[Any]]:
    files, _ = write_traces(prof, tmp_path / "job")
    assert [f.name for f in files] == [f"job.{r}.et" for r in range(len(files))]
    return load(files)


def test_gloo_job_nodes_attributes_and_replay(tmp_path: Path) -> None:
    ranks = encoded(gloo_job(), tmp_path)
    finish = replay(ranks)
    assert set(finish) == {0, 1}
    comm = {r: sorted((n.name, n.type, attrs(n).get("comm_size"), attrs(n).get("comm_src"), attrs(n).get("comm_dst"))
                      for n in nodes if n.type != pb.COMP_NODE) for r, nodes in ranks.items()}
    s, rv, c = pb.COMM_SEND_NODE, pb.COMM_RECV_NODE, pb.COMM_COLL_NODE
    assert comm[0] == sorted([
        ("allreduce", c, 4096, None, None), ("send", s, 400, 0, 1), ("reduce:send", s, 800, 0, 1),
        ("gather:recv", rv, 200, 1, 0), ("scatter:recv", rv, 300, 1, 0), ("barrier:recv", rv, 0, 1, 0),
        ("barrier:send", s, 0, 0, 1), ("alltoallv", c, 1000, None, None)])
    assert comm[1] == sorted([
        ("allreduce", c, 4096, None, None), ("recv", rv, 400, 0, 1), ("reduce:recv", rv, 800, 0, 1),
        ("gather:send", s, 200, 1, 0), ("scatter:send", s, 300, 1, 0), ("barrier:send", s, 0, 1, 0),
        ("barrier:recv", rv, 0, 0, 1), ("alltoallv", c, 2000, None, None)])
    a0 = {n.name: attrs(n) for n in ranks[0]}
    assert a0["allreduce"]["comm_type"] == pb.ALL_REDUCE and a0["alltoallv"]["comm_type"] == pb.ALL_TO_ALL
    assert a0["send"]["comm_tag"] == 3 and a0["reduce:send"]["comm_tag"] == DECOMPOSED_TAG + 1
    # the CPU interval before the all-reduce is named after the Python frame its samples were in
    first = ranks[0][0]
    assert first.type == pb.COMP_NODE and first.name == "train_step (train.py)" and attrs(first)["is_cpu_op"]
    assert first.duration_micros == 95 and attrs(first)["num_samples"] == 10
    allreduce = next(n for n in ranks[0] if n.name == "allreduce")
    assert first.id in allreduce.data_deps and allreduce.start_time_micros == 95
    assert allreduce.duration_micros == 50
    # the send ends at its wait, and the wait (a CPU node) depends on it
    send = next(n for n in ranks[0] if n.name == "send")
    wait = next(n for n in ranks[0] if n.name == "send_wait")
    assert send.duration_micros == 15 and send.id in wait.data_deps


def test_ids_grow_along_every_dependency(tmp_path: Path) -> None:
    for nodes in encoded(gloo_job(), tmp_path).values():
        for n in nodes:
            assert all(d < n.id for d in [*n.ctrl_deps, *n.data_deps])


def test_cuda_launches_copies_and_syncs(tmp_path: Path) -> None:
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
    check_trace(nodes)
    by = {(n.name, n.start_time_micros): n for n in nodes}
    load_ = by[("cudaMemcpy HtoD", 0)]
    assert load_.type == pb.MEM_LOAD_NODE and attrs(load_)["tensor_size"] == 1 << 20
    k1, k2 = by[("scale_kernel", 10)], by[("scale_kernel", 12)]
    assert k1.type == pb.COMP_NODE and attrs(k1)["is_cpu_op"] is False and k1.id in k2.ctrl_deps
    assert k2.duration_micros == 7
    sync = by[("cudaStreamSynchronize", 20)]
    assert k2.id in sync.data_deps and attrs(sync)["is_cpu_op"] is True
    store = by[("cudaMemcpyAsync DtoH", 30)]
    assert store.type == pb.MEM_STORE_NODE and sync.id < store.id
    dev = by[("cudaDeviceSynchronize", 35)]
    assert store.id in dev.data_deps


def test_nccl_point_to_point_tags_pair_up(tmp_path: Path) -> None:
    prof = Profile()
    for r in (0, 1):
        for i in range(3):
            e = ev(r, "ncclSend" if r == 0 else "ncclRecv", 1000 * (i + 1), peer=1 - r, bytes=64 * (i + 1))
            e.args["runtime"] = "nccl"
            prof.events.append(e)
    ranks = encoded(prof, tmp_path)
    replay(ranks)
    tags = [attrs(n)["comm_tag"] for n in ranks[0] if n.type == pb.COMM_SEND_NODE]
    assert tags == [P2P_TAG, P2P_TAG + 1, P2P_TAG + 2]


def test_ranks_from_events_or_numbered_after(tmp_path: Path) -> None:
    prof = gloo_job()
    for e in prof.events:
        if e.pid == 101:
            e.rank = -1
    traces = build_traces(prof)
    assert sorted(traces.ranks) == [0, 1] and traces.ranks[1].pids == [101]
    assert any("no rank known" in w for w in traces.warnings)


def test_no_communication_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ChakraError, match="nothing for a Chakra trace"):
        write_traces(Profile(samples=samples(0, range(1, 4))), tmp_path / "x")
    with pytest.raises(ChakraError, match="no such directory"):
        write_traces(gloo_job(), tmp_path / "missing" / "x")


def test_decoder_rejects_malformed_bytes() -> None:
    trace = build_traces(gloo_job()).ranks[0]
    data = encode_rank(trace, 0)
    meta, nodes = decode_et(data)
    assert meta.version and len(nodes) == len(trace.nodes)
    for bad in (b"", data[: len(data) - 3], b"\xff" * 12):
        with pytest.raises(ChakraError):
            decode_et(bad)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_decoder_fuzz(data: bytes) -> None:
    try:
        decode_et(data)
    except ChakraError:
        pass


OPS = ("allreduce", "allgather", "broadcast", "alltoallv", "reduce", "gather", "scatter", "barrier", "p2p")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 1), st.integers(1, 4096), st.integers(0, 20_000)),
                min_size=1, max_size=12), st.integers(2, 4))
def test_random_jobs_make_dags_that_replay(job: list[tuple[str, int, int, int]], world: int) -> None:
    """Any sequence of collectives the ranks agree on, with random compute gaps, replays to the end."""
    prof = Profile()
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
            e = ev(r, op, t, 500, tid=7 + i % 2, bytes=size, root=root % world)
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
    replay(by_rank)


def test_rank_environment_parsing() -> None:
    env = b"PATH=/bin\0RANK=3\0WORLD_SIZE=4\0LOCAL_RANK=1\0LOCAL_WORLD_SIZE=2\0"
    assert parse_environ(env) == {"rank": 3, "world_size": 4, "local_rank": 1, "local_world_size": 2}
    assert parse_environ(b"RANK=3\0WORLD_SIZE=2\0") == {}  # a rank outside its world places nothing
    assert parse_environ(b"RANK=x\0WORLD_SIZE=2\0") == {}
    assert parse_environ(b"RANK=-1\0WORLD_SIZE=2") == {}
    assert parse_environ(b"RANK=0") == {}


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_rank_environment_fuzz(data: bytes) -> None:
    out = parse_environ(data)
    if "rank" in out:
        assert 0 <= out["rank"] < out["world_size"]
