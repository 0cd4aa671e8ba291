"""The store agent (:class:`kvgate.store.redis_store.RedisStore`) when Redis is away: the
fallback policies ``open``, ``closed``, ``share``, ``strict``, per-limit policies, and
``max_degraded_s`` turning ``share`` into ``after_degraded``; and what a call that timed out on
the replica but ran on the server leaves behind.

A replica that never reached Redis talks to a closed loopback port (its breaker opens at
start). A replica that learned its scopes first talks to a real ``redis-server`` that is then
killed or paused (``CLIENT PAUSE``, ``SIGSTOP``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from tests.store.redis_servers import RedisServer, free_port, wait_for

from kvgate import AdmissionController
from kvgate.config import StoreConfig
from kvgate.store import StoreRefusal
from kvgate.store.redis_store import RedisStore, StoreHold

#: what an admission holds: a hold id of the replica's quota ledger (decided locally, in the
#: Rust core) or a StoreHold (decided in Redis, or by a fallback policy)
HOLDS = (StoreHold, int)


@dataclass(frozen=True)
class Ref:
    """A backend or tenant as the store sees it: its core id and name."""

    id: int
    name: str


@dataclass
class Limits:
    """One backend and one tenant registered in an admission core."""

    controller: Any
    backend: Ref
    tenant: Ref


def limits(
    max_concurrency: int = 10,
    tokens_per_minute: int = 60_000,
    burst_tokens: int = 10_000,
    **tenant: Any,
) -> Limits:
    ctl = AdmissionController()
    b = ctl.add_backend(
        "gpu",
        max_concurrency=max_concurrency,
        tokens_per_minute=tokens_per_minute,
        burst_tokens=burst_tokens,
    )
    t = ctl.add_tenant("acme", priority="standard", **tenant)
    return Limits(ctl, Ref(b, "gpu"), Ref(t, "acme"))


def config(url: str, **kw: Any) -> StoreConfig:
    """A store's settings for these tests: fast heartbeats, one failure opens the breaker.
    The deadlines are long enough for a loaded machine's Redis (a join or a decision answered
    late would fall back before the fault a test injects): Redis killed fails every call at
    once; a test that stalls Redis sets the short deadline it needs."""
    opts: dict[str, Any] = {
        "heartbeat_s": 0.05,
        "lease_ttl_s": 2.0,
        "deadline_ms": 1000,
        "background_deadline_ms": 1000,
        "breaker_failures": 1,
    }
    opts.update(kw)
    return StoreConfig(url=url, **opts)


@pytest.fixture
async def stores() -> AsyncIterator[Callable[..., Awaitable[RedisStore]]]:
    """Makes started stores; closes them after the test."""
    made: list[RedisStore] = []

    async def make(cfg: StoreConfig, lim: Limits, backends: tuple[str, ...] = ()) -> RedisStore:
        store = RedisStore(cfg, lim.controller)
        await store.start(backends)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


async def admit(store: RedisStore, lim: Limits, tokens: int = 1) -> Any:
    """The admission stage's order: the replica's quotas, else the store."""
    hold = store.try_admit(lim.backend, lim.tenant, "standard", tokens)
    if hold is None:
        hold = await store.admit(lim.backend, lim.tenant, "standard", tokens)
    return hold


async def admit_until_refused(
    store: RedisStore, lim: Limits, most: int, tokens: int = 1
) -> tuple[list[Any], StoreRefusal]:
    """Admits requests of ``tokens`` until one is refused: the holds and the refusal (the
    test fails after ``most`` admissions)."""
    holds: list[Any] = []
    while True:
        h = await admit(store, lim, tokens)
        if isinstance(h, StoreRefusal):
            return holds, h
        holds.append(h)
        assert len(holds) <= most


def unreachable() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


# --- a replica that never reached Redis ------------------------------------------------------


async def test_never_reached_open_admits_everything(stores: Any) -> None:
    lim = limits(max_concurrency=2)
    store = await stores(config(unreachable(), on_failure="open"), lim)
    assert store.state()["breaker"] == "open"
    assert store.try_admit(lim.backend, lim.tenant, "standard", 10) is None
    holds = [await admit(store, lim, 10) for _ in range(5)]  # beyond the limit of 2
    assert all(isinstance(h, HOLDS) for h in holds)
    assert store.degraded_admissions == 5
    for h in holds:
        store.release(h, 10, 10)
    sc = store.scopes["bgpu"]
    assert sc.pools["burst"].in_use == 0


@pytest.mark.parametrize("policy", ["closed", "share", "strict"])
async def test_never_reached_closed_share_strict_refuse_store_unavailable(
    stores: Any, policy: str
) -> None:
    # share and strict hold nothing when Redis never answered: no share to fall back on
    lim = limits()
    store = await stores(config(unreachable(), on_failure=policy), lim)
    refusal = await admit(store, lim)
    assert isinstance(refusal, StoreRefusal)
    assert refusal.reason == "store-unavailable"
    assert refusal.scope == "backend"
    assert refusal.retry_after == pytest.approx(0.05)
    assert not refusal.never
    assert store.degraded_admissions == 0
    assert all(p.in_use == 0 for sc in store.scopes.values() for p in sc.pools.values())


async def test_a_policy_per_limit_overrides_on_failure(stores: Any) -> None:
    lim = limits()
    cfg = config(unreachable(), on_failure="open", policies={"backend-slots": "closed"})
    store = await stores(cfg, lim)
    refusal = await admit(store, lim)
    assert isinstance(refusal, StoreRefusal)
    assert refusal.reason == "store-unavailable"
    # the other way round: slots open, the rest closed
    cfg = config(unreachable(), on_failure="closed", policies={"backend-slots": "open"})
    lim2 = limits(tokens_per_minute=2**40)  # no backend bucket: slots only
    store2 = await stores(cfg, lim2)
    assert isinstance(await admit(store2, lim2), HOLDS)


# --- a replica that learned its scopes, then lost Redis ----------------------------------------


async def learned(
    stores: Any, server: RedisServer, lim: Limits, n: int, **cfg: Any
) -> tuple[RedisStore, list[Any]]:
    """A store that admitted ``n`` requests through Redis (it knows its scopes)."""
    store = await stores(config(server.url, **cfg), lim)
    holds = [await admit(store, lim) for _ in range(n)]
    assert all(isinstance(h, HOLDS) for h in holds), holds
    await wait_for(lambda: not store.scopes["bgpu"].busy, 5.0, "the lane idle")
    return store, holds


async def lose_redis(store: RedisStore, server: RedisServer, lim: Limits) -> Any:
    """Kills Redis, waits (bounded) until a heartbeat failed and opened the breaker (one
    failure opens it), then admits one request: by the fallback policy."""
    server.kill()
    await wait_for(lambda: store.state()["breaker"] == "open", 10.0, "the breaker open")
    return await admit(store, lim)


async def test_share_keeps_at_most_the_limit_divided_among_live_replicas(
    stores: Any, redis_server: RedisServer
) -> None:
    lim = limits(max_concurrency=10, tokens_per_minute=2**40)
    await learned(stores, redis_server, lim, 1, on_failure="share")  # a second replica
    store, holds = await learned(stores, redis_server, lim, 1, on_failure="share")
    assert store.scopes["bgpu"].live == 2
    first = await lose_redis(store, redis_server, lim)
    assert isinstance(first, HOLDS)
    holds.append(first)
    pool = store.scopes["bgpu"].pools["burst"]
    ceiling = max(pool.q, 10 // 2)
    more, h = await admit_until_refused(store, lim, 10 - len(holds))
    holds += more
    assert pool.in_use == len(holds) == ceiling
    assert (h.reason, h.scope, h.retry_after) == ("backend-slots", "backend", 0.05)
    assert store.degraded_admissions == len(holds) - 1
    store.release(holds.pop(), 1, 1)  # a slot back: admitted again
    assert isinstance(await admit(store, lim), HOLDS)


async def test_share_bucket_is_the_rate_and_burst_divided_among_live_replicas(
    stores: Any, redis_server: RedisServer
) -> None:
    # 600 tokens a minute, a burst of 100; two live replicas: a share of 50 tokens
    lim = limits(max_concurrency=100, tokens_per_minute=600, burst_tokens=100)
    await learned(stores, redis_server, lim, 1, on_failure="share")
    store, _ = await learned(stores, redis_server, lim, 1, on_failure="share")
    assert store.scopes["bgpu"].live == 2
    redis_server.kill()
    held = store.scopes["bgpu"].buckets["tpm"].avail
    assert held < 40  # what it pre-debited for small requests
    big = await admit(store, lim, 60)  # more than the share's burst: refused
    assert isinstance(big, StoreRefusal)
    assert store.state()["breaker"] == "open"
    assert big.reason == "backend-tpm"
    ok = await admit(store, lim, 45)  # from the share (or what it held)
    assert isinstance(ok, HOLDS)
    again = await admit(store, lim, 45)
    assert isinstance(again, StoreRefusal)
    assert again.reason == "backend-tpm"
    assert again.retry_after is not None
    assert again.retry_after > 1.0  # 10 tokens a second for the share's 5 a second


async def test_share_of_a_tenant_redis_never_answered_for_divides_by_the_backends_replicas(
    stores: Any, redis_server: RedisServer
) -> None:
    # a tenant's first requests reach this replica only after Redis went away: its share is its
    # limit ÷ the replicas Redis named for the backend (a 503 before: no share known)
    lim = limits(max_concurrency=100, tokens_per_minute=2**40)
    t2 = lim.controller.add_tenant(
        "beta", priority="standard", max_concurrency=4, tokens_per_minute=600, burst_tokens=100
    )
    late = Limits(lim.controller, lim.backend, Ref(t2, "beta"))
    await learned(stores, redis_server, lim, 1, on_failure="share")  # a second replica
    store, _ = await learned(stores, redis_server, lim, 1, on_failure="share")
    assert store.scopes["bgpu"].live == 2
    assert "tbeta" not in store.scopes or store.scopes["tbeta"].epoch is None
    redis_server.kill()
    await wait_for(lambda: store.state()["breaker"] == "open", 10.0, "the breaker open")
    holds, h = await admit_until_refused(store, late, 4, 10)
    # 4 slots ÷ 2 replicas; 10-token requests within the bucket's share (burst 100 ÷ 2)
    assert len(holds) == 2
    assert (h.reason, h.scope) == ("tenant-concurrency", "tenant")
    assert "Redis not answering: share" in (h.note or "")
    for hold in holds:
        store.release(hold, 10, 10)
    big = await admit(store, late, 60)  # over the bucket's share of the burst (50)
    assert isinstance(big, StoreRefusal)
    assert big.reason == "tenant-tpm"


async def test_a_replica_joins_its_backends_at_start_so_its_first_request_has_a_share(
    stores: Any, redis_server: RedisServer
) -> None:
    # two replicas started (each joins the backend's scope at start) and took no request yet;
    # Redis goes away: the first request has a share (limit ÷ 2), not a 503
    lim = limits(max_concurrency=4, tokens_per_minute=2**40)
    other = await stores(config(redis_server.url, on_failure="share"), lim, ("gpu",))
    store = await stores(config(redis_server.url, on_failure="share"), lim, ("gpu",))
    assert store.scopes["bgpu"].live == 2
    assert other.scopes["bgpu"].epoch is not None
    assert store.calls == 1  # one message: the join
    redis_server.kill()  # the first request's message fails: the fallback policy decides
    holds, h = await admit_until_refused(store, lim, 4)
    assert len(holds) == 2
    assert (h.reason, h.scope) == ("backend-slots", "backend")


async def test_a_replica_that_alone_served_a_tenant_takes_only_its_share_of_it(
    stores: Any, redis_server: RedisServer
) -> None:
    # three replicas joined the backend's scope; one alone served the tenant (Redis counts one
    # live replica in the tenant's scope); Redis goes away: every replica divides the tenant's
    # limit by the backend's three, so the three together stay within it (the one that served
    # it took the whole limit before, the others their shares on top)
    lim = limits(max_concurrency=100, tokens_per_minute=2**40)
    t2 = lim.controller.add_tenant("gamma", priority="standard", max_concurrency=9)
    tenant = Limits(lim.controller, lim.backend, Ref(t2, "gamma"))
    made = [
        await stores(config(redis_server.url, on_failure="share", lease_ttl_s=5.0), lim, ("gpu",))
        for _ in range(3)
    ]
    for store in made:  # past their first heartbeats (warming: no headroom floor)
        store._ledger.warming = False
    served, *others = made
    for store in others:  # they serve another tenant on the backend: they heard of all three
        h = await admit(store, lim)
        assert isinstance(h, HOLDS), h
        store.release(h, 1, 1)
    holds = [await admit(served, tenant) for _ in range(2)]
    assert all(isinstance(h, HOLDS) for h in holds), holds
    assert served.scopes["tgamma"].live == 1
    assert [s.scopes["bgpu"].live for s in made] == [3, 3, 3]
    redis_server.kill()
    admitted = {}
    for store in made:
        got, h = await admit_until_refused(store, tenant, 9)
        assert h.reason == "tenant-concurrency", h
        admitted[id(store)] = len(got)
    # 9 ÷ 3 = 3 each: the one that runs 2 takes 1 more, the others 3 each
    assert admitted[id(served)] == 1
    assert [admitted[id(s)] for s in others] == [3, 3]
    assert 2 + sum(admitted.values()) <= 9


async def test_a_replica_that_cannot_reach_redis_at_start_joins_nothing(stores: Any) -> None:
    lim = limits()
    store = await stores(config(unreachable(), on_failure="share"), lim, ("gpu",))
    assert store.calls == 0
    refusal = await admit(store, lim)
    assert isinstance(refusal, StoreRefusal)
    assert refusal.reason == "store-unavailable"


async def test_strict_keeps_only_what_the_replica_held(
    stores: Any, redis_server: RedisServer
) -> None:
    lim = limits(max_concurrency=10, tokens_per_minute=2**40)
    await learned(stores, redis_server, lim, 1, on_failure="strict")
    store, holds = await learned(stores, redis_server, lim, 2, on_failure="strict")
    pool = store.scopes["bgpu"].pools["burst"]
    quota = pool.q
    assert quota >= pool.in_use == 2
    redis_server.kill()
    more, h = await admit_until_refused(store, lim, 10 - len(holds))
    holds += more
    assert store.state()["breaker"] == "open"
    assert pool.in_use == len(holds) == quota
    assert h.reason == "backend-slots"


async def test_share_becomes_closed_after_max_degraded_s(
    stores: Any, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """``share`` turns into ``closed`` once Redis has been away for ``max_degraded_s``; the
    replica says so once in its log and in ``/admin/state`` (``share_policy_now``)."""
    lim = limits(max_concurrency=10, tokens_per_minute=2**40)
    store, _ = await learned(stores, redis_server, lim, 1, on_failure="share", max_degraded_s=0.3)
    first = await lose_redis(store, redis_server, lim)
    opened = store._breaker.opened_at
    assert opened is not None
    assert store.state()["share_policy_now"] == "share"
    assert isinstance(first, HOLDS)  # share: within its share
    store.release(first, 1, 1)
    admitted = 0
    deadline = time.monotonic() + 10.0
    while isinstance(h := await admit(store, lim), HOLDS):
        admitted += 1  # still share: one slot at a time, given back
        store.release(h, 1, 1)
        assert time.monotonic() < deadline, "share never turned into closed"
        await asyncio.sleep(0.01)
    assert time.monotonic() - opened >= 0.3 - 0.05
    assert admitted > 0
    assert isinstance(h, StoreRefusal)
    assert h.reason == "store-unavailable"
    assert store.state()["share_policy_now"] == "closed"
    said = [r.getMessage() for r in caplog.records if "max_degraded_s" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].endswith("limits with the share policy now use closed")


async def test_share_becomes_open_after_max_degraded_s_when_asked(
    stores: Any, redis_server: RedisServer
) -> None:
    lim = limits(max_concurrency=4, tokens_per_minute=2**40)
    store, holds = await learned(
        stores,
        redis_server,
        lim,
        1,
        on_failure="share",
        max_degraded_s=0.2,
        after_degraded="open",
    )
    holds.append(await lose_redis(store, redis_server, lim))
    opened = store._breaker.opened_at
    assert opened is not None
    while isinstance(h := await admit(store, lim), HOLDS):
        holds.append(h)
    assert len(holds) <= 4  # share: at most the limit
    await wait_for(lambda: time.monotonic() - opened > 0.25, 5.0, "max_degraded_s over")
    more = [await admit(store, lim) for _ in range(6)]
    assert all(isinstance(h, HOLDS) for h in more)  # open: beyond the limit


# --- a call that timed out on the replica but ran on the server ------------------------------


async def test_a_timed_out_admit_that_ran_late_is_given_back(
    stores: Any, redis_server: RedisServer
) -> None:
    """An admission decided in Redis whose reply came too late: the caller was refused (its
    deadline passed) while Redis recorded the slot and a grant as the replica's quota. The
    replica's next message re-asserts what it really holds, so the units go back; once it left,
    the scope holds nothing (no slot lost for the other replicas)."""
    lim = limits(max_concurrency=6, tokens_per_minute=2**40, guaranteed_slots=1)
    # heartbeats by hand (tick), a short deadline, strict: a late reply means a refusal
    cfg = config(
        redis_server.url,
        on_failure="strict",
        heartbeat_s=5,
        lease_ttl_s=10,
        deadline_ms=100,
        background_deadline_ms=100,
        breaker_failures=1000,
    )
    store = await stores(cfg, lim)
    r = redis_server.client()
    state = "{kvg:b:gpu}"
    sc_key = "bgpu"
    running = await admit(store, lim)  # on the tenant's guarantee (1 slot)
    assert isinstance(running, HOLDS)
    sc = store.scopes[sc_key]

    async def beat() -> None:
        store.tick()
        await wait_for(lambda: not sc.busy, 5.0, "the lane idle")

    # a few heartbeats: the burst quota this replica took as headroom goes back
    await wait_for(lambda: not sc.busy, 5.0, "the lane idle")
    for _ in range(3):
        await beat()
    burst = sc.pools["burst"]
    assert (burst.q, burst.rq, int(r.hget(state, "alloc|burst") or 0)) == (0, 0, 0)

    # Redis busy for 1 s: the next admission (guarantee full: the burst pool, decided in
    # Redis) is sent on the open connection and runs once Redis wakes, after its deadline
    sleeper = redis_server.client()
    busy = threading.Thread(target=lambda: sleeper.execute_command("DEBUG", "SLEEP", "1.0"))
    busy.start()
    try:
        await asyncio.sleep(0.2)  # (ordering only: DEBUG SLEEP first)
        late = await admit(store, lim)
    finally:
        await asyncio.get_running_loop().run_in_executor(None, busy.join)
    assert isinstance(late, StoreRefusal)
    assert store.failures["timeout"] == 1
    await wait_for(
        lambda: int(r.hget(state, f"q|burst|{store.pod}") or 0) > 0, 5.0, "the late admit ran"
    )

    await beat()  # the replica's next message: its burst quota is 0
    assert int(r.hget(state, f"q|burst|{store.pod}") or 0) == 0
    assert int(r.hget(state, "alloc|burst")) == 0
    store.release(running, 1, 1)
    for _ in range(3):
        await beat()
    await store.close()
    fields = r.hgetall(state)
    assert not [k for k in fields if k.startswith("q|")], fields
    assert all(int(v) == 0 for k, v in fields.items() if k.startswith("alloc|")), fields


async def test_the_breaker_closes_soon_after_a_stall_not_at_the_next_heartbeat(
    stores: Any, redis_server: RedisServer
) -> None:
    """Redis stalls (SIGSTOP) long enough to open the breaker, then answers again: the replica
    probes it 100 ms after the breaker opened, then twice as late each time, so the fallback
    ends within a few hundred milliseconds of Redis answering, not at the next heartbeat (5 s
    here; before, only the heartbeat probed)."""
    lim = limits(max_concurrency=10, tokens_per_minute=2**40)
    cfg = config(
        redis_server.url,
        heartbeat_s=5.0,
        lease_ttl_s=20.0,
        deadline_ms=50,
        background_deadline_ms=50,
        breaker_failures=1,
    )
    store = await stores(cfg, lim)
    running = await admit(store, lim)
    assert isinstance(running, HOLDS)
    await wait_for(lambda: not any(sc.busy for sc in store.scopes.values()), 5.0, "lanes idle")
    redis_server.pause()
    try:
        store.tick()  # a heartbeat: its calls time out, the breaker opens
        await wait_for(lambda: store.state()["breaker"] == "open", 5.0, "the breaker open")
        await asyncio.sleep(0.3)
    finally:
        redis_server.resume()
    resumed = time.monotonic()
    await wait_for(lambda: store.state()["breaker"] == "closed", 10.0, "the breaker closed")
    assert time.monotonic() - resumed < 2.5, "closed by the heartbeat, not by an early probe"
    store.release(running, 1, 1)


async def test_every_active_scope_reasserts_when_the_breaker_closes(
    stores: Any, redis_server: RedisServer
) -> None:
    """The probe that closes the breaker is one scope's heartbeat; the replica's other active
    scopes then send a message at once (re-asserting what it holds: what the fallback admitted,
    not what admits that ran late in Redis left there), not at their next heartbeat."""
    lim = limits(max_concurrency=10, tokens_per_minute=2**40)
    t2 = lim.controller.add_tenant("gamma", priority="standard", max_concurrency=9)
    tenant = Limits(lim.controller, lim.backend, Ref(t2, "gamma"))
    cfg = config(redis_server.url, heartbeat_s=5.0, lease_ttl_s=20.0, breaker_failures=1)
    store = await stores(cfg, lim)
    running = await admit(store, tenant)
    assert isinstance(running, HOLDS)
    await wait_for(lambda: not any(sc.busy for sc in store.scopes.values()), 5.0, "lanes idle")
    assert {"bgpu", "tgamma"} <= {k for k, sc in store.scopes.items() if sc in store._active}
    sent: list[str] = []
    fcall = store._wire.fcall

    async def recording(*args: Any) -> Any:
        sent.append(args[2])  # the scope's key
        return await fcall(*args)

    store._wire.fcall = recording
    store._breaker.opened_at, store._breaker.failures = time.monotonic(), 1  # Redis was away
    probe = store.scopes["bgpu"]
    probe.hb_due = True
    store._kick(probe)
    await wait_for(lambda: store.state()["breaker"] == "closed", 5.0, "the breaker closed")
    await wait_for(
        lambda: store.scopes["tgamma"].key in sent, 2.0, "the tenant's scope re-asserted"
    )
    store.release(running, 1, 1)


async def test_refunds_of_degraded_admissions_do_not_fill_the_shared_bucket(
    stores: Any, redis_server: RedisServer
) -> None:
    """A request admitted from the replica's own share of a bucket while Redis was away never
    took tokens from the shared bucket: what it gives back at release must not go to the
    shared bucket either, or every replica could then take more than the rate allows."""
    # one token a second, a burst of 100
    lim = limits(max_concurrency=100, tokens_per_minute=60, burst_tokens=100)
    cfg = config(redis_server.url, on_failure="share", deadline_ms=100, background_deadline_ms=100)
    store = await stores(cfg, lim)
    first = await admit(store, lim, 90)  # through Redis: about 10 tokens left
    assert isinstance(first, HOLDS)
    redis_server.pause()  # SIGSTOP: the state survives
    try:
        await wait_for(lambda: store.state()["breaker"] == "open", 10.0, "the breaker open")
        degraded = await admit(store, lim, 80)  # the replica's own bucket (share)
        assert isinstance(degraded, HOLDS)
        assert store.degraded_admissions == 1
    finally:
        redis_server.resume()
    await wait_for(lambda: store.state()["breaker"] == "closed", 10.0, "the breaker closed")
    store.release(degraded, 80, 0)  # it used nothing: 80 tokens unused
    store.release(first, 90, 90)
    for _ in range(3):
        store.tick()
        await wait_for(lambda: not store.scopes["bgpu"].busy, 5.0, "the lane idle")
    # another replica asks the shared bucket for 60 tokens: about 10 (+1 a second) are there
    other = await stores(cfg, lim)
    refused = await admit(other, lim, 60)
    assert isinstance(refused, StoreRefusal), "the degraded request's refund filled the bucket"
    assert refused.reason == "backend-tpm"


async def test_a_replica_frozen_past_its_lease_admits_nothing_locally(
    stores: Any, redis_server: RedisServer
) -> None:
    """A replica silent past its lease is reaped by the others (who kept talking to the
    scope), who may then take the whole pool; when it wakes up it must not use the quota it
    held (Redis no longer counts it): it asks Redis, which refuses, and it re-asserts only
    what it still runs."""
    lim = limits(max_concurrency=10, tokens_per_minute=2**40)
    cfg = config(redis_server.url, lease_ttl_s=0.3, chunk_fraction=1.0, on_failure="strict")
    frozen = await stores(cfg, lim)
    running = await admit(frozen, lim)
    assert isinstance(running, HOLDS)
    other = await stores(cfg, lim)
    taken = [await admit(other, lim)]  # it holds a slot: it heartbeats the scope
    assert isinstance(taken[0], HOLDS)
    pool = frozen.scopes["bgpu"].pools["burst"]
    await wait_for(lambda: pool.q - pool.in_use >= 1, 5.0, "headroom held")
    # freeze: no more heartbeats; wait (bounded) until its lease ran out in Redis
    assert frozen._heartbeat_task is not None
    frozen._heartbeat_task.cancel()
    r = redis_server.client()

    def reaped() -> bool:
        return r.zscore("{kvg:b:gpu}:live", frozen.pod) is None

    await wait_for(reaped, 10.0, "the frozen replica reaped by the other's heartbeats")
    assert pool.q - pool.in_use >= 1  # it still believes it holds headroom
    while isinstance(h := await admit(other, lim), HOLDS):
        taken.append(h)
        assert len(taken) <= 10
    assert len(taken) == 10  # the frozen replica was reaped: the whole pool
    # it wakes up
    assert frozen.try_admit(lim.backend, lim.tenant, "standard", 1) is None
    refused = await frozen.admit(lim.backend, lim.tenant, "standard", 1)
    assert isinstance(refused, StoreRefusal)
    assert refused.reason == "backend-slots"
    assert int(r.hget("{kvg:b:gpu}", f"q|burst|{frozen.pod}") or 0) == 1  # what it runs
    frozen.release(running, 1, 1)
