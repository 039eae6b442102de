"""The Chakra checker's rules for one rank's nodes: ids and dependencies (3-7 of docs/chakra.md) and node types
and attributes (10-20); exporters/chakra_check.py lists them and runs them. Also `Problem`, the finding every rule
reports. Names with a leading underscore are shared with chakra_check.py and chakra_replay.py only.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

INT_SLOTS = frozenset({"int32_val", "int64_val", "uint32_val", "uint64_val", "sint32_val", "sint64_val",
                       "fixed32_val", "fixed64_val", "sfixed32_val", "sfixed64_val", "bool_val"})
INT_ATTRS = ("comm_type", "comm_size", "comm_priority", "comm_src", "comm_dst", "comm_tag", "num_ops",
             "tensor_size", "is_cpu_op")
SIMULATED = {0: "ALL_REDUCE", 2: "ALL_GATHER", 6: "ALL_TO_ALL", 7: "REDUCE_SCATTER"}
REPLAYED = {5: "BROADCAST"}
COMP, SEND, RECV, COLL = 4, 5, 6, 7
RUNS = {COMP: "COMP", SEND: "COMM_SEND", RECV: "COMM_RECV", COLL: "COMM_COLL"}
NOT_RUN = {0: "INVALID (skipped without running its children)", 1: "METADATA (aborts the simulator's statistics)",
           2: "MEM_LOAD (needs a remote-memory model; statistics reject it)",
           3: "MEM_STORE (needs a remote-memory model; statistics reject it)"}
REQUIRED = {COLL: ("comm_type", "comm_size"), SEND: ("comm_dst", "comm_size", "comm_tag"),
            RECV: ("comm_src", "comm_size", "comm_tag")}
MAX_IDS_SHOWN = 8


@dataclass(frozen=True, slots=True)
class Problem:
    """One broken rule: where (file or rank), which rule, which nodes, and what the simulator does about it."""

    path: str
    rule: str  # e.g. "4 dependency present"
    message: str
    node_ids: tuple[int, ...] = ()
    severity: str = "error"  # "error": the simulator aborts, hangs or drops nodes; "warning": it runs, off the mark

    def __str__(self) -> str:
        ids = ""
        if self.node_ids:
            shown = ", ".join(map(str, self.node_ids[:MAX_IDS_SHOWN]))
            more = f" (+{len(self.node_ids) - MAX_IDS_SHOWN} more)" if len(self.node_ids) > MAX_IDS_SHOWN else ""
            ids = f" node{'s' if len(self.node_ids) > 1 else ''} {shown}{more}:"
        return f"{self.path}: {self.severity}: rule {self.rule}:{ids} {self.message}"


@dataclass(slots=True)
class _Rank:
    rank: int
    path: str
    nodes: list[Any] = field(default_factory=list)
    meta: Any = None


def _attrs(node: Any) -> dict[str, tuple[str | None, Any]]:
    """name -> (slot, value) of the first attribute of each name (the simulator takes the first)."""
    out: dict[str, tuple[str | None, Any]] = {}
    for a in node.attr:
        if a.name not in out:
            slot = a.WhichOneof("value")
            out[a.name] = (slot, getattr(a, slot) if slot else None)
    return out


def _int_value(attrs: dict[str, tuple[str | None, Any]], key: str) -> int | None:
    slot, v = attrs.get(key, (None, None))
    return int(v) if slot in INT_SLOTS else None


# --- one rank ----------------------------------------------------------------------------------------------------


def _check_rank(r: _Rank, world: int, comm_groups: set[int], splits: int, roofline: bool,
                problems: list[Problem]) -> None:
    add = problems.append
    p = r.path
    by_rule: dict[tuple[str, str, str], list[int]] = defaultdict(list)

    def bad(rule: str, message: str, nid: int, severity: str = "error") -> None:
        by_rule[(rule, message, severity)].append(nid)

    ids = [n.id for n in r.nodes]
    seen: set[int] = set()
    for i in ids:
        if i in seen:
            bad("3 unique ids", "the same id more than once: the simulator merges them into one node, run once", i)
        seen.add(i)
    for n in r.nodes:
        for kind, deps in (("data", n.data_deps), ("ctrl", n.ctrl_deps)):
            for d in deps:
                if d not in seen:
                    bad("4 dependency present", f"a {kind} dependency on an id not in the file: the simulator "
                        "aborts at load ('not found in index')", n.id)
                    break
        if n.id in n.data_deps or n.id in n.ctrl_deps:
            bad("7 no cycle", "depends on itself: the simulator never runs it, and says nothing", n.id)
        _check_node(n, r.rank, world, comm_groups, splits, roofline, bad)
    if r.nodes and all(n.data_deps or n.ctrl_deps for n in r.nodes):
        add(Problem(p, "6 a free node", "every node has a dependency: the simulator aborts ('No dependancy free "
                    "nodes found')"))
    if not r.nodes:
        add(Problem(p, "6 a free node", "no nodes: the simulator aborts ('No dependancy free nodes found')"))
    cyclic = {n.id for n in r.nodes} - set(_topo(r.nodes))  # what Kahn's algorithm leaves
    if cyclic:
        bad_ids = sorted(cyclic)
        by_rule[("7 no cycle", "in a dependency cycle (or after one): the simulator never runs them and still "
                 "prints 'finished'", "error")] += bad_ids
    for (rule, message, severity), nids in by_rule.items():
        add(Problem(p, rule, message, tuple(sorted(set(nids))), severity))


def _check_node(n: Any, rank: int, world: int, comm_groups: set[int], splits: int, roofline: bool,
                bad: Any) -> None:
    if n.type not in RUNS:
        bad("10 node type", f"type {NOT_RUN.get(n.type, n.type)}: not a node the simulator runs", n.id)
        return
    a = _attrs(n)
    for key in INT_ATTRS:
        if key in a and a[key][0] not in INT_SLOTS:
            bad("20 attribute slot", f"{key} as {a[key][0] or 'no value'}: the simulator reads an integer and "
                "throws (std::bad_cast)", n.id)
    if "pg_name" in a and a["pg_name"][0] != "string_val":
        bad("20 attribute slot", f"pg_name as {a['pg_name'][0]}: the simulator reads a string and throws", n.id)
    if "involved_dim" in a:
        slot, v = a["involved_dim"]
        if slot != "bool_list":
            bad("14 involved_dim", "involved_dim not a bool_list: the simulator exits", n.id)
        elif not any(v.values):
            bad("14 involved_dim", "involved_dim all false: the collective never completes", n.id)
    if _int_value(a, "is_cpu_op"):
        what = ("a collective on the CPU: the simulator throws ('Comm node should not be on CPU')" if n.type == COLL
                else "is_cpu_op true: the simulator refuses its overlap statistics and counts all of it as "
                "exposed communication")
        bad("12 is_cpu_op", what, n.id)
    for key in REQUIRED.get(n.type, ()):
        if key not in a:
            bad("14 required attribute" if n.type == COLL else "15 required attribute",
                f"no {key}: the simulator throws ('Attribute {key} not found')", n.id)
    size = _int_value(a, "comm_size")
    if n.type == COLL:
        _check_coll(n, a, size, comm_groups, splits, bad)
    elif n.type in (SEND, RECV):
        _check_p2p(n, a, size, rank, world, bad)
    elif roofline:
        if _int_value(a, "num_ops") is None:
            bad("13 roofline", "no num_ops: roofline mode throws", n.id)
        if not _int_value(a, "tensor_size"):
            bad("13 roofline", "no tensor_size (or 0): roofline mode skips the node and the rank stalls", n.id)


def _check_coll(n: Any, a: dict[str, tuple[str | None, Any]], size: int | None, comm_groups: set[int],
                splits: int, bad: Any) -> None:
    ctype = _int_value(a, "comm_type")
    if ctype is not None and ctype not in SIMULATED:
        if ctype in REPLAYED:
            bad("14 comm_type", "BROADCAST is replayed from duration_micros, not simulated: no rank waits for "
                "another", n.id, "warning")
        else:
            bad("14 comm_type", f"comm_type {ctype} is not a collective the simulator runs ('Unsupported "
                "collective comm type')", n.id)
    if size is not None:
        if size < 0:
            bad("14 comm_size", "negative comm_size: read as about 1.8e19 bytes, it never completes", n.id)
        elif ctype == 2 and size < splits:
            bad("21 comm_size", f"ALL_GATHER of fewer than preferred-dataset-splits ({splits}) bytes: it never "
                "completes (0) or loops forever", n.id)
        elif size == 0:
            bad("21 comm_size", "comm_size 0: simulated as a few bytes", n.id, "warning")
    if "pg_name" in a and a["pg_name"][0] == "string_val":
        pg = str(a["pg_name"][1])
        if pg not in ("", "0"):
            if not pg.isdigit():
                bad("14 pg_name", f"pg_name {pg!r} is not a number: the simulator throws (std::stoi)", n.id)
            elif int(pg) not in comm_groups:
                bad("14 pg_name", f"pg_name {pg!r} is not a group of the comm-group configuration: the simulator "
                    "exits", n.id)


def _check_p2p(n: Any, a: dict[str, tuple[str | None, Any]], size: int | None, rank: int, world: int,
               bad: Any) -> None:
    send = n.type == SEND
    if size is not None and size <= 0:
        bad("15 comm_size", "comm_size not > 0: the simulator aborts ('chunk_size > 0')", n.id)
    tag = _int_value(a, "comm_tag")
    if tag is not None and not 0 <= tag < 1 << 31:
        bad("15 comm_tag", f"tag {tag} outside 0..2^31-1: the simulator aborts", n.id)
    me, peer_key = ("comm_src", "comm_dst") if send else ("comm_dst", "comm_src")
    own = _int_value(a, me)
    if own is not None and own != rank:
        bad("15 own rank", f"{me} {own} is not this rank ({rank}): the simulator throws", n.id)
    peer = _int_value(a, peer_key)
    if peer is not None:
        if not 0 <= peer < world:
            bad("15 peer", f"{peer_key} {peer} outside the job's {world} ranks: the simulator aborts", n.id)
        elif peer == rank:
            bad("15 peer", f"{peer_key} is this rank: the simulator aborts ('src != dest')", n.id)


def _topo(nodes: Sequence[Any]) -> list[int]:
    """Ids of the nodes in a dependency order (Kahn's algorithm, the free nodes lowest id first); the nodes in a
    cycle, or after one, never become free and are left out."""
    known = {n.id for n in nodes}
    indeg: dict[int, int] = {}
    users: dict[int, list[int]] = defaultdict(list)
    for n in nodes:
        deps = (set(n.data_deps) | set(n.ctrl_deps)) & known
        indeg[n.id] = len(deps)
        for d in deps:
            users[d].append(n.id)
    todo = deque(sorted(i for i, d in indeg.items() if d == 0))
    out = []
    while todo:
        i = todo.popleft()
        out.append(i)
        for u in users[i]:
            indeg[u] -= 1
            if indeg[u] == 0:
                todo.append(u)
    return out
