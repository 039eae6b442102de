"""The validator of Chakra traces (exporters/chakra_check.py): a broken trace for each input rule of ASTRA-sim's
analytical backend (docs/chakra.md) is reported under that rule, naming the nodes, and a good one passes; the CLI
command `aiflame chakra check` prints one line per problem and exits 1 on an error."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from aiflame.cli.main import main
from aiflame.exporters.chakra_check import Problem, check, expand

pb = pytest.importorskip("chakra.schema.protobuf.et_def_pb2", reason="mlc-chakra is installed by make setup")
from chakra.src.third_party.utils import protolib  # noqa: E402

COMP, COLL, SEND, RECV = pb.COMP_NODE, pb.COMM_COLL_NODE, pb.COMM_SEND_NODE, pb.COMM_RECV_NODE
Attr = tuple[str, Any]


def node(i: int, type_: int = COMP, deps: tuple[int, ...] = (), ctrl: tuple[int, ...] = (), **a: Attr) -> Any:
    return make(i, type_, deps, ctrl, a)


def make(i: int, type_: int, deps: tuple[int, ...], ctrl: tuple[int, ...], a: dict[str, Attr]) -> Any:
    n = pb.Node(id=i, name=f"n{i}", type=type_, data_deps=deps, ctrl_deps=ctrl, duration_micros=5)
    a.setdefault("is_cpu_op", ("bool_val", False))
    for k, (slot, v) in a.items():
        attr = pb.AttributeProto(name=k)
        if slot == "bool_list":
            attr.bool_list.values.extend(v)
        else:
            setattr(attr, slot, v)
        n.attr.append(attr)
    return n


def coll(i: int, ctype: int = pb.ALL_REDUCE, size: int = 1024, deps: tuple[int, ...] = (), **a: Attr) -> Any:
    return make(i, COLL, deps, (), {"comm_type": ("int64_val", ctype), "comm_size": ("int64_val", size), **a})


def send(i: int, dst: int = 1, tag: int = 7, size: int = 64, deps: tuple[int, ...] = (), **a: Attr) -> Any:
    a = {"comm_dst": ("int32_val", dst), "comm_tag": ("int32_val", tag), "comm_size": ("int64_val", size), **a}
    return make(i, SEND, deps, (), a)


def recv(i: int, src: int = 0, tag: int = 7, size: int = 64, deps: tuple[int, ...] = (), **a: Attr) -> Any:
    a = {"comm_src": ("int32_val", src), "comm_tag": ("int32_val", tag), "comm_size": ("int64_val", size), **a}
    return make(i, RECV, deps, (), a)


def encode(nodes: Sequence[Any], meta: bool = True) -> bytes:
    buf = io.BytesIO()
    if meta:
        protolib.encodeMessage(buf, pb.GlobalMetadata(version="0.0.4"))
    for n in nodes:
        protolib.encodeMessage(buf, n)
    return buf.getvalue()


def write(tmp: Path, ranks: list[list[Any]] | list[bytes]) -> list[Path]:
    out = []
    for r, content in enumerate(ranks):
        p = tmp / f"job.{r}.et"
        p.write_bytes(content if isinstance(content, bytes) else encode(content))
        out.append(p)
    return out


def good() -> list[list[Any]]:
    """Two ranks: compute, an all-reduce, a message 0 -> 1, compute."""
    return [[node(1), coll(2, deps=(1,)), send(3, deps=(2,)), node(4, deps=(3,))],
            [node(1), coll(2, deps=(1,)), recv(3, deps=(2,)), node(4, deps=(3,))]]


def one_rank(*nodes: Any) -> list[list[Any]]:
    """Rank 0 holds `nodes`, rank 1 the same collectives and nothing else broken."""
    return [list(nodes), [node(1)]]


CASES: dict[str, tuple[Callable[[], list[list[Any]] | list[bytes]], str, str, tuple[int, ...]]] = {
    # name: (ranks, rule, message fragment, node ids)
    "empty_file": (lambda: [b"", encode([node(1)])], "1 framing", "empty file", ()),
    "no_metadata": (lambda: [encode([node(1), node(2, deps=(1,))], meta=False), encode([node(1)])], "1 framing",
                    "no GlobalMetadata", ()),
    "zero_length_record": (lambda: [encode([node(1)]) + b"\x00", encode([node(1)])], "1 framing", "zero-length", ()),
    "truncated": (lambda: [encode([node(1), coll(2)])[:-3], encode([node(1)])], "1 framing", "cut short", ()),
    "missing_rank": (lambda: [[node(1)]], "2 one file per rank", "no file for rank(s) 1", ()),
    "duplicate_id": (lambda: one_rank(node(1), node(1)), "3 unique ids", "merges", (1,)),
    "data_dep_missing": (lambda: one_rank(node(1), node(2, deps=(99,))), "4 dependency present", "data", (2,)),
    "ctrl_dep_missing": (lambda: one_rank(node(1), node(2, ctrl=(99,))), "4 dependency present", "ctrl", (2,)),
    "no_free_node": (lambda: one_rank(node(1, deps=(2,)), node(2, deps=(1,))), "6 a free node", "every node", ()),
    "self_dependency": (lambda: one_rank(node(1), node(2, deps=(2,))), "7 no cycle", "itself", (2,)),
    "partial_cycle": (lambda: one_rank(node(1), node(2, deps=(3,)), node(3, deps=(2,))), "7 no cycle", "cycle",
                      (2, 3)),
    "metadata_node": (lambda: one_rank(node(1), node(2, pb.METADATA_NODE)), "10 node type", "METADATA", (2,)),
    "invalid_node": (lambda: one_rank(node(1), node(2, pb.INVALID_NODE)), "10 node type", "INVALID", (2,)),
    "mem_node": (lambda: one_rank(node(1), node(2, pb.MEM_LOAD_NODE, tensor_size=("uint64_val", 8))),
                 "10 node type", "MEM_LOAD", (2,)),
    "cpu_comp": (lambda: one_rank(node(1, is_cpu_op=("bool_val", True))), "12 is_cpu_op", "exposed", (1,)),
    "cpu_collective": (lambda: [[coll(1, is_cpu_op=("bool_val", True))], [coll(1)]], "12 is_cpu_op", "on the CPU",
                       (1,)),
    "barrier_type": (lambda: [[coll(1, pb.BARRIER)], [coll(1, pb.BARRIER)]], "14 comm_type", "comm_type 9", (1,)),
    "no_comm_size": (lambda: one_rank(node(1, COLL, comm_type=("int64_val", 0))), "14 required attribute",
                     "no comm_size", (1,)),
    "no_comm_type": (lambda: one_rank(node(1, COLL, comm_size=("int64_val", 8))), "14 required attribute",
                     "no comm_type", (1,)),
    "negative_size": (lambda: [[coll(1, size=-8)], [coll(1, size=-8)]], "14 comm_size", "negative", (1,)),
    "small_all_gather": (lambda: [[coll(1, pb.ALL_GATHER, 2)], [coll(1, pb.ALL_GATHER, 2)]], "21 comm_size",
                         "ALL_GATHER", (1,)),
    "pg_name_unknown": (lambda: [[coll(1, pg_name=("string_val", "1"))], [coll(1, pg_name=("string_val", "1"))]],
                        "14 pg_name", "comm-group", (1,)),
    "pg_name_text": (lambda: [[coll(1, pg_name=("string_val", "abc"))], [coll(1, pg_name=("string_val", "abc"))]],
                     "14 pg_name", "not a number", (1,)),
    "pg_name_int": (lambda: [[coll(1, pg_name=("int64_val", 0))], [coll(1, pg_name=("int64_val", 0))]],
                    "20 attribute slot", "pg_name", (1,)),
    "involved_dim_int": (lambda: [[coll(1, involved_dim=("int64_val", 1))], [coll(1)]], "14 involved_dim",
                         "bool_list", (1,)),
    "involved_dim_false": (lambda: [[coll(1, involved_dim=("bool_list", [False]))], [coll(1)]], "14 involved_dim",
                           "never completes", (1,)),
    "size_as_double": (lambda: [[node(1, COLL, comm_type=("int64_val", 0), comm_size=("double_val", 8.0))],
                                [coll(1)]], "20 attribute slot", "comm_size as double_val", (1,)),
    "type_as_string": (lambda: [[node(1, COLL, comm_type=("string_val", "0"), comm_size=("int64_val", 8))],
                                [coll(1)]], "20 attribute slot", "comm_type as string_val", (1,)),
    "send_size_zero": (lambda: [[send(1, size=0)], [recv(1, size=0)]], "15 comm_size", "chunk_size", (1,)),
    "send_negative_tag": (lambda: [[send(1, tag=-1)], [recv(1, tag=-1)]], "15 comm_tag", "tag -1", (1,)),
    "send_no_tag": (lambda: [[node(1, SEND, comm_dst=("int32_val", 1), comm_size=("int64_val", 8))], [node(1)]],
                    "15 required attribute", "no comm_tag", (1,)),
    "recv_no_src": (lambda: [[node(1)], [node(1, RECV, comm_tag=("int32_val", 1), comm_size=("int64_val", 8))]],
                    "15 required attribute", "no comm_src", (1,)),
    "send_wrong_src": (lambda: [[send(1, comm_src=("int32_val", 1))], [recv(1)]], "15 own rank", "not this rank",
                       (1,)),
    "send_out_of_range": (lambda: [[send(1, dst=5)], [node(1)]], "15 peer", "outside", (1,)),
    "send_to_self": (lambda: [[send(1, dst=0)], [node(1)]], "15 peer", "src != dest", (1,)),
    "collective_size_mismatch": (lambda: [[coll(1, pb.ALL_TO_ALL, 3200)], [coll(1, pb.ALL_TO_ALL, 7200)]],
                                 "22 collectives match", "differs", (1,)),
    "collective_type_mismatch": (lambda: [[coll(1, pb.ALL_REDUCE)], [coll(1, pb.ALL_GATHER)]],
                                 "22 collectives match", "differs", (1,)),
    "collective_missing": (lambda: [[node(1), coll(2, deps=(1,))], [node(1)]], "22 collectives match",
                           "never by rank(s) 1", (2,)),
    "message_size_mismatch": (lambda: [[send(1, size=64)], [recv(1, size=65)]], "15 messages meet", "never", (1,)),
    "message_tag_mismatch": (lambda: [[send(1, tag=7)], [recv(1, tag=8)]], "stall", "never finish", (1,)),
    "deadlock": (lambda: [[recv(1, src=1, tag=1), send(2, tag=2, deps=(1,))],
                          [recv(1, src=0, tag=2), send(2, dst=0, tag=1, deps=(1,))]], "stall", "never finish",
                 (1, 2)),
}


def rules_of(problems: list[Problem]) -> list[str]:
    return [p.rule for p in problems]


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_broken_rule_is_reported(case: str, tmp_path: Path) -> None:
    # Oracle: by construction — one trace built here to break each input rule of ASTRA-sim's analytical backend
    make, rule, fragment, ids = CASES[case]
    problems = check(write(tmp_path, make()), world=2)
    hits = [p for p in problems if p.rule == rule and fragment in p.message]
    assert hits, (rule, fragment, [str(p) for p in problems])
    assert hits[0].severity == "error"
    if ids:
        assert set(ids) <= set(hits[0].node_ids), str(hits[0])
    line = str(hits[0])
    assert "\n" not in line and f"rule {rule}" in line


def test_good_traces_pass(tmp_path: Path) -> None:
    # Oracle: by construction — traces built here from mlc-chakra's schema that keep every rule
    assert check(write(tmp_path, good())) == []


def test_warnings_do_not_fail(tmp_path: Path) -> None:
    # Oracle: by construction — a broadcast, which the simulator runs as another type, and a reordered pair
    ranks = [[coll(1, pb.BROADCAST), coll(2, pb.ALL_REDUCE)], [coll(1, pb.BROADCAST), coll(2, pb.ALL_REDUCE)]]
    problems = check(write(tmp_path, ranks))
    assert {(p.rule, p.severity) for p in problems} == {("14 comm_type", "warning"), ("9 collective order", "warning")}


def test_comm_groups_and_roofline(tmp_path: Path) -> None:
    # Oracle: by construction — a comm group named here, and a COMP node without tensor sizes
    ranks = [[coll(1, pg_name=("string_val", "1"))], [coll(1, pg_name=("string_val", "1"))]]
    assert check(write(tmp_path, ranks), comm_groups=[1]) == []
    ranks = [[node(1), node(2, deps=(1,), num_ops=("int64_val", 10), tensor_size=("uint64_val", 0))], [node(1)]]
    files = write(tmp_path, ranks)
    assert check(files) == []
    got = {(p.path, p.message.split(":")[0], p.node_ids) for p in check(files, roofline=True)}
    assert (str(files[0]), "no num_ops", (1,)) in got and (str(files[0]), "no tensor_size (or 0)", (1, 2)) in got


def test_expand_prefixes_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = write(tmp_path, good())
    assert expand([str(tmp_path / "job")]) == files
    assert main(["chakra", "check", str(tmp_path / "job")]) == 0
    assert "every rule" in capsys.readouterr().out
    (tmp_path / "job.1.et").write_bytes(encode([coll(1, size=7200)]))
    (tmp_path / "job.0.et").write_bytes(encode([coll(1, size=3200)]))
    assert main(["chakra", "check", str(tmp_path / "job.0.et"), str(tmp_path / "job.1.et")]) == 1
    err = capsys.readouterr().err
    assert "rule 22 collectives match" in err and "aiflame: error" in err
    groups = tmp_path / "groups.json"
    groups.write_text(json.dumps({"1": [0, 1]}))
    assert main(["chakra", "check", str(tmp_path / "job"), "--comm-groups", str(groups)]) == 1
    assert main(["chakra", "check", str(tmp_path / "absent")]) == 1
    assert "no absent.<rank>.et" in capsys.readouterr().err
