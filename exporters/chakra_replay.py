"""The Chakra checker's rules across ranks (15, 22 of docs/chakra.md; exporters/chakra_check.py runs them when
every rank's file loads): a replay of the dependencies alone in the simulator's issue order, in which collectives
must meet and receives must meet sends; what never finishes is reported, and so are collectives that no
dependency orders (9).
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from typing import Any

from .chakra_rules import COLL, RECV, SEND, Problem, _attrs, _int_value, _Rank, _topo


def _replay(ranks: dict[int, _Rank], problems: list[Problem]) -> None:
    """Run the ranks' dependencies together: collectives meet in issue order, receives meet sends."""
    known = {r: {n.id: n for n in rk.nodes} for r, rk in ranks.items()}
    deps = {r: {n.id: (set(n.data_deps) | set(n.ctrl_deps)) for n in rk.nodes} for r, rk in ranks.items()}
    if any(any(not d <= known[r].keys() for d in deps[r].values()) for r in ranks):
        return  # rule 4 broken: the simulator stops at load
    rp = _Replay(ranks, known, deps)
    progress = True
    while progress:
        issued = rp.issue()
        received = rp.receive()
        met = rp.meet()
        progress = issued or received or met
    problems += rp.mismatch
    rp.unfinished(problems)
    _order(ranks, problems)


class _Replay:
    """The state of a replay and its three steps, repeated while one makes progress: issue the nodes that are
    ready, match receives with sends, meet the collectives every rank has issued."""

    def __init__(self, ranks: dict[int, _Rank], known: dict[int, dict[int, Any]],
                 deps: dict[int, dict[int, set[int]]]) -> None:
        self.ranks, self.known = ranks, known
        self.done: dict[int, set[int]] = {r: set() for r in ranks}
        # each rank's nodes whose dependencies are all done and that are not issued yet, lowest id first (a heap);
        # a node becomes ready when its last dependency finishes, so a pass never rescans the nodes still waiting
        self.waiting = {r: {nid: len(d) for nid, d in deps[r].items()} for r in ranks}
        self.users: dict[int, dict[int, list[int]]] = {r: defaultdict(list) for r in ranks}
        for r in ranks:
            for nid, d in deps[r].items():
                for dep in d:
                    self.users[r][dep].append(nid)
        self.ready = {r: sorted(nid for nid, w in self.waiting[r].items() if w == 0) for r in ranks}
        self.colls: dict[int, list[tuple[int, int, int, int]]] = {r: [] for r in ranks}  # (id, type, size) in order
        self.arrived: dict[int, dict[int, Any]] = defaultdict(dict)  # k -> rank -> node
        # (src,dst,tag) -> (size, id)
        self.queue: dict[tuple[int, int, int], deque[tuple[int, int]]] = defaultdict(deque)
        self.receiving: dict[int, list[Any]] = {r: [] for r in ranks}
        self.mismatch: list[Problem] = []
        self.reported: set[int] = set()

    def finish(self, r: int, nid: int) -> None:
        self.done[r].add(nid)
        waiting, ready = self.waiting[r], self.ready[r]
        for u in self.users[r].pop(nid, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)

    def issue(self) -> bool:
        """Issue every rank's ready nodes; whether any was."""
        progress = False
        for r in self.ranks:
            ready = self.ready[r]
            # in id order, as a scan of the sorted nodes would: one made ready during the pass by a node with a
            # higher id waits for the next pass
            later: list[int] = []
            last = -1
            while ready:
                nid = heapq.heappop(ready)
                if nid < last:
                    later.append(nid)
                    continue
                last = nid
                progress = True
                self._issue_node(r, self.known[r][nid])
            for nid in later:
                heapq.heappush(ready, nid)
        return progress

    def _issue_node(self, r: int, n: Any) -> None:
        a = _attrs(n)
        if n.type == COLL:
            k = len(self.colls[r])
            self.colls[r].append((n.id, _int_value(a, "comm_type") or 0, _int_value(a, "comm_size") or 0, k))
            self.arrived[k][r] = n
        elif n.type == SEND:
            key = (r, _int_value(a, "comm_dst") or 0, _int_value(a, "comm_tag") or 0)
            self.queue[key].append((_int_value(a, "comm_size") or 0, n.id))
            self.finish(r, n.id)
        elif n.type == RECV:
            self.receiving[r].append(n)
        else:
            self.finish(r, n.id)

    def receive(self) -> bool:
        """Finish the receives whose send was made; whether any was. One whose send has another size never does."""
        progress = False
        for r in self.ranks:
            for n in list(self.receiving[r]):
                a = _attrs(n)
                key = (_int_value(a, "comm_src") or 0, r, _int_value(a, "comm_tag") or 0)
                if not self.queue[key]:
                    continue
                size, sid = self.queue[key][0]
                if size != (_int_value(a, "comm_size") or 0):
                    if n.id not in self.reported:
                        self.reported.add(n.id)
                        self.mismatch.append(Problem(
                            f"rank {r}", "15 messages meet", f"receives {_int_value(a, 'comm_size')} B from rank "
                            f"{key[0]} tag {key[2]}, whose send (rank {key[0]} node {sid}) has {size} B: it never "
                            "completes", (n.id,)))
                    continue
                self.queue[key].popleft()
                self.receiving[r].remove(n)
                self.finish(r, n.id)
                progress = True
        return progress

    def meet(self) -> bool:
        """Finish the collectives every rank has issued, when their type and size agree; whether any was."""
        progress = False
        for k in sorted(self.arrived):
            parts = self.arrived[k]
            if len(parts) < len(self.ranks):
                continue
            shapes = {r: (_int_value(_attrs(n), "comm_type"), _int_value(_attrs(n), "comm_size"))
                      for r, n in parts.items()}
            if len(set(shapes.values())) > 1:
                if k not in self.reported:
                    self.reported.add(k)
                    desc = "; ".join(f"rank {r} node {parts[r].id}: type {t} size {s}" for r, (t, s) in
                                     sorted(shapes.items()))
                    self.mismatch.append(Problem(
                        "ranks", "22 collectives match", f"collective #{k} differs across ranks ({desc}): its "
                        "packets never match, the ranks hang", tuple(sorted({n.id for n in parts.values()}))))
                continue
            for r, n in parts.items():
                self.finish(r, n.id)
            del self.arrived[k]
            progress = True
        return progress

    def unfinished(self, problems: list[Problem]) -> None:
        """Report the collectives some rank never issued, and each rank's nodes that never finished."""
        for k in sorted(self.arrived):
            parts = self.arrived[k]
            missing = sorted(set(self.ranks) - parts.keys())
            if missing and k not in self.reported:
                problems.append(Problem("ranks", "22 collectives match", f"collective #{k} is issued by rank(s) "
                                        f"{', '.join(map(str, sorted(parts)))} but never by rank(s) "
                                        f"{', '.join(map(str, missing))}: the ranks that issued it hang",
                                        tuple(sorted(n.id for n in parts.values()))))
        for r, rk in self.ranks.items():
            stuck = sorted(set(self.known[r]) - self.done[r])
            if stuck:
                problems.append(Problem(rk.path, "stall", "never finish in a replay of the dependencies: the "
                                        "simulator prints no 'finished' line for this rank", tuple(stuck)))


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
