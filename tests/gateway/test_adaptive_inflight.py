"""The in-flight token budget under adaptive limits: never scaled by the law (it already is the
engine's KV memory), lowered only by the engine's *external* KV occupancy (what it holds beyond
kvgate's own in-flight tokens). Readings are fed to the adaptive sink by hand on a manual clock;
the admissions are the core's; ``/admin/state`` and ``/metrics`` are read from a running
gateway."""

from __future__ import annotations

import multiprocessing as mp
import uuid
from typing import Any

import aiohttp
import pytest

from kvgate import AdmissionController, InvalidAmountError, InvalidConfigError, ManualClock
from kvgate.adaptive import AdaptiveSink
from kvgate.app import Gateway
from kvgate.config import Config
from kvgate.gateway_build import build_gateway
from kvgate.server import run_gateway
from kvgate.telemetry.engine_metrics import EngineReading

from .conftest import sha
from .helpers import bearer, get_text, metric

ADMIN = "sk-admin-inflight"
CAPACITY = 10_000  # the engine's KV capacity (tokens)
BASE = 9_000  # its in-flight budget: capacity × the default safety factor 0.9


def gateway(**backend: Any) -> tuple[Gateway, AdaptiveSink, ManualClock]:
    """A gateway (not serving) with one adaptive backend at the article's watermarks (0.85 /
    0.70, floor 0.6), many slots and a large TPM so that only the in-flight budget binds, and
    a sink whose laws run on a manual clock."""
    b = {
        "name": "b0",
        "url": "http://127.0.0.1:9",
        "models": [{"name": "m", "context_window": 4096}],
        "max_concurrency": 100,
        "tokens_per_minute": 10**9,
        "adaptive": {"enabled": True, "high": 0.85, "low": 0.70, "floor": 0.6},
        **backend,
    }
    tenants = [
        {"name": "std", "api_key_sha256": [sha("sk-std")], "priority": "standard"},
        {
            "name": "gold",
            "api_key_sha256": [sha("sk-gold")],
            "priority": "critical",
            "guaranteed_slots": 4,
        },
    ]
    config = Config.model_validate(
        {"backends": [b], "tenants": tenants, "admin_key_sha256": sha(ADMIN)}
    )
    gw = build_gateway(config, poll=False)
    clock = ManualClock()
    return gw, AdaptiveSink(gw, law_clock=clock), clock


def reading(kv_usage: float | None, waiting: int = 0, capacity: int | None = CAPACITY) -> Any:
    return EngineReading(
        engine="vllm", kv_usage=kv_usage, waiting=waiting, kv_capacity_tokens=capacity
    )


def state(gw: Gateway) -> dict[str, Any]:
    return dict(gw.controller.backend_state(0))


def ids(gw: Gateway) -> tuple[int, int]:
    ctl = gw.controller
    return ctl.tenant_id("std"), ctl.tenant_id("gold")


def release_all(gw: Gateway, held: list[Any]) -> None:
    for r in held:
        r.release()
    st = state(gw)
    assert (st["in_use"], st["inflight_tokens"], st["burst_in_use"]) == (0, 0, 0)


def test_a_healthy_engine_is_never_throttled_below_its_base_budget() -> None:
    """Only kvgate's traffic on the engine: it holds prompt + tokens generated so far, kvgate
    reserved prompt + max_tokens, so the KV usage never exceeds kvgate's in-flight share and
    the budget stays at base while the generations grow — even once the law scales the slots
    down at 0.8 KV usage."""
    gw, sink, clock = gateway()
    std, _ = ids(gw)
    ctl = gw.controller
    sink.on_reading("b0", reading(0.0), 0.0)
    assert state(gw)["inflight_token_limit"] == BASE
    # eight requests of prompt 200 + max_tokens 800
    held = [ctl.admit(0, std, "standard", 1000) for _ in range(8)]
    assert all(r.admitted for r in held)
    for generated in range(0, 801, 100):
        clock.advance(1.0)
        sink.on_reading("b0", reading(8 * (200 + generated) / CAPACITY), float(generated))
        assert state(gw)["effective_inflight_token_limit"] == BASE, generated
    st = state(gw)
    assert st["inflight_external_tokens"] == 0
    assert st["scale"] < 0.8  # the law acted on the slots and TPM (0.8 KV usage)...
    assert gw.backend_named("b0").bound_by == "kv-usage"
    # ...but the last 1,000 tokens of the budget are still there
    last = ctl.admit(0, std, "standard", 1000)
    assert last.admitted
    assert ctl.admit(0, std, "standard", 1).reason == "inflight-tokens"
    release_all(gw, [*held, last])


def test_external_occupancy_lowers_the_budget_by_exactly_that() -> None:
    gw, sink, _ = gateway()
    std, gold = ids(gw)
    ctl = gw.controller
    sink.on_reading("b0", reading(0.0), 0.0)
    held = [ctl.admit(0, std, "standard", 1000) for _ in range(2)]
    # the engine holds 5,000 tokens, 2,000 of them at most ours: 3,000 are someone else's
    sink.on_reading("b0", reading(0.5), 1.0)
    st = state(gw)
    assert st["inflight_token_limit"] == BASE  # the base is unchanged
    assert st["inflight_external_tokens"] == 3000
    assert st["effective_inflight_token_limit"] == BASE - 3000
    # 4,000 more fit exactly, for a guaranteed slot as for anyone; not one token more
    r = ctl.admit(0, std, "standard", 4001)
    assert (r.admitted, r.reason) == (False, "inflight-tokens")
    g = ctl.admit(0, gold, "critical", 4001)
    assert (g.admitted, g.reason) == (False, "inflight-tokens")
    g = ctl.admit(0, gold, "critical", 4000)
    assert (g.admitted, g.pool) == (True, "guaranteed")
    held.append(g)
    assert ctl.admit(0, gold, "critical", 1).reason == "inflight-tokens"
    assert state(gw)["inflight_tokens"] == BASE - 3000
    release_all(gw, held)
    # the other client is gone: the whole base budget again
    sink.on_reading("b0", reading(0.1), 2.0)
    st = state(gw)
    assert (st["inflight_external_tokens"], st["effective_inflight_token_limit"]) == (1000, 8000)
    sink.on_reading("b0", reading(0.0), 3.0)
    assert state(gw)["effective_inflight_token_limit"] == BASE
    big = ctl.admit(0, std, "standard", BASE)
    assert big.admitted
    release_all(gw, [big])


@pytest.mark.parametrize(
    ("kv_usage", "waiting", "bound_by"),
    [(0.86, 0, "kv-usage"), (0.5, 20, "waiting")],
    ids=["kv-above-high", "deep-queue"],
)
def test_the_articles_watermarks_leave_room_above_what_is_in_flight(
    kv_usage: float, waiting: int, bound_by: str
) -> None:
    """Long generations hold large reservations while the engine holds less (it has not
    generated the tokens yet). At 0.86 KV usage (above the high watermark 0.85), or with a deep
    queue, the law goes to its floor 0.6; scaling the budget too gave 0.6 × 9,000 = 5,400
    tokens, below the 8,700 in flight: nothing but guaranteed slots could be admitted."""
    gw, sink, _ = gateway()
    std, _ = ids(gw)
    ctl = gw.controller
    sink.on_reading("b0", reading(0.0), 0.0)
    held = [ctl.admit(0, std, "standard", 2900) for _ in range(3)]  # 8,700 tokens in flight
    sink.on_reading("b0", reading(kv_usage, waiting), 1.0)
    st = state(gw)
    assert st["scale"] == pytest.approx(0.6)
    assert st["effective_concurrency"] == 60
    assert 0.6 * BASE < st["inflight_tokens"] == 8700
    assert st["effective_inflight_token_limit"] == BASE
    short = ctl.admit(0, std, "standard", 300)  # a standard short chat still gets in
    assert (short.admitted, short.pool) == (True, "burst")
    assert state(gw)["inflight_external_tokens"] == 0
    assert gw.backend_named("b0").bound_by == bound_by
    release_all(gw, [*held, short])


def test_no_correction_without_a_known_capacity_or_kv_gauge() -> None:
    """A configured budget with an engine that states no capacity, or an engine without a KV
    gauge: the budget in force is the base. A configured budget with a stated capacity is
    corrected like a discovered one."""
    gw, sink, _ = gateway(inflight_token_limit=5000)
    sink.on_reading("b0", reading(0.9, capacity=None), 0.0)
    st = state(gw)
    assert (st["inflight_external_tokens"], st["effective_inflight_token_limit"]) == (0, 5000)
    sink.on_reading("b0", reading(0.3), 1.0)  # now it states 10,000 tokens: 3,000 external
    st = state(gw)
    assert (st["inflight_external_tokens"], st["effective_inflight_token_limit"]) == (3000, 2000)
    assert st["inflight_token_limit"] == 5000
    sink.on_reading("b0", reading(None), 2.0)  # the KV gauge is gone: no correction
    assert state(gw)["effective_inflight_token_limit"] == 5000


def test_adaptation_off_makes_no_correction() -> None:
    gw, sink, _ = gateway(adaptive={"enabled": False})
    sink.on_reading("b0", reading(0.9), 0.0)
    st = state(gw)
    assert (st["scale"], st["inflight_external_tokens"]) == (1.0, 0)
    assert st["effective_inflight_token_limit"] == BASE


def test_set_inflight_external_refuses_bad_input_and_changes_nothing() -> None:
    gw, _, _ = gateway()
    ctl = gw.controller
    ctl.set_inflight_external(0, 123)
    before = state(gw)
    for bad, kind in ((-1, InvalidAmountError), (2**63, InvalidAmountError), (1.5, TypeError)):
        with pytest.raises(kind, match="tokens"):
            ctl.set_inflight_external(0, bad)
    with pytest.raises(TypeError, match="tokens"):
        ctl.set_inflight_external(0, True)
    with pytest.raises(InvalidConfigError, match="unknown backend"):
        ctl.set_inflight_external(5, 1)
    assert state(gw) == before


def _set_external(shm_name: str, tokens: int) -> None:
    ctl = AdmissionController.attach(shm_name)
    backend = ctl.backend_id("b")
    assert backend is not None
    ctl.set_inflight_external(backend, tokens)


def test_external_occupancy_is_shared_by_the_worker_processes() -> None:
    """With ``--workers N`` every worker polls the engines; the value one of them sets is in
    force in all of them, as every other limit of the shared region."""
    name = f"kvgate-test-ext-{uuid.uuid4().hex[:8]}"
    ctl = AdmissionController(shm_name=name, create=True)
    b = ctl.add_backend("b", max_concurrency=4, tokens_per_minute=10**6, inflight_token_limit=1000)
    t = ctl.add_tenant("t", priority="standard")
    worker = mp.get_context("spawn").Process(target=_set_external, args=(name, 600))
    worker.start()
    worker.join(60)
    assert worker.exitcode == 0
    st = ctl.backend_state(b)
    assert (st["inflight_external_tokens"], st["effective_inflight_token_limit"]) == (600, 400)
    assert ctl.admit(b, t, "standard", 401).reason == "inflight-tokens"
    r = ctl.admit(b, t, "standard", 400)
    assert r.admitted
    r.release()
    assert ctl.backend_state(b)["inflight_tokens"] == 0


async def test_admin_state_says_what_binds_each_limit_and_metrics_show_external() -> None:
    gw, sink, clock = gateway()
    async with run_gateway(gw) as url, aiohttp.ClientSession() as s:

        async def b0() -> dict[str, Any]:
            async with s.get(url + "/admin/state", headers=bearer(ADMIN)) as r:
                assert r.status == 200
                return dict((await r.json())["backends"][0])

        sink.on_reading("b0", reading(0.2), 0.0)
        st = await b0()
        assert st["bound_by"] == {
            "concurrency": "none",
            "tokens_per_minute": "none",
            "inflight": "external-kv",  # 2,000 tokens held, none of them ours
        }
        assert (st["inflight_external_tokens"], st["effective_inflight_token_limit"]) == (
            2000,
            BASE - 2000,
        )
        text = await get_text(url + "/metrics")
        assert metric(text, "kvgate_inflight_external_tokens", backend="b0") == 2000
        assert metric(text, "kvgate_inflight_token_limit", backend="b0") == BASE - 2000

        sink.on_reading("b0", reading(0.9), 1.0)
        bound = (await b0())["bound_by"]
        assert (bound["concurrency"], bound["tokens_per_minute"]) == ("kv-usage", "kv-usage")
        sink.on_reading("b0", reading(0.0, waiting=50), 2.0)
        assert (await b0())["bound_by"] == {
            "concurrency": "waiting",
            "tokens_per_minute": "waiting",
            "inflight": "none",
        }
        sink.on_reading("b0", reading(0.0), 3.0)  # pressure gone, no time passed yet
        assert (await b0())["bound_by"]["concurrency"] == "recovery"
        sink.on_stale("b0", True, 4.0)
        assert (await b0())["bound_by"]["concurrency"] == "stale"
        sink.on_stale("b0", False, 5.0)
        for t in range(6, 30):
            clock.advance(1.0)
            sink.on_reading("b0", reading(0.0), float(t))
        st = await b0()
        assert st["scale"] == 1.0
        assert st["bound_by"]["concurrency"] == "none"
        text = await get_text(url + "/metrics")
        assert metric(text, "kvgate_inflight_external_tokens", backend="b0") == 0
