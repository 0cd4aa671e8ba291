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
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from kvgate.app import GET_ENDPOINTS, handle_unknown
from kvgate.metrics import FLUSH_SECONDS
from kvgate.proxy.handler import INFERENCE_ROUTES, handle_inference, handle_passthrough

if TYPE_CHECKING:
    from kvgate.app import Gateway

__all__ = ["Dispatcher", "gateway_runtime", "make_server", "run_gateway", "serve_forever"]


class Dispatcher:
    """The routing table, called by aiohttp for each request.

    ``POST`` on an inference route (``/v1/chat/completions``, ``/v1/completions``,
    ``/v1/embeddings``) → :func:`kvgate.proxy.handler.handle_inference`; ``GET`` (or ``HEAD``)
    on ``/v1/models``, ``/metrics``, ``/healthz``, ``/readyz``, ``/admin/state`` → the gateway's
    own endpoints; anything else under ``/v1/`` → the engine (passthrough, which also answers
    405 for a wrong method on an inference route); anything else → 404 / 405 in OpenAI's error
    shape. Returns the handler's coroutine itself (no extra frame on the hot path).
    """

    __slots__ = ("_gateway", "_get")

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._get = GET_ENDPOINTS

    def __call__(self, request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
        path = request.path
        method = request.method
        if method == "POST" and path in INFERENCE_ROUTES:
            return handle_inference(self._gateway, request)
        if method in ("GET", "HEAD"):
            own = self._get.get(path)
            if own is not None:
                return own(self._gateway, request)
        if path.startswith("/v1/"):
            return handle_passthrough(self._gateway, request)
        return handle_unknown(self._gateway, request)


def make_server(gateway: Gateway) -> web.Server:
    """aiohttp's low-level server for ``gateway``, created inside the running loop.

    Requests carry the body cap as ``client_max_size`` (a chunked body over it is cut off while
    it is read); ``handler_cancellation=True`` so a client disconnect cancels the handler at
    once, even while it waits for the engine; keep-alive connections idle for
    ``timeouts.client_header`` seconds are closed; no access log.
    """
    loop = asyncio.get_running_loop()
    cap = gateway.max_body_bytes

    def request_factory(
        message: Any, payload: Any, protocol: Any, writer: Any, task: Any
    ) -> web.BaseRequest:
        return web.BaseRequest(message, payload, protocol, writer, task, loop, client_max_size=cap)

    return web.Server(
        Dispatcher(gateway),
        request_factory=request_factory,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=gateway.timeouts.client_header,
    )


@contextlib.asynccontextmanager
async def gateway_runtime(gateway: Gateway) -> AsyncIterator[None]:
    """The gateway's background parts for the life of a server, in this order (and closed in
    reverse): the upstream ``ClientSession`` (no pool limit, ``connect`` timeout), the upstream
    timeouts' watchdog (:class:`~kvgate.proxy.deadline.Watchdog`), the metrics flush every :data:`~kvgate.metrics.FLUSH_SECONDS` (and once at the end), the engine metrics
    pollers (when ``gateway.poll``), SIGHUP → :meth:`Gateway.reload` (when
    ``gateway.config_path``)."""
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, connect=gateway.timeouts.connect)
    gateway.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
    loop = asyncio.get_running_loop()
    metrics = gateway.metrics

    async def flush_forever() -> None:
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            metrics.flush()

    flusher = asyncio.create_task(flush_forever())
    gateway.watchdog.start()
    poller = None
    reload_on_hup = bool(gateway.config_path)
    try:
        if gateway.poll:
            poller = await _start_poller(gateway)
        if reload_on_hup:
            loop.add_signal_handler(signal.SIGHUP, gateway.reload)
        yield
    finally:
        if reload_on_hup:
            loop.remove_signal_handler(signal.SIGHUP)
        if poller is not None:
            await poller.stop()
        flusher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flusher
        await gateway.watchdog.stop()
        metrics.flush()
        await gateway.session.close()


async def _start_poller(gateway: Gateway) -> Any:
    """Engine metrics pollers feeding the adaptive law (one task per backend)."""
    from kvgate.adaptive import AdaptiveSink, poll_targets
    from kvgate.telemetry.poller import MetricsPoller

    def shed_waiters(_backend: str) -> None:
        if gateway.queue is not None:
            gateway.queue.shed("sheddable")

    sink = AdaptiveSink(gateway, on_shed=shed_waiters)
    poller = MetricsPoller(gateway.session, sink, poll_targets(gateway))
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
) -> AsyncIterator[str]:
    """Serve ``gateway`` on ``host:port`` (default an ephemeral loopback port) for a block.

    Yields the base URL (``http://127.0.0.1:PORT``). On exit the listening socket closes first,
    in-flight requests get up to ``shutdown_timeout`` seconds to finish (then they are
    cancelled, which releases what they hold), and the background parts stop last. Used by
    ``kvgate serve``, the tests, the demo and embedding applications.
    """
    async with gateway_runtime(gateway):
        runner = web.ServerRunner(make_server(gateway), shutdown_timeout=shutdown_timeout)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port, reuse_port=reuse_port)
            await site.start()
            bound = runner.addresses[0][1]
            yield f"http://{host}:{bound}"
        finally:
            await runner.cleanup()


async def serve_forever(
    gateway: Gateway,
    *,
    host: str,
    port: int,
    reuse_port: bool,
    shutdown_timeout: float,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """``kvgate serve``'s main coroutine: serve until SIGTERM or SIGINT, then drain (see
    :func:`run_gateway`). A second signal during the drain changes nothing (SIGKILL forces a
    stop)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with run_gateway(
            gateway,
            host=host,
            port=port,
            reuse_port=reuse_port,
            shutdown_timeout=shutdown_timeout,
        ) as url:
            if on_ready is not None:
                on_ready(url)
            await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
