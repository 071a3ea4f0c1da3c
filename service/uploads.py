"""An upload's bytes on their way in: held in segments that are allocated, accounted and
(for f32/f16) quantized as the data arrives.

The worker never allocates an upload in one piece: a header alone commits nothing, and a
stream that stalls holds what it sent. Each segment (whole rows, ~``SEGMENT_BYTES``) is
reserved as ``staging`` in the accountant before it is allocated (RESOURCE_EXHAUSTED when the
budget cannot hold it), so the status figures show what uploads hold. A full f32/f16 segment is
quantized to Q6_K in a thread and its float bytes released at once, so an f32 upload holds
about its Q6_K size plus one float segment, not 4.9x the weight. What the buffer ends up
holding is Q6_K blocks of whole rows, handed to the load chunk by chunk.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable, Iterator

import numpy as np

from q6serve.kernels import q6k
from q6serve.kernels.api import DTYPES
from q6serve.kernels.errors import InvalidArgument

from .threads import run_in_thread
from .vram import Reservation, VramAccountant

SEGMENT_BYTES = 16 << 20  # of the format sent; a segment holds at least one row


class UploadBuffer:
    """Receives one upload (``add`` each chunk on the event loop, then ``finish``)."""

    def __init__(self, name: str, rows: int, k: int, fmt: str, total_bytes: int,
                 sha256: str, vram: VramAccountant | None,
                 cancelled: Callable[[], bool] | None = None,
                 segment_bytes: int = SEGMENT_BYTES) -> None:
        self.name, self.rows, self.k, self.fmt = name, rows, k, fmt
        self.want = total_bytes
        self.sha256 = sha256.lower()
        self._vram = vram
        self._cancelled = cancelled
        self.what = f"upload {name!r}"
        self.q_row_bytes = q6k.aos_nbytes(1, k)
        self.row_bytes = self.q_row_bytes if fmt == "q6_k" else k * DTYPES[fmt].itemsize
        self.seg_rows = max(1, segment_bytes // self.row_bytes)
        self.parts: list[np.ndarray] = []  # Q6_K blocks of whole rows, in order
        self.got = 0
        self._hash = hashlib.sha256()
        self._seg: np.ndarray | None = None  # the segment being filled (bytes as sent)
        self._seg_res: Reservation | None = None
        self._fill = 0
        self._row = 0  # first row of the segment being filled
        self._held: list[Reservation] = []  # for the finished parts

    @property
    def nbytes(self) -> int:
        """Bytes held now (what the accountant has reserved for this upload)."""
        seg = self._seg.nbytes if self._seg is not None else 0
        return seg + sum(p.nbytes for p in self.parts)

    def _reserve(self, nbytes: int) -> Reservation | None:
        return self._vram.reserve(staging=nbytes) if self._vram is not None else None

    async def add(self, chunk: bytes) -> None:
        if self.got + len(chunk) > self.want:
            raise InvalidArgument(f"{self.what} sent more than the declared {self.want} bytes")
        self._hash.update(chunk)
        self.got += len(chunk)
        view = memoryview(chunk).cast("B")
        while view.nbytes:
            if self._seg is None:
                rows = min(self.seg_rows, self.rows - self._row)
                self._seg_res = self._reserve(rows * self.row_bytes)
                self._seg = np.empty(rows * self.row_bytes, np.uint8)  # pages come as written
                self._fill = 0
            n = min(view.nbytes, self._seg.nbytes - self._fill)
            self._seg[self._fill : self._fill + n] = np.frombuffer(view[:n], np.uint8)
            self._fill += n
            view = view[n:]
            if self._fill == self._seg.nbytes:
                await self._close_segment()

    async def _close_segment(self) -> None:
        """Turn the full segment into Q6_K blocks (checked; quantized for f32/f16) and keep
        them with their reservation."""
        seg, res = self._seg, self._seg_res
        assert seg is not None
        self._seg, self._seg_res = None, None
        rows = seg.nbytes // self.row_bytes
        try:
            if self.fmt == "q6_k":
                blocks = seg.reshape(-1, q6k.BLOCK_BYTES)
                q6k.check_scales_finite(blocks, self.what, self._row * (self.k // q6k.QK_K),
                                        self.k // q6k.QK_K)
            else:
                from q6serve.kernels.quantize import quantize_q6_k

                x = seg.view(DTYPES[self.fmt]).reshape(rows, self.k)
                del seg
                out_res = self._reserve(rows * self.q_row_bytes)
                try:
                    blocks = await run_in_thread(quantize_q6_k, x, self.what,
                                                 self._cancelled, self._row)
                except BaseException:
                    if out_res is not None:
                        out_res.release()
                    raise
                del x
                if res is not None:
                    res.release()  # the float bytes are gone once quantized
                res = out_res
        except BaseException:
            if res is not None:
                res.release()
            raise
        self.parts.append(blocks)
        if res is not None:
            self._held.append(res)
        self._row += rows

    async def receive(self, chunks: AsyncIterator[bytes]) -> None:
        """Add every chunk, then :meth:`finish`; on any failure (a bad chunk, the stream
        broken, a budget refusal) the data and its reservations are dropped first."""
        try:
            async for chunk in chunks:
                await self.add(chunk)
            self.finish()
        except BaseException:
            self.release()
            raise

    def finish(self) -> None:
        """Check the byte count and the sha256 of the bytes as sent."""
        if self.got != self.want:
            raise InvalidArgument(f"{self.what} ended after {self.got} of {self.want} bytes")
        digest = self._hash.hexdigest()
        if digest != self.sha256:
            raise InvalidArgument(f"{self.what}: sha256 mismatch (got {digest}, header says "
                                  f"{self.sha256})")

    def chunks(self, chunk_bytes: int) -> Iterator[np.ndarray]:
        """The Q6_K blocks as chunks of whole rows of at most ``chunk_bytes`` (>= 1 row)."""
        return self.row_chunks(0, self.rows, chunk_bytes)

    def row_chunks(self, r0: int, r1: int, chunk_bytes: int) -> Iterator[np.ndarray]:
        """Rows ``[r0, r1)`` as such chunks (views; a multi-device worker loads each device's
        rows from the one buffer)."""
        per_row = self.k // q6k.QK_K
        rows_per = max(1, chunk_bytes // self.q_row_bytes)
        row = 0
        for part in self.parts:
            n = part.shape[0] // per_row
            lo, hi = max(r0, row), min(r1, row + n)
            for a in range(lo, hi, rows_per):
                b = min(hi, a + rows_per)
                yield part[(a - row) * per_row : (b - row) * per_row]
            row += n

    def row_blocks(self, r0: int, r1: int) -> np.ndarray:
        """A copy of the Q6_K blocks of rows ``[r0, r1)``."""
        per_row = self.k // q6k.QK_K
        out, row = [], 0
        for part in self.parts:
            n = part.shape[0] // per_row
            lo, hi = max(r0, row), min(r1, row + n)
            if lo < hi:
                out.append(part[(lo - row) * per_row : (hi - row) * per_row])
            row += n
        return np.concatenate(out) if out else np.empty((0, q6k.BLOCK_BYTES), np.uint8)

    def q6k_sha256(self) -> str:
        h = hashlib.sha256()
        for part in self.parts:
            h.update(part.data)
        return h.hexdigest()

    def hand_over(self) -> None:
        """Stop accounting the finished data (kept): the load about to copy it into the
        weight reserves that, and the buffer must not make a weight that fits the budget
        once need room for two copies. The overlap while it copies is the load's, as for a
        GGUF file's mapped pages."""
        for res in self._held:
            res.release()
        self._held.clear()

    def release(self) -> None:
        """Drop the data and its reservations (idempotent)."""
        self.hand_over()
        if self._seg_res is not None:
            self._seg_res.release()
            self._seg_res = None
        self._seg = None
        self.parts = []
