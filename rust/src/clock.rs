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
    /// `CLOCK_MONOTONIC`: system-wide, so processes sharing a shared-memory region agree on it.
    #[default]
    Monotonic,
    /// A test clock.
    Manual(Arc<ManualClock>),
}

impl Clock {
    /// The current time in nanoseconds.
    #[inline]
    pub fn now_ns(&self) -> u64 {
        match self {
            Clock::Monotonic => monotonic_ns(),
            Clock::Manual(c) => c.now_ns(),
        }
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds (system-wide on Linux, unlike `std::time::Instant`'s
/// unspecified epoch).
#[inline]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC is always available on Linux.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts);
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
}
