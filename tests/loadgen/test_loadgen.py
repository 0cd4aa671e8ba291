"""kvgate.loadgen against the in-process simulator: ignore_eos and per-request send times."""

from __future__ import annotations

from kvgate.loadgen import Burst, Stream, TrafficMix, drive
from kvgate.sim import SimConfig, run_sim


async def test_ignore_eos_generates_max_tokens_and_ttft_at_follows_the_schedule() -> None:
    async with run_sim(SimConfig.from_profile("tiny", speed=50, seed=3)) as sim:
        base = sim.url
        mix = TrafficMix(
            model=sim.engine.config.model,
            duration=0.3,
            seed=1,
            streams=(Stream("s", "k", rate=0.0, prompt_tokens=10, max_tokens=5),),
            bursts=(
                Burst(
                    "fixed", "k", at=0.0, count=3, prompt_tokens=20, max_tokens=40, ignore_eos=True
                ),
                Burst(
                    "late",
                    "k",
                    at=0.2,
                    count=2,
                    prompt_tokens=20,
                    max_tokens=7,
                    stream=False,
                    ignore_eos=True,
                ),
            ),
        )
        stats = await drive(base, mix, drain=30.0)
    fixed, late = stats["fixed"], stats["late"]
    # ignore_eos: exactly max_tokens each (the simulator's drawn length would be shorter)
    assert (fixed.ok, fixed.completion_tokens) == (3, 3 * 40)
    assert (late.ok, late.completion_tokens) == (2, 2 * 7)
    # one scheduled send time per TTFT sample
    assert fixed.ttft_at == [0.0, 0.0, 0.0]
    assert late.ttft_at == [0.2, 0.2]
    assert len(fixed.ttft) == 3
    assert all(t > 0 for t in fixed.ttft)
    assert stats["s"].sent == 0
