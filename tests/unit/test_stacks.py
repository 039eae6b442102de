"""Raw user stacks into model stacks: a frame-pointer chain that broke (an address in no executable mapping)
ends in one `[unknown]` frame instead of the garbage the walk read beyond it."""

from __future__ import annotations

import shutil

from aiflame.core.model import FrameKind
from aiflame.core.raw import Capture, CaptureFooter, CaptureHeader, Mapping, ProcessSnapshot, RawSample
from aiflame.symbolize.stacks import StackOptions, symbolize_capture

TRUE = shutil.which("true") or "/bin/true"
TEXT = Mapping(0x400000, 0x410000, 0, TRUE)


def _profile(user: tuple[int, ...]) -> list[tuple[str, FrameKind, str]]:
    cap = Capture(CaptureHeader(1, target="test"))
    cap.processes = [ProcessSnapshot(7, 1, [TEXT], comm="t")]
    cap.samples = [RawSample(5, 7, 7, 0, "t", user, ())]
    cap.footer = CaptureFooter()
    prof = symbolize_capture(cap, options=StackOptions(group="none", kernel=False))
    (sample,) = prof.samples
    return [(f.name, f.kind, f.module) for f in sample.stack]


def test_mapped_chain_is_kept_whole() -> None:
    stack = _profile((0x401000, 0x402000, 0x403000))  # leaf first
    assert len(stack) == 3 and all(module == "true" for _, _, module in stack)


def test_chain_that_leaves_the_mappings_ends_in_one_unknown() -> None:
    # leaf, its caller, then garbage: an unmapped address, and beyond it values that happen to be mapped
    stack = _profile((0x401000, 0x402000, 0x7F0000001234, 0x405000, 0x9999, 0x406000))
    assert stack[0] == ("[unknown]", FrameKind.UNKNOWN, "")
    assert [module for _, _, module in stack[1:]] == ["true", "true"]
    assert len(stack) == 3


def test_unmapped_leaf_is_one_unknown() -> None:
    assert _profile((0x10, 0x20, 0x30)) == [("[unknown]", FrameKind.UNKNOWN, "")]
