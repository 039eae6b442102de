"""Chakra execution traces (MLCommons' `mlc-chakra` schema and encoder): the `chakra` exporter writes one
`<prefix>.<rank>.et` per rank, each the GlobalMetadata and then the rank's nodes (exporters/chakra_nodes.py says
what becomes a node and how nodes depend on each other)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiflame.core.errors import BadInput, NothingToShow, Unreadable
from aiflame.core.model import Profile

from .base import Exporter, Option, Output, write_atomic

if TYPE_CHECKING:
    from .chakra_calibration import Calibration
from .chakra_nodes import COMP, ChakraTraces, EtNode, RankTrace, build_traces, node_types

__all__ = ["ChakraExporter", "decode_et", "encode_rank", "write_traces"]

VERSION = "0.0.4"  # what ASTRA-sim's examples carry; no consumer checks it


def _schema() -> tuple[Any, Any]:
    """MLCommons' generated schema and length-delimited codec (installed with --no-deps by `make setup`)."""
    try:
        from chakra.schema.protobuf import et_def_pb2
        from chakra.src.third_party.utils import protolib
    except ImportError as e:
        raise BadInput(f"the Chakra schema is not importable ({e}): pip install --no-deps mlc-chakra==1.0.0"
                       ) from None
    return et_def_pb2, protolib


def _micros(ns: int) -> int:
    return max(ns, 0) // 1000


def _durations_micros(nodes: Sequence[EtNode]) -> list[int]:
    """Whole microseconds per node. COMP nodes are rounded against their running sum, so the rank's compute adds
    up to what was measured (rounding each up would add up to a microsecond per node)."""
    out = []
    acc = 0
    for n in nodes:
        if n.type == COMP:
            out.append((acc + n.duration_ns + 500) // 1000 - (acc + 500) // 1000)
            acc += n.duration_ns
        else:
            out.append(max((n.duration_ns + 500) // 1000, 1 if n.duration_ns > 0 else 0))
    return out


def encode_rank(trace: RankTrace, base_ns: int) -> bytes:
    """The `.et` bytes of one rank: GlobalMetadata, then its nodes; times in µs from `base_ns`."""
    pb, protolib = _schema()
    buf = io.BytesIO()
    meta = pb.GlobalMetadata(version=VERSION, attr=[
        pb.AttributeProto(name="schema", string_val="aiflame post-execution trace"),
        pb.AttributeProto(name="rank", int64_val=trace.rank),
        pb.AttributeProto(name="world_size", int64_val=trace.world_size),
    ])
    protolib.encodeMessage(buf, meta)
    for n, micros in zip(trace.nodes, _durations_micros(trace.nodes), strict=True):
        node = pb.Node(id=n.id, name=n.name, type=n.type, ctrl_deps=n.ctrl_deps, data_deps=n.data_deps,
                       start_time_micros=_micros(n.start_ns - base_ns), duration_micros=micros)
        for key, (slot, value) in n.attrs.items():
            node.attr.append(pb.AttributeProto(name=key, **{slot: value}))
        protolib.encodeMessage(buf, node)
    return buf.getvalue()


def decode_et(data: bytes) -> tuple[Any, list[Any]]:
    """(GlobalMetadata, [Node]) of a `.et` file's bytes, with mlc-chakra's own decoder; Unreadable when the
    bytes are not a Chakra trace."""
    pb, protolib = _schema()
    f = io.BytesIO(data)
    meta = pb.GlobalMetadata()
    try:
        if not protolib.decodeMessage(f, meta):
            raise Unreadable("empty or truncated Chakra trace (no metadata record)")
        nodes = []
        while True:
            node = pb.Node()
            pos = f.tell()
            if not protolib.decodeMessage(f, node):
                break
            if f.tell() > len(data) or (f.tell() - pos) < 1:
                raise Unreadable("truncated Chakra trace")
            nodes.append(node)
    except Unreadable:
        raise
    except Exception as e:  # the decoder raises protobuf's DecodeError and friends
        raise Unreadable(f"malformed Chakra trace: {e}") from None
    if f.tell() != len(data):
        raise Unreadable(f"malformed Chakra trace: stopped at byte {f.tell()} of {len(data)}")
    return meta, nodes


def _check_prefix(prefix: Path) -> None:
    if not prefix.name or prefix.name in (".", ".."):
        raise BadInput(f"{prefix}: give a file prefix (DIR/prefix), not a directory")
    if not prefix.parent.is_dir():
        raise BadInput(f"{prefix.parent}: no such directory")


def write_traces(prof: Profile, prefix: Path, check: bool = True,
                 calibration: Calibration | None = None) -> tuple[list[Path], ChakraTraces]:
    """Write `<prefix>.<rank>.et` for every rank of the capture, and `<prefix>.network.yml`: the calibrated
    network when `calibration` is given (each call then preceded by its host cost, exporters/chakra_calibration.py),
    else one fitted to the capture's own communication (exporters/chakra_network.py); returns the `.et` files and
    the traces. With `check`, the files are checked against the simulator's input rules
    (exporters/chakra_check.py) and what they break is in `traces.problems`."""
    from .chakra_calibration import calibration_yaml, capture_id
    from .chakra_check import check as check_files
    from .chakra_network import P2P, fit_network, network_yaml

    prefix = Path(prefix)
    _check_prefix(prefix)
    traces = build_traces(prof, host=calibration.host_ns if calibration else None)
    base = prof.start_ns or min((n.start_ns for t in traces.ranks.values() for n in t.nodes), default=0)
    written = []
    for r, trace in sorted(traces.ranks.items()):
        path = prefix.with_name(f"{prefix.name}.{r}.et")
        write_atomic(path, encode_rank(trace, base))
        written.append(path)
    world = traces.timeline.world
    path = prefix.with_name(f"{prefix.name}.network.yml")
    if calibration is not None:
        traces.network = calibration
        calls = {P2P if op.kind != "collective" else op.call for t in traces.timeline.ranks.values() for op in t.ops}
        traces.warnings += calibration.stand_ins(calls)
        write_atomic(path, calibration_yaml(calibration, world).encode())
        traces.extra_files.append(path)
    else:
        traces.network = fit_network(traces)
        if traces.network is not None:
            write_atomic(path, network_yaml(traces.network, world, capture_id(prof)).encode())
            traces.extra_files.append(path)
    if check:
        traces.problems = check_files(written, world=traces.timeline.world)
    return written, traces


class ChakraExporter(Exporter):
    """Chakra execution traces of a capture's timed events: `write(profile, prefix)` writes `<prefix>.<rank>.et`
    for every rank and keeps what could not be represented exactly in `warnings`."""

    name = "chakra"
    extension = ".et"
    description = "Chakra execution traces for ASTRA-sim, one PREFIX.<rank>.et per rank"
    options = (Option("check", bool, True, "check the traces against ASTRA-sim's input rules; a broken one "
                      "fails the export (aiflame chakra check lists them)"),
               Option("network", str, "", "a calibrated network file (aiflame chakra calibrate): written as "
                      "PREFIX.network.yml, each call preceded by its host cost; default: a network fitted to this "
                      "capture, which reproduces it but predicts nothing else"))
    writes_many = True
    whole_capture = True

    def render(self, profile: Profile) -> bytes:
        raise BadInput("chakra writes one file per rank: write() them under a prefix")

    def __init__(self, check: bool = True, network: str = "") -> None:
        self.check = check
        self.network = network

    def write(self, profile: Profile, path: Path) -> list[Output]:
        from .chakra_calibration import load_calibration

        cal = load_calibration(Path(self.network)) if self.network else None
        files, traces = write_traces(profile, path, check=self.check, calibration=cal)
        self.warnings = [*traces.warnings, *(str(p) for p in traces.problems)]
        errors = [p for p in traces.problems if p.severity == "error"]
        if errors:  # no trace the simulator runs: as the capture without communication (exporters/write.py)
            raise NothingToShow(f"the traces break {len(errors)} of ASTRA-sim's input rules, the simulator would not "
                                f"run them to the end (`aiflame chakra check {path}` lists them): {errors[0]}")
        out = [Output(f, f"rank {rank}: " + ", ".join(f"{n} {k}" for k, n in sorted(node_types(t.nodes).items())))
               for f, (rank, t) in zip(files, sorted(traces.ranks.items()), strict=True)]
        what = (f"an ASTRA-sim network calibrated on capture {cal.source}" if cal else
                "an ASTRA-sim network fitted to this capture (it reproduces this job, predicts no other)")
        return out + [Output(f, what) for f in traces.extra_files]
