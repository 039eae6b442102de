"""The dump's walks over memory a hostile target controls: garbage stacks and frame chains, and reads that fail
anywhere, end a walk (bounded, loops cut) and never raise anything but the memory error the dump catches."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.agent.dump import MAX_PY, _py_frames
from aiflame.agent.dump_native import MAX_NATIVE, _Map, _Unwinder
from aiflame.core.errors import TargetGone
from aiflame.core.python_layouts import layout_for


class _Garbage:
    """Memory of 8-byte words drawn by hypothesis, some addresses unreadable; reads past the words wrap."""

    def __init__(self, words: list[int], holes: set[int]) -> None:
        self.words = words or [0]
        self.holes = holes
        self.pid = 1

    def read(self, addr: int, size: int) -> bytes:
        if addr % 97 in self.holes:
            raise TargetGone("unreadable")
        out = b""
        while len(out) < size:
            out += self.words[(addr // 8 + len(out) // 8) % len(self.words)].to_bytes(8, "little")
        return out[:size]

    def u64(self, addr: int) -> int:
        return int.from_bytes(self.read(addr, 8), "little")


_words = st.lists(st.integers(0, (1 << 64) - 1) | st.sampled_from([0, 8, 16, 0x1000, 0x7FFF0000]), max_size=64)
_holes = st.sets(st.integers(0, 96), max_size=20)


@settings(max_examples=200, deadline=None)
@given(_words, _holes, st.sampled_from([(3, 10), (3, 11), (3, 12), (3, 13)]), st.integers(0, (1 << 64) - 1))
def test_python_frame_walk_of_garbage_is_bounded(words: list[int], holes: set[int], version: tuple[int, int],
                                                 tstate: int) -> None:
    lay = layout_for(version)
    assert lay is not None
    try:
        frames = _py_frames(_Garbage(words, holes), tstate, lay)  # type: ignore[arg-type]
    except TargetGone:
        return
    assert len(frames) <= MAX_PY


@settings(max_examples=200, deadline=None)
@given(_words, _holes, st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 64) - 1))
def test_native_unwind_of_garbage_is_bounded(words: list[int], holes: set[int], rip: int, rsp: int, rbp: int) -> None:
    u = _Unwinder.__new__(_Unwinder)  # one mapping of everything, without a CFI table: frame pointers all the way
    u.pid, u.mem, u.errors = 1, _Garbage(words, holes), {}  # type: ignore[assignment]
    u.maps, u._starts = [_Map(0, 1 << 64, 0, "/garbage", tried=True)], [0]
    pcs = u.unwind(rip, rsp, rbp)
    assert 1 <= len(pcs) <= MAX_NATIVE and pcs[0] == rip
