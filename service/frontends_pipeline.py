"""The device process's launch pipeline (service/frontends.py): calls launched at a loop
trip's end behind the launches still out and waited for (and answered) a loop trip later, so
the loop reads and launches the next calls while the GPU runs the previous ones. Its users:
CUDA-region calls (``_launch_cuda_due``, here), full system-region calls
(frontends_regions.py) and the fast lanes' full batches (service/lane.py ``LaneServer.pipe``).

``Pipeline`` is a part of ``FrontendsWorker`` (its state is made in
``FrontendsWorker.__init__``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


class Pipeline:
    """FrontendsWorker's launches answered a loop trip later (``_pipe``, ``_settle``,
    ``_tick``)."""

    # -- CUDA-region calls: launched at a trip's end, waited for a trip later ---------------
    def _launch_cuda_due(self) -> None:
        """The trip's CUDA-region calls (y in a CUDA region: ``CudaSupport.launch_now``;
        else, or where none may launch, ``CudaSupport.start``), behind the launches out."""
        due, self._cuda_due = self._cuda_due, []
        cuda, engine = self.regions.cuda, self.engine  # type: ignore[union-attr]
        assert cuda is not None
        for call, yd, done in due:
            try:
                self._pipe(lambda c=call, y=yd: cuda.launch_now(engine, c, y), done,
                           lambda c=call, y=yd, d=done: cuda.start(engine, c, y, d))
            except Exception as e:
                done(None, e)

    def _pipe(self, launch: Callable[[], Callable[[], Any] | None],
              done: Callable[[Any, BaseException | None], None],
              otherwise: Callable[[], None]) -> None:
        """``launch()`` (the wait of a launch, or None: the device may not launch it now) now,
        behind the launches out; while it may not, the oldest out is waited for and
        answered, then it is tried again; with none out, ``otherwise()``. Launched, its
        wait and ``done(reply, exception)`` are out until ``_settle``: a loop trip later, or
        before a later launch that needs its slot. Refusals raise from ``launch``."""
        dev = self.engine.device  # type: ignore[union-attr]
        while True:
            if self._out and not dev.may_launch_now():  # (its slots taken: no launch() try)
                self._settle(self._out[0][2] + 1)
                continue
            held = self._held_slots()
            wait = launch()
            if wait is not None:
                self._out.append((wait, done, self._launches, self._taken_event(held)))
                self._launches += 1
                self.pipelined[0] += 1
                if not self._tick_due:
                    self._tick_due = True
                    asyncio.get_running_loop().call_soon(self._tick, True)
                return
            if not self._out:
                otherwise()
                return
            self._settle(self._out[0][2] + 1)

    def _held_slots(self) -> int:
        """The workspace's launch slots held now (bit s: slot s), before a launch, for
        :meth:`_taken_event` (0: no ready polling)."""
        ws = self._ws
        if ws is None:
            return 0
        return sum(1 << s for s in range(self._ws_slots) if ws.held(s))

    def _taken_event(self, before: int) -> Any:
        """The completion event of the slot a launch just took: the one held now that was
        not before it (``held``: :meth:`_held_slots` then), as the launch itself marked it
        (``Workspace.take``), whichever slot its launcher chose; None (no ready polling, or
        a launch that took no slot of this workspace): its wait is called a trip later."""
        ws = self._ws
        if ws is None:
            return None
        for s in range(self._ws_slots):
            if not before >> s & 1 and ws.held(s):
                return ws.done_event(s)
        return None

    def _settle_done(self, before: int) -> None:
        """:meth:`_settle`, with ready polling only those done by now (their slot's event; no
        event: waited for), in order up to the first that is not; a tick looks at the rest a
        loop trip later."""
        if self._ws is None:
            self._settle(before)
            return
        out = self._out
        while out and out[0][2] < before:
            ev = out[0][3]
            if ev is not None and not ev.done:
                if not self._tick_due:
                    self._tick_due = True
                    asyncio.get_running_loop().call_soon(self._tick, True)
                return
            self._settle(out[0][2] + 1)

    def _settle(self, before: int) -> None:
        """Wait for the launches out numbered below ``before``, in order, each answered."""
        out = self._out
        while out and out[0][2] < before:
            wait, done, _, _ = out.popleft()
            t = time.perf_counter()
            try:
                reply, exc = wait(), None
            except Exception as e:
                reply, exc = None, e
            finally:
                self.pipelined[1] += time.perf_counter() - t
            done(reply, exc)

    def _tick(self, first: bool) -> None:
        """A loop trip after a launch: the launches out are waited for and answered. In two
        steps: the first, at the start of the next trip, only schedules the second, so the
        messages that trip reads are parsed first; the second runs before that trip's end
        (``_flush_calls``), which, where the trip read calls, launches them before it waits
        for the earlier ones: the second then leaves the waits to it."""
        if first:
            asyncio.get_running_loop().call_soon(self._tick, False)
            return
        self._tick_due = False
        if self._merging or self._cuda_due or self._sys_due:
            return  # (_flush_calls comes: it settles them, after its own launches)
        self._settle_done(self._launches)
        for fe in self._fronts.values():
            fe.out.flush_now()
