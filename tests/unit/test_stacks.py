"""Raw user stacks into model stacks: a frame-pointer chain that broke (an address in no executable mapping)
ends in one `[unwind stopped]` frame instead of the garbage the walk read beyond it; addresses in mappings of no
file are `[anon]` (or the kernel's name for the mapping)."""

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
    # Oracle: by construction — every address inside /bin/true's text mapping
    stack = _profile((0x401000, 0x402000, 0x403000))  # leaf first
    assert len(stack) == 3 and all(module == "true" for _, _, module in stack)


def test_chain_that_leaves_the_mappings_ends_in_one_marker() -> None:
    # Oracle: by construction — an unmapped address third in the chain
    # leaf, its caller, then garbage: an unmapped address, and beyond it values that happen to be mapped
    stack = _profile((0x401000, 0x402000, 0x7F0000001234, 0x405000, 0x9999, 0x406000))
    assert stack[0] == ("[unwind stopped]", FrameKind.UNKNOWN, "")
    assert [module for _, _, module in stack[1:]] == ["true", "true"]
    assert len(stack) == 3


def test_unmapped_leaf_is_one_marker() -> None:
    # Oracle: by construction — no address mapped
    assert _profile((0x10, 0x20, 0x30)) == [("[unwind stopped]", FrameKind.UNKNOWN, "")]


def test_fileless_mappings_are_named_by_kind() -> None:
    # Oracle: by construction — anonymous, [vdso] and [anon:jit] mappings built here
    maps = [TEXT, Mapping(0x500000, 0x501000, 0, ""), Mapping(0x600000, 0x601000, 0, "[vdso]"),
            Mapping(0x700000, 0x701000, 0, "[anon:jit]")]
    cap = Capture(CaptureHeader(1, target="test"))
    cap.processes = [ProcessSnapshot(7, 1, maps, comm="t")]
    cap.samples = [RawSample(5, 7, 7, 0, "t", (0x600010, 0x700010, 0x500010, 0x401000), ())]
    prof = symbolize_capture(cap, options=StackOptions(group="none", kernel=False))
    names = [f.name for f in prof.samples[0].stack]
    assert names[1:] == ["[anon]", "[anon:jit]", "[vdso]"]
    assert names[0] != "[unknown]"  # a symbol, or module+0xOFFSET: never a bare [unknown]
