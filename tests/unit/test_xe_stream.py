"""The Intel Xe EU stall collector without an Intel GPU: its uapi structs and ioctl numbers against the real
xe_drm.h (compiled C check), device discovery on a sysfs tree, the clear "no xe device" / "driver without EU
stall sampling" paths with real ioctls, and the read loop handing records to the parser."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiflame.agent.accel import xe_stream as xe
from aiflame.core.errors import HostError
from aiflame.symbolize.vendor.xe_eu_stall import LAYOUTS
from tests.conftest import PROGRAMS


def _xe_header() -> tuple[Path, list[str]]:
    """An xe_drm.h with EU stall sampling, and the include flags it needs: the system's (libdrm-dev >= 2.4.125,
    linux-libc-dev >= 6.15), else the Linux uapi headers in the `ziglang` wheel (accel-test extra)."""
    for p in (Path("/usr/include/drm/xe_drm.h"), Path("/usr/include/libdrm/xe_drm.h")):
        if p.is_file() and "DRM_XE_OBSERVATION_TYPE_EU_STALL" in p.read_text():
            return p, []
    for root in sys.path:
        inc = Path(root) / "ziglang" / "lib" / "libc" / "include"
        h = inc / "any-linux-any" / "drm" / "xe_drm.h"
        if h.is_file():
            return h, ["-I", str(inc / "any-linux-any"), "-I", str(inc / "x86-linux-any")]
    pytest.fail("no xe_drm.h with EU stall sampling: install the accel-test extra (the ziglang wheel ships it)")


@pytest.fixture(scope="module")
def uapi(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    header, flags = _xe_header()
    exe = tmp_path_factory.mktemp("xe") / "xe_uapi_check"
    subprocess.run(["cc", "-Wall", "-Werror", *flags, "-include", str(header), "-o", str(exe),
                    str(PROGRAMS / "xe_uapi_check.c")], check=True, capture_output=True, text=True)
    return json.loads(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)  # type: ignore[no-any-return]


def test_ioctl_numbers_and_ids_match_the_header(uapi: dict[str, object]) -> None:
    # Oracle: the real xe_drm.h, compiled in C here
    assert uapi["DRM_IOCTL_XE_DEVICE_QUERY"] == xe.DRM_IOCTL_XE_DEVICE_QUERY
    assert uapi["DRM_IOCTL_XE_OBSERVATION"] == xe.DRM_IOCTL_XE_OBSERVATION
    assert uapi["DRM_XE_OBSERVATION_IOCTL_ENABLE"] == xe.DRM_XE_OBSERVATION_IOCTL_ENABLE
    assert uapi["DRM_XE_OBSERVATION_IOCTL_DISABLE"] == xe.DRM_XE_OBSERVATION_IOCTL_DISABLE
    assert uapi["DRM_XE_DEVICE_QUERY_GT_LIST"] == xe.DRM_XE_DEVICE_QUERY_GT_LIST
    assert uapi["DRM_XE_DEVICE_QUERY_EU_STALL"] == xe.DRM_XE_DEVICE_QUERY_EU_STALL
    assert uapi["DRM_XE_EU_STALL_PROP_GT_ID"] == xe.DRM_XE_EU_STALL_PROP_GT_ID
    assert uapi["DRM_XE_EU_STALL_PROP_WAIT_NUM_REPORTS"] == xe.DRM_XE_EU_STALL_PROP_WAIT_NUM_REPORTS


def test_packed_structs_are_byte_identical_to_c(uapi: dict[str, object]) -> None:
    # Oracle: the real xe_drm.h, compiled in C here (bytes of each struct)
    assert xe.pack_device_query(xe.DRM_XE_DEVICE_QUERY_EU_STALL, 0x1234, 0x1122334455667788).hex() == \
        uapi["device_query"]
    assert xe.OBSERVATION_PARAM.pack(0, xe.DRM_XE_OBSERVATION_TYPE_EU_STALL, xe.DRM_XE_OBSERVATION_OP_STREAM_OPEN,
                                     0xCAFE).hex() == uapi["observation_param"]
    buf, first = xe.pack_properties([(xe.DRM_XE_EU_STALL_PROP_GT_ID, 0), (xe.DRM_XE_EU_STALL_PROP_SAMPLE_RATE,
                                                                           1004)])
    second = buf.raw[xe.SET_PROPERTY.size:]
    assert second.hex() == str(uapi["set_property"]).replace("ddccbbaa00000000", "0000000000000000")
    # the chain: the first link points at the second, the last at nothing
    assert struct.unpack_from("<Q", buf.raw, 0)[0] == first + xe.SET_PROPERTY.size


def test_query_replies_parse_as_the_header_lays_them_out(uapi: dict[str, object]) -> None:
    # Oracle: the real xe_drm.h, compiled in C here (replies laid out by the C structs)
    gts = xe.parse_gt_list(bytes.fromhex(str(uapi["gt_list"])))
    assert gts == [xe.XeGt(xe.DRM_XE_QUERY_GT_TYPE_MAIN, 0, 0, (20, 1)), xe.XeGt(1, 1, 3, (13, 0))]
    info = xe.parse_eu_stall_info(bytes.fromhex(str(uapi["eu_stall"])))
    assert info == xe.EuStallInfo(1, 64, 512 * 1024, (251, 502, 753))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_query_reply_parsers_fail_only_with_one_line(data: bytes) -> None:
    for parse in (xe.parse_gt_list, xe.parse_eu_stall_info):
        try:
            parse(data)
        except HostError as e:
            assert "\n" not in str(e)


def _drm_node(sysfs: Path, name: str, driver: str | None, pci: str) -> None:
    dev = sysfs / "devices" / pci
    (dev / "driver_target").mkdir(parents=True, exist_ok=True)
    node = sysfs / "class" / name
    node.mkdir(parents=True)
    (node / "device").symlink_to(dev)
    if driver:
        drv = sysfs / "bus" / "drivers" / driver
        drv.mkdir(parents=True, exist_ok=True)
        (dev / "driver").symlink_to(drv)


def test_finds_only_xe_render_nodes(tmp_path: Path) -> None:
    _drm_node(tmp_path, "renderD129", "xe", "0000:03:00.0")
    _drm_node(tmp_path, "renderD128", "i915", "0000:00:02.0")
    _drm_node(tmp_path, "renderD130", None, "0000:04:00.0")
    _drm_node(tmp_path, "renderD131", "xe", "0000:05:00.0")
    (tmp_path / "class" / "card0").mkdir()
    found = xe.find_xe_devices(tmp_path / "class", Path("/dev/dri"))
    assert found == [xe.XeDevice(Path("/dev/dri/renderD129"), "0000:03:00.0", 0),
                     xe.XeDevice(Path("/dev/dri/renderD131"), "0000:05:00.0", 1)]


def test_this_host_says_clearly_it_has_no_xe_device() -> None:
    if xe.find_xe_devices():
        pytest.fail("this test expects a host without an Intel xe GPU")
    running, problems = xe.start_all()
    assert running == []
    assert problems == ["Intel EU stall sampling: no Intel GPU with the xe driver on this host"]


def test_driver_without_eu_stall_is_explained_from_the_real_ioctl() -> None:
    # /dev/null answers the DRM ioctls as a driver without them does (ENOTTY): the same code path, for real.
    stall = xe.XeEuStall(xe.XeDevice(Path("/dev/null"), "0000:00:00.0", 0))
    with pytest.raises(HostError, match="the xe driver has no EU stall sampling") as e:
        stall.start()
    assert str(e.value).startswith("/dev/null (0000:00:00.0): ")
    fd = os.open("/dev/null", os.O_RDWR)
    try:
        with pytest.raises(OSError) as raw:
            xe.open_stream(fd, 0, 1004)
    finally:
        os.close(fd)
    assert "no EU stall sampling" in xe.explain_open_error(raw.value, "x")


@pytest.mark.parametrize(("err", "words"), [(13, "not allowed"), (16, "already open"), (19, "SR-IOV")])
def test_open_errors_are_one_line_each(err: int, words: str) -> None:
    msg = xe.explain_open_error(OSError(err, os.strerror(err)), "/dev/dri/renderD128")
    assert words in msg and "\n" not in msg


def _record(ip: int, tdr: int, sbid: int) -> bytes:
    value = ip | tdr << 29 | sbid << 77  # Xe2: tdr[29:37], sbid[77:85]
    return value.to_bytes(16, "little") + bytes(48)


def test_read_loop_hands_records_to_the_parser() -> None:
    r, w = os.pipe()
    stall = xe.XeEuStall(xe.XeDevice(Path("/dev/dri/renderD128"), "0000:03:00.0", 2))
    stall._stream, stall._layout = r, LAYOUTS["xe2"]  # a pipe stands in for the stream fd
    os.set_blocking(r, False)
    os.write(w, _record(0x123, 5, 0) + _record(0x123, 1, 2) + _record(0x40, 0, 0) + b"\x01\x02")
    os.close(w)
    assert stall._read_once(64 * 16)
    got = sorted((s.offset, s.reason, s.count, s.device, s.source, s.pid) for s in stall.take())
    assert got == [(0x123, "sbid", 2, 2, "xe", 0), (0x123, "tdr", 6, 2, "xe", 0)]
    assert stall.counters["xe_records"] == 3 and stall.counters["xe_empty_records"] == 1
    assert stall.counters["xe_partial_bytes"] == 2
    os.close(r)
