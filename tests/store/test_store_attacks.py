"""Adversarial checks of the shared store: clients that give up while a decision is in Redis,
Redis answering errors or nothing, limits reloaded on some replicas, odd configuration. Each
runs real gateways (``kvgate serve``) against a real ``redis-server`` and the simulator, whose
own count of what it ran per tenant is the judge; Redis's books (``alloc`` against the sum of
the replicas' quotas) and ``/admin/state`` show that nothing stays held once the load ends."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from tests.gateway.helpers import metric
from tests.store.redis_servers import RedisServer
from tests.store.replicas import drive, run_replicas
from tests.store.test_replica_faults import (
    KEY_A,
    KEY_B,
    SLOW_SIM,
    config,
    hold,
    hold_within,
    post_chat,
    redis_pool,
    until,
    user,
)

pytestmark = pytest.mark.slow


async def give_up_after(url: str, key: str, tenant: str, model: str, after_s: float) -> str:
    """One streamed request whose client disconnects after ``after_s`` seconds unless it was
    answered before; ``"gave up"`` or the status."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "impatient"}],
        "max_tokens": 4,
        "stream": True,
        "user": tenant,
    }
    timeout = aiohttp.ClientTimeout(total=after_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as s,
            s.post(
                url + "/v1/chat/completions",
                data=orjson.dumps(body),
                headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            ) as r,
        ):
            await r.read()
            return str(r.status)
    except TimeoutError:
        return "gave up"


def pools_in_use(state: dict[str, Any]) -> dict[str, int]:
    """``{scope/pool: units its requests hold}`` from one replica's ``/admin/state``."""
    out = {}
    for key, sc in state["store"]["scopes"].items():
        for name, p in sc["pools"].items():
            out[f"{key}/{name}"] = p["in_use"]
    return out


async def test_a_client_gone_while_its_admission_waits_in_redis_leaves_nothing_held(
    redis_server: RedisServer,
) -> None:
    """A request whose tenant part is decided in Redis (near the tenant's limit) while its
    backend part came from the replica's own quota: its client disconnects while Redis has
    not answered. Everything it took goes back: the backend's four slots all run at the engine
    afterwards, no reservation is counted as leaked, and Redis holds nothing once idle."""
    cfg = with_backend(config({"url": redis_server.url, "deadline_ms": 4000}, a_conc=2), 4)
    async with run_replicas(cfg, n=2, sim_args=SLOW_SIM) as reps:
        # a runs one request on replica 1; replica 0 has never held any of a (its next
        # admission of a is decided in Redis) but holds headroom of the backend's slots
        held = await hold(reps, 1, "a", KEY_A, 1)
        held += await hold(reps, 0, "b", KEY_B, 1)

        async def backend_quota() -> bool:
            st = (await reps.admin_state(0))["store"]["scopes"].get("{kvg:b:sim}")
            pool = st["pools"]["burst"] if st is not None else {"quota": 0, "in_use": 0}
            return bool(pool["quota"] > pool["in_use"])

        await until(backend_quota, 10, "replica 0 holds backend headroom")
        # Redis stalls writes: the decision of a's request waits; its client gives up
        paused = asyncio.get_running_loop().run_in_executor(
            None, lambda: redis_server.cli("CLIENT", "PAUSE", "2500", "WRITE")
        )
        await paused
        outcomes = await asyncio.gather(
            *(give_up_after(reps.url(0), KEY_A, "a", reps.model, 0.6) for _ in range(2))
        )
        assert "gave up" in outcomes, outcomes
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)

        async def idle() -> bool:
            by_user = (await reps.sim_state())["by_user"]
            return all(by_user.get(t, {}).get("in_flight", 0) == 0 for t in ("a", "b"))

        await until(idle, 20, "every request ended at the engine")
        seen: list[dict[str, int]] = []

        async def released() -> bool:
            seen.append(pools_in_use(await reps.admin_state(0)))
            return not any(seen[-1].values())

        try:
            await until(released, 15, "replica 0's store pools hold no request")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {seen[-1]}") from None
        # the engine is the judge: the backend's four slots all run again through replica 0
        tasks = await hold_within(reps, 0, "b", KEY_B, 4, within=5)
        assert (await user(reps, "b"))["in_flight"] == 4
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        text = await reps.metrics(0)
        assert not metric(text, "kvgate_reservation_leaks_total"), "a reservation leaked"

        async def books_empty() -> bool:
            alloc, quotas = redis_pool(redis_server, "{kvg:b:sim}", "burst")
            a_alloc, a_quotas = redis_pool(redis_server, "{kvg:t:a}", "conc")
            return alloc == quotas == 0 and a_alloc == a_quotas == 0

        await until(books_empty, 15, "Redis's books back to 0 once idle")


def with_backend(cfg: dict[str, Any], slots: int) -> dict[str, Any]:
    """``cfg`` with one backend ``sim`` of ``slots`` concurrent requests serving the
    simulator's tiny model (the harness points it at the simulator)."""
    model = {"name": "kvgate-sim-tiny", "context_window": 1024}
    return {**cfg, "backends": [{"name": "sim", "models": [model], "max_concurrency": slots}]}


async def test_function_flush_mid_load_keeps_the_limit_exact(redis_server: RedisServer) -> None:
    """``FUNCTION FLUSH`` (or a Redis restarted without its data) while a tenant hammers its
    limit through three replicas: a call that finds the library missing did not run, so the
    replica loads the library and sends the same message again. Nothing falls back to the
    per-replica share (which would admit above the limit while the other replicas still use
    their quotas): the engine never runs more than the limit."""
    store = {"url": redis_server.url}
    async with run_replicas(config(store)) as reps:
        load = asyncio.create_task(
            drive(reps.urls, {"a": KEY_A}, 5.0, 18, model=reps.model, max_tokens=24)
        )
        loop = asyncio.get_running_loop()
        for _ in range(8):
            await asyncio.sleep(0.4)
            await loop.run_in_executor(None, lambda: redis_server.cli("FUNCTION", "FLUSH"))
        loads = await load
        a = await user(reps, "a")
        assert a["peak_in_flight"] <= 6, a
        assert loads["a"].counts["200"] > 0, loads["a"]
        assert loads["a"].counts["other"] == 0, loads["a"]
        states = [(await reps.admin_state(i))["store"] for i in range(3)]
        assert sum(s["degraded_admissions"] for s in states) == 0, states
        assert all(s["breaker"] == "closed" for s in states), states


async def test_redis_refusing_writes_longer_than_a_lease_reaps_no_live_replica(
    redis_server: RedisServer,
) -> None:
    """Redis answers every write with an OOM error (``maxmemory 1``, ``noeviction``) for
    longer than a lease while replicas 0 and 1 run the tenant's whole limit (``strict``: each
    admits only what it held). When Redis accepts writes again, the first replica to reach it
    must not reap the others for a silence that was Redis's: their requests still run, so the
    tenant's limit, granted again to a third replica, would run twice at the engine."""
    store = {"url": redis_server.url, "on_failure": "strict"}
    cfg = with_backend(config(store, a_conc=4), 64)
    # no adaptive scale: replica 2, idle, makes no call to Redis before it is asked for a's
    cfg["backends"][0]["adaptive"] = {"enabled": False}
    async with run_replicas(cfg, sim_args=SLOW_SIM) as reps:
        held = await hold_within(reps, 0, "a", KEY_A, 2) + await hold_within(reps, 1, "a", KEY_A, 2)
        await reps.reset_peaks()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(
            None, lambda: redis_server.cli("CONFIG", "SET", "maxmemory", "1")
        )

        async def breakers_open() -> bool:
            sts = [(await reps.admin_state(i))["store"] for i in range(3)]
            return all(s["breaker"] == "open" for s in sts[:2])

        await until(breakers_open, 10, "replicas 0 and 1 see Redis refusing writes")
        await asyncio.sleep(1.0)  # longer than a lease (0.75 s): every lease ran out in Redis
        await loop.run_in_executor(
            None, lambda: redis_server.cli("CONFIG", "SET", "maxmemory", "0")
        )
        # replica 2 asks for a's slots, again and again, as Redis comes back
        extra: list[asyncio.Task[int]] = []
        give_up = loop.time() + 4.0
        while loop.time() < give_up:
            task = asyncio.create_task(post_chat(reps.url(2), KEY_A, "a", 300, reps.model))
            await asyncio.sleep(0.1)
            if not task.done():
                extra.append(task)
        a = await user(reps, "a")
        for t in held + extra:
            t.cancel()
        await asyncio.gather(*held, *extra, return_exceptions=True)
        assert a["peak_in_flight"] <= 4, a
        logs = b"".join(reps.stderr(i) for i in range(3))
        assert b"OutOfMemoryError" in logs, logs.decode(errors="replace")


async def impatient_load(
    urls: list[str], key: str, tenant: str, model: str, workers: int, duration_s: float
) -> dict[str, int]:
    """``workers`` clients of ``tenant`` sending streamed requests round-robin over ``urls``
    for ``duration_s`` seconds, each giving up after a random 0.02..0.6 s (while it waits for
    admission, or mid-stream); outcomes counted (``gave up``, ``"200"``, ``"429"``...)."""
    import random

    rng = random.Random(7)
    loop = asyncio.get_running_loop()
    stop = loop.time() + duration_s
    counts: dict[str, int] = {}
    turn = iter(range(10**9))

    async def worker() -> None:
        while loop.time() < stop:
            url = urls[next(turn) % len(urls)]
            out = await give_up_after(url, key, tenant, model, rng.uniform(0.02, 0.6))
            counts[out] = counts.get(out, 0) + 1
            if out != "200":
                await asyncio.sleep(0.01)

    await asyncio.gather(*(worker() for _ in range(workers)))
    return counts


async def test_a_hostile_tenant_with_impatient_clients_leaves_the_books_balanced(
    redis_server: RedisServer,
) -> None:
    """A tenant hammers its concurrency and token limits through three replicas with many
    clients that disconnect at random (while waiting for a decision, or mid-stream), with a
    polite tenant beside it. The engine never runs more than the limit; once the load ends
    every replica's pools hold nothing, Redis's allocation equals the sum of the quotas and
    drops to 0 within a few heartbeats, and no reservation leaked."""
    store = {"url": redis_server.url}
    cfg = config(store)
    cfg["tenants"][0]["tokens_per_minute"] = 60_000
    async with run_replicas(cfg) as reps:
        polite = asyncio.create_task(
            drive(reps.urls, {"b": KEY_B}, 6.0, 3, model=reps.model, max_tokens=24)
        )
        counts = await impatient_load(reps.urls, KEY_A, "a", reps.model, 30, 6.0)
        loads = await polite
        assert counts.get("gave up", 0) > 0, counts
        assert counts.get("200", 0) > 0, counts
        assert set(counts) <= {"gave up", "200", "429", "503"}, counts
        assert loads["b"].counts["other"] == 0, loads["b"]
        a = await user(reps, "a")
        assert a["peak_in_flight"] <= 6, a

        async def idle() -> bool:
            by_user = (await reps.sim_state())["by_user"]
            return all(by_user.get(t, {}).get("in_flight", 0) == 0 for t in ("a", "b"))

        await until(idle, 20, "every request ended at the engine")
        seen: list[Any] = []

        async def balanced() -> bool:
            held = [pools_in_use(await reps.admin_state(i)) for i in range(3)]
            books = {
                (scope, pool): redis_pool(redis_server, scope, pool)
                for scope, pool in (
                    ("{kvg:t:a}", "conc"),
                    ("{kvg:t:b}", "conc"),
                    ("{kvg:b:sim}", "burst"),
                    ("{kvg:b:sim}", "inflight"),
                )
            }
            seen[:] = [held, books]
            return not any(v for h in held for v in h.values()) and all(
                alloc == quotas == 0 for alloc, quotas in books.values()
            )

        try:
            await until(balanced, 10, "pools and Redis's books back to 0")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {seen}") from None
        for i in range(3):
            text = await reps.metrics(i)
            assert not metric(text, "kvgate_reservation_leaks_total"), f"replica {i} leaked"
            assert b"Traceback" not in reps.stderr(i), reps.stderr(i).decode(errors="replace")


async def reload_with(reps: Any, i: int, tenants: list[dict[str, Any]]) -> None:
    """Rewrites gateway ``i``'s file with ``tenants`` and reloads it (SIGHUP); waits for its
    log to say so."""
    import signal

    import yaml

    path = reps.config_path(i)
    data = yaml.safe_load(path.read_text())
    data["tenants"] = tenants
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    before = reps.stderr(i).count(b"configuration reloaded")
    reps.gateways[i].proc.send_signal(signal.SIGHUP)

    async def reloaded() -> bool:
        return reps.stderr(i).count(b"configuration reloaded") > before

    await until(reloaded, 10, f"gateway {i} reloaded")


async def test_limits_reloaded_on_one_replica_then_all_converge(
    redis_server: RedisServer,
) -> None:
    """SIGHUP with a's concurrency lowered from 6 to 2 below what runs, b removed and c added:
    first on one replica (the others still admit by the old limit: never above it), then on
    all (once what ran drains, the engine never runs more than the new limit). No replica
    fails; b's key stops working, c's works through every replica."""
    from tests.store.test_replica_faults import sha

    store = {"url": redis_server.url}
    cfg = config(store)
    async with run_replicas(cfg) as reps:
        urls = reps.urls
        await drive(urls, {"a": KEY_A}, 1.5, 12, model=reps.model, max_tokens=24)
        lowered = [dict(cfg["tenants"][0], max_concurrency=2)]
        lowered.append({"name": "c", "api_key_sha256": [sha("key-c")], "max_concurrency": 3})
        await reload_with(reps, 0, lowered)
        await reps.reset_peaks()
        loads = await drive(urls, {"a": KEY_A}, 2.5, 12, model=reps.model, max_tokens=24)
        assert (await user(reps, "a"))["peak_in_flight"] <= 6
        assert loads["a"].counts["other"] == 0, loads["a"]
        for i in (1, 2):
            await reload_with(reps, i, lowered)
        await drive(urls, {"a": KEY_A}, 1.0, 12, model=reps.model, max_tokens=24)
        await reps.reset_peaks()
        loads = await drive(
            urls, {"a": KEY_A, "c": "key-c"}, 3.0, {"a": 12, "c": 6},
            model=reps.model, max_tokens=24,
        )  # fmt: skip
        a, c = await user(reps, "a"), await user(reps, "c")
        assert a["peak_in_flight"] <= 2, a
        assert c["peak_in_flight"] <= 3, c
        assert loads["a"].counts["200"] > 0, loads["a"]
        assert loads["c"].counts["200"] > 0, loads["c"]
        assert loads["c"].counts["other"] == 0, loads["c"]
        gone = await drive(urls, {"b": KEY_B}, 0.3, 1, model=reps.model)
        assert gone["b"].counts["200"] == 0, gone["b"]
        for i in range(3):
            assert reps.gateways[i].alive
            assert b"Traceback" not in reps.stderr(i), reps.stderr(i).decode(errors="replace")

        async def books() -> bool:
            alloc, quotas = redis_pool(redis_server, "{kvg:t:a}", "conc")
            return alloc == quotas == 0

        await until(books, 10, "a's books back to 0 once idle")
