"""Worker addresses: the check every client and the command line apply (no gRPC import, so
the CLI can check ``--target`` while parsing)."""

from __future__ import annotations

import re

DEFAULT_PORT = 50051
# gRPC name-resolver schemes passed through as they are (dns:///h:p, unix:/path, ...)
_SCHEME = re.compile(r"^(dns|unix|unix-abstract|ipv4|ipv6|vsock|xds|google-c2p):")


def check_target(target: str) -> str:
    """``target`` unchanged if it names a port, else a ValueError saying how to write it.

    gRPC quietly sends a bare host ("10.0.0.5", "dns:///q6serve") to port 443, where no worker
    listens, and the call then fails as UNAVAILABLE with no hint why; so a host without a port
    is refused here (the worker's default port is 50051)."""
    if not target or not target.strip():
        raise ValueError(f"empty target: write HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT})")
    m = _SCHEME.match(target)
    if m and m.group(1) not in ("dns", "ipv4", "ipv6"):
        return target  # unix sockets and other resolvers have no port to check
    hostport = target[m.end():] if m else target
    if hostport.startswith("//"):  # dns://AUTHORITY/host:port
        hostport = hostport[2:].partition("/")[2]
    for address in hostport.split(","):  # ipv4:a:p,b:p
        port = _port_of(address)
        if port is None:
            raise ValueError(f"target {target!r} has no port: write HOST:PORT, e.g. "
                             f"{target.rstrip(':')}:{DEFAULT_PORT} (gRPC would use 443)")
        if not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"target {target!r}: port {port!r} is not 1..65535")
    return target


def _port_of(address: str) -> str | None:
    if address.startswith("["):  # [::1]:50051
        host, _, rest = address.partition("]")
        return rest[1:] if rest.startswith(":") and rest[1:] else None
    if address.count(":") > 1:  # a bare IPv6 address: gRPC needs brackets for a port
        return None
    host, sep, port = address.rpartition(":")
    return port if sep and host and port else None
