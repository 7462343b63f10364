"""API keys: a request must send `Authorization: Bearer KEY` (as OpenAI's clients do) with one of
the server's keys, where it has any; with several, each key is a client of its own for the
per-client limits (admission.py)."""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from .api_errors import APIError


class ApiKeys:
    def __init__(self, keys: tuple[str, ...]):
        # the keys' digests: compared with the digest of what a request sends, so the comparison
        # takes the same time whatever the lengths (hmac.compare_digest only hides the content)
        self.digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    def check(self, request: web.Request) -> int | None:
        """Which key the request sent (its index): a 401 if none of them; None without keys."""
        if not self.digests:
            return None
        scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "You didn't provide an API key. Send it in an Authorization header using Bearer "
                                "auth (Authorization: Bearer YOUR_KEY).", code="invalid_api_key")
        given = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        matches = [hmac.compare_digest(given, digest) for digest in self.digests]  # (each compared)
        if not any(matches):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return matches.index(True)

    def client_of(self, request: web.Request) -> str:
        """Who the per-client limits count a request against: its key where the server has several,
        else its address."""
        if len(self.digests) > 1:
            return f"key {self.check(request)}"  # (checked already: this finds which)
        return request.remote or "unknown"
