"""Chunked prefill in the sans-IO engine (vLLM V1's per-step token budget), with a virtual clock.

Each test steps :class:`Engine` by hand and adds up the step durations it returns, so every time
here is exact and no test sleeps.
"""

from __future__ import annotations

import math
import random

import pytest
from tests.sim.test_engine import check_invariants, run_until_idle

from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine, FailEvent, Sequence, StepResult, TokenEvent
from kvgate.sim.profiles import PROFILES

PREFILL = 0.001  # s per prompt token
BASE = 0.02  # s per step
PER_SEQ = 0.002  # s per produced token


def cfg(**kw: object) -> SimConfig:
    base: dict[str, object] = {
        "kv_blocks": 256,
        "block_size": 16,
        "context_window": 2048,
        "max_num_seqs": 16,
        "prefill_s_per_token": PREFILL,
        "decode_base_s": BASE,
        "decode_per_seq_s": PER_SEQ,
        "max_num_batched_tokens": 64,
    }
    base.update(kw)
    return SimConfig.from_profile("tiny", **base)


def seq(e: Engine, prompt: int, out: int, name: bytes) -> Sequence:
    s = e.new_sequence(prompt, out, fingerprint=name, ignore_eos=True)
    e.add(s)
    return s


def tokens_of(r: StepResult, s: Sequence) -> int:
    return sum(1 for ev in r.events if isinstance(ev, TokenEvent) and ev.seq_id == s.seq_id)


def start_decoding(e: Engine, out: int = 1000) -> tuple[Sequence, float]:
    """A short request that is already decoding; returns it and the clock after its prefill."""
    d = seq(e, 10, out, b"decoder")
    r = e.step(0.0)
    assert tokens_of(r, d) == 1
    return d, r.duration_s


def test_a_long_prompt_alone_is_prefilled_over_ceil_prompt_over_budget_steps() -> None:
    e = Engine(cfg())
    long_ = seq(e, 500, 4, b"long")
    chunks, now = [], 0.0
    while long_.generated == 0:
        r = e.step(now)
        now += r.duration_s
        check_invariants(e)
        chunks.append(r.prefill_tokens)
        assert r.scheduled_tokens <= 64
        if long_.generated == 0:  # mid-prompt: it holds blocks for what it has computed
            assert long_.prefilling
            assert long_.blocks == math.ceil(long_.computed / 16)
            assert e.used_blocks == long_.blocks
            assert not r.events
    assert len(chunks) == math.ceil(500 / 64) == 8
    assert chunks == [64] * 7 + [500 - 7 * 64]
    # TTFT: the same prefill time as a whole prefill, plus one step base per extra step
    assert now == pytest.approx(PREFILL * 500 + 8 * BASE + PER_SEQ)
    assert e.prompt_tokens_total == 500  # counted once, when its prefill ended


def test_a_long_prompt_no_longer_stalls_running_decodes() -> None:
    e = Engine(cfg())
    d, now = start_decoding(e)
    long_ = seq(e, 500, 4, b"long")
    steps, gaps = 0, []
    while long_.generated == 0:
        r = e.step(now)
        check_invariants(e)
        assert tokens_of(r, d) == 1  # the decode goes on at every step of the prefill
        assert r.scheduled_tokens <= 64
        gaps.append(r.duration_s)
        now += r.duration_s
        steps += 1
    # the decoder takes one token of each step's budget: 63 prompt tokens per step
    assert steps == math.ceil(500 / 63)
    bound = PREFILL * 64 + BASE + PER_SEQ * 2  # one step of the full budget
    assert max(gaps) <= bound + 1e-12
    whole = Engine(cfg(chunked_prefill=False, max_num_batched_tokens=None))
    d2, now2 = start_decoding(whole)
    seq(whole, 500, 4, b"long")
    r = whole.step(now2)
    assert tokens_of(r, d2) == 1
    # without chunked prefill the decoder's next token waits for the whole prompt
    assert r.duration_s == pytest.approx(PREFILL * 500 + BASE + PER_SEQ * 2)
    assert r.duration_s > 5 * bound


def test_ttft_of_a_long_prompt_grows_with_the_steps_it_takes() -> None:
    def ttft(budget: int, prompt: int) -> tuple[float, int]:
        e = Engine(cfg(max_num_batched_tokens=budget))
        _, now = start_decoding(e)
        start, steps = now, 0
        long_ = seq(e, prompt, 4, b"long")
        while long_.generated == 0:
            now += e.step(now).duration_s
            steps += 1
        return now - start, steps

    for budget in (64, 128, 512):
        took, steps = ttft(budget, 1000)
        assert steps == math.ceil(1000 / (budget - 1))
        # prefill of the whole prompt, one base per step, the decoder's token at each step and
        # the long prompt's own first token
        assert took == pytest.approx(PREFILL * 1000 + steps * (BASE + PER_SEQ) + PER_SEQ)
    assert ttft(64, 1000)[0] > ttft(512, 1000)[0]


def test_budget_is_never_exceeded_and_every_token_is_delivered() -> None:
    rng = random.Random(5)
    for budget in (32, 100, 257):
        e = Engine(
            cfg(
                max_num_batched_tokens=budget,
                kv_blocks=64,
                context_window=1024,
                on_overflow="preempt",
            )
        )
        seqs = [seq(e, rng.randint(1, 600), rng.randint(1, 40), b"%d" % i) for i in range(24)]
        now, events = 0.0, []
        for _ in range(20_000):
            if not e.has_work:
                break
            r = e.step(now)
            assert r.scheduled_tokens <= budget
            assert len(e.running) <= e.config.max_num_seqs
            check_invariants(e)
            now += r.duration_s
            events.extend(r.events)
        assert not e.has_work
        assert e.preemptions > 0  # the cache (1,024 tokens) is far smaller than the load
        for s in seqs:
            mine = [ev for ev in events if ev.seq_id == s.seq_id]
            assert len(mine) == s.max_tokens  # preempted ones recompute, nothing sent twice
        assert e.used_blocks == 0
        assert e.prompt_tokens_total == sum(s.prompt_tokens for s in seqs)


def test_preemption_still_happens_when_prefill_chunks_run_out_of_blocks() -> None:
    # 16 blocks × 16 = 256 KV tokens; two prompts of 120 fill them as they decode
    e = Engine(cfg(kv_blocks=16, context_window=256, max_num_batched_tokens=64))
    a = seq(e, 120, 100, b"a")
    b = seq(e, 120, 100, b"b")
    events, _, _ = run_until_idle(e)
    assert e.preemptions > 0
    assert a.preemptions + b.preemptions > 0
    assert e.peak_used_blocks == 16
    for s in (a, b):
        assert sum(1 for ev in events if ev.seq_id == s.seq_id) == 100


def test_a_partly_prefilled_prompt_can_be_preempted_and_restarts_from_zero() -> None:
    # the decoder holds most of the cache; the long prompt's next chunk does not fit
    e = Engine(cfg(kv_blocks=20, context_window=320, max_num_batched_tokens=64))
    d, now = start_decoding(e, out=300)  # 10-token prompt, decoding
    for _ in range(150):  # the decoder grows to 160 tokens: 10 blocks
        now += e.step(now).duration_s
    long_ = seq(e, 300, 4, b"long")
    while not e.preemptions:
        now += e.step(now).duration_s
        check_invariants(e)
    assert long_.preemptions == 1  # the newest running sequence is the victim
    assert long_.computed == 0
    assert long_.blocks == 0
    assert e.waiting[0] is long_
    assert d.blocks > 0


def test_oom_mode_still_crashes_when_chunks_run_out_of_blocks() -> None:
    e = Engine(cfg(kv_blocks=16, context_window=256, on_overflow="oom", restart_seconds=1.0))
    seqs = [seq(e, 120, 100, b"%d" % i) for i in range(3)]
    now, failed = 0.0, []
    for _ in range(1000):
        r = e.step(now)
        failed = [ev for ev in r.events if isinstance(ev, FailEvent)]
        if failed:
            break
        check_invariants(e)
        now += r.duration_s
    assert {ev.seq_id for ev in failed} == {s.seq_id for s in seqs}
    assert e.ooms == 1
    assert e.preemptions == 0
    assert e.used_blocks == 0


def test_no_chunked_prefill_keeps_the_old_whole_prefill_timing() -> None:
    """Without chunked prefill (and no budget given) every admissible prompt is prefilled whole
    in the step that admits it: the step costs all of their prefill time."""
    e = Engine(cfg(chunked_prefill=False, max_num_batched_tokens=None))
    assert e.config.token_budget is None
    a, b = seq(e, 700, 3, b"a"), seq(e, 900, 3, b"b")
    r = e.step(0.0)
    assert (a.generated, b.generated) == (1, 1)
    assert r.prefill_tokens == r.scheduled_tokens == 1600
    assert r.duration_s == pytest.approx(PREFILL * 1600 + BASE + 2 * PER_SEQ)
    r = e.step(r.duration_s)
    assert r.prefill_tokens == 0
    assert r.duration_s == pytest.approx(BASE + 2 * PER_SEQ)


def test_no_chunked_prefill_with_a_budget_admits_whole_prompts_that_fit() -> None:
    e = Engine(cfg(chunked_prefill=False, max_num_batched_tokens=2048))
    a, b, c = seq(e, 1000, 3, b"a"), seq(e, 1000, 3, b"b"), seq(e, 100, 3, b"c")
    r = e.step(0.0)
    # a and b fill 2,000 of 2,048 tokens; c (100) waits although it would fit a chunk
    assert (a.generated, b.generated, c.generated) == (1, 1, 0)
    assert r.scheduled_tokens == 2000
    r = e.step(r.duration_s)
    assert c.generated == 1
    assert r.scheduled_tokens == 2 + 100


def test_several_prompts_share_one_step_budget() -> None:
    e = Engine(cfg(max_num_batched_tokens=256))
    a, b, c = seq(e, 100, 3, b"a"), seq(e, 100, 3, b"b"), seq(e, 100, 3, b"c")
    r = e.step(0.0)
    assert (a.generated, b.generated, c.generated) == (1, 1, 0)
    assert (c.computed, c.prefilling) == (56, True)  # the budget left: a first chunk
    assert r.scheduled_tokens == 256
    r = e.step(r.duration_s)
    assert c.generated == 1
    assert r.scheduled_tokens == 2 + 44


def test_profiles_default_budgets_follow_vllm() -> None:
    assert PROFILES["h800x8-llama3-70b"].max_num_batched_tokens == 8192
    assert PROFILES["l4-llama3-8b"].max_num_batched_tokens == 2048
    assert SimConfig.from_profile("h800x8-llama3-70b").token_budget == 8192
    assert SimConfig.from_profile("tiny").token_budget == 2048
    assert SimConfig.from_profile("tiny", chunked_prefill=False).token_budget is None


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be ≥ 1"),
        ({"max_num_batched_tokens": 8}, r"must be ≥ max_num_seqs \(16\)"),
        (
            {"chunked_prefill": False, "max_num_batched_tokens": 512},
            "smaller than the context window",
        ),
    ],
)
def test_bad_budgets_are_refused(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SimConfig.from_profile("tiny", **overrides)
