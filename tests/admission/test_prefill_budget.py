"""The prefill budget's rules (kvgate.admission.prefill)."""

from __future__ import annotations

import pytest

from kvgate.admission.prefill import MIN_BUDGET, PrefillGate, default_budget, gate_for


def test_a_lane_admits_while_its_prompts_fit_and_one_alone_always() -> None:
    gate = PrefillGate(1000)
    a = gate.enter(600, "standard")
    assert a is not None
    assert gate.enter(500, "standard") is None  # 600 + 500 > 1000
    b = gate.enter(400, "sheddable")  # the same lane: 1000 fits exactly
    assert b is not None
    assert gate.in_prefill == 1000
    a.leave()
    a.leave()  # idempotent
    assert gate.in_prefill == 400
    b.leave()
    big = gate.enter(5000, "standard")  # larger than the budget, but alone: it goes
    assert big is not None
    assert gate.enter(1, "standard") is None
    assert gate.refused == 2


def test_critical_has_its_own_lane() -> None:
    gate = PrefillGate(1000)
    burst = gate.enter(32_000, "standard")  # a long prompt fills the shared lane
    assert burst is not None
    assert gate.enter(10, "standard") is None
    chat = gate.enter(300, "critical")  # critical chat is not held behind it
    assert chat is not None
    assert gate.enter(800, "critical") is None  # but critical is bounded too
    chat.leave()
    assert gate.critical_in_prefill == 0
    assert gate.in_prefill == 32_000


def test_leaving_wakes_the_queue() -> None:
    woken: list[int] = []
    gate = PrefillGate(10, on_leave=lambda: woken.append(1))
    t = gate.enter(5, "standard")
    assert t is not None
    t.leave()
    t.leave()
    assert woken == [1]


def test_the_default_budget() -> None:
    assert default_budget(None) is None
    assert default_budget(1_381_856) == int(1_381_856 * 0.03)
    assert default_budget(10_000) == MIN_BUDGET  # small engines: never the bottleneck
    assert default_budget(1_381_856, chunk_tokens=8192) == 16_384
    assert gate_for(0, 1_000_000) is None  # 0: no budget
    g = gate_for(2048, None)
    assert g is not None
    assert g.budget == 2048
    assert gate_for(None, None) is None
    with pytest.raises(ValueError, match="at least 1 token"):
        PrefillGate(0)
