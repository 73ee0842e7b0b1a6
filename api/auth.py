"""Bearer-token guard for the endpoints that change what kvindex follows.

Queries stay open (routers call them on every request); registering and
removing engines does not. The guard is only attached when a token is
configured, so the OpenAPI schema declares security exactly when the server
enforces it. Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, params
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.errors import ApiError

_bearer = HTTPBearer(auto_error=False, description="the token kvindex was started with")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def require_token(token: str | None) -> list[params.Depends]:
    """Route dependencies that demand ``Authorization: Bearer <token>`` (none if no token)."""
    if token is None:
        return []
    expected = token.encode()

    def check(credentials: Credentials) -> None:
        given = credentials.credentials.encode() if credentials else b""
        if not hmac.compare_digest(given, expected):
            raise ApiError(
                401,
                "missing or wrong bearer token (Authorization: Bearer <token>)",
                {"WWW-Authenticate": "Bearer"},
            )

    return [Depends(check)]
