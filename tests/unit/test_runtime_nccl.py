"""The NCCL plug-in on calls built by hand: registers as the x86-64 SysV ABI lays NCCL's arguments out (int
arguments with garbage in their upper halves, the 7th and later arguments and the by-value ncclUniqueId on the
stack), failed reads, unknown communicators and garbage."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.agent.runtimes.base import Call, Library, TargetMemory
from aiflame.agent.runtimes.nccl import COLLECTIVES, SPECS, NcclRuntime
from aiflame.core.raw import GpuCode, RawEvent

PID, TID = 4242, 4243
SP = 0x7FFD_0000_1000
GARBAGE = 0xDEAD_BEEF_0000_0000  # what a 32-bit int argument may leave in its register's upper half
COMM = 0x5555_0000_1000
STREAM = 0x5151
SPEC = {s.call: s for s in SPECS}


class FakeMemory(TargetMemory):
    """Memory of a target: {address: bytes}; everything else is unreadable."""

    def __init__(self, regions: dict[int, bytes] | None = None) -> None:
        super().__init__()
        self.regions = regions or {}

    def read(self, pid: int, addr: int, size: int) -> bytes | None:
        for start, data in self.regions.items():
            if start <= addr and addr + size <= start + len(data):
                return data[addr - start:addr - start + size]
        return None


def call(name: str, regs: tuple[int, ...] = (), derefs: tuple[int | None, ...] = (), *, ret: int | None = 0,
         out: int | None = None, string: bytes | None = None, parent: str = "", tid: int = TID) -> Call:
    args = (*regs, *([0] * (6 - len(regs))), SP, 0x401234)
    return Call(SPEC[name], PID, tid, 1000, args, (*derefs, *([None] * (4 - len(derefs)))), string,
                user=(0x401000, 0x401234), parent=parent, end_ns=2000 if ret is not None else 0, ret=ret, out=out)


def events(out: list[RawEvent | GpuCode]) -> list[RawEvent]:
    assert all(isinstance(e, RawEvent) for e in out)
    return [e for e in out if isinstance(e, RawEvent)]


def one(rt: NcclRuntime, c: Call, mem: TargetMemory | None = None) -> RawEvent:
    (ev,) = events(rt.decode(c, mem or FakeMemory()))
    return ev


def init_rank(rt: NcclRuntime, comm: int, nranks: int, rank: int, ret: int = 0) -> RawEvent:
    # (ncclComm_t *comm, int nranks, ncclUniqueId id, int rank): the id is on the stack, rank in rdx
    return one(rt, call("ncclCommInitRank", (0x7FFD_0000_2000, GARBAGE | nranks, GARBAGE | rank),
                        (0x1122334455667788,), ret=ret, out=comm))


def test_specs_probe_both_names_and_want_only_libnccl() -> None:
    for spec in SPECS:
        assert spec.symbols == (spec.call, "p" + spec.call)
    rt = NcclRuntime()
    assert rt.wants(Library("/opt/nvidia/nccl/lib/libnccl.so.2"))
    assert rt.wants(Library("libnccl.so"))
    assert not rt.wants(Library("/usr/lib/libnccl-net.so"))
    assert not rt.wants(Library("/usr/lib/libcudart.so.13"))
    assert {"ncclAllReduce", "ncclAlltoAll", "ncclBcast", "ncclCommInitRankConfig", "ncclGroupEnd"} <= set(SPEC)


def test_allreduce_registers_and_stack() -> None:
    # Oracle: by construction — ncclAllReduce's arguments in SysV registers and at SP+8 (nccl.h's order)
    # (send, recv, count, dtype, op, comm, stream): stream is the 7th argument, read at SP+8
    ev = one(NcclRuntime(), call("ncclAllReduce", (0x1000, 0x2000, 1000, GARBAGE | 7, GARBAGE | 0, COMM),
                                 (STREAM, 0, 0), ret=4))
    assert (ev.runtime, ev.call, ev.kind) == ("nccl", "ncclAllReduce", "collective")
    assert ev.args == {"count": 1000, "dtype": 7, "bytes": 4000, "op": 0, "comm": COMM, "stream": STREAM, "ret": 4}
    assert ev.strs == {"dtype": "float32", "op": "sum"}
    assert ev.user == (0x401000, 0x401234) and (ev.start_ns, ev.end_ns) == (1000, 2000)


def test_reduce_takes_comm_and_stream_from_the_stack() -> None:
    # Oracle: by construction — ncclReduce's 7th and 8th arguments on the stack
    # (send, recv, count, dtype, op, root, comm, stream)
    ev = one(NcclRuntime(), call("ncclReduce", (1, 2, 64, 8, 3, GARBAGE | 1), (COMM, STREAM, 0)))
    assert ev.args == {"count": 64, "dtype": 8, "bytes": 512, "op": 3, "root": 1, "comm": COMM,
                            "stream": STREAM, "ret": 0}
    assert ev.strs["op"] == "min"


def test_failed_stack_reads_leave_the_arguments_out() -> None:
    ev = one(NcclRuntime(), call("ncclReduce", (1, 2, 64, 8, 3, 1), (None, None, None)))
    assert "comm" not in ev.args and "stream" not in ev.args
    assert ev.args["bytes"] == 512


def test_p2p_and_bcast_layouts() -> None:
    # Oracle: by construction — ncclSend/ncclRecv/ncclBcast arguments in nccl.h's order
    rt = NcclRuntime()
    send = one(rt, call("ncclSend", (0x1000, 10, GARBAGE | 2, GARBAGE | 1, COMM, STREAM)))
    assert send.args == {"count": 10, "dtype": 2, "bytes": 40, "peer": 1, "comm": COMM, "stream": STREAM, "ret": 0}
    recv = one(rt, call("ncclRecv", (0x1000, 20, 2, 0, COMM, 0)))
    assert (recv.args["peer"], recv.args["bytes"]) == (0, 80)
    bcast = one(rt, call("ncclBcast", (0x1000, 33, 1, 0, COMM, 0)))
    assert (bcast.call, bcast.args["root"], bcast.args["bytes"]) == ("ncclBcast", 0, 33)


def test_broadcast_inside_bcast_is_not_counted_twice() -> None:
    # Oracle: by construction — ncclBroadcast called from inside ncclBcast
    rt = NcclRuntime()
    regs = (0x1000, 0x1000, 33, 1, 0, COMM)
    assert rt.decode(call("ncclBroadcast", regs, (0,), parent="ncclBcast"), FakeMemory()) == []
    ev = one(rt, call("ncclBroadcast", regs, (STREAM,)))
    assert ev.args["root"] == 0 and ev.args["stream"] == STREAM


def test_config_variants_report_the_plain_name() -> None:
    # Oracle: by construction — the *Config variants' extra argument after the stream
    rt = NcclRuntime()
    ev = one(rt, call("ncclAllReduceConfig", (1, 2, 500, 7, 4, COMM), (STREAM, 0xC0F, 0)))
    assert (ev.call, ev.args["config"], ev.args["stream"], ev.strs["op"]) == ("ncclAllReduce", 0xC0F, STREAM, "avg")
    ev = one(rt, call("ncclReduceConfig", (1, 2, 8, 7, 0, 2), (COMM, STREAM, 0xC0F)))
    assert (ev.call, ev.args["comm"], ev.args["stream"], ev.args["config"]) == ("ncclReduce", COMM, STREAM, 0xC0F)
    ev = one(rt, call("ncclAllGatherConfig", (1, 2, 8, 7, COMM, STREAM), (0xC0F,)))
    assert (ev.call, ev.args["config"]) == ("ncclAllGather", 0xC0F)


def test_comm_init_gives_later_collectives_their_rank() -> None:
    # Oracle: by construction — ncclCommInitRank(comm*, nranks, id, rank) built here
    rt = NcclRuntime()
    meta = init_rank(rt, COMM, nranks=8, rank=3)
    assert (meta.kind, meta.call) == ("meta", "ncclCommInitRank")
    assert meta.args == {"rank": 3, "nranks": 8, "world_size": 8, "comm": COMM, "ret": 0}
    assert meta.strs["comm_id"] == "1122334455667788"
    ag = one(rt, call("ncclAllGather", (1, 2, 100, 4, COMM, STREAM)))
    assert (ag.args["rank"], ag.args["world_size"]) == (3, 8)
    assert (ag.args["bytes"], ag.args["total_bytes"]) == (800, 6400)  # this rank's part, the gathered whole
    ar = one(rt, call("ncclAllReduce", (1, 2, 100, 4, 0, COMM), (STREAM,)))
    assert ar.args["rank"] == 3 and "total_bytes" not in ar.args
    other = one(rt, call("ncclAllReduce", (1, 2, 100, 4, 0, COMM + 8), (STREAM,)))
    assert "rank" not in other.args  # an unknown communicator


def test_failed_init_reports_the_request_but_names_no_communicator() -> None:
    rt = NcclRuntime()
    meta = init_rank(rt, 0x1234, nranks=2, rank=1, ret=1)  # *comm left as the caller had it
    assert meta.args == {"rank": 1, "nranks": 2, "ret": 1}
    ev = one(rt, call("ncclAllReduce", (1, 2, 10, 7, 0, 0x1234), (0,)))
    assert "rank" not in ev.args


def test_nonblocking_init_in_progress_counts_as_created() -> None:
    # Oracle: by construction — ncclInProgress (7) from a nonblocking init
    rt = NcclRuntime()
    init_rank(rt, COMM, nranks=4, rank=2, ret=7)
    assert one(rt, call("ncclSend", (1, 1, 7, 0, COMM, 0))).args["rank"] == 2


def test_init_rank_config_reads_the_comm_name() -> None:
    # Oracle: by construction — ncclConfig_t's size, magic, version and commName read here
    rt = NcclRuntime()
    # (comm*, nranks, id, rank, config): derefs = id[0:8], config->size, config->magic|version, config->commName
    derefs = (0xABCD, 120, (23203 << 32) | 0xCAFEBEEF, 0x404000)
    ev = one(rt, call("ncclCommInitRankConfig", (0x7FFD0000, 4, 3, 0x7FFE0000), derefs, ret=1, string=b"tp-group"))
    assert ev.args == {"rank": 3, "nranks": 4, "config": 0x7FFE0000, "ret": 1}
    assert ev.strs == {"comm_id": "000000000000abcd", "comm_name": "tp-group"}
    unread = call("ncclCommInitRankConfig", (0, 4, 3, 1), derefs, string=None)  # the probe's read failed
    assert one(rt, unread, FakeMemory({0x404000: b"dp-group\0"})).strs["comm_name"] == "dp-group"
    assert "comm_name" not in one(rt, unread).strs
    old = one(rt, call("ncclCommInitRankConfig", (0, 4, 3, 1), (1, 40, 0xCAFEBEEF, 7), string=b"junk"))
    assert "comm_name" not in old.strs  # a config too old to have commName
    bad = one(rt, call("ncclCommInitRankConfig", (0, 4, 3, 1), (1, 120, 0x1234, 7), string=b"junk"))
    assert "comm_name" not in bad.strs
    null = one(rt, call("ncclCommInitRankConfig", (0, 4, 3, 0), (None, None, None, None)))
    assert null.strs == {} and null.args["config"] == 0


def test_init_all_registers_every_communicator() -> None:
    # Oracle: by construction — ncclCommInitAll's array of communicators in memory
    rt = NcclRuntime()
    array = 0x7FFD_0000_3000
    comms = [COMM, COMM + 0x100, COMM + 0x200]
    mem = FakeMemory({array: b"".join(c.to_bytes(8, "little") for c in comms)})
    meta = one(rt, call("ncclCommInitAll", (array, 3, 0x7FFD0000_4000), out=comms[0]), mem)
    assert meta.args["nranks"] == 3 and meta.args["comm"] == COMM and "rank" not in meta.args
    for rank, comm in enumerate(comms):
        ev = one(rt, call("ncclSend", (1, 1, 7, 0, comm, 0)))
        assert (ev.args["rank"], ev.args["world_size"]) == (rank, 3)


def test_init_all_with_the_array_gone_keeps_the_first() -> None:
    rt = NcclRuntime()
    one(rt, call("ncclCommInitAll", (0x999000, 2, 0), out=COMM))
    assert one(rt, call("ncclSend", (1, 1, 7, 0, COMM, 0))).args["rank"] == 0
    failed = one(rt, call("ncclCommInitAll", (0x999000, 2, 0), ret=1, out=COMM + 8))
    assert failed.args == {"nranks": 2, "devlist": 0, "ret": 1}


def test_split_then_rank_queries_fill_in_the_new_communicator() -> None:
    # Oracle: by construction — ncclCommSplit's colour and key, then rank queries
    rt = NcclRuntime()
    init_rank(rt, COMM, nranks=8, rank=5)
    child = COMM + 0x900
    split = one(rt, call("ncclCommSplit", (COMM, 1, GARBAGE | 5, 0x7FFD0000), out=child))
    assert split.args == {"comm": COMM, "color": 1, "key": 5, "rank": 5, "world_size": 8, "new_comm": child,
                          "ret": 0}
    assert "rank" not in one(rt, call("ncclSend", (1, 1, 7, 0, child, 0))).args
    assert rt.decode(call("ncclCommUserRank", (child, 0x7FFD0010), out=GARBAGE | 2), FakeMemory()) == []
    assert rt.decode(call("ncclCommCount", (child, 0x7FFD0014), out=4), FakeMemory()) == []
    ev = one(rt, call("ncclSend", (1, 1, 7, 0, child, 0)))
    assert (ev.args["rank"], ev.args["world_size"]) == (2, 4)
    # a failed query or a failed out read teaches nothing
    rt.decode(call("ncclCommUserRank", (child, 0), ret=4, out=7), FakeMemory())
    rt.decode(call("ncclCommCount", (child, 0), out=None), FakeMemory())
    assert one(rt, call("ncclSend", (1, 1, 7, 0, child, 0))).args["rank"] == 2


def test_destroy_and_forget_drop_communicators() -> None:
    rt = NcclRuntime()
    init_rank(rt, COMM, nranks=2, rank=1)
    ev = one(rt, call("ncclCommDestroy", (COMM,)))
    assert ev.args == {"comm": COMM, "rank": 1, "world_size": 2, "ret": 0}
    assert "rank" not in one(rt, call("ncclSend", (1, 1, 7, 0, COMM, 0))).args
    init_rank(rt, COMM, nranks=2, rank=1)
    rt.forget(PID + 1)
    assert "rank" in one(rt, call("ncclSend", (1, 1, 7, 0, COMM, 0))).args
    rt.forget(PID)
    assert "rank" not in one(rt, call("ncclSend", (1, 1, 7, 0, COMM, 0))).args


def test_group_marks_the_calls_inside_it() -> None:
    # Oracle: by construction — calls between ncclGroupStart and ncclGroupEnd on one thread
    rt = NcclRuntime()
    start = one(rt, call("ncclGroupStart"))
    assert (start.kind, start.args) == ("meta", {"depth": 1, "ret": 0})
    inside = one(rt, call("ncclSend", (1, 1, 7, 0, 0, 0)))
    other_thread = one(rt, call("ncclSend", (1, 1, 7, 0, 0, 0), tid=TID + 1))
    end = one(rt, call("ncclGroupEnd"))
    after = one(rt, call("ncclSend", (1, 1, 7, 0, 0, 0)))
    assert inside.args["grouped"] == 1 and "grouped" not in other_thread.args and "grouped" not in after.args
    assert end.args["depth"] == 0
    assert one(rt, call("ncclGroupEnd")).args["depth"] == 0  # unbalanced End: no negative depth


def test_unknown_dtype_and_custom_op() -> None:
    ev = one(NcclRuntime(), call("ncclAllReduce", (1, 2, 10, 99, 5, 0), (0,)))
    assert "bytes" not in ev.args and ev.args["dtype"] == 99
    assert ev.strs == {"dtype": "dtype 99", "op": "custom 5"}


def test_capture_end_before_return_has_no_ret() -> None:
    ev = one(NcclRuntime(), call("ncclAllReduce", (1, 2, 10, 7, 0, 0), (0,), ret=None))
    assert "ret" not in ev.args and ev.end_ns == 0


def test_huge_values_fit_the_capture() -> None:
    ev = one(NcclRuntime(), call("ncclAllReduce", (1, 2, 2**64 - 1, 8, 0, 2**63 + 5), (2**64 - 1,)))
    assert all(-(2**63) <= v < 2**63 for v in ev.args.values())
    assert ev.args["comm"] == -(2**63) + 5 and ev.args["count"] == -1


_u64 = st.integers(0, 2**64 - 1)


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.sampled_from(sorted(SPEC)), min_size=1, max_size=6),
    st.lists(st.tuples(st.lists(_u64, min_size=6, max_size=6), st.lists(st.none() | _u64, min_size=4, max_size=4),
                       st.none() | st.binary(max_size=130), st.none() | _u64, st.none() | _u64,
                       st.sampled_from(["", "ncclBcast", "ncclGroupEnd"])), min_size=6, max_size=6),
    st.dictionaries(_u64, st.binary(max_size=64), max_size=3),
)
def test_decode_never_raises(names: list[str], raw: list[tuple[list[int], list[int | None], bytes | None,
                                                             int | None, int | None, str]],
                             regions: dict[int, bytes]) -> None:
    rt = NcclRuntime()
    mem = FakeMemory(regions)
    for name, (regs, derefs, string, ret, out, parent) in zip(names, raw, strict=False):
        c = call(name, tuple(regs), tuple(derefs), ret=ret, out=out, string=string, parent=parent)
        for ev in events(rt.decode(c, mem)):
            assert ev.kind in ("collective", "meta")
            assert all(isinstance(v, int) and -(2**63) <= v < 2**63 for v in ev.args.values())
            assert all(isinstance(v, str) for v in ev.strs.values())
            if name in COLLECTIVES:
                assert ev.call == COLLECTIVES[name].name
