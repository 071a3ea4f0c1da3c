"""A TCP proxy standing for a client that stopped reading: what the client sends reaches the
worker, what the worker sends back stops after the first ``pass_bytes`` (its HTTP/2 settings
and a little more), so the worker's writes to it fill the socket buffers and stay pending.
With ``upstream=True`` it stands for a client that stops *sending* instead: its first
``pass_bytes`` reach the worker (a request's headers and the start of its message), the rest
never does."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterable
from typing import Any


class StallingProxy:
    def __init__(self, target: str, pass_bytes: int = 16 << 10, upstream: bool = False) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._pass = pass_bytes
        self._upstream = upstream
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self._listen.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            upstream = socket.socket()
            upstream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # stall sooner
            upstream.connect(self._target)
            self._socks += [client, upstream]
            up, down = (self._pass, None) if self._upstream else (None, self._pass)
            threading.Thread(target=self._forward, args=(client, upstream, up),
                             daemon=True).start()
            threading.Thread(target=self._forward, args=(upstream, client, down),
                             daemon=True).start()

    @staticmethod
    def _forward(src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        """Copy src to dst; with ``limit``, stop reading src after that many bytes."""
        sent = 0
        with contextlib.suppress(OSError):
            while limit is None or sent < limit:
                data = src.recv(min(65536, limit - sent) if limit is not None else 65536)
                if not data:
                    return
                dst.sendall(data)
                sent += len(data)

    def close(self) -> None:
        self._closed = True
        for s in [self._listen, *self._socks]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def stop_all(futures: Iterable[Any] = (), closables: Iterable[Any] = ()) -> None:
    """The end of an attack: cancel its calls, then close its channels and proxies."""
    for f in futures:
        f.cancel()
    for c in closables:
        c.close()
