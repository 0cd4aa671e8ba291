"""AdmissionController behaviour under the ManualClock: limits, reasons, reconcile, leaks,
priority classes, scale and the adaptive law."""

from __future__ import annotations

import gc

import pytest

from kvgate import (
    AdaptiveLaw,
    AdmissionController,
    InvalidConfigError,
    ManualClock,
    Rejection,
    Reservation,
)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def ctl(clock: ManualClock) -> AdmissionController:
    return AdmissionController(clock=clock)


def test_admit_release_reconciles_every_bucket(ctl: AdmissionController) -> None:
    b = ctl.add_backend("b", max_concurrency=4, tokens_per_minute=6000, inflight_token_limit=1000)
    t = ctl.add_tenant("t", priority="standard", tokens_per_minute=600)
    r = ctl.admit(b, t, "standard", 100)
    assert isinstance(r, Reservation)
    assert r.admitted
    assert r.tokens == 100
    s = ctl.backend_state(b)
    assert (s["in_use"], s["inflight_tokens"], s["available_tokens"]) == (1, 100, 5900)
    assert ctl.tenant_state(t)["in_use"] == 1
    r.release(160)  # overrun of 60 is charged
    s = ctl.backend_state(b)
    assert (s["in_use"], s["inflight_tokens"], s["available_tokens"]) == (0, 0, 5840)
    assert ctl.tenant_state(t)["available_tokens"] == 440
    assert ctl.tenant_state(t)["in_use"] == 0
    r2 = ctl.admit(b, t, 0, 100)
    r2.release(10)  # refund of 90
    assert ctl.tenant_state(t)["available_tokens"] == 430


def test_refusals_hold_nothing(ctl: AdmissionController, clock: ManualClock) -> None:
    b = ctl.add_backend("b", max_concurrency=2, tokens_per_minute=6000, inflight_token_limit=1000)
    t = ctl.add_tenant("t", priority="standard", tokens_per_minute=600, max_concurrency=5)
    before_b, before_t = ctl.backend_state(b), ctl.tenant_state(t)

    never = ctl.admit(b, t, "standard", 601)
    assert isinstance(never, Rejection)
    assert (never.reason, never.scope, never.retry_after, never.never) == (
        "tenant-tpm",
        "tenant",
        None,
        True,
    )
    assert not never
    big = ctl.admit(b, ctl.add_tenant("u", priority="critical"), "critical", 1001)
    assert (big.reason, big.scope, big.never) == ("inflight-tokens", "backend", True)

    held = [ctl.admit(b, t, "standard", 100) for _ in range(2)]
    slots = ctl.admit(b, t, "standard", 1)
    assert (slots.reason, slots.scope, slots.never) == ("backend-slots", "backend", False)
    assert slots.retry_after is not None
    assert slots.retry_after > 0
    for r in held:
        r.release()
    drained = ctl.admit(b, t, "standard", 500)  # 400 left of 600
    assert drained.reason == "tenant-tpm"
    assert drained.retry_after == pytest.approx(10.0)  # 100 missing at 10 tokens/s
    clock.advance(10.0)
    ok = ctl.admit(b, t, "standard", 500)
    assert ok.admitted
    ok.release()
    assert ctl.backend_state(b)["in_use"] == before_b["in_use"] == 0
    assert ctl.tenant_state(t)["in_use"] == before_t["in_use"] == 0


def test_tenant_concurrency(ctl: AdmissionController) -> None:
    b = ctl.add_backend("b", max_concurrency=10, tokens_per_minute=10**6)
    t = ctl.add_tenant("t", priority="standard", max_concurrency=1)
    with ctl.admit(b, t, "standard", 1) as r:
        assert isinstance(r, Reservation)
        denied = ctl.admit(b, t, "standard", 1)
        assert (denied.reason, denied.scope) == ("tenant-concurrency", "tenant")
    assert r.released
    assert ctl.admit(b, t, "standard", 1).admitted


def test_backend_tpm_and_scale(ctl: AdmissionController) -> None:
    b = ctl.add_backend("b", max_concurrency=10, tokens_per_minute=1000, inflight_token_limit=900)
    t = ctl.add_tenant("t", priority="standard")
    ctl.set_scale(b, 0.5)
    # The scale applies to slots and TPM, not to the in-flight budget; the engine's external
    # KV occupancy lowers that.
    ctl.set_inflight_external(b, 450)
    s = ctl.backend_state(b)
    assert (s["effective_concurrency"], s["effective_tokens_per_minute"]) == (5, 500)
    assert (s["effective_burst_tokens"], s["effective_inflight_token_limit"]) == (500, 450)
    assert (s["inflight_token_limit"], s["inflight_external_tokens"]) == (900, 450)
    # Above the budget in force but within the base one: retry later, not never.
    r = ctl.admit(b, t, "standard", 460)
    assert (r.reason, r.never) == ("inflight-tokens", False)
    r = ctl.admit(b, t, "standard", 450)
    assert r.admitted
    r2 = ctl.admit(b, t, "standard", 100)
    assert r2.reason == "inflight-tokens"
    r.release()
    ctl.set_inflight_external(b, 0)
    # The scale binds standard requests only while the backend is overloaded.
    ctl.set_overload(b, True)
    assert ctl.backend_state(b)["overloaded"]
    held = [ctl.admit(b, t, "standard", 1) for _ in range(5)]
    assert all(h.admitted for h in held)
    assert ctl.admit(b, t, "standard", 1).reason == "backend-slots"
    ctl.set_overload(b, False)
    extra = ctl.admit(b, t, "standard", 1)  # the base 10 slots
    assert extra.admitted
    extra.release()
    ctl.set_overload(b, True)
    ctl.set_scale(b, 1.0)
    assert ctl.admit(b, t, "standard", 1).admitted


def test_guarantees_burst_pool_and_shedding(ctl: AdmissionController) -> None:
    b = ctl.add_backend("b", max_concurrency=4, tokens_per_minute=10**6)
    gold = ctl.add_tenant("gold", priority="critical", guaranteed_slots=2)
    batch = ctl.add_tenant("batch", priority="sheddable")
    held = [ctl.admit(b, batch, "sheddable", 1) for _ in range(2)]
    assert all(h.admitted and h.pool == "burst" for h in held)
    assert ctl.admit(b, batch, "sheddable", 1).reason == "backend-slots"
    g = [ctl.admit(b, gold, "critical", 1) for _ in range(2)]
    assert [x.pool for x in g] == ["guaranteed", "guaranteed"]
    ctl.set_shedding(b, True)
    assert ctl.backend_state(b)["shedding"]
    shed = ctl.admit(b, batch, "sheddable", 1)
    assert (shed.reason, shed.scope, shed.never) == ("shed", "backend", False)
    ctl.set_scale(b, 0.5)  # limit 2: the burst pool is gone, the guarantees stay
    assert ctl.backend_state(b)["burst_pool"] == 0
    for x in (*held, *g):
        x.release()
    assert ctl.admit(b, gold, "critical", 1).admitted
    ctl.set_shedding(b, False)
    assert ctl.admit(b, batch, "sheddable", 1).reason == "backend-slots"


def test_second_release_and_leak_counting(ctl: AdmissionController) -> None:
    b = ctl.add_backend("b", max_concurrency=2, tokens_per_minute=6000)
    t = ctl.add_tenant("t", priority="standard")
    r = ctl.admit(b, t, "standard", 10)
    r.release(5)
    r.release(500)  # no-op: nothing charged twice
    assert ctl.backend_state(b)["available_tokens"] == 5995
    assert ctl.leaks == 0
    ctl.admit(b, t, "standard", 10)  # dropped at once
    gc.collect()
    assert ctl.leaks == 1
    assert ctl.backend_state(b)["in_use"] == 0
    assert ctl.backend_state(b)["inflight_tokens"] == 0


def test_hot_reload(ctl: AdmissionController) -> None:
    b = ctl.add_backend("b", max_concurrency=2, tokens_per_minute=6000)
    t = ctl.add_tenant("t", priority="standard", tokens_per_minute=100)
    held = [ctl.admit(b, t, "standard", 1) for _ in range(2)]
    ctl.update_backend(b, max_concurrency=1, inflight_token_limit=50)
    s = ctl.backend_state(b)
    assert (s["max_concurrency"], s["in_use"], s["inflight_token_limit"]) == (1, 2, 50)
    for h in held:
        h.release()
    ctl.update_tenant(t, tokens_per_minute=1000, priority="critical")
    ts = ctl.tenant_state(t)
    assert (ts["tokens_per_minute"], ts["priority"]) == (1000, "critical")
    assert ctl.backend_id("b") == b
    assert ctl.tenant_id("t") == t
    assert ctl.tenant_id("nope") is None


def test_adaptive_law_drives_scale(clock: ManualClock) -> None:
    law = AdaptiveLaw(clock=clock)
    assert law.target(0.9) == pytest.approx(0.6)
    assert law.target(0.775) == pytest.approx(0.8)
    assert law.target(0.5) == 1.0
    assert law.target(None) == pytest.approx(0.6)
    assert law.target(0.1, waiting=9) == pytest.approx(0.6)
    assert law.update(0.95, 0) == pytest.approx(0.6)
    assert law.shedding
    clock.advance(1.0)
    assert law.update(0.1, 0) == pytest.approx(0.65)  # bounded recovery, no snap back
    assert not law.shedding
    clock.advance(100.0)
    assert law.update(0.1, 0) == 1.0
    law.update(0.86, 0)
    assert law.shedding
    law.update(0.75, 0)
    assert law.shedding, "hysteresis: still shedding between the watermarks"
    law.update(0.69, 0)
    assert not law.shedding


def test_guarantee_scoped_to_backends(ctl: AdmissionController) -> None:
    b0 = ctl.add_backend("b0", max_concurrency=4, tokens_per_minute=10**6)
    b1 = ctl.add_backend("b1", max_concurrency=4, tokens_per_minute=10**6)
    gold = ctl.add_tenant("gold", priority="critical", guaranteed_slots=3, guaranteed_backends=[b0])
    other = ctl.add_tenant("other", priority="standard")
    assert ctl.tenant_state(gold)["guaranteed_slots"] == 3
    assert ctl.tenant_state(gold)["guaranteed_backends"] == [b0]
    assert ctl.tenant_state(other)["guaranteed_backends"] == [b0, b1]  # default: every backend
    s0, s1 = ctl.backend_state(b0), ctl.backend_state(b1)
    assert (s0["guaranteed_slots"], s0["burst_pool"]) == (3, 1)
    assert (s1["guaranteed_slots"], s1["burst_pool"]) == (0, 4)
    # b1's burst pool is not reduced by gold's guarantee on b0
    on_b1 = [ctl.admit(b1, other, "standard", 1) for _ in range(4)]
    assert all(r.admitted and r.pool == "burst" for r in on_b1)
    assert ctl.admit(b1, gold, "critical", 1).reason == "backend-slots"
    # the same guarantee on both backends would not fit b0 (3 + 3 > 4): refused, nothing changed
    with pytest.raises(InvalidConfigError, match='"b0"'):
        ctl.add_tenant("x", priority="critical", guaranteed_slots=3)
    assert ctl.tenant_id("x") is None
    # move gold's guarantee to b1 while it holds guaranteed slots on b0
    held = [ctl.admit(b0, gold, "critical", 1) for _ in range(2)]
    assert [r.pool for r in held] == ["guaranteed", "guaranteed"]
    for r in on_b1:
        r.release()
    ctl.update_tenant(gold, guaranteed_backends=[b1])
    assert ctl.tenant_state(gold)["guaranteed_backends"] == [b1]
    assert ctl.backend_state(b0)["guaranteed_slots"] == 0
    assert ctl.backend_state(b0)["in_use"] == 2
    assert ctl.admit(b1, gold, "critical", 1).pool == "guaranteed"
    for r in held:
        r.release()
    assert ctl.backend_state(b0)["in_use"] == 0
    # None on update = unchanged; "all" = every backend
    ctl.update_tenant(gold, guaranteed_slots=2)
    assert ctl.tenant_state(gold)["guaranteed_backends"] == [b1]
    ctl.update_tenant(gold, guaranteed_backends="all")
    assert ctl.tenant_state(gold)["guaranteed_backends"] == [b0, b1]
    assert ctl.backend_state(b0)["guaranteed_slots"] == 2


def test_bad_guaranteed_backends(ctl: AdmissionController) -> None:
    b0 = ctl.add_backend("b0", max_concurrency=4, tokens_per_minute=10**6)
    with pytest.raises(InvalidConfigError, match="backend id 1"):
        ctl.add_tenant("t", priority="critical", guaranteed_slots=1, guaranteed_backends=[b0, 1])
    with pytest.raises(InvalidConfigError, match="backend id -1"):
        ctl.add_tenant("t", priority="critical", guaranteed_slots=1, guaranteed_backends=[-1])
    with pytest.raises(TypeError, match="guaranteed_backends"):
        ctl.add_tenant("t", priority="critical", guaranteed_backends="b0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="guaranteed_backends"):
        ctl.add_tenant("t", priority="critical", guaranteed_backends=["b0"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="guaranteed_backends"):
        ctl.add_tenant("t", priority="critical", guaranteed_backends=0)  # type: ignore[arg-type]
    assert ctl.tenant_count == 0
    t = ctl.add_tenant("t", priority="critical", guaranteed_slots=1, guaranteed_backends=[])
    assert ctl.tenant_state(t)["guaranteed_backends"] == []
    assert ctl.backend_state(b0)["guaranteed_slots"] == 0
    with pytest.raises(InvalidConfigError, match="backend id 3"):
        ctl.update_tenant(t, guaranteed_backends=[3])
    assert ctl.tenant_state(t)["guaranteed_backends"] == []
