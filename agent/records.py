"""ctypes mirrors of bpf/aiflame.h. A test compares them with the layouts BCC reads from the C header."""

from __future__ import annotations

import ctypes
import enum

MAX_STACK = 127
COMM_LEN = 16


class RecKind(enum.IntEnum):
    SAMPLE = 1
    FORK = 2
    EXEC = 3
    EXIT = 4


class Counter(enum.IntEnum):
    """Indexes of the per-CPU counter array (enum aiflame_counter)."""

    SAMPLES = 0
    LOST = 1
    USTACK_ERR = 2
    KSTACK_ERR = 3
    PROC_LOST = 4
    TARGETS_FULL = 5


COUNTER_SLOTS = 8


class SampleRec(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("time_ns", ctypes.c_uint64),
        ("pid", ctypes.c_uint32),
        ("tid", ctypes.c_uint32),
        ("user_len", ctypes.c_int32),
        ("kern_len", ctypes.c_int32),
        ("comm", ctypes.c_char * COMM_LEN),
        ("user", ctypes.c_uint64 * MAX_STACK),
        ("kern", ctypes.c_uint64 * MAX_STACK),
    ]


class ProcRec(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("time_ns", ctypes.c_uint64),
        ("pid", ctypes.c_uint32),
        ("child", ctypes.c_uint32),
        ("comm", ctypes.c_char * COMM_LEN),
    ]
