"""The store agent against a real ``redis-server``: scale proposals shared across replicas, and
``kvgate check-config`` checking the server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from tests.store.redis_servers import (
    SENTINEL_MASTER,
    Forwarder,
    RedisServer,
    free_port,
    promote,
    start_sentinel,
    wait_for,
    wait_primary,
)

from kvgate import AdmissionController
from kvgate.__main__ import main
from kvgate.config import StoreConfig
from kvgate.store import StoreRefusal
from kvgate.store.redis_store import RedisStore

ROOT = Path(__file__).resolve().parents[2]


def example_with(url: str) -> str:
    """``examples/replicas.yaml`` with its store at ``url``."""
    text = (ROOT / "examples" / "replicas.yaml").read_text()
    return text.replace("${KVGATE_REDIS_URL:-redis://127.0.0.1:6379/0}", url)


def redis_hget_int(server: RedisServer, key: str, field: str) -> int:
    return int(server.client().hget(key, field) or 0)


@contextlib.asynccontextmanager
async def hung_server() -> AsyncIterator[tuple[int, list[asyncio.StreamWriter]]]:
    """A TCP server on 127.0.0.1 that accepts connections and never answers (a stopped
    sentinel, a dropped route): its port and the connections it accepted, closed on the way
    out."""
    accepted: list[asyncio.StreamWriter] = []

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # (kept open, never answered)

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], accepted
    finally:
        server.close()
        for w in accepted:
            w.close()


class Named:
    def __init__(self, id: int, name: str) -> None:
        self.id, self.name = id, name


def core() -> tuple[Any, Named, Named]:
    ctl = AdmissionController(backends=1, tenants=1)
    b = ctl.add_backend("b", max_concurrency=8, tokens_per_minute=2**40)
    t = ctl.add_tenant("t", priority="standard", max_concurrency=4)
    return ctl, Named(b, "b"), Named(t, "t")


async def synced(store: RedisStore, backend: str, timeout: float = 10.0) -> None:
    """Heartbeats until Redis answered for the backend's scope since this call."""
    sc = store._scope("b", backend)
    seq = sc.seq
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while sc.seq <= seq or sc.busy or sc.epoch is None:
        store.tick()
        await asyncio.sleep(0.02)
        assert loop.time() < give_up, "no reply from Redis"


async def test_the_lowest_live_proposal_is_in_force_and_shedding_is_shared(
    redis_server: RedisServer,
) -> None:
    ctl, _backend, _tenant = core()
    cfg = StoreConfig(url=redis_server.url, heartbeat_s=0.1, background_deadline_ms=2000)
    seen: list[tuple[str, float, bool]] = []
    one = RedisStore(cfg, ctl)
    two = RedisStore(cfg, ctl, on_effective=lambda *a: seen.append(a))
    await one.start()
    await two.start()
    try:
        assert one.propose("b", 0.5, True) == (0.5, True)  # its own, before Redis answered
        await synced(one, "b")
        assert two.propose("b", 1.0, False) == (1.0, False)
        await synced(two, "b")
        # two sees one's proposal: the lowest scale, and shedding because one sheds
        assert two.effective("b") == (0.5, True)
        assert seen[-1] == ("b", 0.5, True)
        # one leaves cleanly: its proposal goes with it
        await one.close()
        await synced(two, "b")
        assert two.effective("b") == (1.0, False)
    finally:
        await two.close()


def test_check_config_reports_the_server_and_warns_on_eviction(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(example_with(redis_server.url))
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr()
    assert "store: Redis 7." in out.out
    assert "maxmemory-policy" not in out.err
    # every limit's fallback, and what share turns into
    assert "fallback share, tenant-tpm: strict; share for 60 s at most, then closed" in out.out
    redis_server.cli("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
    assert main(["check-config", str(path)]) == 0
    err = capsys.readouterr().err
    assert "warning: store: maxmemory-policy is 'allkeys-lru'" in err


def test_check_config_refuses_a_replica(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A URL that names a read-only replica: every message would be refused (``READONLY``)."""
    from redis.exceptions import ReadOnlyError

    from kvgate.store.server import connection_lost

    path = tmp_path / "c.yaml"
    path.write_text(example_with(redis_server.url))
    master = free_port()
    redis_server.cli("REPLICAOF", "127.0.0.1", str(master))
    try:
        assert main(["check-config", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"the server is a read-only replica (of 127.0.0.1:{master})" in err, err
    finally:
        redis_server.cli("REPLICAOF", "NO", "ONE")
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err
    # (a refused write did not run: sent again on a new connection, like a lost one)
    assert connection_lost(ReadOnlyError("You can't write against a read only replica."))


@pytest.mark.parametrize(
    ("user", "acl", "words"),
    [
        # a password for a server that has none: redis-py (which loads the library) carries on,
        # the replicas' own connection is refused: every request was refused 503 by `serve`
        (":not-set", None, "AuthenticationError"),
        # a user that may load the library and read, not FCALL
        ("ro:ro-pass", "~* +@read +ping +info +function", "NoPermissionError"),
        # a user that may FCALL but not write the key prefix's keys
        ("nokeys:nk-pass", "%R~* +@all", "NoPermissionError"),
    ],
)
def test_check_config_sends_a_message_as_the_replicas_do(
    redis_server: RedisServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    user: str,
    acl: str | None,
    words: str,
) -> None:
    """``check-config`` passed these, and ``serve`` then refused every request (503
    ``store-unavailable``): it now sends one message the way a replica does and fails (exit
    2) with the server's reason."""
    name, _, password = user.partition(":")
    if acl is not None:
        redis_server.cli("ACL", "SETUSER", name, "on", ">" + password, *acl.split())
    url = redis_server.url.replace("redis://", f"redis://{user}@")
    path = tmp_path / "c.yaml"
    path.write_text(example_with(url))
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "store.url: a replica's message" in err, err
    assert words in err, err
    assert password not in err
    # the right user on the same server passes
    redis_server.cli("ACL", "SETUSER", "rw", "on", ">rw-pass", "~*", "+@all")
    path.write_text(path.read_text().replace(user, "rw:rw-pass"))
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err


def test_check_config_against_a_cluster(
    redis_cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    text = example_with(redis_cluster.url)
    path.write_text(text.replace("  deadline_ms: 25", "  cluster: true\n  deadline_ms: 25"))
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr()
    assert "store: Redis 7." in out.out, out
    assert "Redis Cluster" in out.out
    # one node of the cluster named without cluster: true: every scope on another node's
    # slots would be a MOVED error for serve
    path.write_text(text)
    assert main(["check-config", str(path)]) == 2
    assert "set store.cluster: true" in capsys.readouterr().err


async def test_proposals_of_three_replicas_scale_the_shared_slots(
    redis_server: RedisServer,
) -> None:
    """Three store agents propose scales for one backend of 8 slots: the lowest live proposal
    is in force everywhere and caps the slots all of them hold together; when the lowest one
    recovers the next lowest is in force; a replica that stops heartbeating (a crash) loses
    its say after its lease."""
    from kvgate.store import StoreRefusal

    cfg = StoreConfig(url=redis_server.url, heartbeat_s=0.1, background_deadline_ms=2000)
    made = []
    for _ in range(3):
        ctl = AdmissionController(backends=1, tenants=1)
        b = ctl.add_backend("b", max_concurrency=8, tokens_per_minute=2**40)
        t = ctl.add_tenant("t", priority="standard", max_concurrency=8)
        made.append((ctl, Named(b, "b"), Named(t, "t")))
    stores = [RedisStore(cfg, ctl) for ctl, _, _ in made]
    for st in stores:
        await st.start()
    try:
        for st, scale, shed in zip(stores, (0.5, 0.75, 1.0), (True, False, False), strict=True):
            st.propose("b", scale, shed)
        for st in stores:
            await synced(st, "b")
        for st in stores:
            await synced(st, "b")
        assert [st.effective("b") for st in stores] == [(0.5, True)] * 3
        # 8 slots × 0.5: four holds at most across the three replicas (the tenant's limit is 8)
        holds = []
        for i in range(9):
            st, (_, backend, tenant) = stores[i % 3], made[i % 3]
            hold = st.try_admit(backend, tenant, "standard", 1)
            if hold is None:
                hold = await st.admit(backend, tenant, "standard", 1)
            if type(hold) is not StoreRefusal:
                holds.append((st, hold))
        assert len(holds) == 4, len(holds)
        for st, hold in holds:
            st.release(hold, 1, 1)
        stores[0].propose("b", 1.0, False)
        for _ in range(2):
            for st in stores:
                await synced(st, "b")
        assert [st.effective("b") for st in stores] == [(0.75, False)] * 3
        # replica 1 stops heartbeating (as if killed): its proposal goes with its lease
        hb = stores[1]._heartbeat_task
        assert hb is not None
        hb.cancel()
        stores[1]._closed = True
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 10
        while stores[2].effective("b") != (1.0, False):
            await synced(stores[2], "b")
            assert loop.time() < give_up, stores[2].effective("b")
    finally:
        for st in stores:
            await st.close()


async def test_a_lost_scope_settles_but_one_that_expired_idle_does_not(
    redis_server: RedisServer,
) -> None:
    """A scope's state missing in Redis although this replica heard from it moments ago was
    lost (a flush, a restart): for half a lease nothing is admitted there while the holders
    re-assert. One missing after minutes of silence simply expired (nobody held anything):
    the next request is admitted at once."""
    from kvgate.store import StoreRefusal

    ctl, backend, tenant = core()
    # generous deadlines: a reply later than 25 ms (a loaded machine) would be a fallback
    # decision, not the settling refusal this test is about
    cfg = StoreConfig(
        url=redis_server.url, heartbeat_s=1.0, deadline_ms=2000, background_deadline_ms=2000
    )
    st = RedisStore(cfg, ctl)
    await st.start()
    try:
        first = await st.admit(backend, tenant, "standard", 1)
        assert type(first) is not StoreRefusal, first
        st.release(first, 1, 1)
        client = redis_server.client()
        sc = st._scope("t", "t")
        # lost: the keys vanish right after a reply
        client.delete(sc.key, sc.key + ":live")
        for pool in sc.pools.values():
            pool.q = pool.rq = pool.in_use = 0
        lost = await st.admit(backend, tenant, "standard", 1)
        assert type(lost) is StoreRefusal, lost
        assert lost.retry_after is not None, lost
        assert 0 < lost.retry_after <= 1.5, lost
        # the refusal says why: not the limit (its remaining is not claimed to be 0)
        assert lost.note is not None
        assert "Redis restarted" in lost.note, lost
        assert lost.remaining is None, lost
        # expired: the keys vanish after the replica's last reply is minutes old
        await asyncio.sleep(1.6)  # the settling time is over
        client.delete(sc.key, sc.key + ":live")
        for pool in sc.pools.values():
            pool.q = pool.rq = 0
        sc.lease_until -= 200.0
        idle = await st.admit(backend, tenant, "standard", 1)
        assert type(idle) is not StoreRefusal, idle
    finally:
        await st.close()


async def test_a_request_that_fits_the_in_flight_budget_is_not_refused_for_stranded_tokens(
    redis_server: RedisServer,
) -> None:
    """Two replicas share a backend's in-flight token budget of 1,843 tokens. Replica one runs a
    905-token request; replica two asks for another 905: 1,810 fit, as on one gateway. The
    headroom replica one keeps beyond its use (it cannot even hold a second request of that
    size), and replica two's own, must not leave the request refused: it is admitted within a
    few heartbeats (it was refused for as long as the first request ran)."""
    from kvgate.store import StoreRefusal

    cfg = StoreConfig(url=redis_server.url, heartbeat_s=0.1, background_deadline_ms=2000)
    made = []
    for _ in range(2):
        ctl = AdmissionController(backends=1, tenants=1)
        b = ctl.add_backend(
            "b", max_concurrency=64, tokens_per_minute=2**40, inflight_token_limit=1843
        )
        t = ctl.add_tenant("t", priority="standard")
        made.append((ctl, Named(b, "b"), Named(t, "t")))
    one, two = (RedisStore(cfg, ctl) for ctl, _, _ in made)
    await one.start()
    await two.start()
    try:
        (_, b1, t1), (_, b2, t2) = made
        first = await one.admit(b1, t1, "standard", 905)
        assert not isinstance(first, StoreRefusal), first
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 2.0  # 20 heartbeats
        second: Any = None
        while True:
            second = two.try_admit(b2, t2, "standard", 905) or await two.admit(
                b2, t2, "standard", 905
            )
            if not isinstance(second, StoreRefusal):
                break
            assert second.reason == "inflight-tokens", second
            assert loop.time() < give_up, "refused for stranded in-flight tokens"
            one.tick()
            await asyncio.sleep(0.05)
        pools = [one._scope("b", "b").pools["inflight"], two._scope("b", "b").pools["inflight"]]
        assert sum(p.in_use for p in pools) == 1810
        one.release(first, 905, 905)
        two.release(second, 905, 905)
    finally:
        await one.close()
        await two.close()


def failed_since(store: RedisStore, start: dict[str, int]) -> dict[str, int]:
    """The failed calls of ``store`` by kind since ``start`` (a copy of ``store.failures``
    taken after :meth:`RedisStore.start`): a test of one fault counts only what that fault
    cost. A join answered after the background deadline (250 ms: a loaded machine's Redis
    can take that long for a first call) is counted at start, and is not the test's fault."""
    return {
        kind: n - start.get(kind, 0)
        for kind, n in store.failures.items()
        if n != start.get(kind, 0)
    }


async def idle_lanes(store: RedisStore, timeout: float = 10.0) -> None:
    """Waits (bounded) until no scope of ``store`` has a message in flight or queued."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while any(sc.busy or sc.admits for sc in store.scopes.values()):
        assert loop.time() < give_up, "a lane still busy"
        await asyncio.sleep(0.01)


async def test_requests_that_waited_for_tokens_bring_a_grant_for_as_many_again(
    redis_server: RedisServer,
) -> None:
    """Twenty requests of 100 tokens reach a replica at once, far from every limit, before it
    holds any tokens (its first since the start; the same after a quiet spell): they are
    decided in Redis, and what comes back lets the next twenty be decided here, without Redis.
    Before, the grant was eight requests' worth until a heartbeat measured the demand, so a
    burst went to Redis again and again (each message waiting behind the last, often past
    ``deadline_ms``: a fallback decision)."""
    from kvgate.store import StoreRefusal

    # no heartbeat measures the demand meanwhile; a deadline a loaded machine's Redis meets
    # (the subject is what the grant lets the next twenty do, not Redis's speed)
    cfg = StoreConfig(url=redis_server.url, heartbeat_s=5.0, deadline_ms=1000)
    ctl = AdmissionController(backends=1, tenants=1)
    b = ctl.add_backend("b", max_concurrency=1000, tokens_per_minute=2**40)
    t = ctl.add_tenant(
        "t",
        priority="standard",
        max_concurrency=1000,
        tokens_per_minute=6_000_000,
        burst_tokens=1_000_000,
    )
    backend, tenant = Named(b, "b"), Named(t, "t")
    store = RedisStore(cfg, ctl)
    await store.start()
    try:
        first = await asyncio.gather(
            *(store.admit(backend, tenant, "standard", 100) for _ in range(20))
        )
        assert not any(isinstance(h, StoreRefusal) for h in first), first
        assert store.degraded_admissions == 0
        await idle_lanes(store)
        calls = store.calls
        second = [store.try_admit(backend, tenant, "standard", 100) for _ in range(20)]
        assert all(h is not None for h in second), "decided in Redis again"
        assert store.calls == calls
        for h in first + second:
            store.release(h, 100, 100)
    finally:
        await store.close()


async def test_a_replica_far_from_a_slot_limit_keeps_headroom_after_a_decision_in_redis(
    redis_server: RedisServer,
) -> None:
    """A request whose slot this replica did not hold is decided in Redis; far from the limit
    the reply leaves the replica room for the next requests (before, the pool a waiting
    request asked for kept no headroom in that message: every request of a burst went to
    Redis until the next heartbeat)."""
    from kvgate.store import StoreRefusal

    cfg = StoreConfig(url=redis_server.url, heartbeat_s=5.0, deadline_ms=2000)
    ctl, backend, tenant = core()  # 8 backend slots, 4 for the tenant: far, one replica
    store = RedisStore(cfg, ctl)
    await store.start()
    store._ledger.warming = False  # past its first heartbeats (see the test below)
    try:
        first = await store.admit(backend, tenant, "standard", 1)
        assert not isinstance(first, StoreRefusal), first
        await idle_lanes(store)
        calls = store.calls
        second = store.try_admit(backend, tenant, "standard", 1)
        assert second is not None, "decided in Redis again"
        assert store.calls == calls
        store.release(first, 1, 1)
        store.release(second, 1, 1)
    finally:
        await store.close()


async def test_replicas_that_start_together_keep_no_headroom_at_a_small_limit(
    redis_server: RedisServer,
) -> None:
    """Three replicas start together; one serves a tenant limited to 4 requests first, while
    it still counts itself alone. In its first heartbeats (warming up) it keeps no unused slot
    beyond the fraction of the limit, so the other two can run the rest of the limit at once.
    Before, it kept room for two more requests (half of the limit), and the others' requests
    were refused until its next heartbeat."""
    from kvgate.store import StoreRefusal

    # a generous deadline: a late reply would be decided by the fallback (a share of 1 each)
    cfg = StoreConfig(url=redis_server.url, heartbeat_s=5.0, deadline_ms=2000)
    made = [limited(4) for _ in range(3)]
    stores = [RedisStore(cfg, ctl) for ctl, _, _ in made]
    for st in stores:
        await st.start()
    try:
        assert all(st.state()["warming"] for st in stores)
        holds = []
        for st, n in zip(stores, (1, 2, 1), strict=True):
            _, backend, tenant = made[stores.index(st)]
            for _ in range(n):
                hold = st.try_admit(backend, tenant, "standard", 1)
                if hold is None:
                    hold = await st.admit(backend, tenant, "standard", 1)
                assert not isinstance(hold, StoreRefusal), hold
                holds.append((st, hold))
            await idle_lanes(st)
        for st, hold in holds:
            st.release(hold, 1, 1)
    finally:
        for st in stores:
            await st.close()


async def test_warming_up_ends_after_two_heartbeats(redis_server: RedisServer) -> None:
    """A replica warms up (no headroom floor) from its start for two heartbeats, then keeps
    the usual headroom."""
    ctl, _, _ = limited(4)
    store = RedisStore(StoreConfig(url=redis_server.url, heartbeat_s=0.1), ctl)
    assert not store.state()["warming"]  # not started: nothing to learn yet
    await store.start()
    try:
        assert store.state()["warming"]
        await wait_for(
            lambda: not store.state()["warming"], 10.0, "warming up ended (heartbeat 0.1 s)"
        )
    finally:
        await store.close()


async def test_a_refusal_of_a_scaled_bucket_tells_when_the_scaled_bucket_is_full(
    redis_server: RedisServer,
) -> None:
    """At scale 0.5 a backend's 60,000-token bucket is 30,000 tokens refilled at 30,000 a
    minute (``kvg_sync`` scales both): a refusal's reset (``x-ratelimit-reset-tokens``) is the
    time to fill that bucket, not the configured one at the scaled rate (twice as long)."""
    from kvgate.store import StoreRefusal

    ctl = AdmissionController(backends=1, tenants=1)
    b = ctl.add_backend("b", max_concurrency=64, tokens_per_minute=60_000, burst_tokens=60_000)
    t = ctl.add_tenant("t", priority="standard")
    st = RedisStore(StoreConfig(url=redis_server.url, heartbeat_s=0.2), ctl)
    await st.start()
    try:
        backend, tenant = Named(b, "b"), Named(t, "t")
        st.propose("b", 0.5, False)
        await synced(st, "b")
        assert st._scope("b", "b").scale == 0.5
        first = st.try_admit(backend, tenant, "standard", 20_000) or await st.admit(
            backend, tenant, "standard", 20_000
        )
        assert not isinstance(first, StoreRefusal), first
        second = st.try_admit(backend, tenant, "standard", 20_000) or await st.admit(
            backend, tenant, "standard", 20_000
        )
        assert isinstance(second, StoreRefusal), second
        assert second.reason == "backend-tpm"
        assert second.remaining is not None
        assert second.remaining < 20_000
        assert second.reset_after is not None
        # (30,000 - remaining) tokens at 500 a second
        assert second.reset_after == pytest.approx((30_000 - second.remaining) / 500, abs=0.5)
    finally:
        await st.close()


def test_no_share_policy_no_word_of_share_turning_closed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With every limit ``strict``, an outage past ``max_degraded_s`` changes no policy:
    ``/admin/state`` shows no share policy in force and nothing is logged about one."""
    import time

    ctl = AdmissionController(backends=1, tenants=1)
    cfg = StoreConfig(url="redis://127.0.0.1:1", on_failure="strict", max_degraded_s=1)
    st = RedisStore(cfg, ctl)
    st._breaker.opened_at = time.monotonic() - 5  # Redis away for 5 s
    assert st.state()["share_policy_now"] is None
    assert st._policy("tenant-tpm") == "strict"
    assert not [r for r in caplog.records if "max_degraded_s" in r.getMessage()]


def test_every_failure_kind_is_a_series_from_the_start() -> None:
    """``kvgate_store_failures_total{kind}`` has every kind at 0 before the first failure (an
    alert on its rate needs the series; an absent one reads as "no data")."""
    from prometheus_client import generate_latest

    from kvgate.metrics import GatewayMetrics

    metrics = GatewayMetrics(lambda: [], lambda: 0)
    ctl = AdmissionController(backends=1, tenants=1)
    RedisStore(StoreConfig(url="redis://127.0.0.1:1"), ctl, metrics=metrics)
    text = generate_latest(metrics.registry).decode()
    for kind in ("timeout", "error", "stale", "late"):
        assert f'kvgate_store_failures_total{{kind="{kind}"}} 0.0' in text, text


async def test_a_release_near_a_limit_is_written_to_redis_before_flushed_returns(
    redis_server: RedisServer,
) -> None:
    """At its limit a replica gives a released slot back to Redis at once; ``flushed`` (awaited
    before the client sees the end of its answer) returns only once Redis applied that
    message, also when another message of the scope was in flight at the release, and at once
    while Redis is away."""
    from kvgate.store import StoreRefusal

    cfg = StoreConfig(url=redis_server.url, heartbeat_s=5.0, deadline_ms=2000)
    ctl = AdmissionController(backends=1, tenants=1)
    backend = Named(ctl.add_backend("b", max_concurrency=8, tokens_per_minute=2**40), "b")
    tenant = Named(ctl.add_tenant("t", priority="standard", max_concurrency=1), "t")
    store = RedisStore(cfg, ctl)
    await store.start()
    sent: list[dict[str, Any]] = []
    fcall = store._wire.fcall

    async def recording(*args: Any) -> Any:
        sent.append(orjson.loads(args[-1]))
        return await fcall(*args)

    store._wire.fcall = recording

    client = redis_server.client()

    def conc_quota_sent() -> int:
        """The tenant's concurrency quota of this replica as Redis has it now (a command sent
        after the replica's messages, on another connection)."""
        return int(client.hget(store._scope("t", "t").key, f"q|conc|{store.pod}") or 0)

    try:
        for _ in range(3):
            hold = await store.admit(backend, tenant, "standard", 1)
            assert not isinstance(hold, StoreRefusal), hold
            await idle_lanes(store)
            assert conc_quota_sent() == 1
            assert not store.unsent
            store.release(hold, 1, 1)
            assert store.unsent
            await store.flushed()
            # written, not only queued: a request of another replica comes after it in Redis
            assert conc_quota_sent() == 0
            assert not store.unsent
        # a message in flight when the slot comes back: flushed waits for the next one
        hold = await store.admit(backend, tenant, "standard", 1)
        assert not isinstance(hold, StoreRefusal), hold
        await idle_lanes(store)
        sc = store._scope("t", "t")
        sc.hb_due = True
        store._kick(sc)  # a heartbeat, sent on the loop's next turn
        await asyncio.sleep(0)
        assert sc.busy
        store.release(hold, 1, 1)
        await store.flushed()
        assert conc_quota_sent() == 0
        # Redis away (the breaker open): nothing to wait for
        await idle_lanes(store)
        hold = await store.admit(backend, tenant, "standard", 1)
        assert not isinstance(hold, StoreRefusal), hold
        await idle_lanes(store)
        store._breaker.opened_at = asyncio.get_running_loop().time()
        store.release(hold, 1, 1)
        before = len(sent)
        await asyncio.wait_for(store.flushed(), 0.5)
        assert len(sent) == before
        assert not store.unsent
    finally:
        store._breaker.opened_at = None
        await store.close()


def limited(limit: int) -> tuple[Any, Named, Named]:
    """A core with one backend ``b`` far from its limits and one tenant ``t`` limited to
    ``limit`` requests at once."""
    ctl = AdmissionController(backends=1, tenants=1)
    b = ctl.add_backend("b", max_concurrency=64, tokens_per_minute=2**40)
    t = ctl.add_tenant("t", priority="standard", max_concurrency=limit)
    return ctl, Named(b, "b"), Named(t, "t")


async def admit_and_release(store: RedisStore, backend: Named, tenant: Named) -> None:
    """``store`` admits one request of ``tenant`` (here or in Redis; a refusal fails the
    test), gives it back, and waits until the message that gives it back is answered."""
    from kvgate.store import StoreRefusal

    hold = store.try_admit(backend, tenant, "standard", 1)
    if hold is None:
        hold = await store.admit(backend, tenant, "standard", 1)
    assert not isinstance(hold, StoreRefusal), hold
    store.release(hold, 1, 1)
    await store.flushed()
    await idle_lanes(store)


async def applied_once(store: RedisStore, client: Any, backend: Named, tenant: Named) -> None:
    """After a message that admitted one request of ``tenant`` was delivered twice: Redis
    records one slot for this replica (the second delivery changed nothing), and the limit of
    one holds (the next request is refused)."""
    from kvgate.store import StoreRefusal

    await idle_lanes(store)
    assert int(client.hget(store._scope("t", "t").key, f"q|conc|{store.pod}") or 0) == 1
    refused = await store.admit(backend, tenant, "standard", 1)
    assert isinstance(refused, StoreRefusal), refused


async def test_a_caller_gone_while_redis_decides_leaves_no_slot_stranded(
    redis_server: RedisServer,
) -> None:
    """At a limit of one, a request's client goes away while Redis decides it (the server is
    stopped with the message written, then resumed): the call still admits it in Redis, for
    no request. The replica re-asserts what it holds right behind that call, so the slot is
    free in Redis at once and the other replica admits its request; before, the slot stayed
    with the first replica until its next heartbeat (5 s here) and every replica was refused
    meanwhile."""

    cfg = StoreConfig(url=redis_server.url, heartbeat_s=5.0, deadline_ms=2000)
    ctl, backend, tenant = limited(1)
    one = RedisStore(cfg, ctl)
    other_ctl, other_backend, other_tenant = limited(1)
    other = RedisStore(cfg, other_ctl)
    await one.start(["b"])
    await other.start(["b"])
    client = redis_server.client()
    loop = asyncio.get_running_loop()
    try:
        for _ in range(3):
            redis_server.pause()
            try:
                task = asyncio.create_task(one.admit(backend, tenant, "standard", 1))
                give_up = loop.time() + 10
                while not (one._wire._proto is not None and one._wire._proto.pending):
                    assert loop.time() < give_up, "the decision was never written"
                    await asyncio.sleep(0.001)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            finally:
                redis_server.resume()
            await idle_lanes(one)
            key = one._scope("t", "t").key
            assert int(client.hget(key, f"q|conc|{one.pod}") or 0) == 0
            began = loop.time()
            await admit_and_release(other, other_backend, other_tenant)
            assert loop.time() - began < 2.5  # well under the 5 s heartbeat
    finally:
        await one.close()
        await other.close()


async def test_flushed_returns_once_redis_applied_the_slot_given_back(
    redis_server: RedisServer,
) -> None:
    """``flushed`` (awaited before the client reads the end of its answer) returns once the
    message that gives a slot back near a limit is applied in Redis, not when it is composed:
    redis-py writes a command only after the event loop's next turn, and a busy replica may
    write it later still (here each call waits 50 ms before it goes). The client's next
    request, sent at once to another replica, is then admitted there. Before, ``flushed``
    returned with the message still unwritten, and that request was refused."""
    from kvgate.store import StoreRefusal

    ctl, backend, tenant = limited(1)
    cfg = StoreConfig(url=redis_server.url, heartbeat_s=5.0, deadline_ms=2000)
    one = RedisStore(cfg, ctl)
    other_ctl, other_backend, other_tenant = limited(1)
    other = RedisStore(cfg, other_ctl)
    await one.start(["b"])
    await other.start(["b"])
    fcall = one._wire.fcall

    async def written_late(*args: Any) -> Any:
        await asyncio.sleep(0.05)
        return await fcall(*args)

    try:
        for _ in range(3):
            hold = await one.admit(backend, tenant, "standard", 1)
            assert not isinstance(hold, StoreRefusal), hold
            await idle_lanes(one)
            one._wire.fcall = written_late
            one.release(hold, 1, 1)
            assert one.unsent
            await one.flushed()
            one._wire.fcall = fcall
            await admit_and_release(other, other_backend, other_tenant)
    finally:
        await one.close()
        await other.close()


async def test_a_message_whose_connection_closed_goes_again_and_is_applied_once(
    redis_server: RedisServer,
) -> None:
    """A call whose reply was lost with its connection (Redis failed over, restarted, or
    dropped it) goes once more on a new connection: the request is decided in Redis, not by
    the fallback, and the second delivery, which carries the same operation id, changes
    nothing."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from kvgate.store import StoreRefusal

    ctl, backend, tenant = limited(1)
    # a deadline a loaded machine meets: the message goes again within it, never after
    store = RedisStore(StoreConfig(url=redis_server.url, heartbeat_s=5.0, deadline_ms=2000), ctl)
    await store.start(["b"])
    at_start = dict(store.failures)
    fcall = store._wire.fcall
    lost: list[bytes] = []

    async def reply_lost_once(*args: Any) -> Any:
        reply = await fcall(*args)  # it ran on the server
        if not lost and b'"admits"' in args[-1]:
            lost.append(args[-1])
            raise RedisConnectionError("Connection closed by server.")
        return reply

    store._wire.fcall = reply_lost_once
    client = redis_server.client()
    try:
        hold = await store.admit(backend, tenant, "standard", 1)
        assert lost, "no admission went to Redis"
        assert not isinstance(hold, StoreRefusal), hold
        assert store.resent == 1
        assert store.degraded_admissions == 0
        assert failed_since(store, at_start) == {}
        await applied_once(store, client, backend, tenant)
    finally:
        await store.close()


async def test_a_request_the_fallback_admits_is_counted_before_those_queued_behind_it(
    redis_server: RedisServer,
) -> None:
    """Replica two's message carrying request A fails (Redis refused the write, the breaker
    still closed) while B and C queue behind it: A is decided by the fallback (its share, one
    slot of two), and the next message re-asserts that slot before Redis decides B and C, so
    with replica one's slot the tenant's limit of two holds."""
    from redis.exceptions import ResponseError

    from kvgate.store import StoreRefusal

    cfg = StoreConfig(url=redis_server.url, heartbeat_s=5.0, deadline_ms=5000)
    ctl1, backend1, tenant1 = limited(2)
    ctl2, backend2, tenant2 = limited(2)
    one, two = RedisStore(cfg, ctl1), RedisStore(cfg, ctl2)
    await one.start(["b"])
    await two.start(["b"])
    sc1 = one._scope("b", "b")
    sc1.hb_due = True
    one._kick(sc1)  # one hears that two replicas serve b: it keeps no headroom for t
    await idle_lanes(one)
    held = await one.admit(backend1, tenant1, "standard", 1)
    assert not isinstance(held, StoreRefusal), held
    await idle_lanes(one)
    key = one._scope("t", "t").key
    assert int(redis_server.client().hget(key, f"q|conc|{one.pod}") or 0) == 1
    fcall = two._wire.fcall
    tenant_calls: list[dict[str, Any]] = []
    in_flight, fail_now = asyncio.Event(), asyncio.Event()

    async def second_message_fails(*args: Any) -> Any:
        if ":t:" not in str(args[2]):
            return await fcall(*args)
        tenant_calls.append(orjson.loads(args[-1]))
        if len(tenant_calls) == 2:  # the message carrying A
            in_flight.set()
            await fail_now.wait()
            raise ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
        return await fcall(*args)

    two._wire.fcall = second_message_fails
    try:
        sc = two._scope("t", "t")
        sc.hb_due = True
        two._kick(sc)  # a heartbeat in flight: A queues behind it and goes in the next message
        await asyncio.sleep(0)
        assert sc.busy
        a = asyncio.create_task(two.admit(backend2, tenant2, "standard", 1))
        await asyncio.wait_for(in_flight.wait(), 10)
        assert tenant_calls[1].get("admits"), tenant_calls
        b = asyncio.create_task(two.admit(backend2, tenant2, "standard", 1))
        c = asyncio.create_task(two.admit(backend2, tenant2, "standard", 1))
        for _ in range(1000):  # B and C queue behind the message in flight (a turn or two)
            if len(sc.admits) == 2:
                break
            await asyncio.sleep(0)
        assert len(sc.admits) == 2, sc.admits
        fail_now.set()
        got = await asyncio.wait_for(asyncio.gather(a, b, c), 10)
        assert not isinstance(got[0], StoreRefusal), got  # A: by the fallback, its share
        assert two.degraded_admissions == 1
        # the message of B and C re-asserted A's slot: Redis refused them
        assert tenant_calls[2]["pools"]["conc"]["q"] == 1, tenant_calls[2]
        assert all(isinstance(r, StoreRefusal) for r in got[1:]), got
    finally:
        await two.close()
        await one.close()


async def test_a_request_sent_from_its_own_coroutine_waits_at_most_the_deadline_in_all(
    redis_server: RedisServer,
) -> None:
    """Request X waits in its tenant's and its backend's scopes; the tenant's message fails
    and the backend's is slow, so X is decided by the fallback only when the backend answers.
    Request Z of the same tenant, whose backend part is taken locally, sends its tenant's next
    message itself: that message waits for X's fallback first, and Z still waits no longer
    than ``deadline_ms`` in all."""
    from redis.exceptions import ResponseError

    deadline = 0.4
    ctl = AdmissionController(backends=2, tenants=2)
    b1 = Named(ctl.add_backend("b1", max_concurrency=64, tokens_per_minute=2**40), "b1")
    b2 = Named(ctl.add_backend("b2", max_concurrency=64, tokens_per_minute=2**40), "b2")
    t = Named(ctl.add_tenant("t", priority="standard", max_concurrency=8), "t")
    u = Named(ctl.add_tenant("u", priority="standard"), "u")  # no limit of its own
    cfg = StoreConfig(url=redis_server.url, heartbeat_s=5.0, deadline_ms=400)
    store = RedisStore(cfg, ctl)
    await store.start(["b1", "b2"])
    try:
        # b2 holds headroom: the backend part of a request on b2 is taken here
        holds = [await store.admit(b2, u, "standard", 1) for _ in range(4)]
        await idle_lanes(store)
        for h in holds:
            store.release(h, 1, 0)
        await idle_lanes(store)
        burst = store._scope("b", "b2").pools["burst"]
        assert burst.q - burst.in_use >= 1, (burst.q, burst.in_use)
        fcall = store._wire.fcall
        tenant_calls = 0

        async def faults(*args: Any) -> Any:
            nonlocal tenant_calls
            key = str(args[2])
            if ":t:t}" in key:
                tenant_calls += 1
                if tenant_calls == 1:
                    raise ResponseError("OOM command not allowed")  # X's tenant message
                await asyncio.sleep(0.35)  # slow, within the deadline
            elif ":b:b1}" in key:
                await asyncio.sleep(0.38)  # X's backend message, slow
            return await fcall(*args)

        store._wire.fcall = faults
        loop = asyncio.get_running_loop()
        x = asyncio.create_task(store.admit(b1, t, "standard", 1))
        sc = store._scope("t", "t")
        for _ in range(10_000):  # until X's tenant message failed and X awaits its fallback
            if sc.falling:
                break
            await asyncio.sleep(0.001)
        assert sc.falling == 1
        assert not sc.busy
        began = loop.time()
        await store.admit(b2, t, "standard", 1)
        waited = loop.time() - began
        await x
        assert waited <= deadline + 0.1, waited
    finally:
        await store.close()


async def test_a_connection_that_drops_after_the_write_sends_the_message_again_once(
    redis_server: RedisServer,
) -> None:
    """The store's own connection drops with a decision's message written and its reply not
    yet read (the reply future the store awaits fails as a lost connection): the message goes
    once more on a new connection within the same deadline, Redis applies it once (its
    operation id), and the request is admitted in Redis."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from kvgate.store import StoreRefusal

    ctl, backend, tenant = limited(1)
    # a deadline a loaded machine meets: the message goes again within it, never after
    store = RedisStore(StoreConfig(url=redis_server.url, heartbeat_s=5.0, deadline_ms=2000), ctl)
    await store.start(["b"])
    at_start = dict(store.failures)
    proto = store._wire._proto
    assert proto is not None
    assert not proto.closed
    call = proto.call
    dropped: list[bytes] = []

    def written_then_dropped(packed: bytes) -> Any:
        fut = call(packed)
        if not dropped and b'"admits"' in packed:
            dropped.append(packed)
            proto.close(RedisConnectionError("Connection closed by server."))
        return fut

    proto.call = written_then_dropped  # type: ignore[method-assign]
    client = redis_server.client()
    try:
        hold = await store.admit(backend, tenant, "standard", 1)
        assert dropped, "no admission went to Redis"
        assert not isinstance(hold, StoreRefusal), hold
        assert (store.resent, store.degraded_admissions) == (1, 0)
        assert failed_since(store, at_start) == {}
        assert store._wire.connects == 2
        await applied_once(store, client, backend, tenant)
    finally:
        await store.close()


async def test_a_message_resent_to_a_redis_that_restarted_empty_loads_the_library_first(
    redis_server: RedisServer,
) -> None:
    """The connection closed because Redis restarted without its data: the message sent again
    meets a Redis without the Functions library, which is loaded, and the request is decided
    in Redis."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from kvgate.store import StoreRefusal

    ctl, backend, tenant = limited(1)
    # a deadline a loaded machine meets: the message goes again within it, never after
    store = RedisStore(StoreConfig(url=redis_server.url, heartbeat_s=5.0, deadline_ms=2000), ctl)
    await store.start(["b"])
    at_start = dict(store.failures)
    fcall = store._wire.fcall
    client = redis_server.client()
    restarted: list[bool] = []

    async def restarts_empty_once(*args: Any) -> Any:
        if not restarted and b'"admits"' in args[-1]:
            restarted.append(True)
            client.function_flush()
            raise RedisConnectionError("Connection closed by server.")
        return await fcall(*args)

    store._wire.fcall = restarts_empty_once
    try:
        hold = await store.admit(backend, tenant, "standard", 1)
        assert restarted
        assert not isinstance(hold, StoreRefusal), hold
        assert (store.resent, store.degraded_admissions) == (1, 0)
        assert failed_since(store, at_start) == {}
        assert client.function_list(library="kvgate")
    finally:
        await store.close()


def far_from_limits(names: list[str]) -> tuple[Any, Named, list[Named]]:
    """A core with backend ``b`` and a tenant per name, each far from its limits (1,000 at
    once, 10^9 tokens a minute): what a replica of a gateway with many API keys holds."""
    ctl = AdmissionController(backends=1, tenants=len(names))
    backend = Named(ctl.add_backend("b", max_concurrency=10_000, tokens_per_minute=2**40), "b")
    tenants = [
        Named(
            ctl.add_tenant(n, priority="standard", max_concurrency=1000, tokens_per_minute=10**9),
            n,
        )
        for n in names
    ]
    return ctl, backend, tenants


def messages_sent(st: RedisStore) -> list[str]:
    """The kind (``t``, ``b``) of the scope of each message ``st`` sends from now on, whether
    alone or with others in one call."""
    sent: list[str] = []
    send, send_many = st._send, st._send_many

    async def one(sc: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(sc.kind)
        return await send(sc, *args, **kwargs)

    async def many(batch: Any) -> Any:
        sent.extend(sc.kind for sc, _, _ in batch)
        return await send_many(batch)

    st._send = one  # type: ignore[method-assign]
    st._send_many = many  # type: ignore[method-assign]
    return sent


async def test_a_tenants_lone_request_costs_two_messages_and_a_steady_tenant_keeps_its_tokens(
    redis_server: RedisServer,
) -> None:
    """A tenant seen rarely (one of 100,000 API keys, say): its request is decided in Redis,
    and the next heartbeat gives everything back, tokens included, so the scope goes quiet
    at the one after with no message: two messages, not three (the tokens used to go back a
    heartbeat later). A tenant that sends again before that heartbeat is no newcomer there:
    it keeps tokens sized from its rate."""
    ctl, backend, (tenant,) = far_from_limits(["t"])
    # heartbeats only when the test calls tick()
    cfg = StoreConfig(url=redis_server.url, heartbeat_s=5.0, deadline_ms=2000)
    st = RedisStore(cfg, ctl)
    await st.start(["b"])
    sent = messages_sent(st)
    sc = st._scope("t", "t")
    try:
        await admit_and_release(st, backend, tenant)  # decided in Redis: no quota held
        assert sent.count("t") == 1
        st.tick()  # a newcomer that runs nothing: everything goes back
        await idle_lanes(st)
        assert sent.count("t") == 2
        assert not sc.holds(), [(p.q, p.rq, p.in_use) for p in sc.pools.values()]
        st.tick()  # nothing held, nothing used: the scope goes quiet without a message
        await idle_lanes(st)
        assert sent.count("t") == 2
        assert sc not in st._active

        # steady: requests in two heartbeat periods in a row
        await admit_and_release(st, backend, tenant)
        st.tick()
        await idle_lanes(st)
        await admit_and_release(st, backend, tenant)
        st.tick()  # active at the last heartbeat: sized from its rate, tokens kept
        await idle_lanes(st)
        tokens = next(iter(sc.buckets.values()))
        assert tokens.avail > 0, tokens.avail
        assert sc in st._active
    finally:
        await st.close()


def held_in_redis(server: RedisServer, st: RedisStore, sc: Any) -> dict[str, str]:
    """What Redis records ``st``'s replica as holding in scope ``sc`` (its non-zero quotas)."""
    fields = server.client().hgetall(sc.key)
    return {k: v for k, v in fields.items() if k.startswith("q|") and k.endswith(st.pod)}


async def test_the_give_backs_of_tenants_seen_once_go_32_to_a_call(
    redis_server: RedisServer,
) -> None:
    """200 tenants seen once each (their requests decided in Redis, one call each): the next
    heartbeat gives back what each took in calls of up to 32 scopes (``kvg_sync_many``), not
    one call per tenant, and Redis then records nothing held by this replica in any of them."""
    from kvgate.store.redis_store import BEAT_GROUP

    ctl, backend, tenants = far_from_limits([f"t{i}" for i in range(200)])
    # heartbeats only when the test calls tick(); half a period is 1 s
    cfg = StoreConfig(url=redis_server.url, heartbeat_s=2.0, deadline_ms=2000)
    st = RedisStore(cfg, ctl)
    await st.start(["b"])
    at_start = dict(st.failures)
    try:
        for t in tenants:
            await admit_and_release(st, backend, t)
        scopes = [st._scope("t", t.name) for t in tenants]
        before = st.calls
        st.tick()  # 201 scopes (the backend's too): 7 groups of up to 32
        await wait_for(
            lambda: not any(sc.holds() or sc.busy for sc in scopes), 10, "every scope gave back"
        )
        await idle_lanes(st)
        groups = -(-(len(scopes) + 1) // BEAT_GROUP)
        assert st.calls - before <= groups + 2, (st.calls - before, groups)
        assert failed_since(st, at_start).keys() <= {"stale", "late"}, st.failures
        assert all(not any(int(v) for v in held_in_redis(redis_server, st, sc).values())
                   for sc in scopes)  # fmt: skip
        assert st.stranded() == (0, 0)
    finally:
        await st.close()


async def test_heartbeats_go_one_call_per_scope_when_the_server_has_no_kvg_sync_many(
    redis_server: RedisServer,
) -> None:
    """A library loaded by an earlier kvgate (a rolling upgrade) has no ``kvg_sync_many``:
    the heartbeat that tried it ran nothing, its scopes send their messages alone, what they
    held goes back all the same, and the next heartbeats go one call per scope meanwhile."""
    from kvgate.store.server import LIBRARY

    ctl, backend, tenants = far_from_limits(["a", "b", "c"])
    cfg = StoreConfig(url=redis_server.url, heartbeat_s=5.0, deadline_ms=2000)
    st = RedisStore(cfg, ctl)
    await st.start(["b"])
    at_start = dict(st.failures)
    earlier = LIBRARY.replace("redis.register_function('kvg_sync_many', kvg_sync_many)\n", "")
    assert earlier != LIBRARY
    redis_server.client().function_load(earlier, replace=True)
    sent = messages_sent(st)
    try:
        holds = []
        for t in tenants:  # a request each, still running at the heartbeat
            hold = st.try_admit(backend, t, "standard", 1) or await st.admit(
                backend, t, "standard", 1
            )
            holds.append(hold)
        await idle_lanes(st)
        scopes = [st._scope("t", t.name) for t in tenants]
        seqs = [sc.seq for sc in scopes]
        st.tick()  # tried in one call: Function not found
        await wait_for(
            lambda: all(
                sc.seq >= seq + 2 and not sc.busy for sc, seq in zip(scopes, seqs, strict=True)
            ),
            10,
            "each scope sent its heartbeat alone",
        )
        await idle_lanes(st)
        assert st._batch_off_until > 0
        assert failed_since(st, at_start).keys() <= {"stale", "late"}, st.failures
        for hold in holds:
            st.release(hold, 1, 1)
        await st.flushed()
        sent.clear()
        before = st.calls
        st.tick()  # one call per scope now: three tenants and the backend
        await wait_for(lambda: not any(sc.holds() or sc.busy for sc in scopes), 10, "given back")
        await idle_lanes(st)
        assert st.calls - before == len(sent) == 4, (st.calls - before, sent)
        assert all(not any(int(v) for v in held_in_redis(redis_server, st, sc).values())
                   for sc in scopes)  # fmt: skip
    finally:
        await st.close()


async def test_a_heartbeat_of_many_scopes_goes_out_in_groups_spread_over_half_a_period(
    redis_server: RedisServer,
) -> None:
    """A replica holding something in 300 tenants' scopes: a heartbeat sends 32 messages at
    once and the rest in groups over half the period, so that a decision near a limit waits
    in Redis behind a group, not behind 300 messages (with thousands, 80 ms and more: past
    the 25 ms deadline, and the breaker opened with Redis healthy). Every scope still beats
    within the period."""
    from kvgate.store import StoreRefusal
    from kvgate.store.redis_store import BEAT_GROUP

    ctl, backend, tenants = far_from_limits([f"t{i}" for i in range(300)])
    # heartbeats only when the test calls tick(); half a period is 1 s
    cfg = StoreConfig(url=redis_server.url, heartbeat_s=2.0, deadline_ms=2000)
    st = RedisStore(cfg, ctl)
    await st.start(["b"])
    at_start = dict(st.failures)
    holds = []
    try:
        for t in tenants:  # each holds a running request: its scope stays active
            hold = st.try_admit(backend, t, "standard", 1) or await st.admit(
                backend, t, "standard", 1
            )
            assert not isinstance(hold, StoreRefusal), hold
            holds.append(hold)
        await idle_lanes(st)
        scopes = [st._scope("t", t.name) for t in tenants]
        seqs = [sc.seq for sc in scopes]
        loop = asyncio.get_running_loop()
        started = loop.time()
        st.tick()
        at_once = sum(sc.busy or sc.hb_due for sc in scopes)
        assert 0 < at_once <= BEAT_GROUP, at_once
        give_up = started + 10
        while any(sc.seq == seq for sc, seq in zip(scopes, seqs, strict=True)):
            assert loop.time() < give_up, "a scope never beat"
            await asyncio.sleep(0.02)
        # spread: the last group went out no sooner than most of half a period later
        assert loop.time() - started >= 0.8, loop.time() - started
        await idle_lanes(st)
        assert "timeout" not in failed_since(st, at_start), st.failures
    finally:
        for hold in holds:
            st.release(hold, 1, 1)
        await st.close()


async def each_tenant_once(url: str, n: int) -> tuple[RedisStore, Named, list[Named]]:
    """A started store on ``url`` with one backend ``b`` and ``n`` tenants ``t<i>``
    (``max_concurrency`` 4), each of which has had one request admitted and released."""
    ctl = AdmissionController(backends=1, tenants=n)
    b = Named(ctl.add_backend("b", max_concurrency=1000, tokens_per_minute=2**40), "b")
    tenants = [
        Named(ctl.add_tenant(f"t{i}", priority="standard", max_concurrency=4), f"t{i}")
        for i in range(n)
    ]
    st = RedisStore(StoreConfig(url=url, heartbeat_s=5.0), ctl)
    await st.start(["b"])
    for t in tenants:
        hold = st.try_admit(b, t, "standard", 10)
        if hold is None:
            hold = await st.admit(b, t, "standard", 10)
        st.release(hold, 10, 5)
    return st, b, tenants


async def test_state_lists_the_backends_and_the_named_tenants_scopes(
    redis_server: RedisServer,
) -> None:
    """``/admin/state?tenant=`` (or a page of tenants) lists those tenants' store scopes, not
    every active one (a replica that served 10,000 tenants lately answered 1.8 MB for one
    tenant); ``active_tenant_scopes`` counts them all."""
    st, _, _ = await each_tenant_once(redis_server.url, 50)
    try:
        every = st.state()
        assert every["active_tenant_scopes"] == 50
        assert len(every["scopes"]) == 51
        some = st.state(["t3", "t7", "not-a-tenant"])
        assert some["active_tenant_scopes"] == 50
        assert set(some["scopes"]) == {"{kvg:b:b}", "{kvg:t:t3}", "{kvg:t:t7}"}
        one, same = some["scopes"]["{kvg:t:t3}"], every["scopes"]["{kvg:t:t3}"]
        del one["lease_left_s"], same["lease_left_s"]  # (read a moment apart)
        assert one == same
        assert set(st.state([])["scopes"]) == {"{kvg:b:b}"}
    finally:
        await st.close()


async def test_close_leaves_the_scopes_it_is_live_in_not_every_scope_it_saw(
    redis_server: RedisServer,
) -> None:
    """A replica that closes leaves (``kvg_leave``) every scope where Redis may still count it
    live, concurrently — what it held there goes back at once — and skips those whose lease
    ran out and where it holds nothing (the others reap them): a replica that served 100,000
    tenants once each spent its shutdown one round trip per tenant, and past its deadline left
    the rest to the reaping."""
    st, _, tenants = await each_tenant_once(redis_server.url, 300)
    await st.flushed()
    # the first 100 tenants' leases ran out long ago and they hold nothing there any more
    for t in tenants[:100]:
        sc = st._scope("t", t.name)
        for p in sc.pools.values():
            p.q = 0
        for bucket in sc.buckets.values():
            bucket.avail = 0
        sc.lease_until = time.monotonic() - 3600
    left: list[str] = []
    fcall = st._wire.fcall

    def recording(*args: Any) -> Any:
        if args[0] == "kvg_leave":
            left.append(args[2])
        return fcall(*args)

    st._wire.fcall = recording
    await st.close()
    assert len(left) == 201, len(left)  # the backend's scope and 200 tenants'
    assert set(left) == {"{kvg:b:b}"} | {f"{{kvg:t:t{i}}}" for i in range(100, 300)}
    client = redis_server.client()
    for key in left:
        assert client.zscore(key + ":live", st.pod) is None, key
        held = {k: v for k, v in client.hgetall(key).items() if k.startswith("alloc|")}
        assert all(int(v) == 0 for v in held.values()), (key, held)


@pytest.mark.parametrize("connection", ["kvgate", "redis-py"])
async def test_a_store_leaves_a_demoted_primary_for_the_new_one(
    redis_replica_pair: tuple[RedisServer, RedisServer], connection: str
) -> None:
    """A switchover that keeps the old primary running as a replica, its address moved to the
    new primary (a :class:`Forwarder` switched with the old connections kept): the store's
    messages on the old connections are refused (``READONLY``), and go again on new ones,
    on the store's own connection and on redis-py's (the client of a TLS URL with settings
    the store's connection does not apply). A slot given back after the switchover is given
    back on the new primary."""
    primary, replica = redis_replica_pair
    fwd = Forwarder(primary.port)
    await fwd.start()
    ctl, b, t = core()
    store = RedisStore(StoreConfig(url=f"redis://127.0.0.1:{fwd.port}/0", heartbeat_s=5.0), ctl)
    await store.start(["b"])
    try:
        if connection == "redis-py":
            await store._wire.aclose()
            store._wire = store._client
        assert store.state()["connection"]["client"] == connection
        hold = store.try_admit(b, t, "standard", 10) or await store.admit(b, t, "standard", 10)
        assert not isinstance(hold, StoreRefusal), hold
        key = store._scope("t", "t").key

        def alloc(server: RedisServer) -> int:
            return int(server.client().hget(key, "alloc|conc") or 0)

        await wait_for(lambda: alloc(replica) >= 1, 10, "the hold replicated")
        promote(replica)
        primary.cli("REPLICAOF", "127.0.0.1", str(replica.port))
        fwd.switch(replica.port, keep=True)
        store.release(hold, 10, 10)
        store._beat(store._scope("t", "t"))
        give_up = time.monotonic() + 10
        while alloc(replica) != 0:  # (Redis is polled, not notified)
            assert time.monotonic() < give_up, f"not given back on the new primary: {store.state()}"
            if not store._scope("t", "t").busy:
                store._beat(store._scope("t", "t"))
            await asyncio.sleep(0.05)
        assert store.resent >= 1  # the refused message went again, on a new connection
    finally:
        await store.close()
        await fwd.close()


def test_check_config_finds_the_primary_through_sentinel(
    redis_replica_pair: tuple[RedisServer, RedisServer],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``store.sentinel``: check-config names the primary the sentinels name and checks it as
    it checks a server of ``url``; a master name the sentinels do not know, or no sentinel
    that answers, is a problem (exit 2)."""
    primary, replica = redis_replica_pair
    with start_sentinel(tmp_path / "sentinel", primary, replica) as sentinel:
        path = tmp_path / "c.yaml"
        text = example_with("redis://kvgm/0")

        def with_sentinel(master: str, port: int) -> None:
            path.write_text(
                text.replace(
                    "  deadline_ms: 25",
                    f"  deadline_ms: 25\n  sentinel:\n    master: {master}\n"
                    f"    nodes: ['127.0.0.1:{port}']",
                )
            )

        with_sentinel(SENTINEL_MASTER, sentinel.port)
        assert main(["check-config", str(path)]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert f"the sentinels name 127.0.0.1:{primary.port} as the primary of 'kvgm'" in out
        assert (
            f"at the primary of 'kvgm' (Redis Sentinel: 127.0.0.1:{sentinel.port}; database 0)"
            in out
        )
        assert "store: Redis 7." in out
        with_sentinel("nosuch", sentinel.port)
        assert main(["check-config", str(path)]) == 2
        assert "store.sentinel: no sentinel names a primary for 'nosuch'" in capsys.readouterr().err
        with_sentinel(SENTINEL_MASTER, free_port())
        assert main(["check-config", str(path)]) == 2
        err = capsys.readouterr().err
        assert "store.sentinel: no sentinel names a primary for 'kvgm'" in err
        assert "Connection refused" in err or "Error 111" in err, err


async def test_a_hung_sentinel_does_not_stop_the_lookup(
    redis_replica_pair: tuple[RedisServer, RedisServer], tmp_path: Path
) -> None:
    """The first sentinel accepts connections and never answers (a stopped process, a
    dropped route): the store's connection still finds the primary through the second one
    within its connect timeout (each sentinel gets its share of it), and a store decides in
    Redis."""
    from kvgate.store.server import sentinel_for, store_wire

    primary, replica = redis_replica_pair
    async with hung_server() as (hung_port, accepted):
        with start_sentinel(tmp_path / "sentinel", primary, replica) as sentinel:
            config = StoreConfig(
                url=f"redis://{SENTINEL_MASTER}/0",
                heartbeat_s=5.0,
                sentinel={
                    "master": SENTINEL_MASTER,
                    "nodes": [f"127.0.0.1:{hung_port}", f"127.0.0.1:{sentinel.port}"],
                },
            )
            finder = sentinel_for(config, 0.5)
            wire = store_wire(config, finder, connect_timeout_s=0.5, stall_s=5.0)
            try:
                assert await wire.command("PING") == b"PONG"
                assert wire.located == ("127.0.0.1", primary.port)
                assert accepted, "the hung sentinel was asked first"
            finally:
                await wire.aclose()
                await finder.aclose()
            ctl, b, t = core()
            store = RedisStore(config, ctl)
            await store.start(["b"])
            try:
                hold = await store.admit(b, t, "standard", 10)
                assert not isinstance(hold, StoreRefusal), hold
                assert store.state()["connection"]["primary"] == f"127.0.0.1:{primary.port}"
            finally:
                await store.close()


async def test_a_failover_that_keeps_the_old_primary_up_moves_every_store(
    redis_replica_pair: tuple[RedisServer, RedisServer], tmp_path: Path
) -> None:
    """``SENTINEL FAILOVER`` with the old primary alive: the sentinels name the new primary at
    once but turn the old one into a replica only seconds later, and meanwhile it still takes
    writes. A store connected before (A) must not go on deciding there while one that connects
    since (C) decides on the new primary: A asks the sentinels at each heartbeat and moves.
    Held across both stores never exceeds the limit."""
    primary, replica = redis_replica_pair
    limit = 4
    with start_sentinel(tmp_path / "sentinel", primary, replica) as sentinel:
        config = StoreConfig(
            url=f"redis://{SENTINEL_MASTER}/0",
            heartbeat_s=0.25,
            # every decision Redis's: a reply later than the default 25 ms (a loaded machine)
            # would leave it to the fallback, whose share is a bound of its own
            deadline_ms=2000,
            sentinel={"master": SENTINEL_MASTER, "nodes": [f"127.0.0.1:{sentinel.port}"]},
        )
        stores: dict[str, tuple[RedisStore, Named, Named]] = {}
        held: dict[str, list[Any]] = {}

        async def start(name: str) -> None:
            ctl = AdmissionController(backends=1, tenants=1)
            b = Named(ctl.add_backend("b", max_concurrency=64, tokens_per_minute=2**40), "b")
            t = Named(ctl.add_tenant("t", priority="standard", max_concurrency=limit), "t")
            st = RedisStore(config, ctl)
            await st.start(["b"])
            stores[name], held[name] = (st, b, t), []

        async def grab(name: str) -> None:
            st, b, t = stores[name]
            while len(held[name]) < limit:
                hold = st.try_admit(b, t, "standard", 10) or await st.admit(b, t, "standard", 10)
                if isinstance(hold, StoreRefusal):
                    return
                held[name].append(hold)

        await start("A")
        try:
            await grab("A")
            assert len(held["A"]) == limit
            # A's holdings replicated before the failover: Redis replicates asynchronously,
            # and writes a failover loses are the bound of a replica that missed writes
            # (docs/replicas.md), not what this test is about
            key = stores["A"][0]._scope("t", "t").key
            await wait_for(lambda: redis_hget_int(replica, key, "alloc|conc") == limit, 10,
                           "A's holdings on the replica")  # fmt: skip
            sentinel.cli("SENTINEL", "FAILOVER", SENTINEL_MASTER)
            await asyncio.to_thread(wait_primary, sentinel, replica.port)
            await start("C")
            moved_at = None
            began = time.monotonic()
            while time.monotonic() - began < 4.0:
                await grab("C")
                total = sum(len(h) for h in held.values())
                assert total <= limit, f"{total} held of {limit}: {stores['C'][0].state()}"
                a = stores["A"][0].state()["connection"]["primary"]
                if moved_at is None and a == f"127.0.0.1:{replica.port}":
                    moved_at = time.monotonic() - began
                await asyncio.sleep(0.05)
            assert moved_at is not None, "store A never left the old primary"
            assert primary.client().execute_command("ROLE")[0] == "master"  # (still up)
        finally:
            for st, _, _ in stores.values():
                await st.close()


async def test_sentinels_down_the_store_reconnects_to_the_primary_they_last_named(
    redis_replica_pair: tuple[RedisServer, RedisServer], tmp_path: Path
) -> None:
    """Every sentinel down (a rolling restart of them), and the store's connection dropped
    (an idle timeout, ``CLIENT KILL``): the store reconnects to the primary the sentinels last
    named (it checks that the server there is still a primary) and decides there."""
    primary, replica = redis_replica_pair
    ctl, b, t = core()
    with start_sentinel(tmp_path / "sentinel", primary, replica) as sentinel:
        config = StoreConfig(
            url=f"redis://{SENTINEL_MASTER}/0",
            heartbeat_s=5.0,
            sentinel={"master": SENTINEL_MASTER, "nodes": [f"127.0.0.1:{sentinel.port}"]},
        )
        store = RedisStore(config, ctl)
        await store.start(["b"])
        try:
            hold = await store.admit(b, t, "standard", 10)
            assert not isinstance(hold, StoreRefusal), hold
            sentinel.stop()
            wire = store._wire
            opened = wire.connects
            assert primary.client().client_kill_filter(_type="normal", skipme=True) >= 1
            failures = sum(store.failures.values())
            # the give-back's message meets the closed connection and goes again on a new one
            store.release(hold, 10, 10)
            await wait_for(lambda: wire.connects > opened and not store._scope("t", "t").busy,
                           10, "the message sent again on a new connection")  # fmt: skip
            assert sum(store.failures.values()) == failures, store.state()
            assert store.state()["connection"]["primary"] == f"127.0.0.1:{primary.port}"
            assert redis_hget_int(primary, store._scope("t", "t").key, "alloc|conc") == 0
        finally:
            await store.close()


async def test_a_store_that_could_not_start_says_why_in_its_state(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A URL that names a read-only replica: the store starts on its fallback, logs that the
    server is a replica (not that it could not be reached), and its state keeps the reason
    while it retries each heartbeat; once the server is a primary again it shares its limits."""
    redis_server.cli("REPLICAOF", "127.0.0.1", str(free_port()))
    ctl = core()[0]
    store = RedisStore(StoreConfig(url=redis_server.url, heartbeat_s=0.1), ctl)
    try:
        with caplog.at_level("ERROR", logger="kvgate.store"):
            await store.start(["b"])
        assert "is a read-only replica" in caplog.text, caplog.text
        assert store.state()["breaker"] == "open"
        await wait_for(lambda: "loading the library" in (store.state()["last_failure"] or ""),
                       10, "the retry's reason in the state")  # fmt: skip
        assert "ReadOnlyError" in store.state()["last_failure"]
        redis_server.cli("REPLICAOF", "NO", "ONE")
        await wait_for(lambda: store.state()["breaker"] == "closed", 10, "the breaker closed")
    finally:
        await store.close()


async def test_lookups_at_once_keep_every_sentinel_listed(
    redis_replica_pair: tuple[RedisServer, RedisServer], tmp_path: Path
) -> None:
    """Several lookups of the primary at once (the connection's, the heartbeat's check,
    redis-py's pool), the first sentinel down: each puts the one that answered first, and
    none drops a sentinel from the list or lists one twice."""
    from kvgate.store.server import sentinel_for

    primary, replica = redis_replica_pair
    with start_sentinel(tmp_path / "sentinel", primary, replica) as sentinel:
        second = Forwarder(sentinel.port)
        await second.start()
        dead = free_port()
        config = StoreConfig(
            url=f"redis://{SENTINEL_MASTER}/0",
            sentinel={
                "master": SENTINEL_MASTER,
                "nodes": [
                    f"127.0.0.1:{dead}",
                    f"127.0.0.1:{sentinel.port}",
                    f"127.0.0.1:{second.port}",
                ],
            },
        )
        finder = sentinel_for(config, 2.0)
        try:
            found = await asyncio.gather(
                *(finder.discover_master(SENTINEL_MASTER) for _ in range(4))
            )
            assert set(found) == {("127.0.0.1", primary.port)}
            ports = sorted(s.connection_pool.connection_kwargs["port"] for s in finder.sentinels)
            assert ports == sorted([dead, sentinel.port, second.port])
        finally:
            await finder.aclose()
            await second.close()


async def test_closing_a_store_ends_its_question_to_the_sentinels(
    redis_replica_pair: tuple[RedisServer, RedisServer], tmp_path: Path
) -> None:
    """A store closed while its heartbeat's question to the sentinels waits on one that hangs:
    the question ends with the store (nothing reopens the sentinels' connections after)."""
    primary, replica = redis_replica_pair
    async with hung_server() as (hung_port, _):
        with start_sentinel(tmp_path / "sentinel", primary, replica) as sentinel:
            nodes = [f"127.0.0.1:{hung_port}", f"127.0.0.1:{sentinel.port}"]
            config = StoreConfig(
                url=f"redis://{SENTINEL_MASTER}/0",
                heartbeat_s=5.0,
                sentinel={"master": SENTINEL_MASTER, "nodes": nodes},
            )
            store = RedisStore(config, core()[0])
            await store.start(["b"])
            finder = store._sentinel
            # the hung one first again (the start's lookup put the one that answered first)
            finder.sentinels.reverse()
            store.tick()
            task = store._check_task
            assert task is not None
            await asyncio.sleep(0.05)
            assert not task.done()  # waiting on the hung sentinel
            await store.close()
            assert task.done()
            assert store._check_task is None
