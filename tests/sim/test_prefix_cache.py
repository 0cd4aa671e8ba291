"""Prefix caching (``--prefix-caching``): shared, reference-counted prompt blocks, vLLM's counters.

Engine tests step :class:`Engine` with a virtual clock; the server test uses the official
``openai`` client and reads ``/metrics`` with kvgate's vLLM adapter.
"""

from __future__ import annotations

import random

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.sim.test_engine import check_invariants, run_until_idle

from kvgate.sim import SimConfig, run_sim
from kvgate.sim.engine import Engine, Sequence, prefix_block_hashes
from kvgate.telemetry.engine_metrics import read_engine_metrics

PREFILL = 0.001


def cfg(**kw: object) -> SimConfig:
    base: dict[str, object] = {
        "kv_blocks": 64,
        "block_size": 16,
        "context_window": 512,
        "max_num_seqs": 16,
        "prefill_s_per_token": PREFILL,
        "decode_base_s": 0.02,
        "decode_per_seq_s": 0.0,
        "prefix_caching": True,
    }
    base.update(kw)
    return SimConfig.from_profile("tiny", **base)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def add(e: Engine, prompt: list[int], out: int, name: bytes) -> Sequence:
    s = e.new_sequence(
        len(prompt),
        out,
        fingerprint=name,
        ignore_eos=True,
        block_hashes=prefix_block_hashes(prompt, e.config.block_size),
    )
    e.add(s)
    return s


def ttft(e: Engine, s: Sequence, now: float = 0.0) -> tuple[float, int]:
    """Seconds until ``s`` produced its first token, and the prompt tokens prefilled meanwhile."""
    start, prefilled = now, 0
    while s.generated == 0:
        r = e.step(now)
        now += r.duration_s
        prefilled += r.prefill_tokens
    return now - start, prefilled


def test_block_hashes_are_chained_over_the_prefix() -> None:
    a = prefix_block_hashes(tokens(100), 16)
    b = prefix_block_hashes(tokens(64) + tokens(36, start=1000), 16)
    assert len(a) == len(b) == 6  # 100 // 16 full blocks; the partial one has no hash
    assert a[:4] == b[:4]
    assert a[4] != b[4]
    assert prefix_block_hashes(b"x" * 130, 16) == prefix_block_hashes(b"x" * 128, 16)
    assert len(prefix_block_hashes(b"x" * 128, 16)) == 2  # 4 bytes a token: 32 tokens


def test_a_repeated_prompt_skips_its_cached_blocks() -> None:
    e = Engine(cfg())
    first = add(e, tokens(100), 3, b"first")
    took_first, prefilled_first = ttft(e, first)
    run_until_idle(e)
    assert e.used_blocks == 0
    assert e.cached_blocks == 6  # kept after the request ended...
    assert e.kv_cache_usage == 0.0  # ...yet free: evictable, as vLLM counts them
    second = add(e, tokens(100), 3, b"second")
    took_second, prefilled_second = ttft(e, second)
    assert (prefilled_first, prefilled_second) == (100, 100 - 96)
    assert took_first - took_second == pytest.approx(PREFILL * 96)
    assert (e.prefix_cache_queries, e.prefix_cache_hits) == (200, 96)
    assert e.prompt_tokens_total == 200  # usage still counts every prompt token


def test_a_full_hit_still_computes_the_last_token() -> None:
    e = Engine(cfg())
    first = add(e, tokens(96), 2, b"a")
    ttft(e, first)
    run_until_idle(e)
    again = add(e, tokens(96), 2, b"b")
    _, prefilled = ttft(e, again)
    assert prefilled == 16  # (96 − 1) // 16 = 5 blocks hit; the last block is recomputed
    assert e.prefix_cache_hits == 80


def test_shared_blocks_are_counted_once_and_reference_counted() -> None:
    e = Engine(cfg())
    shared = tokens(64)  # 4 full blocks
    a = add(e, shared + tokens(36, start=1000), 50, b"a")
    ttft(e, a)
    b = add(e, shared + tokens(36, start=2000), 50, b"b")
    ttft(e, b)
    assert a.block_ids[:4] == b.block_ids[:4]
    assert a.block_ids[4:] != b.block_ids[4:]
    assert e.used_blocks == len(set(a.block_ids) | set(b.block_ids)) == a.blocks + b.blocks - 4
    assert e.prefix_cache_hits == 64
    assert e.abort(a.seq_id)
    assert b.state.value == "running"
    assert e.used_blocks == b.blocks  # the shared blocks stay, held by b
    assert e.abort(b.seq_id)
    assert e.used_blocks == 0


def test_unreferenced_cached_blocks_are_evicted_when_space_is_needed() -> None:
    e = Engine(cfg(kv_blocks=32, context_window=512))
    for i in range(3):  # three different 160-token prompts: 30 blocks cached, none in use
        s = add(e, tokens(160, start=10_000 * i), 1, b"%d" % i)
        ttft(e, s)
        run_until_idle(e)
    assert e.used_blocks == 0
    assert e.cached_blocks == 30
    big = add(e, tokens(400, start=99_000), 1, b"big")  # needs 25 blocks
    ttft(e, big)
    # the free queue, least recently freed first: the 2 never-used blocks, prompt 0's 10 and
    # prompt 1's 10 blocks, then prompt 2's last 3 (a request's tail is freed first)
    assert e.cached_blocks == 30 - (10 + 10 + 3) + 25  # big's own 25 blocks are cached too
    last = add(e, tokens(160, start=20_000), 1, b"last")  # prompt 2 again
    _, prefilled = ttft(e, last)
    assert prefilled == 160 - 7 * 16  # its first 7 blocks were still cached


def test_preempted_lookups_are_not_counted_as_queries() -> None:
    e = Engine(cfg(kv_blocks=16, context_window=256))
    a = add(e, tokens(100), 100, b"a")
    b = add(e, tokens(100, start=500), 100, b"b")
    run_until_idle(e)
    assert a.preemptions + b.preemptions > 0
    assert e.prefix_cache_queries == 200  # one lookup per request, not per recompute


async def test_server_counts_hits_and_the_adapter_reads_true_occupancy() -> None:
    config = SimConfig.from_profile("tiny", prefix_caching=True, speed=50.0)
    prompt = "The same long system prompt for every request. " * 40  # ~480 tokens
    async with (
        run_sim(config) as sim,
        openai.AsyncOpenAI(base_url=sim.base_url, api_key="unused", max_retries=0) as c,
        aiohttp.ClientSession() as http,
    ):
        for _ in range(2):
            r = await c.completions.create(model=config.model, prompt=prompt, max_tokens=4)
            assert r.usage is not None
        expected = r.usage.prompt_tokens
        async with http.get(sim.url + "/metrics") as resp:
            text = await resp.text()
        samples = {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples}
        assert samples["vllm:prefix_cache_queries_total"].value == 2 * expected
        hits = samples["vllm:prefix_cache_hits_total"].value
        assert hits == (expected - 1) // 16 * 16
        assert samples["vllm:cache_config_info"].labels["enable_prefix_caching"] == "True"
        async with http.get(sim.url + "/sim/state") as resp:
            state = await resp.json()
        assert state["used_blocks"] == 0
        assert state["cached_blocks"] == expected // 16
        reading = read_engine_metrics(text, "vllm")
        assert reading.kv_usage == 0.0  # cached but unreferenced blocks are free


def test_shared_prefixes_under_preemption_lose_nothing() -> None:
    """Many prompts sharing prefixes, a small cache, chunked prefill, preemptions: every token is
    delivered, the blocks in use are exactly those the running sequences hold, and at the end
    nothing is in use (only evictable cached blocks remain)."""
    rng = random.Random(11)
    e = Engine(cfg(kv_blocks=48, context_window=512, max_num_batched_tokens=96))
    prefixes = [tokens(rng.randint(16, 200), start=100_000 * k) for k in range(3)]
    seqs = []
    for i in range(30):
        prompt = rng.choice(prefixes) + tokens(rng.randint(1, 60), start=1_000_000 + 1000 * i)
        seqs.append(add(e, prompt, rng.randint(1, 80), b"%d" % i))
    now, events = 0.0, []
    for _ in range(20_000):
        if not e.has_work:
            break
        r = e.step(now)
        assert r.scheduled_tokens <= 96
        check_invariants(e)
        now += r.duration_s
        events.extend(r.events)
    assert not e.has_work
    assert e.preemptions > 0
    assert e.prefix_cache_hits > 0
    for s in seqs:
        assert sum(1 for ev in events if ev.seq_id == s.seq_id) == s.max_tokens
    assert e.used_blocks == 0
    assert 0 < e.cached_blocks <= e.free_blocks == e.config.kv_blocks
