//! Read-only views of the state: backend and tenant snapshots, and the numbers behind the
//! `x-ratelimit-*` response headers.

use std::sync::atomic::Ordering;

use super::config::GuaranteedBackends;
use super::region::read_name;
use super::{scaled, Admission, OVERLOAD_BIT, SCALE_ONE, SHED_BIT};
use crate::error::CoreError;
use crate::priority::Priority;
use crate::slots::UNLIMITED;

/// A snapshot of a backend for status pages and `x-ratelimit-*` headers.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendSnapshot {
    /// Name.
    pub name: String,
    /// Current scale (0..1].
    pub scale: f64,
    /// Whether the sheddable class is shed.
    pub shedding: bool,
    /// Whether the backend is overloaded: the scale binds every class, not only `sheddable`.
    pub overloaded: bool,
    /// Base concurrency limit.
    pub max_concurrency: u64,
    /// Scaled concurrency limit.
    pub effective_concurrency: u64,
    /// Slots held.
    pub in_use: u64,
    /// Sum of the guarantees of the tenants whose guarantee applies to this backend (base).
    pub guaranteed_slots: u64,
    /// Burst pool size after scaling.
    pub burst_pool: u64,
    /// Burst pool slots held.
    pub burst_in_use: u64,
    /// Base TPM.
    pub tokens_per_minute: u64,
    /// Scaled TPM.
    pub effective_tokens_per_minute: u64,
    /// Base bucket capacity.
    pub burst_tokens: u64,
    /// Scaled bucket capacity.
    pub effective_burst_tokens: u64,
    /// Tokens in the bucket now (negative in debt).
    pub available_tokens: i64,
    /// Nanoseconds until the bucket is full.
    pub time_to_full_ns: u64,
    /// In-flight tokens held.
    pub inflight_tokens: u64,
    /// Base in-flight budget (`None` = unlimited).
    pub inflight_token_limit: Option<u64>,
    /// The engine's KV occupancy beyond kvgate's in-flight tokens (tokens), as last set by
    /// [`Admission::set_inflight_external`].
    pub inflight_external_tokens: u64,
    /// In-flight budget in force: base less `inflight_external_tokens`, never below 0 (never
    /// scaled; `None` = unlimited).
    pub effective_inflight_token_limit: Option<u64>,
    /// EWMA (weight 1/8) of slot hold times (ns). With the system clock it is fed by the first
    /// release, then by about one release in eight (a random draw); a manual clock: every one.
    pub hold_time_ewma_ns: u64,
}

/// What `OpenAI`'s `x-ratelimit-*` headers say for one tenant on one backend
/// ([`Admission::rate_limits`]; formatted by [`crate::headers::rate_limit_headers`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimits {
    /// The tenant's concurrency limit if it has one, else the backend's effective one (slots).
    pub limit_requests: u64,
    /// Free slots under that limit (never negative).
    pub remaining_requests: u64,
    /// Estimated nanoseconds until a slot frees (the backend's hold-time EWMA) when none is
    /// free, else 0.
    pub reset_requests_ns: u64,
    /// The tenant's TPM if it has one, else the backend's effective TPM (tokens per minute).
    pub limit_tokens: u64,
    /// Tokens in that bucket now (0 in debt).
    pub remaining_tokens: u64,
    /// Nanoseconds until that bucket is full again.
    pub reset_tokens_ns: u64,
    /// The request figures are the tenant's own concurrency limit (else the backend's).
    pub tenant_requests: bool,
    /// The token figures are the tenant's own TPM bucket (else the backend's).
    pub tenant_tokens: bool,
    /// A token limit applies: the tenant's own TPM, or a backend TPM below
    /// [`UNLIMITED_TPM`]. Without one the token headers are left out
    /// ([`crate::headers::rate_limit_header_count`]).
    pub tokens_limited: bool,
}

/// A backend token rate at or above this (tokens per minute) is no limit: the gateway
/// registers a backend without `tokens_per_minute` with 2^40 tokens per minute, a bucket that
/// never binds.
pub const UNLIMITED_TPM: u64 = 1 << 40;

/// A snapshot of a tenant.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantSnapshot {
    /// Name.
    pub name: String,
    /// Priority class.
    pub priority: Priority,
    /// Guaranteed slots on each backend of `guaranteed_backends`.
    pub guaranteed_slots: u64,
    /// Ids of the registered backends the guarantee applies to.
    pub guaranteed_backends: Vec<u32>,
    /// Concurrency limit (`None` = unlimited).
    pub max_concurrency: Option<u64>,
    /// Requests held across backends.
    pub in_use: u64,
    /// TPM (`None` = no tenant TPM limit).
    pub tokens_per_minute: Option<u64>,
    /// Bucket capacity.
    pub burst_tokens: Option<u64>,
    /// Tokens available now.
    pub available_tokens: Option<i64>,
    /// Nanoseconds until the bucket is full.
    pub time_to_full_ns: Option<u64>,
}

impl Admission {
    /// A snapshot of a backend.
    pub fn backend_state(&self, id: u32) -> Result<BackendSnapshot, CoreError> {
        let b = self.backend(id)?;
        let now = self.clock.now_ns();
        let ppm = b.scale_ppm.load(Ordering::Acquire);
        let conc = b.max_concurrency.load(Ordering::Acquire);
        let eff = scaled(conc, ppm);
        let g = b.total_guaranteed.load(Ordering::Acquire);
        let (rate, burst) = (b.tpm.rate(), b.tpm.burst());
        let (erate, eburst) = (scaled(rate, ppm), scaled(burst, ppm));
        let il = b.inflight.limit();
        Ok(BackendSnapshot {
            name: read_name(&b.name),
            scale: ppm as f64 / SCALE_ONE as f64,
            shedding: b.shedding.load(Ordering::Acquire) & SHED_BIT != 0,
            overloaded: b.shedding.load(Ordering::Acquire) & OVERLOAD_BIT != 0,
            max_concurrency: conc,
            effective_concurrency: eff,
            in_use: b.in_use.load(Ordering::Acquire),
            guaranteed_slots: g,
            burst_pool: eff.saturating_sub(g),
            burst_in_use: b.burst.in_use(),
            tokens_per_minute: rate,
            effective_tokens_per_minute: erate,
            burst_tokens: burst,
            effective_burst_tokens: eburst,
            available_tokens: b.tpm.available_with(now, erate, eburst),
            time_to_full_ns: b.tpm.time_to_full_ns_with(now, erate, eburst),
            inflight_tokens: b.inflight.in_use(),
            inflight_token_limit: (il != UNLIMITED).then_some(il),
            inflight_external_tokens: b.inflight_external.load(Ordering::Acquire),
            effective_inflight_token_limit: (il != UNLIMITED).then(|| b.effective_inflight_limit()),
            hold_time_ewma_ns: b.ewma_hold_ns.load(Ordering::Relaxed),
        })
    }

    /// The numbers behind the `x-ratelimit-*` headers for `tenant` on `backend`: the tenant's
    /// own limits where it has them, else the backend's effective (scaled) ones. One read of
    /// the atomics, no allocation (the hot path of every response).
    ///
    /// Errors: unknown ids.
    pub fn rate_limits(&self, backend: u32, tenant: u32) -> Result<RateLimits, CoreError> {
        let b = self.backend(backend)?;
        let t = self.tenant(tenant)?;
        let now = self.clock.now_ns();
        let ppm = b.scale_ppm.load(Ordering::Acquire);
        let t_limit = t.conc.limit();
        let (limit_r, used) = if t_limit == UNLIMITED {
            (
                scaled(b.max_concurrency.load(Ordering::Acquire), ppm),
                b.in_use.load(Ordering::Acquire),
            )
        } else {
            (t_limit, t.conc.in_use())
        };
        let reset_r = if used >= limit_r {
            b.ewma_hold_ns.load(Ordering::Relaxed)
        } else {
            0
        };
        let tenant_tokens = t.has_tpm.load(Ordering::Acquire) == 1;
        let (limit_t, avail, full) = if tenant_tokens {
            (
                t.tpm.rate(),
                t.tpm.available(now),
                t.tpm.time_to_full_ns(now),
            )
        } else {
            let (rate, burst) = (scaled(b.tpm.rate(), ppm), scaled(b.tpm.burst(), ppm));
            (
                rate,
                b.tpm.available_with(now, rate, burst),
                b.tpm.time_to_full_ns_with(now, rate, burst),
            )
        };
        Ok(RateLimits {
            limit_requests: limit_r,
            remaining_requests: limit_r.saturating_sub(used),
            reset_requests_ns: reset_r,
            limit_tokens: limit_t,
            remaining_tokens: u64::try_from(avail).unwrap_or(0),
            reset_tokens_ns: full,
            tenant_requests: t_limit != UNLIMITED,
            tenant_tokens,
            tokens_limited: tenant_tokens || b.tpm.rate() < UNLIMITED_TPM,
        })
    }

    /// A snapshot of a tenant.
    pub fn tenant_state(&self, id: u32) -> Result<TenantSnapshot, CoreError> {
        let t = self.tenant(id)?;
        let c = self.tenant_config(id)?;
        let now = self.clock.now_ns();
        let has = c.tokens_per_minute.is_some();
        let in_use = t.conc.in_use();
        Ok(TenantSnapshot {
            name: read_name(&t.name),
            priority: c.priority,
            guaranteed_slots: c.guaranteed_slots,
            guaranteed_backends: match c.guaranteed_backends {
                GuaranteedBackends::All => (0..self.backend_count()).collect(),
                GuaranteedBackends::Only(ids) => ids,
            },
            max_concurrency: c.max_concurrency,
            in_use,
            tokens_per_minute: c.tokens_per_minute,
            burst_tokens: c.burst_tokens,
            available_tokens: has.then(|| t.tpm.available(now)),
            time_to_full_ns: has.then(|| t.tpm.time_to_full_ns(now)),
        })
    }
}
