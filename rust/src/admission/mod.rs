//! The admission controller: one call admits a request for (backend, tenant, priority class,
//! tokens) against every limit that applies, or says which limit refused and when to retry.
//!
//! All state lives in one region made only of atomics (`region.rs`), sized when it is created
//! ([`Capacity`]: no fixed ceiling on tenants or backends), either heap-allocated (one process)
//! or mapped from named shared memory (several worker processes sharing one set of limits). The
//! code path is the same both ways. The hot path (`admit`, `release`) takes no lock: every
//! limit is a compare-and-swap counter or a one-word GCRA token bucket, and its cost does not
//! depend on the number of tenants or backends. Registration of backends / tenants (rare) takes
//! a small spin lock in the region.
//!
//! Concurrency slots of a backend: the guaranteed slots of each tenant whose guarantee applies
//! to that backend ([`TenantConfig::guaranteed_backends`]; all backends by default) are carved
//! out of the backend's (scaled) concurrency limit; the rest is the shared burst pool. When the scale
//! shrinks the limit, the burst pool shrinks first; guarantees shrink (proportionally) only when
//! the limit is below their sum. `critical` and `standard` requests use the tenant's guaranteed
//! slots first, then the burst pool; `sheddable` requests use only the burst pool and are refused
//! as a whole while the backend is shedding. The scale binds the `sheddable` class always (its
//! requests fit under the scaled limit counting every class's slots) and `critical` /
//! `standard` only while the backend is overloaded ([`Admission::set_overload`]: KV pressure at
//! or above the high watermark); between the watermarks they keep the base limits
//! ([`class_ppm`]). The scale applies to
//! concurrency and TPM only: the
//! in-flight token budget in force is the base budget less the engine's external KV occupancy
//! ([`Admission::set_inflight_external`]), for every request, guaranteed slot or not.
//!
//! Crash safety: every process attached to a shared region keeps its own held counts in the
//! region (a private heap region, which dies with its one process, keeps none); `reclaim_dead`
//! (from any live process) gives back what a dead process held. A process is identified by pid and
//! start time, so a reused pid is not mistaken for the dead one. Counters are updated global
//! first, ledger second on acquire, and ledger first, global second on release: a kill between
//! the two can leak one unit (the limit shrinks by one) but never frees a unit twice.

mod board;
mod config;
mod region;
mod route;
mod snapshot;
#[cfg(test)]
mod tests;

pub use board::BOARD_PAYLOAD_BYTES;
pub use config::{BackendConfig, GuaranteedBackends, TenantConfig, ALL_BACKENDS};
pub use region::{
    BackendState, Capacity, GuarEntry, Header, ProcLedger, TenantState, MAX_NAME_LEN, MAX_PROCS,
};
pub use snapshot::{BackendSnapshot, RateLimits, TenantSnapshot, UNLIMITED_TPM};

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::clock::Clock;
use crate::error::{check_amount, CoreError};
use crate::priority::Priority;
use crate::slots::{add, add_in, sub, sub_in, try_acquire_in, Rmw, UNLIMITED};
use crate::token_bucket::TokenBucket;

use region::{Layout, Names, Storage};

const SCALE_ONE: u64 = 1_000_000; // scale is stored in parts per million
/// Bit of a backend's flag word: the `sheddable` class is shed.
const SHED_BIT: u64 = 1;
/// Bit of a backend's flag word: the backend is overloaded, the scale binds every class.
const OVERLOAD_BIT: u64 = 2;
/// Retry-after hint (ns) when a refusal depends on the adaptive scale (shed, scaled-down limit).
const SCALE_RETRY_NS: u64 = 1_000_000_000;
/// Retry-after hint (ns) for slot refusals before any hold time has been measured.
const DEFAULT_HOLD_NS: u64 = 1_000_000_000;
const MIN_RETRY_NS: u64 = 1_000_000;

/// Why a request was refused. `as_str` gives the low-cardinality label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The tenant's token bucket (TPM).
    TenantTpm,
    /// The tenant's concurrency limit.
    TenantConcurrency,
    /// The backend's concurrency slots (guaranteed + burst pool).
    BackendSlots,
    /// The backend's token bucket (TPM).
    BackendTpm,
    /// The backend's in-flight token budget.
    InflightTokens,
    /// The class is being shed.
    Shed,
}

impl Reason {
    /// The label: `tenant-tpm`, `tenant-concurrency`, `backend-slots`, `backend-tpm`,
    /// `inflight-tokens`, `shed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::TenantTpm => "tenant-tpm",
            Reason::TenantConcurrency => "tenant-concurrency",
            Reason::BackendSlots => "backend-slots",
            Reason::BackendTpm => "backend-tpm",
            Reason::InflightTokens => "inflight-tokens",
            Reason::Shed => "shed",
        }
    }

    /// Whose limit refused: `"tenant"` (HTTP 429) or `"backend"` (HTTP 503).
    pub fn scope(self) -> &'static str {
        match self {
            Reason::TenantTpm | Reason::TenantConcurrency => "tenant",
            _ => "backend",
        }
    }
}

/// A refusal: nothing is held after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// Which limit refused.
    pub reason: Reason,
    /// Estimated nanoseconds until a retry may succeed; `None` when it never can.
    pub retry_after_ns: Option<u64>,
}

/// Which pool a reservation's slot came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pool {
    /// The tenant's guaranteed slots on that backend.
    Guaranteed,
    /// The backend's shared burst pool.
    Burst,
}

/// What an admitted request holds; give it back with [`Admission::release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    /// Backend id.
    pub backend: u32,
    /// Tenant id.
    pub tenant: u32,
    /// Pool of the slot.
    pub pool: Pool,
    /// Tokens reserved (prompt + reserved completion).
    pub tokens: u64,
    /// Admission time (ns, controller clock).
    pub admitted_ns: u64,
    /// Effective (scaled) backend TPM the reservation was charged at (tokens per minute).
    pub backend_rate: u64,
    /// Tenant TPM the reservation was charged at; 0 when the tenant had no TPM limit.
    pub tenant_rate: u64,
}

/// The admission controller over one region.
pub struct Admission {
    storage: Storage,
    /// Start of the region (heap block or mapping, owned by `storage`).
    base: NonNull<u8>,
    /// Where the arrays of the region are.
    lay: Layout,
    clock: Clock,
    proc_idx: usize,
    /// Whether admit / release keep this process's ledger: only for a shared region, where
    /// another process may have to reclaim what this one held. A private heap region dies
    /// with its process, so its ledger would never be read.
    ledger: bool,
    /// How admit / release update the limits: [`Rmw::Atomic`] unless the controller was made
    /// by [`Admission::new_heap_serialized`].
    rmw: Rmw,
    leaks: AtomicU64,
    /// Backend name → id, this process's cache.
    backend_names: Mutex<Names>,
    /// Tenant name → id, this process's cache.
    tenant_names: Mutex<Names>,
}

// SAFETY: the region is made only of atomics and outlives `Admission` (owned by `storage`).
unsafe impl Send for Admission {}
// SAFETY: idem.
unsafe impl Sync for Admission {}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("shm", &self.shm_name())
            .field("proc_idx", &self.proc_idx)
            .finish_non_exhaustive()
    }
}

#[inline]
fn scaled(base: u64, ppm: u64) -> u64 {
    if base == UNLIMITED || base == 0 || ppm == SCALE_ONE {
        return base;
    }
    ((u128::from(base) * u128::from(ppm) / u128::from(SCALE_ONE)) as u64).max(1)
}

/// The scale (parts per million) a request of `priority` is admitted at, given the backend's
/// scale `ppm` and whether it is overloaded ([`Admission::set_overload`]): under memory
/// pressure the low-priority work gives way first. The `sheddable` class always feels the
/// scale (between the watermarks it fills at most the scaled limit, counting the slots every
/// class holds, so it gives way as pressure rises); `critical` and `standard` feel it only while
/// the backend is overloaded (KV pressure at or above the high watermark, or stale metrics),
/// else they keep the base limits. The in-flight token budget (the engine's KV memory) binds
/// every class.
#[inline]
pub(crate) fn class_ppm(ppm: u64, priority: Priority, overloaded: bool) -> u64 {
    if priority == Priority::Sheddable || overloaded {
        ppm
    } else {
        SCALE_ONE
    }
}

impl Admission {
    /// Takes `tokens` from bucket `tb` (effective `rate` / `burst`) at `now` (the tick-resolution
    /// clock), or returns the retry-after hint (ns).
    ///
    /// Before refusing it looks again at the precise clock, and the hint is computed from it:
    /// the tick clock lags real time by up to a tick (4 ms, and a little more, here), so a
    /// decision and a hint taken from it alone would refuse about half of the clients that
    /// retry exactly when told to (the clock they retry by has moved on; the tick clock may not
    /// have). With the precise look, a retry at or after the hint finds the tokens, as with a
    /// precise clock throughout. Refusals are rare, so the hot path keeps its cheap reading.
    fn reserve(
        &self,
        tb: &TokenBucket,
        tokens: u64,
        now: u64,
        rate: u64,
        burst: u64,
    ) -> Result<(), u64> {
        if tb.try_reserve_in(self.rmw, tokens, now, rate, burst) {
            return Ok(());
        }
        // never before `now`: the manual clock gives the same reading twice
        let precise = self.clock.precise_now_ns().max(now);
        if precise > now && tb.try_reserve_in(self.rmw, tokens, precise, rate, burst) {
            return Ok(());
        }
        Err(tb
            .retry_after_ns_with(tokens, precise, rate, burst)
            .unwrap_or(SCALE_RETRY_NS)
            .max(MIN_RETRY_NS))
    }

    fn slot_retry(b: &BackendState, in_use: u64) -> u64 {
        let hold = match b.ewma_hold_ns.load(Ordering::Relaxed) {
            0 => DEFAULT_HOLD_NS,
            h => h,
        };
        (hold / in_use.max(1)).max(MIN_RETRY_NS)
    }

    /// Admits a request of `tokens` (prompt + reserved completion) for `tenant` at `priority`
    /// on `backend`, or refuses it. After a refusal nothing is held.
    ///
    /// Errors: unknown ids, or `tokens` above [`MAX_AMOUNT`].
    #[allow(clippy::too_many_lines)] // one linear sequence of checks with their rollbacks
    pub fn admit(
        &self,
        backend: u32,
        tenant: u32,
        priority: Priority,
        tokens: u64,
    ) -> Result<Result<Ticket, Refusal>, CoreError> {
        check_amount("tokens", i128::from(tokens))?;
        let b = self.backend(backend)?;
        let t = self.tenant(tenant)?;
        let refuse = |reason, retry_after_ns| {
            Ok(Err(Refusal {
                reason,
                retry_after_ns,
            }))
        };
        let has_tpm = t.has_tpm.load(Ordering::Acquire) == 1;
        // Never admissible (against base limits).
        if has_tpm && tokens > t.tpm.burst() {
            return refuse(Reason::TenantTpm, None);
        }
        if tokens > b.tpm.burst() {
            return refuse(Reason::BackendTpm, None);
        }
        if tokens > b.inflight.limit() {
            return refuse(Reason::InflightTokens, None);
        }
        let flags = b.shedding.load(Ordering::Acquire);
        if priority == Priority::Sheddable && flags & SHED_BIT != 0 {
            return refuse(Reason::Shed, Some(SCALE_RETRY_NS));
        }
        let now = self.clock.now_ns();
        let ppm = class_ppm(
            b.scale_ppm.load(Ordering::Acquire),
            priority,
            flags & OVERLOAD_BIT != 0,
        );
        let rmw = self.rmw;

        // Tenant concurrency.
        // Always counted (limit UNLIMITED when none), so the tenant's in_use is exact.
        if !t.conc.try_acquire_within_in(rmw, 1, t.conc.limit()) {
            return refuse(
                Reason::TenantConcurrency,
                Some(Self::slot_retry(b, t.conc.in_use())),
            );
        }
        let undo_tenant_conc = || {
            t.conc.release_saturating_in(rmw, 1).into_unit();
        };
        // Tenant TPM.
        let (t_rate, t_burst) = (t.tpm.rate(), t.tpm.burst());
        if has_tpm {
            if let Err(ra) = self.reserve(&t.tpm, tokens, now, t_rate, t_burst) {
                undo_tenant_conc();
                return refuse(Reason::TenantTpm, Some(ra));
            }
        }
        let undo_tenant = || {
            undo_tenant_conc();
            if has_tpm {
                t.tpm.refund_in(rmw, tokens, t_rate);
            }
        };
        // Backend slot: guaranteed first (not for sheddable), then the burst pool.
        let limit = scaled(b.max_concurrency.load(Ordering::Acquire), ppm);
        let g_total = b.total_guaranteed.load(Ordering::Acquire);
        // The guarantee table is read only for a tenant with guaranteed slots.
        let entry =
            if priority != Priority::Sheddable && t.guaranteed_slots.load(Ordering::Acquire) > 0 {
                self.find_entry(tenant, backend)
            } else {
                None
            };
        let (g_t, guar) = match entry {
            Some(i) => {
                let e = self.entry_at(i);
                (e.guaranteed.load(Ordering::Acquire), Some(&e.in_use))
            }
            None => (0, None),
        };
        let mut pool = None;
        if let (Some(guar), true) = (guar, g_t > 0) {
            let g_eff = if limit >= g_total {
                g_t
            } else {
                (u128::from(g_t) * u128::from(limit) / u128::from(g_total)) as u64
            };
            if try_acquire_in(rmw, guar, 1, g_eff) {
                pool = Some(Pool::Guaranteed);
            }
        }
        // The in_use test only binds after a guarantee was lowered or moved away while its
        // slots are held (otherwise burst + guaranteed in use <= limit already).
        if pool.is_none() && b.in_use.load(Ordering::Acquire) < limit {
            let burst_pool = limit.saturating_sub(g_total);
            if b.burst.try_acquire_within_in(rmw, 1, burst_pool) {
                pool = Some(Pool::Burst);
            }
        }
        let Some(pool) = pool else {
            undo_tenant();
            return refuse(
                Reason::BackendSlots,
                Some(Self::slot_retry(b, b.in_use.load(Ordering::Relaxed))),
            );
        };
        let undo_slot = || match pool {
            Pool::Guaranteed => {
                if let Some(guar) = guar {
                    sub_in(rmw, guar, 1);
                }
            }
            Pool::Burst => b.burst.release_saturating_in(rmw, 1).into_unit(),
        };
        // In-flight tokens: the base budget (the engine's KV capacity × safety factor, or the
        // configured one) less the engine's external KV occupancy (what it holds beyond our
        // in-flight tokens, from its metrics). The adaptive scale never shrinks it: the budget
        // already is the engine's memory, so scaling it by KV pressure too counted that pressure
        // twice and, under long generations, pushed it below the tokens already in flight. A
        // guaranteed slot is held to the same budget: it guarantees a slot, not memory the
        // engine does not have (another client's tokens are real), and never more than base.
        let inflight_limit = b.effective_inflight_limit();
        if !b
            .inflight
            .try_acquire_within_in(rmw, tokens, inflight_limit)
        {
            undo_slot();
            undo_tenant();
            let ra = if tokens > inflight_limit {
                SCALE_RETRY_NS
            } else {
                Self::slot_retry(b, b.in_use.load(Ordering::Relaxed))
            };
            return refuse(Reason::InflightTokens, Some(ra));
        }
        // Backend TPM (scaled).
        let rate = scaled(b.tpm.rate(), ppm);
        let burst = scaled(b.tpm.burst(), ppm);
        if let Err(ra) = self.reserve(&b.tpm, tokens, now, rate, burst) {
            b.inflight.release_saturating_in(rmw, tokens).into_unit();
            undo_slot();
            undo_tenant();
            return refuse(Reason::BackendTpm, Some(ra));
        }
        add_in(rmw, &b.in_use, 1);
        if self.ledger {
            // Ledger of this process (global first, ledger second).
            let p = self.proc_at(self.proc_idx);
            let bi = backend as usize;
            add(&p.backend_total[bi], 1);
            match (pool, entry) {
                (Pool::Guaranteed, Some(gi)) => add(&p.guar[gi], 1),
                _ => add(&p.backend_burst[bi], 1),
            }
            add(&p.backend_inflight[bi], tokens);
            add(&p.tenant_conc[tenant as usize], 1);
        }
        Ok(Ok(Ticket {
            backend,
            tenant,
            pool,
            tokens,
            admitted_ns: now,
            backend_rate: rate,
            tenant_rate: if has_tpm { t_rate } else { 0 },
        }))
    }

    /// Releases what `ticket` holds and reconciles the token buckets with `actual` tokens
    /// (prompt + real completion; `None` = as reserved). Call exactly once per ticket.
    ///
    /// Errors: `actual` above [`MAX_AMOUNT`] (nothing is released then).
    pub fn release(&self, ticket: &Ticket, actual: Option<u64>) -> Result<(), CoreError> {
        let actual = match actual {
            Some(a) => check_amount("actual tokens", i128::from(a))?,
            None => ticket.tokens,
        };
        let b = self.backend(ticket.backend)?;
        let t = self.tenant(ticket.tenant)?;
        let (bi, ti) = (ticket.backend as usize, ticket.tenant as usize);
        let rmw = self.rmw;
        // A guaranteed slot was counted in the (tenant, backend) entry, which is never removed.
        let entry = match ticket.pool {
            Pool::Guaranteed => Some(self.find_entry(ticket.tenant, ticket.backend).ok_or_else(
                || {
                    CoreError::SharedState(format!(
                        "no guarantee entry for tenant {} on backend {}",
                        ticket.tenant, ticket.backend
                    ))
                },
            )?),
            Pool::Burst => None,
        };
        if self.ledger {
            // Ledger first, global second.
            let p = self.proc_at(self.proc_idx);
            sub(&p.backend_total[bi], 1);
            match entry {
                Some(gi) => sub(&p.guar[gi], 1),
                None => sub(&p.backend_burst[bi], 1),
            }
            sub(&p.backend_inflight[bi], ticket.tokens);
            sub(&p.tenant_conc[ti], 1);
        }
        sub_in(rmw, &b.in_use, 1);
        match ticket.pool {
            Pool::Guaranteed => {
                if let Some(gi) = entry {
                    sub_in(rmw, &self.entry_at(gi).in_use, 1);
                }
            }
            Pool::Burst => b.burst.release_saturating_in(rmw, 1).into_unit(),
        }
        b.inflight
            .release_saturating_in(rmw, ticket.tokens)
            .into_unit();
        t.conc.release_saturating_in(rmw, 1).into_unit();
        // Reconcile both buckets with the real usage. Unused tokens give back the time they
        // were charged (at the rate of the admission, so a scale change in between neither
        // inflates nor shrinks the refund), with no clock reading; an overrun is new usage,
        // charged now at today's rates (one clock reading).
        let now = std::cell::OnceCell::new();
        let now_ns = || *now.get_or_init(|| self.clock.now_ns());
        match actual.cmp(&ticket.tokens) {
            std::cmp::Ordering::Less => {
                let unused = ticket.tokens - actual;
                if ticket.tenant_rate != 0 {
                    t.tpm.refund_in(rmw, unused, ticket.tenant_rate);
                }
                b.tpm.refund_in(rmw, unused, ticket.backend_rate);
            }
            std::cmp::Ordering::Greater => {
                let over = actual - ticket.tokens;
                if t.has_tpm.load(Ordering::Acquire) == 1 {
                    t.tpm
                        .charge_in(rmw, over, now_ns(), t.tpm.rate(), t.tpm.burst());
                }
                let ppm = b.scale_ppm.load(Ordering::Acquire);
                b.tpm.charge_in(
                    rmw,
                    over,
                    now_ns(),
                    scaled(b.tpm.rate(), ppm),
                    scaled(b.tpm.burst(), ppm),
                );
            }
            std::cmp::Ordering::Equal => {}
        }
        // EWMA (1/8) of hold times, racy by design: it is only an estimate. With the system
        // clock the first release and about one in HOLD_SAMPLE_EVERY (a random draw) are
        // timed, so most releases read no clock; a manual clock times every release.
        let old = b.ewma_hold_ns.load(Ordering::Relaxed);
        if old == 0 || matches!(self.clock, Clock::Manual(_)) || hold_sample() {
            let hold = now_ns().saturating_sub(ticket.admitted_ns).max(1);
            let new = if old == 0 {
                hold
            } else {
                (i128::from(old) + (i128::from(hold) - i128::from(old)) / 8).max(1) as u64
            };
            b.ewma_hold_ns.store(new, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// Releases timed for the hold-time EWMA with the system clock: one in this many on average.
const HOLD_SAMPLE_EVERY: u32 = 8;

/// Whether this release is one of the timed ones: a per-thread xorshift draw (no atomic), so
/// that every backend gets its share of samples whatever order one thread releases them in
/// (a counter would always pick the same backend of a round-robin over 2, 4 or 8).
#[inline]
fn hold_sample() -> bool {
    thread_local! {
        static STATE: std::cell::Cell<u64> = const { std::cell::Cell::new(0x9e37_79b9_7f4a_7c15) };
    }
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        (x >> 32) % u64::from(HOLD_SAMPLE_EVERY) == 0
    })
}

/// Discards a count where only the side effect matters.
trait IntoUnit {
    fn into_unit(self);
}

impl IntoUnit for u64 {
    fn into_unit(self) {}
}
