"""The gateway's per-request metrics are batched in plain dicts and added to prometheus_client's
metrics by ``flush()``: after a flush the exposition must be exactly what direct
``inc()`` / ``observe()`` calls would have produced (this also guards the flush's use of the
histogram's per-bucket values, which prometheus_client keeps private)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from kvgate.metrics import GatewayMetrics
from kvgate.proxy.relay import RelayResult

B0 = SimpleNamespace(name="b0")
B1 = SimpleNamespace(name="b1")
ALICE = SimpleNamespace(name="alice", priority="critical")
BOB = SimpleNamespace(name="bob", priority="standard")
CHAT = SimpleNamespace(name="chat")

# latency values on, between, below and above the bucket bounds (0.0001 ... 1.0)
SECONDS = [0.00005, 0.0001, 0.00010001, 0.0003, 0.001, 0.002, 0.7, 1.0, 5.0, 0.0]


def samples(m: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue  # creation timestamps differ between the two registries
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def drive(m: GatewayMetrics) -> None:
    """A mix of refusals, admissions and settlements through the batched methods."""
    for i, sec in enumerate(SECONDS):
        backend, tenant = (B0, ALICE) if i % 3 else (B1, BOB)
        m.rejected(backend, tenant, "backend-tpm" if i % 2 else "tenant-tpm", sec, CHAT)
        m.admitted(backend, tenant, 100 + i, sec)
        result = RelayResult(status=200, ttft=sec * 10, outcome="ok" if i % 4 else "stream_broken")
        m.settled(backend, tenant, 100 + i, [0, 50, 100 + i, 250][i % 4], result, CHAT, 60)
    m.request_done(None, None, "rejected_400")
    m.request_done(None, ALICE, "rejected_404")


def drive_directly(m: GatewayMetrics) -> None:
    """The same events as :func:`drive`, as direct prometheus_client calls."""
    for i, sec in enumerate(SECONDS):
        backend, tenant = (B0, ALICE) if i % 3 else (B1, BOB)
        reason = "backend-tpm" if i % 2 else "tenant-tpm"
        m.rejections.labels(backend.name, reason).inc()
        m.requests.labels(backend.name, tenant.name, "rejected").inc()
        m.tenant_requests.labels(tenant.name, "chat", "rejected").inc()
        m.admission_seconds.observe(sec)
        reserved, actual = 100 + i, [0, 50, 100 + i, 250][i % 4]
        m.tokens_reserved.labels(backend.name).inc(reserved)
        m.admission_seconds.observe(sec)
        if actual <= reserved:
            m.tokens_refunded.labels(backend.name).inc(reserved - actual)
        else:
            m.tokens_overrun.labels(backend.name).inc(actual - reserved)
        m.usage_ratio.labels(backend.name).observe(actual / reserved)
        m.tenant_tokens.labels(tenant.name).inc(actual)
        m.ttft_seconds.labels(backend.name, tenant.priority).observe(sec * 10)
        outcome = "ok" if i % 4 else "stream_broken"
        m.requests.labels(backend.name, tenant.name, outcome).inc()
        m.tenant_requests.labels(tenant.name, "chat", outcome).inc()
        prompt = min(60, actual)  # the prompt is charged first, the rest is completion
        if prompt:
            m.tenant_usage_tokens.labels(tenant.name, "chat", "prompt").inc(prompt)
        if actual - prompt:
            m.tenant_usage_tokens.labels(tenant.name, "chat", "completion").inc(actual - prompt)
    m.requests.labels("", "", "rejected_400").inc()
    m.requests.labels("", "alice", "rejected_404").inc()
    m.tenant_requests.labels("alice", "", "rejected_404").inc()


def new_metrics(leaks: list[int]) -> GatewayMetrics:
    return GatewayMetrics(lambda: [], lambda: leaks[0])


def test_flushed_batches_equal_direct_updates() -> None:
    batched, direct = new_metrics([0]), new_metrics([0])
    drive(batched)
    drive_directly(direct)
    got, want = samples(batched), samples(direct)  # render() flushes first
    assert got == want
    assert want[("kvgate_admission_seconds_count", ())] == 2 * len(SECONDS)
    assert want[("kvgate_admission_seconds_bucket", (("le", "0.0001"),))] == 2 * 3
    # the usage ledger got the same counts, per tenant × model × outcome
    rows = batched.usage.totals(0, float("inf"))
    tokens: dict[tuple[str, str, str], float] = {}
    for (tenant, model, outcome), (requests, prompt, completion) in rows.items():
        labels = (("model", model), ("outcome", outcome), ("tenant", tenant))
        assert want[("kvgate_tenant_requests_total", labels)] == requests
        for kind, n in (("prompt", prompt), ("completion", completion)):
            tokens[(kind, model, tenant)] = tokens.get((kind, model, tenant), 0) + n
    for (kind, model, tenant), n in tokens.items():
        key = (("kind", kind), ("model", model), ("tenant", tenant))
        assert want.get(("kvgate_tenant_usage_tokens_total", key), 0) == n
    assert sum(tokens.values()) > 0
    assert rows[("alice", "", "rejected_404")] == (1, 0, 0)


def test_nothing_shows_before_a_flush_and_nothing_counts_twice() -> None:
    leaks = [0]
    m = new_metrics(leaks)
    m.rejected(B0, ALICE, "backend-slots", 0.0002)
    assert m.rejections.labels("b0", "backend-slots")._value.get() == 0  # still batched
    leaks[0] = 2  # two reservations dropped without release since the last sync
    m.flush()
    m.flush()
    got = samples(m)
    assert got[("kvgate_rejections_total", (("backend", "b0"), ("reason", "backend-slots")))] == 1
    assert got[("kvgate_admission_seconds_count", ())] == 1
    assert got[("kvgate_reservation_leaks_total", ())] == 2


def test_queue_depth_is_a_gauge_set_at_every_flush() -> None:
    m = new_metrics([0])
    depth = {"critical": 0, "standard": 3, "sheddable": 1}
    m.queue_depth_of = lambda cls: depth[cls]
    got = samples(m)
    assert got[("kvgate_queue_depth", (("class", "standard"),))] == 3
    assert got[("kvgate_queue_depth", (("class", "sheddable"),))] == 1
    depth["standard"] = 0
    assert samples(m)[("kvgate_queue_depth", (("class", "standard"),))] == 0
