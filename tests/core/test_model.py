"""Model-based (stateful) tests of TokenBucket and SlotPool against simple reference models,
driven by the ManualClock (no sleeping)."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvgate import ManualClock, NeverAdmissibleError, OverReleaseError, SlotPool, TokenBucket

NS = 1_000_000_000
# Rates whose nanoseconds-per-token are whole numbers, so the exact model and the bucket's
# nanosecond arithmetic agree to the token.
RATES = [60, 120, 600, 1_000, 6_000, 60_000, 1_000_000]


class TokenBucketMachine(RuleBasedStateMachine):
    """Reference: an exact rational level, refilled by elapsed time, capped at the burst,
    debt bounded by one burst."""

    @initialize(rate=st.sampled_from(RATES), burst=st.integers(1, 5_000))
    def setup(self, rate: int, burst: int) -> None:
        self.clock = ManualClock(123)
        self.bucket = TokenBucket(rate, burst, clock=self.clock)
        self.rate = rate
        self.burst = burst
        self.level = Fraction(burst)

    @rule(seconds=st.integers(0, 120 * NS))
    def advance(self, seconds: int) -> None:
        self.clock.advance_ns(seconds)
        self.level = min(Fraction(self.burst), self.level + Fraction(seconds * self.rate, 60 * NS))

    @rule(n=st.integers(0, 6_000))
    def reserve(self, n: int) -> None:
        if n > self.burst:
            with pytest.raises(NeverAdmissibleError) as ei:
                self.bucket.try_reserve(n)
            assert (ei.value.requested, ei.value.limit) == (n, self.burst)
            return
        ok = n == 0 or self.level >= n
        assert self.bucket.try_reserve(n) == ok
        if ok:
            self.level -= n

    @rule(reserved=st.integers(0, 6_000), actual=st.integers(0, 6_000))
    def reconcile(self, reserved: int, actual: int) -> None:
        self.bucket.reconcile(reserved, actual)
        level = self.level + reserved - actual
        self.level = max(Fraction(-self.burst), min(Fraction(self.burst), level))

    @rule(n=st.integers(1, 6_000))
    def retry_after(self, n: int) -> None:
        if n > self.burst:
            return
        need = max(Fraction(0), n - self.level)
        expected = need * 60 * NS / self.rate  # exact ns
        assert abs(self.bucket.retry_after(n) * NS - float(expected)) <= 2

    @rule(rate=st.sampled_from(RATES))
    def set_rate(self, rate: int) -> None:
        self.bucket.tokens_per_minute = rate
        # The level is kept, re-expressed as whole nanoseconds at the new rate, rounded down.
        level_ns = self.level * 60 * NS / self.rate
        assert level_ns.denominator == 1
        new_ns = (level_ns * self.rate) // rate
        self.level = Fraction(new_ns * rate, 60 * NS)
        self.rate = rate

    @invariant()
    def available_matches(self) -> None:
        assert self.bucket.available == int(self.level // 1)
        assert -self.burst <= self.bucket.available <= self.burst
        full_ns = (self.burst - self.level) * 60 * NS / self.rate
        assert abs(self.bucket.time_to_full() * NS - float(full_ns)) <= 2


class SlotPoolMachine(RuleBasedStateMachine):
    """Reference: an int count that never exceeds the limit in force at acquire time."""

    @initialize(limit=st.integers(0, 10))
    def setup(self, limit: int) -> None:
        self.pool = SlotPool(limit, clock=ManualClock())
        self.limit = limit
        self.held = 0

    @rule(n=st.integers(0, 4))
    def acquire(self, n: int) -> None:
        ok = n == 0 or self.held + n <= self.limit  # zero is always a valid no-op
        assert self.pool.try_acquire(n) == ok
        if ok:
            self.held += n

    @precondition(lambda self: self.held > 0)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(1, self.held))
        self.pool.release(n)
        self.held -= n

    @rule(extra=st.integers(1, 3))
    def over_release(self, extra: int) -> None:
        with pytest.raises(OverReleaseError):
            self.pool.release(self.held + extra)

    @rule(limit=st.integers(0, 10))
    def set_limit(self, limit: int) -> None:
        self.pool.limit = limit
        self.limit = limit

    @invariant()
    def counts_match(self) -> None:
        assert self.pool.in_use == self.held
        assert self.pool.limit == self.limit
        assert self.pool.in_use >= 0


TestTokenBucketModel = TokenBucketMachine.TestCase
TestTokenBucketModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestSlotPoolModel = SlotPoolMachine.TestCase
TestSlotPoolModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
