//! Lock-free counters of concurrency slots (and, with weights, of in-flight tokens).

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use crate::error::CoreError;

/// "No limit" for a counter.
pub const UNLIMITED: u64 = u64::MAX;

/// The body of [`Rmw::update`] for any atomic integer type.
macro_rules! rmw_update {
    ($rmw:expr, $a:expr, $f:expr) => {{
        let mut f = $f;
        match $rmw {
            Rmw::Atomic => $a.fetch_update(Ordering::AcqRel, Ordering::Acquire, f),
            Rmw::Serialized => {
                let v = $a.load(Ordering::Relaxed);
                match f(v) {
                    Some(new) => {
                        $a.store(new, Ordering::Relaxed);
                        Ok(v)
                    }
                    None => Err(v),
                }
            }
        }
    }};
}

/// How a limiter makes its read-modify-writes.
///
/// Every counter is an atomic either way, so no mode can cause a data race; the mode only
/// decides whether concurrent updates are safe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Rmw {
    /// Compare-and-swap / fetch-and-add: correct for any number of threads and processes
    /// updating the same counters at once. The default, and the only mode for shared memory.
    #[default]
    Atomic,
    /// One atomic load and one atomic store (no locked instruction): correct only when the
    /// caller serialises every update of these counters, as CPython's GIL does for a private
    /// controller (the bindings call the core with it held and run no Python code in between).
    /// Concurrent callers would lose updates.
    Serialized,
}

impl Rmw {
    /// Replaces the value `v` of `a` by `f(v)` and returns `Ok(v)`, or leaves it and returns
    /// `Err(v)` when `f` returns `None` (the contract of [`AtomicU64::fetch_update`]).
    #[inline]
    pub fn update(self, a: &AtomicU64, f: impl FnMut(u64) -> Option<u64>) -> Result<u64, u64> {
        rmw_update!(self, a, f)
    }

    /// [`Rmw::update`] for a signed word (the token bucket's `tat`).
    #[inline]
    pub fn update_i64(self, a: &AtomicI64, f: impl FnMut(i64) -> Option<i64>) -> Result<i64, i64> {
        rmw_update!(self, a, f)
    }
}

/// A counter of held units (slots or tokens) with a runtime-settable limit.
///
/// `#[repr(C)]` and made only of atomics, so it can live in a shared-memory region; all-zero
/// bytes are a valid counter (nothing held, limit 0). Acquire and release are compare-and-swap
/// loops: the count is never above the limit in force at the moment of the acquire, and never
/// negative (an over-release is an error and changes nothing). Lowering the limit never cancels
/// what is held; it only blocks new acquires until the count drops below it.
#[repr(C)]
#[derive(Debug, Default)]
pub struct SlotCounter {
    in_use: AtomicU64,
    limit: AtomicU64,
}

impl SlotCounter {
    /// A counter with nothing held and the given limit (units).
    pub const fn new(limit: u64) -> Self {
        Self {
            in_use: AtomicU64::new(0),
            limit: AtomicU64::new(limit),
        }
    }

    /// Units held now.
    #[inline]
    pub fn in_use(&self) -> u64 {
        self.in_use.load(Ordering::Acquire)
    }

    /// The configured limit.
    #[inline]
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Acquire)
    }

    /// Sets the limit; held units are untouched.
    pub fn set_limit(&self, limit: u64) {
        self.limit.store(limit, Ordering::Release);
    }

    /// Takes `n` units if that keeps the count within the configured limit. `n == 0` always
    /// succeeds and changes nothing.
    #[inline]
    pub fn try_acquire(&self, n: u64) -> bool {
        self.try_acquire_within(n, self.limit())
    }

    /// Takes `n` units if that keeps the count within `limit` (an effective limit computed by the
    /// caller, e.g. scaled). Returns whether it did.
    #[inline]
    pub fn try_acquire_within(&self, n: u64, limit: u64) -> bool {
        try_acquire_atomic(&self.in_use, n, limit)
    }

    /// [`Self::try_acquire_within`] made in mode `rmw`.
    #[inline]
    pub fn try_acquire_within_in(&self, rmw: Rmw, n: u64, limit: u64) -> bool {
        try_acquire_in(rmw, &self.in_use, n, limit)
    }

    /// Gives back `n` units. Fails with [`CoreError::OverRelease`] (changing nothing) when fewer
    /// than `n` are held.
    #[inline]
    pub fn release(&self, n: u64) -> Result<(), CoreError> {
        if n == 0 {
            return Ok(());
        }
        Rmw::Atomic
            .update(&self.in_use, |cur| cur.checked_sub(n))
            .map(|_| ())
            .map_err(|held| CoreError::OverRelease { requested: n, held })
    }

    /// Gives back up to `n` units, stopping at zero; returns how many were given back. Used when
    /// reclaiming the holdings of a dead process.
    pub fn release_saturating(&self, n: u64) -> u64 {
        self.release_saturating_in(Rmw::Atomic, n)
    }

    /// [`Self::release_saturating`] made in mode `rmw`.
    #[inline]
    pub fn release_saturating_in(&self, rmw: Rmw, n: u64) -> u64 {
        let prev = rmw
            .update(&self.in_use, |v| Some(v.saturating_sub(n)))
            .unwrap_or(0);
        prev.min(n)
    }
}

/// Adds `n` to the count `a` if that keeps it within `limit` (a CAS loop); `n == 0` always
/// succeeds. The building block of [`SlotCounter`], also used on bare counters in the region.
#[inline]
pub fn try_acquire_atomic(a: &AtomicU64, n: u64, limit: u64) -> bool {
    try_acquire_in(Rmw::Atomic, a, n, limit)
}

/// [`try_acquire_atomic`] made in mode `rmw`.
#[inline]
pub fn try_acquire_in(rmw: Rmw, a: &AtomicU64, n: u64, limit: u64) -> bool {
    // Zero always fits, even above a lowered limit (nothing is taken).
    n == 0
        || rmw
            .update(a, |cur| {
                (cur <= limit && n <= limit - cur).then_some(cur + n)
            })
            .is_ok()
}

/// Adds `delta` to a plain atomic statistic or per-process ledger entry.
#[inline]
pub(crate) fn add(a: &AtomicU64, delta: u64) {
    add_in(Rmw::Atomic, a, delta);
}

/// [`add`] made in mode `rmw`.
#[inline]
pub(crate) fn add_in(rmw: Rmw, a: &AtomicU64, delta: u64) {
    if delta != 0 {
        match rmw {
            Rmw::Atomic => {
                a.fetch_add(delta, Ordering::AcqRel);
            }
            Rmw::Serialized => a.store(a.load(Ordering::Relaxed) + delta, Ordering::Relaxed),
        }
    }
}

/// Subtracts `delta` from a plain atomic statistic or ledger entry, stopping at zero.
#[inline]
pub(crate) fn sub(a: &AtomicU64, delta: u64) {
    sub_in(Rmw::Atomic, a, delta);
}

/// [`sub`] made in mode `rmw`.
#[inline]
pub(crate) fn sub_in(rmw: Rmw, a: &AtomicU64, delta: u64) {
    if delta != 0 {
        let _ = rmw.update(a, |v| Some(v.saturating_sub(delta)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;

    #[test]
    fn acquire_release_limits() {
        let c = SlotCounter::new(2);
        assert!(c.try_acquire(1));
        assert!(c.try_acquire(1));
        assert!(!c.try_acquire(1));
        assert!(c.try_acquire(0));
        c.release(2).unwrap();
        assert_eq!(c.in_use(), 0);
        assert_eq!(
            c.release(1),
            Err(CoreError::OverRelease {
                requested: 1,
                held: 0
            })
        );
    }

    #[test]
    fn lowering_limit_keeps_holders() {
        let c = SlotCounter::new(3);
        assert!(c.try_acquire(3));
        c.set_limit(1);
        assert_eq!(c.in_use(), 3);
        assert!(!c.try_acquire(1));
        c.release(2).unwrap();
        assert!(!c.try_acquire(1));
        c.release(1).unwrap();
        assert!(c.try_acquire(1));
    }

    #[test]
    fn threads_never_exceed_limit() {
        let c = Arc::new(SlotCounter::new(3));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        if c.try_acquire(1) {
                            assert!(c.in_use() <= 3);
                            c.release(1).unwrap();
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(c.in_use(), 0);
    }

    proptest! {
        #[test]
        fn matches_model(limit in 0u64..20, ops in proptest::collection::vec((any::<bool>(), 0u64..6), 0..60)) {
            let c = SlotCounter::new(limit);
            let mut model = 0u64;
            for (acq, n) in ops {
                if acq {
                    let ok = model + n <= limit;
                    prop_assert_eq!(c.try_acquire(n), ok);
                    if ok { model += n; }
                } else {
                    let ok = n <= model;
                    prop_assert_eq!(c.release(n).is_ok(), ok);
                    if ok { model -= n; }
                }
                prop_assert_eq!(c.in_use(), model);
                prop_assert!(model <= limit);
            }
        }
    }
}
