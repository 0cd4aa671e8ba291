"""OpenAI-shaped errors: the one place where an outcome becomes an HTTP status and body.

Every error kvgate answers uses OpenAI's body shape (openai-openapi ``Error`` schema, ENGINES.md
§5.1): ``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}`` —
all four keys present, ``param`` and ``code`` possibly ``null``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

__all__ = [
    "GatewayError",
    "error_body",
    "method_not_allowed",
    "reshape_upstream_error",
    "upstream_failed",
    "upstream_timeout",
]


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> bytes:
    """Serialise an OpenAI error body.

    Args:
        message: human-readable text.
        type_: OpenAI ``type`` (``invalid_request_error``, ``requests``, ``tokens``,
            ``server_error``, ...).
        param: the offending request field, or ``None``.
        code: a machine-readable code (``context_length_exceeded``, ``rate_limit_exceeded``,
            ...), or ``None``.

    Returns:
        The JSON body as bytes.
    """
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


@dataclass(slots=True)
class GatewayError(Exception):
    """An error the gateway answers itself: status, OpenAI error fields and extra headers.

    Raised inside the request pipeline and turned into a response once, by the handler.
    """

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def __str__(self) -> str:
        return f"{self.status} {self.code or self.type}: {self.message}"

    def body(self) -> bytes:
        """The OpenAI-shaped JSON body (bytes)."""
        return error_body(self.message, self.type, self.param, self.code)


def method_not_allowed(method: str, path: str, allow: str) -> GatewayError:
    """405 ``method_not_allowed`` with ``Allow: <allow>`` for ``method`` on ``path``."""
    return GatewayError(
        405,
        f"{method} is not allowed on {path}; use {allow}.",
        "invalid_request_error",
        code="method_not_allowed",
        headers={"Allow": allow},
    )


def upstream_timeout(what: str) -> GatewayError:
    """504 ``upstream_timeout``: the engine did not answer (``what``) within its timeout."""
    return GatewayError(504, f"upstream {what} timed out", "server_error", code="upstream_timeout")


def upstream_failed(exc: BaseException, code: str = "upstream_unreachable") -> GatewayError:
    """502: the engine could not be reached (``upstream_unreachable``) or broke off mid-answer
    (``upstream_broken``); the message names the transport error's class."""
    what = "unreachable" if code == "upstream_unreachable" else "broke"
    return GatewayError(
        502, f"upstream {what}: {exc.__class__.__name__}", "server_error", code=code
    )


_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "requests",
}


def reshape_upstream_error(status: int, body: bytes) -> bytes:
    """Turn an engine's error body into OpenAI's shape, keeping its message.

    Engines differ (ENGINES.md §5.1): vLLM < 0.10.1 sends a flat ``{"object": "error", "message",
    "type": "BadRequestError", "code": 400}``; vLLM ≥ 0.10.1 nests it under ``error`` with an
    integer ``code``; TGI sends ``{"error": str, "error_type": str}``; llama.cpp ``{"error":
    {"code": int, "message", "type"}}``. The result always has the four OpenAI keys; an integer
    ``code`` (an HTTP status) becomes ``null``, and a vLLM context-length message gets OpenAI's
    ``context_length_exceeded`` code. A body that is already OpenAI-shaped passes unchanged;
    an unparseable body becomes the message text.

    Args:
        status: the upstream HTTP status (≥ 400).
        body: the upstream body bytes.

    Returns:
        An OpenAI error body (bytes).
    """
    try:
        data: Any = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        data = None
    message: str | None = None
    type_: str | None = None
    param: str | None = None
    code: Any = None
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict):
            message, type_ = inner.get("message"), inner.get("type")
            param, code = inner.get("param"), inner.get("code")
            if (
                isinstance(message, str)
                and isinstance(type_, str)
                and (code is None or isinstance(code, str))
                and set(inner) >= {"message", "type", "param", "code"}
            ):
                return body
        elif isinstance(inner, str):  # TGI
            message, type_ = inner, data.get("error_type")
        elif data.get("object") == "error" or "message" in data:  # vLLM < 0.10.1
            message, type_ = data.get("message"), data.get("type")
            param, code = data.get("param"), data.get("code")
    if not isinstance(message, str):
        text = body.decode("utf-8", "replace").strip()
        message = text[:2000] or f"upstream returned HTTP {status}"
    if not isinstance(code, str):
        code = None
    if code is None and "maximum context length" in message:
        code = "context_length_exceeded"
    if not isinstance(type_, str) or (type_.endswith("Error") and "_" not in type_):
        # exception-class names (BadRequestError) are not OpenAI types
        type_ = _STATUS_TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
    if not isinstance(param, str):
        param = None
    return error_body(message, type_, param, code)
