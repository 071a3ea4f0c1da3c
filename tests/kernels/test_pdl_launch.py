"""Host side of the programmatic dependent launch (PDL) of the K-slice tiles' split-K sum
(kernels/cuda/driver.py ``launch_pdl``), without a device: the ctypes mirrors of the driver's
CUlaunchConfig / CUlaunchAttribute have the C layout, and a launch hands cuLaunchKernelEx the
grid, block, shared memory, current stream, the one attribute and pointers to the argument
values; the launcher uses it by default on compute capability 9.0+ (Q6SERVE_PDL=0: never)."""

from __future__ import annotations

import ctypes
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from q6serve.kernels.cuda import driver
from q6serve.kernels.cuda import launch as lm
from q6serve.kernels.errors import DeviceError, InvalidArgument


def test_struct_layouts_match_the_driver_headers():
    # CUlaunchAttribute: 4-byte id, 4 bytes of padding, a 64-byte value union
    assert ctypes.sizeof(driver._LaunchAttr) == 72 and driver._LaunchAttr.value.offset == 8
    # CUlaunchConfig: 7 unsigned ints, padding, stream, attrs, numAttrs (+ tail padding)
    assert driver._LaunchConfig.stream.offset == 32 and driver._LaunchConfig.attrs.offset == 40
    assert driver._LaunchConfig.nattrs.offset == 48 and ctypes.sizeof(driver._LaunchConfig) == 56


def test_launch_pdl_passes_config_attribute_and_argument_values(monkeypatch):
    fake = SimpleNamespace(cuda=SimpleNamespace(
        get_current_stream=lambda: SimpleNamespace(ptr=0x5150)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    seen = {}

    def launch_ex(cfg_ref, func, params, extra):
        cfg = cfg_ref._obj
        seen.update(grid=tuple(cfg.grid), block=tuple(cfg.block), smem=cfg.smem,
                    stream=cfg.stream, n=cfg.nattrs, id=cfg.attrs[0].id,
                    allowed=ctypes.c_int.from_buffer_copy(bytes(cfg.attrs[0].value[:4])).value,
                    func=func.value, extra=extra,
                    u=ctypes.c_uint64.from_address(params[0]).value,
                    i=ctypes.c_int32.from_address(params[1]).value,
                    q=ctypes.c_int64.from_address(params[2]).value)
        return 0

    fn = SimpleNamespace(kernel=SimpleNamespace(ptr=0xF00D))
    driver.launch_pdl(launch_ex, fn, (7,), 256,
                  (np.uint64(1 << 40), np.int32(-3), np.int64(5 << 33)), 1024)
    assert seen == dict(grid=(7, 1, 1), block=(256, 1, 1), smem=1024, stream=0x5150, n=1,
                        id=6, allowed=1, func=0xF00D, extra=None, u=1 << 40, i=-3, q=5 << 33)

    with pytest.raises(DeviceError, match="cuLaunchKernelEx"):
        driver.launch_pdl(lambda *a: 1, fn, (1, 2, 3), 32, (np.int32(0),), 0)


@pytest.mark.parametrize("env, cc, want", [("1", "90", True), ("0", "90", False),
                                           ("1", "89", False), (None, "90", True),
                                           ("off", "90", False), ("", "90", True)])
def test_only_asked_for_and_on_sm90(monkeypatch, env, cc, want):
    if env is None:
        monkeypatch.delenv("Q6SERVE_PDL", raising=False)
    else:
        monkeypatch.setenv("Q6SERVE_PDL", env)
    monkeypatch.setattr(lm, "_driver_launch_ex", lambda: "cuLaunchKernelEx")
    lc = lm.Launcher(SimpleNamespace(cc=cc), graphs=False)
    assert (lc._pdl_launcher() == "cuLaunchKernelEx") is want


def test_only_the_register_tile_sums_with_pdl(monkeypatch):
    """The sum step of a src 4 plan takes PDL, a wgmma tile plan's (src 8; its src 6 form was
    mixed on the H200) does not (the ring tile src 5, which took it too, left after session
    21)."""
    monkeypatch.setattr(lm, "_driver_launch_ex", lambda: "cuLaunchKernelEx")
    lc = lm.Launcher(SimpleNamespace(cc="90"), graphs=False)
    lc.pdl = True
    lc.ws.ptr = lambda *a, **kw: 4096  # no device buffers
    w = SimpleNamespace(rows=64, k=512)
    cw = SimpleNamespace(table=SimpleNamespace(data=SimpleNamespace(ptr=8)), rps=64)
    for src, want in ((4, True), (8, False)):
        lp = lm.LaunchPlan("mma_f16", "tile", (4, 2, 1), 256, 0, 2, 4, 2, 1, None, (1,),
                           (0, 0, 0), "sum", src)
        steps = lc.steps(lp, w, cw, 16, 32, 8)
        assert [s.fn for s in steps] == ["tile", "sum"]
        assert (steps[1].pdl == "cuLaunchKernelEx") is want and steps[0].pdl is None


def test_a_bad_value_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("Q6SERVE_PDL", "maybe")
    with pytest.raises(InvalidArgument, match="Q6SERVE_PDL='maybe'"):
        lm.Launcher(SimpleNamespace(cc="90"), graphs=False)
