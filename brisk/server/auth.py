"""The API key's check and the bearer token of a request: used by the guard in front of every route and by the
Responses store (a stored response is visible only with the key that created it)."""

from __future__ import annotations

import hashlib
import hmac


def bearer_token(authorization: str) -> str | None:
    """The credentials of an `Authorization: Bearer <token>` header; the scheme is case-insensitive (RFC 9110)."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def api_key_matches(authorization: str, api_key: str) -> bool:
    """Constant-time check of an `Authorization: Bearer <key>` header.

    Both sides are hashed first so that the comparison does not even leak the key's length.
    """
    given = hashlib.sha256((bearer_token(authorization) or "").encode()).digest()
    expected = hashlib.sha256(api_key.encode()).digest()
    return hmac.compare_digest(given, expected)
