"""`top`'s view: functions ranked by self and total samples as py-spy top ranks them (self: the leaf; total:
anywhere in the stack, once per sample, recursion included), and the leaf shown whole at 80 columns."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from aiflame.agent.daemon.top import render, view_of
from aiflame.core.model import Frame, FrameKind, Profile, Sample


def _py(name: str) -> Frame:
    return Frame(name, FrameKind.PYTHON, "train.py", "/srv/job/train.py", 10)


def test_functions_by_self_and_total() -> None:
    # Oracle: py-spy top's ranking rules (self: the leaf; total: once per sample); counts by construction
    main, step, fwd, load = _py("main"), _py("step"), _py("forward"), _py("load_batch")
    memcpy = Frame("__memmove_avx_unaligned_erms", FrameKind.NATIVE, "libc.so.6")
    prof = Profile(samples=[
        Sample((main, step, fwd), 50), Sample((main, step, fwd, fwd), 10),  # recursion counts once in total
        Sample((main, load, memcpy), 30), Sample((main, step), 10),
        Sample((Frame("other", FrameKind.NATIVE, "x"),), 7, pid=2),
    ])
    v = view_of(prof, "test", pid=0)
    assert v.samples == 100
    got = {name: (own, tot) for own, tot, name in v.functions}
    assert got == {"forward (train.py)": (60, 60), "__memmove_avx_unaligned_erms (libc.so.6)": (30, 30),
                   "step (train.py)": (10, 70), "main (train.py)": (0, 100), "load_batch (train.py)": (0, 30)}
    assert [n for _, _, n in v.functions][:3] == ["forward (train.py)", "__memmove_avx_unaligned_erms (libc.so.6)",
                                                  "step (train.py)"]
    assert v.stacks[0] == (50, "forward (train.py)", "step (train.py) ← main (train.py)")


def test_the_leaf_is_never_cut_at_80_columns() -> None:
    leaf = "torch::autograd::engine::evaluate_function_with_a_very_long_templated_name<float, 3ul>::operator()"
    callers = tuple(Frame(f"caller_number_{i}_with_a_long_name", FrameKind.NATIVE, "libtorch.so") for i in range(8))
    prof = Profile(samples=[Sample((*callers, Frame(leaf, FrameKind.NATIVE_CPP, "libtorch.so")), 3)])
    console = Console(width=80, record=True, force_terminal=False)
    console.print(render(view_of(prof, "test")))
    shown = console.export_text()
    # the leaf column's cells of the stacks table (the third column), its wrapped lines joined
    rows = [ln.split("│") for ln in shown[shown.index("hottest stacks"):].splitlines() if ln.count("│") == 5]
    cell = "".join("".join(r[3].split()) for r in rows)
    assert cell == "".join(leaf.split()) + "(libtorch.so)", shown


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6), st.integers(1, 50)),
                max_size=20))
def test_self_and_total_invariants(stacks: list[tuple[list[str], int]]) -> None:
    # Oracle: py-spy top's rules, worked out here for each random profile
    prof = Profile(samples=[Sample(tuple(Frame(n, FrameKind.NATIVE) for n in names), w) for names, w in stacks])
    v = view_of(prof, "test", top=100)
    assert sum(own for own, _, _ in v.functions) == v.samples  # every sample's leaf counted once
    for own, tot, name in v.functions:
        assert 0 <= own <= tot <= v.samples
        assert tot == sum(w for names, w in stacks if name in names)
    owns = [own for own, _, _ in v.functions]
    assert owns == sorted(owns, reverse=True)
