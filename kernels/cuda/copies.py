"""x's way in and y's way out of a launch (kernels/cuda/launch.py, points 1, 4, 8): a copy by
the copy engine or, up to ``COPY_KERNEL_MAX`` bytes between 16-byte aligned addresses, by a
copy kernel on the kernels' engine (:meth:`Copies._copy`; a small f16 y converted on its way
out, :meth:`Copies._y16_out`); a bound sequence's upload, its small y's download, a row-chunked
y's blocks downloaded chunk by chunk, a pinned region's device address.

:class:`Copies` is one of the parts ``launcher.Launcher`` is made of (its methods are the
launcher's); sequence.py, region_call.py and many.py call them through the launcher."""

from __future__ import annotations

import ctypes

import numpy as np

from . import launch
from .driver import _D2H, _H2D
from .sequence import Bound


class Copies:
    """The launcher's copies in and out (see the module docstring)."""

    def _download(self, b: Bound) -> None:
        """A small y's way out, enqueued after the kernels (a bound sequence's last part, in
        its graph too): f16 converted on the device, then copied into the pinned out buffer;
        or the top-k epilogue's launches and its packed rows' copy into that buffer."""
        out = b.extra["out"]
        cp = self.ctx.cp
        if out is None:
            if b.extra.get("y16") is not None:  # a larger f16 y: only its conversion here
                shape = b.extra["shape"]
                cp.copyto(self.ws.array("y16b", shape, np.float16),
                          self.ws.array("y", shape, np.float32), casting="same_kind")
            return
        if b.extra["post"]:  # the top-k epilogue (after the end event: not kernel time)
            for s in b.extra["post"]:
                s()
            packed, host = out
            self._copy(host.ctypes.data, packed, host.nbytes, _D2H)
            return
        y16, host = out
        src = b.extra["y"]
        if y16 and self._y16_out(host.ctypes.data, src, host.size):  # (one kernel: Y16_COPY)
            return
        if y16:  # ("y16b": bound, unlike _finish's "y16"; at the bound size: nothing grows)
            cp.copyto(self.ws.array("y16b", host.shape, np.float16),
                      self.ws.array("y", host.shape, np.float32), casting="same_kind")
            src = y16
        self._copy(host.ctypes.data, src, host.nbytes, _D2H)

    def copy_limit(self) -> int:
        """Bytes up to which :meth:`_copy` uses the copy kernel (0: never)."""
        return launch.COPY_KERNEL_MAX if self.copy_kernel_max is None else self.copy_kernel_max

    def _copy(self, dst: int, src: int, nbytes: int, kind: int) -> bool:
        """``nbytes`` from ``src`` to ``dst`` on the stream (a direct launch, or a node under
        capture): by the copy kernel (COPY_SRC; True) when it is at most :meth:`copy_limit`
        bytes and both addresses are 16-byte aligned, else by ``memcpyAsync`` (``kind``: its
        direction) on the copy engine (False). Host addresses must be the device's too
        (cudaHostAlloc'd, or mapped: :meth:`device_ptr`)."""
        if not self.by_kernel(nbytes, dst, src):
            self.ctx.cp.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, self.ctx.stream.ptr)
            return False
        self._kernel_copy(dst, src, nbytes)
        return True

    def by_kernel(self, nbytes: int, *ptrs: int) -> bool:
        """Whether :meth:`_copy` moves ``nbytes`` between ``ptrs`` by the copy kernel."""
        return 0 < nbytes <= self.copy_limit() and all(p % 16 == 0 for p in ptrs)

    def _kernel_copy(self, dst: int, src: int, nbytes: int) -> None:
        """The copy kernel (COPY_SRC) on the stream; both addresses the device's."""
        stream = self.ctx.stream
        if self._copy_fn is None:
            self._copy_fn = self.ctx.cp.RawKernel(launch.COPY_SRC, "q6_copy")
        blocks = max(1, min(launch.COPY_MAX_BLOCKS, -(-(nbytes >> 4) // launch.COPY_THREADS)))
        self._copy_fn((blocks,), (launch.COPY_THREADS,), (np.uint64(src), np.uint64(dst),
                                                    np.int64(nbytes)), stream=stream)

    def _y16_out(self, dst: int, src: int, count: int) -> bool:
        """A small f16 y's way out: ``count`` f32 values of the device y at ``src`` into the
        host buffer at ``dst`` as f16 by COPY_H_SRC (True), where ``Y16_COPY`` is on and the
        copy kernel would take those bytes (:meth:`by_kernel`); False: nothing done (convert,
        then :meth:`_copy`)."""
        if not launch.Y16_COPY or not self.by_kernel(2 * count, dst, src):
            return False
        if self._copy_h_fn is None:
            self._copy_h_fn = self.ctx.cp.RawKernel(launch.COPY_H_SRC, "q6_copy_h")
        blocks = max(1, min(launch.COPY_MAX_BLOCKS, -(-(count >> 3) // launch.COPY_THREADS)))
        self._copy_h_fn((blocks,), (launch.COPY_THREADS,), (np.uint64(src), np.uint64(dst),
                                                      np.int64(count)),
                        stream=self.ctx.stream)
        return True

    def device_ptr(self, host: int) -> int | None:
        """The device's address of registered page-locked host memory at ``host`` (a region:
        ``cudaHostRegister``ed, whose device address need not be the host's), or None where
        the driver gives none."""
        if self._dev_ptr is None:
            self._dev_ptr = launch._host_device_ptr() or False
        if not self._dev_ptr:
            return None
        out = ctypes.c_uint64()
        with self.ctx.dev:
            if self._dev_ptr(ctypes.byref(out), ctypes.c_void_p(host), 0) != 0:
                return None
        return int(out.value)

    def _chunks_out(self, b: Bound, dst: int) -> None:
        """Enqueue a split y's way out into ``dst`` (host, [N, rows] f32): a 2D copy of each
        part (a row chunk's [N, r1 - r0] block into its columns, point 8; a token half's rows,
        point 10) - all but the last on the y copy stream, each once its part's event fired;
        the last on the backend's stream after its kernels (no hand-off between streams at the
        end of the call) once the copy stream's copies are done (the backend's stream orders
        everything after it: a later launch reuses the device y)."""
        rt, stream = self.ctx.cp.cuda.runtime, self.ctx.stream
        ys = self.y_stream()
        y = b.extra["y"]
        copies = b.extra["copies"]
        for i, (doff, soff, dpitch, spitch, width, height, ev) in enumerate(copies):
            last = i == len(copies) - 1
            if last:
                join = b.extra["join"]
                join.record(ys)
                stream.wait_event(join)
            else:
                ys.wait_event(ev)
            rt.memcpy2DAsync(dst + doff, dpitch, y + soff, spitch, width, height, _D2H,
                             stream.ptr if last else ys.ptr)

    def _upload(self, b: Bound, src: int) -> bool:
        """x's upload from the host at ``src`` into the sequence's device x, on the stream (by
        the copy kernel where :meth:`_copy` takes it: True); the token halves' (point 10): the
        first half's on the stream, then the stream forks to the x stream, which uploads the
        rest (each half's event after its copy: the stream waits for it before that half's
        kernels, ``_kernels``)."""
        rt, stream = self.ctx.cp.cuda.runtime, self.ctx.stream
        xd, xparts = b.extra["xd"], b.extra.get("xparts")
        if not xparts:
            return self._copy(xd, src, b.x_bytes, _H2D)
        xs = self.x_stream()
        for off, nbytes, ev in xparts:
            if ev is None:
                rt.memcpyAsync(xd + off, src + off, nbytes, _H2D, stream.ptr)
                b.extra["fork"].record(stream)
                xs.wait_event(b.extra["fork"])
            else:
                rt.memcpyAsync(xd + off, src + off, nbytes, _H2D, xs.ptr)
                ev.record(xs)
        return False

    def _y_out(self, y: int, n: int, rows: int, half: bool) -> int:
        """The device address y leaves from: the workspace's f32 y at ``y``, or (``half``) its
        f16 conversion enqueued into the workspace's "y16" (half the bytes cross the bus)."""
        if not half:
            return y
        y16 = self.ws.array("y16", (n, rows), np.float16, bound=False)
        self.ctx.cp.copyto(y16, self.ws.array("y", (n, rows), np.float32), casting="same_kind")
        return int(y16.data.ptr)
