"""The inference request handler: body cap → auth → analysis → admission → relay → settle.

Order (issue 5, DESIGN.md): the body-size cap is checked from ``Content-Length`` before a byte of
the body is read (413), then the tenant is identified (401), the request analysed by the Rust
analyser (400 / 404), admitted by the Rust core (429 for a tenant over its quota, 503 when the
backend is saturated or the class is shed), forwarded, and finally its reservation settled with
the real usage. Refusals charge nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from kvgate._core import MAX_AMOUNT
from kvgate.errors import GatewayError, method_not_allowed
from kvgate.proxy.prepared import PreparedResponse, Reply, prepared
from kvgate.proxy.relay import RelayResult, relay

if TYPE_CHECKING:
    from kvgate.app import Gateway

__all__ = ["handle_inference", "handle_passthrough"]

#: Bodies shorter than this (bytes) are analysed on the event loop; longer ones in a thread.
INLINE_ANALYSIS_BYTES = 16_384

INFERENCE_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


def error_response(request: web.BaseRequest, err: GatewayError) -> PreparedResponse:
    """The client-facing response to ``request`` for a :class:`GatewayError`: its status, its
    headers (``Connection: close`` closes the connection after it) and the OpenAI error body."""
    headers = [("Content-Type", "application/json")]
    close = False
    if err.headers:
        for name, value in err.headers.items():
            if name.lower() == "connection":
                close = close or value.lower() == "close"
            else:
                headers.append((name, value))
    return prepared(request, err.status, headers, err.body(), close)


async def read_body(request: web.BaseRequest, max_body_bytes: int, body_seconds: float) -> bytes:
    """Read the request body under the byte cap and the client body timeout.

    ``Content-Length`` over the cap is refused before reading; a chunked body is cut off when it
    passes the cap (aiohttp's ``client_max_size``, set to the same cap by the app); a body that
    has not fully arrived after ``body_seconds`` is cut off.

    A client that sent ``Expect: 100-continue`` is told to go on (``100 Continue``) once the
    size cap passed.

    Raises:
        GatewayError: 413 ``request_too_large``; 408 ``request_timeout``; 417
            ``expectation_failed`` (an ``Expect`` other than ``100-continue``).
    """
    body = body_if_complete(request, max_body_bytes)
    if body is not None:
        return body
    await _continue(request)
    try:
        async with asyncio.timeout(body_seconds):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(None, max_body_bytes) from None
    except RequestPayloadError as exc:  # undecodable Content-Encoding, broken chunking
        raise _unreadable(exc) from None
    except TimeoutError:
        raise GatewayError(
            408,
            f"The request body did not arrive within {body_seconds:g} s.",
            "invalid_request_error",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None


async def _continue(request: web.BaseRequest) -> None:
    """``Expect: 100-continue`` (RFC 9110 §10.1.1): tell the client to send the body now that
    its head passed the checks that need no body (the size cap). Any other expectation → 417.

    Raises:
        GatewayError: 417 ``expectation_failed``.
    """
    expect = request.headers.get("Expect")
    if expect is None:
        return
    _check_expectation(expect)
    if request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim response is not part of the answer


def _check_expectation(expect: str) -> None:
    """Only ``100-continue`` can be met (RFC 9110 §10.1.1).

    Raises:
        GatewayError: 417 ``expectation_failed``.
    """
    if expect.lower() != "100-continue":
        raise GatewayError(
            417,
            f"Unknown Expect: {expect!r} (only 100-continue is supported).",
            "invalid_request_error",
            code="expectation_failed",
            headers={"Connection": "close"},
        )


def body_if_complete(request: web.BaseRequest, max_body_bytes: int) -> bytes | None:
    """The body, when all of it has already arrived (it usually comes with the head), taken
    without waiting; ``None`` when part of it is still to come (then :func:`read_body` waits).

    Raises:
        GatewayError: 413 ``request_too_large`` (``Content-Length``, or the bytes received,
            over the cap); 400 ``invalid_body`` (undecodable ``Content-Encoding``, broken
            chunking); 417 ``expectation_failed`` (an ``Expect`` other than ``100-continue``,
            also when the body came with the head).
    """
    length = request.content_length
    if length is not None and length > max_body_bytes:
        raise _too_large(length, max_body_bytes)
    content = request.content
    if not content.is_eof():
        return None
    headers = request.headers
    if "Expect" in headers:  # the body is here: no 100 to send, but the expectation is checked
        _check_expectation(headers["Expect"])
    try:
        body = content.read_nowait()
    except RequestPayloadError as exc:
        raise _unreadable(exc) from None
    if len(body) > max_body_bytes:  # chunked: no Content-Length to check first
        raise _too_large(None, max_body_bytes)
    return body


def _unreadable(exc: RequestPayloadError) -> GatewayError:
    return GatewayError(
        400,
        f"The request body could not be read: {exc.__cause__ or exc}.",
        "invalid_request_error",
        code="invalid_body",
        headers={"Connection": "close"},
    )


def _too_large(length: int | None, cap: int) -> GatewayError:
    size = f"{length} bytes" if length is not None else "more than the cap"
    return GatewayError(
        413,
        f"Request body is {size}; this gateway accepts at most {cap} bytes.",
        "invalid_request_error",
        code="request_too_large",
        headers={"Connection": "close"},
    )


def rewrite_body(body: bytes, analysis: Any, add_usage: bool) -> bytes:
    """The body to forward: the client's bytes, or a copy with what kvgate must add:
    ``stream_options.include_usage`` (streamed requests, so the engine reports usage) and the
    ``default_max_tokens`` it reserved for (``analysis.inject_max_tokens``).

    When those keys are absent (the usual case) the members are spliced in after the opening
    ``{`` and every byte the client sent is forwarded as sent. When one is present (say
    ``"stream_options": {}`` or ``"max_tokens": null``) the body is decoded and re-encoded with
    the standard ``json`` module, which keeps integers of any size exact (orjson would turn
    those above 64 bits into floats) and writes ASCII escapes.
    """
    inject = getattr(analysis, "inject_max_tokens", None)
    if not add_usage and inject is None:
        return body
    data = orjson.loads(body)
    members = []
    if add_usage and "stream_options" not in data:
        members.append(b'"stream_options":{"include_usage":true}')
    if inject is not None and "max_tokens" not in data:
        members.append(b'"max_tokens":%d' % inject)
    start = len(body) - len(body.lstrip())
    if len(members) == add_usage + (inject is not None) and body[start : start + 1] == b"{":
        rest = body[start + 1 :]
        sep = b"" if rest.lstrip().startswith(b"}") else b","
        return body[: start + 1] + b",".join(members) + sep + rest
    data = json.loads(body)
    if add_usage:
        opts = data.get("stream_options")
        data["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    if inject is not None:
        data["max_tokens"] = inject
    return json.dumps(data, separators=(",", ":")).encode()


async def handle_inference(gw: Gateway, request: web.BaseRequest) -> Reply:
    """``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``."""
    started = time.perf_counter()
    route = request.path
    tenant = None
    try:
        # the common case without a single await: body already here, small enough to analyse
        # on the loop
        body = body_if_complete(request, gw.max_body_bytes)
        if body is None:
            body = await read_body(request, gw.max_body_bytes, gw.timeouts.client_body)
        tenant, priority = gw.authenticate(request)
        if len(body) < INLINE_ANALYSIS_BYTES:
            model, analysis = gw.analyze_now(route, body)
        else:
            model, analysis = await gw.analyze_in_thread(route, body)
        backend = gw.pick_backend(model, tenant)
    except GatewayError as err:
        gw.metrics.request_done(None, tenant, f"rejected_{err.status}")
        return error_response(request, err)
    tokens = analysis.reserved_tokens
    queue = gw.queue
    # fast path: nobody queued, admitted at once; else the priority wait queue decides
    decision = (
        gw.controller.admit(backend.id, tenant.id, priority, tokens)
        if queue is None or not queue.waiting
        else None
    )
    if decision is None or not decision.admitted:
        if decision is None or not gw.refusal_stands(request, backend, tenant, decision):
            decision = await gw.admit_slow(request, backend, tenant, priority, tokens, decision)
        if not decision.admitted:
            response, reason = gw.rejection_response(
                request, decision, backend, tenant, model, tokens
            )
            gw.metrics.rejected(backend, tenant, reason, time.perf_counter() - started)
            return response
    gw.metrics.admitted(backend, tenant, tokens, time.perf_counter() - started)

    stream = bool(analysis.stream)
    add_usage = stream and not analysis.include_usage and route != "/v1/embeddings"
    result = RelayResult()
    try:
        forward = rewrite_body(body, analysis, add_usage)
        return await relay(
            request,
            gw.session,
            backend.url + route,
            forward,
            stream=stream,
            strip_usage_chunk=add_usage,
            timeouts=gw.timeouts,
            watchdog=gw.watchdog,
            build=partial(gw.controller.relay_http, backend.id, tenant.id),
            count_text=model.count_text,
            result=result,
            retry_hint=partial(gw.retry_hint, backend),
        )
    except GatewayError as err:
        return error_response(request, err)
    finally:
        actual = _actual_tokens(analysis, result)
        decision.release(actual)
        if queue is not None and queue.waiting:
            queue.notify()
        gw.metrics.settled(backend, tenant, tokens, actual, result)


def _actual_tokens(analysis: Any, result: RelayResult) -> int:
    """Tokens to charge: prompt (engine's count if it gave one, else ours) + completion delivered.

    Charged nothing: a request that never reached the engine (unreachable upstream), one whose
    engine did not answer before the ``first_byte`` timeout, and one the engine answered with
    an error before any completion token was delivered (a 4xx/5xx status, or an error event
    first in a stream). README "What a request is charged" lists every outcome.
    """
    outcome = result.outcome
    if outcome == "upstream_unreachable":
        return 0
    if outcome == "upstream_timeout" and result.ttft is None:
        return 0
    if outcome == "upstream_error" and result.completion_tokens == 0:
        return 0
    prompt = result.prompt_tokens if result.prompt_tokens is not None else analysis.prompt_tokens
    # each count is at most MAX_AMOUNT (relay._take_usage); their sum must be too
    return min(int(prompt) + int(result.completion_tokens), MAX_AMOUNT)


async def handle_passthrough(gw: Gateway, request: web.BaseRequest) -> Reply:
    """Anything else under ``/v1/``: forwarded with a slot but no token charge (DESIGN.md).
    A wrong method on an inference route is answered here (405), not by the engine."""
    if request.path in INFERENCE_ROUTES:
        return error_response(request, method_not_allowed(request.method, request.path, "POST"))
    try:
        body = await read_body(request, gw.max_body_bytes, gw.timeouts.client_body)
        tenant, priority = gw.authenticate(request)
        backend = gw.default_backend()
    except GatewayError as err:
        return error_response(request, err)
    decision = gw.controller.admit(backend.id, tenant.id, priority, 0) if not gw.queue else None
    if decision is None or not decision.admitted:
        decision = await gw.admit_slow(request, backend, tenant, priority, 0, decision)
        if not decision.admitted:
            response, reason = gw.rejection_response(request, decision, backend, tenant, None, 0)
            gw.metrics.rejected(backend, tenant, reason, 0.0)
            return response
    try:
        return await gw.forward_raw(request, backend, body)
    except GatewayError as err:
        return error_response(request, err)
    finally:
        decision.release(0)
        if gw.queue:
            gw.queue.notify()
