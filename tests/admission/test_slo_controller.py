"""The latency-target controller (kvgate.admission.slo) on an injected clock: no sleeps."""

from __future__ import annotations

import pytest

from kvgate.admission.slo import ClassTargets, SloController


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def controller(clock: Clock, ceiling: int = 64, **kw: object) -> SloController:
    return SloController(
        {"critical": ClassTargets(ttft_p99_s=1.0)},
        lambda name: ceiling,
        clock=clock,
        min_samples=5,
        **kw,  # type: ignore[arg-type]
    )


def run(slo: SloController, cls: str, n: int, ttft: float) -> None:
    for _ in range(n):
        slo.started("b", cls)
        slo.finished("b", cls, ttft, ttft + 1.0, 11)


def test_a_missed_target_caps_the_lower_classes_and_a_met_one_lifts_the_cap() -> None:
    clock = Clock()
    slo = controller(clock)
    for _ in range(20):
        slo.started("b", "standard")  # 20 standard requests running
    run(slo, "critical", 10, ttft=3.0)  # critical misses its 1 s target
    slo.tick()
    st = slo.state()["b"]
    assert st["standard"]["cap"] == 16  # 20 × 0.8
    assert st["sheddable"]["cap"] == 1
    assert st["standard"]["bound_by"] == "critical-ttft"
    assert st["critical"]["cap"] is None  # the class that misses is never capped
    assert st["critical"]["ttft_p99_s"] == 3.0
    assert not slo.allow("b", "standard")  # 20 running ≥ 16
    assert slo.allow("b", "critical")
    clock.now += 1.0
    slo.tick()  # nothing new finished: the same evidence does not cut twice
    assert slo.state()["b"]["standard"]["cap"] == 16
    run(slo, "critical", 2, ttft=3.0)  # new misses: lowered again
    clock.now += 1.0
    slo.tick()
    assert slo.state()["b"]["standard"]["cap"] == 12
    # the slow requests age out of the window; fast ones come in: the cap rises step by step
    clock.now += 11.0
    run(slo, "critical", 10, ttft=0.2)
    caps = []
    for _ in range(30):
        clock.now += 1.0
        slo.tick()
        caps.append(slo.state()["b"]["standard"]["cap"])
    assert caps[0] == 14  # + max(1, 10 %)
    assert caps == sorted(caps[: caps.index(None)]) + [None] * caps.count(None)
    assert caps[-1] is None  # past the backend's concurrency: no cap at all
    assert slo.state()["b"]["standard"]["bound_by"] == "none"


def test_too_few_requests_say_nothing() -> None:
    clock = Clock()
    slo = controller(clock)
    run(slo, "critical", 4, ttft=30.0)  # below min_samples
    slo.started("b", "standard")
    slo.tick()
    assert slo.state()["b"]["standard"]["cap"] is None


def test_time_per_output_token_target() -> None:
    clock = Clock()
    slo = SloController(
        {"standard": ClassTargets(tpot_p99_s=0.05)}, lambda n: 64, clock=clock, min_samples=5
    )
    for _ in range(8):
        slo.started("b", "sheddable")
    for _ in range(6):
        slo.started("b", "standard")
        slo.finished("b", "standard", 0.1, 0.1 + 0.2 * 10, 11)  # 0.2 s per token
    slo.tick()
    st = slo.state()["b"]
    assert st["sheddable"]["cap"] == 6  # 8 × 0.8
    assert st["sheddable"]["bound_by"] == "standard-tpot"
    assert st["critical"]["cap"] is None  # higher classes are never capped by a lower one


def test_allow_runs_the_controller_on_its_period() -> None:
    clock = Clock()
    raised: list[int] = []
    slo = controller(clock, ceiling=10, on_raise=lambda: raised.append(1))
    for _ in range(10):
        slo.started("b", "standard")
    run(slo, "critical", 10, ttft=2.0)
    assert not slo.allow("b", "standard")  # the first call ran a step: capped at 8
    clock.now += 20.0  # the misses aged out, nothing measured: the cap rises
    slo.allow("b", "standard")
    assert raised


def test_unknown_class_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown priority class"):
        SloController({"gold": ClassTargets(ttft_p99_s=1.0)}, lambda n: 1)
