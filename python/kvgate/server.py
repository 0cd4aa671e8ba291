"""The gateway's HTTP server: aiohttp's low-level server with kvgate's own routing table.

kvgate serves a fixed, small set of routes, so it runs on aiohttp's documented low-level server
(``aiohttp.web.Server`` + ``web.ServerRunner``, https://docs.aiohttp.org/en/stable/web_lowlevel.html)
instead of a ``web.Application``: the same HTTP parser, keep-alive, streaming responses,
graceful shutdown and ``handler_cancellation``, without the router, the middleware chain and the
per-request application lookup (about 6 µs of CPU per request on this project's load benchmark,
``benches/RESULTS.md``). What the application would own lives here: the routing table
(:class:`Dispatcher`), the request body cap (``client_max_size``) and the lifetime of the
gateway's background parts (:func:`gateway_runtime`: the upstream session, the engine metrics
pollers, the metrics flush, SIGHUP reload).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from kvgate import memtrim
from kvgate.accesslog import flush_access_log, log_access, request_id, with_request_id
from kvgate.app import GET_ENDPOINTS, handle_model
from kvgate.errors import GatewayError, error_body, method_not_allowed
from kvgate.metrics import FLUSH_SECONDS
from kvgate.proxy.handler import authenticate, handle_forward, handle_inference
from kvgate.proxy.prepared import Reply, error_response
from kvgate.proxy.relay import reuse_trace
from kvgate.proxy.routes import RouteKind, not_forwarded, route_of

if TYPE_CHECKING:
    from kvgate.app import Gateway

logger = logging.getLogger("kvgate.serve")

__all__ = ["Dispatcher", "gateway_runtime", "make_server", "run_gateway", "serve_forever"]


class Dispatcher:
    """The routing table, called by aiohttp for each request: the route is decided once, up
    front, by :func:`kvgate.proxy.routes.route_of` (path normalised, then looked up), and the
    request handed to the handler of its kind:

    * inference route → :func:`kvgate.proxy.handler.handle_inference`;
    * the gateway's own endpoints → :data:`kvgate.app.GET_ENDPOINTS`; ``/v1/models/{id}`` →
      :func:`kvgate.app.handle_model`;
    * any other route → the gateway's ``other_routes`` policy: ``forward`` →
      :func:`kvgate.proxy.handler.handle_forward`, ``refuse`` → 404 ``unknown_url``; a target
      that is not a path (``OPTIONS *``, ``CONNECT host:port``) → 404 ``unknown_url`` always;
    * a wrong method on a known route → 405; a ``.`` or ``..`` segment → 400 ``invalid_path``
      (``/v1/../x`` would reach any engine URL once the upstream client resolves it).

    Errors are in OpenAI's shape. Returns the handler's coroutine itself (no extra frame on the
    hot path).
    """

    __slots__ = ("_gateway", "_get")

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._get = GET_ENDPOINTS

    def __call__(self, request: web.BaseRequest) -> Awaitable[Reply]:
        route = route_of(request.method, request.path)
        kind = route.kind
        gateway = self._gateway
        if kind is RouteKind.INFERENCE:
            return handle_inference(gateway, request, route.path)
        if kind is RouteKind.GATEWAY:
            return self._get[route.path](gateway, request)
        if kind is RouteKind.MODEL:
            return handle_model(gateway, request, route.model_id)
        if kind is RouteKind.OTHER:
            # only an origin-form target (a path from `/`) has an engine URL to go to: `OPTIONS *`
            # and `CONNECT host:port` (RFC 9112 §3.2.3, §3.2.4) are refused whatever the policy
            origin = route.path.startswith("/")
            if origin and gateway.other_routes == "forward":
                if not_forwarded(request.method, route.path):
                    # a client without a valid key learns nothing of the engine's routes: it
                    # is answered 401 as on every route that goes upstream
                    try:
                        authenticate(gateway, request)
                    except GatewayError as err:
                        return _answer(request, err)
                    return _answer(
                        request,
                        GatewayError(
                            403,
                            f"{request.method} {route.path} is an engine's own route "
                            "(administration, or generation without OpenAI's usage): not "
                            "forwarded. Use /v1/chat/completions, /v1/completions, "
                            "/v1/embeddings or /v1/responses.",
                            "invalid_request_error",
                            code="route_not_forwarded",
                        ),
                    )
                return handle_forward(gateway, request)
            why = "other_routes: refuse" if origin else "only paths that start with '/'"
            return _answer(
                request,
                GatewayError(
                    404,
                    f"Unknown URL: {request.method} {route.path or request.raw_path}. This "
                    "gateway serves /v1/chat/completions, /v1/completions, /v1/embeddings, "
                    f"/v1/responses and /v1/models; it refuses other routes ({why}).",
                    "invalid_request_error",
                    code="unknown_url",
                ),
            )
        if kind is RouteKind.WRONG_METHOD:
            allow = route.allow or "GET"
            return _answer(request, method_not_allowed(request.method, route.path, allow))
        return _answer(
            request,
            GatewayError(
                400,
                f"The path {route.path!r} has a '.' or '..' segment; send the resolved path.",
                "invalid_request_error",
                code="invalid_path",
            ),
        )


async def _answer(request: web.BaseRequest, err: GatewayError) -> Reply:
    """The error answer decided by the routing table (nothing read, nothing held), with the
    request's id (``x-request-id``) and its access log line."""
    started = time.perf_counter()
    rid = request_id(request.headers.get("x-request-id"))
    reply = error_response(request, err)
    reply.raw = with_request_id(reply.raw, rid)
    now = time.perf_counter()
    log_access(
        request, rid, started, now, route=request.path, status=err.status, outcome="rejected",
        reason=err.code, reply=reply,
    )  # fmt: skip
    return reply


class _RequestHandler(RequestHandler):
    """aiohttp's connection handler, answering the errors aiohttp decides itself in OpenAI's
    shape (JSON, docs/engines.md §4) instead of plain text: a request it cannot parse (bad request
    line, header or chunk size, ``Content-Length`` with ``Transfer-Encoding``, a header over
    8190 bytes, too many headers: 400 ``invalid_http``) and an unexpected exception in a handler
    (500 ``internal_error``, no traceback). The connection is closed after either, as aiohttp
    does. A client gone while its answer was written (``ConnectionResetError``) is not logged."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if isinstance(exc, ConnectionResetError):
            # the client went away as its answer's head was written (the relay counted a
            # client disconnect and settlement released everything): no traceback, no answer
            resp = web.Response(status=status)
            resp.force_close()
            return resp
        # aiohttp's version logs the error and refuses to answer when bytes already went out
        super().handle_error(request, status, exc, message)
        if status >= 500:
            body = error_body(
                "The gateway failed to handle the request.", "server_error", None, "internal_error"
            )
        else:
            text = message or "The request could not be parsed."
            body = error_body(
                f"Malformed HTTP request: {text}", "invalid_request_error", None, "invalid_http"
            )
        resp = web.Response(status=status, body=body, content_type="application/json")
        resp.force_close()
        return resp


class _Server(web.Server):
    """``web.Server`` whose connections use :class:`_RequestHandler` (aiohttp's
    ``Server.__call__`` builds the handler the same way)."""

    def __call__(self) -> RequestHandler:
        return _RequestHandler(self, loop=self._loop, **self._kwargs)


#: After an answer sent before the request's body was read (401, 413, ...), how long the rest
#: of the body is read and dropped before the connection is closed (seconds): long enough for a
#: client to finish sending and read the answer (closing at once can reset the connection under
#: it), short enough that a client streaming an endless body without a key costs a few seconds
#: of reading, not aiohttp's default 10 (12 GB over loopback).
LINGER_S = 2.0


def make_server(gateway: Gateway) -> web.Server:
    """aiohttp's low-level server for ``gateway``, created inside the running loop.

    Requests carry the body cap (``gateway.max_body_bytes`` when the request arrives, so a reload
    applies to the next request) as ``client_max_size`` (a chunked body over it is cut off while
    it is read); ``handler_cancellation=True`` so a client disconnect cancels the handler at
    once, even while it waits for the engine; keep-alive connections idle for
    ``timeouts.client_header`` seconds are closed; the rest of a body not read is dropped for
    :data:`LINGER_S` seconds at most; no access log; the errors aiohttp answers
    itself (unparsable requests, unexpected exceptions) in OpenAI's shape (:class:`_RequestHandler`).
    """
    loop = asyncio.get_running_loop()

    def request_factory(
        message: Any, payload: Any, protocol: Any, writer: Any, task: Any
    ) -> web.BaseRequest:
        # the cap is read per request: a reload may change it
        cap = gateway.max_body_bytes
        return web.BaseRequest(message, payload, protocol, writer, task, loop, client_max_size=cap)

    # aiohttp types its handler as returning a StreamResponse; the server only calls
    # ``prepare``, ``write_eof`` and ``keep_alive`` on it, which a PreparedResponse has too
    handler = cast(
        "Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]", Dispatcher(gateway)
    )
    return _Server(
        handler,
        request_factory=request_factory,
        handler_cancellation=True,
        # request bodies are decoded by the handler, under the body cap (decode_body)
        auto_decompress=False,
        access_log=None,
        keepalive_timeout=gateway.timeouts.client_header,
        lingering_time=LINGER_S,
    )


@contextlib.asynccontextmanager
async def gateway_runtime(gateway: Gateway) -> AsyncIterator[None]:
    """The gateway's background parts for the life of a server, in this order (and closed in
    reverse): the upstream ``ClientSession`` (no pool limit, ``connect`` timeout, the relay's
    connection-reuse trace), the upstream timeouts' watchdog
    (:class:`~kvgate.proxy.deadline.Watchdog`), the metrics flush every
    :data:`~kvgate.metrics.FLUSH_SECONDS` (and once at the end), the latency-target
    controller's steps (with ``slo``), the C heap's trim every
    :data:`~kvgate.memtrim.TRIM_SECONDS` (with glibc), the span exporter (with ``tracing``), the
    shared store (with ``store``), the engine metrics pollers (when ``gateway.poll``), SIGHUP →
    :meth:`Gateway.reload_soon` (when ``gateway.config_path``)."""
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, connect=gateway.timeouts.connect)
    # the trace lets the relay resend a request that failed on a pooled connection the engine
    # had closed (kvgate.proxy.relay.reuse_trace)
    # no cookie jar: a cookie one tenant's answer set (an engine, a load balancer's affinity
    # cookie) must not ride on every other tenant's requests
    gateway.session = aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        trace_configs=[reuse_trace()],
        cookie_jar=aiohttp.DummyCookieJar(),
    )
    loop = asyncio.get_running_loop()
    metrics = gateway.metrics

    async def flush_forever() -> None:
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            metrics.flush()

    flusher = asyncio.create_task(flush_forever())
    slo = gateway.slo

    async def slo_forever() -> None:
        # the latency-target controller steps on its own period, traffic or not
        while True:
            await asyncio.sleep(slo.interval_s)
            slo.tick()

    stepper = asyncio.create_task(slo_forever()) if slo is not None else None

    async def trim_forever() -> None:
        # the C heap's free pages back to the system (kvgate.memtrim), off the event loop
        while True:
            await asyncio.sleep(memtrim.TRIM_SECONDS)
            await asyncio.to_thread(memtrim.trim_heap)

    trimmer = asyncio.create_task(trim_forever()) if memtrim.AVAILABLE else None
    gateway.watchdog.start()
    if gateway.tracing is not None:
        gateway.tracing.start()
    poller = None
    reload_on_hup = bool(gateway.config_path)
    try:
        await gateway.store.start([b.name for b in gateway.config.backends])
        if gateway.poll:
            poller = await _start_poller(gateway)
        if reload_on_hup:
            loop.add_signal_handler(signal.SIGHUP, gateway.reload_soon)
        yield
    finally:
        if reload_on_hup:
            loop.remove_signal_handler(signal.SIGHUP)
        if poller is not None:
            await poller.stop()
        flusher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flusher
        for task in (stepper, trimmer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await gateway.watchdog.stop()
        await gateway.store.close()
        metrics.flush()
        flush_access_log()
        await gateway.session.close()
        if gateway.tracing is not None:  # the last spans go out (bounded by the export timeout)
            await asyncio.to_thread(gateway.tracing.shutdown)


async def _start_poller(gateway: Gateway) -> Any:
    """Engine metrics pollers feeding the adaptive law (one task per backend); with
    ``--workers N``, each worker polls its share of the backends and follows the others'
    polls (:mod:`kvgate.telemetry.share`)."""
    from kvgate.adaptive import AdaptiveSink, poll_targets
    from kvgate.telemetry.poller import MetricsPoller

    def shed_waiters(backend: str) -> None:
        if gateway.queue is not None:
            gateway.queue.shed("sheddable", backend)

    sink = AdaptiveSink(gateway, on_shed=shed_waiters)
    share = None
    if gateway.workers > 1 and gateway.controller.shm_name is not None:
        from kvgate.telemetry.share import BoardShare

        ids = {b.name: b.id for b in gateway.backends}
        share = BoardShare(gateway.controller, ids, gateway.worker, gateway.workers)
    # its own session, no traces
    poller = MetricsPoller(None, sink, poll_targets(gateway), share=share)
    gateway.poller = poller
    await poller.start()
    return poller


@contextlib.asynccontextmanager
async def run_gateway(
    gateway: Gateway,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    reuse_port: bool = False,
    shutdown_timeout: float = 60.0,
    ssl_context: ssl.SSLContext | None = None,
) -> AsyncIterator[str]:
    """Serve ``gateway`` on ``host:port`` (default an ephemeral loopback port) for a block.

    With ``ssl_context`` (:func:`kvgate.tls.server_context`) the socket serves HTTPS only (a
    plain-HTTP request on it fails its TLS handshake and the connection is closed).
    Yields the base URL (``http://127.0.0.1:PORT``, ``https://`` with TLS). On exit the listening socket closes first,
    in-flight requests get up to ``shutdown_timeout`` seconds to finish (then they are
    cancelled, which releases what they hold), and the background parts stop last. Used by
    ``kvgate serve``, the tests, the demo and embedding applications.
    """
    async with gateway_runtime(gateway):
        server = make_server(gateway)
        runner = web.ServerRunner(server, shutdown_timeout=shutdown_timeout)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port, reuse_port=reuse_port, ssl_context=ssl_context)
            await site.start()
            bound = runner.addresses[0][1]
            scheme = "http" if ssl_context is None else "https"
            yield f"{scheme}://{host}:{bound}"
        finally:
            # aiohttp's drain waits `shutdown_timeout`, then only stops reading request bodies
            # and waits as long again; the deadline is ours: at `shutdown_timeout` every
            # connection still open is closed, which cancels its handler (handler_cancellation)
            # and so releases what it holds
            loop = asyncio.get_running_loop()
            cut = loop.call_later(shutdown_timeout, _close_connections, server)
            try:
                await runner.cleanup()
            finally:
                cut.cancel()


def _close_connections(server: web.Server) -> None:
    for connection in server.connections:
        connection.force_close()


async def serve_forever(
    gateway: Gateway,
    *,
    host: str,
    port: int,
    reuse_port: bool,
    shutdown_timeout: float,
    on_ready: Callable[[str], None] | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> None:
    """``kvgate serve``'s main coroutine: serve until SIGTERM or SIGINT, then drain (see
    :func:`run_gateway`; ``ssl_context``: serve HTTPS). A second signal during the drain changes nothing (SIGKILL forces a
    stop). SIGHUP reloads the configuration file, or is logged and ignored without one."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if not gateway.config_path:  # with a file, gateway_runtime reloads it on SIGHUP
        loop.add_signal_handler(signal.SIGHUP, _nothing_to_reload)
    try:
        async with run_gateway(
            gateway,
            host=host,
            port=port,
            reuse_port=reuse_port,
            shutdown_timeout=shutdown_timeout,
            ssl_context=ssl_context,
        ) as url:
            if on_ready is not None:
                on_ready(url)
            await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)


def _nothing_to_reload() -> None:
    logger.warning("SIGHUP ignored: started without --config, there is no file to reload")
