"""The :class:`Gateway` state (what every request needs, built by :mod:`kvgate.gateway_build`)
and the gateway's own HTTP endpoints (served by :mod:`kvgate.server`).

The state: the Rust admission core (``kvgate._core``), the per-model request analysers, the
backends and their upstream session, the tenant table, the wait queue, the store, metrics and
the engine metrics pollers. It holds no request policy: a request's stages are functions of
their own modules that read it (:mod:`kvgate.proxy.handler` calls them in order).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import hmac
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kvgate import ModelRegistry, ReplicaSet, dashboard
from kvgate.admission.identity import TenantIndex, TenantTable, api_key
from kvgate.admission.retry_hint import RunningRequests
from kvgate.config import TimeoutsConfig
from kvgate.errors import GatewayError, invalid_value
from kvgate.metrics import GatewayMetrics
from kvgate.proxy.deadline import Watchdog
from kvgate.proxy.prepared import Reply, error_response
from kvgate.proxy.routes import normalize_path
from kvgate.store import LocalStore
from kvgate.usage import usage_reply

__all__ = [
    "Backend",
    "Gateway",
    "ModelRoute",
    "Tenant",
]

logger = logging.getLogger("kvgate.gateway")


@dataclass(slots=True)
class Backend:
    """One upstream engine (a replica).

    Attributes:
        name: declared name (a metric label).
        url: base URL without trailing slash (``http://127.0.0.1:8000``).
        id: index in the admission core.
        models: model names it serves.
        metrics_url: where its Prometheus text is scraped.
        engine: engine adapter name (``auto``, ``vllm``, ...).
        healthy: routing flag; a backend whose health check fails is skipped.
        kv_usage: last KV-cache usage ratio (0..1) read from its metrics, or ``None``.
        waiting: last waiting-request count read from its metrics, or ``None``.
        bound_by: what holds its concurrency and TPM below base now, set by the adaptive
            sink (one of :data:`kvgate.adaptive.BOUND_BY`; ``none`` at base).
    """

    name: str
    url: str
    id: int
    models: list[str]
    metrics_url: str
    engine: str = "auto"
    config: Any = None
    stale: bool = False
    waiting: int | None = None
    bound_by: str = "none"
    #: the routing stage's replica sets (:class:`kvgate.ReplicaSet`) this backend is in, told
    #: of its health and KV-cache usage as they change (:meth:`Gateway.index_replicas`)
    replica_sets: list[Any] = field(default_factory=list, repr=False)
    _healthy: bool = field(default=True, repr=False)
    _kv_usage: float | None = field(default=None, repr=False)

    @property
    def healthy(self) -> bool:
        """Routing flag: a backend whose health check fails is skipped."""
        return self._healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        self._healthy = value
        for replicas in self.replica_sets:
            replicas.set_healthy(self.id, value)

    @property
    def kv_usage(self) -> float | None:
        """Last KV-cache usage ratio (0..1) read from its metrics, or ``None``."""
        return self._kv_usage

    @kv_usage.setter
    def kv_usage(self, value: float | None) -> None:
        self._kv_usage = value
        for replicas in self.replica_sets:
            replicas.set_kv_usage(self.id, value)

    @property
    def api_key(self) -> str | None:
        """The engine's API key (config ``api_key_env``), or ``None``: sent to the engine as
        ``Authorization: Bearer <key>`` by every request kvgate makes to it."""
        return getattr(self.config, "api_key", None)

    @property
    def stream_upstream(self) -> bool:
        """Whether requests the client did not stream go to this engine as streams, their
        answer assembled by kvgate (config ``stream_upstream``, default ``True``)."""
        return bool(getattr(self.config, "stream_upstream", True))

    def upstream_headers(self, content_type: str) -> dict[str, str]:
        """The headers of a request to this engine: ``Content-Type`` and, when the backend has
        an API key, ``Authorization: Bearer <key>``. Nothing of the client's request (its own
        ``Authorization`` or ``api-key`` in particular) is ever forwarded."""
        key = self.api_key
        if key is None:
            return {"Content-Type": content_type}
        return {"Content-Type": content_type, "Authorization": f"Bearer {key}"}


@dataclass(slots=True)
class ModelRoute:
    """A served model: its analyser and the backends (replicas) that serve it.

    Attributes:
        replicas: its backends as the routing stage reads them (:class:`kvgate.ReplicaSet`,
            in the order of :attr:`backends`; made by :meth:`Gateway.index_replicas`).
        open_to: the replicas open to tenants limited to some backends, by the set of backend
            names they may use (made when first asked, :meth:`Gateway.replicas_open_to`).
    """

    name: str
    analyzer: Any
    backends: list[Backend]
    count_text: Callable[[str], int] | None = None
    replicas: Any = field(default=None, repr=False)
    open_to: dict[frozenset[str], tuple[Any, list[Backend]]] = field(
        default_factory=dict, repr=False
    )


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Holds off Python's cyclic garbage collector for the block (restored as it was after,
    also on an error): reading a large configuration (100,000 tenants: about two million
    objects) would otherwise set off collection after collection, each walking every object
    made so far while holding the interpreter (``kvgate serve`` of 100,000 tenants answers
    2.0 s after it starts instead of 2.4; a reload's pause of the event loop about halved:
    ``benches/tenants/reload_pause.py``)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@dataclass(slots=True)
class Tenant:
    """A tenant: who is calling, at which priority class.

    Attributes:
        id: index in the admission core.
        name: declared name (a metric label; never the key).
        priority: ``critical`` | ``standard`` | ``sheddable``.
        key_hashes: SHA-256 hex digests of its API keys.
        max_wait_ms: longest time a refused request may wait in the priority queue.
        shadow: its refusals are counted, not enforced.
        backends: names of the backends it may be routed to (config ``tenants[].backends``;
            its guaranteed slots apply on these); ``None`` = every backend.
    """

    id: int
    name: str
    priority: str = "standard"
    key_hashes: tuple[str, ...] = ()
    max_wait_ms: int = 0
    shadow: bool = False
    backends: frozenset[str] | None = None


@dataclass
class Gateway:
    """Everything a request needs, built once at start-up (and swapped on reload).

    Attributes:
        controller: the Rust ``AdmissionController``.
        models: model name → :class:`ModelRoute`.
        backends: all backends, in core id order.
        tenants: all tenants; ``anonymous`` (if any) is used when no key is sent.
        max_body_bytes: the request body cap (bytes).
        timeouts: upstream and client timeouts (seconds).
        watchdog: enforces the upstream timeouts (one sweep per loop, not a timer per wait).
        require_key: refuse requests without a known API key (401).
    """

    controller: Any
    models: dict[str, ModelRoute]
    backends: list[Backend]
    tenants: list[Tenant]
    max_body_bytes: int = 8 * 1024 * 1024
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    anonymous: Tenant | None = None
    config: Any = None
    #: the configuration the gateway started with: a reload that changes what applies only
    #: at start (store, listen, workers, tracing, model settings) is told so against it, not
    #: against the last file read (which may carry such a change, not applied)
    started_config: Any = None
    config_path: str | None = None
    #: applied to every reloaded configuration: the command-line flags that win over the file
    config_overrides: Callable[[Any], Any] | None = None
    #: applies a new configuration to this gateway (``gateway_build.apply_config``, given by
    #: the builder so this module does not import it back); ``None``: reload is a no-op
    apply_config: Callable[[Gateway, Any], None] | None = None
    #: makes a new configuration ready for :attr:`apply_config` without changing this gateway
    #: (``gateway_build.prepare_reload``: its limits tried, what changes worked out), where the
    #: file is read (a worker thread at SIGHUP); ``None``: :attr:`apply_config` does it
    prepare_config: Callable[[Gateway, Any], Any] | None = None
    #: a reload failed after it began to change the core (the core refused a step): what the
    #: core holds is part old file, part new, and the next reload sets every tenant again
    partly_applied: bool = False
    poll: bool = False
    #: this process's index among the workers of ``--workers N`` (0 with one process), and N
    #: as it was at start (a reload's ``workers`` applies at the next start): the worker polls
    #: the backends whose core id is its index modulo N and follows the others' polls through
    #: the shared region (:mod:`kvgate.telemetry.share`)
    worker: int = 0
    workers: int = 1
    session: aiohttp.ClientSession = field(init=False)
    watchdog: Watchdog = field(init=False, default_factory=Watchdog)
    metrics: GatewayMetrics = field(init=False)
    discovered_capacity: dict[str, int] = field(init=False, default_factory=dict)
    #: backend name → what the engine said about itself at start-up
    #: (:class:`kvgate.telemetry.discovery.EngineInfo`; ``kvgate serve --upstream``)
    discovery: dict[str, Any] = field(default_factory=dict)
    #: backend name → the engine's slot count (discovered; 64 where it states none) that the
    #: backend's slot limit follows (at least the guaranteed slots of its tenants), for the
    #: backends whose limit is the engine's own rather than configured
    engine_slots: dict[str, int] = field(init=False, default_factory=dict)
    poller: Any = field(init=False, default=None)
    #: the reload SIGHUP started (:meth:`reload_soon`), and whether another SIGHUP came during it
    _reloading: asyncio.Future[None] | None = field(init=False, default=None, repr=False)
    _reload_again: bool = field(init=False, default=False, repr=False)
    #: why the last reload was refused (``None`` once one applied)
    last_refusal: Exception | None = field(init=False, default=None, repr=False)
    #: a reload waits for requests of removed tenants to end (its refusal was logged once)
    _retrying: bool = field(init=False, default=False, repr=False)
    queue: Any = field(init=False, default=None)
    registry: Any = field(init=False, default=None)
    #: this worker's admitted, unsettled requests: the retry hints of slot refusals
    running: RunningRequests = field(init=False, default_factory=RunningRequests)
    #: where the limits live across replicas: :class:`kvgate.store.LocalStore` (this host
    #: only) or :class:`kvgate.store.redis_store.RedisStore` (config ``store``)
    store: Any = field(default_factory=LocalStore)
    #: backend name → its prefill budget (:class:`kvgate.admission.prefill.PrefillGate`)
    prefill: dict[str, Any] = field(default_factory=dict)
    #: the latency-target controller (:class:`kvgate.admission.slo.SloController`), or ``None``
    slo: Any = None
    #: OpenTelemetry traces (:class:`kvgate.tracing.Tracing`, config ``tracing``), or ``None``
    tracing: Any = None
    #: who is calling: the tenants by API key (:class:`kvgate.admission.identity.TenantTable`)
    identity: TenantTable = field(init=False)
    #: the ``GET /metrics`` text being written (:meth:`metrics_text`)
    _metrics_text: asyncio.Future[bytes] | None = field(init=False, default=None, repr=False)
    #: every backend as the routing stage reads them (:meth:`index_replicas`)
    replicas: ReplicaSet = field(init=False, repr=False)
    _by_name: dict[str, Backend] = field(init=False, repr=False)
    _open_to: dict[frozenset[str], tuple[ReplicaSet, list[Backend]]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from kvgate.admission.wait_queue import PriorityWaitQueue

        self._by_name = {b.name: b for b in self.backends}
        self.index_replicas()
        self.identity = TenantTable(self.tenants, self.anonymous)
        # one JSON parse per request: the registry picks the model's analyser itself
        self.registry = ModelRegistry([m.analyzer for m in self.models.values()])
        self.metrics = GatewayMetrics(self.read_state, lambda: int(self.controller.leaks))
        self.metrics.stage_gauges.gateway = self
        self.metrics.init_backends(b.name for b in self.backends)
        size = self.config.queue.max_size if self.config is not None else 1024
        self.queue = (
            PriorityWaitQueue(max_waiters=size, on_wait=self._observe_wait) if size > 0 else None
        )
        self.metrics.queue_depth_of = (
            (lambda cls: self.queue.depth(cls)) if self.queue is not None else (lambda cls: 0)
        )

    def set_prefill_capacity(self, backend: str, kv_capacity_tokens: int | None) -> None:
        """(Re)makes ``backend``'s prefill budget from its configuration, the prefill chunk the
        engine stated at discovery and the engine's KV capacity (tokens; start-up, discovery,
        reload). Tokens in prefill when it changes are forgotten by the new gate (their
        tickets leave the old one)."""
        from kvgate.admission.prefill import gate_for

        b = self.backend_named(backend)
        chunk = getattr(self.discovery.get(backend), "prefill_chunk_tokens", None)
        configured = getattr(b.config, "prefill_token_budget", None)
        if kv_capacity_tokens is None and b.config is not None:
            limit = b.config.inflight_token_limit
            if limit is not None:  # a configured budget is a share of the KV capacity
                kv_capacity_tokens = int(limit / b.config.capacity_safety_factor)
        gate = gate_for(configured, kv_capacity_tokens, self.notify_waiters, chunk)
        old = self.prefill.get(backend)
        if gate is None:
            self.prefill.pop(backend, None)
        elif old is None or old.budget != gate.budget:
            self.prefill[backend] = gate

    def notify_waiters(self) -> None:
        """Wakes the priority wait queue (if anyone waits) to try its waiters again: call it
        when a limit grew (a poll, a reload, the prefill budget freed tokens)."""
        if self.queue is not None and self.queue.waiting:
            self.queue.notify()

    def reload(self) -> bool:
        """Re-read ``config_path`` and apply it, with :attr:`config_overrides`. An invalid file
        is refused with a log line and the running configuration stays in force; returns
        whether it was applied. ``listen`` and ``workers`` need a restart (a warning says so
        when they changed). Reads the file on the calling thread: SIGHUP uses
        :meth:`reload_soon`, which reads it on a worker thread."""
        if self.config_path is None or self.apply_config is None:
            return False
        self._reload_again = True  # a SIGHUP reload that waits reads the file again after this
        try:
            new = self._read_config()
        except Exception as exc:
            self._refused(exc)
            return False
        return self._apply(new)

    def reload_soon(self) -> None:
        """SIGHUP's reload: the file is read and checked, its limits tried on a scratch core
        and what it changes worked out, on a worker thread (with 100,000 tenants that is
        seconds of work the event loop would otherwise spend answering nothing), then the
        changes are applied on the event loop as :meth:`reload` does. A SIGHUP during a
        reload reads the file again once that one is done."""
        if self.config_path is None or self.apply_config is None:
            return
        if self._reloading is not None and not self._reloading.done():
            self._reload_again = True
            return
        self._reloading = asyncio.ensure_future(self._reload_in_background())

    async def _reload_in_background(self) -> None:
        while True:
            self._reload_again = False
            try:
                new = await asyncio.to_thread(self._read_config)
            except Exception as exc:
                self._refused(exc)
            else:
                # a refusal that time mends (``retry_after_s``: requests of removed tenants
                # still hold the ids the file needs): the file as read is applied again until
                # it applies or another reload comes (which reads the file again), so that every
                # replica ends up with it; it is not read again (100,000 tenants: seconds of CPU)
                while not self._apply(new) and not self._read_again():
                    retry = getattr(self.last_refusal, "retry_after_s", None)
                    if retry is None:
                        break
                    await asyncio.sleep(retry)
                    if self._read_again():
                        break
            if not self._read_again():
                return

    def _read_again(self) -> bool:
        """Whether a reload came during this one (the file is read again)."""
        return self._reload_again

    def _apply(self, new: Any) -> bool:
        assert self.apply_config is not None
        try:
            self.apply_config(self, new)
        except Exception as exc:
            self._refused(exc)
            return False
        self.last_refusal = None
        self._retrying = False
        return True

    def _read_config(self) -> Any:
        """The file, read and checked, made ready for :attr:`apply_config` by
        :attr:`prepare_config` when given. The cyclic garbage collector waits meanwhile (and
        runs again after, as before): the objects a large file makes (100,000 tenants: about
        two million) would set off collection after collection, each walking them all while
        holding the interpreter, so pausing the event loop (``benches/tenants/reload_pause.py``);
        they are walked once, at the next collection."""
        from kvgate.config import load_config

        assert self.config_path is not None
        with collector_paused():
            new = load_config(self.config_path)
            if self.config_overrides is not None:
                new = self.config_overrides(new)
            return new if self.prepare_config is None else self.prepare_config(self, new)

    def _refused(self, exc: Exception) -> None:
        self.last_refusal = exc
        if getattr(exc, "retry_after_s", None) is None:
            self._retrying = False
        elif self._retrying:  # said once, at the first try
            return
        else:
            self._retrying = True
        if self.partly_applied:
            logger.error(
                "reload of %s failed part way, some of its limits are in force: %s; reload a "
                "file that applies (the next reload sets every tenant again)",
                self.config_path,
                exc,
            )
            return
        logger.error(
            "reload of %s refused, keeping the running configuration: %s", self.config_path, exc
        )

    def _observe_wait(self, priority: str, seconds: float) -> None:
        self.metrics.queue_wait.labels(priority).observe(seconds)

    @property
    def other_routes(self) -> str:
        """What happens to a request on a route that is neither an inference route nor one of
        the gateway's own (config ``other_routes``): ``refuse`` (404, the default) or
        ``forward`` (admitted against the tenant's and a backend's limits and relayed)."""
        cfg = self.config
        return cfg.other_routes if cfg is not None else "refuse"

    def set_tenants(
        self, tenants: list[Tenant], anonymous: Tenant | None, index: TenantIndex | None = None
    ) -> None:
        """Replace the tenant table (start-up and reload): keys, classes, wait times;
        ``index``: its lookups, when built already (:meth:`TenantTable.index`)."""
        self.tenants, self.anonymous = tenants, anonymous
        self.identity.replace(tenants, anonymous, index)

    def metrics_text(self) -> Awaitable[bytes]:
        """The ``GET /metrics`` text: the gauges of the gateway's state read on the event loop,
        the counters and histograms read and the text written on a worker thread
        (:meth:`kvgate.metrics.GatewayMetrics.snapshot`). One at a time: a scrape that comes
        while another's text is being written gets that text, so a flood of scrapes costs
        about one (the text is at most that scrape's age older)."""
        writing = self._metrics_text
        if writing is None or writing.done():
            writing = self._metrics_text = asyncio.ensure_future(
                asyncio.to_thread(self.metrics.snapshot())
            )
        # (one scrape's client going away must not cancel the text the others wait for)
        return asyncio.shield(writing)

    def backend_named(self, name: str) -> Backend:
        """The backend called ``name`` (``KeyError`` if none)."""
        return self._by_name[name]

    def index_replicas(self) -> None:
        """(Re)makes the routing stage's replica sets (:class:`kvgate.ReplicaSet`): one of
        every backend (:attr:`replicas`), one per model (:attr:`ModelRoute.replicas`), each
        told of its members' health and KV-cache usage now, and each backend told which sets
        it is in. The sets made for tenants limited to some backends are forgotten (made again
        when next asked: a reload may have changed those limits)."""
        for b in self.backends:
            b.replica_sets = []
        self.replicas = self._replica_set(self.backends)
        self._open_to = {}
        for m in self.models.values():
            m.replicas = self._replica_set(m.backends)
            m.open_to = {}

    @staticmethod
    def _replica_set(backends: list[Backend]) -> ReplicaSet:
        replicas = ReplicaSet([b.id for b in backends])
        for b in backends:
            replicas.set_healthy(b.id, b.healthy)
            replicas.set_kv_usage(b.id, b.kv_usage)
            b.replica_sets.append(replicas)
        return replicas

    def replicas_open_to(
        self, allowed: frozenset[str], model: ModelRoute | None = None
    ) -> tuple[ReplicaSet, list[Backend]]:
        """The replicas of ``model`` (of every backend when ``None``) that a tenant limited to
        the backends named ``allowed`` may use, and those backends in the set's order (made
        once per set of names and model, then kept up to date like the others)."""
        cache = self._open_to if model is None else model.open_to
        got = cache.get(allowed)
        if got is None:
            members = [b for b in (self.backends if model is None else model.backends)
                       if b.name in allowed]  # fmt: skip
            got = cache[allowed] = (self._replica_set(members), members)
        return got

    # ---- state ----------------------------------------------------------------------------
    def read_state(self) -> list[tuple[str, dict[str, Any]]]:
        """``[(backend name, core state dict)]`` for metrics and ``/admin/state``."""
        return [(b.name, self.controller.backend_state(b.id)) for b in self.backends]


# ---- HTTP endpoints besides inference ----------------------------------------------------
async def handle_models(gw: Gateway, request: web.BaseRequest) -> web.Response:
    """``GET /v1/models``: the models this gateway serves (OpenAI list shape)."""
    now = int(time.time())
    data = [_model_object(name, route, now) for name, route in gw.models.items()]
    return web.Response(
        body=orjson.dumps({"object": "list", "data": data}), content_type="application/json"
    )


async def handle_metrics(gw: Gateway, request: web.BaseRequest) -> web.Response:
    """``GET /metrics``: Prometheus text exposition (:meth:`Gateway.metrics_text`)."""
    body = await gw.metrics_text()
    return web.Response(
        body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


async def handle_healthz(gw: Gateway, request: web.BaseRequest) -> web.Response:
    """``GET /healthz``: the process is up."""
    return web.json_response({"status": "ok"})


async def handle_readyz(gw: Gateway, request: web.BaseRequest) -> web.Response:
    """``GET /readyz``: 200 while at least one backend is in routing, else 503.

    Backends start in routing and leave it after ``unhealthy_after`` (3) failed health checks in
    a row (:mod:`kvgate.telemetry.poller`), so the answer turns 503 a few poll intervals after
    every engine went down, or after start-up when none is reachable."""
    ready = any(b.healthy for b in gw.backends)
    return web.json_response({"ready": ready}, status=200 if ready else 503)


def admin_key_ok(gw: Gateway, key: str | None) -> bool:
    """Whether ``key`` opens the gateway's admin endpoints: always when no
    ``admin_key_sha256`` is configured, else when the SHA-256 of ``key`` (UTF-8) equals it
    (compared in constant time). ``None`` or ``""`` is no key."""
    want = getattr(gw.config, "admin_key_sha256", None)
    if not want:
        return True
    digest = hashlib.sha256((key or "").encode("utf-8", "surrogatepass")).digest()
    return hmac.compare_digest(digest, bytes.fromhex(want))


def admin_refusal(request: web.BaseRequest) -> Reply:
    """401 ``invalid_api_key`` (OpenAI's error shape) for an admin endpoint without its key."""
    return error_response(
        request,
        GatewayError(401, "Admin key required.", "invalid_request_error", code="invalid_api_key"),
    )


def admin_denied(gw: Gateway, request: web.BaseRequest) -> Reply | None:
    """The 401 (``invalid_api_key``, OpenAI's error shape) for an admin endpoint asked without
    the admin key (``Authorization: Bearer`` or ``api-key``, :func:`admin_key_ok`); ``None``
    when the key matches or none is configured."""
    return None if admin_key_ok(gw, api_key(request.headers)) else admin_refusal(request)


async def handle_admin_usage(gw: Gateway, request: web.BaseRequest) -> Reply:
    """``GET /admin/usage``: per tenant × model × outcome, the requests and the prompt and
    completion tokens charged, over ``?from=`` / ``?to=`` (Unix seconds or RFC 3339; default
    since start), as JSON or ``?format=csv`` (:func:`kvgate.usage.usage_reply`). This worker's
    own count (each worker of ``--workers N`` answers for itself). Needs the admin key when
    ``admin_key_sha256`` is configured (401 otherwise); a bad parameter is a 400."""
    denied = admin_denied(gw, request)
    if denied is not None:
        return denied
    gw.metrics.flush()
    return await usage_reply(gw.metrics.usage, request)


#: tenants ``GET /admin/state`` lists when not asked for a page size: past a few thousand,
#: building the document holds the event loop (100,000 tenants: about 25 MB, most of a second)
ADMIN_STATE_TENANTS = 1000
#: the largest page (``limit``) one ``GET /admin/state`` takes (names, ``tenant``, are bounded
#: by the request line: aiohttp's 8,190 bytes)
ADMIN_STATE_MAX_TENANTS = 10_000
_STATE_PARAMS = frozenset({"tenant", "offset", "limit"})


def state_tenants(gw: Gateway, query: Any) -> tuple[list[Tenant], dict[str, Any]]:
    """The tenants one ``GET /admin/state`` lists, and its ``tenant_page`` entry, from its
    query (a ``MultiDict``): ``tenant=<name>`` (repeatable): those tenants, in that order;
    else the page ``offset`` (default 0) and ``limit`` (default :data:`ADMIN_STATE_TENANTS`,
    at most :data:`ADMIN_STATE_MAX_TENANTS`) of the tenants in configuration order.
    ``tenant_page``: ``total`` (tenants configured), ``offset``, ``limit`` and ``next`` (the
    next page's offset, ``None`` after the last page; always ``None`` with ``tenant``). An
    offset is a position in the configuration's order: a reload between two pages that adds
    or removes tenants before it shifts the pages after it.

    Raises:
        GatewayError: 400 ``invalid_value`` for an unknown or repeated parameter, an offset or
            limit that is not a whole number in range, an empty name, or ``tenant`` together
            with a page;
            404 ``tenant_not_found`` for a name no tenant has.
    """
    for name in query:
        if name not in _STATE_PARAMS:
            raise invalid_value(name, f"Unknown parameter {name!r}: use tenant, offset and limit.")
        if name != "tenant" and len(query.getall(name)) > 1:
            raise invalid_value(name, f"Parameter {name!r} is given more than once.")
    total = len(gw.tenants)
    names = query.getall("tenant", [])
    if names:
        if "offset" in query or "limit" in query:
            raise invalid_value("tenant", "Give either tenant names or a page (offset, limit).")
        picked = []
        for name in names:
            if not name:
                raise invalid_value("tenant", "A tenant name is not empty.")
            tenant = gw.identity.named(name)
            if tenant is None:
                raise GatewayError(
                    404,
                    f"No tenant is called {name!r}.",
                    "invalid_request_error",
                    param="tenant",
                    code="tenant_not_found",
                )
            picked.append(tenant)
        return picked, {"total": total, "offset": 0, "limit": len(picked), "next": None}
    offset = _whole(query, "offset", 0, 0, 2**63 - 1)
    limit = _whole(query, "limit", ADMIN_STATE_TENANTS, 1, ADMIN_STATE_MAX_TENANTS)
    end = offset + limit
    page = {"total": total, "offset": offset, "limit": limit, "next": end if end < total else None}
    return gw.tenants[offset:end], page


def _whole(query: Any, name: str, default: int, low: int, high: int) -> int:
    """Query parameter ``name`` as a whole number in ``low..high`` (``default`` when absent)."""
    text = query.get(name)
    if text is None:
        return default
    digits = text.lstrip("0") or "0"  # (leading zeros allowed; ASCII digits only)
    if not (text.isascii() and text.isdigit() and len(digits) <= 19 and low <= int(digits) <= high):
        raise invalid_value(name, f"{name} must be a whole number from {low:,} to {high:,}.")
    return int(digits)


def admin_state(gw: Gateway, tenants: Iterable[Tenant] | None = None) -> dict[str, Any]:
    """The document ``GET /admin/state`` answers (see :func:`handle_admin_state`); also the
    source of ``GET /dashboard/data``, which lists only ``tenants`` (``None``: every tenant,
    for callers inside the gateway; the endpoint lists a page)."""
    backends = []
    for b in gw.backends:
        st = dict(gw.controller.backend_state(b.id))
        st.update(
            name=b.name,
            url=b.url,
            healthy=b.healthy,
            stale=b.stale,
            kv_usage=b.kv_usage,
            waiting=b.waiting,
            last_good_scrape_age=_scrape_age(gw, b),
            bound_by=_bound_by(b, st),
        )
        found = gw.discovery.get(b.name)
        if found is not None:
            st["discovered"] = found.as_dict()
        backends.append(st)
    rows = []
    listed = gw.tenants if tenants is None else list(tenants)
    for t in listed:
        st = dict(gw.controller.tenant_state(t.id))
        st.update(
            name=t.name,
            priority=t.priority,
            queue_depth=gw.queue.tenant_depth(t.name) if gw.queue is not None else 0,
        )
        rows.append(st)
    return {
        "backends": backends,
        "tenants": rows,
        "store": gw.store.state(None if tenants is None else [t.name for t in listed]),
        "prefill": {name: gate.state() for name, gate in gw.prefill.items()},
        "slo": gw.slo.state() if gw.slo is not None else None,
    }


async def handle_admin_state(gw: Gateway, request: web.BaseRequest) -> Reply:
    """``GET /admin/state``: each backend's base and effective limits, scale, in-use, KV usage,
    waiting, the engine's external KV occupancy, which signal holds each limit below base
    (``bound_by``), age of the last good scrape and (quick start) what its engine said about itself
    (``discovered``: engine, models and context windows, slots, KV capacity, each with its
    source); each tenant's usage, quota and queue depth; each backend's prefill budget
    (``prefill``: budget, prompt tokens in prefill per lane, refusals); the latency targets
    (``slo``: per backend and class the cap, what bound it, running, measured p99 TTFT and
    TPOT); the store (``mode`` ``local``, or
    with Redis: this replica's id, breaker, counters and each active scope's mode, live
    replicas and quotas).
    Tenants by page (the first :data:`ADMIN_STATE_TENANTS` unless asked otherwise) or by name,
    with ``tenant_page`` saying which (:func:`state_tenants`; a bad query is a 400, an unknown
    name a 404).
    Needs the admin key (``Authorization: Bearer``) when ``admin_key_sha256`` is configured."""
    if not admin_key_ok(gw, api_key(request.headers)):
        return admin_refusal(request)
    try:
        tenants, page = state_tenants(gw, request.query)
    except GatewayError as err:
        return error_response(request, err)
    doc = admin_state(gw, tenants)
    doc["tenant_page"] = page
    return web.Response(
        body=orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS),
        content_type="application/json",
    )


def _bound_by(b: Backend, st: dict[str, Any]) -> dict[str, str]:
    """Which signal holds each of a backend's limits below its base now: ``concurrency`` and
    ``tokens_per_minute`` (scaled together by the adaptive law: one of
    :data:`kvgate.adaptive.BOUND_BY`), ``inflight`` (``external-kv``: the engine holds KV
    beyond kvgate's in-flight tokens, so the budget in force is base less that; else
    ``none``)."""
    scaled = b.bound_by if st["scale"] < 1.0 else "none"
    external = st["inflight_token_limit"] is not None and st["inflight_external_tokens"] > 0
    return {
        "concurrency": scaled,
        "tokens_per_minute": scaled,
        "inflight": "external-kv" if external else "none",
    }


def _dashboard_key(request: web.BaseRequest) -> str | None:
    """The admin key a dashboard request carries: ``Authorization: Bearer`` (or ``api-key``),
    else the dashboard's cookie."""
    key = api_key(request.headers)
    if key is None:
        cookie = request.cookies.get(dashboard.COOKIE)
        key = urllib.parse.unquote(cookie) if cookie else None
    return key


def _dashboard_reply(request: web.BaseRequest, path: str) -> web.Response:
    body, content_type = dashboard.asset(path)
    resp = web.Response(body=body, headers=dashboard.PAGE_HEADERS)
    resp.headers["Content-Type"] = content_type
    return resp


async def handle_dashboard(gw: Gateway, request: web.BaseRequest) -> Reply:
    """``GET /dashboard``: the live view (HTML; its script polls ``/dashboard/data`` every
    second). With ``?key=KEY`` (the admin key, once): a 303 to ``/dashboard`` that sets the
    ``HttpOnly``, ``SameSite=Strict`` cookie :data:`kvgate.dashboard.COOKIE` (``Path=/dashboard``,
    ``Secure`` over TLS, 12 hours) holding it; a wrong key → 401. Without it, the page needs
    the cookie or a Bearer header when ``admin_key_sha256`` is configured (else 401
    ``invalid_api_key`` saying how to open it). The key is never logged."""
    key = request.query.get("key")
    if key is not None:
        if not admin_key_ok(gw, key):
            return admin_refusal(request)
        resp = web.Response(
            status=303, headers={**dashboard.PAGE_HEADERS, "Location": "/dashboard"}
        )
        if getattr(gw.config, "admin_key_sha256", None):
            resp.set_cookie(
                dashboard.COOKIE,
                urllib.parse.quote(key, safe=""),
                path="/dashboard",
                max_age=dashboard.COOKIE_MAX_AGE_S,
                httponly=True,
                samesite="Strict",
                secure=request.secure or None,
            )
        return resp
    if not admin_key_ok(gw, _dashboard_key(request)):
        return error_response(
            request,
            GatewayError(
                401,
                "Admin key required: open /dashboard?key=ADMIN_KEY once (it sets a cookie).",
                "invalid_request_error",
                code="invalid_api_key",
            ),
        )
    return _dashboard_reply(request, "/dashboard")


async def handle_dashboard_asset(gw: Gateway, request: web.BaseRequest) -> Reply:
    """``GET /dashboard/dashboard.css`` and ``/dashboard/dashboard.js``: the page's style and
    script, shipped in the package (no data in them: no key needed)."""
    return _dashboard_reply(request, normalize_path(request.path))


async def handle_dashboard_data(gw: Gateway, request: web.BaseRequest) -> Reply:
    """``GET /dashboard/data``: the live view's JSON (:func:`kvgate.dashboard.dashboard_data`),
    built from :func:`admin_state` (the top tenants by tokens only), the metric families
    (summed over workers; with tenant-less series, the tokens per tenant are this worker's
    usage ledger's) and this worker's wait queue. Needs the admin key (Bearer header or the
    dashboard's cookie) when ``admin_key_sha256`` is configured, else 401
    ``invalid_api_key``."""
    if not admin_key_ok(gw, _dashboard_key(request)):
        return admin_refusal(request)
    # (flushes this process's batches into the usage ledger, then reads off the event loop)
    families = await asyncio.to_thread(gw.metrics.dashboard_families())
    tokens = (
        dashboard.tenant_tokens(families)
        if gw.metrics.per_tenant
        else gw.metrics.usage.tenant_tokens
    )
    data = dashboard.dashboard_data(
        admin_state(gw, dashboard.top_tenants(gw.tenants, tokens)),
        families,
        gw.queue.backend_depths() if gw.queue is not None else {},
        time.time(),
        tokens,
    )
    return web.Response(
        body=orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


def _scrape_age(gw: Gateway, b: Backend) -> float | None:
    """Seconds since the backend's last good metrics scrape (``None``: never, or no poller)."""
    if gw.poller is None:
        return None
    status = gw.poller.status(b.name)
    return status.age(asyncio.get_running_loop().time()) if status.last_good_at else None


def _model_object(name: str, route: ModelRoute, created: int) -> dict[str, Any]:
    """One model in OpenAI's ``Model`` shape, with vLLM's ``max_model_len`` (tokens)."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "kvgate",
        "max_model_len": getattr(route.analyzer, "context_window", None),
    }


async def handle_model(gw: Gateway, request: web.BaseRequest, model_id: str) -> Reply:
    """``GET /v1/models/{id}``: one model object, as ``GET /v1/models`` lists it (what the
    ``openai`` client's ``models.retrieve`` asks); a model this gateway does not serve → 404
    ``model_not_found`` in OpenAI's shape. Needs no API key, like the list."""
    route = gw.models.get(model_id)
    if route is None:
        return error_response(
            request,
            GatewayError(
                404,
                f"The model `{model_id}` does not exist or you do not have access to it.",
                "invalid_request_error",
                param="model",
                code="model_not_found",
            ),
        )
    return web.Response(
        body=orjson.dumps(_model_object(model_id, route, int(time.time()))),
        content_type="application/json",
    )


#: The gateway's own ``GET`` (and ``HEAD``) endpoints, by path.
GET_ENDPOINTS: dict[str, Callable[[Gateway, web.BaseRequest], Awaitable[Reply]]] = {
    "/v1/models": handle_models,
    "/metrics": handle_metrics,
    "/healthz": handle_healthz,
    "/readyz": handle_readyz,
    "/admin/state": handle_admin_state,
    "/admin/usage": handle_admin_usage,
    "/dashboard": handle_dashboard,
    "/dashboard/data": handle_dashboard_data,
    "/dashboard/dashboard.css": handle_dashboard_asset,
    "/dashboard/dashboard.js": handle_dashboard_asset,
}
