"""Bearer-token guard for the calls that change what kvindex follows or answers.

Plain queries stay open (routers call them on every request); registering
and removing engines, and recording routed entries (which steer every
router's answers for their TTL), do not. The guard is only attached when a
token is configured, so the OpenAPI schema declares security exactly when
the server enforces it. Tokens are compared in constant time.

:func:`authenticated` also tells the reads that hold a secret (an engine's
``hash_seed``) whether to show it: only to a caller who presented the token.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import Depends, Request, params
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param

from api.errors import ApiError

_bearer = HTTPBearer(auto_error=False, description="the token kvindex was started with")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
#: The scheme FastAPI names ``_bearer`` by in the OpenAPI components.
SCHEME = "HTTPBearer"


def authenticated(token: str | None, request: Request) -> bool:
    """Whether the request carries the configured token (never, with none configured:
    then nobody has proven anything)."""
    if token is None:
        return False
    scheme, given = get_authorization_scheme_param(request.headers.get("Authorization"))
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), token.encode())


def demand_token(token: str | None, request: Request) -> None:
    """401 unless the request carries the configured token (nothing to demand without one)."""
    if token is not None and not authenticated(token, request):
        raise ApiError(
            401,
            "missing or wrong bearer token (Authorization: Bearer <token>)",
            {"WWW-Authenticate": "Bearer"},
        )


def require_token(token: str | None) -> list[params.Depends]:
    """Route dependencies that demand ``Authorization: Bearer <token>`` (none if no token)."""
    if token is None:
        return []

    def check(request: Request, _: Credentials) -> None:  # Credentials: declares the scheme
        demand_token(token, request)

    return [Depends(check)]


def optional_security(token: str | None) -> dict[str, Any]:
    """``openapi_extra`` for a route that takes the token for some requests only: open,
    or with the bearer scheme (nothing to declare without a token)."""
    return {} if token is None else {"security": [{}, {SCHEME: []}]}
