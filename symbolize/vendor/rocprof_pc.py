"""AMD PC sampling records of rocprofiler-sdk (host-trap and stochastic), read from a file of raw records.

The file holds the records as a rocprofiler-sdk tool receives them in its PC-sampling buffer callback, written
back to back: `rocprofiler_pc_sampling_record_host_trap_v0_t` (88 bytes) or
`rocprofiler_pc_sampling_record_stochastic_v0_t` (104 bytes), little-endian x86-64 layout; each begins with its
own u64 `size`, which tells the kinds apart. Offsets, from `rocprofiler-sdk/pc_sampling.h`:

    host trap   0 size, 8 hw_id, 16 pc.code_object_id, 24 pc.code_object_offset, 32 exec_mask, 40 timestamp,
                48 dispatch_id, 56 correlation_id.internal, 64 .external, 72 workgroup_id{x,y,z}, 84 wave_in_group
    stochastic  0 size, 8 flags(u8), 9 wave_in_group(u8), 10 wave_issued:1 inst_type:5 (u8), 16 hw_id,
                24 pc.code_object_id, 32 pc.code_object_offset, 40 exec_mask, 48 workgroup_id{x,y,z},
                60 wave_count, 64 timestamp, 72 dispatch_id, 80 correlation_id.internal, 88 .external,
                96 snapshot (reason_not_issued: bits 0-3), 100 memory_counters

The stall reason of a stochastic sample is its `reason_not_issued` (or `issued <type>` when the wave issued);
host-trap samples have none (`host_trap`). Code objects are ELF files whose kernels are STT_FUNC symbols; a
sample's `code_object_offset` is taken as the ELF address (code objects are linked at 0). A record with an
unknown size makes the rest of the file unreadable and raises Unreadable naming its byte offset.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from aiflame.core.errors import Unreadable
from aiflame.core.raw import GpuCode, RawStallSample
from aiflame.symbolize.objfmt.elf_format import parse_header

__all__ = [
    "EM_AMDGPU",
    "HOST_TRAP_SIZE",
    "NOT_ISSUED_REASONS",
    "STOCHASTIC_SIZE",
    "CodeObject",
    "RocprofParse",
    "amdgpu_refusal",
    "code_object_from_elf",
    "parse_file",
    "parse_records",
]

EM_AMDGPU = 224
HOST_TRAP_SIZE = 88
STOCHASTIC_SIZE = 104
_HOST = struct.Struct("<QQQQQQQQQIIII")
_STOCH = struct.Struct("<QBBBxxxxxQQQQIIIIQQQQII")
assert _HOST.size == HOST_TRAP_SIZE and _STOCH.size == STOCHASTIC_SIZE

# rocprofiler_pc_sampling_instruction_not_issued_reason_t, by value
NOT_ISSUED_REASONS = ("NONE", "NO_INSTRUCTION_AVAILABLE", "ALU_DEPENDENCY", "WAITCNT", "INTERNAL_INSTRUCTION",
                      "BARRIER_WAIT", "ARBITER_NOT_WIN", "ARBITER_WIN_EX_STALL", "OTHER_WAIT", "SLEEP_WAIT")
# rocprofiler_pc_sampling_instruction_type_t, by value
INSTRUCTION_TYPES = ("NONE", "VALU", "MATRIX", "SCALAR", "TEX", "LDS", "LDS_DIRECT", "FLAT", "EXPORT", "MESSAGE",
                     "BARRIER", "BRANCH_NOT_TAKEN", "BRANCH_TAKEN", "JUMP", "OTHER", "NO_INST", "DUAL_VALU")


@dataclass(frozen=True)
class CodeObject:
    """A loaded code object: its id in the records, content digest, and kernels as (start, size, name)."""

    id: int
    digest: str
    kernels: tuple[tuple[int, int, str], ...]

    def find(self, offset: int) -> tuple[str, int] | None:
        """(kernel name, offset inside it) for an offset in the code object."""
        starts = [k[0] for k in self.kernels]
        i = bisect.bisect_right(starts, offset) - 1
        if i >= 0 and offset < self.kernels[i][0] + self.kernels[i][1]:
            return self.kernels[i][2], offset - self.kernels[i][0]
        return None

    def gpu_code(self, data: bytes, origin: str) -> GpuCode:
        """The capture's record of this code object, `data` being its ELF bytes (kept so exports work offline)."""
        return GpuCode(self.digest, "amdgpu-elf", 0, origin, data)


def amdgpu_refusal(data: bytes, label: str) -> str | None:
    """Why `data` is not an AMDGPU code object, in one line that starts with `label` (None when it is one)."""
    try:
        machine = parse_header(data, label).e_machine
    except Unreadable as e:
        return str(e)
    if machine != EM_AMDGPU:
        return f"{label}: an ELF file for machine {machine}, not an AMDGPU code object (e_machine {EM_AMDGPU})"
    return None


def code_object_from_elf(code_object_id: int, data: bytes) -> CodeObject:
    """A code object from its ELF bytes (AMDGPU kernels are STT_FUNC symbols; `name.kd` descriptors skipped)."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    try:
        elf = ELFFile(io.BytesIO(data))
        kernels = []
        for sec in elf.iter_sections():
            if isinstance(sec, SymbolTableSection):
                for sym in sec.iter_symbols():
                    if sym["st_info"]["type"] == "STT_FUNC" and sym["st_size"] > 0:
                        kernels.append((int(sym["st_value"]), int(sym["st_size"]), sym.name))
    except (ELFError, ValueError, struct.error) as e:
        raise Unreadable(f"code object {code_object_id}: not a readable ELF ({e})") from None
    return CodeObject(code_object_id, hashlib.sha256(data).hexdigest(), tuple(sorted(set(kernels))))


@dataclass
class RocprofParse:
    """Samples (summed per code object, offset, reason and correlation id) and what could not be placed."""

    samples: list[RawStallSample]
    host_trap: int = 0
    stochastic: int = 0
    unknown_reason: int = 0  # reason indices beyond the known enum: kept as `reason_<n>`
    unknown_kernel: int = 0  # samples in code objects not given, or outside their kernels (no kernel name)
    notes: list[str] = field(default_factory=list)

    def counters(self) -> dict[str, int]:
        c = {"rocprof_host_trap_records": self.host_trap, "rocprof_stochastic_records": self.stochastic,
             "rocprof_unknown_reason": self.unknown_reason, "rocprof_unknown_kernel": self.unknown_kernel}
        return {k: v for k, v in c.items() if v}


def _reason(snapshot: int, issued: int, inst_type: int, out: RocprofParse) -> str:
    if issued:
        name = INSTRUCTION_TYPES[inst_type] if inst_type < len(INSTRUCTION_TYPES) else f"type_{inst_type}"
        return f"issued {name}"
    r = snapshot & 0xF
    if r < len(NOT_ISSUED_REASONS):
        return NOT_ISSUED_REASONS[r]
    out.unknown_reason += 1
    return f"reason_{r}"


def parse_records(
    data: bytes, *, code_objects: dict[int, CodeObject] | None = None, pid: int = 0, device: int = -1,
    label: str = "rocprofiler records",
) -> RocprofParse:
    """Parse back-to-back host-trap / stochastic records; Unreadable on a size that is neither."""
    cos = code_objects or {}
    out = RocprofParse([])
    counts: Counter[tuple[str, str, int, str, int]] = Counter()
    pos, n = 0, len(data)
    while pos < n:
        if n - pos < 8:
            raise Unreadable(f"{label}: truncated record at byte {pos} ({n - pos} bytes left)")
        (size,) = struct.unpack_from("<Q", data, pos)
        if size == HOST_TRAP_SIZE and n - pos >= size:
            f = _HOST.unpack_from(data, pos)
            co_id, co_off, corr = f[2], f[3], f[7]
            reason = "host_trap"
            out.host_trap += 1
        elif size == STOCHASTIC_SIZE and n - pos >= size:
            f = _STOCH.unpack_from(data, pos)
            bits = f[3]
            co_id, co_off, corr = f[5], f[6], f[14]
            reason = _reason(f[16], bits & 1, (bits >> 1) & 0x1F, out)
            out.stochastic += 1
        elif size in (HOST_TRAP_SIZE, STOCHASTIC_SIZE):
            raise Unreadable(f"{label}: truncated record at byte {pos} ({n - pos} of {size} bytes)")
        else:
            raise Unreadable(f"{label}: record at byte {pos} has size {size}, not a host-trap ({HOST_TRAP_SIZE})"
                             f" or stochastic ({STOCHASTIC_SIZE}) PC-sampling record")
        pos += size
        co = cos.get(co_id)
        hit = co.find(co_off) if co else None
        if hit is None:
            out.unknown_kernel += 1
            # Kernel unknown: keep the code object offset (an absolute address when the object is unknown).
            counts[(co.digest if co else "", "", co_off, reason, corr)] += 1
        else:
            counts[(co.digest if co else "", hit[0], hit[1], reason, corr)] += 1
    out.samples = [RawStallSample("rocprof", pid, device, code, kernel, off, reason, c, correlation_id=corr)
                   for (code, kernel, off, reason, corr), c in sorted(counts.items())]
    return out


def parse_file(
    path: str | Path, *, code_objects: dict[int, CodeObject] | None = None, pid: int = 0, device: int = -1
) -> RocprofParse:
    """Read and parse a file of records; Unreadable when unreadable, empty or malformed."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise Unreadable(f"{path}: {e.strerror}") from None
    if not data:
        raise Unreadable(f"{path}: empty file (no PC-sampling records)")
    return parse_records(data, code_objects=code_objects, pid=pid, device=device, label=str(path))
