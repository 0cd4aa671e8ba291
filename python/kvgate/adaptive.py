"""Adaptive limits: engine metrics → the core's control law → effective limits and shedding.

What: :class:`AdaptiveSink` receives the :class:`~kvgate.telemetry.poller.MetricsPoller`'s
readings for every backend and feeds each one through that backend's
:class:`kvgate.AdaptiveLaw` (high watermark 0.85 → floor 0.6 × base, low watermark
0.70 → back to base, linear in between, decreases at once, recovery at a bounded rate per second,
engine queue deeper than ``waiting_threshold`` counts as pressure). The resulting scale is written
to the admission core (``set_scale``: concurrency, TPM and in-flight token limits together) and
the law's shedding flag switches the ``sheddable`` class off and on (``set_shedding``).

Inputs: readings (KV-cache usage ratio 0..1, requests waiting), scrape failures, staleness and
health transitions. An engine that reports no KV gauge (TGI's derived ratio missing, llama.cpp
without ``/slots``) adapts on its queue alone: its KV usage is taken as 0.

Config: per backend ``adaptive`` (``enabled``, ``high``, ``low``, ``floor``,
``recovery_per_second``, ``waiting_threshold``, ``poll_interval``, ``stale_after``).

Trade-offs: stale metrics (no good scrape for ``stale_after``) drive the backend to the floor
and shed sheddable traffic — never to "unlimited". The engine's own KV capacity, when it states
it (``vllm:cache_config_info``, ``sglang:max_total_num_tokens``, llama.cpp ``/slots``), becomes
the backend's in-flight token budget × ``capacity_safety_factor`` unless the config sets one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvgate.app import Gateway
    from kvgate.telemetry.engine_metrics import EngineReading

__all__ = ["AdaptiveSink", "poll_targets"]

logger = logging.getLogger("kvgate.adaptive")


class AdaptiveSink:
    """The poller's sink for a gateway: implements :class:`kvgate.telemetry.poller.ReadingSink`.

    Args:
        gateway: the running gateway (its controller, backends and metrics).
        on_shed: called with the backend name when shedding turns on (the wait queue answers
            its queued sheddable requests then).
        law_clock: a ``kvgate.ManualClock`` for the laws (tests); ``None`` = monotonic.
    """

    __slots__ = ("_gw", "_on_shed", "laws")

    def __init__(
        self,
        gateway: Gateway,
        *,
        on_shed: Callable[[str], None] | None = None,
        law_clock: Any = None,
    ) -> None:
        from kvgate import AdaptiveLaw

        self._gw = gateway
        self._on_shed = on_shed
        self.laws: dict[str, Any] = {}
        for b in gateway.backends:
            cfg = getattr(b.config, "adaptive", None)
            if cfg is None or not cfg.enabled:
                continue
            self.laws[b.name] = AdaptiveLaw(
                high=cfg.high,
                low=cfg.low,
                floor=cfg.floor,
                recovery_per_second=cfg.recovery_per_second,
                waiting_threshold=cfg.waiting_threshold,
                clock=law_clock,
            )

    def _apply(self, name: str, kv_usage: float | None, waiting: int) -> None:
        law = self.laws.get(name)
        if law is None:
            return
        backend = self._gw.backend_named(name)
        was_shedding = bool(law.shedding)
        before = law.scale
        scale = law.update(kv_usage, waiting)
        ctl = self._gw.controller
        store = self._gw.store
        shed_in_force = bool(law.shedding)
        if store.mode != "local":
            # several replicas: the most conservative live proposal is in force
            scale, shed_in_force = store.propose(name, scale, shed_in_force)
        ctl.set_scale(backend.id, scale)
        if scale > before and self._gw.queue:
            self._gw.queue.notify()  # limits grew: waiters may fit now
        ctl.set_shedding(backend.id, shed_in_force)
        if bool(law.shedding) != was_shedding:
            self._gw.metrics.shedding.labels(name, "sheddable").set(1 if law.shedding else 0)
            logger.warning(
                "backend %s: %s sheddable traffic (kv_usage=%s, waiting=%d)",
                name,
                "shedding" if law.shedding else "no longer shedding",
                kv_usage,
                waiting,
            )
            if law.shedding and self._on_shed is not None:
                self._on_shed(name)

    def on_reading(self, backend: str, reading: EngineReading, now: float) -> None:
        """A good reading: record it, feed the law, discover capacity."""
        b = self._gw.backend_named(backend)
        b.kv_usage, b.waiting = reading.kv_usage, reading.waiting
        m = self._gw.metrics
        if reading.kv_usage is not None:
            m.backend_kv_usage.labels(backend).set(reading.kv_usage)
        if reading.waiting is not None:
            m.backend_waiting.labels(backend).set(reading.waiting)
        # no KV gauge on this engine: adapt on the queue alone
        kv = reading.kv_usage if reading.kv_usage is not None else 0.0
        self._apply(backend, kv, int(reading.waiting or 0))
        self._discover_capacity(b, reading)
        self._discover_slots(b, reading)

    def _discover_slots(self, b: Any, reading: EngineReading) -> None:
        """The quick start's slot limit follows the engine's own (llama.cpp ``/slots``), e.g.
        after the engine restarted with another ``--parallel``; only when the limit in force
        is the one discovered from the engine, never a configured one."""
        slots = reading.slots
        known = self._gw.engine_slots.get(b.name)
        if not slots or known is None or slots == known:
            return
        self._gw.engine_slots[b.name] = slots
        self._gw.controller.update_backend(b.id, max_concurrency=slots)
        self._gw.store.reload()
        logger.info("backend %s: slot limit %d (the engine's slots, was %d)", b.name, slots, known)

    def _discover_capacity(self, b: Any, reading: EngineReading) -> None:
        cap = reading.kv_capacity_tokens
        if not cap or b.config is None or b.config.inflight_token_limit is not None:
            return
        budget = max(1, int(cap * b.config.capacity_safety_factor))
        if self._gw.discovered_capacity.get(b.name) == budget:
            return
        self._gw.discovered_capacity[b.name] = budget
        self._gw.set_prefill_capacity(b.name, cap)
        self._gw.controller.update_backend(b.id, inflight_token_limit=budget)
        self._gw.store.reload()
        logger.info(
            "backend %s: in-flight token budget %d (engine KV capacity %d × %.2f)",
            b.name,
            budget,
            cap,
            b.config.capacity_safety_factor,
        )

    def on_failure(self, backend: str, reason: str, message: str, now: float) -> None:
        """A failed scrape: counted (the poller logs transitions, not every failure)."""
        self._gw.metrics.scrape_errors.labels(backend).inc()

    def on_stale(self, backend: str, stale: bool, now: float) -> None:
        """Stale metrics: go to the floor and shed; fresh again: the readings decide, and the
        limits recover from the floor at the bounded rate from now (the outage is not
        recovery time)."""
        b = self._gw.backend_named(backend)
        b.stale = stale
        self._gw.metrics.metrics_stale.labels(backend).set(1 if stale else 0)
        if backend not in self.laws:
            return
        if stale:
            logger.warning(
                "backend %s: limits go to the floor scale until its metrics come back", backend
            )
        # stale: the floor; fresh again (called just before the first good reading): the floor
        # once more, which restarts the law's recovery clock now
        self._apply(backend, None, 0)

    def on_health(self, backend: str, healthy: bool, now: float) -> None:
        """Take a backend out of routing (or put it back)."""
        self._gw.backend_named(backend).healthy = healthy
        logger.warning("backend %s is %s", backend, "healthy again" if healthy else "unhealthy")


def poll_targets(gateway: Gateway) -> list[Any]:
    """One :class:`~kvgate.telemetry.poller.PollTarget` per backend of ``gateway``."""
    from kvgate.telemetry.poller import PollTarget

    targets = []
    for b in gateway.backends:
        cfg = b.config
        found = gateway.discovery.get(b.name)
        adaptive = getattr(cfg, "adaptive", None)
        interval = adaptive.poll_interval if adaptive is not None else 1.0
        targets.append(
            PollTarget(
                name=b.name,
                metrics_url=b.metrics_url,
                engine=b.engine,
                model=b.models[0] if len(b.models) == 1 else None,
                health_url=cfg.effective_health_url if cfg is not None else None,
                # with `auto`, read only once the metrics name llama.cpp
                slots_url=(b.url + "/slots") if b.engine in ("llamacpp", "auto") else None,
                kv_unified=bool(found is not None and found.kv_unified),
                poll_interval=interval,
                scrape_timeout=getattr(adaptive, "scrape_timeout", None),
                stale_after=adaptive.stale_after if adaptive is not None else 5.0,
                adaptive=adaptive is not None and adaptive.enabled,
                headers=(
                    {"Authorization": f"Bearer {b.api_key}"} if b.api_key is not None else None
                ),
            )
        )
    return targets
