"""The request handlers: body cap → auth → analysis → admission → relay → settle.

:func:`handle_inference` serves the inference routes, :func:`handle_forward` any other route
when the gateway's ``other_routes`` is ``forward`` (the route is decided before either is
called, by :mod:`kvgate.proxy.routes`). Each stage is a call into its own module, in order:
:mod:`kvgate.admission.identity` (who), :mod:`kvgate.routing` (what it asks, which backend),
:mod:`kvgate.admission.stage` (admitted, waited for, or refused), :mod:`kvgate.proxy.relay`
(forwarded and relayed), :mod:`kvgate.proxy.settle` (released and charged); this module holds
the HTTP around them (the body, the refusal answers) and no admission policy.

Order (docs/admission.md): the body-size cap is checked from ``Content-Length`` before a byte of
the body is read (413), then the tenant is identified (401), the request analysed by the Rust
analyser (400 / 404), admitted by the Rust core (429 for a tenant over its quota, 503 when the
backend is saturated or the class is shed), forwarded, and finally its reservation settled with
the real usage. Refusals charge nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from kvgate._core import MAX_AMOUNT
from kvgate.accesslog import (
    request_id,
    upstream_trace_headers,
    with_request_id,
)
from kvgate.admission.retry_hint import slot_hint
from kvgate.admission.stage import admit, holds_slot
from kvgate.admission.waiting import queue_hint
from kvgate.errors import GatewayError
from kvgate.proxy.prepared import PreparedResponse, Reply, connection_header, error_response
from kvgate.proxy.relay import RelayResult, relay
from kvgate.proxy.routes import normalize_path
from kvgate.proxy.settle import actual_tokens, end_request, release_at_end, settle
from kvgate.routing import analyze_in_thread, analyze_now, model_of, pick_any_backend, pick_backend

if TYPE_CHECKING:
    from kvgate.app import Gateway, Tenant

__all__ = ["FORWARD_RESERVATION", "authenticate", "handle_forward", "handle_inference"]

#: Bodies shorter than this (bytes) are analysed on the event loop; longer ones in a thread.
INLINE_ANALYSIS_BYTES = 16_384

#: The routes whose streams kvgate asks usage for (``stream_options.include_usage``); a
#: Responses stream always ends with its usage (``response.completed``).
USAGE_OPTION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
RESPONSES_ROUTE = "/v1/responses"

#: The routes whose non-streamed requests go upstream as streams (the backend's
#: ``stream_upstream``), their answer assembled by kvgate (:mod:`kvgate.proxy.assemble`);
#: embeddings have no stream mode.
STREAM_UPSTREAM_ROUTES = USAGE_OPTION_ROUTES | {RESPONSES_ROUTE}

#: Tokens a forwarded request (``other_routes: forward``) reserves: what it will use is unknown
#: before the engine answers, and one token is enough for a tenant whose bucket is empty to be
#: refused; the usage the engine reports is charged when it ends.
FORWARD_RESERVATION = 1


def authenticate(gw: Gateway, request: web.BaseRequest) -> tuple[Tenant, str]:
    """The tenant and priority class (``critical`` | ``standard`` | ``sheddable``) of the
    request's key (:meth:`kvgate.admission.identity.TenantTable.identify`), from its head alone,
    before its body is read.

    Raises:
        GatewayError: 401 ``invalid_api_key``; with ``Connection: close`` when the body has not
            all arrived (as the 413 answered before the body): the connection cannot carry
            another request while a body nobody reads may still come (a client that sent
            ``Expect: 100-continue`` and got this answer instead never sends it).
    """
    try:
        return gw.identity.identify(request.headers)
    except GatewayError as err:
        if not request.content.is_eof():
            err.headers = {**(err.headers or {}), "Connection": "close"}
        raise


async def read_body(request: web.BaseRequest, max_body_bytes: int, body_seconds: float) -> bytes:
    """Read the request body under the byte cap and the client body timeout.

    ``Content-Length`` over the cap is refused before reading; a chunked body is cut off when it
    passes the cap (aiohttp's ``client_max_size``, set to the same cap by the app); a body that
    has not fully arrived after ``body_seconds`` is cut off.

    A client that sent ``Expect: 100-continue`` is told to go on (``100 Continue``) once the
    size cap passed.

    A ``Content-Encoding: gzip`` / ``deflate`` body is decoded (:func:`decode_body`), and the cap
    applies to the decoded size too.

    Raises:
        GatewayError: 413 ``request_too_large``; 408 ``request_timeout``; 417
            ``expectation_failed`` (an ``Expect`` other than ``100-continue``); 415
            ``unsupported_content_encoding``; 400 ``invalid_body`` (a corrupt compressed body).
    """
    body = body_if_complete(request, max_body_bytes)
    if body is not None:
        return body
    await _continue(request)
    try:
        async with asyncio.timeout(body_seconds):
            raw = await request.read()
        return decode_body(raw, content_coding(request), max_body_bytes)
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

    A ``Content-Encoding: gzip`` / ``deflate`` body is returned decoded (:func:`decode_body`).

    Raises:
        GatewayError: 413 ``request_too_large`` (``Content-Length``, the bytes received, or
            the decoded size over the cap); 415 ``unsupported_content_encoding`` (a coding other
            than gzip, deflate, identity: refused before the body is read); 400 ``invalid_body``
            (a corrupt or truncated compressed body, broken chunking); 417
            ``expectation_failed`` (an ``Expect`` other than ``100-continue``, also when the body
            came with the head).
    """
    length = request.content_length
    if length is not None and length > max_body_bytes:
        raise _too_large(length, max_body_bytes)
    coding = content_coding(request)
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
    return decode_body(body, coding, max_body_bytes)


#: The request content codings kvgate decodes (RFC 9110 §8.4.1; ``x-gzip`` is gzip's old name).
SUPPORTED_CODINGS = ("gzip", "x-gzip", "deflate")


def content_coding(request: web.BaseRequest) -> str | None:
    """The request body's content coding: ``"gzip"`` or ``"deflate"``, or ``None`` for a body
    sent as is (no ``Content-Encoding``, or only ``identity``). The gateway's HTTP server does
    not decode bodies itself, so that :func:`decode_body` can bound the decoded size.

    Raises:
        GatewayError: 415 ``unsupported_content_encoding`` for any other coding (``br``,
            ``zstd``, ``compress``, ...) or several codings stacked (``gzip, gzip``), with
            ``Accept-Encoding: gzip, deflate`` naming what is accepted (RFC 9110 §12.5.3).
    """
    values = request.headers.getall("Content-Encoding", ())
    if not values:
        return None
    codings = [c.strip().lower() for v in values for c in v.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in SUPPORTED_CODINGS:
        return "deflate" if codings[0] == "deflate" else "gzip"
    raise GatewayError(
        415,
        f"Unsupported Content-Encoding {', '.join(values)!r}: this gateway decodes request bodies "
        "sent as gzip or deflate (one coding), or as is.",
        "invalid_request_error",
        code="unsupported_content_encoding",
        headers={"Accept-Encoding": "gzip, deflate", "Connection": "close"},
    )


def decode_body(body: bytes, coding: str | None, max_body_bytes: int) -> bytes:
    """``body`` decoded from its content ``coding`` (``None``: returned as is), producing at most
    ``max_body_bytes`` + 1 bytes (``max_body_bytes`` is the cap on the DECODED size): a
    decompression bomb (say 10 MB of zeros gzipped to 10 KB) costs the work of one cap's worth
    of output, then is refused — the rest is never inflated.

    gzip (RFC 1952) may hold several members one after the other; deflate is the zlib format
    (RFC 1950) or, as some clients send it, a raw deflate stream (RFC 1951).

    Raises:
        GatewayError: 413 ``request_too_large`` (decoded size over the cap); 400
            ``invalid_body`` (not valid data of that coding, truncated, or trailing bytes).
    """
    if coding is None or not body:
        return body
    if coding == "deflate":
        # a zlib header: CM = 8 in the low nibble and the 16-bit header a multiple of 31
        zlib_header = len(body) >= 2 and body[0] & 0x0F == 8 and (body[0] << 8 | body[1]) % 31 == 0
        wbits = zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS
    else:
        wbits = 16 + zlib.MAX_WBITS
    out = bytearray()
    data = body
    while True:
        decoder = zlib.decompressobj(wbits)
        try:
            # max_length bounds the work: never more than one byte past the cap
            out += decoder.decompress(data, max_body_bytes + 1 - len(out))
        except zlib.error as exc:
            raise _corrupt(coding, str(exc)) from None
        if len(out) > max_body_bytes:
            raise GatewayError(
                413,
                f"Request body decodes ({coding}) to more than {max_body_bytes} bytes; this "
                f"gateway accepts at most {max_body_bytes} bytes, decoded.",
                "invalid_request_error",
                code="request_too_large",
                headers={"Connection": "close"},
            )
        if not decoder.eof:
            raise _corrupt(coding, "the compressed data ends early")
        data = decoder.unused_data
        if not data:
            return bytes(out)
        if coding != "gzip":
            raise _corrupt(coding, "bytes follow the end of the compressed data")


def _corrupt(coding: str, why: str) -> GatewayError:
    return GatewayError(
        400,
        f"The request body is not valid {coding} data: {why}.",
        "invalid_request_error",
        code="invalid_body",
        headers={"Connection": "close"},
    )


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


def rewrite_body(
    body: bytes, analysis: Any, add_usage: bool, stream_upstream: bool = False
) -> bytes:
    """The body to forward: the client's bytes, or a copy with what kvgate must change:
    ``stream_options.include_usage`` added (streamed requests, so the engine reports usage),
    ``"stream": true`` (``stream_upstream``: a request the client did not stream, whose answer
    kvgate assembles), the ``default_max_tokens`` it reserved for
    (``analysis.inject_max_tokens``, written as ``max_output_tokens`` on ``/v1/responses``, as
    ``max_tokens`` elsewhere), and, when the body has both ``max_tokens`` and
    ``max_completion_tokens``, the one not reserved removed (``analysis.drop_cap``), so the
    engine gets exactly the cap kvgate reserved for (engines differ in which key they read).

    When the keys to add are absent and nothing is removed (the usual case) the members are
    spliced in after the opening ``{`` and every byte the client sent is forwarded as sent;
    the body is not parsed again when the analyser already saw that none of them is there
    (``analysis.addable``).
    Otherwise (say ``"stream_options": {}``, ``"max_tokens": null``, or a cap to drop) the
    body is decoded and re-encoded with the standard ``json`` module, which keeps integers of
    any size exact (orjson would turn those above 64 bits into floats), accepts lone surrogate
    escapes as the analyser does, and writes ASCII escapes.
    """
    inject = getattr(analysis, "inject_max_tokens", None)
    drop = getattr(analysis, "drop_cap", None)
    if not add_usage and not stream_upstream and inject is None and drop is None:
        return body
    responses = getattr(analysis, "route", None) == RESPONSES_ROUTE
    limit = "max_output_tokens" if responses else "max_tokens"
    if drop is None:
        if getattr(analysis, "addable", False):
            data: Any = ()  # the analyser saw none of the keys to add: no second parse
        else:
            try:
                data = orjson.loads(body)
            except orjson.JSONDecodeError:  # a lone surrogate escape, which orjson refuses
                data = json.loads(body)
        members = []
        if stream_upstream and "stream" not in data:
            members.append(b'"stream":true')
        if add_usage and "stream_options" not in data:
            members.append(b'"stream_options":{"include_usage":true}')
        if inject is not None and limit not in data:
            members.append(b'"%s":%d' % (limit.encode(), inject))
        start = len(body) - len(body.lstrip())
        wanted = add_usage + stream_upstream + (inject is not None)
        if len(members) == wanted and body[start : start + 1] == b"{":
            rest = body[start + 1 :]
            sep = b"" if rest.lstrip().startswith(b"}") else b","
            return body[: start + 1] + b",".join(members) + sep + rest
    data = json.loads(body)
    if drop is not None:
        data.pop(drop, None)
    if stream_upstream:
        data["stream"] = True
    if add_usage:
        opts = data.get("stream_options")
        data["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    if inject is not None:
        data[limit] = inject
    return json.dumps(data, separators=(",", ":")).encode()


async def handle_inference(gw: Gateway, request: web.BaseRequest, route: str) -> Reply:
    """``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
    ``/v1/responses``: analysed, admitted, relayed (streams as they arrive), settled.

    Args:
        gw: the gateway.
        request: the client's request.
        route: the normalised inference path (:func:`kvgate.proxy.routes.route_of`); the
            request goes upstream to this path, whatever spelling the client used.
    """
    started = time.perf_counter()
    rid = request_id(request.headers.get("x-request-id"))
    tracing = gw.tracing  # None unless configured: then each stage below is one `is` check
    trace = None if tracing is None else tracing.begin(request, route, started, rid)
    tenant = None
    model = None
    try:
        # authenticated from the head alone: a client without a valid key is answered before
        # its body is read (no 100 Continue invites it to send one)
        tenant, priority = authenticate(gw, request)
        if trace is not None:
            trace.authenticated = time.perf_counter()
        # the common case without a single await: body already here, small enough to analyse
        # on the loop
        body = body_if_complete(request, gw.max_body_bytes)
        if body is None:
            body = await read_body(request, gw.max_body_bytes, gw.timeouts.client_body)
        if len(body) < INLINE_ANALYSIS_BYTES:
            model, analysis = analyze_now(gw, route, body)
        else:
            model, analysis = await analyze_in_thread(gw, route, body)
        backend = pick_backend(gw, model, tenant)
        if trace is not None:
            trace.analysed = time.perf_counter()
    except GatewayError as err:
        gw.metrics.request_done(None, tenant, f"rejected_{err.status}", model)
        return _refused(request, rid, started, route, err, tenant, model, trace)
    tokens = analysis.reserved_tokens
    got = await _admission(
        gw, request, (rid, route, started), (tenant, backend, model), priority, tokens,
        analysis.prompt_tokens, trace,
    )  # fmt: skip
    if isinstance(got, PreparedResponse):
        return got
    decision, extras, admitting, admitted = got

    stream = bool(analysis.stream)
    # a request the client did not stream goes upstream as a stream: the engine then notices
    # at its next token write that the client went away (kvgate.proxy.assemble)
    assemble = not stream and backend.stream_upstream and route in STREAM_UPSTREAM_ROUTES
    add_usage = (stream or assemble) and not analysis.include_usage and route in USAGE_OPTION_ROUTES
    result = RelayResult()
    if extras is not None:  # the prompt leaves the prefill budget at the first bytes
        result.on_first_data = extras.first_data
    upstream_headers = upstream_trace_headers(request.headers, rid)
    if trace is not None:  # the engine gets the upstream span's context
        upstream_headers = trace.upstream_headers(upstream_headers, backend.url + route, "POST")
        result.on_first_data = _both(result.on_first_data, trace.data_arrived)
    # what holds the slots, for the retry hints of refusals (a shadow admission holds none)
    running = (
        gw.running.start(backend.id, tenant.id, analysis.completion_tokens)
        if holds_slot(decision)
        else None
    )
    reply: Reply | None = None
    error_code: str | None = None

    async def ended() -> None:
        await release_at_end(gw, decision, actual_tokens(analysis, result))

    result.on_end = ended
    try:
        forward = rewrite_body(body, analysis, add_usage, assemble)
        reply = await relay(
            request,
            gw.session,
            backend.url + route,
            forward,
            stream=stream,
            strip_usage_chunk=add_usage,
            timeouts=gw.timeouts,
            watchdog=gw.watchdog,
            build=partial(gw.controller.relay_http, backend.id, tenant.id, request_id=rid),
            count_text=model.count_text,
            result=result,
            responses=route == RESPONSES_ROUTE,
            api_key=backend.api_key,
            assemble=assemble,
            retry_hint=partial(queue_hint, gw, backend.id),
            extra_headers=upstream_headers,
        )
        return reply
    except GatewayError as err:
        error_code = err.code
        reply = _tagged(error_response(request, err), rid)
        return reply
    finally:
        if trace is not None:
            trace.relay_end = time.perf_counter()
        if extras is not None:
            extras.finish(result.completion_tokens)
        if running is not None:
            gw.running.finish(
                running,
                completed=result.outcome == "ok",
                stream=stream,
                first_byte=result.ttft,
                completion_tokens=result.completion_tokens,
            )
        prompt = result.prompt_tokens
        settle(
            gw,
            request,
            decision,
            actual_tokens(analysis, result),
            (rid, route, started, admitting, admitted),
            (tenant, backend, model),
            tokens,
            prompt if prompt is not None else analysis.prompt_tokens,
            result,
            reply,
            error_code,
            trace=trace,
        )
        if type(reply) is PreparedResponse and gw.store.unsent:
            # a whole answer goes out once this returns: the slot first (release_at_end)
            await gw.store.flushed()


def _both(first: Any, second: Any) -> Any:
    """A callback that runs ``first`` (when not ``None``) then ``second``."""
    if first is None:
        return second

    def both() -> None:
        first()
        second()

    return both


async def _admission(
    gw: Gateway,
    request: web.BaseRequest,
    where: tuple[str, str, float],
    who: tuple[Any, Any, Any],
    priority: str,
    tokens: int,
    prompt_tokens: int,
    trace: Any,
) -> tuple[Any, Any, float, float] | PreparedResponse:
    """The admission stage of an inference or forwarded request
    (:func:`kvgate.admission.stage.admit`), timed and counted: ``(decision, extras, admitting,
    admitted)`` (``time.perf_counter()`` when admission began and ended) or the refusal's
    answer, already counted and logged.

    Args:
        where: the request id, route and when it arrived.
        who: its tenant, backend and model route.
        tokens: the tokens it reserves; ``prompt_tokens``: its prompt's (the prefill budget).
    """
    rid, route, started = where
    tenant, backend, model = who
    admitting = time.perf_counter()
    if trace is not None:
        trace.admitting = admitting
    try:
        decision, extras = await admit(
            gw, backend, tenant, priority, tokens, prompt_tokens,
            request.headers,
        )  # fmt: skip
    except asyncio.CancelledError:  # the client left while its request waited
        # counted and logged like a client that leaves later (outcome client_disconnect,
        # status 0: no answer was sent), with the time it waited
        now = time.perf_counter()
        gw.metrics.request_done(backend, tenant, "client_disconnect", model)
        end_request(
            request,
            rid,
            started,
            trace,
            route=route,
            queue_wait=now - admitting,
            status=0,
            outcome="client_disconnect",
            tenant=tenant,
            backend=backend,
            model=model,
            reason="left_while_waiting",
            reserved=tokens,
        )
        raise
    if not decision.admitted:
        return _refusal(gw, request, decision, rid, (started, admitting), route, tokens, who, trace)
    admitted = time.perf_counter()
    if trace is not None:
        trace.admitted = admitted
    gw.metrics.admitted(backend, tenant, tokens, admitted - started)
    return decision, extras, admitting, admitted


def _tagged(response: PreparedResponse, rid: str) -> PreparedResponse:
    """``response`` with the request id header (``x-request-id``) added."""
    response.raw = with_request_id(response.raw, rid)
    return response


def _refused(
    request: web.BaseRequest,
    rid: str,
    started: float,
    route: str,
    err: GatewayError,
    tenant: Any,
    model: Any,
    trace: Any = None,
) -> PreparedResponse:
    """The answer to a request refused before admission (``err``: 4xx), with its request id,
    its access log line (outcome ``rejected``, reason the error's code) and the end of its
    trace (``None``: not traced)."""
    reply = _tagged(error_response(request, err), rid)
    end_request(
        request,
        rid,
        started,
        trace,
        route=route,
        reply=reply,
        status=err.status,
        outcome="rejected",
        tenant=tenant,
        model=model,
        reason=err.code,
    )
    return reply


def _refusal(
    gw: Gateway,
    request: web.BaseRequest,
    decision: Any,
    rid: str,
    times: tuple[float, float],
    route: str,
    tokens: int,
    who: tuple[Any, Any, Any],
    trace: Any = None,
) -> PreparedResponse:
    """The answer to an admission refusal (429/503, :func:`_refusal_response`) with its
    request id; counts it in the metrics and writes its access log line (outcome ``rejected``,
    the refusal's reason, the tokens it asked for, the time it spent in admission).

    Args:
        decision: the refusal (the core's ``Rejection`` or the gateway's ``Refusal``).
        times: ``time.perf_counter()`` when the request arrived and when admission began.
        tokens: the tokens the request asked to reserve.
        who: the request's tenant, backend and model route.
        trace: its trace (:class:`kvgate.tracing.RequestTrace`), ended here; ``None``.
    """
    started, admitting = times
    tenant, backend, model = who
    response, reason = _refusal_response(gw, request, decision, backend, tenant, model, tokens)
    now = time.perf_counter()
    gw.metrics.rejected(backend, tenant, reason, now - started, model)
    _tagged(response, rid)
    end_request(
        request,
        rid,
        started,
        trace,
        route=route,
        queue_wait=now - admitting,
        reply=response,
        status=response.status,
        outcome="rejected",
        tenant=tenant,
        backend=backend,
        model=model,
        reason=reason,
        reserved=tokens,
    )
    return response


def _refusal_response(
    gw: Gateway,
    request: web.BaseRequest,
    decision: Any,
    backend: Any,
    tenant: Any,
    model: Any,
    requested: int,
) -> tuple[PreparedResponse, str]:
    """429 (tenant over quota, or a request that can never fit) or 503 (backend saturated /
    class shed) with OpenAI's error body, ``Retry-After`` (computed; omitted with
    ``x-should-retry: false`` when it can never be admitted), the ``x-ratelimit-*`` headers and
    ``x-kvgate-reject-reason``, serialized whole in Rust
    (:meth:`kvgate._core.AdmissionController.refusal_response`). Returns it and the refusal's
    reason (for the metrics).

    A refusal that waits for a slot (``tenant-concurrency``, ``backend-slots``,
    ``inflight-tokens``, ``queued``, ``queue-full``) gets its hint (seconds) from the requests
    this worker is running (:func:`kvgate.admission.retry_hint.slot_hint`).

    Args:
        decision: the refusal (the core's ``Rejection`` or a :class:`Refusal`).
        model: the request's model route, or ``None`` (a forwarded request that names none).
        requested: the tokens it asked to reserve.
    """
    queue = gw.queue
    queued = queue.waiting if queue is not None else 0
    decision = slot_hint(decision, gw.running, backend.id, tenant.id, queued)
    # status, OpenAI error body, x-ratelimit-*, Retry-After / retry-after-ms (or
    # x-should-retry: false), the reason, Content-Length, Date: one call, one buffer
    connection = connection_header(request)
    status, reason, raw = gw.controller.refusal_response(
        backend.id,
        tenant.id,
        decision,
        model.name if model is not None else None,
        tenant.name,
        requested,
        connection,
    )
    return PreparedResponse(status, raw, connection), reason


async def handle_forward(gw: Gateway, request: web.BaseRequest) -> Reply:
    """Any route that is neither an inference route nor the gateway's own, when the gateway's
    ``other_routes`` is ``forward``: admitted and accounted like an inference request.

    The body's ``model`` (when it is a JSON object that names one) routes it like inference,
    among the backends the tenant may use; without one, to the backend the tenant may use with
    the most headroom. It holds the tenant's and the backend's slots and reserves
    :data:`FORWARD_RESERVATION` token (so a tenant at its TPM limit is refused), goes upstream
    with its method, normalised path, query string and ``Content-Type``, and its answer is
    relayed as it arrives (an SSE stream read for its ``usage`` like any other; another body
    passed through, its ``usage`` read at the end). The usage the engine reports (prompt +
    completion tokens) is charged; a body without one is charged nothing, an SSE stream
    without one a token per event that carried text.

    Args:
        gw: the gateway.
        request: the client's request (its path is normalised again for the upstream URL, from
            the raw, percent-encoded path, so what the engine receives is encoded as sent).
    """
    started = time.perf_counter()
    rid = request_id(request.headers.get("x-request-id"))
    route = request.path
    tracing = gw.tracing
    trace = None if tracing is None else tracing.begin(request, route, started, rid)
    tenant = None
    model = None
    try:
        tenant, priority = authenticate(gw, request)  # before the body, as above
        if trace is not None:
            trace.authenticated = time.perf_counter()
        body = body_if_complete(request, gw.max_body_bytes)
        if body is None:
            body = await read_body(request, gw.max_body_bytes, gw.timeouts.client_body)
        model = model_of(gw, body)
        backend = pick_backend(gw, model, tenant) if model else pick_any_backend(gw, tenant)
        if trace is not None:
            trace.analysed = time.perf_counter()
    except GatewayError as err:
        gw.metrics.request_done(None, tenant, f"rejected_{err.status}", model)
        return _refused(request, rid, started, route, err, tenant, model, trace)
    tokens = FORWARD_RESERVATION
    got = await _admission(
        gw, request, (rid, route, started), (tenant, backend, model), priority, tokens, 0, trace
    )
    if isinstance(got, PreparedResponse):
        return got
    decision, extras, admitting, admitted = got
    raw_path, sep, query = request.raw_path.partition("?")
    result = RelayResult()
    if extras is not None:
        result.on_first_data = extras.first_data
    url = backend.url + normalize_path(raw_path) + sep + query
    upstream_headers = upstream_trace_headers(request.headers, rid)
    if trace is not None:
        upstream_headers = trace.upstream_headers(upstream_headers, url, request.method)
        result.on_first_data = _both(result.on_first_data, trace.data_arrived)
    # holds a slot (a shadow admission holds none): counted for the retry hints of refusals
    running = gw.running.start(backend.id, tenant.id, 0) if holds_slot(decision) else None
    reply: Reply | None = None
    error_code: str | None = None

    async def ended() -> None:
        await release_at_end(gw, decision, _forwarded_tokens(result))

    result.on_end = ended
    try:
        reply = await relay(
            request,
            gw.session,
            url,
            body,
            stream=True,
            strip_usage_chunk=False,
            timeouts=gw.timeouts,
            watchdog=gw.watchdog,
            build=partial(gw.controller.relay_http, backend.id, tenant.id, request_id=rid),
            count_text=None,
            result=result,
            method=request.method,
            content_type=request.headers.get("Content-Type"),
            pass_body=True,
            api_key=backend.api_key,
            extra_headers=upstream_headers,
        )
        return reply
    except GatewayError as err:
        error_code = err.code
        reply = _tagged(error_response(request, err), rid)
        return reply
    finally:
        if trace is not None:
            trace.relay_end = time.perf_counter()
        if extras is not None:
            extras.finish(result.completion_tokens)
        actual = _forwarded_tokens(result)
        if running is not None:  # held a slot; its time says nothing about generation
            gw.running.finish(
                running, completed=False, stream=False, first_byte=None, completion_tokens=0
            )
        settle(
            gw,
            request,
            decision,
            actual,
            (rid, route, started, admitting, admitted),
            (tenant, backend, model),
            tokens,
            result.prompt_tokens,
            result,
            reply,
            error_code,
            trace=trace,
        )
        if type(reply) is PreparedResponse and gw.store.unsent:
            await gw.store.flushed()


def _forwarded_tokens(result: RelayResult) -> int:
    """Tokens a forwarded request is charged: the usage its answer reported (0 when the
    engine could not be reached)."""
    if result.outcome == "upstream_unreachable":
        return 0
    return min(int(result.prompt_tokens or 0) + int(result.completion_tokens), MAX_AMOUNT)
