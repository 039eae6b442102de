"""Intel Xe EU stall sampling records (upstream `xe` driver, Linux >= 6.15), and their IPs mapped to kernels.

A read() of the device-wide stream returns whole records (64 bytes on PVC and Xe2) from every XeCore. The low
bytes of a record are one little-endian bit field (fields cross 64-bit words), per platform:

    PVC   ip[0:29] active[29:37] other[37:45] control[45:53] pipestall[53:61] send[61:69] dist_acc[69:77]
          sbid[77:85] sync[85:93] inst_fetch[93:101]
    Xe2   as PVC with tdr at [29:37]; active[101:109] ex_id[109:112] end_flag[112]
    Xe3p  ip[0:61], the Xe2 fields 32 bits higher: active[133:141] ex_id[141:144] end_flag[144]

Each 8-bit field counts the samples of that stall reason at the IP. The IP is in units of 8 bytes from the
instruction base address (IBA): VA = (ip << 3) + IBA, and a kernel's offset = VA - the kernel's start VA, which
Level Zero launch information supplies (`XeKernel`). Parsing never raises on record contents: records with bits
set where the platform has none are foreign and counted, never guessed at.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace

from aiflame.core.errors import BadInput
from aiflame.core.raw import RawEvent, RawStallSample

__all__ = [
    "LAYOUTS",
    "RECORD_SIZE",
    "XeKernel",
    "XeLayout",
    "XeParse",
    "layout_for",
    "map_ips",
    "parse_records",
    "xe_kernels_from_events",
]

RECORD_SIZE = 64  # bytes per record on PVC and Xe2, when the driver does not say


@dataclass(frozen=True)
class XeLayout:
    """Bit positions of one platform's record: `fields` are (reason, low bit), each 8 bits wide."""

    name: str
    ip_bits: int
    fields: tuple[tuple[str, int], ...]
    used_bits: int  # bits above this must be zero in a record of this platform

    def extract(self, value: int) -> tuple[int, list[tuple[str, int]]]:
        ip = value & ((1 << self.ip_bits) - 1)
        return ip, [(name, (value >> lo) & 0xFF) for name, lo in self.fields]


_PVC_REASONS = ("active", "other", "control", "pipestall", "send", "dist_acc", "sbid", "sync", "inst_fetch")
_XE2_REASONS = ("tdr", *_PVC_REASONS[1:])


def _fields(names: Iterable[str], first: int) -> tuple[tuple[str, int], ...]:
    return tuple((n, first + 8 * i) for i, n in enumerate(names))


LAYOUTS: dict[str, XeLayout] = {
    "pvc": XeLayout("pvc", 29, _fields(_PVC_REASONS, 29), 101),
    "xe2": XeLayout("xe2", 29, (*_fields(_XE2_REASONS, 29), ("active", 101)), 113),
    "xe3p": XeLayout("xe3p", 61, (*_fields(_XE2_REASONS, 61), ("active", 133)), 145),
}
# ex_id and end_flag describe the record, not a stall: they are part of used_bits but not counted.


def layout_for(graphics_version: tuple[int, int]) -> XeLayout:
    """The record layout of a device by graphics IP version: 12.60 PVC, 20.x-30.x Xe2 layout, 35+ Xe3p.
    BadInput for devices without EU stall sampling."""
    major, minor = graphics_version
    if (major, minor) == (12, 60):
        return LAYOUTS["pvc"]
    if 20 <= major < 35:
        return LAYOUTS["xe2"]
    if major >= 35:
        return LAYOUTS["xe3p"]
    raise BadInput(f"graphics version {major}.{minor} has no EU stall sampling (PVC or Xe2 and later only)")


@dataclass
class XeParse:
    """Stall samples of a buffer of records (summed per IP and reason), and what could not be used."""

    samples: list[RawStallSample]
    records: int = 0
    empty: int = 0  # rows with no stall counted (hardware padding)
    foreign: int = 0  # bits set outside the platform's layout: not this platform's record
    partial_bytes: int = 0  # a trailing piece shorter than a record

    def counters(self) -> dict[str, int]:
        """Drops for the capture footer / summary, zero ones left out."""
        c = {"xe_records": self.records, "xe_empty_records": self.empty, "xe_foreign_records": self.foreign,
             "xe_partial_bytes": self.partial_bytes}
        return {k: v for k, v in c.items() if v}

    def refusal(self, label: str, platform: str, record_size: int) -> str | None:
        """Why the bytes parsed are not whole EU stall records of `platform`, in one line that starts with `label`
        (None when they are): a tail shorter than a record, or more than 1% of records with bits set where the
        layout has none (a record of another platform, or not one at all). The live stream counts these;
        `aiflame import` refuses such a file."""
        hint = "not EU stall data, or a wrong --platform / --record-size"
        if self.partial_bytes:
            size = self.records * record_size + self.partial_bytes
            return f"{label}: {size} bytes are not whole {record_size}-byte records ({hint})"
        if self.foreign * 100 > self.records:
            return f"{label}: {self.foreign} of {self.records} records are not {platform} EU stall records ({hint})"
        return None


def parse_records(
    data: bytes | memoryview,
    layout: XeLayout | str,
    *,
    record_size: int = RECORD_SIZE,
    device: int = -1,
    time_ns: int = 0,
) -> XeParse:
    """Parse a read() buffer of EU stall records. Samples carry the raw IP as `offset` and no kernel yet."""
    lay = layout if isinstance(layout, XeLayout) else LAYOUTS.get(layout)
    if lay is None:
        raise BadInput(f"unknown Xe platform {layout!r} (known: {', '.join(LAYOUTS)})")
    width = (lay.used_bits + 7) // 8
    if record_size < width or record_size > 4096:
        raise BadInput(f"record size {record_size} cannot hold a {lay.name} record ({width} bytes needed)")
    buf = memoryview(data).cast("B")
    n = len(buf) // record_size
    out = XeParse([], partial_bytes=len(buf) - n * record_size)
    counts: Counter[tuple[int, str]] = Counter()
    for i in range(n):
        rec = buf[i * record_size:(i + 1) * record_size]
        out.records += 1
        value = int.from_bytes(rec[:width], "little")
        if value >> lay.used_bits or any(rec[width:]):
            out.foreign += 1
            continue
        ip, fields = lay.extract(value)
        hit = False
        for reason, c in fields:
            if c:
                counts[(ip, reason)] += c
                hit = True
        if not hit:
            out.empty += 1
    out.samples = [RawStallSample("xe", 0, device, "", "", ip, reason, c, time_ns=time_ns)
                   for (ip, reason), c in sorted(counts.items())]
    return out


@dataclass(frozen=True)
class XeKernel:
    """Where a launched kernel's code lies: from Level Zero launch information (USDT or uprobes)."""

    name: str
    start: int  # kernel's start VA
    size: int
    iba: int  # instruction base address the kernel ran with
    pid: int = 0
    code: str = ""  # digest of its module (zebin) in the capture, "" unknown


def xe_kernels_from_events(events: Iterable[RawEvent]) -> list[XeKernel]:
    """Kernel placements from runtime events that carry `kernel_va`, `kernel_size` and `iba` args and a `name`
    string (the Level Zero launch probes that can read them)."""
    out: dict[tuple[int, int, int], XeKernel] = {}
    for e in events:
        a = e.args
        if "kernel_va" in a and a.get("kernel_size", 0) > 0 and "iba" in a:
            k = XeKernel(e.strs.get("name", ""), a["kernel_va"], a["kernel_size"], a["iba"], e.pid,
                         e.strs.get("digest", ""))
            out.setdefault((k.pid, k.iba, k.start), k)
    return list(out.values())


def map_ips(samples: Iterable[RawStallSample], kernels: list[XeKernel]) -> tuple[list[RawStallSample], int]:
    """Xe samples with a raw IP turned into kernel + offset (and the launching pid); samples no kernel covers
    are returned unchanged (the merge shows them under an unknown kernel). Returns (samples, unmapped count)."""
    by_iba: dict[int, tuple[list[int], list[XeKernel]]] = {}
    for iba in {k.iba for k in kernels}:
        ks = sorted((k for k in kernels if k.iba == iba), key=lambda k: k.start)
        by_iba[iba] = ([k.start for k in ks], ks)
    out: list[RawStallSample] = []
    unmapped = 0
    for s in samples:
        if s.source != "xe" or s.kernel:
            out.append(s)
            continue
        hit = None
        for starts, ks in by_iba.values():
            va = (s.offset << 3) + ks[0].iba
            j = bisect.bisect_right(starts, va) - 1
            if j >= 0 and va < ks[j].start + ks[j].size and (not s.pid or s.pid == ks[j].pid):
                hit = (ks[j], va - ks[j].start)
                break
        if hit is None:
            unmapped += s.count
            out.append(s)
        else:
            k, off = hit
            out.append(replace(s, kernel=k.name, offset=off, pid=s.pid or k.pid, code=s.code or k.code))
    return out, unmapped
