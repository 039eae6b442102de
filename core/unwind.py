"""How the BPF unwinder ended a user-stack walk: the reason codes of bpf/unwind.h (UW_STOP_*, UW_USED_FP) as
samples carry them (RawSample.unwind), with the names the summary and `doctor` print. A test keeps them equal
to the C header."""

from __future__ import annotations

STOP_MASK = 0xFF
USED_FP = 0x100  # at least one frame of the walk was found by frame pointer
USED_SCAN = 0x200  # at least one frame was found by scanning the stack past code without CFI
END = 1  # the outermost frame: a clean end

# code -> (counter key, what a user reads)
STOPS: dict[int, tuple[str, str]] = {
    1: ("end", "reached the outermost frame"),
    2: ("no_mapping", "address outside every file mapping (JIT, anonymous code, vdso)"),
    3: ("not_covered", "address not covered by the file's CFI, no frame pointer"),
    4: ("unsupported", "CFA rule the unwinder cannot follow, no frame pointer"),
    5: ("read_fault", "stack read failed"),
    6: ("depth", "depth limit (127 frames, or the walk's 31 tail calls spent)"),
    7: ("fp_end", "frame-pointer chain ended (file without CFI table)"),
    8: ("evicted", "the file's table was evicted from the BPF pool"),
}


def stop_of(unwind: int) -> int:
    """The UW_STOP_* code of a sample's `unwind` value (0: not walked by the CFI unwinder)."""
    return unwind & STOP_MASK
