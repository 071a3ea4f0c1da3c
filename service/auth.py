"""Optional bearer-token checks (constant-time), applied by the interceptor.

- ``token`` set: every RPC except health needs ``authorization: Bearer <token>`` (the admin
  token is accepted too).
- ``admin_token`` set: LoadWeights, UploadWeight, UnloadWeight and SetFlags need it (missing or
  invalid credentials: UNAUTHENTICATED; the valid user token: PERMISSION_DENIED).
Neither set: open (the default bind is 127.0.0.1).

``identity`` names the caller for what callers own (shared-memory regions): "admin", "user" or
"anonymous" (no valid token, or a worker without tokens, where every caller is the same one).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from q6serve.kernels.errors import PermissionDenied, Unauthenticated

OPEN_SERVICES = ("/grpc.health.v1.Health/",)


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization":
            v = value.decode() if isinstance(value, bytes) else value
            scheme, _, cred = v.partition(" ")
            return cred.strip() if scheme.lower() == "bearer" else None
    return None


def _match(given: str | None, want: str | None) -> bool:
    return (given is not None and want is not None
            and hmac.compare_digest(given.encode(), want.encode()))


@dataclass(frozen=True)
class TokenAuth:
    token: str | None = None
    admin_token: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.token or self.admin_token)

    def check(self, path: str, method: str, admin: bool,
              metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        if not self.enabled or path.startswith(OPEN_SERVICES):
            return
        given = _bearer(metadata)
        is_admin = _match(given, self.admin_token)
        is_user = _match(given, self.token)
        if admin and self.admin_token:
            if is_admin:
                return
            if is_user:  # valid credentials, not enough rights
                raise PermissionDenied(f"{method} needs the admin token")
            raise Unauthenticated(f"{method} needs the admin bearer token")
        if self.token and not (is_admin or is_user):
            raise Unauthenticated(f"{method} needs a valid bearer token")

    def identity(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """Who owns what this caller registers (the interceptor has checked the token)."""
        if not self.enabled:
            return "anonymous"
        given = _bearer(metadata)
        if _match(given, self.admin_token):
            return "admin"
        if _match(given, self.token):
            return "user"
        return "anonymous"
