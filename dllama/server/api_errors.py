"""Errors answered as OpenAI answers them."""

from __future__ import annotations


class APIError(Exception):
    """An error answered as OpenAI does: HTTP status + {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, extra: dict | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.extra = extra or {}
        # seconds, in a Retry-After header (a 429 or 503 without one gets 1)
        self.retry_after = retry_after if retry_after is not None else 1 if status in (429, 503) else None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)
