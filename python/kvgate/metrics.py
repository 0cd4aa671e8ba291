"""Every metric the gateway exports, in one module (names, labels, help).

Labels stay low-cardinality: backend name, declared tenant name, priority class, outcome and
rejection reason — never a raw header value. Counters and histograms are per process; with
``--workers N`` they are aggregated by prometheus_client's multiprocess mode (the master sets
``PROMETHEUS_MULTIPROC_DIR`` before the workers start). Limits and in-use gauges are read at
scrape time from the shared admission state, so they are exact across workers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvgate.proxy.relay import RelayResult

__all__ = ["GatewayMetrics"]

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 1.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RATIO_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.5, 2.0)


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
                "Effective in-flight token budget.",
                "effective_inflight_token_limit",
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

    Args:
        read_state: returns ``[(backend_name, state_dict)]`` at scrape time; the dict keys are
            those of ``AdmissionController.backend_state`` (``in_use``,
            ``effective_concurrency``, ``effective_tokens_per_minute``, ``available_tokens``,
            ``inflight_tokens``, ``effective_inflight_token_limit``, ``scale``).
        leaks: returns the core's leaked-reservation count.
    """

    def __init__(
        self,
        read_state: Callable[[], list[tuple[str, dict[str, Any]]]],
        leaks: Callable[[], int],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
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
            "Tokens charged per tenant after settlement.",
            ["tenant"],
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
            "Upstream time to first byte.",
            ["backend"],
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
        self.reservation_leaks = Counter(
            "kvgate_reservation_leaks",
            "Reservations dropped without release (each released itself); summed over workers.",
            registry=reg,
        )
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._leaks = leaks
        self._leaks_seen = 0
        reg.register(_StateCollector(read_state))
        reg.register(_QueueCollector(lambda cls: self.queue_depth_of(cls)))

    def _child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, looked up once per label set and then kept (the hot path
        pays a dict lookup instead of prometheus_client's label validation and lock; the child
        is the same object ``labels()`` would return)."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def request_done(self, backend: Any, tenant: Any, outcome: str) -> None:
        """Count a finished request (``backend``/``tenant`` may be ``None`` before routing)."""
        self._child(
            self.requests,
            backend.name if backend is not None else "",
            tenant.name if tenant is not None else "",
            outcome,
        ).inc()

    def rejected(self, backend: Any, tenant: Any, reason: str, seconds: float) -> None:
        """Count an admission refusal."""
        self._child(self.rejections, backend.name, reason).inc()
        self.request_done(backend, tenant, "rejected")
        self.admission_seconds.observe(seconds)

    def admitted(self, backend: Any, tenant: Any, reserved: int, seconds: float) -> None:
        """Count an admission and its reservation."""
        self._child(self.tokens_reserved, backend.name).inc(reserved)
        self.admission_seconds.observe(seconds)

    def settled(
        self, backend: Any, tenant: Any, reserved: int, actual: int, result: RelayResult
    ) -> None:
        """Record a settlement: refund or overrun, ratio, TTFT and the request outcome."""
        name = backend.name
        if actual <= reserved:
            self._child(self.tokens_refunded, name).inc(reserved - actual)
        else:
            self._child(self.tokens_overrun, name).inc(actual - reserved)
        if reserved > 0:
            self._child(self.usage_ratio, name).observe(actual / reserved)
        self._child(self.tenant_tokens, tenant.name).inc(actual)
        self.sync_leaks()
        if result.ttft is not None:
            self._child(self.ttft_seconds, name).observe(result.ttft)
        self.request_done(backend, tenant, result.outcome)

    def sync_leaks(self) -> None:
        """Carry the core's per-process leak count into the (multiprocess-aware) counter."""
        leaks = self._leaks()
        if leaks > self._leaks_seen:
            self.reservation_leaks.inc(leaks - self._leaks_seen)
            self._leaks_seen = leaks

    def render(self) -> bytes:
        """The exposition text for ``GET /metrics``."""
        self.sync_leaks()
        if self._multiproc:
            from prometheus_client import multiprocess

            merged = CollectorRegistry()
            multiprocess.MultiProcessCollector(merged)
            return generate_latest(merged) + generate_latest(_GaugesOnly(self.registry))
        return generate_latest(self.registry)


class _QueueCollector(Collector):
    def __init__(self, depth: Callable[[str], int]) -> None:
        self._depth = depth

    def collect(self) -> Iterator[Any]:
        fam = GaugeMetricFamily(
            "kvgate_queue_depth", "Requests waiting in the priority queue.", labels=["class"]
        )
        for cls in ("critical", "standard", "sheddable"):
            fam.add_metric([cls], float(self._depth(cls)))
        yield fam


class _GaugesOnly(Collector):
    """In multiprocess mode: only the scrape-time collectors of this registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Any]:
        for metric in self._registry.collect():
            if metric.name.startswith(
                (
                    "kvgate_slots",
                    "kvgate_concurrency",
                    "kvgate_tpm",
                    "kvgate_tokens_available",
                    "kvgate_inflight",
                    "kvgate_scale",
                )
            ):
                yield metric
