"""Responses serialized ahead and written to the client with one write.

The answers kvgate gives itself — refusals (429/503) above all, which must cost little more than
a bare 429 (measured side by side in benches/RESULTS.md) — are small and complete before the first byte goes out, so they are built
as the exact bytes of an HTTP/1.1 message in Rust (:func:`kvgate._core.http_response`,
:meth:`kvgate._core.AdmissionController.refusal_response`) and handed to aiohttp as a
:class:`PreparedResponse`. aiohttp's low-level server drives any response through ``prepare`` and
``write_eof`` and then reads ``keep_alive``; a ``PreparedResponse`` writes its bytes through the
request's own payload writer (``request.writer.write``, which raises ``ConnectionResetError`` on
a closed connection and waits for the client when its buffer is full), so keep-alive,
pipelining and disconnects behave as with a ``web.Response``, without building a header
multidict and serializing it per request (measured: 18 µs against 32 µs of CPU per refusal,
``benches/RESULTS.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from kvgate._core import http_response
from kvgate.errors import GatewayError

__all__ = [
    "HeadBuilder",
    "PreparedResponse",
    "PreparedStream",
    "Reply",
    "connection_header",
    "error_response",
    "prepared",
    "relayed",
    "start_stream",
]


class PreparedResponse:
    """A complete HTTP/1.1 response (status line, headers, body) as bytes, returned from a
    handler in place of a ``web.Response``.

    Args:
        status: the HTTP status code (for logs and tests; the bytes carry it).
        raw: the message as it goes on the wire.
        connection: the ``Connection`` value the message carries (:func:`connection_header`);
            ``close`` ends the connection after it (``keep_alive`` false).
    """

    __slots__ = ("keep_alive", "raw", "status")

    def __init__(self, status: int, raw: bytes, connection: str | None) -> None:
        self.status = status
        self.raw = raw
        self.keep_alive = connection != "close"

    async def prepare(self, request: web.BaseRequest) -> None:
        """Write the whole message (aiohttp calls this once the handler returned it).

        Raises:
            ConnectionResetError: the client is gone (aiohttp counts it as a disconnect).
        """
        await request.writer.write(self.raw)

    async def write_eof(self, data: bytes = b"") -> None:
        """Nothing left to write: the message carried its ``Content-Length`` and body."""

    def __repr__(self) -> str:
        return f"<PreparedResponse {self.status} {len(self.raw)} bytes>"


class PreparedStream:
    """A streamed response whose head kvgate wrote itself (:func:`start_stream`): the body goes
    out through the request's payload writer, chunked for HTTP/1.1 clients (``Transfer-Encoding:
    chunked``), until the connection closes for HTTP/1.0 ones. Returned from a handler like a
    prepared ``web.StreamResponse``.

    Attributes:
        status: the HTTP status code sent.
        keep_alive: whether the connection stays open after the stream.
    """

    __slots__ = ("_eof", "_writer", "keep_alive", "status")

    def __init__(self, status: int, connection: str | None, writer: AbstractStreamWriter) -> None:
        self.status = status
        self.keep_alive = connection != "close"
        self._writer = writer
        self._eof = False

    async def prepare(self, request: web.BaseRequest) -> None:
        """Nothing to do: the head went out when the stream started."""

    async def write(self, data: bytes) -> None:
        """Send ``data`` (framed as one chunk for HTTP/1.1); waits while the client's buffer is
        full.

        Raises:
            ConnectionResetError: the client is gone.
            RuntimeError: the stream already ended.
        """
        if self._eof:
            raise RuntimeError("write() after write_eof()")
        await self._writer.write(data)

    async def write_eof(self, data: bytes = b"") -> None:
        """End the stream (the last chunk for HTTP/1.1); later calls do nothing.

        Raises:
            ConnectionResetError: the client is gone.
        """
        if self._eof:
            return
        self._eof = True
        await self._writer.write_eof(data)

    def __repr__(self) -> str:
        return f"<PreparedStream {self.status}>"


#: Builds a relayed response's bytes: ``(status, upstream_headers, body, connection, chunked)``
#: → bytes, e.g. ``functools.partial(controller.relay_http, backend_id, tenant_id)`` (the
#: engine's headers minus hop-by-hop ones, kvgate's ``x-ratelimit-*``; see
#: :meth:`kvgate._core.AdmissionController.relay_http`).
HeadBuilder = Callable[[int, Any, "bytes | None", "str | None", bool], bytes]


def relayed(
    request: web.BaseRequest, build: HeadBuilder, status: int, upstream_headers: Any, body: bytes
) -> PreparedResponse:
    """A whole relayed answer to ``request`` (``upstream_headers``: the engine's
    ``(name, value)`` byte pairs, aiohttp's ``raw_headers``) as a :class:`PreparedResponse`."""
    connection = connection_header(request)
    raw = build(status, upstream_headers, body, connection, True)
    return PreparedResponse(status, raw, connection)


async def start_stream(
    request: web.BaseRequest, build: HeadBuilder, status: int, upstream_headers: Any
) -> PreparedStream:
    """Write the head of a relayed stream to ``request`` (see :func:`relayed`) and return the
    stream: chunked for an HTTP/1.1 client, delimited by the connection's close for HTTP/1.0;
    the answer to ``HEAD`` and a ``204`` / ``304`` have no body, so no framing at all.

    Raises:
        ConnectionResetError: the client is gone.
    """
    # the answer to HEAD and a 204 / 304 end at their head (RFC 9110 §9.3.2, §15.3.5, §15.4.5):
    # no framing, or the last chunk would be read as the start of the next response
    bodiless = request.method == "HEAD" or status in (204, 304)
    chunked = request.version >= (1, 1) and not bodiless
    # an HTTP/1.0 client reads the body until the connection closes
    connection = connection_header(request, close=request.version < (1, 1) and not bodiless)
    head = build(status, upstream_headers, None, connection, chunked)
    writer = request.writer
    await writer.write(head)
    if chunked:
        writer.enable_chunking()
    return PreparedStream(status, connection, writer)


#: What kvgate's handlers return: aiohttp's responses (streams, relayed bodies, its own GET
#: endpoints) or a prepared one.
Reply = web.StreamResponse | PreparedResponse | PreparedStream


def connection_header(request: web.BaseRequest, close: bool = False) -> str | None:
    """The ``Connection`` value a response to ``request`` carries, as aiohttp writes it:
    ``close`` when the client asked to close or ``close`` is forced, ``keep-alive`` for an
    HTTP/1.0 client keeping the connection, else nothing (HTTP/1.1 default)."""
    if close or not request.keep_alive:
        return "close"
    if request.version < (1, 1):
        return "keep-alive"
    return None


def prepared(
    request: web.BaseRequest,
    status: int,
    headers: list[tuple[str, str]],
    body: bytes,
    close: bool = False,
) -> PreparedResponse:
    """A :class:`PreparedResponse` to ``request`` (see :func:`kvgate._core.http_response` for
    what ``headers`` may hold; ``close`` forces ``Connection: close``; the answer to ``HEAD``
    carries the ``Content-Length`` of ``body`` but not the body).

    Raises:
        ValueError: a status outside 100..=999, or a header that could split the response.
    """
    connection = connection_header(request, close)
    raw = http_response(status, headers, body, connection)
    if body and request.method == "HEAD":  # the Content-Length of the body, without it
        raw = raw[: -len(body)]
    return PreparedResponse(status, raw, connection)


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
