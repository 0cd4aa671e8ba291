"""Standing slices (``store.standing_share``) against a real ``redis-server``: a tenant seen
rarely is admitted with no message to Redis, every limit stays exact across replicas that hold
slices and one that holds none, and the claims (``kvg_stand``) go to at most
``standing_replicas`` replicas, survive Redis losing them, and free themselves after a silence."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest
from tests.store.redis_servers import RedisServer, wait_for
from tests.store.test_store_agent import Named, idle_lanes, messages_sent

from kvgate import AdmissionController
from kvgate.config import StoreConfig
from kvgate.store import StoreRefusal
from kvgate.store.redis_store import RedisStore
from kvgate.store.server import LIBRARY


def tenants_core(n: int, conc: int, tpm: int | None) -> tuple[Any, Named, list[Named]]:
    """A core with backend ``b`` far from its limits and ``n`` tenants ``t<i>`` limited to
    ``conc`` requests at once and ``tpm`` tokens a minute."""
    ctl = AdmissionController(backends=1, tenants=n)
    backend = Named(ctl.add_backend("b", max_concurrency=100_000, tokens_per_minute=2**40), "b")
    tenants = [
        Named(
            ctl.add_tenant(
                f"t{i}", priority="standard", max_concurrency=conc, tokens_per_minute=tpm
            ),
            f"t{i}",
        )
        for i in range(n)
    ]
    return ctl, backend, tenants


def standing_config(url: str, share: float, replicas: int, **kw: Any) -> StoreConfig:
    return StoreConfig(
        url=url,
        heartbeat_s=0.1,
        deadline_ms=2000,
        background_deadline_ms=2000,
        standing_share=share,
        standing_replicas=replicas,
        **kw,
    )


async def claimed(st: RedisStore) -> None:
    """Waits (bounded) until ``st`` may use its standing slices (a fresh claims hash settles
    for two leases first)."""
    await wait_for(lambda: st._stand_until > time.monotonic(), 10.0, "a standing claim")


def stand(server: RedisServer, pod: str, want: int, n: int = 2, ttl_s: float = 0.2) -> int:
    got = server.client().fcall("kvg_stand", 1, "{kvg:stand}", pod, int(ttl_s * 1e6), n, want, "0")
    return int(got[0])


async def test_a_tenant_seen_rarely_is_admitted_with_no_message(
    redis_server: RedisServer,
) -> None:
    """With standing slices, 200 tenants with one request each: none of them costs a message
    to its tenant's scope (without slices each costs two: test_store_agent), and what Redis
    grants in a tenant's scope leaves the slices out."""
    ctl, backend, tenants = tenants_core(200, 1000, 10**9)
    st = RedisStore(standing_config(redis_server.url, 0.01, 1), ctl)
    await st.start(["b"])
    try:
        await claimed(st)
        # the backend's scope is busy in a gateway: its first request brings it a quota
        first = await st.admit(backend, tenants[-1], "standard", 100)
        st.release(first, 100, 100)
        await idle_lanes(st)
        sent = messages_sent(st)
        for t in tenants[:-1]:
            hold = st.try_admit(backend, t, "standard", 100)
            assert hold is not None, t.name
            st.release(hold, 100, 40)
        await idle_lanes(st)
        assert sent.count("t") == 0, sent
        state = st.state()["standing"]
        assert state["claim"] == 0
        assert state["tenants"] == 200
        assert state["slots_in_use"] == 0
        assert sent.count("b") <= 2, sent  # grants of the backend's quota, not per request
        # a decision in Redis in a tenant's scope: its limit there is 1,000 less the slices
        # (1 % of it over 1 replica: 10 slots)
        assert st.standing_admissions == 199
        got = await st.admit(backend, tenants[0], "standard", 1)
        assert not isinstance(got, StoreRefusal)
        pool = st._scope("t", "t0").pools["conc"]
        assert pool.st == 10
        assert pool.limit == 990, pool.limit
        st.release(got, 1, 1)
    finally:
        await st.close()
    # leaving gives the claim up at once: another replica may claim it
    assert stand(redis_server, "other", -1, n=1) == 0


async def test_slots_stay_exact_across_replicas_with_and_without_a_claim(
    redis_server: RedisServer,
) -> None:
    """Three replicas, two claims: a tenant limited to 40 requests at once (slices of 2 for
    each claim, 4 kept out of Redis). Each replica admits and releases at random, and over
    the whole run the requests held across the three never pass 40; then all three ask for
    more than the limit at once until exactly 40 are held."""
    ctl, backend, (tenant,) = tenants_core(1, 40, None)
    cfg = standing_config(redis_server.url, 0.1, 2)
    stores = [RedisStore(cfg, ctl) for _ in range(3)]
    for st in stores:
        await st.start(["b"])
    holds: list[tuple[RedisStore, Any]] = []
    rng = random.Random(7)
    try:
        await wait_for(
            lambda: sum(st._stand_until > time.monotonic() for st in stores) == 2,
            10.0,
            "two claims",
        )
        assert sorted(st._stand_claim for st in stores) == [-1, 0, 1]

        async def one(st: RedisStore) -> None:
            hold = st.try_admit(backend, tenant, "standard", 1)
            if hold is None:
                hold = await st.admit(backend, tenant, "standard", 1)
            if not isinstance(hold, StoreRefusal):
                holds.append((st, hold))
                assert len(holds) <= 40, len(holds)

        for _ in range(60):
            await asyncio.gather(*(one(rng.choice(stores)) for _ in range(rng.randint(1, 12))))
            for _ in range(rng.randint(0, len(holds))):
                st, hold = holds.pop(rng.randrange(len(holds)))
                st.release(hold, 1, 1)
            assert len(holds) <= 40
        for st, hold in holds:
            st.release(hold, 1, 1)
        holds.clear()
        for st in stores:
            await st.flushed()
            await idle_lanes(st)
        # saturation: every replica asks for 30 at once, again after what a replica held
        # beyond its use went back (a burst may be refused meanwhile: docs/replicas.md)
        for _ in range(10):
            await asyncio.gather(*(one(st) for st in stores for _ in range(30)))
            assert len(holds) <= 40
            if len(holds) == 40:
                break
            for st in stores:
                st.tick()
                await st.flushed()
                await idle_lanes(st)
        assert len(holds) == 40, len(holds)
        # the two with a claim hold their slices as well as what Redis granted
        assert sum(st._standing_state(time.monotonic())["slots_in_use"] for st in stores) == 4
    finally:
        for st, hold in holds:
            st.release(hold, 1, 1)
        for st in stores:
            await st.close()


async def test_tokens_stay_within_the_bucket_across_replicas(redis_server: RedisServer) -> None:
    """A tenant of 60,000 tokens a minute (a burst of 60,000; 10 % held as slices by two
    claims of three replicas): requests of 1,000 tokens from all three as fast as they are
    answered for about a second are admitted no more than the bucket allows — its burst and
    what it refilled meanwhile — and more than Redis's part alone (the slices were used)."""
    ctl, backend, (tenant,) = tenants_core(1, 100_000, 60_000)
    cfg = standing_config(redis_server.url, 0.1, 2)
    stores = [RedisStore(cfg, ctl) for _ in range(3)]
    for st in stores:
        await st.start(["b"])
    try:
        await wait_for(
            lambda: sum(st._stand_until > time.monotonic() for st in stores) == 2,
            10.0,
            "two claims",
        )
        admitted = 0
        began = time.monotonic()

        async def drive(st: RedisStore) -> None:
            nonlocal admitted
            while time.monotonic() - began < 1.0:
                hold = st.try_admit(backend, tenant, "standard", 1000)
                if hold is None:
                    hold = await st.admit(backend, tenant, "standard", 1000)
                if isinstance(hold, StoreRefusal):
                    await asyncio.sleep(0.005)
                    continue
                admitted += 1000
                st.release(hold, 1000, 1000)

        await asyncio.gather(*(drive(st) for st in stores))
        elapsed = time.monotonic() - began
        allowed = 60_000 + 60_000 * elapsed / 60 + 1000
        assert admitted <= allowed, (admitted, allowed)
        assert admitted > 54_000, admitted  # Redis's bucket alone holds 54,000
    finally:
        for st in stores:
            await st.close()


async def test_limits_too_small_for_a_slice_take_everything_from_redis(
    redis_server: RedisServer,
) -> None:
    """A tenant limited to 10 at once with 1 % slices over 8 claims: a slice would be 0 slots,
    so nothing is kept out of Redis and its requests are decided there as without slices."""
    ctl, backend, (tenant,) = tenants_core(1, 10, None)
    st = RedisStore(standing_config(redis_server.url, 0.01, 8), ctl)
    await st.start(["b"])
    try:
        await claimed(st)
        sent = messages_sent(st)
        hold = st.try_admit(backend, tenant, "standard", 1)
        assert hold is None
        hold = await st.admit(backend, tenant, "standard", 1)
        assert not isinstance(hold, StoreRefusal)
        assert sent.count("t") == 1
        assert st._scope("t", "t0").pools["conc"].st == 0
        assert st.state()["standing"]["tenants"] == 0
        st.release(hold, 1, 1)
    finally:
        await st.close()


def test_claims_settle_after_a_loss_and_free_themselves_after_a_silence(
    redis_server: RedisServer,
) -> None:
    """``kvg_stand`` with two claims and a 1 s lease: a fresh hash gives no new claim for two
    leases; then a and b claim, c gets none; a replica gets back the claim it held right
    after Redis lost the hash, before any newcomer; and a claim silent for a lease stays its
    replica's for one more, then goes to another replica."""
    client = redis_server.client()
    client.function_load(LIBRARY, replace=True)
    key = "{kvg:stand}"

    def server_us() -> int:
        sec, us = client.time()
        return int(sec) * 1_000_000 + int(us)

    def claim(pod: str, want: int) -> int:
        return stand(redis_server, pod, want, ttl_s=1.0)

    assert claim("a", -1) == -1  # the call that made the hash: settling
    born = int(client.hget(key, "born") or 0)
    deadline = time.monotonic() + 10
    while (got := claim("a", -1)) < 0:
        assert time.monotonic() < deadline, "no claim after the settling"
        time.sleep(0.05)
    assert got == 0
    assert server_us() >= born + 2_000_000
    assert claim("b", -1) == 1
    assert claim("c", -1) == -1
    assert claim("a", 0) == 0  # renewed

    client.flushall()  # Redis lost the claims
    assert claim("c", -1) == -1  # a newcomer waits for the holders
    assert claim("b", 1) == 1  # a holder re-asserts its own at once
    assert claim("a", 0) == 0

    # b goes silent (a does not): once b's claim expired, it is still b's for one more lease
    expiry = int(client.hget(key, "e|1") or 0)
    checked = False
    deadline = time.monotonic() + 10
    while True:
        assert time.monotonic() < deadline, ("no claim for c", client.hgetall(key), server_us())
        assert claim("a", 0) == 0  # a stays live
        before = server_us()
        got = claim("c", -1)
        after = server_us()
        if before > expiry and after < expiry + 1_000_000:
            assert got == -1  # expired, within the grace
            checked = True
        if got >= 0:
            break
        time.sleep(0.05)
    assert got == 1
    assert after > expiry + 1_000_000  # (the call ran between before and after)
    assert checked


def test_a_standing_share_over_a_tenth_is_refused() -> None:
    with pytest.raises(ValueError, match="standing_share"):
        StoreConfig(url="redis://127.0.0.1:6379/0", standing_share=0.5)
    with pytest.raises(ValueError, match="standing_replicas"):
        StoreConfig(url="redis://127.0.0.1:6379/0", standing_replicas=0)
