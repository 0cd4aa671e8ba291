"""The replica harness and the load driver, with plain configurations (no shared store): each
gateway is a real ``kvgate serve`` in front of a real ``kvgate sim``, and the simulator's
per-user counts are the judge."""

from __future__ import annotations

import hashlib
from typing import Any

import aiohttp
import openai
import pytest
from tests.gateway.helpers import metric
from tests.store.replicas import drive, run_replicas

KEYS = {"alice": "sk-alice", "bob": "sk-bob", "capped": "sk-capped"}


def tenants(**extra: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()],
            **extra.get(name, {}),
        }
        for name, key in KEYS.items()
    ]


async def chat_via(base_url: str, key: str, user: str, model: str) -> int:
    """One chat through a gateway with the official client; the completion tokens."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as c:
        r = await c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, user=user
        )
    assert r.usage is not None
    return r.usage.completion_tokens


async def test_each_gateway_reaches_the_sim_and_by_user_counts_it() -> None:
    admin = "sk-admin"
    config = {
        "tenants": tenants(),
        "admin_key_sha256": hashlib.sha256(admin.encode()).hexdigest(),
        "access_log": {"enabled": False},
    }
    async with run_replicas(config, n=2, admin_key=admin) as rep:
        assert len(rep.urls) == 2
        assert rep.urls[0] != rep.urls[1]
        a = await chat_via(rep.base_url(0), KEYS["alice"], "alice", rep.model)
        b = await chat_via(rep.base_url(1), KEYS["bob"], "bob", rep.model)
        state = await rep.sim_state()
        assert state["by_user"]["alice"]["requests"] == 1
        assert state["by_user"]["alice"]["completion_tokens"] == a
        assert state["by_user"]["bob"]["requests"] == 1
        assert state["by_user"]["bob"]["completion_tokens"] == b
        # each gateway counted only its own request
        m0, m1 = await rep.metrics(0), await rep.metrics(1)
        assert metric(m0, "kvgate_requests_total", tenant="alice") == 1
        assert metric(m0, "kvgate_requests_total", tenant="bob") is None
        assert metric(m1, "kvgate_requests_total", tenant="bob") == 1
        admin_state = await rep.admin_state(0)
        assert [b["name"] for b in admin_state["backends"]] == ["sim"]
        peaks = await rep.reset_peaks()
        assert peaks["by_user"]["alice"]["peak_running"] == 0
        # every file is the same configuration but for the port
        texts = [rep.config_path(i).read_text().replace(str(rep.ports[i]), "PORT") for i in (0, 1)]
        assert texts[0] == texts[1]


async def test_kill9_stop_cont_restart() -> None:
    async with run_replicas({"access_log": {"enabled": False}}, n=2) as rep:
        pid = rep.gateways[1].proc.pid  # type: ignore[union-attr]
        await rep.kill9(1)
        assert rep.gateways[1] is not None
        assert rep.gateways[1].proc.returncode == -9
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientConnectorError):
                await s.get(rep.url(1) + "/healthz")
        await rep.restart(1)
        assert rep.gateways[1].proc.pid != pid  # type: ignore[union-attr]
        assert await chat_via(rep.base_url(1), "unused", "after-restart", rep.model) >= 1

        rep.stop(0)  # SIGSTOP: the connection is accepted by the kernel, nothing answers
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s:
                with pytest.raises(TimeoutError):
                    await s.get(rep.url(0) + "/healthz")
        finally:
            rep.cont(0)
        assert await chat_via(rep.base_url(0), "unused", "after-cont", rep.model) >= 1
        by_user = (await rep.sim_state())["by_user"]
        assert by_user["after-restart"]["requests"] == 1
        assert by_user["after-cont"]["requests"] == 1


async def test_drive_counts_match_the_engine_and_limits_are_per_gateway_without_a_store() -> None:
    # "capped" may run 1 request at a time on each gateway; with no shared store, two gateways
    # let it run up to 2 at the engine (what the shared store is for)
    config = {"tenants": tenants(capped={"max_concurrency": 1}), "access_log": {"enabled": False}}
    async with run_replicas(config, n=2, sim_args=("--profile", "tiny", "--speed", "10")) as rep:
        loads = await drive(
            rep.urls,
            {"alice": KEYS["alice"], "capped": KEYS["capped"]},
            duration_s=2.0,
            concurrency={"alice": 2, "capped": 4},
            model=rep.model,
            max_tokens=8,
        )
        state = await rep.sim_state()
    alice, capped = loads["alice"], loads["capped"]
    assert alice.counts["200"] > 0
    assert alice.counts["429"] == 0
    assert capped.counts["200"] > 0
    assert capped.counts["429"] > 0  # 4 workers against 1 slot per gateway
    assert capped.retry_after
    assert alice.counts["other"] == capped.counts["other"] == 0, (alice.other, capped.other)
    for name, load in loads.items():
        engine = state["by_user"][name]
        assert engine["requests"] == load.counts["200"]  # refusals never reach the engine
        assert engine["completion_tokens"] == load.completion_tokens
        assert engine["prompt_tokens"] == load.prompt_tokens
        assert len(load.latencies) == len(load.ttfts) == load.counts["200"]
        assert all(0 < t <= lat for t, lat in zip(load.ttfts, load.latencies, strict=True))
    assert 1 <= state["by_user"]["capped"]["peak_in_flight"] <= 2


async def test_a_gateway_that_cannot_start_fails_with_its_stderr() -> None:
    with pytest.raises(RuntimeError, match="max_concurrency"):
        async with run_replicas(
            {"backends": [{"name": "b", "models": [{"name": "m"}], "max_concurrency": -1}]}, n=1
        ):
            pass


async def test_drive_counts_a_dead_gateway_as_other() -> None:
    async with run_replicas({"access_log": {"enabled": False}}, n=2) as rep:
        await rep.kill9(1)
        loads = await drive(rep.urls, {"t": None}, duration_s=0.5, concurrency=1, model=rep.model)
    assert loads["t"].counts["200"] > 0
    assert loads["t"].counts["other"] > 0
    assert set(loads["t"].other) == {"ClientConnectorError"}
