"""ReplicaSet: the routing stage's choice among a model's replicas, read in Rust from the
admission core, against the rule written out in Python (the gateway's former scan)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate import AdmissionController, InvalidConfigError, ReplicaSet


def reference(ctl: AdmissionController, ids: list[int], healthy: list[bool],
              kv: list[float | None]) -> int | None:  # fmt: skip
    """The position of the healthy replica with the most headroom: the free slot ratio of its
    effective concurrency limit, then the lowest KV-cache usage (None as 0), the first on a tie."""
    best: tuple[float, float] | None = None
    chosen = None
    for at, (bid, ok, usage) in enumerate(zip(ids, healthy, kv, strict=True)):
        if not ok:
            continue
        state = ctl.backend_state(bid)
        limit = max(1, state["effective_concurrency"])
        key = ((limit - state["in_use"]) / limit, -(usage or 0.0))
        if best is None or key > best:
            best, chosen = key, at
    return chosen


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 8),  # slots
            st.integers(0, 10),  # requests held (past the limit too, after a scale-down)
            st.sampled_from([1.0, 0.5, 0.25]),  # scale
            st.booleans(),  # healthy
            st.one_of(st.none(), st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0])),  # KV usage
        ),
        min_size=1,
        max_size=12,
    ),
    st.randoms(use_true_random=False),
)
def test_the_choice_is_the_rules(replicas: list[tuple[int, int, float, bool, float | None]],
                                 rnd) -> None:  # fmt: skip
    ctl = AdmissionController(backends=len(replicas), tenants=1)
    t = ctl.add_tenant("t", priority="critical")
    ids = [ctl.add_backend(f"b{i}", max_concurrency=r[0], tokens_per_minute=10**9)
           for i, r in enumerate(replicas)]  # fmt: skip
    held = []
    for bid, (slots, n, scale, _, _) in zip(ids, replicas, strict=True):
        for _ in range(min(n, slots)):
            held.append(ctl.admit(bid, t, "critical", 0))
        ctl.set_scale(bid, scale)
    order = list(range(len(ids)))
    rnd.shuffle(order)  # members in any order: positions follow the set's order
    members = [ids[i] for i in order]
    rs = ReplicaSet(members)
    for i in order:
        rs.set_healthy(ids[i], replicas[i][3])
        rs.set_kv_usage(ids[i], replicas[i][4])
    healthy = [replicas[i][3] for i in order]
    kv = [replicas[i][4] for i in order]
    assert rs.healthy == sum(healthy)
    assert rs.most_headroom(ctl) == reference(ctl, members, healthy, kv)
    for r in held:
        r.release()


def test_members_health_and_errors() -> None:
    ctl = AdmissionController(backends=3, tenants=1)
    ids = [ctl.add_backend(f"b{i}", max_concurrency=2, tokens_per_minute=10**9) for i in range(3)]
    rs = ReplicaSet(ids)
    assert (len(rs), rs.backends, rs.healthy) == (3, ids, 3)
    assert rs.most_headroom(ctl) == 0  # all alike: the first
    rs.set_kv_usage(ids[0], 0.4)
    assert rs.most_headroom(ctl) == 1
    rs.set_healthy(ids[1], False)
    rs.set_healthy(ids[1], False)  # twice: counted once
    assert (rs.healthy, rs.most_headroom(ctl)) == (2, 2)
    rs.set_healthy(ids[2], False)
    rs.set_healthy(ids[0], False)
    assert (rs.healthy, rs.most_headroom(ctl)) == (0, None)
    assert ReplicaSet([]).most_headroom(ctl) is None
    with pytest.raises(ValueError, match="twice"):
        ReplicaSet([0, 1, 0])
    with pytest.raises(ValueError, match="not in this replica set"):
        rs.set_healthy(7, True)
    with pytest.raises(ValueError, match="not finite"):
        rs.set_kv_usage(ids[0], math.nan)
    with pytest.raises(InvalidConfigError, match="unknown backend id 9"):
        ReplicaSet([0, 9]).most_headroom(ctl)
    with pytest.raises(OverflowError):
        ReplicaSet([-1])
