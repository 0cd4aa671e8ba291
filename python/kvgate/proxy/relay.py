"""Forward one admitted request upstream and relay the answer, settling its token account.

Every path — success, upstream error, timeout, client disconnect (the handler task is cancelled:
the app runs with ``handler_cancellation=True``), exception — ends in ``finally`` with the
upstream response *closed* (not released to the keep-alive pool, so the engine sees the
disconnect and aborts the request; shut down at once, before the reservation goes back:
:func:`close_now`) and the reservation released with the tokens actually used.

A stream ends for the client at ``data: [DONE]``, even when the engine keeps the connection
open afterwards. An answer that ended cleanly may have returned its connection to aiohttp's pool
already (at the chunked EOF); an engine may close it right after (llama.cpp's server does after
every stream, while announcing ``Keep-Alive``), so a request that fails on a reused connection
before any byte of the answer came is sent again (:func:`reuse_trace`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from kvgate._core import MAX_AMOUNT, usage_tokens
from kvgate.errors import (
    GatewayError,
    error_body,
    reshape_upstream_error,
    upstream_failed,
    upstream_redirect,
    upstream_timeout,
)
from kvgate.proxy.assemble import EVENT_LIMIT, StreamAssembler, stream_kind
from kvgate.proxy.deadline import Deadline, Watchdog
from kvgate.proxy.prepared import HeadBuilder, PreparedStream, Reply, relayed, start_stream
from kvgate.proxy.sse import SSEInspector

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from kvgate.config import TimeoutsConfig as Timeouts

__all__ = ["RelayResult", "close_now", "relay", "reuse_trace"]

logger = logging.getLogger("kvgate.proxy")

#: The headers of an engine error relayed in OpenAI's shape (the body is re-encoded).
_JSON = ((b"Content-Type", b"application/json"),)

#: Headers every relayed stream carries so that a buffering proxy in front of kvgate passes each
#: event on at once (``X-Accel-Buffering: no`` is nginx's switch; ``Cache-Control: no-cache``
#: the usual SSE header), unless the engine sent its own value.
_STREAM_HEADERS = ((b"Cache-Control", b"no-cache"), (b"X-Accel-Buffering", b"no"))

#: Engine statuses whose ``Retry-After`` / ``retry-after-ms`` reach the client.
_RETRY_STATUSES = frozenset({429, 503})

#: Attempts of a request whose connection, taken from the pool, turns out closed by the engine.
_STALE_ATTEMPTS = 4


class _Attempt:
    """One upstream send, told by :func:`reuse_trace` whether its connection came from the
    pool."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


async def _on_reuse(session: aiohttp.ClientSession, ctx: Any, params: Any) -> None:
    attempt = ctx.trace_request_ctx
    if isinstance(attempt, _Attempt):
        attempt.reused = True


def reuse_trace() -> aiohttp.TraceConfig:
    """An aiohttp trace config for the upstream ``ClientSession`` that tells :func:`relay`
    whether a request went out on a pooled (reused) connection. With it, a request that fails
    with ``ServerDisconnectedError`` or ``ClientOSError`` on a reused connection before any byte
    of the answer is sent again (up to 4 attempts): the engine had closed that connection
    (llama.cpp's server closes it right after a stream), so it never processed the request.
    Without it such a failure is a 502 ``upstream_unreachable``."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(_on_reuse)
    return trace


async def _send(
    session: aiohttp.ClientSession, method: str, url: str, body: bytes, headers: dict[str, str]
) -> aiohttp.ClientResponse:
    """Send the request upstream (``method``, usually ``POST``), sent again when it failed on a
    pooled connection the engine had closed (see :func:`reuse_trace`): the engine never read
    it, so sending it again cannot run it twice. A redirect is not followed: the prompt and
    the backend's key go to the backend's URL only (the caller answers 502).

    Raises:
        aiohttp.ClientError: the engine could not be reached, or broke off before the answer.
    """
    attempt = _Attempt()
    for _ in range(_STALE_ATTEMPTS - 1):
        attempt.reused = False
        try:
            return await session.request(
                method,
                url,
                data=body,
                headers=headers,
                trace_request_ctx=attempt,
                allow_redirects=False,
            )
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if not attempt.reused or isinstance(exc, aiohttp.ClientConnectorError):
                raise
    return await session.request(method, url, data=body, headers=headers, allow_redirects=False)


@dataclass(slots=True)
class RelayResult:
    """What the relay learnt, for settlement and metrics.

    Attributes:
        status: status sent to the client (0 if the client went away before headers).
        prompt_tokens: from the engine's usage, else ``None``.
        completion_tokens: from the engine's usage, else counted from delivered text, else 0.
        usage_from_engine: whether the engine reported usage.
        ttft: upstream time to the answer's head (seconds), or ``None``.
        outcome: ``ok``, ``upstream_error``, ``upstream_timeout``, ``upstream_unreachable``,
            ``client_disconnect``, ``client_timeout`` (the client stopped reading a stream
            until the ``total`` timeout), ``stream_broken``.
    """

    status: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    usage_from_engine: bool = False
    ttft: float | None = None
    outcome: str = "ok"
    #: called once, when the first bytes of the answer's body arrive (the admission stage's
    #: prefill budget and latency targets: the engine produced its first token)
    on_first_data: Callable[[], None] | None = None
    #: awaited once when a relayed answer is complete (the stream's end event read, the whole
    #: body read; the counts above filled in) and before its last bytes go to the client:
    #: settlement releases the request's slots then, so that a client that sends its next
    #: request on reading the end finds its slot free (on any replica); not called when the
    #: answer fails
    on_end: Callable[[], Awaitable[None]] | None = None


async def relay(
    request: web.BaseRequest,
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    *,
    stream: bool,
    strip_usage_chunk: bool,
    timeouts: Timeouts,
    watchdog: Watchdog,
    build: HeadBuilder,
    count_text: Callable[[str], int] | None,
    result: RelayResult,
    responses: bool = False,
    method: str = "POST",
    content_type: str | None = "application/json",
    pass_body: bool = False,
    api_key: str | None = None,
    assemble: bool = False,
    retry_hint: Callable[[], float | None] | None = None,
    extra_headers: dict[str, str] | None = None,
) -> Reply:
    """POST ``body`` to ``url`` (or send it with ``method``) and relay the answer to the client.

    Args:
        request: the client's request (its connection receives the answer).
        session: the shared upstream ``ClientSession``.
        url: full upstream URL.
        body: the (possibly rewritten) JSON body to send.
        stream: the request asked for SSE streaming.
        strip_usage_chunk: the gateway added ``include_usage`` itself; drop that chunk.
        timeouts: upstream timeouts.
        watchdog: enforces them (:mod:`kvgate.proxy.deadline`).
        build: serializes the answer's head (the engine's headers minus hop-by-hop ones, plus
            kvgate's ``x-ratelimit-*``; :data:`~kvgate.proxy.prepared.HeadBuilder`).
        count_text: tokenizer count of delivered text, used when the engine sent no usage.
        result: filled in as the relay goes, so the caller can settle even if this raises or is
            cancelled.
        responses: the answer is OpenAI's Responses API's (``POST /v1/responses``): its stream's
            named events are read for the ``delta`` text and the terminal event's usage
            (``SSEInspector(responses=True)``).
        method: the upstream request's method.
        content_type: the upstream request's ``Content-Type`` (``None``: none sent).
        pass_body: an answer that is not an SSE stream is written to the client as it arrives
            (its ``usage``, when it is JSON of at most :data:`USAGE_SCAN_BYTES`, read at the
            end) instead of read whole first.
        api_key: the backend's API key, sent as ``Authorization: Bearer <key>``; no header of
            the client's request (its own key in particular) is forwarded.
        assemble: the client did not ask for a stream but ``body`` asks the engine for one
            (the backend's ``stream_upstream``): an SSE answer is read whole and the client
            gets the JSON body the engine would have sent (:func:`_relay_assembled`).
        retry_hint: kvgate's own wait hint (seconds) for this request, asked only when the
            engine answers 429 or 503: the client is sent the longer of it and the engine's
            ``retry-after-ms`` / ``Retry-After`` (RFC 9110 §10.2.3: seconds or an HTTP-date),
            as ``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms``.
        extra_headers: more headers for the upstream request (the request id and trace
            context, :func:`kvgate.accesslog.upstream_trace_headers`).

    Returns:
        The response: for streams, already prepared and written; else the whole answer as a
        :class:`~kvgate.proxy.prepared.PreparedResponse` (one write).

    Raises:
        GatewayError: 502 upstream unreachable / broken before headers (an assembled answer:
            before its end), 502 ``upstream_redirect`` (the engine answered 3xx: not
            followed), 504 upstream timeout before headers (an assembled answer: before
            its end).
        asyncio.CancelledError: the client went away (the handler was cancelled).
    """
    started = time.perf_counter()
    deadline = watchdog.deadline()
    loop = asyncio.get_running_loop()
    # `total` bounds the whole request, from here; `first_byte` the wait for the answer's head
    end = None if timeouts.total is None else loop.time() + timeouts.total
    first = loop.time() + timeouts.first_byte
    if end is not None and end < first:
        first = end
    upstream: aiohttp.ClientResponse | None = None
    headers = {"Content-Type": content_type} if content_type else {}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    if extra_headers:
        headers.update(extra_headers)
    try:
        try:
            with deadline.at(first):
                upstream = await _send(session, method, url, body, headers)
        except TimeoutError:
            result.outcome = "upstream_timeout"
            raise upstream_timeout("response") from None
        except aiohttp.ClientError as exc:
            result.outcome = "upstream_unreachable"
            raise upstream_failed(exc) from None
        result.ttft = time.perf_counter() - started
        if 300 <= upstream.status < 400 and upstream.status != 304:
            # a redirect (an engine moved, a proxy in front of it): not followed, so neither
            # the prompt nor the backend's key goes to a host the operator did not name (a 304
            # Not Modified, to a forwarded conditional GET, is relayed)
            result.outcome = "upstream_error"
            raise upstream_redirect(upstream.status)
        if upstream.status >= 400:
            result.outcome = "upstream_error"
            raw = await _read_all(upstream, timeouts, deadline, end, result, ERROR_BODY_LIMIT)
            result.status = upstream.status
            body = reshape_upstream_error(upstream.status, raw)
            headers_out: tuple[tuple[bytes, bytes], ...] = _JSON
            if upstream.status in _RETRY_STATUSES:
                headers_out = _with_retry_after(upstream.headers, retry_hint)
            return relayed(request, build, upstream.status, headers_out, body)
        if assemble and upstream.content_type == "text/event-stream":
            kind = "responses" if responses else stream_kind(url)
            return await _relay_assembled(
                request, upstream, timeouts, deadline, end, build, count_text, result, kind
            )
        if stream and upstream.content_type == "text/event-stream":
            return await _relay_stream(
                request,
                upstream,
                strip_usage_chunk,
                timeouts,
                deadline,
                end,
                build,
                count_text,
                result,
                responses,
            )
        if pass_body:
            return await _relay_body(request, upstream, timeouts, deadline, end, build, result)
        raw = await _read_all(upstream, timeouts, deadline, end, result)
        _settle_from_body(raw, result, count_text)
        result.status = upstream.status
        return relayed(request, build, upstream.status, upstream.raw_headers, raw)
    except asyncio.CancelledError:
        result.outcome = "client_disconnect"
        raise
    finally:
        if upstream is not None:
            # close, never release: a pooled connection would keep the engine generating
            close_now(upstream)


def close_now(upstream: aiohttp.ClientResponse) -> None:
    """Closes an answer's upstream connection; one still open (the answer not read to its end:
    the client went away, a timeout, an error) is shut down at once, so that the engine sees
    the disconnect — its cue to abort the request — before this request's slot goes back.
    ``close()`` alone closes the socket only on the event loop's next turn (asyncio and uvloop
    both defer it), by which time the released slot may already be in the shared store and
    taken by another replica's request, which could then reach the engine first: for a moment
    the engine would run one request more than the limit."""
    conn = upstream.connection
    transport = conn.transport if conn is not None else None
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        # a duplicate of the socket's descriptor: shutdown acts on the socket itself (the
        # transport's own socket object does not offer it)
        with (
            contextlib.suppress(OSError),
            socket.fromfd(sock.fileno(), sock.family, sock.type) as dup,
        ):
            dup.shutdown(socket.SHUT_RDWR)
    upstream.close()


#: bytes of an engine's error answer read (its message is at the start; the rest is dropped
#: with the connection): a 200 MB error page must not sit in the gateway's memory
ERROR_BODY_LIMIT = 1024 * 1024


async def _read_all(
    upstream: aiohttp.ClientResponse,
    timeouts: Timeouts,
    deadline: Deadline,
    end: float | None,
    result: RelayResult,
    limit: int | None = None,
) -> bytes:
    """The whole upstream body, with ``idle`` between chunks and the request's ``end`` (loop
    time) overall (a body that stalls half-way frees its slot after ``idle``, as a stream does);
    with ``limit``, its first ``limit`` bytes (bytes; the rest is not read).

    Raises:
        GatewayError: 504 ``upstream_timeout`` (outcome ``upstream_timeout``), 502
            ``upstream_broken`` (outcome ``stream_broken``).
    """
    content = upstream.content
    if content.is_eof():  # the whole body is already here: nothing to wait for
        whole = await upstream.read()
        return whole if limit is None else whole[:limit]
    idle = timeouts.idle
    parts: list[bytes] = []
    size = 0
    try:
        while limit is None or size < limit:
            chunk = content.read_nowait() or await _await_bytes(content, deadline, idle, end)
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
    except TimeoutError:
        result.outcome = "upstream_timeout"
        raise upstream_timeout("body") from None
    except aiohttp.ClientError as exc:
        result.outcome = "stream_broken"
        raise upstream_failed(exc, "upstream_broken") from None
    body = b"".join(parts)
    return body if limit is None else body[:limit]


#: the longest wait an engine's ``Retry-After`` / ``retry-after-ms`` is relayed as (seconds):
#: a longer one (an absurd value, a date years ahead) becomes this — a client that honours it
#: comes back within the hour (OpenAI's clients ignore a wait over 60 s and back off themselves)
ENGINE_WAIT_MAX_S = 3600.0


def _with_retry_after(
    upstream_headers: Any, retry_hint: Callable[[], float | None] | None
) -> tuple[tuple[bytes, bytes], ...]:
    """The headers of a relayed 429/503: ``Content-Type``, and ``Retry-After`` /
    ``retry-after-ms`` for the longer of the engine's wait (at most :data:`ENGINE_WAIT_MAX_S`)
    and kvgate's ``retry_hint`` (none when neither has one)."""
    engine = _engine_wait(upstream_headers)
    if engine is not None:
        engine = min(engine, ENGINE_WAIT_MAX_S)
    waits = [w for w in (engine, retry_hint and retry_hint()) if w]
    if not waits:
        return _JSON
    seconds = max(waits)
    return (
        *_JSON,
        (b"Retry-After", b"%d" % max(1, math.ceil(seconds))),
        (b"retry-after-ms", b"%d" % max(1, math.ceil(seconds * 1000))),
    )


def _engine_wait(headers: Any) -> float | None:
    """Seconds the engine asked to wait: ``retry-after-ms`` (milliseconds, what OpenAI's
    clients read first), else ``Retry-After`` (seconds, or an HTTP-date, RFC 9110 §10.2.3);
    ``None`` when neither is there or readable (negative, not finite, unparseable). The caller
    caps it at :data:`ENGINE_WAIT_MAX_S`."""
    raw = headers.get("retry-after-ms")
    if raw is not None:
        try:
            ms = float(raw)
        except ValueError:
            ms = math.nan
        if math.isfinite(ms) and ms > 0:
            return ms / 1000
    raw = headers.get("Retry-After")
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(raw).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def _stream_headers(upstream_headers: Any) -> Any:
    """The engine's headers plus :data:`_STREAM_HEADERS` it did not send itself."""
    have = {name.lower() for name, _ in upstream_headers}
    missing = tuple(h for h in _STREAM_HEADERS if h[0].lower() not in have)
    return (*upstream_headers, *missing) if missing else upstream_headers


def _wait_until(
    loop: asyncio.AbstractEventLoop, idle: float | None, end: float | None
) -> float | None:
    """Loop time a wait for the next upstream bytes may last until: ``idle`` from now, never
    past the request's ``end`` (``None``: no limit)."""
    when = None if idle is None else loop.time() + idle
    if end is not None and (when is None or end < when):
        return end
    return when


def _first_data(result: RelayResult) -> None:
    """Runs the result's first-data callback once."""
    callback = result.on_first_data
    result.on_first_data = None
    if callback is not None:
        callback()


async def _await_bytes(
    content: aiohttp.StreamReader,
    deadline: Deadline,
    idle: float | None,
    end: float | None,
) -> bytes:
    """The next upstream bytes once nothing is buffered (call it as
    ``content.read_nowait() or await _await_bytes(...)``, so bytes already buffered cost no
    await): ``b""`` at the end of the body, else a wait of at most ``idle`` and never past the
    request's ``end`` (loop time).

    Raises:
        TimeoutError: nothing arrived in time (the caller decides what that ends).
        aiohttp.ClientError: the upstream connection broke.
    """
    if content.at_eof():
        return b""
    with deadline.at(_wait_until(asyncio.get_running_loop(), idle, end)):
        return await content.readany()


def _settle_from_body(
    raw: bytes, result: RelayResult, count_text: Callable[[str], int] | None
) -> None:
    """Settle a whole (non-streamed) answer: the engine's usage; when it sent none, the
    tokenizer count of the answer's text, as for a stream (a completion is never free)."""
    counts = usage_tokens(raw)  # Rust: reads the usage object only
    if counts is not None:
        _take_usage(*counts, result)
    if not result.usage_from_engine and count_text is not None:
        text = _answer_text(raw)
        if text:
            result.completion_tokens = count_text(text)


def _answer_text(raw: bytes) -> str:
    """The generated text of a non-streamed answer (``""`` when the body is not one): every
    choice's legacy ``text``, ``message`` content and reasoning, and tool-call names and
    arguments — the pieces the stream relay counts from its deltas (``kvgate._core.SSEInspector``);
    for a Responses answer, the text of its ``output`` items (:func:`_output_text`).
    """
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return ""
    if isinstance(data, dict) and isinstance(data.get("output"), list):
        return _output_text(data["output"])
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list):
        return ""
    parts: list[str] = []

    def take(value: object) -> None:
        if isinstance(value, str):
            parts.append(value)

    for choice in choices:
        if not isinstance(choice, dict):
            continue
        take(choice.get("text"))
        message = choice.get("message")
        if not isinstance(message, dict):
            continue
        for key in ("content", "reasoning_content", "reasoning"):
            take(message.get(key))
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                take(fn.get("name"))
                take(fn.get("arguments"))
    return "".join(parts)


def _output_text(output: list[object]) -> str:
    """The generated text of a non-streamed Responses answer's ``output`` items (OpenAI's
    Responses API): a ``message``'s ``output_text`` and ``refusal`` parts, a ``function_call``'s
    name and arguments, a ``reasoning`` item's summary and content text — what its stream
    delivers as ``delta`` text."""
    parts: list[str] = []
    for item in output:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "function_call":
            pieces: list[object] = [item.get("name"), item.get("arguments")]
        else:
            pieces = []
            for key in ("content", "summary"):
                inner = item.get(key)
                for part in inner if isinstance(inner, list) else ():
                    if isinstance(part, dict):
                        pieces += [part.get("text"), part.get("refusal")]
        parts += [p for p in pieces if isinstance(p, str)]
    return "".join(parts)


def _take_usage(prompt: object, completion: object, result: RelayResult) -> None:
    """Settle from the engine's counts, each only when it is an integer (not a bool) in
    0..``MAX_AMOUNT`` (2**62; an absurd count is ignored as if the engine had sent none)."""
    if type(prompt) is int and 0 <= prompt <= MAX_AMOUNT:
        result.prompt_tokens = prompt
    if type(completion) is int and 0 <= completion <= MAX_AMOUNT:
        result.completion_tokens = completion
        result.usage_from_engine = True


async def _relay_stream(
    request: web.BaseRequest,
    upstream: aiohttp.ClientResponse,
    strip_usage_chunk: bool,
    timeouts: Timeouts,
    deadline: Deadline,
    end: float | None,
    build: HeadBuilder,
    count_text: Callable[[str], int] | None,
    result: RelayResult,
    responses: bool = False,
) -> PreparedStream:
    inspector = SSEInspector(
        strip_usage_chunk=strip_usage_chunk, count_text=count_text, responses=responses
    )
    try:
        response = await start_stream(
            request, build, upstream.status, _stream_headers(upstream.raw_headers)
        )
    except ConnectionResetError:
        result.outcome = "client_disconnect"
        raise
    result.status = upstream.status
    content = upstream.content
    idle = timeouts.idle
    try:
        while True:
            try:
                # bytes already buffered need no deadline
                data = content.read_nowait() or await _await_bytes(content, deadline, idle, end)
                if result.on_first_data is not None and data:
                    _first_data(result)
            except TimeoutError:
                result.outcome = "upstream_timeout"
                await _write_error_event(
                    response, "upstream stream timed out", "upstream_timeout", deadline, end
                )
                break
            except aiohttp.ClientError:
                result.outcome = "stream_broken"
                await _write_error_event(
                    response, "upstream stream broke", "upstream_broken", deadline, end
                )
                break
            if not data:
                tail = inspector.flush()
                if tail:
                    with deadline.at(end):
                        await response.write(tail)
                if not inspector.done and inspector.error is None:
                    result.outcome = "stream_broken"
                    await _write_error_event(
                        response, "upstream stream ended early", "upstream_broken", deadline, end
                    )
                break
            out = inspector.feed(data)
            if inspector.overlong:
                # megabytes without an event's end: not an engine's stream (memory per stream
                # stays bounded); the complete events before it still go to the client
                result.outcome = "stream_broken"
                if out:
                    with deadline.at(end):
                        await response.write(out)
                err = _event_too_long()
                await _write_error_event(response, err.message, str(err.code), deadline, end)
                break
            if inspector.done and result.on_end is not None and inspector.error is None:
                _stream_counts(inspector, result)
                await _ended(result)
            if out:
                # a client that stops reading must not hold the slot past the request's `total`
                # (the write waits while the client's buffer is full, and so does the next read)
                with deadline.at(end):
                    await response.write(out)
            if inspector.done:
                # [DONE] ends the stream, whether or not the engine closes its connection
                break
        if result.outcome == "ok":
            with deadline.at(end):
                await response.write_eof()
    except TimeoutError:
        # only a write can time out here (a read's timeout is handled above): the client stopped
        # reading and the request ran past its `total`; the stream is cut off mid-chunk, so the
        # connection is closed instead of ending it with an error event
        result.outcome = "client_timeout"
        if request.transport is not None:
            request.transport.abort()
    except ConnectionResetError:
        # the client went away between two chunks (a failed write, before the handler is
        # cancelled): not an error of ours; the caller releases everything
        result.outcome = "client_disconnect"
    finally:
        _stream_counts(inspector, result)
        if inspector.error is not None and result.outcome == "ok":
            result.outcome = "upstream_error"
    return response


async def _ended(result: RelayResult) -> None:
    """Awaits ``result.on_end`` (settlement's early release); a failure there is logged and
    the answer still ends normally (settlement runs again afterwards)."""
    on_end = result.on_end
    if on_end is None:
        return
    try:
        await on_end()
    except Exception:
        logger.exception("releasing a finished request before its end failed")


def _stream_counts(inspector: SSEInspector, result: RelayResult) -> None:
    """The stream's token counts into ``result``: the engine's usage when it sent one, else
    the text counted piece by piece as it passed (bounded memory per stream)."""
    counts = inspector.usage_tokens
    if counts is not None:
        _take_usage(*counts, result)
    if not result.usage_from_engine:
        result.completion_tokens = max(inspector.delivered_tokens, inspector.content_chunks)


#: Headers of an engine's stream that do not belong on the assembled JSON answer (lower case).
_STREAM_ONLY_HEADERS = frozenset({b"content-type", b"cache-control", b"x-accel-buffering"})


async def _relay_assembled(
    request: web.BaseRequest,
    upstream: aiohttp.ClientResponse,
    timeouts: Timeouts,
    deadline: Deadline,
    end: float | None,
    build: HeadBuilder,
    count_text: Callable[[str], int] | None,
    result: RelayResult,
    kind: str,
) -> Reply:
    """Read the engine's SSE answer to a request the client did not stream and answer with the
    JSON body the engine would have sent (:class:`~kvgate.proxy.assemble.StreamAssembler` of
    ``kind``: ``chat``, ``completions`` or ``responses``), with the engine's headers
    (``Content-Type: application/json`` instead of its stream's, no ``Cache-Control``).

    Nothing reaches the client before the end, so a failure is an error answer: an ``error``
    event → the engine's message in OpenAI's shape with the event's 4xx/5xx ``code`` (else
    500); a stream that breaks or ends before ``data: [DONE]`` (a Responses stream: before its
    terminal event; a chat stream without ``[DONE]`` passes when every choice has its
    ``finish_reason``), or an event over :data:`EVENT_LIMIT` bytes → 502 ``upstream_broken``;
    ``idle`` between chunks or the request's ``end`` (loop time) passed → 504. Settled like a
    whole body (:func:`_settle_from_body`: the usage chunk's counts, else the assembled text
    counted), also when cut off.

    Raises:
        GatewayError: 502 ``upstream_broken``, 504 ``upstream_timeout``.
    """
    assembler = StreamAssembler(kind)
    content = upstream.content
    settled = False
    try:
        while True:
            try:
                data = content.read_nowait() or await _await_bytes(
                    content, deadline, timeouts.idle, end
                )
                if result.on_first_data is not None and data:
                    _first_data(result)
            except TimeoutError:
                result.outcome = "upstream_timeout"
                raise upstream_timeout("body") from None
            except aiohttp.ClientError as exc:
                result.outcome = "stream_broken"
                raise upstream_failed(exc, "upstream_broken") from None
            if data:
                assembler.feed(data)
            else:
                assembler.finish()
            if assembler.overlong:
                result.outcome = "stream_broken"
                raise _event_too_long()
            if not data or assembler.complete or assembler.error is not None:
                break
        raw = assembler.answer()
        _settle_from_body(raw, result, count_text)
        settled = True
        error = assembler.error
        if error is not None:
            result.outcome = "upstream_error"
            status = error.get("code")
            if type(status) is not int or not 400 <= status <= 599:
                status = 500
            result.status = status
            body = reshape_upstream_error(status, orjson.dumps({"error": error}))
            return relayed(request, build, status, _JSON, body)
        if not (assembler.complete or assembler.all_finished):
            result.outcome = "stream_broken"
            raise GatewayError(
                502, "upstream stream ended early", "server_error", code="upstream_broken"
            )
        result.status = upstream.status
        headers = [
            (name, value)
            for name, value in upstream.raw_headers
            if name.lower() not in _STREAM_ONLY_HEADERS
        ]
        headers.append((b"Content-Type", b"application/json"))
        return relayed(request, build, upstream.status, tuple(headers), raw)
    finally:
        if not settled:
            _settle_from_body(assembler.answer(), result, count_text)


#: The most bytes of a passed-through answer kept to read its ``usage`` at the end (a JSON
#: body larger than this, or one that is not JSON, is relayed without being kept).
USAGE_SCAN_BYTES = 1 << 20


async def _relay_body(
    request: web.BaseRequest,
    upstream: aiohttp.ClientResponse,
    timeouts: Timeouts,
    deadline: Deadline,
    end: float | None,
    build: HeadBuilder,
    result: RelayResult,
) -> PreparedStream:
    """Write a non-SSE answer to the client as it arrives (chunked; a forwarded route's answer
    may be large or slow: audio, files), with ``idle`` between chunks and the request's ``end``
    overall; a JSON answer of at most :data:`USAGE_SCAN_BYTES` is kept and its ``usage``
    settled from at the end. An upstream that stalls or breaks mid-body gets the client's
    connection closed (a body cannot carry an error event)."""
    try:
        response = await start_stream(request, build, upstream.status, upstream.raw_headers)
    except ConnectionResetError:
        result.outcome = "client_disconnect"
        raise
    result.status = upstream.status
    keep: bytearray | None = bytearray() if "json" in upstream.content_type else None
    content = upstream.content
    try:
        while True:
            try:
                data = content.read_nowait() or await _await_bytes(
                    content, deadline, timeouts.idle, end
                )
            except TimeoutError:
                result.outcome = "upstream_timeout"
                break
            except aiohttp.ClientError:
                result.outcome = "stream_broken"
                break
            if not data:
                break
            if keep is not None:
                keep += data
                if len(keep) > USAGE_SCAN_BYTES:
                    keep = None
            with deadline.at(end):
                await response.write(data)
        if result.outcome == "ok":
            if result.on_end is not None:
                _body_counts(keep, result)
                keep = None
                await _ended(result)
            with deadline.at(end):
                await response.write_eof()
        elif request.transport is not None:
            request.transport.abort()
    except TimeoutError:
        result.outcome = "client_timeout"
        if request.transport is not None:
            request.transport.abort()
    except ConnectionResetError:
        result.outcome = "client_disconnect"
    finally:
        _body_counts(keep, result)
    return response


def _body_counts(keep: bytearray | None, result: RelayResult) -> None:
    """The ``usage`` of a passed-through JSON body (``keep``: its bytes, ``None`` when it was
    not JSON or too large) into ``result``."""
    if keep:
        counts = usage_tokens(bytes(keep))
        if counts is not None:
            _take_usage(*counts, result)


def _event_too_long() -> GatewayError:
    """502 ``upstream_broken``: the engine sent an SSE event longer than the core's
    ``EVENT_LIMIT`` without its end (as an error event once the stream started)."""
    return GatewayError(
        502,
        f"upstream sent an event of over {EVENT_LIMIT // (1024 * 1024)} MiB",
        "server_error",
        code="upstream_broken",
    )


async def _write_error_event(
    response: PreparedStream, message: str, code: str, deadline: Deadline, end: float | None
) -> None:
    """End a stream whose upstream failed with an OpenAI error event (docs/engines.md §4), within
    the request's ``end`` (loop time): a client that does not read it is not waited for."""
    try:
        with deadline.at(end):
            await response.write(
                b"data: " + error_body(message, "server_error", None, code) + b"\n\n"
            )
            await response.write_eof()
    except (ConnectionError, RuntimeError, TimeoutError):
        pass
