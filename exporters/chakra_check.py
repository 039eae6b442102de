"""A checker of Chakra `.et` files against the input rules of ASTRA-sim's analytical backend: what its Chakra
feeder and its system layer abort on, hang on, or silently get wrong (the rules, with where the simulator
enforces them, are in docs/chakra.md). `check(paths)` returns one `Problem` per broken rule and rank, naming the
node ids; an empty list means the simulator will run the files to the end.

What it checks, by the rule numbers of docs/chakra.md:
- framing (1): a GlobalMetadata record with its version first, no zero-length record, no record cut short;
- files (2): one `<prefix>.<rank>.et` per rank of the job;
- ids and dependencies (3-7): unique ids, every dependency present, a dependency-free node, no cycle and no
  self-dependency;
- node types (10-19): only COMP, COMM_COLL, COMM_SEND and COMM_RECV; no `is_cpu_op` true; the attributes each
  type needs, in the typed slots the simulator reads (20), with values it accepts; with `roofline`, `num_ops`
  and `tensor_size` on every COMP node;
- across ranks (15, 22): a replay of the dependencies alone, in the simulator's issue order (free nodes by
  ascending id), in which collectives meet in order with the same type and size on every rank and receives meet
  sends of the same source, destination, tag and size; what never finishes is reported.
"""

from __future__ import annotations

import re
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .chakra import _schema
from .chakra_nodes import ChakraError

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
# rules after whose breach a replay of the ranks means nothing (the simulator stops at load, or drops nodes)
STRUCTURAL = frozenset({"1 framing", "2 one file per rank", "3 unique ids", "4 dependency present", "6 a free node",
                        "7 no cycle", "10 node type"})
_RANK = re.compile(r"\.(\d+)\.et$")


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


def rank_of(path: Path) -> int | None:
    m = _RANK.search(path.name)
    return int(m.group(1)) if m else None


def expand(args: Sequence[str | Path]) -> list[Path]:
    """`.et` files, or prefixes whose `<prefix>.<rank>.et` files are taken; ChakraError when none is found."""
    out: list[Path] = []
    for a in args:
        p = Path(a)
        if p.suffix == ".et" and rank_of(p) is not None:
            out.append(p)
            continue
        found = sorted((f for f in p.parent.glob(f"{p.name}.*.et") if rank_of(f) is not None),
                       key=lambda f: rank_of(f) or 0)
        if not found:
            raise ChakraError(f"{p}: no {p.name}.<rank>.et files")
        out += found
    return out


# --- framing -------------------------------------------------------------------------------------------------


def _varint(data: bytes, pos: int) -> tuple[int, int] | None:
    value, shift = 0, 0
    while pos < len(data) and shift < 64:
        b = data[pos]
        value |= (b & 0x7F) << shift
        pos += 1
        if not b & 0x80:
            return value, pos
        shift += 7
    return None


def _read(path: Path, rank: int, problems: list[Problem]) -> _Rank | None:
    pb, _ = _schema()
    name = str(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        problems.append(Problem(name, "2 one file per rank", f"unreadable ({e.strerror or e}): the simulator stops "
                                "with 'workload file does not exist'"))
        return None
    if not data:
        problems.append(Problem(name, "1 framing", "empty file: the simulator aborts ('Failed to read global "
                                "metadata')"))
        return None
    out = _Rank(rank, name)
    pos, index = 0, 0
    while pos < len(data):
        head = _varint(data, pos)
        if head is None or head[1] + head[0] > len(data):
            problems.append(Problem(name, "1 framing", f"record {index} at byte {pos} is cut short: the simulator "
                                    "uses it half-parsed, silently"))
            break
        length, start = head
        body = data[start:start + length]
        if length == 0:
            problems.append(Problem(name, "1 framing", f"zero-length record {index} at byte {pos}: the simulator "
                                    "makes it an INVALID node with id 0 (replacing a real node 0)"))
        msg = pb.GlobalMetadata() if index == 0 else pb.Node()
        try:
            msg.ParseFromString(body)
        except Exception as e:  # protobuf's DecodeError
            problems.append(Problem(name, "1 framing", f"record {index} at byte {pos} does not decode ({e}): the "
                                    "simulator uses it half-parsed"))
            msg = None
        if index == 0:
            out.meta = msg
            if msg is None or not msg.version:
                problems.append(Problem(name, "1 framing", "no GlobalMetadata version first: the simulator takes "
                                        "the first record for the metadata, and that node is lost"))
        elif msg is not None and length:
            out.nodes.append(msg)
        pos, index = start + length, index + 1
    return out


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
    cyclic = _cyclic(r.nodes)
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


def _cyclic(nodes: Sequence[Any]) -> set[int]:
    """Ids of nodes that never become free because of a cycle (Kahn's algorithm leaves them)."""
    known = {n.id for n in nodes}
    indeg: dict[int, int] = {}
    users: dict[int, list[int]] = defaultdict(list)
    for n in nodes:
        deps = (set(n.data_deps) | set(n.ctrl_deps)) & known
        indeg[n.id] = len(deps)
        for d in deps:
            users[d].append(n.id)
    todo = deque(i for i, d in indeg.items() if d == 0)
    done = set()
    while todo:
        i = todo.popleft()
        done.add(i)
        for u in users[i]:
            indeg[u] -= 1
            if indeg[u] == 0:
                todo.append(u)
    return set(indeg) - done


# --- across ranks ----------------------------------------------------------------------------------------------


def _replay(ranks: dict[int, _Rank], problems: list[Problem]) -> None:
    """Run the ranks' dependencies together: collectives meet in issue order, receives meet sends."""
    known = {r: {n.id: n for n in rk.nodes} for r, rk in ranks.items()}
    deps = {r: {n.id: (set(n.data_deps) | set(n.ctrl_deps)) for n in rk.nodes} for r, rk in ranks.items()}
    if any(any(not d <= known[r].keys() for d in deps[r].values()) for r in ranks):
        return  # rule 4 broken: the simulator stops at load
    done: dict[int, set[int]] = {r: set() for r in ranks}
    issued: dict[int, set[int]] = {r: set() for r in ranks}
    colls: dict[int, list[tuple[int, int, int, int]]] = {r: [] for r in ranks}  # (id, type, size) in issue order
    arrived: dict[int, dict[int, Any]] = defaultdict(dict)  # k -> rank -> node
    queue: dict[tuple[int, int, int], deque[tuple[int, int]]] = defaultdict(deque)  # (src,dst,tag) -> (size, id)
    receiving: dict[int, list[Any]] = {r: [] for r in ranks}
    mismatch: list[Problem] = []
    reported: set[int] = set()
    progress = True
    while progress:
        progress = False
        for r, rk in ranks.items():
            for n in sorted(rk.nodes, key=lambda x: x.id):
                if n.id in issued[r] or not deps[r][n.id] <= done[r]:
                    continue
                issued[r].add(n.id)
                progress = True
                a = _attrs(n)
                if n.type == COLL:
                    k = len(colls[r])
                    colls[r].append((n.id, _int_value(a, "comm_type") or 0, _int_value(a, "comm_size") or 0, k))
                    arrived[k][r] = n
                elif n.type == SEND:
                    key = (r, _int_value(a, "comm_dst") or 0, _int_value(a, "comm_tag") or 0)
                    queue[key].append((_int_value(a, "comm_size") or 0, n.id))
                    done[r].add(n.id)
                elif n.type == RECV:
                    receiving[r].append(n)
                else:
                    done[r].add(n.id)
        for r in ranks:
            for n in list(receiving[r]):
                a = _attrs(n)
                key = (_int_value(a, "comm_src") or 0, r, _int_value(a, "comm_tag") or 0)
                if not queue[key]:
                    continue
                size, sid = queue[key][0]
                if size != (_int_value(a, "comm_size") or 0):
                    if n.id not in reported:
                        reported.add(n.id)
                        mismatch.append(Problem(f"rank {r}", "15 messages meet",
                                                f"receives {_int_value(a, 'comm_size')} B from rank {key[0]} tag "
                                                f"{key[2]}, whose send (rank {key[0]} node {sid}) has {size} B: it "
                                                "never completes", (n.id,)))
                    continue
                queue[key].popleft()
                receiving[r].remove(n)
                done[r].add(n.id)
                progress = True
        for k in sorted(arrived):
            parts = arrived[k]
            if len(parts) < len(ranks):
                continue
            shapes = {r: (_int_value(_attrs(n), "comm_type"), _int_value(_attrs(n), "comm_size"))
                      for r, n in parts.items()}
            if len(set(shapes.values())) > 1:
                if k not in reported:
                    reported.add(k)
                    desc = "; ".join(f"rank {r} node {parts[r].id}: type {t} size {s}" for r, (t, s) in
                                     sorted(shapes.items()))
                    mismatch.append(Problem("ranks", "22 collectives match",
                                            f"collective #{k} differs across ranks ({desc}): its packets never "
                                            "match, the ranks hang", tuple(sorted({n.id for n in parts.values()}))))
                continue
            for r, n in parts.items():
                done[r].add(n.id)
            del arrived[k]
            progress = True
    problems += mismatch
    for k in sorted(arrived):
        parts = arrived[k]
        missing = sorted(set(ranks) - parts.keys())
        if missing and k not in reported:
            problems.append(Problem("ranks", "22 collectives match", f"collective #{k} is issued by rank(s) "
                                    f"{', '.join(map(str, sorted(parts)))} but never by rank(s) "
                                    f"{', '.join(map(str, missing))}: the ranks that issued it hang",
                                    tuple(sorted(n.id for n in parts.values()))))
    for r, rk in ranks.items():
        stuck = sorted(set(known[r]) - done[r])
        if stuck:
            problems.append(Problem(rk.path, "stall", "never finish in a replay of the dependencies: the simulator "
                                    "prints no 'finished' line for this rank", tuple(stuck)))
    _order(ranks, problems)


def _order(ranks: dict[int, _Rank], problems: list[Problem]) -> None:
    """Collectives that no dependency orders: the simulator issues the lowest id first, so their order (which
    must be the same on every rank) depends on ids and timing."""
    for rk in ranks.values():
        colls = sorted(n.id for n in rk.nodes if n.type == COLL)
        if len(colls) < 2:
            continue
        bit = {nid: 1 << i for i, nid in enumerate(colls)}
        anc: dict[int, int] = {}
        by_id = {n.id: n for n in rk.nodes}
        order = _topo(rk.nodes)
        for nid in order:
            n = by_id[nid]
            acc = 0
            for d in set(n.data_deps) | set(n.ctrl_deps):
                acc |= anc.get(d, 0) | bit.get(d, 0)
            anc[nid] = acc
        loose = [b for a, b in zip(colls, colls[1:], strict=False) if not anc.get(b, 0) & bit[a]]
        if loose:
            problems.append(Problem(rk.path, "9 collective order", "a collective that does not depend on the one "
                                    "before it: their order follows ids and timing, not dependencies",
                                    tuple(loose), "warning"))


def _topo(nodes: Sequence[Any]) -> list[int]:
    known = {n.id for n in nodes}
    indeg = {n.id: len((set(n.data_deps) | set(n.ctrl_deps)) & known) for n in nodes}
    users: dict[int, list[int]] = defaultdict(list)
    for n in nodes:
        for d in (set(n.data_deps) | set(n.ctrl_deps)) & known:
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


# --- entry point -------------------------------------------------------------------------------------------------


def check(paths: Iterable[str | Path], world: int | None = None, comm_groups: Iterable[int] = (), splits: int = 4,
          roofline: bool = False) -> list[Problem]:
    """The rules the `.et` files of one job break, one Problem per rule and rank. `world`: the job's ranks (the
    network's NPU count), by default from the files' metadata or names; `comm_groups`: the ids of the
    comm-group configuration; `splits`: the system's preferred-dataset-splits; `roofline`: check for roofline mode."""
    problems: list[Problem] = []
    ranks: dict[int, _Rank] = {}
    for path in map(Path, paths):
        rank = rank_of(path)
        if rank is None:
            problems.append(Problem(str(path), "2 one file per rank", "not named <prefix>.<rank>.et: the simulator "
                                    "will not find it"))
            continue
        if rank in ranks:
            problems.append(Problem(str(path), "2 one file per rank", f"a second file for rank {rank}"))
            continue
        r = _read(path, rank, problems)
        if r is not None:
            ranks[rank] = r
    if world is None:
        declared = [int(a.int64_val) for r in ranks.values() if r.meta is not None
                    for a in r.meta.attr if a.name == "world_size" and a.WhichOneof("value") == "int64_val"]
        world = max([*declared, max(ranks, default=-1) + 1])
    missing = sorted(set(range(world)) - ranks.keys())
    if missing:
        problems.append(Problem("ranks", "2 one file per rank", f"no file for rank(s) {', '.join(map(str, missing))} "
                                f"of {world}: the simulator stops ('workload file does not exist')"))
    extra = sorted(r for r in ranks if r >= world)
    if extra:
        problems.append(Problem("ranks", "2 one file per rank", f"files for rank(s) {', '.join(map(str, extra))} "
                                f"beyond the job's {world}: the simulator ignores them", (), "warning"))
    for r in ranks.values():
        _check_rank(r, world, set(comm_groups), splits, roofline, problems)
    if ranks and not any(p.severity == "error" and p.rule in STRUCTURAL for p in problems):
        _replay({r: rk for r, rk in ranks.items() if r < world}, problems)
    return problems


def check_nodes(ranks: Mapping[int, Sequence[Any]], world: int | None = None, comm_groups: Iterable[int] = (),
                splits: int = 4, roofline: bool = False) -> list[Problem]:
    """The same rules on decoded nodes (rank -> mlc-chakra Nodes), for traces that are not in files; `path` in
    each Problem is "rank R"."""
    problems: list[Problem] = []
    rks = {r: _Rank(r, f"rank {r}", list(nodes)) for r, nodes in ranks.items()}
    world = world if world is not None else max(rks, default=-1) + 1
    missing = sorted(set(range(world)) - rks.keys())
    if missing:
        problems.append(Problem("ranks", "2 one file per rank", f"no trace for rank(s) {', '.join(map(str, missing))} "
                                f"of {world}"))
    for r in rks.values():
        _check_rank(r, world, set(comm_groups), splits, roofline, problems)
    if rks and not any(p.severity == "error" and p.rule in STRUCTURAL for p in problems):
        _replay(rks, problems)
    return problems


def errors(problems: Iterable[Problem]) -> list[Problem]:
    return [p for p in problems if p.severity == "error"]
