//! Backend and tenant configuration: the limits, their validation, and registration and hot
//! reload of backends and tenants in the region.

use std::sync::atomic::Ordering;

use super::region::{read_name, write_name, TenantState, MAX_BACKENDS, MAX_TENANTS, NAME_WORDS};
use super::{Admission, SCALE_ONE};
use crate::error::{CoreError, MAX_AMOUNT};
use crate::priority::Priority;
use crate::slots::UNLIMITED;
use crate::token_bucket::TokenBucket;

/// [`TenantConfig::guaranteed_backends`] value: the guarantee applies to every backend,
/// including backends registered later.
pub const ALL_BACKENDS: u64 = u64::MAX;
/// Longest backend / tenant name in bytes.
pub const MAX_NAME_LEN: usize = NAME_WORDS * 8;

/// Configuration of a backend (base limits, before scaling).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendConfig {
    /// Concurrency limit (slots), >= 1.
    pub max_concurrency: u64,
    /// Token bucket rate (tokens per minute), >= 1.
    pub tokens_per_minute: u64,
    /// Token bucket capacity (tokens); defaults to `tokens_per_minute`.
    pub burst_tokens: Option<u64>,
    /// In-flight token budget (tokens); `None` = unlimited.
    pub inflight_token_limit: Option<u64>,
}

/// Configuration of a tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantConfig {
    /// The tenant's (default) priority class.
    pub priority: Priority,
    /// Tenant token bucket rate (tokens per minute); `None` = no tenant TPM limit.
    pub tokens_per_minute: Option<u64>,
    /// Tenant token bucket capacity; defaults to `tokens_per_minute`.
    pub burst_tokens: Option<u64>,
    /// Tenant concurrency limit across backends; `None` = unlimited.
    pub max_concurrency: Option<u64>,
    /// Slots reserved for this tenant on each backend its guarantee applies to (0 for
    /// sheddable tenants).
    pub guaranteed_slots: u64,
    /// Backends the guarantee applies to: bit `i` = backend id `i`, or [`ALL_BACKENDS`]
    /// (every backend, including those registered later). A set mask names only registered
    /// backends.
    pub guaranteed_backends: u64,
}

/// Whether a guarantee with backend mask `mask` applies to backend `bi`.
#[inline]
pub(super) fn applies(mask: u64, bi: usize) -> bool {
    bi < 64 && (mask >> bi) & 1 == 1
}

pub(super) fn check_name(name: &str) -> Result<(), CoreError> {
    if name.is_empty() || name.len() > MAX_NAME_LEN || name.contains('\0') {
        return Err(CoreError::InvalidConfig(format!(
            "name {name:?} must be 1..={MAX_NAME_LEN} bytes without NUL"
        )));
    }
    Ok(())
}

pub(super) fn config_err<T>(msg: String) -> Result<T, CoreError> {
    Err(CoreError::InvalidConfig(msg))
}

impl Admission {
    pub(super) fn check_backend_config(c: &BackendConfig) -> Result<(u64, u64), CoreError> {
        if c.max_concurrency == 0 || c.max_concurrency > MAX_AMOUNT {
            return config_err(format!(
                "max_concurrency must be in 1..=2**62 (got {})",
                c.max_concurrency
            ));
        }
        if c.inflight_token_limit == Some(0) {
            return config_err("inflight_token_limit must be >= 1 (or None for unlimited)".into());
        }
        let burst = c.burst_tokens.unwrap_or(c.tokens_per_minute);
        TokenBucket::new(c.tokens_per_minute, burst)?;
        Ok((c.tokens_per_minute, burst))
    }

    /// Registers a backend; returns its id.
    pub fn add_backend(&self, name: &str, c: &BackendConfig) -> Result<u32, CoreError> {
        check_name(name)?;
        let (rate, burst) = Self::check_backend_config(c)?;
        let _g = self.lock_registration();
        if self.backend_id(name).is_some() {
            return config_err(format!("backend {name:?} already exists"));
        }
        let h = &self.region().header;
        let id = h.n_backends.load(Ordering::Acquire) as usize;
        if id >= MAX_BACKENDS {
            return config_err(format!("at most {MAX_BACKENDS} backends"));
        }
        // Guarantees that apply to every backend (ALL_BACKENDS) apply to this one too.
        let tenants: Vec<&TenantState> = (0..self.tenant_count())
            .filter_map(|i| self.tenant(i).ok())
            .filter(|t| applies(t.guaranteed_backends.load(Ordering::Acquire), id))
            .collect();
        let g: u64 = tenants
            .iter()
            .map(|t| t.guaranteed_slots.load(Ordering::Acquire))
            .sum();
        if g > c.max_concurrency {
            return config_err(format!(
                "backend {name:?}: max_concurrency {} is below the guaranteed slots of the \
                 tenants that apply to every backend ({g})",
                c.max_concurrency
            ));
        }
        for t in &tenants {
            t.guaranteed[id].store(
                t.guaranteed_slots.load(Ordering::Acquire),
                Ordering::Release,
            );
        }
        let b = &self.region().backends[id];
        b.total_guaranteed.store(g, Ordering::Release);
        write_name(&b.name, name);
        b.max_concurrency
            .store(c.max_concurrency, Ordering::Release);
        b.scale_ppm.store(SCALE_ONE, Ordering::Release);
        b.shedding.store(0, Ordering::Release);
        b.inflight
            .set_limit(c.inflight_token_limit.unwrap_or(UNLIMITED));
        b.tpm.init(rate, burst)?;
        b.ready.store(1, Ordering::Release);
        h.n_backends.store(id as u64 + 1, Ordering::Release);
        Ok(id as u32)
    }

    /// Hot reload of a backend's base limits; held slots and tokens are untouched and the token
    /// level is kept. Every field of `c` is applied (`None` in-flight limit = unlimited).
    pub fn update_backend(&self, id: u32, c: &BackendConfig) -> Result<(), CoreError> {
        let b = self.backend(id)?;
        let (rate, burst) = Self::check_backend_config(c)?;
        let _g = self.lock_registration();
        let g = b.total_guaranteed.load(Ordering::Acquire);
        if g > c.max_concurrency {
            return config_err(format!(
                "backend {:?}: max_concurrency {} is below the guaranteed slots of the tenants \
                 that use it ({g})",
                read_name(&b.name),
                c.max_concurrency
            ));
        }
        b.max_concurrency
            .store(c.max_concurrency, Ordering::Release);
        b.inflight
            .set_limit(c.inflight_token_limit.unwrap_or(UNLIMITED));
        b.tpm.set_params(rate, burst, self.clock.now_ns())?;
        Ok(())
    }

    /// The base configuration of a backend.
    pub fn backend_config(&self, id: u32) -> Result<BackendConfig, CoreError> {
        let b = self.backend(id)?;
        let limit = b.inflight.limit();
        Ok(BackendConfig {
            max_concurrency: b.max_concurrency.load(Ordering::Acquire),
            tokens_per_minute: b.tpm.rate(),
            burst_tokens: Some(b.tpm.burst()),
            inflight_token_limit: (limit != UNLIMITED).then_some(limit),
        })
    }

    pub(super) fn check_tenant_config(c: &TenantConfig) -> Result<Option<(u64, u64)>, CoreError> {
        if c.priority == Priority::Sheddable && c.guaranteed_slots > 0 {
            return config_err(
                "a sheddable tenant cannot have guaranteed slots (it uses only the burst pool)"
                    .into(),
            );
        }
        if c.max_concurrency == Some(0) {
            return config_err("max_concurrency must be >= 1 (or None for unlimited)".into());
        }
        if c.guaranteed_slots > MAX_AMOUNT {
            return config_err("guaranteed_slots must be <= 2**62".into());
        }
        match c.tokens_per_minute {
            None => {
                if c.burst_tokens.is_some() {
                    return config_err("burst_tokens needs tokens_per_minute".into());
                }
                Ok(None)
            }
            Some(rate) => {
                let burst = c.burst_tokens.unwrap_or(rate);
                TokenBucket::new(rate, burst)?;
                Ok(Some((rate, burst)))
            }
        }
    }

    /// Checks `c.guaranteed_backends` against the registered backends and, for every backend,
    /// the sum of the guarantees with tenant `old`'s replaced by `c`'s; returns each backend's
    /// new total. Call with the registration lock held.
    pub(super) fn check_guarantees(
        &self,
        old: Option<&TenantState>,
        c: &TenantConfig,
    ) -> Result<[u64; MAX_BACKENDS], CoreError> {
        let n = self.backend_count() as usize;
        let mask = c.guaranteed_backends;
        if mask != ALL_BACKENDS && (mask >> n) != 0 {
            let bad = (mask >> n).trailing_zeros() as usize + n;
            return config_err(format!(
                "guaranteed_backends names backend id {bad}, but {n} backends are registered"
            ));
        }
        let mut totals = [0u64; MAX_BACKENDS];
        for (bi, total) in totals.iter_mut().enumerate().take(n) {
            let Ok(b) = self.backend(bi as u32) else {
                continue;
            };
            let before = old.map_or(0, |t| t.guaranteed[bi].load(Ordering::Acquire));
            let after = if applies(mask, bi) {
                c.guaranteed_slots
            } else {
                0
            };
            *total = b.total_guaranteed.load(Ordering::Acquire) - before + after;
            let conc = b.max_concurrency.load(Ordering::Acquire);
            if *total > conc {
                return config_err(format!(
                    "guaranteed slots would total {total}, above backend {:?}'s \
                     max_concurrency {conc}",
                    read_name(&b.name)
                ));
            }
        }
        Ok(totals)
    }

    /// Stores a checked guarantee: the tenant's per-backend slots and each backend's total.
    pub(super) fn store_guarantees(
        &self,
        t: &TenantState,
        c: &TenantConfig,
        totals: &[u64; MAX_BACKENDS],
    ) {
        t.guaranteed_slots
            .store(c.guaranteed_slots, Ordering::Release);
        t.guaranteed_backends
            .store(c.guaranteed_backends, Ordering::Release);
        for (bi, g) in t.guaranteed.iter().enumerate() {
            let on = bi < self.backend_count() as usize && applies(c.guaranteed_backends, bi);
            g.store(if on { c.guaranteed_slots } else { 0 }, Ordering::Release);
        }
        for (bi, total) in totals
            .iter()
            .enumerate()
            .take(self.backend_count() as usize)
        {
            self.region().backends[bi]
                .total_guaranteed
                .store(*total, Ordering::Release);
        }
    }

    /// Registers a tenant; returns its id.
    pub fn add_tenant(&self, name: &str, c: &TenantConfig) -> Result<u32, CoreError> {
        check_name(name)?;
        let bucket = Self::check_tenant_config(c)?;
        let _g = self.lock_registration();
        if self.tenant_id(name).is_some() {
            return config_err(format!("tenant {name:?} already exists"));
        }
        let totals = self.check_guarantees(None, c)?;
        let h = &self.region().header;
        let id = h.n_tenants.load(Ordering::Acquire) as usize;
        if id >= MAX_TENANTS {
            return config_err(format!("at most {MAX_TENANTS} tenants"));
        }
        let t = &self.region().tenants[id];
        write_name(&t.name, name);
        t.priority.store(c.priority as u64, Ordering::Release);
        t.conc.set_limit(c.max_concurrency.unwrap_or(UNLIMITED));
        if let Some((rate, burst)) = bucket {
            t.tpm.init(rate, burst)?;
            t.has_tpm.store(1, Ordering::Release);
        } else {
            t.has_tpm.store(0, Ordering::Release);
        }
        self.store_guarantees(t, c, &totals);
        t.ready.store(1, Ordering::Release);
        h.n_tenants.store(id as u64 + 1, Ordering::Release);
        Ok(id as u32)
    }

    /// Hot reload of a tenant (every field of `c` is applied; held slots are untouched). A
    /// tenant TPM limit that is added starts with a full bucket. Slots held on a guarantee that
    /// is lowered or moved to other backends stay held until released; meanwhile that backend
    /// gives out no burst slot beyond its limit.
    pub fn update_tenant(&self, id: u32, c: &TenantConfig) -> Result<(), CoreError> {
        let t = self.tenant(id)?;
        let bucket = Self::check_tenant_config(c)?;
        let _g = self.lock_registration();
        let totals = self.check_guarantees(Some(t), c)?;
        t.priority.store(c.priority as u64, Ordering::Release);
        self.store_guarantees(t, c, &totals);
        t.conc.set_limit(c.max_concurrency.unwrap_or(UNLIMITED));
        match bucket {
            Some((rate, burst)) if t.has_tpm.load(Ordering::Acquire) == 1 => {
                t.tpm.set_params(rate, burst, self.clock.now_ns())?;
            }
            Some((rate, burst)) => {
                t.tpm.init(rate, burst)?;
                t.has_tpm.store(1, Ordering::Release);
            }
            None => t.has_tpm.store(0, Ordering::Release),
        }
        Ok(())
    }

    /// The configuration of a tenant.
    pub fn tenant_config(&self, id: u32) -> Result<TenantConfig, CoreError> {
        let t = self.tenant(id)?;
        let has = t.has_tpm.load(Ordering::Acquire) == 1;
        let conc = t.conc.limit();
        Ok(TenantConfig {
            priority: Priority::from_code(t.priority.load(Ordering::Acquire))?,
            tokens_per_minute: has.then(|| t.tpm.rate()),
            burst_tokens: has.then(|| t.tpm.burst()),
            max_concurrency: (conc != UNLIMITED).then_some(conc),
            guaranteed_slots: t.guaranteed_slots.load(Ordering::Acquire),
            guaranteed_backends: t.guaranteed_backends.load(Ordering::Acquire),
        })
    }

    /// Sets a backend's scale (0 < scale <= 1), applied to its concurrency, TPM and in-flight
    /// token limits at once (one atomic word read at check time).
    pub fn set_scale(&self, id: u32, scale: f64) -> Result<(), CoreError> {
        let b = self.backend(id)?;
        if !(scale > 0.0 && scale <= 1.0) {
            return config_err(format!("scale must be in (0, 1] (got {scale})"));
        }
        let ppm = ((scale * SCALE_ONE as f64).round() as u64).clamp(1, SCALE_ONE);
        b.scale_ppm.store(ppm, Ordering::Release);
        Ok(())
    }

    /// Turns shedding of the sheddable class on a backend on or off.
    pub fn set_shedding(&self, id: u32, on: bool) -> Result<(), CoreError> {
        self.backend(id)?
            .shedding
            .store(u64::from(on), Ordering::Release);
        Ok(())
    }
}
