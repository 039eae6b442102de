"""The gloo plug-in's decoding on hand-built calls: the register values and option-struct reads a probe would
deliver (x86-64 SysV), failed reads, layouts that do not hold, and per-process state."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.agent.runtimes.base import DEREF1, MAX_DEREFS, Call, Library, ProbeSpec, TargetMemory
from aiflame.agent.runtimes.gloo import (
    BY_CALL,
    CONTEXT_CALL,
    OPTIONS,
    PG_RECV,
    PG_SEND,
    RECV_WAIT,
    SEND_WAIT,
    T_RECV,
    T_SEND,
    U64_MAX,
    GlooRuntime,
)
from aiflame.core.raw import GpuCode, RawEvent

PID, TID, WORKER = 40, 40, 41
CTX = 0x5555_0000_1000


def _spec(call: str) -> ProbeSpec:
    return next(s for s in GlooRuntime().specs() if s.call == call)


def _call(call: str, args: list[int] | None = None, derefs: tuple[int | None, ...] = (None,) * 4, *,
          tid: int = WORKER, parent: str = "", out: int | None = None, start: int = 1000, end: int = 5000) -> Call:
    spec = _spec(call)
    full = tuple((args or []) + [0] * (8 - len(args or [])))
    return Call(spec, PID, tid, start, full, tuple(derefs) + (None,) * (4 - len(derefs)), None, parent=parent,
                end_ns=end, out=out)


def _one(rt: GlooRuntime, call: Call, mem: TargetMemory | None = None) -> RawEvent:
    out = rt.decode(call, mem or NoMemory())
    assert len(out) == 1 and isinstance(out[0], RawEvent), out
    return out[0]


class NoMemory(TargetMemory):
    def read(self, pid: int, addr: int, size: int) -> bytes | None:
        return None


class FakeMemory(TargetMemory):
    """A process whose memory holds `words` (address -> u64)."""

    def __init__(self, words: dict[int, int]) -> None:
        super().__init__()
        self.words = words

    def read(self, pid: int, addr: int, size: int) -> bytes | None:
        if size != 8 or addr not in self.words:
            return None
        return self.words[addr].to_bytes(8, "little")


def _with_context(rank: int = 0, size: int = 2) -> GlooRuntime:
    rt = GlooRuntime()
    # gloo::Context::Context(this, rank, size, base): int arguments leave garbage in the upper halves
    _one(rt, _call(CONTEXT_CALL, [CTX, rank | 0xDEAD << 32, size | 0xBEEF << 32, 2], tid=TID))
    return rt


def _layout(ev: RawEvent) -> str:
    return ev.strs.get("layout", "")


# --- contexts ---------------------------------------------------------------------------------------------------


def test_context_constructor_gives_rank_and_world_size() -> None:
    # Oracle: by construction — gloo::Context(rank, size) in SysV registers, garbage in the upper halves
    rt = GlooRuntime()
    ev = _one(rt, _call(CONTEXT_CALL, [CTX, 1 | 0xFFFF << 32, 4, 2]))
    assert (ev.kind, ev.call, ev.args["rank"], ev.args["world_size"], ev.args["context"]) == (
        "meta", "context", 1, 4, CTX)
    assert not _layout(ev)


def test_context_with_rank_outside_its_size_is_flagged_and_not_used() -> None:
    rt = GlooRuntime()
    ev = _one(rt, _call(CONTEXT_CALL, [CTX, 5, 2, 2]))
    assert _layout(ev).startswith("unverified: ") and "rank 5 / size 2" in _layout(ev)
    assert rt.unverified["context"] == 1
    ar = _one(rt, _call("gloo::allreduce", [0x7000], (CTX, 10, 4)), NoMemory())
    assert "rank" not in ar.args and "unreadable" in _layout(ar)


# --- collectives --------------------------------------------------------------------------------------------------


def test_allreduce_bytes_count_rank_and_times() -> None:
    # Oracle: by construction — an all-reduce of 1575424 4-byte elements, its option reads built here
    rt = _with_context(rank=1, size=2)
    ev = _one(rt, _call("gloo::allreduce", [0x7000], (CTX, 1575424, 4), start=100, end=900))
    assert (ev.kind, ev.call, ev.start_ns, ev.end_ns, ev.tid) == ("collective", "allreduce", 100, 900, WORKER)
    assert {k: ev.args[k] for k in ("bytes", "count", "elsize", "rank", "world_size")} == {
        "bytes": 6301696, "count": 1575424, "elsize": 4, "rank": 1, "world_size": 2}
    assert not _layout(ev) and not rt.unverified


def test_every_collective_byte_rule() -> None:
    # Oracle: by construction — each collective's option-struct reads (gloo's headers), sizes worked out here
    rt = _with_context(rank=0, size=2)
    buf = 0x9000  # an UnboundBuffer*: the second read, its size the third
    cases: list[tuple[str, tuple[int | None, ...], dict[str, int]]] = [
        ("allgather", (CTX, buf, 8000, 4), {"bytes": 4000, "count": 1000}),  # output / world size
        ("allgatherv", (CTX, buf, 1200, 8), {"bytes": 1200, "count": 150}),
        ("broadcast", (CTX, 2500, 4, 0 | 15 << 32), {"bytes": 10000, "count": 2500, "root": 0}),  # root | tag
        ("alltoall", (CTX, buf, 4000, 4), {"bytes": 4000, "count": 1000}),
        ("alltoallv", (CTX, buf, 3200, 4), {"bytes": 3200, "count": 800}),
        ("reduce", (CTX, 1500, 4, 1), {"bytes": 6000, "count": 1500, "root": 1}),
        ("gather", (CTX, buf, 2400, 0 | 19 << 32), {"bytes": 2400, "root": 0}),
        ("scatter", (CTX, buf, 3200, 1 | 20 << 32), {"bytes": 3200, "root": 1}),
        ("barrier", (CTX,), {"bytes": 0}),
    ]
    for name, derefs, want in cases:
        ev = _one(rt, _call(f"gloo::{name}", [0x7000], derefs))
        assert ev.call == name and ev.kind == "collective"
        assert {k: ev.args.get(k) for k in want} == want, (name, ev.args)
        assert not _layout(ev), (name, ev.strs)
    assert sorted(o.call for o in OPTIONS) == sorted([n for n, _, _ in cases] + ["allreduce"])


def test_option_reads_fit_a_probe_and_chain_from_the_buffer_pointer() -> None:
    for o in OPTIONS:
        assert len(o.reads) <= MAX_DEREFS and o.reads[0][0] == "context"
        for i, (_, d) in enumerate(o.reads):
            if d.src == DEREF1:  # a buffer's size: read through the pointer read just before
                assert i == 2 and o.reads[1][0].startswith("_") and d.offset == 16, o.call


def test_failed_reads_leave_values_out_and_say_so() -> None:
    rt = _with_context()
    ev = _one(rt, _call("gloo::allreduce", [0x7000], (CTX, None, 4)))
    assert "bytes" not in ev.args and "unverified: " in _layout(ev) and "elements" in _layout(ev)
    ev = _one(rt, _call("gloo::allgather", [0x7000], (CTX, None, None, 4)))
    assert "bytes" not in ev.args and "out_size" in _layout(ev)
    ev = _one(rt, _call("gloo::broadcast", [0x7000], (None, 16, 8, 0)))
    assert "context pointer unreadable" in _layout(ev) and ev.args["bytes"] == 128
    ev = _one(rt, _call("gloo::gather", [0x7000], (CTX, 0x9000, 2400, None)))
    assert "root unreadable" in _layout(ev) and "root" not in ev.args
    assert rt.unverified == {"allreduce": 1, "allgather": 1, "broadcast": 1, "gather": 1}


def test_bad_layouts_are_flagged() -> None:
    rt = _with_context(rank=0, size=2)
    bad = [
        ("allreduce", (CTX, 100, 3), "element size 3"),
        ("allreduce", (CTX, 1 << 50, 4), "element count"),
        ("broadcast", (CTX, 10, 4, 7), "root 7 outside the group"),
        ("allgather", (CTX, 0x9000, 4001, 4), "does not split into 2 ranks"),
        ("alltoall", (CTX, 0x9000, 4004, 4), "not whole elements"),
        ("allreduce", (0xBAD0, 10, 4), "is not a gloo::Context seen in this process"),
    ]
    for name, derefs, why in bad:
        ev = _one(rt, _call(f"gloo::{name}", [0x7000], derefs))
        assert _layout(ev).startswith("unverified: ") and why in _layout(ev), (name, ev.strs)
    assert sum(rt.unverified.values()) == len(bad)


def test_context_read_from_memory_when_its_constructor_was_missed() -> None:
    # Oracle: by construction — the context's rank and size in memory, laid out here
    rt = GlooRuntime()  # attached after the process group was made
    mem = FakeMemory({CTX: 1 | 2 << 32})
    ev = _one(rt, _call("gloo::allreduce", [0x7000], (CTX, 10, 4)), mem)
    assert (ev.args["rank"], ev.args["world_size"]) == (1, 2) and not _layout(ev)
    ev = _one(rt, _call("gloo::allreduce", [0x7000], (CTX, 10, 4)), NoMemory())  # cached by now
    assert ev.args["rank"] == 1
    garbage = FakeMemory({0x8000: 7 | 3 << 32})
    ev = _one(GlooRuntime(), _call("gloo::allreduce", [0x7000], (0x8000, 10, 4)), garbage)
    assert "rank 7 / size 3" in _layout(ev) and "rank" not in ev.args


def test_subgroup_collectives_keep_the_process_rank() -> None:
    # Oracle: by construction — a 2-rank subgroup context inside a 4-rank job
    rt = _with_context(rank=3, size=4)
    sub = 0x5555_0000_2000
    _one(rt, _call(CONTEXT_CALL, [sub, 1, 2, 2]))
    ev = _one(rt, _call("gloo::allreduce", [0x7000], (sub, 10, 4)))
    assert {k: ev.args[k] for k in ("rank", "world_size", "group_rank", "group_size")} == {
        "rank": 3, "world_size": 4, "group_rank": 1, "group_size": 2}
    assert not _layout(ev)


def test_algorithm_inside_another_is_not_counted_twice() -> None:
    # Oracle: by construction — an all-gather called from inside an all-reduce
    rt = _with_context()
    ev = _one(rt, _call("gloo::allgather", [0x7000], (CTX, 0x9000, 16, 8), parent="gloo::allreduce"))
    assert ev.kind == "other" and ev.strs["inside"] == "allreduce"


# --- transport and point-to-point ------------------------------------------------------------------------------


def test_transport_inside_a_collective_is_folded_into_it() -> None:
    # Oracle: by construction — UnboundBuffer::send's registers and buffer size, built here
    rt = _with_context()
    # UnboundBuffer::send(this, peer, slot, offset, nbytes); nbytes SIZE_MAX: the buffer (size at +16) from offset
    assert rt.decode(_call(T_SEND, [0x9000, 1, 77, 0, U64_MAX], (4096,), parent="gloo::allreduce"), NoMemory()) == []
    assert rt.decode(_call(T_SEND, [0x9000, 1, 77, 1024, U64_MAX], (4096,), parent="gloo::allreduce"),
                     NoMemory()) == []
    assert rt.decode(_call(T_RECV, [0x9000, 1, 77, 0, 512], (4096,), parent="gloo::allreduce"), NoMemory()) == []
    ev = _one(rt, _call("gloo::allreduce", [0x7000], (CTX, 1024, 4)))
    assert {k: ev.args[k] for k in ("wire_sent", "wire_recv", "wire_sends", "wire_recvs")} == {
        "wire_sent": 4096 + 3072, "wire_recv": 512, "wire_sends": 2, "wire_recvs": 1}
    nxt = _one(rt, _call("gloo::barrier", [0x7000], (CTX,)))
    assert "wire_sent" not in nxt.args  # the traffic went to the collective it ran in


def test_transport_outside_any_collective_is_its_own_event() -> None:
    # Oracle: by construction — UnboundBuffer::recv's registers (peer, slot, offset, bytes)
    rt = _with_context(rank=0, size=2)
    ev = _one(rt, _call(T_RECV, [0x9000, 1 | 0xFFFF << 32, 5, 0, 300], (4096,)))
    assert (ev.kind, ev.call, ev.args["peer"], ev.args["bytes"], ev.args["slot"], ev.args["rank"]) == (
        "other", "transport_recv", 1, 300, 5, 0)
    ev = _one(rt, _call(T_SEND, [0x9000, 1, 5, 0, U64_MAX], (None,)))
    assert "bytes" not in ev.args and "buffer size unreadable" in _layout(ev)


def test_send_and_recv_take_peer_tag_and_bytes_and_pair_with_their_wait() -> None:
    # Oracle: by construction — ProcessGroupGloo::send's SysV registers, built here
    rt = _with_context(rank=0, size=2)
    # ProcessGroupGloo::send(return slot, this, tensors, dstRank, tag): the peer is in the 4th register
    rt.decode(_call(T_SEND, [0x9000, 1, 3, 0, U64_MAX], (4936,), tid=TID, parent=PG_SEND), NoMemory())
    send = _one(rt, _call(PG_SEND, [0x7FFC0, 0x1234, 0x7FFD0, 1 | 0xAB << 32, 3], tid=TID, out=0xC0FFEE))
    assert (send.kind, send.call, send.args["peer"], send.args["tag"], send.args["bytes"], send.tid) == (
        "collective", "send", 1, 3, 4936, TID)
    assert (send.args["rank"], send.args["world_size"]) == (0, 2) and not _layout(send)
    wait = _one(rt, _call(SEND_WAIT, [0xC0FFEE, 30000], tid=TID, start=6000, end=9000))
    assert (wait.kind, wait.call, wait.args["peer"], wait.args["bytes"], wait.end_ns) == (
        "sync", "send_wait", 1, 4936, 9000)
    rt.decode(_call(T_RECV, [0x9000, 1, 4, 0, U64_MAX], (17284,), tid=TID, parent=PG_RECV), NoMemory())
    recv = _one(rt, _call(PG_RECV, [0x7FFC0, 0x1234, 0x7FFD0, 1, 4], tid=TID, out=0xF00D))
    assert (recv.call, recv.args["peer"], recv.args["bytes"]) == ("recv", 1, 17284)
    wait = _one(rt, _call(RECV_WAIT, [0xF00D], tid=TID))
    assert (wait.call, wait.args["bytes"]) == ("recv_wait", 17284)
    unknown = _one(rt, _call(RECV_WAIT, [0xAAAA], tid=TID))  # its post was not seen: still timed
    assert unknown.call == "recv_wait" and "peer" not in unknown.args


def test_send_without_transport_or_with_a_bad_peer_is_flagged() -> None:
    rt = _with_context(rank=0, size=2)
    ev = _one(rt, _call(PG_SEND, [0, 0, 0, 5, 0], tid=TID))
    assert "bytes" not in ev.args and "no transport call seen" in _layout(ev) and "peer 5 outside" in _layout(ev)


# --- state -------------------------------------------------------------------------------------------------------


def test_forget_drops_the_process() -> None:
    rt = _with_context(rank=1, size=2)
    rt.decode(_call(T_SEND, [0x9000, 1, 3, 0, 10], tid=TID, parent=PG_SEND), NoMemory())
    rt.forget(PID)
    ev = _one(rt, _call("gloo::allreduce", [0x7000], (CTX, 10, 4)))
    assert "rank" not in ev.args and "wire_sent" not in ev.args
    ev = _one(rt, _call(PG_SEND, [0, 0, 0, 1, 0], tid=TID))
    assert "bytes" not in ev.args


def test_wants_libtorch_cpu_only() -> None:
    rt = GlooRuntime()
    assert rt.wants(Library("/venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so"))
    assert not rt.wants(Library("/venv/lib/python3.11/site-packages/torch/lib/libtorch_python.so"))
    assert set(BY_CALL) <= {s.call for s in rt.specs()}


class RandomMemory(TargetMemory):
    def __init__(self, data: bytes | None) -> None:
        super().__init__()
        self.data = data

    def read(self, pid: int, addr: int, size: int) -> bytes | None:
        if self.data is None or len(self.data) < size:
            return None
        return self.data[:size]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(
    st.integers(0, len(GlooRuntime().specs()) - 1),
    st.lists(st.integers(0, 2**64 - 1), min_size=8, max_size=8),
    st.lists(st.one_of(st.none(), st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2, 4, 8, CTX])),
             min_size=4, max_size=4),
    st.sampled_from(["", "gloo::allreduce", "gloo::barrier", PG_SEND, PG_RECV, "cudaLaunchKernel"]),
    st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    st.integers(1, 3),
), min_size=1, max_size=12), st.one_of(st.none(), st.binary(min_size=8, max_size=8)))
def test_decode_never_raises(calls: list[tuple[int, list[int], list[int | None], str, int | None, int]],
                             memory: bytes | None) -> None:
    rt = GlooRuntime()
    specs = rt.specs()
    for i, args, derefs, parent, out, tid in calls:
        call = Call(specs[i], PID, tid, 1, tuple(args), tuple(derefs), None, parent=parent, end_ns=2, out=out)
        for item in rt.decode(call, RandomMemory(memory)):
            assert isinstance(item, RawEvent | GpuCode)
            assert isinstance(item, GpuCode) or all(isinstance(v, int) for v in item.args.values())
    rt.forget(PID)
