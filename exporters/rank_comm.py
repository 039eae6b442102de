"""A rank's communication calls, from its trace events: collectives, and sends and receives up to the end of their
waits (`comm_ops`), and the numbering of the collectives in the job's order, the same on every rank
(`match_collectives`). Part of the rank timeline (exporters/rank_timeline.py)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from aiflame.core.model import EventKind, TraceEvent

SENDS, RECVS = frozenset({"send", "ncclSend"}), frozenset({"recv", "ncclRecv"})
P2P_WAITS = frozenset({"send_wait", "recv_wait"})  # gloo: the completion of a posted send/recv


def _int(ev: TraceEvent, key: str, default: int = 0) -> int:
    v = ev.args.get(key, default)
    return int(v) if isinstance(v, int | float) else default


def call_name(ev: TraceEvent) -> str:
    """The runtime call an event stands for (gloo's algorithm name, `ncclAllReduce`, `send`, ...)."""
    return str(ev.args.get("call", ev.name))


@dataclass(slots=True)
class CommOp:
    """One communication call of a rank: a collective, or a send/recv up to the end of its wait."""

    event: TraceEvent
    call: str
    kind: str  # "collective", "send" or "recv"
    start_ns: int  # not before the rank's window
    end_ns: int
    bytes: int  # this rank's size as the runtime reported it; -1 when unknown
    peer: int = -1  # send/recv
    tag: int = -1  # send/recv, when the runtime has tags
    root: int = -1
    seq: int = -1  # collectives: the position in the job's collective order, the same on every rank
    wait: tuple[int, int] | None = None  # send/recv: the wait call (start, end), on the posting thread
    post_end_ns: int = 0  # send/recv: when the post call returned

    @property
    def tid(self) -> int:
        return self.event.tid

    @property
    def duration_ns(self) -> int:
        return max(self.end_ns - self.start_ns, 0)


# --- communication calls -------------------------------------------------------------------------------------------


def comm_ops(events: Sequence[TraceEvent]) -> list[CommOp]:
    """A rank's communication calls by start: collectives, and sends/recvs ending at their waits."""
    # a Work's address is reused by later sends/recvs: each post takes the first wait on it that follows
    waits: dict[tuple[int, int], list[TraceEvent]] = defaultdict(list)
    for ev in sorted(events, key=lambda e: (e.start_ns, e.event_id)):
        if call_name(ev) in P2P_WAITS and _int(ev, "work"):
            waits[(ev.pid, _int(ev, "work"))].append(ev)
    out = []
    for ev in sorted(events, key=lambda e: (e.start_ns, e.event_id)):
        if ev.kind != EventKind.COLLECTIVE:
            continue
        call = call_name(ev)
        end = ev.start_ns + ev.duration_ns
        kind = "send" if call in SENDS else "recv" if call in RECVS else "collective"
        op = CommOp(ev, call, kind, ev.start_ns, end, _int(ev, "bytes", -1) if "bytes" in ev.args else -1,
                    root=_int(ev, "root", -1))
        if kind != "collective":
            op.peer = _int(ev, "peer", -1)
            op.tag = _int(ev, "tag", -1) if "tag" in ev.args else -1
            op.post_end_ns = end
            queue = waits.get((ev.pid, _int(ev, "work")), []) if "work" in ev.args else []
            while queue and queue[0].start_ns < ev.start_ns:
                queue.pop(0)  # a wait before this post belongs to an earlier one
            w = queue.pop(0) if queue else None
            if w is not None:
                op.wait = (w.start_ns, w.start_ns + w.duration_ns)
                op.end_ns = max(end, op.wait[1])
        out.append(op)
    return out


def match_collectives(per_rank: dict[int, list[CommOp]], warnings: list[str]) -> None:
    """Number every rank's collectives in the job's order (`seq`). The k-th collective of each rank is the same
    call; a rank whose k-th and (k+1)-th disagree with the others' but agree swapped (two worker threads started
    them microseconds apart in the other order) is swapped back. Collectives past the first disagreement that no
    swap explains, or past the shortest rank's last one, get no number, with a warning."""
    seqs = {r: [op for op in ops if op.kind == "collective"] for r, ops in per_rank.items()}
    if not seqs:
        return
    if len(seqs) == 1:
        for k, op in enumerate(next(iter(seqs.values()))):
            op.seq = k
        return
    n = min(len(s) for s in seqs.values())
    ref = min(seqs)
    k = 0
    while k < n:
        want = seqs[ref][k].call
        bad = [r for r, s in seqs.items() if s[k].call != want]
        if bad:
            # the majority call at k decides; a swap with k+1 fixes a rank whose order differs by a race
            calls = Counter(s[k].call for s in seqs.values())
            want = calls.most_common(1)[0][0]
            for s in seqs.values():
                if s[k].call != want and k + 1 < len(s) and s[k + 1].call == want:
                    s[k], s[k + 1] = s[k + 1], s[k]
            bad = [r for r, s in seqs.items() if s[k].call != want]
            if bad:
                calls_at = ", ".join(f"rank {r} {s[k].call}" for r, s in sorted(seqs.items()))
                warnings.append(f"collective #{k} differs across ranks ({calls_at}): it and the later ones are "
                                "left unmatched")
                n = k
                break
        for s in seqs.values():
            s[k].seq = k
        k += 1
    longest = max(len(s) for s in seqs.values())
    if longest > n:
        short = ", ".join(f"rank {r}: {len(s) - n}" for r, s in sorted(seqs.items()) if len(s) > n)
        warnings.append(f"collectives without a counterpart on every rank ({short}): left out of the matching")

