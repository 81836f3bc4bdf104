"""API keys: `Authorization: Bearer KEY` on everything but /health, /metrics, /version and the API docs.

An ASGI middleware, so a request without a valid key is answered 401 (OpenAI error envelope)
before any route, body read or model work. Keys are compared in constant time, against every
configured key whatever matched. HTTP Basic credentials (any user name, the key as password) are
accepted too, because that is what a browser can send: the dashboard answers 401 with a Basic
challenge, the browser asks for the key once, and its own fetches of /v1/status carry it. Nothing
here logs a header, a key or a prompt.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json

from router.protocol import APIError

__all__ = ["OPEN_PATHS", "APIKeyMiddleware"]

# Probes, scrapers and version checks must work without a key; the docs only describe the API.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
BROWSER_PAGES = frozenset({"/dashboard"})


def _credential(authorization: bytes) -> bytes | None:
    scheme, _, value = authorization.strip().partition(b" ")
    scheme, value = scheme.lower(), value.strip()
    if scheme == b"bearer" and value:
        return value
    if scheme == b"basic" and value:
        try:
            user, _, password = base64.b64decode(value, validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return None
        return password or user
    return None


class APIKeyMiddleware:
    def __init__(self, app, keys: tuple[str, ...]) -> None:
        self.app = app
        self._keys = tuple(k.encode("utf-8") for k in keys)

    def authorized(self, authorization: bytes | None) -> bool:
        candidate = _credential(authorization) if authorization else None
        if candidate is None:
            return False
        matched = False
        for key in self._keys:  # every key, whichever matches: no timing hint about which or how many
            matched |= hmac.compare_digest(candidate, key)
        return matched

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self._keys or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if self.authorized(authorization):
            await self.app(scope, receive, send)
            return
        reason = "no API key was sent" if authorization is None else "the API key is not valid"
        error = APIError(
            f"{reason}: send `Authorization: Bearer <key>` with one of this server's API keys",
            401,
            None,
            "AuthenticationError",
        )
        challenge = b'Basic realm="baton", charset="UTF-8"' if scope["path"] in BROWSER_PAGES else b"Bearer"
        body = json.dumps(error.body()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", challenge),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
