//! Backend and tenant configuration: the limits, their validation, and registration, hot
//! reload and removal of backends and tenants in the region.

use std::sync::atomic::Ordering;

use super::region::{read_name, write_name, Names, LIVE, MAX_NAME_LEN, TOMBSTONE};
use super::{Admission, OVERLOAD_BIT, SCALE_ONE, SHED_BIT};
use crate::error::{check_amount, CoreError, MAX_AMOUNT};
use crate::priority::Priority;
use crate::slots::UNLIMITED;
use crate::token_bucket::TokenBucket;

/// The backends a tenant's guarantee applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuaranteedBackends {
    /// Every backend, including backends registered later.
    All,
    /// These registered backend ids (order and repeats do not matter).
    Only(Vec<u32>),
}

impl GuaranteedBackends {
    /// Whether the guarantee applies to backend `bi`.
    pub fn applies(&self, bi: u32) -> bool {
        match self {
            Self::All => true,
            Self::Only(ids) => ids.contains(&bi),
        }
    }
}

/// [`TenantConfig::guaranteed_backends`] value: the guarantee applies to every backend,
/// including backends registered later.
pub const ALL_BACKENDS: GuaranteedBackends = GuaranteedBackends::All;

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
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// Backends the guarantee applies to ([`ALL_BACKENDS`] or registered ids). A list takes one
    /// entry of the region's guarantee table per backend; `All` takes one per registered
    /// backend only while `guaranteed_slots` is not 0.
    pub guaranteed_backends: GuaranteedBackends,
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

/// The configuration a removed tenant keeps: no slot, no guarantee.
fn removed_config() -> TenantConfig {
    TenantConfig {
        priority: Priority::Sheddable,
        tokens_per_minute: None,
        burst_tokens: None,
        max_concurrency: None,
        guaranteed_slots: 0,
        guaranteed_backends: GuaranteedBackends::Only(Vec::new()),
    }
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
    ///
    /// Errors: a bad limit or name, a name already registered, or the region's backend
    /// capacity reached (sized when it was created: a restart is needed to grow it).
    pub fn add_backend(&self, name: &str, c: &BackendConfig) -> Result<u32, CoreError> {
        check_name(name)?;
        let (rate, burst) = Self::check_backend_config(c)?;
        let _g = self.lock_registration();
        if self.backend_id(name).is_some() {
            return config_err(format!("backend {name:?} already exists"));
        }
        let h = self.header();
        let id = h.n_backends.load(Ordering::Acquire) as usize;
        let cap = self.capacity().backends as usize;
        if id >= cap {
            return config_err(format!(
                "backend capacity reached ({cap} backends, sized when kvgate started); restart \
                 kvgate to add backend {name:?}"
            ));
        }
        // Guarantees that apply to every backend (ALL_BACKENDS) apply to this one too.
        let tenants: Vec<u32> = (0..self.tenant_count())
            .filter(|&i| {
                self.tenant(i).is_ok_and(|t| {
                    t.guar_all.load(Ordering::Acquire) == 1
                        && t.guaranteed_slots.load(Ordering::Acquire) > 0
                })
            })
            .collect();
        let g: u64 = tenants
            .iter()
            .map(|&i| {
                self.tenant_at(i as usize)
                    .guaranteed_slots
                    .load(Ordering::Acquire)
            })
            .sum();
        if g > c.max_concurrency {
            return config_err(format!(
                "backend {name:?}: max_concurrency {} is below the guaranteed slots of the \
                 tenants that apply to every backend ({g})",
                c.max_concurrency
            ));
        }
        for &ti in &tenants {
            let gi = self.entry_for(ti, id as u32)?;
            let e = self.entry_at(gi);
            e.member.store(1, Ordering::Release);
            e.guaranteed.store(
                self.tenant_at(ti as usize)
                    .guaranteed_slots
                    .load(Ordering::Acquire),
                Ordering::Release,
            );
            self.tenant_at(ti as usize)
                .has_entries
                .store(1, Ordering::Release);
        }
        let b = self.backend_at(id);
        b.total_guaranteed.store(g, Ordering::Release);
        write_name(&b.name, name);
        b.max_concurrency
            .store(c.max_concurrency, Ordering::Release);
        b.scale_ppm.store(SCALE_ONE, Ordering::Release);
        b.shedding.store(0, Ordering::Release);
        b.inflight_external.store(0, Ordering::Release);
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

    /// Guaranteed slots of tenant `tenant` on backend `bi` now (0 without an entry).
    fn guaranteed_on(&self, tenant: Option<u32>, bi: u32) -> u64 {
        tenant
            .and_then(|t| self.find_entry(t, bi))
            .map_or(0, |gi| self.entry_at(gi).guaranteed.load(Ordering::Acquire))
    }

    /// The backends whose guarantee for tenant `old` may differ between now and `c`: every
    /// registered backend when the tenant has (or gets) entries beyond a list, else `c`'s list.
    fn touched_backends(&self, old: Option<u32>, c: &TenantConfig) -> Vec<u32> {
        let n = self.backend_count();
        let had = old.is_some_and(|t| {
            self.tenant_at(t as usize)
                .has_entries
                .load(Ordering::Acquire)
                == 1
        });
        match &c.guaranteed_backends {
            _ if had => (0..n).collect(),
            GuaranteedBackends::All if c.guaranteed_slots > 0 => (0..n).collect(),
            GuaranteedBackends::All => Vec::new(),
            GuaranteedBackends::Only(ids) => {
                let mut ids = ids.clone();
                ids.sort_unstable();
                ids.dedup();
                ids
            }
        }
    }

    /// Checks `c.guaranteed_backends` against the registered backends and, for every backend
    /// whose guarantee changes, the sum of the guarantees with tenant `old`'s replaced by `c`'s;
    /// returns those backends with their new totals. Call with the registration lock held.
    pub(super) fn check_guarantees(
        &self,
        old: Option<u32>,
        c: &TenantConfig,
    ) -> Result<Vec<(u32, u64)>, CoreError> {
        let n = self.backend_count();
        if let GuaranteedBackends::Only(ids) = &c.guaranteed_backends {
            if let Some(bad) = ids.iter().find(|&&id| id >= n) {
                return config_err(format!(
                    "guaranteed_backends names backend id {bad}, but {n} backends are registered"
                ));
            }
        }
        let mut totals = Vec::new();
        for bi in self.touched_backends(old, c) {
            let Ok(b) = self.backend(bi) else {
                continue;
            };
            let before = self.guaranteed_on(old, bi);
            let after = if c.guaranteed_backends.applies(bi) {
                c.guaranteed_slots
            } else {
                0
            };
            if before == after {
                continue;
            }
            let total = b.total_guaranteed.load(Ordering::Acquire) - before + after;
            let conc = b.max_concurrency.load(Ordering::Acquire);
            if total > conc {
                return config_err(format!(
                    "guaranteed slots would total {total}, above backend {:?}'s \
                     max_concurrency {conc}",
                    read_name(&b.name)
                ));
            }
            totals.push((bi, total));
        }
        Ok(totals)
    }

    /// Whether the guarantee table can take the entries `c` needs for tenant `id` (checked
    /// before anything is changed).
    fn check_entry_room(&self, id: Option<u32>, c: &TenantConfig) -> Result<(), CoreError> {
        let needed = self.guarantee_entries_needed(id, c).len() as u64;
        let cap = u64::from(self.capacity().guarantees);
        if needed > self.guarantee_entries_free() {
            return config_err(format!(
                "the guarantee table is full ({cap} (tenant, backend) entries, sized when \
                 kvgate started); restart kvgate to size it for the new configuration"
            ));
        }
        Ok(())
    }

    /// Stores a checked guarantee: the tenant's entries and the changed backends' totals.
    fn store_guarantees(
        &self,
        id: u32,
        c: &TenantConfig,
        totals: &[(u32, u64)],
    ) -> Result<(), CoreError> {
        let t = self.tenant_at(id as usize);
        for bi in self.touched_backends(Some(id), c) {
            let (member, g) = match &c.guaranteed_backends {
                GuaranteedBackends::All => (c.guaranteed_slots > 0, c.guaranteed_slots),
                GuaranteedBackends::Only(ids) if ids.contains(&bi) => (true, c.guaranteed_slots),
                GuaranteedBackends::Only(_) => (false, 0),
            };
            let gi = if member {
                t.has_entries.store(1, Ordering::Release);
                Some(self.entry_for(id, bi)?)
            } else {
                self.find_entry(id, bi)
            };
            if let Some(gi) = gi {
                let e = self.entry_at(gi);
                e.member.store(u64::from(member), Ordering::Release);
                e.guaranteed.store(g, Ordering::Release);
            }
        }
        t.guaranteed_slots
            .store(c.guaranteed_slots, Ordering::Release);
        t.guar_all.store(
            u64::from(c.guaranteed_backends == GuaranteedBackends::All),
            Ordering::Release,
        );
        for &(bi, total) in totals {
            self.backend_at(bi as usize)
                .total_guaranteed
                .store(total, Ordering::Release);
        }
        Ok(())
    }

    /// An id for a new tenant: a never-used one while there are, else a removed tenant's id
    /// that holds nothing any more. Call with the registration lock held.
    fn free_tenant_id(&self, name: &str, c: &TenantConfig) -> Result<(u32, bool), CoreError> {
        let n = self.tenant_count();
        let cap = self.capacity().tenants;
        if n < cap {
            return Ok((n, false));
        }
        self.reusable_tenant_id(c)
            .map(|i| (i, true))
            .ok_or_else(|| {
                CoreError::InvalidConfig(format!(
                    "tenant capacity reached ({cap} tenants, removed ones still holding \
                     requests included; sized when kvgate started): restart kvgate to add \
                     tenant {name:?}"
                ))
            })
    }

    /// A removed tenant's id that holds nothing, if any, chosen for a tenant configured as `c`
    /// (its guarantee entries stay with the id, and serve the tenant that takes it): for a
    /// tenant with a guarantee, the first id whose entries cover it, else the one whose
    /// entries leave the fewest for it to add, then the one with the fewest it leaves unused;
    /// for one without, the first id without entries. A scan of the ids in use that compares
    /// the first [`REUSE_CANDIDATES`] reusable ids at most (a reload adding many tenants to a
    /// large, full table would otherwise look at every removed id, and its entries, for each).
    fn reusable_tenant_id(&self, c: &TenantConfig) -> Option<u32> {
        let needs_entries = c.guaranteed_slots > 0
            || matches!(&c.guaranteed_backends, GuaranteedBackends::Only(ids) if !ids.is_empty());
        let fresh_need = if needs_entries {
            self.guarantee_entries_needed(None, c).len()
        } else {
            0
        };
        let mut best: Option<((usize, usize), u32)> = None;
        let mut examined = 0;
        for i in 0..self.tenant_count() {
            let t = self.tenant_at(i as usize);
            if t.ready.load(Ordering::Acquire) != TOMBSTONE || t.conc.in_use() != 0 {
                continue;
            }
            if examined == REUSE_CANDIDATES {
                break;
            }
            examined += 1;
            let fit = if t.has_entries.load(Ordering::Acquire) == 0 {
                (fresh_need, 0)
            } else if needs_entries {
                let held = self.guarantee_entries_of(i);
                let unused = held.iter().filter(|&&bi| !wants_entry(c, bi)).count();
                (self.guarantee_entries_needed(Some(i), c).len(), unused)
            } else {
                // Without a guarantee, `c` uses none of them: an id without any fits better.
                (0, 1)
            };
            if best.map_or(true, |(f, _)| fit < f) {
                best = Some((fit, i));
                // one that needs no new entry will do (the fewest unused is not worth a scan)
                if fit.0 == 0 && (needs_entries || fit.1 == 0) {
                    break;
                }
            }
        }
        best.map(|(_, i)| i)
    }

    /// Tenant ids a new tenant can take now: never-used ones plus removed tenants' ids that
    /// hold nothing.
    pub fn free_tenant_ids(&self) -> u32 {
        let n = self.tenant_count();
        let idle = (0..n)
            .filter(|&i| {
                let t = self.tenant_at(i as usize);
                t.ready.load(Ordering::Acquire) == TOMBSTONE && t.conc.in_use() == 0
            })
            .count() as u32;
        self.capacity().tenants - n + idle
    }

    /// Guarantee-table entries not used yet. Entries are never freed (a removed tenant's stay
    /// with its id, and serve the tenant that takes the id next).
    pub fn guarantee_entries_free(&self) -> u64 {
        let used = self.header().n_guar.load(Ordering::Acquire);
        u64::from(self.capacity().guarantees).saturating_sub(used)
    }

    /// The backends (ids, ascending) on which setting tenant `id` (`None`: a tenant added
    /// with a fresh id) to `c` would add a guarantee-table entry: those `c` guarantees slots
    /// on where the tenant has no entry yet. Only `guaranteed_slots` and `guaranteed_backends`
    /// of `c` are read; backend ids past the registered ones count as none.
    pub fn guarantee_entries_needed(&self, id: Option<u32>, c: &TenantConfig) -> Vec<u32> {
        let n = self.backend_count();
        self.touched_backends(id, c)
            .into_iter()
            .filter(|&bi| {
                wants_entry(c, bi)
                    && bi < n
                    && id.map_or(true, |t| self.find_entry(t, bi).is_none())
            })
            .collect()
    }

    /// The backends (ids, ascending) on which tenant `id` holds a guarantee-table entry (one
    /// per backend it has had a guarantee on; kept after its removal, for the tenant that takes
    /// the id next). None for an id past the registered tenants.
    pub fn guarantee_entries_of(&self, id: u32) -> Vec<u32> {
        if id >= self.tenant_count() {
            return Vec::new();
        }
        (0..self.backend_count())
            .filter(|&bi| self.find_entry(id, bi).is_some())
            .collect()
    }

    /// Registers a tenant; returns its id. A removed tenant's id is reused only once it holds
    /// nothing (no request of the removed tenant is counted against the new one).
    ///
    /// Errors: a bad limit or name, a name already registered, guarantees above a backend's
    /// `max_concurrency`, or the region's tenant or guarantee capacity reached (sized when it
    /// was created: a restart is needed to grow it).
    pub fn add_tenant(&self, name: &str, c: &TenantConfig) -> Result<u32, CoreError> {
        check_name(name)?;
        let bucket = Self::check_tenant_config(c)?;
        let _g = self.lock_registration();
        let mut names = self
            .tenant_names
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.sync_tenant_names(&mut names);
        if names.map.get(name).is_some_and(|&i| {
            let t = self.tenant_at(i as usize);
            t.ready.load(Ordering::Acquire) == LIVE && read_name(&t.name) == name
        }) {
            return config_err(format!("tenant {name:?} already exists"));
        }
        let (mut id, mut reused) = self.free_tenant_id(name, c)?;
        if !reused && self.check_entry_room(None, c).is_err() {
            // The guarantee table is full, and its entries are never freed: a removed tenant's
            // id comes with the entries it had (on the same backends, they serve the new
            // tenant), so tenants with guarantees that reloads add and remove do not fill it.
            if let Some(i) = self.reusable_tenant_id(c) {
                (id, reused) = (i, true);
            }
        }
        // A reused id's entries were cleared on removal: the old tenant counts as none.
        let totals = self.check_guarantees(reused.then_some(id), c)?;
        self.check_entry_room(Some(id).filter(|_| reused), c)?;
        let t = self.tenant_at(id as usize);
        write_name(&t.name, name);
        t.priority.store(c.priority as u64, Ordering::Release);
        t.conc.set_limit(c.max_concurrency.unwrap_or(UNLIMITED));
        if let Some((rate, burst)) = bucket {
            t.tpm.init(rate, burst)?;
            t.has_tpm.store(1, Ordering::Release);
        } else {
            t.has_tpm.store(0, Ordering::Release);
        }
        self.store_guarantees(id, c, &totals)?;
        t.ready.store(LIVE, Ordering::Release);
        if reused {
            self.bump_names(&mut names, |m| {
                m.map.insert(name.to_owned(), id);
            });
        } else {
            self.header()
                .n_tenants
                .store(u64::from(id) + 1, Ordering::Release);
        }
        Ok(id)
    }

    /// Marks a change of a tenant id's name in the region and applies it to this process's
    /// cache (which was in sync), so it needs no rebuild.
    fn bump_names(&self, names: &mut Names, apply: impl FnOnce(&mut Names)) {
        let h = self.header();
        let gen = h.name_gen.load(Ordering::Acquire);
        h.name_gen.store(gen + 1, Ordering::Release);
        if names.gen == gen {
            names.gen = gen + 1;
            apply(names);
        }
    }

    /// Removes a tenant (a reload that drops it): it becomes a tombstone whose limits are zero
    /// (every admission is refused with `tenant-concurrency`), its guarantees
    /// are given back to the backends' burst pools, its name is free at once, and what it
    /// holds is released as usual. Its id goes to a new tenant only once it holds nothing.
    ///
    /// Errors: unknown or already removed id.
    pub fn remove_tenant(&self, id: u32) -> Result<(), CoreError> {
        let t = self.tenant(id)?;
        let _g = self.lock_registration();
        if t.ready.load(Ordering::Acquire) != LIVE {
            return config_err(format!("tenant id {id} is already removed"));
        }
        self.remove_locked(id)
    }

    /// Removes tenant `id` if it is still the live tenant `name`; whether it did. With several
    /// processes on one shared region each applies the same reload: the tenant may have been
    /// removed by another one already, and its id even given to a tenant that one added, which
    /// must stay (a removal by id alone would take it away, and the new tenant's requests would
    /// be counted against whatever took the id next).
    ///
    /// Errors: `id` past the registered tenants, or a guarantee the core cannot give back.
    pub fn remove_tenant_named(&self, id: u32, name: &str) -> Result<bool, CoreError> {
        let t = self.tenant(id)?;
        let _g = self.lock_registration();
        if t.ready.load(Ordering::Acquire) != LIVE || read_name(&t.name) != name {
            return Ok(false);
        }
        self.remove_locked(id)?;
        Ok(true)
    }

    /// [`Admission::remove_tenant`] of a live tenant, the registration lock held.
    fn remove_locked(&self, id: u32) -> Result<(), CoreError> {
        let t = self.tenant_at(id as usize);
        let mut names = self
            .tenant_names
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.sync_tenant_names(&mut names);
        let c = removed_config();
        let totals = self.check_guarantees(Some(id), &c)?;
        self.store_guarantees(id, &c, &totals)?;
        t.conc.set_limit(0);
        t.has_tpm.store(0, Ordering::Release);
        t.ready.store(TOMBSTONE, Ordering::Release);
        let name = read_name(&t.name);
        self.bump_names(&mut names, |m| {
            m.map.remove(&name);
        });
        Ok(())
    }

    /// Whether tenant `id` was removed ([`Admission::remove_tenant`]) and its id not reused yet.
    pub fn tenant_removed(&self, id: u32) -> Result<bool, CoreError> {
        Ok(self.tenant(id)?.ready.load(Ordering::Acquire) == TOMBSTONE)
    }

    /// Hot reload of a tenant (every field of `c` is applied; held slots are untouched). A
    /// tenant TPM limit that is added starts with a full bucket. Slots held on a guarantee that
    /// is lowered or moved to other backends stay held until released; meanwhile that backend
    /// gives out no burst slot beyond its limit.
    ///
    /// Errors: unknown or removed id, a bad limit, guarantees above a backend's
    /// `max_concurrency`, or the guarantee table full.
    pub fn update_tenant(&self, id: u32, c: &TenantConfig) -> Result<(), CoreError> {
        let t = self.tenant(id)?;
        let bucket = Self::check_tenant_config(c)?;
        let _g = self.lock_registration();
        if t.ready.load(Ordering::Acquire) != LIVE {
            return config_err(format!("tenant id {id} was removed"));
        }
        let totals = self.check_guarantees(Some(id), c)?;
        self.check_entry_room(Some(id), c)?;
        t.priority.store(c.priority as u64, Ordering::Release);
        self.store_guarantees(id, c, &totals)?;
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
        let guaranteed_backends = if t.guar_all.load(Ordering::Acquire) == 1 {
            GuaranteedBackends::All
        } else if t.has_entries.load(Ordering::Acquire) == 0 {
            GuaranteedBackends::Only(Vec::new())
        } else {
            GuaranteedBackends::Only(
                (0..self.backend_count())
                    .filter(|&bi| {
                        self.find_entry(id, bi)
                            .is_some_and(|gi| self.entry_at(gi).member.load(Ordering::Acquire) == 1)
                    })
                    .collect(),
            )
        };
        Ok(TenantConfig {
            priority: Priority::from_code(t.priority.load(Ordering::Acquire))?,
            tokens_per_minute: has.then(|| t.tpm.rate()),
            burst_tokens: has.then(|| t.tpm.burst()),
            max_concurrency: (conc != UNLIMITED).then_some(conc),
            guaranteed_slots: t.guaranteed_slots.load(Ordering::Acquire),
            guaranteed_backends,
        })
    }

    /// Sets a backend's scale (0 < scale <= 1), applied to its concurrency and TPM limits at
    /// once (one atomic word read at check time). The in-flight token budget is not scaled
    /// (see [`Admission::set_inflight_external`]).
    pub fn set_scale(&self, id: u32, scale: f64) -> Result<(), CoreError> {
        let b = self.backend(id)?;
        if !(scale > 0.0 && scale <= 1.0) {
            return config_err(format!("scale must be in (0, 1] (got {scale})"));
        }
        let ppm = ((scale * SCALE_ONE as f64).round() as u64).clamp(1, SCALE_ONE);
        b.scale_ppm.store(ppm, Ordering::Release);
        Ok(())
    }

    /// Sets a backend's external KV occupancy: the tokens the engine holds in its KV cache
    /// beyond kvgate's own in-flight tokens (other clients, fragmentation), measured from its
    /// metrics. The in-flight budget in force becomes `max(0, base - tokens)` for every
    /// request; what is already held stays held. 0 (the initial value) = no correction.
    ///
    /// Errors: unknown id, or `tokens` above [`MAX_AMOUNT`].
    pub fn set_inflight_external(&self, id: u32, tokens: u64) -> Result<(), CoreError> {
        let tokens = check_amount("external tokens", i128::from(tokens))?;
        self.backend(id)?
            .inflight_external
            .store(tokens, Ordering::Release);
        Ok(())
    }

    /// Turns shedding of the sheddable class on a backend on or off.
    pub fn set_shedding(&self, id: u32, on: bool) -> Result<(), CoreError> {
        set_bit(&self.backend(id)?.shedding, SHED_BIT, on);
        Ok(())
    }

    /// Marks a backend overloaded (its KV pressure at or above the adaptive law's high
    /// watermark, or its metrics stale) or not. While overloaded the scale binds every class;
    /// otherwise it binds only the `sheddable` class, and `critical` / `standard` requests keep
    /// the base concurrency and TPM (see [`class_ppm`](super::class_ppm)). Off initially.
    pub fn set_overload(&self, id: u32, on: bool) -> Result<(), CoreError> {
        set_bit(&self.backend(id)?.shedding, OVERLOAD_BIT, on);
        Ok(())
    }
}

/// Sets (`on`) or clears one bit of a flag word.
fn set_bit(word: &std::sync::atomic::AtomicU64, bit: u64, on: bool) {
    if on {
        word.fetch_or(bit, Ordering::AcqRel);
    } else {
        word.fetch_and(!bit, Ordering::AcqRel);
    }
}

/// Reusable tenant ids that [`Admission::add_tenant`] compares, at most, to choose the one
/// that suits a new tenant best (one with guarantee entries costs a look-up per backend).
const REUSE_CANDIDATES: usize = 64;

/// Whether a tenant configured as `c` has a guarantee-table entry on backend `bi`: every
/// backend for a guarantee on all of them, the named ones for a guarantee on some.
fn wants_entry(c: &TenantConfig, bi: u32) -> bool {
    match &c.guaranteed_backends {
        GuaranteedBackends::All => c.guaranteed_slots > 0,
        GuaranteedBackends::Only(ids) => ids.contains(&bi),
    }
}
