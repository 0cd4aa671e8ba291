"""Every metric the gateway exports, in one module (names, labels, help).

Labels stay low-cardinality: backend name, declared tenant name, priority class, outcome and
rejection reason — never a raw header value. Counters and histograms are per process; with
``--workers N`` they are aggregated by prometheus_client's multiprocess mode (the master sets
``PROMETHEUS_MULTIPROC_DIR`` before the workers start). Limits and in-use gauges are read at
scrape time from the shared admission state, so they are exact across workers.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from kvgate.usage import UsageLedger

if TYPE_CHECKING:
    from kvgate.proxy.relay import RelayResult

__all__ = ["ALL_TENANTS", "FLUSH_SECONDS", "GatewayMetrics"]

#: The ``tenant`` label of the per-tenant series when more tenants are configured than
#: ``metrics.tenant_labels``: every tenant's requests and tokens summed in one series.
ALL_TENANTS = "*"

#: How often the app adds the batched per-request counts to the Prometheus metrics (seconds).
FLUSH_SECONDS = 1.0

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 1.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RATIO_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.5, 2.0)


class _StoreCollector(Collector):
    """Gauges of the shared store computed at scrape time (nothing without one)."""

    def __init__(self) -> None:
        self.store: Any = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        store = self.store
        if store is None or store.mode == "local":
            return
        modes = GaugeMetricFamily(
            "kvgate_store_mode",
            "Active tenants and backends by store mode: local (decided from held quotas), "
            "near-limit (decided in Redis), degraded (Redis unreachable), learning.",
            labels=["scope", "mode"],
        )
        for (scope, mode), n in sorted(store.modes().items()):
            modes.add_metric([scope, mode], n)
        yield modes
        slots, tokens = store.stranded()
        stranded = GaugeMetricFamily(
            "kvgate_store_stranded",
            "Quota this replica holds beyond its use (unit: slots or tokens).",
            labels=["unit"],
        )
        stranded.add_metric(["slots"], slots)
        stranded.add_metric(["tokens"], tokens)
        yield stranded
        ratio = GaugeMetricFamily(
            "kvgate_store_calls_per_admission",
            "Calls to the shared store per admission since start (heartbeats included).",
        )
        ratio.add_metric([], store.calls / max(1, store.admissions))
        yield ratio


class _AdmissionStagesCollector(Collector):
    """Gauges of the prefill budget and the latency targets, read at scrape time."""

    def __init__(self) -> None:
        self.gateway: Any = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gw = self.gateway
        if gw is None:
            return
        prefill = GaugeMetricFamily(
            "kvgate_prefill_tokens",
            "Prompt tokens of admitted requests whose first bytes have not arrived yet, by lane.",
            labels=["backend", "lane"],
        )
        budget = GaugeMetricFamily(
            "kvgate_prefill_token_budget", "Prefill budget per lane (tokens).", labels=["backend"]
        )
        for name, gate in gw.prefill.items():
            prefill.add_metric([name, "critical"], gate.critical_in_prefill)
            prefill.add_metric([name, "other"], gate.in_prefill)
            budget.add_metric([name], gate.budget)
        yield prefill
        yield budget
        if gw.slo is None:
            return
        caps = GaugeMetricFamily(
            "kvgate_slo_class_limit",
            "Concurrency cap a latency target put on a class (absent: none).",
            labels=["backend", "class"],
        )
        p99 = GaugeMetricFamily(
            "kvgate_slo_ttft_p99_seconds",
            "Measured p99 time to first token per class over the controller's window.",
            labels=["backend", "class"],
        )
        for backend, classes in gw.slo.state().items():
            for cls, st in classes.items():
                if st["cap"] is not None:
                    caps.add_metric([backend, cls], st["cap"])
                if st["ttft_p99_s"] is not None:
                    p99.add_metric([backend, cls], st["ttft_p99_s"])
        yield caps
        yield p99


class _StateCollector(Collector):
    """Gauges computed at scrape time from the admission core's (shared) state."""

    def __init__(self, read: Callable[[], list[tuple[str, dict[str, Any]]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rows = self._read()
        spec = (
            (
                "kvgate_slots_in_use",
                "Concurrency slots held by admitted, unfinished requests.",
                "in_use",
            ),
            (
                "kvgate_concurrency_limit",
                "Effective concurrency limit (base × adaptive scale).",
                "effective_concurrency",
            ),
            (
                "kvgate_tpm_limit",
                "Effective tokens-per-minute limit of the backend bucket.",
                "effective_tokens_per_minute",
            ),
            (
                "kvgate_tokens_available",
                "Tokens available now in the backend TPM bucket.",
                "available_tokens",
            ),
            (
                "kvgate_inflight_tokens",
                "Prompt + reserved completion tokens in flight.",
                "inflight_tokens",
            ),
            (
                "kvgate_inflight_token_limit",
                "In-flight token budget in force (base less the engine's external KV occupancy).",
                "effective_inflight_token_limit",
            ),
            (
                "kvgate_inflight_external_tokens",
                "Tokens the engine's KV cache holds beyond kvgate's in-flight tokens.",
                "inflight_external_tokens",
            ),
            (
                "kvgate_scale",
                "Adaptive scale applied to the backend's limits (ratio 0..1).",
                "scale",
            ),
        )
        for name, doc, key in spec:
            fam = GaugeMetricFamily(name, doc, labels=["backend"])
            for backend, state in rows:
                value = state.get(key)
                if value is not None:
                    fam.add_metric([backend], float(value))
            yield fam


class GatewayMetrics:
    """The gateway's Prometheus metrics on a private registry.

    The per-request methods (:meth:`request_done`, :meth:`rejected`, :meth:`admitted`,
    :meth:`settled`) batch their counts in plain dicts; :meth:`flush` adds them to the metrics
    (:meth:`render` flushes first; the app flushes every :data:`FLUSH_SECONDS`). Read a metric
    object directly only after :meth:`flush`.

    Args:
        read_state: returns ``[(backend_name, state_dict)]`` at scrape time; the dict keys are
            those of ``AdmissionController.backend_state`` (``in_use``,
            ``effective_concurrency``, ``effective_tokens_per_minute``, ``available_tokens``,
            ``inflight_tokens``, ``effective_inflight_token_limit``,
            ``inflight_external_tokens``, ``scale``).
        leaks: returns the core's leaked-reservation count.
    """

    def __init__(
        self,
        read_state: Callable[[], list[tuple[str, dict[str, Any]]]],
        leaks: Callable[[], int],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        #: whether the per-tenant series carry each tenant's name, or :data:`ALL_TENANTS` (every
        #: tenant summed): :meth:`label_tenants` sets it from the configuration
        self.per_tenant = True
        self._multiproc = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        reg = self.registry
        self.requests = Counter(
            "kvgate_requests",
            "Requests by outcome.",
            ["backend", "tenant", "outcome"],
            registry=reg,
        )
        self.rejections = Counter(
            "kvgate_rejections",
            "Admission refusals by reason.",
            ["backend", "reason"],
            registry=reg,
        )
        self.tokens_reserved = Counter(
            "kvgate_tokens_reserved",
            "Tokens reserved at admission (prompt + completion).",
            ["backend"],
            registry=reg,
        )
        self.tokens_refunded = Counter(
            "kvgate_tokens_refunded",
            "Reserved tokens given back at settlement.",
            ["backend"],
            registry=reg,
        )
        self.tokens_overrun = Counter(
            "kvgate_tokens_overrun",
            "Tokens used beyond the reservation (charged).",
            ["backend"],
            registry=reg,
        )
        self.tenant_tokens = Counter(
            "kvgate_tenant_tokens",
            "Tokens charged per tenant after settlement (kvgate_tenant_usage_tokens_total "
            "summed over model and kind).",
            ["tenant"],
            registry=reg,
        )
        self.tenant_usage_tokens = Counter(
            "kvgate_tenant_usage_tokens",
            "Tokens charged per tenant and model after settlement, by kind (prompt, completion).",
            ["tenant", "model", "kind"],
            registry=reg,
        )
        self.tenant_requests = Counter(
            "kvgate_tenant_requests",
            "Requests per tenant and model, by outcome.",
            ["tenant", "model", "outcome"],
            registry=reg,
        )
        self.admission_seconds = Histogram(
            "kvgate_admission_seconds",
            "Time from request arrival to the admission decision.",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.ttft_seconds = Histogram(
            "kvgate_upstream_ttft_seconds",
            "Upstream time to first byte, by backend and the tenant's priority class.",
            ["backend", "class"],
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.usage_ratio = Histogram(
            "kvgate_usage_ratio",
            "Actual / reserved tokens per request.",
            ["backend"],
            buckets=_RATIO_BUCKETS,
            registry=reg,
        )
        self.backend_kv_usage = Gauge(
            "kvgate_backend_kv_usage",
            "Engine KV-cache usage ratio (0..1), last good scrape.",
            ["backend"],
            registry=reg,
            multiprocess_mode="max",
        )
        self.backend_waiting = Gauge(
            "kvgate_backend_waiting",
            "Requests waiting in the engine, last good scrape.",
            ["backend"],
            registry=reg,
            multiprocess_mode="max",
        )
        self.shedding = Gauge(
            "kvgate_shedding",
            "1 while the class is shed on the backend.",
            ["backend", "class"],
            registry=reg,
            multiprocess_mode="max",
        )
        self.scrape_errors = Counter(
            "kvgate_metrics_scrape_errors",
            "Failed scrapes of an engine's metrics.",
            ["backend"],
            registry=reg,
        )
        self.metrics_stale = Gauge(
            "kvgate_metrics_stale",
            "1 while the engine's metrics are stale.",
            ["backend"],
            registry=reg,
            multiprocess_mode="max",
        )
        self.store_call_seconds = Histogram(
            "kvgate_store_call_seconds",
            "Duration of each call to the shared store (Redis), seconds.",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=reg,
        )
        self.store_failures = Counter(
            "kvgate_store_failures",
            "Calls to the shared store that failed, by kind (timeout, error, stale), and "
            "admissions that fell back to their limit's policy because no reply came before "
            "their deadline (late; one per admission, its call may count as well).",
            ["kind"],
            registry=reg,
        )
        self.store_breaker = Gauge(
            "kvgate_store_breaker_open",
            "1 while the shared store is unreachable and limits use their fallback policies.",
            registry=reg,
            multiprocess_mode="max",
        )
        self.store_amnesia = Counter(
            "kvgate_store_amnesia",
            "Scopes found lost by the shared store (restart without persistence, flush).",
            registry=reg,
        )
        self.store_reaped = Counter(
            "kvgate_store_reaped_replicas",
            "Dead replicas' leases reaped by this replica, one per scope (tenant or backend) "
            "the dead replica held anything in; their quotas went back.",
            registry=reg,
        )
        self.store_degraded = Counter(
            "kvgate_store_degraded_admissions",
            "Admissions decided by a fallback policy while the shared store was unreachable.",
            registry=reg,
        )
        self.shadow_rejections = Counter(
            "kvgate_shadow_rejections",
            "Refusals computed in shadow mode (request admitted).",
            ["reason"],
            registry=reg,
        )
        self.queue_wait = Histogram(
            "kvgate_queue_wait_seconds",
            "Time refused requests waited in the priority queue.",
            ["class"],
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.queue_depth_of: Callable[[str], int] = lambda cls: 0
        # set from queue_depth_of at every flush; summed over live workers in multiprocess mode
        self.queue_depth = Gauge(
            "kvgate_queue_depth",
            "Requests waiting in the priority queue (summed over workers).",
            ["class"],
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.reservation_leaks = Counter(
            "kvgate_reservation_leaks",
            "Reservations dropped without release (each released itself); summed over workers.",
            registry=reg,
        )
        self._leaks = leaks
        self._leaks_seen = 0
        # Hot-path batches: a request appends one tuple (rejected / admitted / settled); flush()
        # folds them into plain dicts of counts and histogram buckets, then adds those to the
        # metrics above (a prometheus_client inc / observe takes a lock, ~0.7 µs each) — before
        # every scrape of this process, and every FLUSH_SECONDS from the app (so other workers'
        # scrapes see them in multiprocess mode).
        self._counts: dict[tuple[Any, tuple[str, ...]], float] = {}
        self._hists: dict[tuple[Any, tuple[str, ...]], list[float]] = {}
        # each request leaves one tuple on the hot path; flush() folds them into the dicts above
        # backend, tenant, model, reason, seconds
        self._rejects: list[tuple[str, str, str, str, float]] = []
        self._admits: list[tuple[str, int, float]] = []  # backend, reserved, seconds
        # backend, tenant, tenant's class, model, outcome, reserved, actual, prompt, ttft
        self._settles: list[tuple[str, str, str, str, str, int, int, int, float | None]] = []
        # per tenant × model × outcome: [requests, prompt tokens, completion tokens], folded
        # into the usage ledger (GET /admin/usage) at every flush
        self._usage: dict[tuple[str, str, str], list[int]] = {}
        #: per-minute usage since start (:mod:`kvgate.usage`)
        self.usage = UsageLedger()
        self._bounds: dict[Any, tuple[float, ...]] = {
            self.admission_seconds: _LATENCY_BUCKETS,
            self.ttft_seconds: _TTFT_BUCKETS,
            self.usage_ratio: _RATIO_BUCKETS,
        }
        #: the metrics above: each reads its own values under its own lock, so they may be
        #: read off the event loop (:meth:`snapshot`)
        self._standard = tuple(v for v in vars(self).values() if isinstance(v, MetricWrapperBase))
        self._state_gauges = _StateCollector(read_state)
        reg.register(self._state_gauges)
        #: the shared store the ``kvgate_store_*`` gauges read (set by the gateway's builder)
        self.store_gauges = _StoreCollector()
        reg.register(self.store_gauges)
        #: the gateway the prefill and latency-target gauges read (set by the gateway)
        self.stage_gauges = _AdmissionStagesCollector()
        reg.register(self.stage_gauges)
        #: the collectors that read the gateway's state when scraped: on the event loop
        self._live = (self._state_gauges, self.store_gauges, self.stage_gauges)

    def label_tenants(self, tenants: int, limit: int) -> None:
        """Label the per-tenant series by tenant name while ``tenants`` (the tenants configured)
        ≤ ``limit`` (config ``metrics.tenant_labels``), else by :data:`ALL_TENANTS` (start-up and
        reload). Series already exported stay (a counter does not go back), and requests
        around the change may count under either label; the dashboard's tokens per tenant
        then start again from the new source (the series, or this process's usage ledger)."""
        self.per_tenant = tenants <= limit

    def init_backends(self, names: Iterable[str]) -> None:
        """Give every backend its samples from start-up: ``kvgate_shedding{class="sheddable"}``
        and ``kvgate_metrics_stale`` at 0, ``kvgate_metrics_scrape_errors_total`` at 0 (else a
        healthy gateway exports none until the first change). In multiprocess mode each worker
        writes its 0s to its own file, and the ``max`` of the gauges and the sum of the counter
        over workers are unchanged by them."""
        for name in names:
            # the adaptive controller sets these (kvgate.adaptive: only the sheddable class is shed)
            self.shedding.labels(name, "sheddable").set(0)
            self.metrics_stale.labels(name).set(0)
            self.scrape_errors.labels(name)

    def _count(self, metric: Any, labels: tuple[str, ...], amount: float = 1) -> None:
        key = (metric, labels)
        counts = self._counts
        counts[key] = counts.get(key, 0) + amount

    def _observe(self, metric: Any, labels: tuple[str, ...], value: float) -> None:
        key = (metric, labels)
        hist = self._hists.get(key)
        bounds = self._bounds[metric]
        if hist is None:  # [sum, count per bucket..., count above the last bound (+Inf)]
            hist = self._hists[key] = [0.0] * (len(bounds) + 2)
        hist[0] += value
        # prometheus buckets are `value <= le`: the first bound not below the value
        hist[1 + bisect_left(bounds, value)] += 1

    def flush(self) -> None:
        """Add the batched counts and observations to the Prometheus metrics, the core's leak
        count to ``kvgate_reservation_leaks_total`` and the wait queue's depth per class to
        ``kvgate_queue_depth``. Cheap when nothing happened."""
        self._fold()
        usage, self._usage = self._usage, {}
        self.usage.add(usage)
        counts, self._counts = self._counts, {}
        for (metric, labels), amount in counts.items():
            (metric.labels(*labels) if labels else metric).inc(amount)
        hists, self._hists = self._hists, {}
        for (metric, labels), hist in hists.items():
            child = metric.labels(*labels) if labels else metric
            # prometheus_client has no public bulk observe: its histogram keeps one value per
            # bucket (non-cumulative) and the sum, each with a public-shaped ``inc``
            # (tests/gateway/test_metrics_batch.py checks this against ``observe``)
            child._sum.inc(hist[0])
            for bucket, count in zip(child._buckets, hist[1:], strict=True):
                if count:
                    bucket.inc(count)
        self.sync_leaks()
        for cls in ("critical", "standard", "sheddable"):
            self.queue_depth.labels(cls).set(self.queue_depth_of(cls))

    def _fold(self) -> None:
        """Fold the per-request tuples into the count and histogram batches."""
        rejects, self._rejects = self._rejects, []
        admits, self._admits = self._admits, []
        settles, self._settles = self._settles, []
        count, observe, use = self._count, self._observe, self._use
        per_tenant = self.per_tenant
        for backend, tenant, model, reason, seconds in rejects:
            label = tenant if per_tenant else ALL_TENANTS
            count(self.rejections, (backend, reason))
            count(self.requests, (backend, label, "rejected"))
            observe(self.admission_seconds, (), seconds)
            use(tenant, label, model, "rejected", 0, 0)
        for backend, reserved, seconds in admits:
            count(self.tokens_reserved, (backend,), reserved)
            observe(self.admission_seconds, (), seconds)
        for backend, tenant, cls, model, outcome, reserved, actual, prompt, ttft in settles:
            labels = (backend,)
            if actual <= reserved:
                count(self.tokens_refunded, labels, reserved - actual)
            else:
                count(self.tokens_overrun, labels, actual - reserved)
            if reserved > 0:
                observe(self.usage_ratio, labels, actual / reserved)
            # the charge split: the prompt first (the engine's count, else kvgate's), the rest
            # completion; a request charged nothing used nothing
            label = tenant if per_tenant else ALL_TENANTS
            count(self.tenant_tokens, (label,), actual)
            prompt = min(prompt, actual)
            use(tenant, label, model, outcome, prompt, actual - prompt)
            if ttft is not None:
                observe(self.ttft_seconds, (backend, cls), ttft)
            count(self.requests, (backend, label, outcome))

    def _use(
        self, tenant: str, label: str, model: str, outcome: str, prompt: int, completion: int
    ) -> None:
        """One request of ``tenant`` on ``model`` with ``outcome``, charged ``prompt`` and
        ``completion`` tokens: the tenant usage counters (labelled ``label``: the tenant's name,
        or :data:`ALL_TENANTS`) and the usage ledger's batch (by the tenant's name)."""
        count = self._count
        count(self.tenant_requests, (label, model, outcome))
        if prompt:
            count(self.tenant_usage_tokens, (label, model, "prompt"), prompt)
        if completion:
            count(self.tenant_usage_tokens, (label, model, "completion"), completion)
        key = (tenant, model, outcome)
        row = self._usage.get(key)
        if row is None:
            self._usage[key] = [1, prompt, completion]
        else:
            row[0] += 1
            row[1] += prompt
            row[2] += completion

    def request_done(self, backend: Any, tenant: Any, outcome: str, model: Any = None) -> None:
        """Count a finished request (``backend``/``tenant``/``model`` may be ``None`` before
        routing; a request without a tenant is in no tenant's usage)."""
        name = tenant.name if tenant is not None else ""
        label = name if self.per_tenant or tenant is None else ALL_TENANTS
        self._count(self.requests, (backend.name if backend is not None else "", label, outcome))
        if tenant is not None:
            self._use(name, label, model.name if model is not None else "", outcome, 0, 0)

    def rejected(
        self, backend: Any, tenant: Any, reason: str, seconds: float, model: Any = None
    ) -> None:
        """Count an admission refusal (``kvgate_rejections_total``, ``kvgate_requests_total``
        and ``kvgate_tenant_requests_total`` with outcome ``rejected``, the admission time)."""
        self._rejects.append(
            (backend.name, tenant.name, model.name if model is not None else "", reason, seconds)
        )

    def admitted(self, backend: Any, tenant: Any, reserved: int, seconds: float) -> None:
        """Count an admission and its reservation."""
        self._admits.append((backend.name, reserved, seconds))

    def settled(
        self,
        backend: Any,
        tenant: Any,
        reserved: int,
        actual: int,
        result: RelayResult,
        model: Any = None,
        prompt: int | None = None,
    ) -> None:
        """Record a settlement: refund or overrun, ratio, TTFT (labelled with the tenant's
        priority class), the request outcome, and the tenant's usage on ``model``: of the
        ``actual`` tokens charged, ``prompt`` (the prompt's tokens; ``None``: unknown, 0) are
        counted as prompt, the rest as completion."""
        self._settles.append(
            (
                backend.name,
                tenant.name,
                tenant.priority,
                model.name if model is not None else "",
                result.outcome,
                reserved,
                actual,
                int(prompt or 0),
                result.ttft,
            )
        )

    def sync_leaks(self) -> None:
        """Carry the core's per-process leak count into the (multiprocess-aware) counter."""
        leaks = self._leaks()
        if leaks > self._leaks_seen:
            self.reservation_leaks.inc(leaks - self._leaks_seen)
            self._leaks_seen = leaks

    def dashboard_families(self) -> Callable[[], list[Any]]:
        """The metric families the dashboard reads — refusals by reason, time to first token by
        class, tokens per tenant — in two steps: this process's batches flushed now
        (on the event loop), and the function returned reads the samples, which may run on a
        worker thread (1,000 backends' histograms take tens of milliseconds to read). With
        ``--workers N``: every family, summed over the workers."""
        self.flush()
        if self._multiproc:
            gauges = list(self._state_gauges.collect())
            return lambda: [*_workers_families(), *gauges]
        wanted = (self.rejections, self.ttft_seconds, self.tenant_tokens)
        return lambda: [f for m in wanted for f in m.collect()]

    def render(self) -> bytes:
        """The exposition text for ``GET /metrics`` (this process's batches flushed first)."""
        return self.snapshot()()

    def snapshot(self) -> Callable[[], bytes]:
        """:meth:`render` in two steps: this process's batches flushed and the gauges that read
        the gateway's state read now (on the event loop), and the function returned reads the
        counters and histograms (each under its own lock) and writes the text, which may run
        on a worker thread (with ``--workers N``, it reads and sums the workers' files there).
        With a thousand backends a scrape reads tens of thousands of samples and writes over
        half a megabyte: off the loop, that no longer holds the requests being served."""
        self.flush()
        if self._multiproc:
            gauges = list(self._state_gauges.collect())
            return lambda: generate_latest(_Samples([*_workers_families(), *gauges]))
        live = [f for c in self._live for f in c.collect()]
        standard = self._standard

        def text() -> bytes:
            return generate_latest(_Samples([*(f for m in standard for f in m.collect()), *live]))

        return text


def _workers_families() -> list[Any]:
    """With ``--workers N``: the counters, histograms and gauges of every worker, summed from
    their files (prometheus_client's multiprocess mode)."""
    from prometheus_client import multiprocess

    merged = CollectorRegistry()
    multiprocess.MultiProcessCollector(merged)
    return list(merged.collect())


class _Samples(Collector):
    """Metric families already collected (:meth:`GatewayMetrics.snapshot`), given as they are."""

    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> Iterator[Any]:
        return iter(self._families)
