//! A lock-free token bucket (tokens per minute) with reserve / reconcile.
//!
//! The state is one word, the GCRA "theoretical arrival time" `tat`: the instant (ns) at which
//! the bucket would be empty. At time `now` the bucket holds
//! `min(burst, (now - max(tat, now - T)) * rate / 60e9)` tokens, where `T` is the time to fill a
//! whole burst. Refill is therefore continuous and needs no background task, and every update is
//! a single compare-and-swap.
//!
//! Rounding: the time cost of `n` tokens is rounded *up* to a whole nanosecond and a refund is
//! rounded *down*, so rounding never grants tokens; `available` is rounded down.
//!
//! Scaling: the admission controller passes effective (scaled) `rate` and `burst` to each call.
//! Since both are scaled by the same factor, the fill time `T` stays the same and a change of
//! scale keeps the bucket's fill fraction.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use crate::error::CoreError;
use crate::slots::Rmw;

const NS_PER_MINUTE: u128 = 60_000_000_000;
/// Cap on every time span, about 73 years, so arithmetic on `i64` nanoseconds never overflows.
const MAX_SPAN_NS: i64 = i64::MAX / 4;
/// `tat` of a bucket that has been full "forever".
const FULL_TAT: i64 = i64::MIN / 4;

/// The nanoseconds `n` tokens take to refill at `rate` tokens per minute, rounded up.
#[inline]
fn cost_ns(n: u64, rate: u64) -> i64 {
    let rate = rate.max(1);
    // One 64-bit division when `n` minutes of nanoseconds fit 64 bits (below ~3e8 tokens),
    // else 128-bit arithmetic; the same value either way.
    let ns = match n.checked_mul(NS_PER_MINUTE as u64) {
        Some(p) => u128::from(p.div_ceil(rate)),
        None => (u128::from(n) * NS_PER_MINUTE).div_ceil(u128::from(rate)),
    };
    ns.min(MAX_SPAN_NS as u128) as i64
}

/// The nanoseconds `n` tokens take to refill, rounded down (used for refunds and fill time).
#[inline]
fn span_ns(n: u64, rate: u64) -> i64 {
    let rate = rate.max(1);
    let ns = match n.checked_mul(NS_PER_MINUTE as u64) {
        Some(p) => u128::from(p / rate),
        None => u128::from(n) * NS_PER_MINUTE / u128::from(rate),
    };
    ns.min(MAX_SPAN_NS as u128) as i64
}

/// The time a whole `burst` takes to refill at `rate`, rounded down but at least 1 ns: at rates
/// where a whole burst refills in under a nanosecond (10^13 tokens per minute with a burst of
/// 100) the bucket still holds a burst, instead of a zero span that could never admit.
#[inline]
fn fill_ns(burst: u64, rate: u64) -> i64 {
    span_ns(burst, rate).max(1)
}

/// Converts a `u64` clock reading to the bucket's `i64` time axis.
#[inline]
fn to_i64(now_ns: u64) -> i64 {
    now_ns.min(MAX_SPAN_NS as u64) as i64
}

/// A token bucket: `rate` tokens per minute, holding at most `burst` tokens, with debt bounded
/// by one `burst`. `#[repr(C)]`, atomics only, so it can live in shared memory.
#[repr(C)]
#[derive(Debug)]
pub struct TokenBucket {
    tat: AtomicI64,
    rate: AtomicU64,
    burst: AtomicU64,
}

impl TokenBucket {
    /// A full bucket of `burst` tokens refilling at `rate` tokens per minute.
    ///
    /// Errors: [`CoreError::InvalidConfig`] when `rate` or `burst` is 0.
    pub fn new(rate: u64, burst: u64) -> Result<Self, CoreError> {
        check_params(rate, burst)?;
        Ok(Self {
            tat: AtomicI64::new(FULL_TAT),
            rate: AtomicU64::new(rate),
            burst: AtomicU64::new(burst),
        })
    }

    /// (Re)initialises a bucket that lives in shared memory: full, with these parameters.
    pub fn init(&self, rate: u64, burst: u64) -> Result<(), CoreError> {
        check_params(rate, burst)?;
        self.rate.store(rate, Ordering::Release);
        self.burst.store(burst, Ordering::Release);
        self.tat.store(FULL_TAT, Ordering::Release);
        Ok(())
    }

    /// Configured refill rate (tokens per minute).
    #[inline]
    pub fn rate(&self) -> u64 {
        self.rate.load(Ordering::Acquire)
    }

    /// Configured capacity (tokens).
    #[inline]
    pub fn burst(&self) -> u64 {
        self.burst.load(Ordering::Acquire)
    }

    /// Changes rate and capacity at `now_ns`, keeping the current token level (capped at the new
    /// capacity). A reservation racing with the change may be computed with the old rate.
    pub fn set_params(&self, rate: u64, burst: u64, now_ns: u64) -> Result<(), CoreError> {
        check_params(rate, burst)?;
        let (old_rate, old_burst) = (self.rate(), self.burst());
        let now = to_i64(now_ns);
        let _ = self
            .tat
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
                let base = tat.max(now - fill_ns(old_burst, old_rate));
                // Level in tokens (exact rational) re-expressed as time at the new rate.
                let level_ns = i128::from(now - base);
                // Rounded down (toward fewer tokens), so a rate change never grants tokens.
                let new_span = (level_ns * i128::from(old_rate)).div_euclid(i128::from(rate));
                let new_span = new_span.clamp(-i128::from(MAX_SPAN_NS), i128::from(MAX_SPAN_NS));
                Some(now - new_span as i64)
            });
        self.rate.store(rate, Ordering::Release);
        self.burst.store(burst, Ordering::Release);
        Ok(())
    }

    #[inline]
    fn base(tat: i64, now: i64, rate: u64, burst: u64) -> i64 {
        tat.max(now - fill_ns(burst, rate))
    }

    /// Tokens available at `now_ns` with effective `rate`/`burst` (negative when in debt).
    pub fn available_with(&self, now_ns: u64, rate: u64, burst: u64) -> i64 {
        let now = to_i64(now_ns);
        let base = Self::base(self.tat.load(Ordering::Acquire), now, rate, burst);
        let tokens = (i128::from(now - base) * i128::from(rate)).div_euclid(NS_PER_MINUTE as i128);
        tokens.min(i128::from(burst)) as i64
    }

    /// Takes `n` tokens at `now_ns` if that many are available (effective `rate`/`burst`).
    /// `n == 0` always succeeds. `n > burst` is never available (returns `false`).
    #[inline]
    pub fn try_reserve_with(&self, n: u64, now_ns: u64, rate: u64, burst: u64) -> bool {
        self.try_reserve_in(Rmw::Atomic, n, now_ns, rate, burst)
    }

    /// [`Self::try_reserve_with`] made in mode `rmw`.
    #[inline]
    pub fn try_reserve_in(&self, rmw: Rmw, n: u64, now_ns: u64, rate: u64, burst: u64) -> bool {
        if n == 0 {
            return true;
        }
        if n > burst {
            return false;
        }
        let now = to_i64(now_ns);
        let cost = cost_ns(n, rate);
        let span = fill_ns(burst, rate);
        rmw.update_i64(&self.tat, |tat| {
            let new = tat.max(now - span) + cost;
            (new <= now).then_some(new)
        })
        .is_ok()
    }

    /// Gives `n` unused tokens back (never above a full bucket).
    ///
    /// Needs no clock reading: `tat` moves back by the refund's span, and every reader caps the
    /// level at a full bucket (`max(tat, now - T)`), which gives the same level at any later
    /// time as capping now would (the clock never goes back). `tat` is floored at the
    /// "full forever" value so repeated refunds cannot overflow it.
    #[inline]
    pub fn refund_with(&self, n: u64, rate: u64) {
        self.refund_in(Rmw::Atomic, n, rate);
    }

    /// [`Self::refund_with`] made in mode `rmw`.
    #[inline]
    pub fn refund_in(&self, rmw: Rmw, n: u64, rate: u64) {
        if n == 0 {
            return;
        }
        let back = span_ns(n, rate);
        let _ = rmw.update_i64(&self.tat, |tat| {
            Some(tat.saturating_sub(back).max(FULL_TAT))
        });
    }

    /// Charges `n` tokens unconditionally (an overrun): the bucket may go into debt, bounded by
    /// one `burst` (what is beyond the bound is forgiven).
    pub fn charge_with(&self, n: u64, now_ns: u64, rate: u64, burst: u64) {
        self.charge_in(Rmw::Atomic, n, now_ns, rate, burst);
    }

    /// [`Self::charge_with`] made in mode `rmw`.
    pub fn charge_in(&self, rmw: Rmw, n: u64, now_ns: u64, rate: u64, burst: u64) {
        if n == 0 {
            return;
        }
        let now = to_i64(now_ns);
        let cost = cost_ns(n, rate);
        let span = fill_ns(burst, rate);
        let _ = rmw.update_i64(&self.tat, |tat| {
            Some((tat.max(now - span) + cost).min(now + span))
        });
    }

    /// Settles a reservation of `reserved` tokens with the `actual` usage: refunds the unused
    /// part, or charges the overrun (into bounded debt). `now_ns` is called only for an overrun
    /// (a refund needs no clock reading).
    #[inline]
    pub fn reconcile_with(
        &self,
        reserved: u64,
        actual: u64,
        now_ns: impl FnOnce() -> u64,
        rate: u64,
        burst: u64,
    ) {
        match actual.cmp(&reserved) {
            std::cmp::Ordering::Less => self.refund_with(reserved - actual, rate),
            std::cmp::Ordering::Greater => {
                self.charge_with(actual - reserved, now_ns(), rate, burst);
            }
            std::cmp::Ordering::Equal => {}
        }
    }

    /// Nanoseconds until `n` tokens are available (0 if they are now).
    ///
    /// Errors: [`CoreError::NeverAdmissible`] when `n > burst`.
    pub fn retry_after_ns_with(
        &self,
        n: u64,
        now_ns: u64,
        rate: u64,
        burst: u64,
    ) -> Result<u64, CoreError> {
        if n > burst {
            return Err(CoreError::NeverAdmissible {
                requested: n,
                limit: burst,
            });
        }
        let now = to_i64(now_ns);
        let base = Self::base(self.tat.load(Ordering::Acquire), now, rate, burst);
        Ok((base + cost_ns(n, rate) - now).max(0) as u64)
    }

    /// Nanoseconds until the bucket is full again.
    pub fn time_to_full_ns_with(&self, now_ns: u64, rate: u64, burst: u64) -> u64 {
        let now = to_i64(now_ns);
        let tat = self.tat.load(Ordering::Acquire);
        (tat + fill_ns(burst, rate) - now).max(0) as u64
    }

    /// [`Self::available_with`] with the configured parameters.
    pub fn available(&self, now_ns: u64) -> i64 {
        self.available_with(now_ns, self.rate(), self.burst())
    }

    /// Takes `n` tokens with the configured parameters.
    ///
    /// Errors: [`CoreError::NeverAdmissible`] when `n` exceeds the capacity.
    pub fn try_reserve(&self, n: u64, now_ns: u64) -> Result<bool, CoreError> {
        let burst = self.burst();
        if n > burst {
            return Err(CoreError::NeverAdmissible {
                requested: n,
                limit: burst,
            });
        }
        Ok(self.try_reserve_with(n, now_ns, self.rate(), burst))
    }

    /// [`Self::reconcile_with`] with the configured parameters.
    pub fn reconcile(&self, reserved: u64, actual: u64, now_ns: u64) {
        self.reconcile_with(reserved, actual, || now_ns, self.rate(), self.burst());
    }

    /// [`Self::retry_after_ns_with`] with the configured parameters.
    pub fn retry_after_ns(&self, n: u64, now_ns: u64) -> Result<u64, CoreError> {
        self.retry_after_ns_with(n, now_ns, self.rate(), self.burst())
    }

    /// [`Self::time_to_full_ns_with`] with the configured parameters.
    pub fn time_to_full_ns(&self, now_ns: u64) -> u64 {
        self.time_to_full_ns_with(now_ns, self.rate(), self.burst())
    }
}

fn check_params(rate: u64, burst: u64) -> Result<(), CoreError> {
    if rate == 0 || burst == 0 {
        return Err(CoreError::InvalidConfig(format!(
            "token bucket needs tokens_per_minute >= 1 and burst_tokens >= 1 (got {rate}, {burst})"
        )));
    }
    if rate > crate::error::MAX_AMOUNT || burst > crate::error::MAX_AMOUNT {
        return Err(CoreError::InvalidConfig(format!(
            "token bucket parameters must be <= 2**62 (got {rate}, {burst})"
        )));
    }
    // the refill of a whole burst must fit the bucket's time axis (about 73 years)
    if u128::from(burst) * NS_PER_MINUTE / u128::from(rate) >= MAX_SPAN_NS as u128 {
        return Err(CoreError::InvalidConfig(format!(
            "token bucket: burst_tokens {burst} at {rate} tokens per minute takes more than 70 \
             years to refill"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn a_burst_that_refills_in_under_a_nanosecond_still_admits() {
        for rate in [10_u64.pow(13), crate::error::MAX_AMOUNT] {
            let b = TokenBucket::new(rate, 100).unwrap();
            assert_eq!(b.available(1_000), 100, "rate {rate}");
            assert!(b.try_reserve_with(100, 1_000, rate, 100));
            assert!(b.try_reserve_with(1, 1_002, rate, 100));
        }
        // a rate change to such a rate keeps the bucket usable
        let b = TokenBucket::new(600, 100).unwrap();
        b.set_params(crate::error::MAX_AMOUNT, 100, 10 * S).unwrap();
        assert!(b.try_reserve_with(1, 11 * S, crate::error::MAX_AMOUNT, 100));
    }

    #[test]
    fn a_burst_that_takes_decades_to_refill_is_refused() {
        assert!(matches!(
            TokenBucket::new(1, 100_000_000),
            Err(CoreError::InvalidConfig(_))
        ));
        assert!(matches!(
            TokenBucket::new(60, crate::error::MAX_AMOUNT),
            Err(CoreError::InvalidConfig(_))
        ));
        // 60 years of refill is still fine
        assert!(TokenBucket::new(1, 60 * 525_960).is_ok());
    }

    #[test]
    fn starts_full_and_refills_continuously() {
        let b = TokenBucket::new(60, 10).unwrap(); // one token per second
        assert_eq!(b.available(0), 10);
        assert!(b.try_reserve(10, 0).unwrap());
        assert_eq!(b.available(0), 0);
        assert!(!b.try_reserve(1, 0).unwrap());
        assert_eq!(b.retry_after_ns(1, 0).unwrap(), S);
        assert_eq!(b.available(S / 2), 0);
        assert_eq!(b.available(3 * S), 3);
        assert_eq!(b.time_to_full_ns(3 * S), 7 * S);
        assert_eq!(b.available(100 * S), 10);
    }

    #[test]
    fn never_admissible_above_burst() {
        let b = TokenBucket::new(60, 10).unwrap();
        assert_eq!(
            b.try_reserve(11, 0),
            Err(CoreError::NeverAdmissible {
                requested: 11,
                limit: 10
            })
        );
        assert!(b.retry_after_ns(11, 0).is_err());
    }

    #[test]
    fn reconcile_refunds_and_charges_with_bounded_debt() {
        let b = TokenBucket::new(60, 10).unwrap();
        assert!(b.try_reserve(8, 0).unwrap());
        b.reconcile(8, 3, 0);
        assert_eq!(b.available(0), 7);
        assert!(b.try_reserve(5, 0).unwrap());
        b.reconcile(5, 9, 0); // overrun of 4 -> 7 - 9 = -2
        assert_eq!(b.available(0), -2);
        b.reconcile(0, 100, 0); // bounded at -burst
        assert_eq!(b.available(0), -10);
        assert_eq!(b.time_to_full_ns(0), 20 * S);
        b.reconcile(20, 0, 0); // refund beyond full is capped
        assert_eq!(b.available(0), 10);
    }

    #[test]
    fn refund_reads_no_clock_and_keeps_overruns_charged() {
        let b = TokenBucket::new(60, 10).unwrap();
        assert!(b.try_reserve(8, 0).unwrap());
        // A refund never asks for the time (the closure would panic).
        b.reconcile_with(8, 2, || unreachable!("refund read the clock"), 60, 10);
        b.reconcile_with(5, 5, || unreachable!("no-op read the clock"), 60, 10);
        assert_eq!(b.available(0), 8);
        // Refunds far beyond a full bucket, many times over: capped at full, no overflow.
        for _ in 0..100 {
            b.refund_with(crate::error::MAX_AMOUNT, 1);
        }
        assert_eq!(b.available(0), 10);
        assert_eq!(b.available(1_000 * S), 10);
        // ...and the slack does not absorb a later overrun: it is charged in full.
        b.reconcile_with(0, 4, || 1_000 * S, 60, 10);
        assert_eq!(b.available(1_000 * S), 6);
        // A refund made while in debt, read later, gives the level capping at once would.
        b.reconcile_with(0, 20, || 1_000 * S, 60, 10); // 6 - 20 -> bounded at -10
        b.refund_with(3, 60);
        assert_eq!(b.available(1_000 * S), -7);
        assert_eq!(b.available(1_010 * S), 3);
        assert_eq!(b.available(1_030 * S), 10);
    }

    #[test]
    fn set_params_keeps_level() {
        let b = TokenBucket::new(60, 10).unwrap();
        assert!(b.try_reserve(6, 0).unwrap());
        b.set_params(120, 10, 0).unwrap();
        assert_eq!(b.available(0), 4);
        assert_eq!(b.available(S), 6);
        assert!(TokenBucket::new(0, 1).is_err());
    }

    proptest! {
        #[test]
        fn matches_exact_model(
            ops in proptest::collection::vec((0u8..3, 0u64..15, 0u64..15, 0u64..3_000_000_000), 0..50)
        ) {
            // 60 tokens/min = 1 token per second exactly, so an exact model is easy.
            let (rate, burst) = (60u64, 10i128);
            let b = TokenBucket::new(rate, burst as u64).unwrap();
            let mut level_ns: i128 = burst * i128::from(S); // level in token-nanoseconds
            let mut now = 0u64;
            for (op, x, y, dt) in ops {
                now += dt;
                level_ns = (level_ns + i128::from(dt)).min(burst * i128::from(S));
                match op {
                    0 => {
                        let ok = x == 0 || i128::from(x) * i128::from(S) <= level_ns;
                        prop_assert_eq!(b.try_reserve(x, now).unwrap_or(false), ok && i128::from(x) <= burst);
                        if ok && i128::from(x) <= burst { level_ns -= i128::from(x) * i128::from(S); }
                    }
                    1 => {
                        b.reconcile(x, y, now);
                        level_ns = (level_ns + (i128::from(x) - i128::from(y)) * i128::from(S))
                            .clamp(-burst * i128::from(S), burst * i128::from(S));
                    }
                    _ => {}
                }
                prop_assert_eq!(i128::from(b.available(now)), level_ns.div_euclid(i128::from(S)));
            }
        }
    }
}
