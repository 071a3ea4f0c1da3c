"""The one channel builder of the sync, asyncio and sharded clients: target check, message
sizes, keepalive, TLS, token, load balancing.

Activations and outputs travel as single messages: N=64 rows of an lm-head (152064 x 3584)
come back as 64 * 152064 * 4 B = 39 MB in f32, far above gRPC's 4 MiB default, so both
directions are raised to ``max_message_bytes`` (256 MiB, the worker's default limit too).
"""

from __future__ import annotations

import grpc

from .targets import DEFAULT_PORT, check_target  # noqa: F401  (re-exported)

MAX_MESSAGE_BYTES = 256 << 20


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES, *,
                    round_robin: bool = False) -> list[tuple[str, int | str]]:
    """Options of every client channel; ``round_robin`` spreads calls over every address a
    name resolves to (replicas behind a DNS name; with the default pick_first, one is used)."""
    opts: list[tuple[str, int | str]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # keep the idle connections of long-lived inference hosts alive through middleboxes;
        # pings only while calls are open, well above the worker's minimum ping interval
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000)]
    if round_robin:
        opts += [("grpc.lb_policy_name", "round_robin"),
                 # re-resolve soon after a replica goes away or a new one appears
                 ("grpc.dns_min_time_between_resolutions_ms", 5_000)]
    return opts


def tls_credentials(tls: bool = False, root_certificates: bytes | None = None,
                    private_key: bytes | None = None,
                    certificate_chain: bytes | None = None) -> grpc.ChannelCredentials | None:
    """TLS credentials when asked for (``tls`` or any PEM given), else None (plaintext). A PEM
    given empty is refused: read as "none given", it sent the channel out in plaintext."""
    pems = {"root_certificates": root_certificates, "private_key": private_key,
            "certificate_chain": certificate_chain}
    if not tls and all(v is None for v in pems.values()):
        return None
    for name, v in pems.items():
        if v is not None and not v:
            raise ValueError(f"{name} is empty: give PEM bytes, or None")
    if (private_key is None) != (certificate_chain is None):
        raise ValueError("mutual TLS needs both private_key and certificate_chain")
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Bearer token as call metadata (works on plaintext loopback channels as well as TLS,
    unlike gRPC call credentials, which refuse insecure channels)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def make_channel(target: str, *, aio: bool = False,
                 credentials: grpc.ChannelCredentials | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, private_key: bytes | None = None,
                 certificate_chain: bytes | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES,
                 round_robin: bool = False) -> grpc.Channel | grpc.aio.Channel:
    """A sync (or ``aio``) channel to ``target``: TLS from ``credentials`` or the PEM bytes
    (plaintext when neither is given), the options of :func:`channel_options`."""
    check_target(target)
    if credentials is None:
        credentials = tls_credentials(tls, root_certificates, private_key, certificate_chain)
    elif tls or any(v is not None for v in (root_certificates, private_key, certificate_chain)):
        raise ValueError("give credentials or the TLS PEM arguments, not both")
    opts = channel_options(max_message_bytes, round_robin=round_robin)
    mod = grpc.aio if aio else grpc
    if credentials is None:
        return mod.insecure_channel(target, options=opts)
    return mod.secure_channel(target, credentials, options=opts)


def sync_channel(target: str, **kw: object) -> grpc.Channel:
    return make_channel(target, aio=False, **kw)  # type: ignore[arg-type,return-value]


def aio_channel(target: str, **kw: object) -> grpc.aio.Channel:
    return make_channel(target, aio=True, **kw)  # type: ignore[arg-type,return-value]
