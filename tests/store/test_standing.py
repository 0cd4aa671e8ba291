"""Standing slices (``store.standing_share``) against a real ``redis-server``: a tenant seen
rarely is admitted with no message to Redis, every limit stays exact across replicas that hold
slices and one that holds none, and the claims (``kvg_stand``) go to at most
``standing_replicas`` replicas, survive Redis losing them, and free themselves after a silence."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
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
    established(redis_server)
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


def one_tenant(conc: int | None, tpm: int | None, burst: int | None = None) -> tuple[Any, ...]:
    """A core with backend ``b``, tenant ``t`` (``conc`` at once, ``tpm`` tokens a minute,
    ``burst``) and tenant ``free`` without limits (its requests bring the backend's quota)."""
    ctl = AdmissionController(backends=1, tenants=2)
    b = Named(ctl.add_backend("b", max_concurrency=100_000, tokens_per_minute=2**40), "b")
    t = Named(
        ctl.add_tenant("t", priority="standard", max_concurrency=conc, tokens_per_minute=tpm,
                       burst_tokens=burst),
        "t",
    )  # fmt: skip
    free = Named(ctl.add_tenant("free", priority="standard"), "free")
    return ctl, b, t, free


async def take(st: RedisStore, b: Named, t: Named, tokens: int) -> Any:
    """A hold of ``tokens`` for ``t``: from ``st``'s quotas or slices, else decided in Redis;
    ``None`` when refused."""
    hold = st.try_admit(b, t, "standard", tokens)
    if hold is None:
        hold = await st.admit(b, t, "standard", tokens)
    return None if isinstance(hold, StoreRefusal) else hold


async def warm_backend(*stores: RedisStore, b: Named, free: Named) -> None:
    """Each store's backend scope gets a quota (a gateway's backend is busy: its part of a
    request is decided locally)."""
    for st in stores:
        hold = await take(st, b, free, 1)
        st.release(hold, 1, 1)
        await idle_lanes(st)


def established(server: RedisServer) -> None:
    """The claims' hash of a deployment that has run for a while (past its settling, its
    claims unused since): a slice's bucket starts full."""
    server.client().hset("{kvg:stand}", "born", 0)


@contextlib.asynccontextmanager
async def claimer_and_other(
    server: RedisServer, conc: int | None
) -> AsyncIterator[tuple[Any, Named, Named, RedisStore, RedisStore, list[tuple[RedisStore, Any]]]]:
    """Two replicas on an established claims hash, slices of a tenth over one claim: A holds
    the claim, B none; both backends warm. Yields the core, the backend, tenant ``t``
    (``conc`` at once), A, B and a list of holds, each released on the way out."""
    established(server)
    ctl, b, t, free = one_tenant(conc, None)
    cfg = standing_config(server.url, 0.1, 1)
    a_st, b_st = RedisStore(cfg, ctl), RedisStore(cfg, ctl)
    await a_st.start(["b"])
    await claimed(a_st)
    await b_st.start(["b"])
    held: list[tuple[RedisStore, Any]] = []
    try:
        assert b_st._stand_claim == -1
        await warm_backend(a_st, b_st, b=b, free=free)
        yield ctl, b, t, a_st, b_st, held
    finally:
        for st, hold in held:
            st.release(hold, 1, 1)
        await a_st.close()
        await b_st.close()


def from_slice(st: RedisStore, b: Named, t: Named, n: int) -> list[tuple[RedisStore, Any]]:
    """``n`` requests of ``t``, each admitted by ``st`` without Redis (its slice)."""
    held = []
    for _ in range(n):
        hold = st.try_admit(b, t, "standard", 1)
        assert hold is not None
        held.append((st, hold))
    return held


def new_limit(ctl: Any, t: Named, conc: int, *stores: RedisStore) -> None:
    """A reload that gives ``t`` a concurrency limit of ``conc``, on every store."""
    ctl.update_tenant(t.id, max_concurrency=conc)
    for st in stores:
        st.reload()


async def test_refunds_never_fill_a_slice_bucket_past_its_burst(redis_server: RedisServer) -> None:
    """TPM 6,000,000 with a burst of 60,000; slices of a tenth over one claim: a burst of
    6,000. A request that reserves the slice's whole burst and uses nothing is refunded after
    the slice refilled: the slice still holds at most its burst, and a request larger than
    the slice's burst is never admitted from it (before, each such refund added up, until one
    request of more than the tenant's whole burst came from the slice)."""
    established(redis_server)
    ctl, b, t, free = one_tenant(None, 6_000_000, 60_000)
    st = RedisStore(standing_config(redis_server.url, 0.1, 1), ctl)
    await st.start(["b"])
    try:
        await claimed(st)
        await warm_backend(st, b=b, free=free)
        for _ in range(3):
            await asyncio.sleep(0.01)  # (the token the last probe took comes back: 0.1 ms)
            hold = st.try_admit(b, t, "standard", 6000)
            assert hold is not None
            view = st.hold_view(hold)
            assert view is not None
            assert view.buckets[0].scope is st._standing
            slice_bucket = view.buckets[0]
            # the slice refills its 6,000 (10,000 tokens a second) while the request runs
            await asyncio.sleep(0.7)
            probe = st.try_admit(b, t, "standard", 1)
            assert probe is not None
            st.release(probe, 1, 1)
            st.release(hold, 6000, 0)  # it used nothing
            # more than the slice's burst: not from the slice (nor from Redis's quota: this
            # replica holds none of t's)
            assert st.try_admit(b, t, "standard", 6001) is None, slice_bucket.avail
            again = st.try_admit(b, t, "standard", 1)
            assert again is not None
            st.release(again, 1, 1)
            assert slice_bucket.avail <= slice_bucket.burst == 6000, slice_bucket.avail
    finally:
        await st.close()


@pytest.mark.parametrize("lowered", [9, 50])
async def test_a_reload_that_lowers_a_limit_counts_what_the_slice_runs(
    redis_server: RedisServer, lowered: int
) -> None:
    """A concurrency limit of 100 (a slice of 10 over one claim): A runs 10 of t's requests
    from its slice; a reload lowers the limit to ``lowered`` (9: no slice any more; 50: a
    slice of 5). The slice's requests beyond its new size are re-asserted in Redis, so B is
    granted only what is left: never more than the new limit with A's 10 (9: nothing new
    until they drain)."""
    async with claimer_and_other(redis_server, 100) as (ctl, b, t, a_st, b_st, held):
        held += from_slice(a_st, b, t, 10)
        assert a_st.standing_admissions == 10
        new_limit(ctl, t, lowered, a_st, b_st)
        await a_st.flushed()
        await idle_lanes(a_st)
        for _ in range(lowered + 20):
            hold = await take(b_st, b, t, 1)
            if hold is None:
                break
            held.append((b_st, hold))
        assert len(held) <= max(10, lowered), f"{len(held)} held of a limit of {lowered}"


async def test_a_claim_handed_over_brings_only_what_its_bucket_refilled(
    redis_server: RedisServer,
) -> None:
    """TPM 60,000 (burst 60,000), slices of a tenth over one claim (a burst of 6,000). Three
    replicas stop one after another, as in a rolling restart: the holder spends its slice and
    closes (gives the claim up), and the next one takes the claim. Then Redis's bucket is
    drained. Across all of it, no more than one bucket allows: the next holder's slice holds
    only what the claim refilled since it was given up (before, each holder started with a
    full slice: 72,000 tokens in about a second)."""
    established(redis_server)
    ctl, b, t, free = one_tenant(None, 60_000)
    cfg = standing_config(redis_server.url, 0.1, 1)
    stores = [RedisStore(cfg, ctl) for _ in range(3)]
    for st in stores:
        await st.start(["b"])
    admitted = 0
    try:
        await wait_for(lambda: any(s._stand_until > time.monotonic() for s in stores), 10,
                       "a claim")  # fmt: skip
        await warm_backend(*stores, b=b, free=free)
        began = time.monotonic()
        alive = list(stores)
        while True:
            holder = next(s for s in alive if s._stand_until > time.monotonic())
            await warm_backend(holder, b=b, free=free)
            while (hold := holder.try_admit(b, t, "standard", 1000)) is not None:
                view = holder.hold_view(hold)
                assert view is not None
                assert view.buckets[0].scope is holder._standing
                holder.release(hold, 1000, 1000)
                admitted += 1000
                assert admitted <= 200_000
            if len(alive) == 1:
                break
            alive.remove(holder)
            await holder.close()
            await wait_for(lambda: any(s._stand_until > time.monotonic() for s in alive), 10,
                           "the claim handed over")  # fmt: skip
        last = alive[0]
        while (hold := await take(last, b, t, 1000)) is not None and admitted < 200_000:
            last.release(hold, 1000, 1000)
            admitted += 1000
        elapsed = time.monotonic() - began
        allowed = 60_000 + 60_000 * elapsed / 60 + 1000
        assert admitted <= allowed, (admitted, allowed)
        assert admitted >= 54_000  # Redis's bucket, at least
    finally:
        for st in stores:
            if not st._closed:
                await st.close()


async def test_a_pool_adopted_on_reload_leaves_the_slices_out_of_redis(
    redis_server: RedisServer,
) -> None:
    """A reload gives t a concurrency limit of 100 (a slice of 10 over one claim, held by A).
    B runs 90 of t's requests from before the reload (adopted); A admits 10 from its slice:
    B's pool asks Redis without the slices, so B gets nothing more (before: 105 of 100)."""
    async with claimer_and_other(redis_server, None) as (ctl, b, t, a_st, b_st, held):
        new_limit(ctl, t, 100, a_st, b_st)
        held += from_slice(a_st, b, t, 10)
        b_st.adopt_running("t", lambda: 90)
        await b_st.flushed()
        await idle_lanes(b_st)
        while (hold := await take(b_st, b, t, 1)) is not None and len(held) < 30:
            held.append((b_st, hold))
        assert 90 + len(held) <= 100, 90 + len(held)


async def test_slices_on_a_redis_cluster(redis_cluster: Any) -> None:
    """``cluster: true``: the claim is taken on the node of ``{<prefix>:stand}``, a tenant is
    admitted from its slice, its messages carry the slices, and closing gives the claim up."""
    ctl, b, t, free = one_tenant(1000, None)
    cfg = standing_config(redis_cluster.url, 0.01, 1, cluster=True, key_prefix="kvgstc")
    st = RedisStore(cfg, ctl)
    await st.start(["b"])
    try:
        await claimed(st)
        await warm_backend(st, b=b, free=free)
        hold = st.try_admit(b, t, "standard", 1)
        assert hold is not None
        assert st.standing_admissions == 1
        st.release(hold, 1, 1)
        got = await st.admit(b, t, "standard", 1)
        assert not isinstance(got, StoreRefusal)
        assert st._scope("t", "t").pools["conc"].limit == 990
        st.release(got, 1, 1)
    finally:
        await st.close()
    assert "i|0" not in redis_cluster.client().hgetall("{kvgstc:stand}")


async def test_admin_state_counts_each_tenant_with_a_slice_once(redis_server: RedisServer) -> None:
    """One tenant limited by concurrency only, one by TPM only: two tenants with a slice."""
    ctl = AdmissionController(backends=1, tenants=3)
    b = Named(ctl.add_backend("b", max_concurrency=100_000, tokens_per_minute=2**40), "b")
    c = Named(ctl.add_tenant("c", priority="standard", max_concurrency=1000), "c")
    r = Named(ctl.add_tenant("r", priority="standard", tokens_per_minute=10**9), "r")
    free = Named(ctl.add_tenant("free", priority="standard"), "free")
    st = RedisStore(standing_config(redis_server.url, 0.1, 1), ctl)
    await st.start(["b"])
    try:
        await claimed(st)
        await warm_backend(st, b=b, free=free)
        for t in (c, r):
            hold = st.try_admit(b, t, "standard", 1)
            assert hold is not None
            st.release(hold, 1, 1)
        assert st.standing_admissions == 2
        assert st.state()["standing"]["tenants"] == 2
    finally:
        await st.close()


def test_kvg_stand_odd_calls(redis_server: RedisServer) -> None:
    """``kvg_stand`` called as no replica calls it: leaving when there is no hash makes none;
    a replica that says another number of claims, or another share, than the hash's gets none
    (-2); a ``want`` that is not a number counts as none."""
    client = redis_server.client()
    client.function_load(LIBRARY, replace=True)
    key = "{kvg:stand}"
    assert client.fcall("kvg_stand", 1, key, "a", 1_000_000, 2, -1, "1")[0] == -1
    assert not client.exists(key)
    client.hset(key, "born", 0)
    got = [
        int(client.fcall("kvg_stand", 1, key, pod, 1_000_000, n, -1, "0")[0])
        for pod, n in (("a", 2), ("b", 2), ("c", 4))
    ]
    assert got == [0, 1, -2]
    # the share as well, once a replica has said it
    say = ("kvg_stand", 1, key)
    assert client.fcall(*say, "a", 1_000_000, 2, 0, "0", "0.01")[0] == 0
    assert client.fcall(*say, "e", 1_000_000, 2, -1, "0", "0.02")[0] == -2
    assert client.fcall("kvg_stand", 1, key, "d", 1_000_000, 2, "x", "0")[0] == -1


async def test_a_claim_whose_reply_was_lost_starts_its_buckets_empty(
    redis_server: RedisServer,
) -> None:
    """Another replica held the only claim, spent it and gave it up just now (a rolling
    restart). The new replica's first ``kvg_stand`` runs in Redis but its reply is lost (a
    timeout): the next one finds the claim already its own. Its slice still holds only what
    the claim refilled since it was given up (100 tokens a second), not a whole burst."""
    established(redis_server)
    ctl, b, t, free = one_tenant(None, 60_000)  # a slice: a burst of 6,000, 100 tokens/s
    cfg = standing_config(redis_server.url, 0.1, 1)
    client = redis_server.client()
    client.function_load(LIBRARY, replace=True)
    ttl_us = int(cfg.ttl_s * 1e6)
    assert client.fcall("kvg_stand", 1, "{kvg:stand}", "old", ttl_us, 1, -1, "0")[0] == 0
    client.fcall("kvg_stand", 1, "{kvg:stand}", "old", ttl_us, 1, 0, "1")  # given up
    began = time.monotonic()
    st = RedisStore(cfg, ctl)
    await st.start(["b"])
    fcall, lost = st._wire.fcall, []

    async def first_reply_lost(name: str, *args: Any) -> Any:
        reply = await fcall(name, *args)
        if name == "kvg_stand" and not lost:
            lost.append(reply)
            raise TimeoutError  # applied in Redis, the reply too late
        return reply

    st._wire.fcall = first_reply_lost
    try:
        await claimed(st)
        assert lost
        await warm_backend(st, b=b, free=free)
        got = 0
        while (hold := st.try_admit(b, t, "standard", 100)) is not None:
            st.release(hold, 100, 100)
            got += 100
            assert got <= 6000
        allowed = 100 * (time.monotonic() - began) + 100
        assert got <= allowed, (got, allowed)
    finally:
        await st.close()


async def test_a_reload_after_adopting_keeps_what_was_adopted(redis_server: RedisServer) -> None:
    """A reload gives t a limit of 100 (a slice of 10, held by A); A runs 80 of t's requests
    from before it (adopted) and 10 from its slice; a second reload lowers the limit to 50.
    Both the 80 adopted and the 5 beyond the new slice stay counted in Redis: B gets nothing
    (before, the second reload replaced the 80 by the 5: B got 40, 130 running of 50)."""
    async with claimer_and_other(redis_server, None) as (ctl, b, t, a_st, b_st, held):
        new_limit(ctl, t, 100, a_st, b_st)
        a_st.adopt_running("t", lambda: 80)  # they run throughout
        await a_st.flushed()
        await idle_lanes(a_st)
        held += from_slice(a_st, b, t, 10)
        new_limit(ctl, t, 50, a_st, b_st)
        await a_st.flushed()
        await idle_lanes(a_st)
        conc = a_st._scope("t", "t").pools["conc"]
        assert (conc.adopted, conc.spill) == (80, 5)
        for _ in range(60):
            hold = await take(b_st, b, t, 1)
            if hold is None:
                break
            held.append((b_st, hold))
        assert 80 + len(held) <= 90, f"{80 + len(held)} running of a limit of 50"


async def test_a_limit_raised_again_takes_the_spill_back_into_the_slice(
    redis_server: RedisServer,
) -> None:
    """A limit of 100 (a slice of 10, full on A) lowered to 50 (5 beyond the slice, counted in
    Redis), then raised to 100 again: the slice holds its 10 again and nothing of it stays
    counted in Redis, so B gets the 90 left (before: 85, the 5 counted twice)."""
    async with claimer_and_other(redis_server, 100) as (ctl, b, t, a_st, b_st, held):
        held += from_slice(a_st, b, t, 10)
        new_limit(ctl, t, 50, a_st, b_st)
        conc = a_st._scope("t", "t").pools["conc"]
        assert conc.spill == 5
        await a_st.flushed()
        new_limit(ctl, t, 100, a_st, b_st)
        assert conc.spill == 0
        await a_st.flushed()
        await idle_lanes(a_st)
        while (hold := await take(b_st, b, t, 1)) is not None and len(held) < 120:
            held.append((b_st, hold))
        assert len(held) == 100, len(held)


async def test_the_spill_goes_back_as_its_requests_end(redis_server: RedisServer) -> None:
    """After a reload lowered the slice from 10 to 5, the heartbeat gives back the spill as the
    slice's requests end: with 4 of the 10 ended (6 running), 1 is left; with all ended,
    none, and Redis counts nothing for A."""
    async with claimer_and_other(redis_server, 100) as (ctl, b, t, a_st, _, held):
        held += from_slice(a_st, b, t, 10)
        ctl.update_tenant(t.id, max_concurrency=50)
        a_st.reload()
        conc = a_st._scope("t", "t").pools["conc"]
        assert (conc.spill, conc.in_use) == (5, 5)
        for _ in range(4):
            st, hold = held.pop()
            st.release(hold, 1, 1)
        a_st.tick()
        assert (conc.spill, conc.in_use) == (1, 1)
        while held:
            st, hold = held.pop()
            st.release(hold, 1, 1)
        a_st.tick()
        assert (conc.spill, conc.in_use) == (0, 0)
        await a_st.flushed()
        await idle_lanes(a_st)
        await wait_for(lambda: redis_hget(redis_server, "{kvg:t:t}", "alloc|conc") == 0, 10,
                       "A's spill given back in Redis")  # fmt: skip


def redis_hget(server: RedisServer, key: str, field: str) -> int:
    return int(server.client().hget(key, field) or 0)
