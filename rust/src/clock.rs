//! Clocks. Every limiter takes the current time as `now_ns` (nanoseconds); the clock that
//! produces it is either the system-wide monotonic clock or a manual clock that tests advance.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A manually advanced clock for tests: time only moves when [`ManualClock::advance_ns`] is
/// called. Shared by `Arc` between the test and the limiters it drives.
#[derive(Debug, Default)]
pub struct ManualClock {
    ns: AtomicU64,
}

impl ManualClock {
    /// A manual clock reading `start_ns` nanoseconds.
    pub fn new(start_ns: u64) -> Self {
        Self {
            ns: AtomicU64::new(start_ns),
        }
    }

    /// The current reading in nanoseconds.
    pub fn now_ns(&self) -> u64 {
        self.ns.load(Ordering::Acquire)
    }

    /// Moves the clock forward by `delta_ns` nanoseconds (saturating).
    pub fn advance_ns(&self, delta_ns: u64) {
        let _ = self
            .ns
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(v.saturating_add(delta_ns))
            });
    }
}

/// The time source of a limiter.
#[derive(Debug, Clone, Default)]
pub enum Clock {
    /// The system-wide monotonic clock at the kernel's tick resolution ([`monotonic_ns`]), so
    /// processes sharing a shared-memory region agree on it.
    #[default]
    Monotonic,
    /// A test clock.
    Manual(Arc<ManualClock>),
}

impl Clock {
    /// The current time in nanoseconds (the system clock: [`monotonic_ns`], tick resolution).
    #[inline]
    pub fn now_ns(&self) -> u64 {
        match self {
            Clock::Monotonic => monotonic_ns(),
            Clock::Manual(c) => c.now_ns(),
        }
    }

    /// The current time in nanoseconds to the nanosecond (the system clock:
    /// [`precise_monotonic_ns`], the clock of Python's `time.monotonic()` and of asyncio's loop),
    /// for what is read seldom and compared with times taken in Python, such as the adaptive
    /// law's steps.
    #[inline]
    pub fn precise_now_ns(&self) -> u64 {
        match self {
            Clock::Monotonic => precise_monotonic_ns(),
            Clock::Manual(c) => c.now_ns(),
        }
    }
}

/// `CLOCK_MONOTONIC_COARSE` in nanoseconds: system-wide on Linux (unlike
/// `std::time::Instant`'s unspecified epoch), never going back, advancing once per kernel tick
/// ([`resolution_ns`]: 1 to 10 ms, 4 ms on the machine of `benches/RESULTS.md`).
///
/// Why the coarse clock: admit reads the clock once per request, and a `CLOCK_MONOTONIC`
/// reading (the vDSO converting the time-stamp counter) costs about 22 ns there against about
/// 6 ns for the coarse one, which returns the time of the last tick (`bench_floor_primitives`
/// times both). The limits are per minute, so a tick is little: a token bucket refills in steps
/// of one tick instead of continuously (at 1,000,000 tokens per minute, 67 tokens per 4 ms
/// tick), and a retry hint or a hold time is off by at most a tick.
#[inline]
pub fn monotonic_ns() -> u64 {
    read(libc::CLOCK_MONOTONIC_COARSE)
}

/// The resolution of [`monotonic_ns`] in nanoseconds (`clock_getres`), at least 1.
pub fn resolution_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is always available on Linux.
    unsafe {
        libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &raw mut ts);
    }
    ((ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64))
    .max(1)
}

/// `CLOCK_MONOTONIC` in nanoseconds, to the nanosecond (what [`Clock::precise_now_ns`] reads;
/// `bench_floor_primitives` times it next to [`monotonic_ns`]).
#[inline]
pub fn precise_monotonic_ns() -> u64 {
    read(libc::CLOCK_MONOTONIC)
}

#[inline]
fn read(id: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; both monotonic clocks are always available on
    // Linux.
    unsafe {
        libc::clock_gettime(id, &raw mut ts);
    }
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_advanced() {
        let c = Arc::new(ManualClock::new(5));
        let clock = Clock::Manual(c.clone());
        assert_eq!(clock.now_ns(), 5);
        c.advance_ns(10);
        assert_eq!(clock.now_ns(), 15);
        c.advance_ns(u64::MAX);
        assert_eq!(clock.now_ns(), u64::MAX);
    }

    #[test]
    fn monotonic_does_not_go_back() {
        let a = Clock::Monotonic.now_ns();
        let b = Clock::Monotonic.now_ns();
        assert!(b >= a);
        assert!(a > 0);
    }

    #[test]
    fn coarse_clock_follows_the_precise_one_within_a_tick() {
        let res = resolution_ns();
        assert!((1..=100_000_000).contains(&res), "{res}");
        for _ in 0..1_000 {
            let before = precise_monotonic_ns();
            let coarse = monotonic_ns();
            let after = precise_monotonic_ns();
            // the last tick before the reading: never ahead of the precise clock, at most a
            // tick (plus scheduling slack) behind it
            assert!(coarse <= after, "{coarse} > {after}");
            assert!(
                before.saturating_sub(coarse) <= res + 50_000_000,
                "{before} {coarse}"
            );
        }
        let first = monotonic_ns();
        std::thread::sleep(std::time::Duration::from_nanos(2 * res));
        assert!(
            monotonic_ns() > first,
            "the coarse clock advances tick by tick"
        );
    }
}
