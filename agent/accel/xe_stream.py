"""The Intel Xe EU stall stream, opened by the agent itself: find `xe` DRM devices, query EU stall support, open
the device-wide stream on the main GT with DRM_IOCTL_XE_OBSERVATION, read records on a thread and hand them to
`symbolize/vendor/xe_eu_stall.py`, which alone knows the record format. No target restart: the stream sees every
process's kernels on that GT (samples carry pid 0 until IPs are mapped to kernels from Level Zero launch
information).

uapi (include/uapi/drm/xe_drm.h, Linux >= 6.15); every struct is packed here with explicit offsets, and a test
compiles a C check of these numbers against the header where one is installed:

    drm_xe_device_query      u64 extensions, u32 query, u32 size, u64 data, u64 reserved[2]          40 bytes
    drm_xe_query_gt_list     u32 num_gt, u32 pad, drm_xe_gt[]                                         8 + n x 96
    drm_xe_gt                u16 type, tile_id, gt_id, pad[3]; u32 reference_clock; u64 near, far;
                             u16 ip_ver_major, ip_ver_minor, ip_ver_rev, pad2; u64 reserved[7]       96 bytes
    drm_xe_query_eu_stall    u64 extensions, capabilities, record_size, per_xecore_buf_size,
                             reserved[5], num_sampling_rates, sampling_rates[]                        80 + n x 8
    drm_xe_ext_set_property  u64 next_extension, u32 name, u32 pad, u32 property, u32 pad, u64 value,
                             u64 reserved[2]                                                          48 bytes
    drm_xe_observation_param u64 extensions, observation_type, observation_op, param                 32 bytes
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import select
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from aiflame.core.errors import BadInput, HostError
from aiflame.core.raw import RawStallSample
from aiflame.symbolize.vendor.xe_eu_stall import RECORD_SIZE, XeLayout, layout_for, parse_records

__all__ = ["EuStallInfo", "XeDevice", "XeEuStall", "XeGt", "find_xe_devices"]

# ioctl numbers: _IOC(dir, type, nr, size) = dir << 30 | size << 16 | type << 8 | nr
_IOC_WRITE, _IOC_READ = 1, 2


def _ioc(direction: int, kind: str, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (ord(kind) << 8) | nr


DRM_COMMAND_BASE = 0x40
DRM_XE_DEVICE_QUERY = 0x00
DRM_XE_OBSERVATION = 0x0B
DEVICE_QUERY = struct.Struct("<QIIQ2Q")
GT_LIST_HEADER = struct.Struct("<II")
GT = struct.Struct("<HHH6xIQQHHHH56x")
EU_STALL_HEADER = struct.Struct("<QQQQ5QQ")
SET_PROPERTY = struct.Struct("<QIIIIQ2Q")
OBSERVATION_PARAM = struct.Struct("<QQQQ")

DRM_IOCTL_XE_DEVICE_QUERY = _ioc(_IOC_READ | _IOC_WRITE, "d", DRM_COMMAND_BASE + DRM_XE_DEVICE_QUERY, DEVICE_QUERY.size)
DRM_IOCTL_XE_OBSERVATION = _ioc(_IOC_WRITE, "d", DRM_COMMAND_BASE + DRM_XE_OBSERVATION, OBSERVATION_PARAM.size)
DRM_XE_OBSERVATION_IOCTL_ENABLE = _ioc(0, "i", 0x0, 0)
DRM_XE_OBSERVATION_IOCTL_DISABLE = _ioc(0, "i", 0x1, 0)

DRM_XE_DEVICE_QUERY_GT_LIST = 3
DRM_XE_DEVICE_QUERY_EU_STALL = 10
DRM_XE_QUERY_GT_TYPE_MAIN = 0
DRM_XE_OBSERVATION_TYPE_EU_STALL = 1
DRM_XE_OBSERVATION_OP_STREAM_OPEN = 0
DRM_XE_EU_STALL_EXTENSION_SET_PROPERTY = 0
DRM_XE_EU_STALL_PROP_GT_ID = 1
DRM_XE_EU_STALL_PROP_SAMPLE_RATE = 2
DRM_XE_EU_STALL_PROP_WAIT_NUM_REPORTS = 3


@dataclass(frozen=True)
class XeDevice:
    """An `xe`-driven GPU: its render node and PCI address."""

    render_node: Path
    pci: str
    ordinal: int  # position among this host's xe devices, used as the samples' device number


@dataclass(frozen=True)
class XeGt:
    type: int
    tile_id: int
    gt_id: int
    ip_version: tuple[int, int]


@dataclass(frozen=True)
class EuStallInfo:
    capabilities: int
    record_size: int
    per_xecore_buf_size: int
    sampling_rates: tuple[int, ...]  # GPU cycles, fastest first


def find_xe_devices(sysfs: Path = Path("/sys/class/drm"), dev: Path = Path("/dev/dri")) -> list[XeDevice]:
    """Render nodes whose kernel driver is `xe`, in node order."""
    found: list[XeDevice] = []
    for node in sorted(sysfs.glob("renderD*"), key=lambda p: int(p.name[7:]) if p.name[7:].isdigit() else 0):
        try:
            driver = os.path.basename(os.readlink(node / "device" / "driver"))
        except OSError:
            continue
        if driver == "xe":
            pci = os.path.basename(os.path.realpath(node / "device"))
            found.append(XeDevice(dev / node.name, pci, len(found)))
    return found


def pack_device_query(query: int, size: int, data: int) -> bytes:
    return DEVICE_QUERY.pack(0, query, size, data, 0, 0)


def parse_gt_list(data: bytes) -> list[XeGt]:
    if len(data) < GT_LIST_HEADER.size:
        raise HostError(f"GT list query returned {len(data)} bytes")
    n, _ = GT_LIST_HEADER.unpack_from(data, 0)
    if GT_LIST_HEADER.size + n * GT.size > len(data):
        raise HostError(f"GT list query claims {n} GTs in {len(data)} bytes")
    out = []
    for i in range(n):
        gtype, tile, gt_id, _clock, _near, _far, major, minor, _rev, _pad = GT.unpack_from(
            data, GT_LIST_HEADER.size + i * GT.size)
        out.append(XeGt(gtype, tile, gt_id, (major, minor)))
    return out


def parse_eu_stall_info(data: bytes) -> EuStallInfo:
    if len(data) < EU_STALL_HEADER.size:
        raise HostError(f"EU stall query returned {len(data)} bytes")
    _ext, caps, record_size, buf_size, *_reserved, n = EU_STALL_HEADER.unpack_from(data, 0)
    if EU_STALL_HEADER.size + 8 * n > len(data):
        raise HostError(f"EU stall query claims {n} sampling rates in {len(data)} bytes")
    rates = struct.unpack_from(f"<{n}Q", data, EU_STALL_HEADER.size)
    return EuStallInfo(caps, record_size, buf_size, tuple(rates))


def pack_properties(props: list[tuple[int, int]]) -> tuple[ctypes.Array[ctypes.c_char], int]:
    """The chain of drm_xe_ext_set_property for STREAM_OPEN, in one buffer (kept alive by the caller), and the
    address of its first link."""
    buf = ctypes.create_string_buffer(SET_PROPERTY.size * len(props))
    base = ctypes.addressof(buf)
    for i, (prop, value) in enumerate(props):
        nxt = base + (i + 1) * SET_PROPERTY.size if i + 1 < len(props) else 0
        SET_PROPERTY.pack_into(buf, i * SET_PROPERTY.size, nxt, DRM_XE_EU_STALL_EXTENSION_SET_PROPERTY, 0, prop, 0,
                               value, 0, 0)
    return buf, base


def _query(fd: int, query: int) -> bytes:
    """A DRM_IOCTL_XE_DEVICE_QUERY: ask the size, then the data."""
    arg = bytearray(pack_device_query(query, 0, 0))
    fcntl.ioctl(fd, DRM_IOCTL_XE_DEVICE_QUERY, arg)
    size = DEVICE_QUERY.unpack(arg)[2]
    data = ctypes.create_string_buffer(size)
    arg = bytearray(pack_device_query(query, size, ctypes.addressof(data)))
    fcntl.ioctl(fd, DRM_IOCTL_XE_DEVICE_QUERY, arg)
    return data.raw


def explain_open_error(e: OSError, what: str) -> str:
    """One line saying why the EU stall stream could not be opened."""
    if e.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
        return f"{what}: the xe driver has no EU stall sampling (needs Linux >= 6.15; PVC or Xe2 and later)"
    if e.errno == errno.ENODEV:
        return f"{what}: EU stall sampling is not supported on this device (e.g. an SR-IOV virtual function)"
    if e.errno in (errno.EACCES, errno.EPERM):
        return (f"{what}: not allowed to open the EU stall stream (run as root, or CAP_PERFMON, or "
                "sysctl dev.xe.observation_paranoid=0)")
    if e.errno == errno.EBUSY:
        return f"{what}: the EU stall stream is already open (another profiler is sampling this GPU)"
    return f"{what}: cannot open the EU stall stream: {os.strerror(e.errno or 0)}"


def open_stream(fd: int, gt_id: int, sample_rate: int, wait_reports: int = 1) -> int:
    """DRM_IOCTL_XE_OBSERVATION(EU_STALL, STREAM_OPEN) on an open render node; the stream's fd (not enabled)."""
    props, first = pack_properties([(DRM_XE_EU_STALL_PROP_GT_ID, gt_id),
                                    (DRM_XE_EU_STALL_PROP_SAMPLE_RATE, sample_rate),
                                    (DRM_XE_EU_STALL_PROP_WAIT_NUM_REPORTS, wait_reports)])
    param = bytearray(OBSERVATION_PARAM.pack(0, DRM_XE_OBSERVATION_TYPE_EU_STALL, DRM_XE_OBSERVATION_OP_STREAM_OPEN,
                                             first))
    stream = fcntl.ioctl(fd, DRM_IOCTL_XE_OBSERVATION, param)
    del props  # the kernel has copied the chain
    return int(stream)


@dataclass
class XeEuStall:
    """One device's EU stall stream for the length of a capture: `start`, then `stop` for the samples."""

    device: XeDevice
    rate_index: int = 3  # into the query's sampling rates, fastest first: the 4th is 251 x 4 cycles, the default
    samples: list[RawStallSample] = field(default_factory=list)
    counters: Counter[str] = field(default_factory=Counter)
    warnings: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._drm = -1
        self._stream = -1
        self._layout: XeLayout | None = None
        self._record_size = RECORD_SIZE
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Open and enable the stream; HostError with one line when this device cannot be sampled."""
        what = f"{self.device.render_node} ({self.device.pci})"
        try:
            self._drm = os.open(self.device.render_node, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise HostError(f"{what}: cannot open: {e.strerror}") from None
        try:
            try:
                info = parse_eu_stall_info(_query(self._drm, DRM_XE_DEVICE_QUERY_EU_STALL))
                gts = parse_gt_list(_query(self._drm, DRM_XE_DEVICE_QUERY_GT_LIST))
            except OSError as e:
                raise HostError(explain_open_error(e, what)) from None
            main = next((g for g in gts if g.type == DRM_XE_QUERY_GT_TYPE_MAIN), None)
            if main is None:
                raise HostError(f"{what}: no main GT in the device's GT list")
            try:
                self._layout = layout_for(main.ip_version)
            except BadInput as e:  # a platform the stall format does not know: this host's, so unsupported here
                raise HostError(f"{what}: {e}") from None
            if not info.sampling_rates:
                raise HostError(f"{what}: the driver lists no EU stall sampling rates")
            self._record_size = info.record_size or RECORD_SIZE
            rate = info.sampling_rates[min(self.rate_index, len(info.sampling_rates) - 1)]
            try:
                self._stream = open_stream(self._drm, main.gt_id, rate)
                fcntl.ioctl(self._stream, DRM_XE_OBSERVATION_IOCTL_ENABLE, 0)
            except OSError as e:
                raise HostError(explain_open_error(e, what)) from None
            os.set_blocking(self._stream, False)
        except BaseException:
            self._close()
            raise
        self._thread = threading.Thread(target=self._read_loop, name="xe-eu-stall", daemon=True)
        self._thread.start()

    def _read_loop(self) -> None:
        poller = select.poll()
        poller.register(self._stream, select.POLLIN)
        chunk = self._record_size * 4096
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            if not self._read_once(chunk):
                return

    def _read_once(self, chunk: int) -> bool:
        """Read what is there; False when the stream is gone."""
        try:
            data = os.read(self._stream, chunk)
        except BlockingIOError:
            return True
        except OSError as e:
            if e.errno == errno.EIO:  # the hardware dropped data (its buffer was full): counted, reading goes on
                self.counters["xe_hw_drops"] += 1
                return True
            self.warnings.append(f"{self.device.render_node}: EU stall stream ended: {os.strerror(e.errno or 0)}"
                                 + (" (GPU reset)" if e.errno == errno.ENODEV else ""))
            return False
        if data:
            assert self._layout is not None
            parsed = parse_records(data, self._layout, record_size=self._record_size, device=self.device.ordinal,
                                   time_ns=time.clock_gettime_ns(time.CLOCK_MONOTONIC))
            with self._lock:
                self.samples.extend(parsed.samples)
                self.counters.update(parsed.counters())
        return True

    def take(self) -> list[RawStallSample]:
        """Samples read so far (the caller stores them; they are not kept here)."""
        with self._lock:
            out, self.samples = self.samples, []
        return out

    def stop(self) -> list[RawStallSample]:
        """Disable, read what is left, close; the samples not yet taken."""
        self._stop.set()
        if self._thread:
            self._thread.join()
        if self._stream >= 0:
            try:
                fcntl.ioctl(self._stream, DRM_XE_OBSERVATION_IOCTL_DISABLE, 0)
            except OSError:
                pass
            for _ in range(1024):  # what the hardware flushed at disable
                if not self._has_data() or not self._read_once(self._record_size * 4096):
                    break
        self._close()
        return self.take()

    def _has_data(self) -> bool:
        return bool(select.select([self._stream], [], [], 0)[0])

    def _close(self) -> None:
        for fd in (self._stream, self._drm):
            if fd >= 0:
                os.close(fd)
        self._stream = self._drm = -1


def start_all(rate_index: int = 3) -> tuple[list[XeEuStall], list[str]]:
    """Open a stream on every xe device; the ones running, and one line per device (or for none) that is not."""
    devices = find_xe_devices()
    if not devices:
        return [], ["Intel EU stall sampling: no Intel GPU with the xe driver on this host"]
    running, problems = [], []
    for d in devices:
        s = XeEuStall(d, rate_index)
        try:
            s.start()
        except HostError as e:
            problems.append(f"Intel EU stall sampling off: {e}")
            continue
        running.append(s)
    return running, problems
