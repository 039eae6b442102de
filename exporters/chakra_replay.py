"""The Chakra checker's rules across ranks (15, 22 of docs/chakra.md; exporters/chakra_check.py runs them when
every rank's file loads): a replay of the dependencies alone in the simulator's issue order, in which collectives
must meet and receives must meet sends; what never finishes is reported, and so are collectives that no
dependency orders (9).
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

from .chakra_rules import COLL, RECV, SEND, Problem, _attrs, _int_value, _Rank


def _replay(ranks: dict[int, _Rank], problems: list[Problem]) -> None:
    """Run the ranks' dependencies together: collectives meet in issue order, receives meet sends."""
    known = {r: {n.id: n for n in rk.nodes} for r, rk in ranks.items()}
    deps = {r: {n.id: (set(n.data_deps) | set(n.ctrl_deps)) for n in rk.nodes} for r, rk in ranks.items()}
    if any(any(not d <= known[r].keys() for d in deps[r].values()) for r in ranks):
        return  # rule 4 broken: the simulator stops at load
    done: dict[int, set[int]] = {r: set() for r in ranks}
    # each rank's nodes whose dependencies are all done and that are not issued yet, lowest id first (a heap);
    # a node becomes ready when its last dependency finishes, so a pass never rescans the nodes still waiting
    waiting = {r: {nid: len(d) for nid, d in deps[r].items()} for r in ranks}
    users: dict[int, dict[int, list[int]]] = {r: defaultdict(list) for r in ranks}
    for r in ranks:
        for nid, d in deps[r].items():
            for dep in d:
                users[r][dep].append(nid)
    ready = {r: sorted(nid for nid, w in waiting[r].items() if w == 0) for r in ranks}

    def finish(r: int, nid: int) -> None:
        done[r].add(nid)
        for u in users[r].pop(nid, ()):
            waiting[r][u] -= 1
            if waiting[r][u] == 0:
                heapq.heappush(ready[r], u)

    colls: dict[int, list[tuple[int, int, int, int]]] = {r: [] for r in ranks}  # (id, type, size) in issue order
    arrived: dict[int, dict[int, Any]] = defaultdict(dict)  # k -> rank -> node
    queue: dict[tuple[int, int, int], deque[tuple[int, int]]] = defaultdict(deque)  # (src,dst,tag) -> (size, id)
    receiving: dict[int, list[Any]] = {r: [] for r in ranks}
    mismatch: list[Problem] = []
    reported: set[int] = set()
    progress = True
    while progress:
        progress = False
        for r in ranks:
            # in id order, as a scan of the sorted nodes would: one made ready during the pass by a node with a
            # higher id waits for the next pass
            later: list[int] = []
            last = -1
            while ready[r]:
                nid = heapq.heappop(ready[r])
                if nid < last:
                    later.append(nid)
                    continue
                last = nid
                n = known[r][nid]
                progress = True
                a = _attrs(n)
                if n.type == COLL:
                    k = len(colls[r])
                    colls[r].append((n.id, _int_value(a, "comm_type") or 0, _int_value(a, "comm_size") or 0, k))
                    arrived[k][r] = n
                elif n.type == SEND:
                    key = (r, _int_value(a, "comm_dst") or 0, _int_value(a, "comm_tag") or 0)
                    queue[key].append((_int_value(a, "comm_size") or 0, n.id))
                    finish(r, n.id)
                elif n.type == RECV:
                    receiving[r].append(n)
                else:
                    finish(r, n.id)
            for nid in later:
                heapq.heappush(ready[r], nid)
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
                finish(r, n.id)
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
                finish(r, n.id)
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

