"""Helpers of the Chakra tests: the validator's load-time rules on one rank's nodes (exporters/chakra_check.py), and
a timed replay of all ranks together — nodes issue when their data and control dependencies are done,
collectives meet across ranks in issue order with the same type and size, a receive finishes once the send with
its (src, dst, tag) was made (sends are eager, as in the simulator's network) — that must finish every node of
every rank and says when each rank finished. Also its own tests on hand-made traces."""

from __future__ import annotations

from collections import defaultdict, deque
from pathlib import Path
from typing import Any

import pytest

pb = pytest.importorskip("chakra.schema.protobuf.et_def_pb2", reason="mlc-chakra is installed by make setup")
from aiflame.exporters.chakra import decode_et  # noqa: E402
from aiflame.exporters.chakra_check import check_nodes  # noqa: E402


def attrs(node: Any) -> dict[str, Any]:
    return {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr}


def load(files: list[Path]) -> dict[int, list[Any]]:
    """rank -> nodes, from `<prefix>.<rank>.et` files, with mlc-chakra's decoder."""
    out = {}
    for f in files:
        meta, nodes = decode_et(f.read_bytes())
        rank = int(f.name.rsplit(".", 2)[1])
        assert attrs(meta)["rank"] == rank
        out[rank] = nodes
    return out


def check_trace(nodes: list[Any], rank: int = 0, world: int = 1) -> None:
    """The simulator's load-time rules for one rank's nodes, by the validator (exporters/chakra_check.py)."""
    problems = check_nodes({rank: nodes}, world=world)
    errors = [str(p) for p in problems if p.severity == "error" and p.rule not in ("2 one file per rank",)]
    assert not errors, errors


def replay(ranks: dict[int, list[Any]]) -> dict[int, int]:
    """Run every rank's nodes to completion; returns the simulated finish time (µs) per rank. Fails on a
    deadlock (nodes left that can never issue) or on collectives/messages that do not agree across ranks."""
    for r, nodes in ranks.items():
        check_trace(nodes, r, len(ranks))
    by_id = {r: {n.id: n for n in nodes} for r, nodes in ranks.items()}
    deps = {r: {n.id: set(n.ctrl_deps) | set(n.data_deps) for n in nodes} for r, nodes in ranks.items()}
    done: dict[int, dict[int, int]] = {r: {} for r in ranks}  # rank -> id -> finish time
    issued: dict[int, set[int]] = {r: set() for r in ranks}
    coll_seq = {r: 0 for r in ranks}
    colls: dict[int, dict[int, tuple[int, int, Any]]] = defaultdict(dict)  # k -> rank -> (id, ready time, node)
    sent: dict[tuple[int, int, int], deque[tuple[int, int]]] = defaultdict(deque)  # (src, dst, tag) -> (t, size)
    waiting: dict[int, list[tuple[Any, int]]] = defaultdict(list)  # rank -> receives issued, not matched
    progress = True
    while progress:
        progress = False
        for r, nodes in ranks.items():
            for n in nodes:
                if n.id in issued[r] or not deps[r][n.id] <= done[r].keys():
                    continue
                issued[r].add(n.id)
                progress = True
                ready = max((done[r][d] for d in deps[r][n.id]), default=0)
                a = attrs(n)
                if n.type == pb.COMM_COLL_NODE:
                    colls[coll_seq[r]][r] = (n.id, ready, n)
                    coll_seq[r] += 1
                elif n.type == pb.COMM_SEND_NODE:  # eager, as the simulator's network: done once sent
                    done[r][n.id] = ready + max(n.duration_micros, 1)
                    sent[(r, a["comm_dst"], a["comm_tag"])].append((done[r][n.id], a["comm_size"]))
                elif n.type == pb.COMM_RECV_NODE:
                    waiting[r].append((n, ready))
                else:
                    done[r][n.id] = ready + max(n.duration_micros, 1)
        for r, queue in waiting.items():  # a receive finishes once its message was sent
            for n, ready in list(queue):
                a = attrs(n)
                key = (a["comm_src"], r, a["comm_tag"])
                if sent[key]:
                    t, size = sent[key].popleft()
                    assert size == a["comm_size"], f"message {key}: {size} bytes sent, {a['comm_size']} received"
                    done[r][n.id] = max(ready, t) + 1
                    queue.remove((n, ready))
                    progress = True
        for k, parts in list(colls.items()):
            if len(parts) == len(ranks):
                types = {attrs(n)["comm_type"] for _, _, n in parts.values()}
                assert len(types) == 1, f"collective #{k}: types differ across ranks {types}"
                sizes = {attrs(n)["comm_size"] for _, _, n in parts.values()}
                assert len(sizes) == 1, f"collective #{k}: sizes differ across ranks {sizes}"
                t = max(ready for _, ready, _ in parts.values()) + 1
                for rr, (i, _, n) in parts.items():
                    done[rr][i] = t + n.duration_micros
                del colls[k]
                progress = True
    stuck = {r: sorted(set(by_id[r]) - done[r].keys())[:5] for r in ranks if len(done[r]) < len(by_id[r])}
    assert not stuck, f"deadlock: nodes never finished (first ones per rank) {stuck}"
    return {r: max(d.values(), default=0) for r, d in done.items()}


# --- the checker's own tests ------------------------------------------------------------------------------------


def _node(i: int, type_: int, deps: tuple[int, ...] = (), **a: tuple[str, Any]) -> Any:
    n = pb.Node(id=i, name=f"n{i}", type=type_, ctrl_deps=deps, duration_micros=5)
    for k, (slot, v) in a.items():
        n.attr.append(pb.AttributeProto(name=k, **{slot: v}))
    return n


def _send(i: int, dst: int, tag: int, deps: tuple[int, ...] = ()) -> Any:
    return _node(i, pb.COMM_SEND_NODE, deps, comm_dst=("int32_val", dst), comm_tag=("int32_val", tag),
                 comm_size=("int64_val", 8), is_cpu_op=("bool_val", False))


def _recv(i: int, src: int, tag: int, deps: tuple[int, ...] = ()) -> Any:
    return _node(i, pb.COMM_RECV_NODE, deps, comm_src=("int32_val", src), comm_tag=("int32_val", tag),
                 comm_size=("int64_val", 8), is_cpu_op=("bool_val", False))


def test_replay_finishes_matched_messages() -> None:
    # Oracle: by construction — hand-made nodes whose messages match
    ranks = {0: [_node(1, pb.COMP_NODE), _send(2, 1, 7, (1,)), _recv(3, 1, 8, (2,))],
             1: [_recv(1, 0, 7), _send(2, 0, 8, (1,))]}
    finish = replay(ranks)
    assert finish[0] >= 15 and finish[1] >= 10


def test_replay_finds_a_deadlock() -> None:
    # Oracle: by construction — both ranks receive before they send
    # both ranks receive first, each waiting for a send the other issues only after its receive
    ranks = {0: [_recv(1, 1, 7), _send(2, 1, 8, (1,))], 1: [_recv(1, 0, 8), _send(2, 0, 7, (1,))]}
    with pytest.raises(AssertionError, match="deadlock"):
        replay(ranks)


def test_checker_rejects_what_the_simulator_aborts_on() -> None:
    coll: dict[str, Any] = {"comm_size": ("int64_val", 8), "is_cpu_op": ("bool_val", False)}
    with pytest.raises(AssertionError, match="not in the file"):
        check_trace([_node(1, pb.COMP_NODE), _node(2, pb.COMP_NODE, (9,))])
    with pytest.raises(AssertionError, match="METADATA"):
        check_trace([_node(1, pb.METADATA_NODE)])
    with pytest.raises(AssertionError, match="comm_type 9"):  # BARRIER is not simulated
        check_trace([_node(1, pb.COMM_COLL_NODE, comm_type=("int64_val", pb.BARRIER), **coll)])
    with pytest.raises(AssertionError, match="double_val"):  # a double where an integer is read
        check_trace([_node(1, pb.COMM_COLL_NODE, comm_type=("double_val", 0.0), **coll)])
    with pytest.raises(AssertionError, match="cycle"):
        check_trace([_node(1, pb.COMP_NODE), _node(2, pb.COMP_NODE, (3,)), _node(3, pb.COMP_NODE, (2,))])
