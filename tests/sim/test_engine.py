"""The sans-IO engine, driven with a virtual clock (no sleeps, no sockets)."""

from __future__ import annotations

import math

import pytest

from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine, FailEvent, SeqState, TokenEvent
from kvgate.sim.profiles import PROFILES, ModelShape, get_profile


def small(**kw: object) -> SimConfig:
    base: dict[str, object] = {
        "kv_blocks": 8,
        "block_size": 4,
        "context_window": 32,
        "max_num_seqs": 8,
        "speed": 1.0,
    }
    base.update(kw)
    return SimConfig.from_profile("tiny", **base)


def run_until_idle(engine: Engine, now: float = 0.0, max_steps: int = 10_000):
    """Step with a virtual clock until no work is left; returns (events, end time, steps)."""
    events = []
    steps = 0
    while engine.has_work and steps < max_steps:
        r = engine.step(now)
        now += r.duration_s
        events.extend(r.events)
        steps += 1
        check_invariants(engine)
    assert not engine.has_work
    return events, now, steps


def check_invariants(engine: Engine) -> None:
    bs = engine.config.block_size
    held: set[int] = set()  # a block shared by prefix caching counts once
    for s in engine.running:
        # vLLM allocates for the tokens computed: prompt + generated − 1 once decoding
        assert s.blocks == math.ceil(s.computed / bs), "blocks must cover the computed tokens"
        if not s.prefilling:
            assert s.computed == s.prompt_tokens + s.generated - 1
        held |= set(s.block_ids)
    for s in engine.waiting:
        assert s.blocks == 0
    assert len(held) == engine.used_blocks
    assert 0 <= engine.free_blocks <= engine.config.kv_blocks
    assert 0.0 <= engine.kv_cache_usage <= 1.0
    assert len(engine.running) <= engine.config.max_num_seqs


def test_single_sequence_holds_blocks_for_prompt_plus_generated() -> None:
    e = Engine(small())
    seq = e.new_sequence(6, 9, fingerprint=b"p", ignore_eos=True)
    e.add(seq)
    r = e.step(0.0)  # prefill: first token
    assert [type(ev) for ev in r.events] == [TokenEvent]
    assert seq.generated == 1
    assert seq.blocks == math.ceil(6 / 4)  # the prompt's KV; the new token's comes next step
    assert r.prefill_tokens == 6
    events, _, _ = run_until_idle(e)
    assert len(events) == 8
    assert events[-1].finish_reason == "length"
    assert seq.state is SeqState.FINISHED
    assert e.free_blocks == 8
    assert e.prompt_tokens_total == 6
    assert e.generation_tokens_total == 9
    assert e.finished["length"] == 1


def test_overflow_preempts_newest_and_everyone_still_gets_every_token() -> None:
    e = Engine(small())
    seqs = [e.new_sequence(6, 10, fingerprint=b"%d" % i, ignore_eos=True) for i in range(3)]
    for s in seqs:
        e.add(s)
    events, _, _ = run_until_idle(e)
    assert e.preemptions > 0
    assert any(s.preemptions for s in seqs)
    for s in seqs:
        mine = [ev for ev in events if ev.seq_id == s.seq_id]
        assert len(mine) == 10  # tokens already sent are not sent again after a recompute
        assert mine[-1].finish_reason == "length"
    assert e.peak_used_blocks == 8  # every block was in use before the first preemption
    assert e.prompt_tokens_total == 18  # a recompute does not count the prompt twice
    assert e.generation_tokens_total == 30
    assert e.used_blocks == 0


def test_preemption_evicts_the_newest_running_sequence() -> None:
    e = Engine(small(kv_blocks=4, context_window=16))
    old = e.new_sequence(8, 8, fingerprint=b"old", ignore_eos=True)
    new = e.new_sequence(8, 8, fingerprint=b"new", ignore_eos=True)
    e.add(old)
    e.add(new)
    e.step(0.0)  # both prefilled: 2 blocks each (8 prompt tokens), cache full
    assert e.free_blocks == 0
    assert len(e.running) == 2
    r = e.step(1.0)  # old computes its 9th token, needs a 3rd block: new is evicted
    assert e.preemptions == 1
    assert new.state is SeqState.WAITING
    assert new.blocks == 0
    assert e.waiting[0] is new
    assert old.state is SeqState.RUNNING
    assert old.blocks == 3
    assert [ev.seq_id for ev in r.events] == [old.seq_id]


def test_oom_mode_fails_everyone_then_restarts_empty() -> None:
    e = Engine(small(on_overflow="oom", restart_seconds=5.0, speed=2.0))
    seqs = [e.new_sequence(6, 10, fingerprint=b"%d" % i, ignore_eos=True) for i in range(4)]
    for s in seqs:
        e.add(s)
    now, failed = 0.0, []
    for _ in range(100):
        r = e.step(now)
        failed = [ev for ev in r.events if isinstance(ev, FailEvent)]
        if failed:
            break
        now += r.duration_s
    assert {ev.seq_id for ev in failed} == {s.seq_id for s in seqs}  # running and waiting
    assert "CUDA out of memory" in failed[0].message
    assert e.ooms == 1
    assert e.failed == 4
    assert e.preemptions == 0
    assert e.used_blocks == 0
    assert not e.running
    assert not e.waiting
    assert not e.is_healthy(now + 2.4)  # 5 s / speed 2 = 2.5 s down
    with pytest.raises(RuntimeError):
        e.add(e.new_sequence(4, 2, fingerprint=b"x"))
    assert e.is_healthy(now + 2.5)
    e.add(e.new_sequence(4, 2, fingerprint=b"x", ignore_eos=True))
    events, _, _ = run_until_idle(e, now + 2.5)
    assert events[-1].finish_reason == "length"


def test_abort_frees_blocks_at_once_and_counts_wasted_tokens() -> None:
    e = Engine(small())
    seq = e.new_sequence(6, 20, fingerprint=b"a", ignore_eos=True)
    waiting = e.new_sequence(6, 20, fingerprint=b"b", ignore_eos=True)
    e.add(seq)
    for t in range(3):
        e.step(float(t))
    e.add(waiting)
    assert seq.generated == 3
    assert e.used_blocks > 0
    assert e.abort(seq.seq_id) is True
    assert e.abort(waiting.seq_id) is True
    assert e.used_blocks == 0
    assert not e.running
    assert not e.waiting
    assert e.aborted == 2
    assert e.wasted_tokens == 3
    assert e.finished["abort"] == 2
    assert e.abort(seq.seq_id) is False  # idempotent
    assert not e.has_work


def test_max_num_seqs_caps_the_batch() -> None:
    e = Engine(small(kv_blocks=64, max_num_seqs=2))
    for i in range(5):
        e.add(e.new_sequence(4, 3, fingerprint=b"%d" % i, ignore_eos=True))
    e.step(0.0)
    assert len(e.running) == 2
    assert len(e.waiting) == 3
    run_until_idle(e)
    assert e.finished["length"] == 5


def test_step_time_grows_with_prompt_tokens_and_batch_size() -> None:
    cfg = small(kv_blocks=64, prefill_s_per_token=0.01, decode_base_s=0.1, decode_per_seq_s=0.02)
    short, long_ = Engine(cfg), Engine(cfg)
    short.add(short.new_sequence(2, 5, fingerprint=b"s"))
    long_.add(long_.new_sequence(20, 5, fingerprint=b"l"))
    assert short.step(0).duration_s == pytest.approx(0.01 * 2 + 0.1 + 0.02)
    assert long_.step(0).duration_s == pytest.approx(0.01 * 20 + 0.1 + 0.02)
    one, four = Engine(cfg), Engine(cfg)
    one.add(one.new_sequence(4, 9, fingerprint=b"0", ignore_eos=True))
    for i in range(4):
        four.add(four.new_sequence(4, 9, fingerprint=b"%d" % i, ignore_eos=True))
    one.step(0)
    four.step(0)
    assert four.step(1).duration_s - one.step(1).duration_s == pytest.approx(3 * 0.02)
    fast = Engine(small(kv_blocks=64, speed=10.0, decode_base_s=0.1, decode_per_seq_s=0.0))
    fast.add(fast.new_sequence(1, 1, fingerprint=b"f"))
    assert fast.step(0).duration_s == pytest.approx(
        (0.1 + 1 * fast.config.prefill_s_per_token) / 10
    )


def test_output_is_deterministic_under_a_seed() -> None:
    def texts(seed: int) -> list[tuple[int, str]]:
        e = Engine(small(kv_blocks=64, seed=seed, mean_output_tokens=6))
        seqs = [e.new_sequence(5, 25, fingerprint=b"%d" % i) for i in range(6)]
        for s in seqs:
            e.add(s)
        events, _, _ = run_until_idle(e)
        by: dict[int, str] = {s.seq_id: "" for s in seqs}
        for ev in events:
            by[ev.seq_id] += ev.text
        return [(s.target_tokens, by[s.seq_id]) for s in seqs]

    assert texts(7) == texts(7)
    assert texts(7) != texts(8)
    lengths = [n for n, _ in texts(7)]
    assert all(1 <= n <= 25 for n in lengths)
    assert len(set(lengths)) > 1


def test_output_length_caps() -> None:
    e = Engine(small(context_window=32, mean_output_tokens=1000))
    assert e.new_sequence(10, None, fingerprint=b"x", ignore_eos=True).target_tokens == 22
    assert e.new_sequence(10, 5, fingerprint=b"x").target_tokens <= 5
    assert e.new_sequence(10, 5, fingerprint=b"x", min_tokens=5).target_tokens == 5
    with pytest.raises(ValueError, match="max_tokens"):
        e.new_sequence(10, 23, fingerprint=b"x")
    with pytest.raises(ValueError, match="prompt_tokens"):
        e.new_sequence(32, None, fingerprint=b"x")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"kv_blocks": 0}, "kv_blocks"),
        ({"speed": 0}, "speed"),
        ({"on_overflow": "explode"}, "on_overflow"),
        ({"metric_names": "v2"}, "metric_names"),
        ({"context_window": 4096}, "larger than the KV cache"),
        ({"decode_base_s": -1.0}, "decode_base_s"),
        ({"bogus": 1}, "unknown SimConfig fields"),
    ],
)
def test_invalid_config_is_refused(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SimConfig.from_profile("tiny", **overrides)


def test_unknown_profile_is_refused() -> None:
    with pytest.raises(ValueError, match="known profiles"):
        get_profile("h100-nope")


def test_profile_arithmetic() -> None:
    assert ModelShape(70.55, 80, 8, 128).kv_bytes_per_token == 327_680  # 320 KiB per token
    assert ModelShape(8.03, 32, 8, 128).kv_bytes_per_token == 131_072
    big = PROFILES["h800x8-llama3-70b"]
    pool = 8 * 79.6 * 2**30 * 0.9 - 70.55e9 * 2 - 8 * 2.5 * 2**30
    assert big.kv_blocks == math.floor(pool / (327_680 * 16)) == 86_366
    for p in PROFILES.values():
        SimConfig.from_profile(p.name)  # every preset validates (context fits the cache)
