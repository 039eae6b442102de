"""The modules a CPU sample crosses from its ring-buffer record to the folded file (issue #27's target: at most 10,
and no layer re-entered once left), measured on the real functions (tests/sample_path.py; docs/paths.md has the
path and what would shorten it). A ratchet: the path may lose modules and re-entries, never gain them; a change
that moves the path along updates both lists here and docs/paths.md."""

from __future__ import annotations

from aiflame.agent.kernel.records import RecKind
from tests import sample_path
from tests.sample_path import layer_of, layers_reentered, modules, trace_cpu_sample, trace_stall_samples

# The modules handed the sample (or what holds it) by a call, today; the ring buffer's consumer
# (agent/kernel/ringbuf.py), where its bytes come from, before them.
CROSSED = {
    "agent/kernel/sampler.py", "agent/kernel/decode.py", "agent/pipeline.py", "core/capture.py",
    "symbolize/stacks.py", "symbolize/road.py", "symbolize/views.py", "exporters/write.py",
    "exporters/base.py", "exporters/folded.py",
}
# No layer is re-entered: the road's composer and the views are in symbolize, the writer alone in exporters
# (exporters/road.py made the views between symbolizing and writing until session 13): see docs/paths.md.
REENTERED: set[str] = set()


def test_a_cpu_sample_crosses_no_more_modules_than_it_did() -> None:
    assert sample_path._SAMPLE_KIND == RecKind.SAMPLE
    path, folded = trace_cpu_sample()
    calls = modules(path, calls_only=True)
    assert folded.startswith("sleep;") and folded.endswith(" 1\n") and folded.count("\n") == 1, folded
    # followed the whole way: from the record callback to the folded exporter
    assert calls[:3] == ["agent/kernel/sampler.py", "agent/kernel/decode.py", "agent/pipeline.py"], calls
    assert {"core/capture.py", "symbolize/stacks.py", "exporters/folded.py"} <= set(calls), calls
    assert set(calls) <= CROSSED, f"new on the path: {sorted(set(calls) - CROSSED)}"
    assert len(set(calls)) <= 10, calls  # issue #27's target
    assert set(layers_reentered(calls)) <= REENTERED, calls
    # Calls and returns alike: once the sample has left the agent it never comes back.
    layers = [layer_of(m) for m in modules(path)]
    assert "agent" not in layers[layers.index("core"):], layers


# The modules handed a CUPTI stream's stall samples (or what holds them) by a call, from the live collector on
# (session 14: the collector stores the stream as it is and the road converts it; before, the collector called the
# converter in symbolize and wrote what it returned, re-entering agent/).
STALL_CROSSED = {
    "core/capture.py", "symbolize/vendor/cupti_stream.py", "symbolize/stacks.py", "symbolize/road.py",
    "symbolize/views.py", "symbolize/stalls.py", "exporters/write.py", "exporters/base.py", "exporters/folded.py",
}


def test_a_stall_sample_goes_down_the_road_like_a_cpu_sample() -> None:
    """A small stream (one kernel, three reasons, no launch stack) rather than the example's 6,000 samples:
    `python -m tests.sample_path --stalls` traces that one in minutes and finds the same modules."""
    from aiflame.core.capture import new_header
    from aiflame.core.raw import Capture, CaptureFooter
    from tests.unit.test_cupti_stream import _not_issued_stream

    cap = Capture(new_header(99, "cpu-clock", ("aiflame",), "test", {}), footer=CaptureFooter())
    path, folded = trace_stall_samples(cap, _not_issued_stream([(0, 10), (1, 7), (2, 5), (3, 4), (4, 4)]))
    assert sum(int(ln.rsplit(" ", 1)[1]) for ln in folded.splitlines()) == 19, folded
    held = modules(path)
    # from the collector that stores the stream to the folded exporter; the agent is not come back to
    assert held[:3] == ["core/safe_files.py", "agent/accel/cupti.py", "core/capture.py"], held
    calls = modules(path, calls_only=True)
    assert {"symbolize/vendor/cupti_stream.py", "symbolize/stalls.py", "exporters/folded.py"} <= set(calls), calls
    assert set(calls) <= STALL_CROSSED, f"new on the path: {sorted(set(calls) - STALL_CROSSED)}"
    assert len(set(calls) | {"agent/accel/cupti.py"}) <= 10 and layers_reentered(calls) == [], calls
    layers = [layer_of(m) for m in held]
    assert "agent" not in layers[layers.index("symbolize"):], layers
