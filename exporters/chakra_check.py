"""A checker of Chakra `.et` files against the input rules of ASTRA-sim's analytical backend: what its Chakra
feeder and its system layer abort on, hang on, or silently get wrong (the rules, with where the simulator
enforces them, are in docs/chakra.md). `check(paths)` returns one `Problem` per broken rule and rank, naming the
node ids; an empty list means the simulator will run the files to the end.

What it checks, by the rule numbers of docs/chakra.md:
- here: framing (1): a GlobalMetadata record with its version first, no zero-length record, no record cut short;
  and files (2): one `<prefix>.<rank>.et` per rank of the job;
- exporters/chakra_rules.py, each rank's nodes: ids and dependencies (3-7): unique ids, every dependency
  present, a dependency-free node, no cycle and no self-dependency; node types (10-19): only COMP, COMM_COLL,
  COMM_SEND and COMM_RECV; no `is_cpu_op` true; the attributes each type needs, in the typed slots the
  simulator reads (20), with values it accepts; with `roofline`, `num_ops` and `tensor_size` on every COMP node;
- exporters/chakra_replay.py, across ranks (15, 22): a replay of the dependencies alone, in the simulator's
  issue order (free nodes by ascending id), in which collectives meet in order with the same type and size on
  every rank and receives meet sends of the same source, destination, tag and size; what never finishes is
  reported. It runs only when no structural rule is broken.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aiflame.core.errors import Unreadable

from .chakra import _schema
from .chakra_replay import _replay
from .chakra_rules import Problem, _check_rank, _Rank

__all__ = ["STRUCTURAL", "Problem", "check", "check_nodes", "errors", "expand", "rank_of"]

# rules after whose breach a replay of the ranks means nothing (the simulator stops at load, or drops nodes)
STRUCTURAL = frozenset({"1 framing", "2 one file per rank", "3 unique ids", "4 dependency present", "6 a free node",
                        "7 no cycle", "10 node type"})
_RANK = re.compile(r"\.(\d+)\.et$")


def rank_of(path: Path) -> int | None:
    m = _RANK.search(path.name)
    return int(m.group(1)) if m else None


def expand(args: Sequence[str | Path]) -> list[Path]:
    """`.et` files, or prefixes whose `<prefix>.<rank>.et` files are taken; Unreadable when none is found."""
    out: list[Path] = []
    for a in args:
        p = Path(a)
        if p.suffix == ".et" and rank_of(p) is not None:
            out.append(p)
            continue
        found = sorted((f for f in p.parent.glob(f"{p.name}.*.et") if rank_of(f) is not None),
                       key=lambda f: rank_of(f) or 0)
        if not found:
            raise Unreadable(f"{p}: no {p.name}.<rank>.et files")
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
