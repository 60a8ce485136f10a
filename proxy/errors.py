"""OpenAI-style error envelopes: `{"error": {"message", "type", "param", "code"}}`.

SDKs parse this shape into their exception's message; anything else shows up as an opaque blob.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import JSONResponse


class ProxyError(Exception):
    """An error the proxy answers itself (bad input, upstream unreachable, ...)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        unsent: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        # An upstream failure known to come before any byte of the request was written
        # (connect refused or timed out, no pool slot): the upstream cannot bill for it.
        self.unsent = unsent

    def response(self, extra_headers: Mapping[str, str] | None = None) -> JSONResponse:
        """The envelope; this error's own headers win over `extra_headers`."""
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        headers = {**(extra_headers or {}), **self.headers}
        return JSONResponse({"error": error}, status_code=self.status, headers=headers)


class ClientDisconnected(Exception):
    """The client went away; there is nobody to answer."""


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param, code=code)
