"""kvgate's engine adapters read the simulator's KV usage as its true occupancy.

For each vLLM metric naming the simulator speaks (``--metric-names v1|v0|both``), every adapter
that applies (``vllm``, ``vllm-v0``, ``auto``) parses the simulator's ``/metrics`` with
:func:`kvgate.telemetry.engine_metrics.read_engine_metrics`, and the reading must equal the
engine's own ``/sim/state`` (used blocks ÷ total blocks, running, waiting, capacity) at several
load levels: idle, a few decoding requests, a long prompt part-way through its chunked prefill,
and a cache nearly full. The simulator's ``GET /slots`` (llama.cpp's shape) is read with
:func:`~kvgate.telemetry.engine_metrics.parse_llamacpp_slots` too: its tokens in use must be the
tokens whose KV the running sequences hold (llama.cpp has no blocks, so that is a token count,
not the block ratio).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from kvgate.sim import SimConfig, run_sim
from kvgate.sim.server import RunningSim
from kvgate.telemetry.engine_metrics import (
    EngineReading,
    SlotsSnapshot,
    parse_llamacpp_slots,
    read_engine_metrics,
)

ADAPTERS = {
    "v1": {"vllm": "vllm:kv_cache_usage_perc", "auto": "vllm:kv_cache_usage_perc"},
    "v0": {"vllm-v0": "vllm:gpu_cache_usage_perc", "auto": "vllm:gpu_cache_usage_perc"},
    # both names carry the same value; every vLLM adapter prefers the V1 one
    "both": {
        "vllm": "vllm:kv_cache_usage_perc",
        "vllm-v0": "vllm:kv_cache_usage_perc",
        "auto": "vllm:kv_cache_usage_perc",
    },
}


def config(metric_names: str) -> SimConfig:
    # slow steps (a 64-token chunk takes ~0.25 s) so a state holds still between two scrapes
    return SimConfig.from_profile(
        "tiny",
        metric_names=metric_names,
        max_num_batched_tokens=64,
        prefill_s_per_token=0.004,
        decode_base_s=0.05,
        decode_per_seq_s=0.001,
    )


async def steady(
    http: aiohttp.ClientSession, sim: RunningSim, adapters: dict[str, str]
) -> tuple[dict[str, Any], dict[str, EngineReading], SlotsSnapshot]:
    """A ``/sim/state``, the adapters' readings of a ``/metrics`` and the parsed ``/slots``
    scraped while the state did not change (the state read before and after the scrapes is the
    same); bounded retries."""
    for _ in range(500):
        async with http.get(sim.url + "/sim/state") as r:
            before = await r.json()
        async with http.get(sim.url + "/metrics") as r:
            text = await r.text()
        async with http.get(sim.url + "/slots") as r:
            slots = parse_llamacpp_slots(await r.read())
        async with http.get(sim.url + "/sim/state") as r:
            after = await r.json()
        if before == after:
            readings = {name: read_engine_metrics(text, name) for name in adapters}
            return before, readings, slots
        await asyncio.sleep(0.005)
    raise AssertionError("the engine never held still between two scrapes")


def check(
    state: dict[str, Any],
    readings: dict[str, EngineReading],
    slots: SlotsSnapshot,
    adapters: dict[str, str],
) -> None:
    assert slots.busy == state["num_running"]
    assert slots.tokens_in_use == sum(r["computed"] for r in state["running"])
    occupancy = state["used_blocks"] / state["kv_blocks"]
    for name, reading in readings.items():
        assert reading.kv_usage == pytest.approx(occupancy, abs=1e-12), name
        assert reading.sources["kv_usage"] == adapters[name]
        assert reading.running == state["num_running"], name
        assert reading.waiting == state["num_waiting"], name
        assert reading.kv_capacity_tokens == state["kv_blocks"] * state["block_size"], name


async def wait_state(
    http: aiohttp.ClientSession, sim: RunningSim, predicate: Callable[[dict[str, Any]], bool]
) -> None:
    for _ in range(2000):
        async with http.get(sim.url + "/sim/state") as r:
            if predicate(await r.json()):
                return
        await asyncio.sleep(0.005)
    raise AssertionError("the engine never reached the expected state")


def streamer(http: aiohttp.ClientSession, sim: RunningSim) -> Callable[[int, int], Awaitable[None]]:
    async def stream(prompt_tokens: int, max_tokens: int) -> None:
        body = {
            "prompt": "word " * (prompt_tokens * 4 // 5),  # bytes / 4 = prompt_tokens
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        async with http.post(sim.base_url + "/completions", json=body) as r:
            async for _ in r.content:
                pass

    return stream


@pytest.mark.parametrize("metric_names", ["v1", "v0", "both"])
async def test_adapters_read_the_true_occupancy(metric_names: str) -> None:
    adapters = ADAPTERS[metric_names]
    tasks: list[asyncio.Task[None]] = []
    async with run_sim(config(metric_names)) as sim, aiohttp.ClientSession() as http:
        stream = streamer(http, sim)
        try:
            # idle
            state, readings, slots = await steady(http, sim, adapters)
            assert state["used_blocks"] == 0
            check(state, readings, slots, adapters)
            # a few decoding requests
            tasks += [asyncio.create_task(stream(40, 800)) for _ in range(2)]
            await wait_state(http, sim, lambda s: s["num_running"] == 2 and not s["num_prefilling"])
            state, readings, slots = await steady(http, sim, adapters)
            assert 0 < state["used_blocks"] < state["kv_blocks"] / 4
            check(state, readings, slots, adapters)
            # a long prompt part-way through its chunked prefill
            tasks.append(asyncio.create_task(stream(900, 100)))
            await wait_state(
                http,
                sim,
                lambda s: any(r["prefilling"] and r["computed"] >= 128 for r in s["running"]),
            )
            state, readings, slots = await steady(http, sim, adapters)
            (mid,) = [r for r in state["running"] if r["prefilling"]]
            # part-way through its prompt, it holds blocks for what it has computed
            assert 128 <= mid["computed"] < 900
            assert mid["blocks"] == math.ceil(mid["computed"] / 16) < math.ceil(900 / 16)
            check(state, readings, slots, adapters)
            # a cache nearly full
            tasks += [asyncio.create_task(stream(200, 400)) for _ in range(6)]
            await wait_state(http, sim, lambda s: s["used_blocks"] >= 0.75 * s["kv_blocks"])
            state, readings, slots = await steady(http, sim, adapters)
            check(state, readings, slots, adapters)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await t
        # every client went away: the engine holds nothing, and the adapters read 0
        await wait_state(http, sim, lambda s: s["used_blocks"] == 0 and not s["num_waiting"])
        state, readings, slots = await steady(http, sim, adapters)
        check(state, readings, slots, adapters)
