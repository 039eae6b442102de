from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Header(_message.Message):
    __slots__ = ("format_version", "aiflame_version", "host", "kernel", "machine", "frequency_hz", "event", "start_wall_ns", "start_mono_ns", "argv", "target", "meta")
    class MetaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    AIFLAME_VERSION_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_HZ_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    START_WALL_NS_FIELD_NUMBER: _ClassVar[int]
    START_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    aiflame_version: str
    host: str
    kernel: str
    machine: str
    frequency_hz: int
    event: str
    start_wall_ns: int
    start_mono_ns: int
    argv: _containers.RepeatedScalarFieldContainer[str]
    target: str
    meta: _containers.ScalarMap[str, str]
    def __init__(self, format_version: _Optional[int] = ..., aiflame_version: _Optional[str] = ..., host: _Optional[str] = ..., kernel: _Optional[str] = ..., machine: _Optional[str] = ..., frequency_hz: _Optional[int] = ..., event: _Optional[str] = ..., start_wall_ns: _Optional[int] = ..., start_mono_ns: _Optional[int] = ..., argv: _Optional[_Iterable[str]] = ..., target: _Optional[str] = ..., meta: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("time_ns", "pid", "tid", "cpu", "comm", "user", "kern", "user_err", "kern_err", "weight", "py", "py_flags", "unwind", "off_cpu_ns")
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TID_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    COMM_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    KERN_FIELD_NUMBER: _ClassVar[int]
    USER_ERR_FIELD_NUMBER: _ClassVar[int]
    KERN_ERR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PY_FIELD_NUMBER: _ClassVar[int]
    PY_FLAGS_FIELD_NUMBER: _ClassVar[int]
    UNWIND_FIELD_NUMBER: _ClassVar[int]
    OFF_CPU_NS_FIELD_NUMBER: _ClassVar[int]
    time_ns: int
    pid: int
    tid: int
    cpu: int
    comm: str
    user: _containers.RepeatedScalarFieldContainer[int]
    kern: _containers.RepeatedScalarFieldContainer[int]
    user_err: int
    kern_err: int
    weight: int
    py: _containers.RepeatedCompositeFieldContainer[PyFrame]
    py_flags: int
    unwind: int
    off_cpu_ns: int
    def __init__(self, time_ns: _Optional[int] = ..., pid: _Optional[int] = ..., tid: _Optional[int] = ..., cpu: _Optional[int] = ..., comm: _Optional[str] = ..., user: _Optional[_Iterable[int]] = ..., kern: _Optional[_Iterable[int]] = ..., user_err: _Optional[int] = ..., kern_err: _Optional[int] = ..., weight: _Optional[int] = ..., py: _Optional[_Iterable[_Union[PyFrame, _Mapping]]] = ..., py_flags: _Optional[int] = ..., unwind: _Optional[int] = ..., off_cpu_ns: _Optional[int] = ...) -> None: ...

class PyFrame(_message.Message):
    __slots__ = ("code", "instr", "owner", "is_entry")
    CODE_FIELD_NUMBER: _ClassVar[int]
    INSTR_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    IS_ENTRY_FIELD_NUMBER: _ClassVar[int]
    code: int
    instr: int
    owner: int
    is_entry: int
    def __init__(self, code: _Optional[int] = ..., instr: _Optional[int] = ..., owner: _Optional[int] = ..., is_entry: _Optional[int] = ...) -> None: ...

class PyCode(_message.Message):
    __slots__ = ("pid", "addr", "time_ns", "qualname", "filename", "firstlineno", "line_table", "version_major", "version_minor", "first_instr_offset")
    PID_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    QUALNAME_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    FIRSTLINENO_FIELD_NUMBER: _ClassVar[int]
    LINE_TABLE_FIELD_NUMBER: _ClassVar[int]
    VERSION_MAJOR_FIELD_NUMBER: _ClassVar[int]
    VERSION_MINOR_FIELD_NUMBER: _ClassVar[int]
    FIRST_INSTR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    pid: int
    addr: int
    time_ns: int
    qualname: str
    filename: str
    firstlineno: int
    line_table: bytes
    version_major: int
    version_minor: int
    first_instr_offset: int
    def __init__(self, pid: _Optional[int] = ..., addr: _Optional[int] = ..., time_ns: _Optional[int] = ..., qualname: _Optional[str] = ..., filename: _Optional[str] = ..., firstlineno: _Optional[int] = ..., line_table: _Optional[bytes] = ..., version_major: _Optional[int] = ..., version_minor: _Optional[int] = ..., first_instr_offset: _Optional[int] = ...) -> None: ...

class PyRuntime(_message.Message):
    __slots__ = ("pid", "version", "layout_source", "binary")
    PID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    BINARY_FIELD_NUMBER: _ClassVar[int]
    pid: int
    version: str
    layout_source: str
    binary: str
    def __init__(self, pid: _Optional[int] = ..., version: _Optional[str] = ..., layout_source: _Optional[str] = ..., binary: _Optional[str] = ...) -> None: ...

class Mapping(_message.Message):
    __slots__ = ("start", "end", "file_offset", "path", "build_id", "perms")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    FILE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BUILD_ID_FIELD_NUMBER: _ClassVar[int]
    PERMS_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    file_offset: int
    path: str
    build_id: str
    perms: str
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., file_offset: _Optional[int] = ..., path: _Optional[str] = ..., build_id: _Optional[str] = ..., perms: _Optional[str] = ...) -> None: ...

class Process(_message.Message):
    __slots__ = ("pid", "ppid", "comm", "cmdline", "exe", "time_ns", "mappings", "exec_seq")
    PID_FIELD_NUMBER: _ClassVar[int]
    PPID_FIELD_NUMBER: _ClassVar[int]
    COMM_FIELD_NUMBER: _ClassVar[int]
    CMDLINE_FIELD_NUMBER: _ClassVar[int]
    EXE_FIELD_NUMBER: _ClassVar[int]
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    MAPPINGS_FIELD_NUMBER: _ClassVar[int]
    EXEC_SEQ_FIELD_NUMBER: _ClassVar[int]
    pid: int
    ppid: int
    comm: str
    cmdline: _containers.RepeatedScalarFieldContainer[str]
    exe: str
    time_ns: int
    mappings: _containers.RepeatedCompositeFieldContainer[Mapping]
    exec_seq: int
    def __init__(self, pid: _Optional[int] = ..., ppid: _Optional[int] = ..., comm: _Optional[str] = ..., cmdline: _Optional[_Iterable[str]] = ..., exe: _Optional[str] = ..., time_ns: _Optional[int] = ..., mappings: _Optional[_Iterable[_Union[Mapping, _Mapping]]] = ..., exec_seq: _Optional[int] = ...) -> None: ...

class KernelSymbol(_message.Message):
    __slots__ = ("addr", "name")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    addr: int
    name: str
    def __init__(self, addr: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class KernelSymbols(_message.Message):
    __slots__ = ("symbols",)
    SYMBOLS_FIELD_NUMBER: _ClassVar[int]
    symbols: _containers.RepeatedCompositeFieldContainer[KernelSymbol]
    def __init__(self, symbols: _Optional[_Iterable[_Union[KernelSymbol, _Mapping]]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("runtime", "call", "kind", "pid", "tid", "start_ns", "end_ns", "user", "user_err", "py", "py_flags", "args", "strs")
    class ArgsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class StrsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TID_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    USER_ERR_FIELD_NUMBER: _ClassVar[int]
    PY_FIELD_NUMBER: _ClassVar[int]
    PY_FLAGS_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    STRS_FIELD_NUMBER: _ClassVar[int]
    runtime: str
    call: str
    kind: str
    pid: int
    tid: int
    start_ns: int
    end_ns: int
    user: _containers.RepeatedScalarFieldContainer[int]
    user_err: int
    py: _containers.RepeatedCompositeFieldContainer[PyFrame]
    py_flags: int
    args: _containers.ScalarMap[str, int]
    strs: _containers.ScalarMap[str, str]
    def __init__(self, runtime: _Optional[str] = ..., call: _Optional[str] = ..., kind: _Optional[str] = ..., pid: _Optional[int] = ..., tid: _Optional[int] = ..., start_ns: _Optional[int] = ..., end_ns: _Optional[int] = ..., user: _Optional[_Iterable[int]] = ..., user_err: _Optional[int] = ..., py: _Optional[_Iterable[_Union[PyFrame, _Mapping]]] = ..., py_flags: _Optional[int] = ..., args: _Optional[_Mapping[str, int]] = ..., strs: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GpuCode(_message.Message):
    __slots__ = ("digest", "kind", "arch", "origin", "data", "size", "offset")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    digest: str
    kind: str
    arch: int
    origin: str
    data: bytes
    size: int
    offset: int
    def __init__(self, digest: _Optional[str] = ..., kind: _Optional[str] = ..., arch: _Optional[int] = ..., origin: _Optional[str] = ..., data: _Optional[bytes] = ..., size: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class StallSample(_message.Message):
    __slots__ = ("source", "pid", "device", "code", "kernel", "offset", "reason", "count", "correlation_id", "time_ns", "not_issued")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    NOT_ISSUED_FIELD_NUMBER: _ClassVar[int]
    source: str
    pid: int
    device: int
    code: str
    kernel: str
    offset: int
    reason: str
    count: int
    correlation_id: int
    time_ns: int
    not_issued: bool
    def __init__(self, source: _Optional[str] = ..., pid: _Optional[int] = ..., device: _Optional[int] = ..., code: _Optional[str] = ..., kernel: _Optional[str] = ..., offset: _Optional[int] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ..., correlation_id: _Optional[int] = ..., time_ns: _Optional[int] = ..., not_issued: _Optional[bool] = ...) -> None: ...

class StallSamples(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[StallSample]
    def __init__(self, samples: _Optional[_Iterable[_Union[StallSample, _Mapping]]] = ...) -> None: ...

class Stream(_message.Message):
    __slots__ = ("format", "name", "data", "size", "offset")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    format: str
    name: str
    data: bytes
    size: int
    offset: int
    def __init__(self, format: _Optional[str] = ..., name: _Optional[str] = ..., data: _Optional[bytes] = ..., size: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class Footer(_message.Message):
    __slots__ = ("end_wall_ns", "end_mono_ns", "samples", "counters", "stop_reason", "agent_cpu_s")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    END_WALL_NS_FIELD_NUMBER: _ClassVar[int]
    END_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    AGENT_CPU_S_FIELD_NUMBER: _ClassVar[int]
    end_wall_ns: int
    end_mono_ns: int
    samples: int
    counters: _containers.ScalarMap[str, int]
    stop_reason: str
    agent_cpu_s: float
    def __init__(self, end_wall_ns: _Optional[int] = ..., end_mono_ns: _Optional[int] = ..., samples: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ..., stop_reason: _Optional[str] = ..., agent_cpu_s: _Optional[float] = ...) -> None: ...

class Record(_message.Message):
    __slots__ = ("header", "sample", "process", "kernel_symbols", "footer", "py_code", "py_runtime", "event", "gpu_code", "stalls", "stream")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_SYMBOLS_FIELD_NUMBER: _ClassVar[int]
    FOOTER_FIELD_NUMBER: _ClassVar[int]
    PY_CODE_FIELD_NUMBER: _ClassVar[int]
    PY_RUNTIME_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    GPU_CODE_FIELD_NUMBER: _ClassVar[int]
    STALLS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    header: Header
    sample: Sample
    process: Process
    kernel_symbols: KernelSymbols
    footer: Footer
    py_code: PyCode
    py_runtime: PyRuntime
    event: Event
    gpu_code: GpuCode
    stalls: StallSamples
    stream: Stream
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., sample: _Optional[_Union[Sample, _Mapping]] = ..., process: _Optional[_Union[Process, _Mapping]] = ..., kernel_symbols: _Optional[_Union[KernelSymbols, _Mapping]] = ..., footer: _Optional[_Union[Footer, _Mapping]] = ..., py_code: _Optional[_Union[PyCode, _Mapping]] = ..., py_runtime: _Optional[_Union[PyRuntime, _Mapping]] = ..., event: _Optional[_Union[Event, _Mapping]] = ..., gpu_code: _Optional[_Union[GpuCode, _Mapping]] = ..., stalls: _Optional[_Union[StallSamples, _Mapping]] = ..., stream: _Optional[_Union[Stream, _Mapping]] = ...) -> None: ...
