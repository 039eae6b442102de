"""ctypes mirrors of bpf/aiflame.h. Tests compare them with the C: the struct layouts as BCC compiles them
(tests/integration/test_records_layout.py), the constants and enums as the header writes them
(tests/unit/test_records.py). The Python walk's flags (PY_*) are core.raw.PyFlag: symbolization reads them."""

from __future__ import annotations

import ctypes
import enum
import struct
from typing import Any

MAX_STACK = 127
COMM_LEN = 16
MAX_PY_FRAMES = 96
SAMPLE_WORDS = 2 * MAX_STACK + 2 * MAX_PY_FRAMES
MAX_PROBES = 256
PROBE_ARGS = 8
PROBE_DEREFS = 4
PROBE_REGS = 6
CALL_STR = 128
PATH_LEN = 256


class TargetFlag(enum.IntFlag):
    """Values of the sampler's targets map (TARGET_*)."""

    ON = 1  # sample and probe this process
    PY = 2  # it has a Python walker layout in py_procs


class RecKind(enum.IntEnum):
    SAMPLE = 1
    FORK = 2
    EXEC = 3
    EXIT = 4
    CALL = 5
    RET = 6
    OPEN = 7
    OFFCPU = 8
    OFFCPU_END = 9


class ProbeFlag(enum.IntFlag):
    STACK = 1
    STR = 2
    OUT = 4
    STOP = 8
    REGS = 16
    RET = 32
    SAMPLE = 64
    IF_OPENED = 128


class Counter(enum.IntEnum):
    """Indexes of the per-CPU counter array (enum aiflame_counter)."""

    SAMPLES = 0
    LOST = 1
    USTACK_ERR = 2
    KSTACK_ERR = 3
    PROC_LOST = 4
    TARGETS_FULL = 5
    PY_TRUNCATED = 6
    PY_READ_ERR = 7
    CALL_LOST = 8
    OPEN_LOST = 9
    UW_TAILCALL_FAIL = 10
    STOPS_UNRECORDED = 11
    CALL_SKIPPED = 12
    OFFCPU = 13
    OFFCPU_LOST = 14


COUNTER_SLOTS = 15


# The head every record starts with (struct sample_rec, proc_rec, call_rec, ret_rec, open_rec, offcpu_end_rec).
_HEAD = [
    ("kind", ctypes.c_uint32),
    ("cpu", ctypes.c_uint32),
    ("time_ns", ctypes.c_uint64),
    ("pid", ctypes.c_uint32),
]


class PyProcRec(ctypes.Structure):
    _fields_ = [
        ("runtime", ctypes.c_uint64),
        ("version", ctypes.c_uint32),
        ("tid_offset", ctypes.c_int32),
        ("runtime_interp_head", ctypes.c_int32),
        ("interp_tstate_head", ctypes.c_int32),
        ("tstate_next", ctypes.c_int32),
        ("tstate_thread_id", ctypes.c_int32),
        ("tstate_native_thread_id", ctypes.c_int32),
        ("tstate_frame", ctypes.c_int32),
        ("cframe_current_frame", ctypes.c_int32),
        ("frame_code", ctypes.c_int32),
        ("frame_back", ctypes.c_int32),
        ("frame_instr", ctypes.c_int32),
        ("frame_owner", ctypes.c_int32),
        ("frame_is_entry", ctypes.c_int32),
        ("frame_read", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class SampleRec(ctypes.Structure):
    _fields_ = [
        *_HEAD,
        ("tid", ctypes.c_uint32),
        ("user_len", ctypes.c_int32),
        ("kern_len", ctypes.c_int32),
        ("comm", ctypes.c_char * COMM_LEN),
        ("py_count", ctypes.c_uint32),
        ("py_flags", ctypes.c_uint32),
        ("unwind", ctypes.c_uint32),  # UW_STOP_* | UW_USED_FP (bpf/unwind.h); 0: frame pointers by the kernel
        ("pad", ctypes.c_uint32),
        ("data", ctypes.c_uint64 * SAMPLE_WORDS),  # packed: user, kernel, then 2 words per Python frame
    ]


class OffCpuEndRec(ctypes.Structure):
    _fields_ = [
        *_HEAD,
        ("tid", ctypes.c_uint32),
        ("out_ns", ctypes.c_uint64),
    ]


class ProcRec(ctypes.Structure):
    _fields_ = [
        *_HEAD,
        ("child", ctypes.c_uint32),
        ("comm", ctypes.c_char * COMM_LEN),
    ]


class ProbeSpecRec(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint32),
        ("src", ctypes.c_int16 * PROBE_DEREFS),
        ("off", ctypes.c_int32 * PROBE_DEREFS),
        ("str_src", ctypes.c_int16),
        ("out_arg", ctypes.c_int16),
        ("regs", ctypes.c_int16 * PROBE_REGS),
        ("sample_arg", ctypes.c_int16),
        ("pad", ctypes.c_int16),
    ]


class CallRec(ctypes.Structure):
    _fields_ = [
        *_HEAD,
        ("tid", ctypes.c_uint32),
        ("probe", ctypes.c_uint32),
        ("user_len", ctypes.c_int32),
        ("args", ctypes.c_uint64 * PROBE_ARGS),
        ("deref", ctypes.c_uint64 * PROBE_DEREFS),
        ("deref_ok", ctypes.c_uint32),
        ("py_count", ctypes.c_uint32),
        ("py_flags", ctypes.c_uint32),
        ("str_len", ctypes.c_int32),
        ("calls", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("str", ctypes.c_char * CALL_STR),
        ("data", ctypes.c_uint64 * SAMPLE_WORDS),  # packed: user stack, then 2 words per Python frame
    ]


class RetRec(ctypes.Structure):
    _fields_ = [
        *_HEAD,
        ("tid", ctypes.c_uint32),
        ("probe", ctypes.c_uint32),
        ("out_ok", ctypes.c_uint32),
        ("ret", ctypes.c_uint64),
        ("out", ctypes.c_uint64),
    ]


class OpenRec(ctypes.Structure):
    _fields_ = [
        *_HEAD,
        ("tid", ctypes.c_uint32),
        ("path", ctypes.c_char * PATH_LEN),
    ]


_CODES: dict[Any, str] = {ctypes.c_uint8: "B", ctypes.c_int16: "h", ctypes.c_uint16: "H", ctypes.c_int32: "i",
                          ctypes.c_uint32: "I", ctypes.c_int64: "q", ctypes.c_uint64: "Q"}


def unpacker(cls: type[ctypes.Structure], upto: str | None = None) -> struct.Struct:
    """A little-endian struct.Struct reading `cls`'s fields in order (arrays as their elements, char arrays as
    bytes), up to the field `upto` (excluded): the decoder's formats come from these layouts, not a copy of them."""
    fmt, at = "<", 0
    types: dict[str, Any] = {f[0]: f[1] for f in cls._fields_}
    for name, ctype in types.items():
        if name == upto:
            break
        field = getattr(cls, name)
        if field.offset > at:
            fmt += f"{field.offset - at}x"
        if issubclass(ctype, ctypes.Array):
            code = "s" if ctype._type_ is ctypes.c_char else _CODES[ctype._type_]
            fmt += f"{ctype._length_}{code}"
        else:
            fmt += _CODES[ctype]
        at = field.offset + field.size
    else:
        if ctypes.sizeof(cls) > at:
            fmt += f"{ctypes.sizeof(cls) - at}x"
    return struct.Struct(fmt)
