"""The prefill budget through a real gateway in front of the simulator with a slow prefill:
long prompts wait for each other's first token, critical requests do not wait behind them."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import aiohttp
import orjson
from tests.store.replicas import run_replicas

SLOW_PREFILL = ("--profile", "tiny", "--speed", "1", "--prefill-s-per-token", "0.006")


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


CONFIG: dict[str, Any] = {
    "backends": [
        {
            "name": "sim",
            "models": [{"name": "kvgate-sim-tiny", "context_window": 1024}],
            "max_concurrency": 16,
            "prefill_token_budget": 300,
            "adaptive": {"enabled": False},
        }
    ],
    "tenants": [
        {"name": "std", "api_key_sha256": [sha("k-std")], "priority": "standard"},
        {
            "name": "waits",
            "api_key_sha256": [sha("k-waits")],
            "priority": "standard",
            "max_wait_ms": 30000,
        },
        {"name": "crit", "api_key_sha256": [sha("k-crit")], "priority": "critical"},
    ],
    "access_log": {"enabled": False},
}


async def chat(
    url: str, key: str, words: int, max_tokens: int = 4
) -> tuple[int, str | None, float]:
    """A streamed chat with a prompt of about ``words`` tokens: status, refusal reason, and the
    seconds to its first body bytes (or to the refusal)."""
    body = {
        "model": "kvgate-sim-tiny",
        "messages": [{"role": "user", "content": " ".join(["cache"] * words)}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.post(
            url + "/v1/chat/completions",
            data=orjson.dumps(body),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        ) as r:
            first = None
            async for _chunk in r.content.iter_any():
                if first is None:
                    first = time.monotonic() - started
            return (
                r.status,
                r.headers.get("x-kvgate-reject-reason"),
                first if first is not None else time.monotonic() - started,
            )


async def in_prefill(url: str, lane: str, tokens: int) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(500):
            async with s.get(url + "/admin/state") as r:
                state = await r.json()
            if state["prefill"]["sim"][lane] >= tokens:
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"no {tokens} tokens in the {lane} lane")


async def test_long_prompts_wait_for_first_tokens_critical_goes_first() -> None:
    async with run_replicas(CONFIG, n=1, sim_args=SLOW_PREFILL) as reps:
        url = reps.url(0)
        long = asyncio.create_task(chat(url, "k-std", 500))  # ~3 s of prefill
        await in_prefill(url, "in_prefill", 400)
        # another standard prompt does not fit while the first is in prefill: refused at once
        status, reason, _ = await chat(url, "k-std", 100)
        assert (status, reason) == (503, "prefill-tokens")
        # a critical request has its own lane: admitted while the long prompt is in prefill
        status, reason, _ = await chat(url, "k-crit", 20)
        assert status == 200, reason
        state = await reps.admin_state(0)
        assert state["prefill"]["sim"]["refused"] == 1  # only the standard prompt was refused
        # a tenant that may wait waits for the first bytes of the long prompt, then goes
        waiting = asyncio.create_task(chat(url, "k-waits", 100))
        status, _, _ = await long
        assert status == 200
        status, reason, _ = await waiting
        assert status == 200, reason
        state = await reps.admin_state(0)
        assert state["prefill"]["sim"]["in_prefill"] == 0
        assert state["prefill"]["sim"]["critical_in_prefill"] == 0
        text = await reps.metrics(0)
        assert 'kvgate_prefill_token_budget{backend="sim"} 300.0' in text
        assert 'kvgate_rejections_total{backend="sim",reason="prefill-tokens"}' in text
