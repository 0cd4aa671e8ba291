"""A replica whose breaker opened before it held anything closes it again once Redis answers:
its heartbeat keeps probing Redis, even with nothing held and adaptive limits off (a real ``kvgate serve`` with a store, a real
``redis-server`` that hangs, then answers again; the official ``openai`` client)."""

from __future__ import annotations

import asyncio
import hashlib
import time

import openai
from tests.store.redis_servers import RedisServer
from tests.store.replicas import run_replicas

KEY = "sk-probe"


async def chat(base_url: str, model: str) -> int:
    """One short chat through the gateway; its HTTP status (200, or the refusal's)."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0) as c:
        try:
            await c.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                user="probe",
            )
        except openai.APIStatusError as exc:
            return exc.status_code
    return 200


async def test_the_breaker_closes_again_on_a_replica_that_held_nothing(
    redis_server: RedisServer,
) -> None:
    config = {
        # adaptive limits off: no scale proposal keeps a backend scope heartbeating
        "backends": [
            {
                "name": "sim",
                "models": [{"name": "kvgate-sim-tiny", "context_window": 1024}],
                "max_concurrency": 16,
                "adaptive": {"enabled": False},
            }
        ],
        "tenants": [
            {
                "name": "probe",
                "api_key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
                "max_concurrency": 8,
            }
        ],
        "access_log": {"enabled": False},
        # a deadline a loaded machine's Redis meets once it answers again (the request after
        # the breaker closed must be decided in Redis, not by the fallback)
        "store": {"url": redis_server.url, "heartbeat_s": 0.25, "deadline_ms": 250},
    }
    async with run_replicas(config, n=1) as reps:
        redis_server.pause()  # Redis hangs before this replica ever held anything
        try:
            # each store call passes its deadline, and after 3 failed calls the breaker opens;
            # meanwhile the fallback policy decides: the replica joined the backend's scope as
            # it started, so it knows it is the only live one: its share is the whole limit. A
            # request that finds the scope's message in flight (a heartbeat, with its longer
            # background deadline) gives up before any call of its own fails: so ask until it
            # opened
            deadline = time.monotonic() + 15
            while True:
                assert await chat(reps.base_url(0), reps.model) == 200
                state = await reps.admin_state(0)
                if state["store"]["breaker"] == "open":
                    break
                assert time.monotonic() < deadline, f"breaker still closed: {state['store']}"
            assert state["store"]["degraded_admissions"] >= 1
        finally:
            redis_server.resume()
        # Redis answers again: within a few heartbeats the probe closes the breaker, with no
        # request to carry it; then a request is decided through Redis again
        deadline = time.monotonic() + 15
        while (state := await reps.admin_state(0))["store"]["breaker"] != "closed":
            assert time.monotonic() < deadline, "breaker open 15 s after Redis answered again"
            await asyncio.sleep(0.1)
        degraded = state["store"]["degraded_admissions"]
        assert await chat(reps.base_url(0), reps.model) == 200
        state = await reps.admin_state(0)
        assert state["store"]["breaker"] == "closed"
        assert state["store"]["degraded_admissions"] == degraded
        assert (await reps.sim_state())["by_user"]["probe"]["requests"] >= 1
        # nothing held once the request is done: the core's slots and the store's quota
        tenant = next(t for t in state["tenants"] if t["name"] == "probe")
        assert tenant["in_use"] == 0, tenant
        pools = [
            p
            for key, sc in state["store"]["scopes"].items()
            if key.endswith(":t:probe}")
            for p in sc["pools"].values()
        ]
        assert all(p["in_use"] == 0 for p in pools), pools
