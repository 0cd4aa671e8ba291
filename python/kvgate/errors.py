"""OpenAI-shaped errors: the one place where an outcome becomes an HTTP status and body.

Every error kvgate answers uses OpenAI's body shape (openai-openapi ``Error`` schema):
``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}`` —
all four keys present, ``param`` and ``code`` possibly ``null``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson

__all__ = [
    "GatewayError",
    "error_body",
    "invalid_value",
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


def invalid_value(param: str, message: str) -> GatewayError:
    """400 ``invalid_value`` (``invalid_request_error``) for the query parameter or field
    ``param``, explained by ``message``."""
    return GatewayError(400, message, "invalid_request_error", param=param, code="invalid_value")


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


def upstream_redirect(status: int) -> GatewayError:
    """502 ``upstream_redirect``: the engine answered a redirect (3xx but 304), which the
    gateway does not follow (the request's prompt and the backend's key go to the backend's URL only)."""
    return GatewayError(
        502,
        f"upstream answered {status} (a redirect, not followed): point the backend's url at "
        "the engine itself",
        "server_error",
        code="upstream_redirect",
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


#: Context-overflow messages of the engines, each with the group that holds the context
#: window (tokens): vLLM and OpenAI ("This model's maximum context length is N tokens. However,
#: you requested ..."), SGLang ("... exceeds the model's maximum context length of N tokens ...";
#: "The input (X tokens) is longer than the model's context length (N tokens)."), llama.cpp's
#: server ("request (X tokens) exceeds the available context size (N tokens), try increasing
#: it", type ``exceed_context_size_error``), TGI's 422 validation error ("`inputs` tokens +
#: `max_new_tokens` must be <= N" or "`inputs` must have less than N tokens").
_CONTEXT_OVERFLOW = (
    re.compile(r"maximum context length (?:is|of) (\d+) tokens"),
    re.compile(r"longer than the model's context length \((\d+) tokens\)"),
    re.compile(r"exceeds the available context size \((\d+) tokens\)"),
    re.compile(r"`inputs` tokens \+ `max_new_tokens` must be <= (\d+)"),
    re.compile(r"`inputs` must have less than (\d+) tokens"),
)

#: Engine error types that mean a context overflow whatever the message says (llama.cpp).
_OVERFLOW_TYPES = frozenset({"exceed_context_size_error"})


def _context_window(message: str, type_: object, data: dict[str, Any] | None) -> int | None:
    """The context window (tokens) an engine's context-overflow error names, ``-1`` when it is
    an overflow that names none, ``None`` when ``message`` is not a context overflow."""
    for pattern in _CONTEXT_OVERFLOW:
        found = pattern.search(message)
        if found is not None:
            return int(found.group(1))
    if type_ in _OVERFLOW_TYPES:
        n_ctx = data.get("n_ctx") if data is not None else None
        return n_ctx if type(n_ctx) is int else -1
    return None


def reshape_upstream_error(status: int, body: bytes) -> bytes:
    """Turn an engine's error body into OpenAI's shape, keeping its message.

    Engines differ: vLLM < 0.10.1 sends a flat ``{"object": "error", "message",
    "type": "BadRequestError", "code": 400}``; vLLM ≥ 0.10.1 nests it under ``error`` with an
    integer ``code``; SGLang sends vLLM's flat shape; TGI sends ``{"error": str, "error_type":
    str}``; llama.cpp's server ``{"error": {"code": int, "message", "type"}}`` (plus
    ``n_prompt_tokens`` and ``n_ctx`` on a context overflow). The result always has the four
    OpenAI keys; an integer ``code`` (an HTTP status) becomes ``null``.

    A context overflow in any of these engines' wordings (:data:`_CONTEXT_OVERFLOW`) comes out
    as OpenAI's: ``type: "invalid_request_error"``, ``code: "context_length_exceeded"``, and a
    message holding the phrase "maximum context length is N tokens" whenever the engine named
    the window N (clients search the message for it; it is put in front of the engine's own
    message when that words it differently). A body that is not JSON (an HTML 502 page of a
    proxy between kvgate and the engine, say) is not relayed: the message says only which
    status the engine answered. A body that is already OpenAI-shaped and no context overflow
    passes unchanged. The status is the caller's to keep.

    Args:
        status: the upstream HTTP status (≥ 400).
        body: the upstream body bytes.

    Returns:
        An OpenAI error body (bytes).
    """
    try:
        data: Any = orjson.loads(body) if body else None
        parsed = True
    except orjson.JSONDecodeError:
        data, parsed = None, False
    message: str | None = None
    type_: str | None = None
    param: str | None = None
    code: Any = None
    holder: dict[str, Any] | None = None
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict):
            holder = inner
            message, type_ = inner.get("message"), inner.get("type")
            param, code = inner.get("param"), inner.get("code")
            if (
                isinstance(message, str)
                and isinstance(type_, str)
                and (code is None or isinstance(code, str))
                and set(inner) >= {"message", "type", "param", "code"}
                and (
                    code == "context_length_exceeded"
                    or _context_window(message, type_, inner) is None
                )
            ):
                return body
        elif isinstance(inner, str):  # TGI
            message, type_ = inner, data.get("error_type")
        elif data.get("object") == "error" or "message" in data:  # vLLM < 0.10.1, SGLang
            holder = data
            message, type_ = data.get("message"), data.get("type")
            param, code = data.get("param"), data.get("code")
    if not isinstance(message, str):
        if not parsed or data is None:
            what = "empty body" if not body.strip() else "non-JSON body"
            message = f"The upstream engine answered {_status_text(status)} ({what})."
        else:
            message = body.decode("utf-8", "replace").strip()[:2000]
    if not isinstance(code, str):
        code = None
    window = _context_window(message, type_, holder)
    if window is not None or code == "context_length_exceeded":
        code, type_ = "context_length_exceeded", "invalid_request_error"
        if (
            window is not None
            and window >= 0
            and f"maximum context length is {window} tokens" not in message
        ):
            message = f"This model's maximum context length is {window} tokens. {message}"
    if not isinstance(type_, str) or (type_.endswith("Error") and "_" not in type_):
        # exception-class names (BadRequestError) are not OpenAI types
        type_ = _STATUS_TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
    if not isinstance(param, str):
        param = None
    return error_body(message, type_, param, code)


def _status_text(status: int) -> str:
    """``502 Bad Gateway``: the status and its reason phrase (just the number when unknown)."""
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return str(status)
