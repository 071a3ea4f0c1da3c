"""Channel settings shared by the sync and asyncio clients: sizes, keepalive, TLS, token.

Activations and outputs travel as single messages: N=64 rows of an lm-head (152064 x 3584)
come back as 64 * 152064 * 4 B = 39 MB in f32, far above gRPC's 4 MiB default, so both
directions are raised to ``max_message_bytes`` (256 MiB, the worker's default limit too).
"""

from __future__ import annotations

import grpc

MAX_MESSAGE_BYTES = 256 << 20


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # keep idle connections of long-lived inference hosts alive through middleboxes
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000)]


def tls_credentials(tls: bool = False, root_certificates: bytes | None = None,
                    private_key: bytes | None = None,
                    certificate_chain: bytes | None = None) -> grpc.ChannelCredentials | None:
    """TLS credentials when asked for (``tls`` or any PEM given), else None (plaintext)."""
    if not (tls or root_certificates or private_key or certificate_chain):
        return None
    if (private_key is None) != (certificate_chain is None):
        raise ValueError("mutual TLS needs both private_key and certificate_chain")
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Bearer token as call metadata (works on plaintext loopback channels as well as TLS,
    unlike gRPC call credentials, which refuse insecure channels)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def aio_channel(target: str, *, tls: bool = False, root_certificates: bytes | None = None,
                private_key: bytes | None = None, certificate_chain: bytes | None = None,
                max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.aio.Channel:
    opts = channel_options(max_message_bytes)
    creds = tls_credentials(tls, root_certificates, private_key, certificate_chain)
    if creds is None:
        return grpc.aio.insecure_channel(target, options=opts)
    return grpc.aio.secure_channel(target, creds, options=opts)


def sync_channel(target: str, *, tls: bool = False, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.Channel:
    opts = channel_options(max_message_bytes)
    creds = tls_credentials(tls, root_certificates, private_key, certificate_chain)
    if creds is None:
        return grpc.insecure_channel(target, options=opts)
    return grpc.secure_channel(target, creds, options=opts)
