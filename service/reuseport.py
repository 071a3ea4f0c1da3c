"""Round-robin of new connections over the front ends' listeners (opt-in:
``Q6SERVE_FRONTEND_ROUND_ROBIN=1``; issue 15, session 9).

The front ends of a ``--frontends N`` worker listen on one port with SO_REUSEPORT, and the
kernel gives each new connection to a listener picked by a hash of its addresses and ports.
That spread is uneven (64 callers over 4 front ends: 11-24 connections each on the H200,
bench/RESULTS.md), and a front end whose loop is saturated serves its callers in turn, so the
callers of the most-connected one make T2's tail. A classic BPF program on the group
(SO_ATTACH_REUSEPORT_CBPF) keeps no state; this attaches an eBPF ``SK_REUSEPORT`` program that
counts connections and hands the k-th to listener ``k mod N`` (a ``REUSEPORT_SOCKARRAY`` map of
the front ends' listeners, by front-end index). A slot with no listener yet (a front end
starting or replaced) falls back to the kernel's hash, as does a race of two SYNs on the count
(they may take the same listener).

The device process makes the maps and the program before it spawns the front ends and passes
their descriptors down (``Popen(pass_fds=...)``); each front end, once its gRPC server listens,
puts its listener into the map at its index and attaches the program to the group (the same
program from each: idempotent). Loading the program needs CAP_BPF (or CAP_SYS_ADMIN) and
CAP_NET_ADMIN where unprivileged BPF is off (most distributions): without them, or on a kernel
that refuses it, a warning is logged and the kernel's hash stays. Off by default: not measured
on the H200 yet.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import socket
import struct
from dataclasses import dataclass

log = logging.getLogger("q6serve.reuseport")

_SYS_BPF = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine)
_MAP_CREATE, _MAP_LOOKUP, _MAP_UPDATE, _PROG_LOAD = 0, 1, 2, 5
_ARRAY, _REUSEPORT_SOCKARRAY = 2, 20
_SK_REUSEPORT = 21  # BPF_PROG_TYPE_SK_REUSEPORT
SO_ATTACH_REUSEPORT_EBPF = 52
_LOOKUP_ELEM, _SK_SELECT_REUSEPORT = 1, 82  # helper ids
_SK_PASS = 1

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _bpf(cmd: int, attr: bytes) -> int:
    """bpf(2); OSError on failure."""
    if _SYS_BPF is None:
        raise OSError(0, f"no bpf syscall number for {os.uname().machine}")
    buf = ctypes.create_string_buffer(attr, max(len(attr), 128))
    r = _libc.syscall(_SYS_BPF, cmd, buf, len(buf))
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return int(r)


def _map(kind: int, key: int, value: int, entries: int) -> int:
    return _bpf(_MAP_CREATE, struct.pack("<IIIII", kind, key, value, entries, 0))


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, dst | src << 4, off, imm)


def program(counter_fd: int, socks_fd: int, n: int) -> bytes:
    """The SK_REUSEPORT program: key = count++ mod n; select socks[key]; SK_PASS (a failed
    select leaves the kernel's hash to pick)."""
    ld_map = 0x18  # BPF_LD | BPF_IMM | BPF_DW, src BPF_PSEUDO_MAP_FD (1): the map's fd
    return b"".join([
        _insn(0xBF, 6, 1),  # r6 = r1 (the context)
        _insn(0x62, 10, 0, -4, 0),  # *(u32 *)(r10 - 4) = 0 (the count's key)
        _insn(0xBF, 2, 10),  # r2 = r10
        _insn(0x07, 2, 0, 0, -4),  # r2 += -4
        _insn(ld_map, 1, 1, 0, counter_fd), _insn(0),  # r1 = the count's map
        _insn(0x85, 0, 0, 0, _LOOKUP_ELEM),  # r0 = lookup(r1, r2)
        _insn(0x15, 0, 0, 12, 0),  # if r0 == 0 goto pass
        _insn(0x61, 7, 0, 0),  # r7 = *(u32 *)(r0)
        _insn(0xB7, 1, 0, 0, 1),  # r1 = 1
        _insn(0xC3, 0, 1, 0, 0),  # lock *(u32 *)(r0) += r1
        _insn(0x94, 7, 0, 0, n),  # w7 %= n
        _insn(0x63, 10, 7, -8),  # *(u32 *)(r10 - 8) = r7 (the listener's key)
        _insn(0xBF, 1, 6),  # r1 = the context
        _insn(ld_map, 2, 1, 0, socks_fd), _insn(0),  # r2 = the listeners' map
        _insn(0xBF, 3, 10),  # r3 = r10
        _insn(0x07, 3, 0, 0, -8),  # r3 += -8
        _insn(0xB7, 4, 0, 0, 0),  # r4 = 0 (flags)
        _insn(0x85, 0, 0, 0, _SK_SELECT_REUSEPORT),  # sk_select_reuseport(r1, r2, r3, r4)
        _insn(0xB7, 0, 0, 0, _SK_PASS),  # pass: r0 = SK_PASS
        _insn(0x95),  # exit
    ])


@dataclass(frozen=True)
class Steering:
    """The descriptors a front end needs: the listeners' map and the program."""

    socks_fd: int
    prog_fd: int
    counter_fd: int

    @property
    def fds(self) -> tuple[int, int, int]:
        return self.socks_fd, self.prog_fd, self.counter_fd

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)

    def count(self) -> int:
        """Connections the program has handed out so far (tests)."""
        value = ctypes.create_string_buffer(4)
        key = ctypes.create_string_buffer(4)
        _bpf(_MAP_LOOKUP, struct.pack("<IIQQQ", self.counter_fd, 0, ctypes.addressof(key),
                                      ctypes.addressof(value), 0))
        return int(struct.unpack("<I", value.raw)[0])


def make(n: int) -> Steering | None:
    """The maps and the program for ``n`` front ends (the device process, before it spawns
    them), or None with a warning where the kernel or the privileges refuse."""
    fds: list[int] = []
    try:
        counter = _map(_ARRAY, 4, 4, 1)
        fds.append(counter)
        socks = _map(_REUSEPORT_SOCKARRAY, 4, 8, n)
        fds.append(socks)
        insns = program(counter, socks, n)
        lic = ctypes.create_string_buffer(b"MIT")
        code = ctypes.create_string_buffer(insns, len(insns))
        prog = _bpf(_PROG_LOAD, struct.pack("<IIQQIIQII", _SK_REUSEPORT, len(insns) // 8,
                                            ctypes.addressof(code), ctypes.addressof(lic),
                                            0, 0, 0, 0, 0))
    except OSError as e:
        for fd in fds:
            os.close(fd)
        log.warning("front-end round robin (Q6SERVE_FRONTEND_ROUND_ROBIN) is off: the kernel "
                    "refused its eBPF program (%s); connections go by the kernel's hash", e)
        return None
    return Steering(socks, prog, counter)


def listener(port: int) -> int | None:
    """This process's listening TCP socket on ``port`` (the gRPC server's), as an fd."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:["):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if (s.type == socket.SOCK_STREAM
                    and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    and s.getsockname()[1] == port):
                return fd
        except OSError:
            pass
        finally:
            s.close()
    return None


def join(steering: tuple[int, int, int], index: int, port: int, fd: int | None = None,
         ) -> bool:
    """A front end: put its listener on ``port`` (``fd``: that one) into the map at
    ``index`` and attach the program to the group. False (logged) where that fails: the
    kernel's hash stays."""
    socks_fd, prog_fd, _ = steering
    if fd is None:
        fd = listener(port)
    try:
        if fd is None:
            raise OSError(0, f"no listening socket on port {port} in this process")
        key, value = struct.pack("<I", index), struct.pack("<Q", fd)
        kb, vb = ctypes.create_string_buffer(key, 4), ctypes.create_string_buffer(value, 8)
        _bpf(_MAP_UPDATE, struct.pack("<IIQQQ", socks_fd, 0, ctypes.addressof(kb),
                                      ctypes.addressof(vb), 0))
        with socket.socket(fileno=os.dup(fd)) as s:
            s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_EBPF, prog_fd)
    except OSError as e:
        log.warning("front end %d takes connections by the kernel's hash: %s", index, e)
        return False
    return True
