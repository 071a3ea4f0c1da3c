"""The one error hierarchy of q6serve (no gRPC here: the service maps these to status codes).

Each class names the gRPC status it becomes in ``q6serve.service`` so the mapping stays
obvious; messages carry the numbers that made the call fail.
"""

from __future__ import annotations


class Q6Error(Exception):
    """Base of every error q6serve raises on purpose."""

    grpc_code = "INTERNAL"


class InvalidArgument(Q6Error):
    grpc_code = "INVALID_ARGUMENT"


class FormatError(InvalidArgument):
    """Malformed Q6_K bytes, GGUF files, shapes or dtypes."""


class NotFound(Q6Error):
    grpc_code = "NOT_FOUND"


class AlreadyExists(Q6Error):
    grpc_code = "ALREADY_EXISTS"


class ResourceExhausted(Q6Error):
    """Budget, queue or size limits exceeded."""

    grpc_code = "RESOURCE_EXHAUSTED"


class FailedPrecondition(Q6Error):
    """The call is valid but not in the current state (e.g. a kernel disabled by a flag)."""

    grpc_code = "FAILED_PRECONDITION"


class Unavailable(Q6Error):
    """Draining, or a backend that cannot run here (e.g. CUDA without a GPU)."""

    grpc_code = "UNAVAILABLE"


class Cancelled(Unavailable):
    """Long work (parsing, quantizing) abandoned because the worker is draining."""


class PermissionDenied(Q6Error):
    grpc_code = "PERMISSION_DENIED"


class Unauthenticated(Q6Error):
    grpc_code = "UNAUTHENTICATED"


class DeviceError(Q6Error):
    """The device failed (allocation after reservation, kernel launch, ECC...)."""

    grpc_code = "INTERNAL"
