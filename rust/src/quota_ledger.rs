//! A replica's quotas in a store shared by several gateway replicas: the local fast path of
//! `kvgate.store.redis_store.RedisStore` (its agent, in Python, talks to Redis and sizes the
//! quotas; this ledger decides the admissions that fit in them, with no Redis call).
//!
//! The ledger holds, in flat arrays indexed by small integers:
//!
//! * scopes (a tenant or a backend): the lease (`lease_until`, seconds of the monotonic clock
//!   the caller passes as `now`), the live replicas as Redis last said, an `active` flag;
//! * pools (slots, or the in-flight token budget, of a scope): `q` units this replica holds
//!   (its quota), `in_use` units its requests hold, `taken` units taken since the agent last
//!   read them (demand), `unit` (units of the last request), `near` (the pool is near its
//!   limit across the replicas), `limit` (effective, as Redis last said; 0 = not known yet) and
//!   `base` (configured);
//! * token buckets of a scope: `avail` pre-debited tokens (negative: an overrun not yet
//!   charged), `taken`, `chunk` (the grant size; 0 = not sized yet), `near`, `burst`;
//! * plans: for one kind of request (a tenant on a backend, one priority class), the parts it
//!   takes from: per scope, alternatives of pools (a slot, or its tokens, from the first pool of
//!   the list with room) and the buckets that pay its tokens.
//!
//! [`QuotaLedger::try_admit`] takes a request's units from every part, or nothing: it fails when
//! a scope's lease ran out, a pool list has no room, or a bucket holds fewer tokens than the
//! request. What it took is a hold, given back once by [`QuotaLedger::release`] (slots at once;
//! `reserved - actual` tokens to each bucket: a refund, or an overrun below zero). Both record
//! the scopes the agent must tell Redis about now ("kicks": a pool under its low-water mark, a
//! bucket under a third of its grant, anything given back near a limit) and the scopes that
//! became active, for the agent to read after the call. The rules are those of the agent's
//! Python code for the same paths (`_take`, `_headroom`, `_first_chunk`, `release`), which the
//! agent still uses where Redis decides.

use std::collections::HashMap;

/// No plan (the end of a chain of keyed plans).
const NO_PLAN: u32 = u32::MAX;

/// Key groups found through the direct table (at most 16 MiB of it); a key of a larger group
/// is found through a hash map.
const MAX_GROUPS: usize = 1 << 22;

/// The group of a plan's key: its bits 1 to 32 — the tenant's id in the agent's keys
/// (`backend << 33 | tenant << 1 | sheddable`), so a tenant's few plans share one chain.
fn key_group(key: u64) -> usize {
    ((key >> 1) & 0xFFFF_FFFF) as usize
}

/// One scope (a tenant's or a backend's limits) as this replica holds it.
#[derive(Debug, Clone, Default)]
pub struct ScopeState {
    /// Until when (seconds, the caller's monotonic clock) the replica's lease lets it admit
    /// from its quotas without Redis.
    pub lease_until: f64,
    /// Live replicas in the scope as Redis last said (at least 1 when used).
    pub live: i64,
    /// Whether the agent knows the scope is active (set by an admission, cleared by the agent).
    pub active: bool,
}

/// Field numbers of a pool for [`QuotaLedger::pool_get`] / [`QuotaLedger::pool_set`].
pub mod pool_field {
    /// Units this replica holds (its quota).
    pub const Q: u8 = 0;
    /// Units its requests hold.
    pub const IN_USE: u8 = 1;
    /// Units taken since the agent last reset it (demand).
    pub const TAKEN: u8 = 2;
    /// Units of the last request.
    pub const UNIT: u8 = 3;
    /// 1 when the pool is near its limit across the replicas, else 0.
    pub const NEAR: u8 = 4;
    /// The effective limit as Redis last said (0 = not known yet).
    pub const LIMIT: u8 = 5;
    /// The configured limit.
    pub const BASE: u8 = 6;
}

/// Field numbers of a bucket for [`QuotaLedger::bucket_get`] / [`QuotaLedger::bucket_set`].
pub mod bucket_field {
    /// Pre-debited tokens this replica holds (negative: an overrun not yet charged).
    pub const AVAIL: u8 = 0;
    /// Tokens taken since the agent last reset it (demand).
    pub const TAKEN: u8 = 1;
    /// The grant size (tokens; 0 = not sized yet).
    pub const CHUNK: u8 = 2;
    /// 1 when the global bucket is near empty, else 0.
    pub const NEAR: u8 = 3;
    /// The bucket's size (tokens).
    pub const BURST: u8 = 4;
}

#[derive(Debug, Clone, Default)]
struct PoolState {
    scope: u32,
    q: i64,
    in_use: i64,
    taken: i64,
    unit: i64,
    near: bool,
    limit: i64,
    base: i64,
}

#[derive(Debug, Clone, Default)]
struct BucketState {
    scope: u32,
    avail: i64,
    taken: i64,
    chunk: i64,
    near: bool,
    burst: i64,
}

/// Pool alternatives of one part: a request takes one unit (a slot) or its tokens (an
/// in-flight token budget) from the first pool of `pools` with room.
#[derive(Debug, Clone)]
pub struct Alternative {
    /// Takes the request's tokens rather than one unit.
    pub counts_tokens: bool,
    /// Pool indices, tried in order.
    pub pools: Vec<u32>,
}

/// One scope's share of a request.
#[derive(Debug, Clone)]
pub struct Part {
    /// The scope's index.
    pub scope: u32,
    /// Every alternative must find room.
    pub alts: Vec<Alternative>,
    /// Buckets paying the request's tokens.
    pub buckets: Vec<u32>,
}

/// What a hold took: (pool index, units) pairs and bucket indices.
pub type HoldParts = (Vec<(u32, i64)>, Vec<u32>);

#[derive(Debug, Default)]
struct HoldSlot {
    generation: u32,
    held: bool,
    picks: Vec<(u32, i64)>,
    buckets: Vec<u32>,
}

/// Why an index or a hold was not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LedgerError {
    /// No scope, pool, bucket or plan with that index, or an unknown field number.
    BadIndex(&'static str, u64),
    /// No plan with that key.
    NoPlan(u64),
}

impl std::fmt::Display for LedgerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::BadIndex(what, i) => write!(f, "no {what} {i} in the quota ledger"),
            Self::NoPlan(key) => write!(f, "no plan with key {key} in the quota ledger"),
        }
    }
}

impl std::error::Error for LedgerError {}

/// A replica's quotas and the admissions taken from them (see the module docs). Not shared
/// between threads: one per store agent, used from its event loop.
#[derive(Debug)]
pub struct QuotaLedger {
    scopes: Vec<ScopeState>,
    pools: Vec<PoolState>,
    buckets: Vec<BucketState>,
    /// Every plan, encoded one after the other: `[parts, (scope, alternatives, (counts
    /// tokens, pools, pool...)..., buckets, bucket...)...]` (one contiguous read per request).
    code: Vec<u32>,
    /// Where each plan starts in `code`, by plan index.
    plans: Vec<u32>,
    /// Heads of the chains of keyed plans in `keyed`, by the key's group ([`key_group`]): an
    /// index, or [`NO_PLAN`]. A direct table rather than a hash map: plans of tenants walked in
    /// turn are then found in order in memory, not at a random place per request.
    by_group: Vec<u32>,
    /// Keyed plans: (key, where the plan starts in `code`, the next plan of its group or
    /// [`NO_PLAN`]).
    keyed: Vec<(u64, u32, u32)>,
    /// Where each plan whose group is [`MAX_GROUPS`] or more starts in `code`, by key.
    by_key: HashMap<u64, u32>,
    holds: Vec<HoldSlot>,
    free: Vec<u32>,
    chunk_fraction: f64,
    /// Whether the replica may not know yet how many replicas share its limits (its first
    /// heartbeats): see [`Self::set_warming`].
    warming: bool,
    /// Admissions taken by [`Self::try_admit`] (the agent adds its own).
    pub admissions: i64,
    kicks: Vec<u32>,
    activated: Vec<u32>,
}

impl QuotaLedger {
    /// An empty ledger; `chunk_fraction` (ratio 0..1) sizes the headroom a replica keeps: that
    /// fraction of a limit ÷ live replicas.
    #[must_use]
    pub fn new(chunk_fraction: f64) -> Self {
        Self {
            scopes: Vec::new(),
            pools: Vec::new(),
            buckets: Vec::new(),
            code: Vec::new(),
            plans: Vec::new(),
            by_group: Vec::new(),
            keyed: Vec::new(),
            by_key: HashMap::new(),
            holds: Vec::new(),
            free: Vec::new(),
            chunk_fraction,
            warming: false,
            admissions: 0,
            kicks: Vec::new(),
            activated: Vec::new(),
        }
    }

    /// Adds a scope (lease expired, one live replica, inactive); returns its index.
    pub fn add_scope(&mut self) -> u32 {
        self.scopes.push(ScopeState {
            lease_until: 0.0,
            live: 1,
            active: false,
        });
        (self.scopes.len() - 1) as u32
    }

    /// Adds a pool of `scope` with its configured limit `base` (units); returns its index.
    ///
    /// # Errors
    /// [`LedgerError::BadIndex`] for an unknown scope.
    pub fn add_pool(&mut self, scope: u32, base: i64) -> Result<u32, LedgerError> {
        self.scope(scope)?;
        self.pools.push(PoolState {
            scope,
            unit: 1,
            base,
            ..PoolState::default()
        });
        Ok((self.pools.len() - 1) as u32)
    }

    /// Adds a token bucket of `scope` of `burst` tokens; returns its index.
    ///
    /// # Errors
    /// [`LedgerError::BadIndex`] for an unknown scope.
    pub fn add_bucket(&mut self, scope: u32, burst: i64) -> Result<u32, LedgerError> {
        self.scope(scope)?;
        self.buckets.push(BucketState {
            scope,
            burst,
            ..BucketState::default()
        });
        Ok((self.buckets.len() - 1) as u32)
    }

    /// Adds a plan (the parts a kind of request takes from), found again by its index (the
    /// result) and, with a `key`, by [`Self::try_admit_key`].
    ///
    /// # Errors
    /// [`LedgerError::BadIndex`] when a part names an unknown scope, pool or bucket.
    pub fn add_plan(&mut self, parts: &[Part], key: Option<u64>) -> Result<u32, LedgerError> {
        for part in parts {
            self.scope(part.scope)?;
            for alt in &part.alts {
                for &p in &alt.pools {
                    if p as usize >= self.pools.len() {
                        return Err(LedgerError::BadIndex("pool", u64::from(p)));
                    }
                }
            }
            for &b in &part.buckets {
                if b as usize >= self.buckets.len() {
                    return Err(LedgerError::BadIndex("bucket", u64::from(b)));
                }
            }
        }
        let start = self.code.len() as u32;
        self.code.push(parts.len() as u32);
        for part in parts {
            self.code.push(part.scope);
            self.code.push(part.alts.len() as u32);
            for alt in &part.alts {
                self.code.push(u32::from(alt.counts_tokens));
                self.code.push(alt.pools.len() as u32);
                self.code.extend_from_slice(&alt.pools);
            }
            self.code.push(part.buckets.len() as u32);
            self.code.extend_from_slice(&part.buckets);
        }
        self.plans.push(start);
        if let Some(key) = key {
            self.insert_key(key, start);
        }
        Ok((self.plans.len() - 1) as u32)
    }

    fn insert_key(&mut self, key: u64, start: u32) {
        let group = key_group(key);
        if group >= MAX_GROUPS {
            self.by_key.insert(key, start);
            return;
        }
        if group >= self.by_group.len() {
            self.by_group.resize(group + 1, NO_PLAN);
        }
        let mut at = self.by_group[group];
        while at != NO_PLAN {
            let entry = &mut self.keyed[at as usize];
            if entry.0 == key {
                entry.1 = start; // the same key added again: the newer plan
                return;
            }
            at = entry.2;
        }
        self.keyed.push((key, start, self.by_group[group]));
        self.by_group[group] = (self.keyed.len() - 1) as u32;
    }

    fn find_key(&self, key: u64) -> Option<u32> {
        let group = key_group(key);
        if group >= MAX_GROUPS {
            return self.by_key.get(&key).copied();
        }
        let mut at = *self.by_group.get(group)?;
        while at != NO_PLAN {
            let (k, start, next) = self.keyed[at as usize];
            if k == key {
                return Some(start);
            }
            at = next;
        }
        None
    }

    /// Forgets every plan (the base limits changed); pools, buckets and holds stay.
    pub fn clear_plans(&mut self) {
        self.code.clear();
        self.plans.clear();
        self.by_group.clear();
        self.keyed.clear();
        self.by_key.clear();
    }

    /// A scope's state.
    ///
    /// # Errors
    /// [`LedgerError::BadIndex`] for an unknown scope.
    pub fn scope(&self, i: u32) -> Result<&ScopeState, LedgerError> {
        self.scopes
            .get(i as usize)
            .ok_or(LedgerError::BadIndex("scope", u64::from(i)))
    }

    /// A scope's state, to change it.
    ///
    /// # Errors
    /// [`LedgerError::BadIndex`] for an unknown scope.
    pub fn scope_mut(&mut self, i: u32) -> Result<&mut ScopeState, LedgerError> {
        self.scopes
            .get_mut(i as usize)
            .ok_or(LedgerError::BadIndex("scope", u64::from(i)))
    }

    /// A pool's field ([`pool_field`]).
    ///
    /// # Errors
    /// [`LedgerError::BadIndex`] for an unknown pool or field.
    pub fn pool_get(&self, i: u32, field: u8) -> Result<i64, LedgerError> {
        let p = self
            .pools
            .get(i as usize)
            .ok_or(LedgerError::BadIndex("pool", u64::from(i)))?;
        Ok(match field {
            pool_field::Q => p.q,
            pool_field::IN_USE => p.in_use,
            pool_field::TAKEN => p.taken,
            pool_field::UNIT => p.unit,
            pool_field::NEAR => i64::from(p.near),
            pool_field::LIMIT => p.limit,
            pool_field::BASE => p.base,
            _ => return Err(LedgerError::BadIndex("pool field", u64::from(field))),
        })
    }

    /// Takes `n` units (slots, or tokens of an in-flight budget) of pool `i` for a request
    /// the agent decided (in Redis, or from this replica's quota while the request waited):
    /// `in_use` and the demand `taken` grow by `n` and `unit` becomes `n`, as for a hold of
    /// [`Self::try_admit`]. Returns whether the quota left is under the low-water mark (half
    /// the headroom): then the pool's scope asks Redis for more.
    ///
    /// # Errors
    /// [`LedgerError::BadIndex`] for an unknown pool.
    pub fn pool_take(&mut self, i: u32, n: i64) -> Result<bool, LedgerError> {
        if i as usize >= self.pools.len() {
            return Err(LedgerError::BadIndex("pool", u64::from(i)));
        }
        Ok(self.take(i, n))
    }

    fn take(&mut self, p: u32, n: i64) -> bool {
        let pool = &mut self.pools[p as usize];
        pool.in_use += n;
        pool.taken += n;
        pool.unit = n;
        let pool = &self.pools[p as usize];
        pool.q - pool.in_use < (self.headroom(pool) + 1) / 2
    }

    /// Sets a pool's field ([`pool_field`]; `NEAR`: non-zero = true).
    ///
    /// # Errors
    /// [`LedgerError::BadIndex`] for an unknown pool or field.
    pub fn pool_set(&mut self, i: u32, field: u8, value: i64) -> Result<(), LedgerError> {
        let p = self
            .pools
            .get_mut(i as usize)
            .ok_or(LedgerError::BadIndex("pool", u64::from(i)))?;
        match field {
            pool_field::Q => p.q = value,
            pool_field::IN_USE => p.in_use = value,
            pool_field::TAKEN => p.taken = value,
            pool_field::UNIT => p.unit = value,
            pool_field::NEAR => p.near = value != 0,
            pool_field::LIMIT => p.limit = value,
            pool_field::BASE => p.base = value,
            _ => return Err(LedgerError::BadIndex("pool field", u64::from(field))),
        }
        Ok(())
    }

    /// A bucket's field ([`bucket_field`]).
    ///
    /// # Errors
    /// [`LedgerError::BadIndex`] for an unknown bucket or field.
    pub fn bucket_get(&self, i: u32, field: u8) -> Result<i64, LedgerError> {
        let b = self
            .buckets
            .get(i as usize)
            .ok_or(LedgerError::BadIndex("bucket", u64::from(i)))?;
        Ok(match field {
            bucket_field::AVAIL => b.avail,
            bucket_field::TAKEN => b.taken,
            bucket_field::CHUNK => b.chunk,
            bucket_field::NEAR => i64::from(b.near),
            bucket_field::BURST => b.burst,
            _ => return Err(LedgerError::BadIndex("bucket field", u64::from(field))),
        })
    }

    /// Sets a bucket's field ([`bucket_field`]; `NEAR`: non-zero = true).
    ///
    /// # Errors
    /// [`LedgerError::BadIndex`] for an unknown bucket or field.
    pub fn bucket_set(&mut self, i: u32, field: u8, value: i64) -> Result<(), LedgerError> {
        let b = self
            .buckets
            .get_mut(i as usize)
            .ok_or(LedgerError::BadIndex("bucket", u64::from(i)))?;
        match field {
            bucket_field::AVAIL => b.avail = value,
            bucket_field::TAKEN => b.taken = value,
            bucket_field::CHUNK => b.chunk = value,
            bucket_field::NEAR => b.near = value != 0,
            bucket_field::BURST => b.burst = value,
            _ => return Err(LedgerError::BadIndex("bucket field", u64::from(field))),
        }
        Ok(())
    }

    /// Whether the replica is warming up: it may not know yet how many replicas share its
    /// limits (it learns their number from its scopes' replies, within a heartbeat of their
    /// start), so a pool's headroom is `chunk_fraction` of the limit ÷ live replicas only,
    /// without the floor of two requests: at a small limit that floor would be half of it
    /// while the replica counts itself alone, and the other replicas' requests would be
    /// refused while it holds that half unused.
    pub fn set_warming(&mut self, on: bool) {
        self.warming = on;
    }

    /// Whether the replica is warming up (see [`Self::set_warming`]).
    #[must_use]
    pub fn warming(&self) -> bool {
        self.warming
    }

    /// Units a replica keeps beyond its use in `pool`: `chunk_fraction` of the limit ÷ live
    /// replicas, within room for two requests of the last size (not while warming up) and
    /// half of its even share, none near the limit or when half of its even share is under
    /// one unit.
    fn headroom(&self, pool: &PoolState) -> i64 {
        if pool.near {
            return 0;
        }
        let limit = if pool.limit != 0 {
            pool.limit
        } else {
            pool.base
        };
        let live = self.scopes[pool.scope as usize].live.max(1);
        let share = (self.chunk_fraction * limit as f64 / live as f64) as i64;
        // none when half an even share is less than one unit (a limit under twice the live
        // replicas): any headroom there would strand a large part of the limit
        let floor = if self.warming { 0 } else { 2 * pool.unit };
        share.max(floor).min(limit.div_euclid(2 * live)).max(0)
    }

    /// The largest grant of a bucket (tokens): `chunk_fraction` of the burst ÷ live
    /// replicas, at least one.
    fn chunk_cap(&self, b: &BucketState) -> i64 {
        let live = self.scopes[b.scope as usize].live.max(1);
        ((self.chunk_fraction * b.burst as f64 / live as f64) as i64).max(1)
    }

    /// The grant size of a bucket before the agent measured its demand: eight requests of
    /// `tokens`, within [`Self::chunk_cap`].
    fn first_chunk(&self, b: &BucketState, tokens: i64) -> i64 {
        (8 * tokens).min(self.chunk_cap(b)).max(1)
    }

    /// Whether what `pool` holds beyond its use goes back to Redis now (the agent's message),
    /// not at the next heartbeat: near a limit, or holding more than twice its headroom.
    fn gives_back_now(&self, pool: &PoolState) -> bool {
        pool.near || pool.q - pool.in_use > 2 * self.headroom(pool)
    }

    /// Whether pool `i` gives back what it holds beyond its use now (the rule of
    /// [`Self::release`], for the agent's own releases).
    ///
    /// # Errors
    /// [`LedgerError::BadIndex`] for an unknown pool.
    pub fn pool_gives_back(&self, i: u32) -> Result<bool, LedgerError> {
        let pool = self
            .pools
            .get(i as usize)
            .ok_or(LedgerError::BadIndex("pool", u64::from(i)))?;
        Ok(self.gives_back_now(pool))
    }

    /// Units this replica keeps beyond its use in pool `i` (see `headroom`).
    ///
    /// # Errors
    /// [`LedgerError::BadIndex`] for an unknown pool.
    pub fn pool_headroom(&self, i: u32) -> Result<i64, LedgerError> {
        let pool = self
            .pools
            .get(i as usize)
            .ok_or(LedgerError::BadIndex("pool", u64::from(i)))?;
        Ok(self.headroom(pool))
    }

    /// The largest grant of bucket `i` (see `chunk_cap`).
    ///
    /// # Errors
    /// [`LedgerError::BadIndex`] for an unknown bucket.
    pub fn bucket_chunk_cap(&self, i: u32) -> Result<i64, LedgerError> {
        let b = self
            .buckets
            .get(i as usize)
            .ok_or(LedgerError::BadIndex("bucket", u64::from(i)))?;
        Ok(self.chunk_cap(b))
    }

    /// The first grant size of bucket `i` for requests of `tokens` (see `first_chunk`).
    ///
    /// # Errors
    /// [`LedgerError::BadIndex`] for an unknown bucket.
    pub fn bucket_first_chunk(&self, i: u32, tokens: i64) -> Result<i64, LedgerError> {
        let b = self
            .buckets
            .get(i as usize)
            .ok_or(LedgerError::BadIndex("bucket", u64::from(i)))?;
        Ok(self.first_chunk(b, tokens))
    }

    fn activate(&mut self, scope: u32) {
        let s = &mut self.scopes[scope as usize];
        if !s.active {
            s.active = true;
            self.activated.push(scope);
        }
    }

    /// Takes `tokens` (prompt + reserved completion) for a request of `plan` from this
    /// replica's quotas at `now` (seconds, the clock of the leases): a hold id, or `None`
    /// (nothing taken) when a lease ran out, a pool list has no room or a bucket is short.
    ///
    /// # Errors
    /// [`LedgerError::BadIndex`] for an unknown plan.
    pub fn try_admit(
        &mut self,
        plan: u32,
        tokens: i64,
        now: f64,
    ) -> Result<Option<u64>, LedgerError> {
        let start = *self
            .plans
            .get(plan as usize)
            .ok_or(LedgerError::BadIndex("plan", u64::from(plan)))?;
        Ok(self.admit_at(start as usize, tokens, now))
    }

    /// [`Self::try_admit`] for the plan added with `key`.
    ///
    /// # Errors
    /// [`LedgerError::NoPlan`] when no plan has that key (since the last
    /// [`Self::clear_plans`]).
    pub fn try_admit_key(
        &mut self,
        key: u64,
        tokens: i64,
        now: f64,
    ) -> Result<Option<u64>, LedgerError> {
        let start = self.find_key(key).ok_or(LedgerError::NoPlan(key))?;
        Ok(self.admit_at(start as usize, tokens, now))
    }

    fn admit_at(&mut self, start: usize, tokens: i64, now: f64) -> Option<u64> {
        // the plan's code is read while the pools and buckets change: moved out meanwhile
        let code = std::mem::take(&mut self.code);
        let got = self.admit_code(&code, start, tokens, now);
        self.code = code;
        got
    }

    fn admit_code(&mut self, code: &[u32], start: usize, tokens: i64, now: f64) -> Option<u64> {
        let slot = if let Some(free) = self.free.pop() {
            free
        } else {
            // generations start at 1: no hold id is 0 (falsy in Python)
            self.holds.push(HoldSlot {
                generation: 1,
                ..HoldSlot::default()
            });
            (self.holds.len() - 1) as u32
        };
        let mut picks = std::mem::take(&mut self.holds[slot as usize].picks);
        let mut buckets = std::mem::take(&mut self.holds[slot as usize].buckets);
        picks.clear();
        buckets.clear();
        let mut fits = true;
        let mut i = start + 1;
        'parts: for _ in 0..code[start] {
            let scope = code[i] as usize;
            if now >= self.scopes[scope].lease_until {
                fits = false;
                break;
            }
            let alts = code[i + 1];
            i += 2;
            for _ in 0..alts {
                let n = if code[i] != 0 { tokens } else { 1 };
                let count = code[i + 1] as usize;
                let pools = &code[i + 2..i + 2 + count];
                i += 2 + count;
                let room = pools.iter().find(|&&p| {
                    let pool = &self.pools[p as usize];
                    pool.q - pool.in_use >= n
                });
                if let Some(&p) = room {
                    picks.push((p, n));
                } else {
                    fits = false;
                    break 'parts;
                }
            }
            let count = code[i] as usize;
            for &b in &code[i + 1..i + 1 + count] {
                if self.buckets[b as usize].avail < tokens {
                    fits = false;
                    break 'parts;
                }
            }
            i += 1 + count;
        }
        if !fits {
            let h = &mut self.holds[slot as usize];
            h.picks = picks;
            h.buckets = buckets;
            self.free.push(slot);
            return None;
        }
        self.admissions += 1;
        for &(p, n) in &picks {
            if self.take(p, n) {
                self.kicks.push(self.pools[p as usize].scope);
            }
        }
        let mut i = start + 1;
        for _ in 0..code[start] {
            let scope = code[i];
            self.activate(scope);
            let alts = code[i + 1];
            i += 2;
            for _ in 0..alts {
                i += 2 + code[i + 1] as usize;
            }
            let count = code[i] as usize;
            for &b in &code[i + 1..i + 1 + count] {
                let chunk = if self.buckets[b as usize].chunk == 0 {
                    self.first_chunk(&self.buckets[b as usize], tokens)
                } else {
                    self.buckets[b as usize].chunk
                };
                let bucket = &mut self.buckets[b as usize];
                bucket.avail -= tokens;
                bucket.taken += tokens;
                bucket.chunk = chunk;
                buckets.push(b);
                if bucket.avail <= bucket.chunk.div_euclid(3) && !bucket.near {
                    self.kicks.push(scope);
                }
            }
            i += 1 + count;
        }
        let h = &mut self.holds[slot as usize];
        h.picks = picks;
        h.buckets = buckets;
        h.held = true;
        Some(u64::from(h.generation) << 32 | u64::from(slot))
    }

    /// Gives back hold `hold`: its units to the pools at once and `reserved - actual` tokens to
    /// each bucket (tokens; an overrun goes below zero, charged by the agent's next message).
    /// Returns `false` (and changes nothing) for a hold already given back or unknown.
    pub fn release(&mut self, hold: u64, reserved: i64, actual: i64) -> bool {
        let slot = (hold & 0xffff_ffff) as usize;
        let generation = (hold >> 32) as u32;
        let Some(h) = self.holds.get_mut(slot) else {
            return false;
        };
        if !h.held || h.generation != generation {
            return false;
        }
        h.held = false;
        h.generation = h.generation.wrapping_add(1).max(1);
        let picks = std::mem::take(&mut h.picks);
        let buckets = std::mem::take(&mut h.buckets);
        for &(p, n) in &picks {
            let pool = &mut self.pools[p as usize];
            pool.in_use = (pool.in_use - n).max(0);
            let pool = &self.pools[p as usize];
            if self.gives_back_now(pool) {
                self.kicks.push(pool.scope);
            }
        }
        let diff = reserved - actual;
        for &b in &buckets {
            let bucket = &mut self.buckets[b as usize];
            bucket.avail += diff;
            if diff < 0 || bucket.near {
                self.kicks.push(bucket.scope);
            }
        }
        let h = &mut self.holds[slot];
        h.picks = picks;
        h.buckets = buckets;
        self.free.push(slot as u32);
        true
    }

    /// The pools of `scope` whose requests hold units now: (pool index, units in use), in
    /// index order. One pass over the pools in Rust: a scope of 100,000 pools (a replica's
    /// standing slices of every tenant) is read without a call per pool.
    ///
    /// # Errors
    /// [`LedgerError::BadIndex`] for an unknown scope.
    pub fn pools_in_use(&self, scope: u32) -> Result<Vec<(u32, i64)>, LedgerError> {
        self.scope(scope)?;
        Ok(self
            .pools
            .iter()
            .enumerate()
            .filter(|(_, p)| p.scope == scope && p.in_use != 0)
            .map(|(i, p)| (i as u32, p.in_use))
            .collect())
    }

    /// The units (pool index, units) and buckets of a hold not yet given back.
    #[must_use]
    pub fn hold_parts(&self, hold: u64) -> Option<HoldParts> {
        let h = self.holds.get((hold & 0xffff_ffff) as usize)?;
        (h.held && h.generation == (hold >> 32) as u32)
            .then(|| (h.picks.clone(), h.buckets.clone()))
    }

    /// Whether the last calls left scopes to kick or newly active scopes to read.
    #[must_use]
    pub fn has_events(&self) -> bool {
        !self.kicks.is_empty() || !self.activated.is_empty()
    }

    /// The scopes to tell Redis about now, in order (a scope may repeat), since the last call.
    pub fn take_kicks(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.kicks)
    }

    /// The scopes that became active since the last call.
    pub fn take_activated(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.activated)
    }
}

#[cfg(test)]
#[allow(clippy::many_single_char_names)]
mod tests {
    use super::*;

    /// One scope's part taking a slot of `pool`.
    fn slot_part(scope: u32, pool: u32) -> Part {
        Part {
            scope,
            alts: vec![Alternative {
                counts_tokens: false,
                pools: vec![pool],
            }],
            buckets: vec![],
        }
    }

    fn one_scope(q: i64, avail: i64) -> (QuotaLedger, u32, u32, u32, u32) {
        let mut l = QuotaLedger::new(0.01);
        let s = l.add_scope();
        l.scope_mut(s).unwrap().lease_until = 100.0;
        let p = l.add_pool(s, 10).unwrap();
        l.pool_set(p, pool_field::Q, q).unwrap();
        let b = l.add_bucket(s, 1000).unwrap();
        l.bucket_set(b, bucket_field::AVAIL, avail).unwrap();
        let plan = l
            .add_plan(
                &[Part {
                    scope: s,
                    alts: vec![Alternative {
                        counts_tokens: false,
                        pools: vec![p],
                    }],
                    buckets: vec![b],
                }],
                None,
            )
            .unwrap();
        (l, s, p, b, plan)
    }

    #[test]
    fn admits_within_the_quota_and_gives_back_once() {
        let (mut l, s, p, b, plan) = one_scope(2, 300);
        let h1 = l.try_admit(plan, 100, 1.0).unwrap().unwrap();
        let h2 = l.try_admit(plan, 100, 1.0).unwrap().unwrap();
        assert!(h1 != 0 && h2 != 0, "no hold id is 0");
        assert_eq!(l.try_admit(plan, 100, 1.0).unwrap(), None, "no third slot");
        assert_eq!(l.pool_get(p, pool_field::IN_USE).unwrap(), 2);
        assert_eq!(l.bucket_get(b, bucket_field::AVAIL).unwrap(), 100);
        assert_eq!(l.take_activated(), vec![s]);
        assert!(l.release(h1, 100, 40));
        assert!(!l.release(h1, 100, 40), "a hold is given back once");
        assert_eq!(l.pool_get(p, pool_field::IN_USE).unwrap(), 1);
        assert_eq!(l.bucket_get(b, bucket_field::AVAIL).unwrap(), 160);
        // an overrun goes below what was reserved and asks for a message at once
        l.take_kicks();
        assert!(l.release(h2, 100, 300));
        assert_eq!(l.bucket_get(b, bucket_field::AVAIL).unwrap(), -40);
        assert_eq!(l.take_kicks(), vec![s]);
        assert_eq!(l.admissions, 2);
    }

    #[test]
    fn nothing_is_taken_when_any_part_is_short() {
        let (mut l, _s, p, b, plan) = one_scope(5, 50);
        assert_eq!(l.try_admit(plan, 100, 1.0).unwrap(), None, "bucket short");
        assert_eq!(l.pool_get(p, pool_field::IN_USE).unwrap(), 0);
        assert_eq!(l.bucket_get(b, bucket_field::AVAIL).unwrap(), 50);
        assert_eq!(l.try_admit(plan, 10, 200.0).unwrap(), None, "lease ran out");
        assert_eq!(l.admissions, 0);
    }

    #[test]
    fn a_stale_hold_id_releases_nothing() {
        let (mut l, _s, p, _b, plan) = one_scope(1, 1000);
        let h = l.try_admit(plan, 1, 1.0).unwrap().unwrap();
        assert!(l.release(h, 1, 1));
        // the slot is reused by the next hold: the old id must not free it
        let h2 = l.try_admit(plan, 1, 1.0).unwrap().unwrap();
        assert_ne!(h, h2);
        assert!(!l.release(h, 1, 1));
        assert_eq!(l.pool_get(p, pool_field::IN_USE).unwrap(), 1);
        assert!(l.release(h2, 1, 1));
        assert!(!l.release(u64::MAX, 1, 1));
    }

    #[test]
    fn first_pool_with_room_and_low_water_kick() {
        let mut l = QuotaLedger::new(0.0);
        let s = l.add_scope();
        l.scope_mut(s).unwrap().lease_until = 10.0;
        let g = l.add_pool(s, 100).unwrap();
        let burst = l.add_pool(s, 100).unwrap();
        l.pool_set(g, pool_field::Q, 1).unwrap();
        l.pool_set(burst, pool_field::Q, 3).unwrap();
        let plan = l
            .add_plan(
                &[Part {
                    scope: s,
                    alts: vec![Alternative {
                        counts_tokens: false,
                        pools: vec![g, burst],
                    }],
                    buckets: vec![],
                }],
                None,
            )
            .unwrap();
        l.try_admit(plan, 5, 0.0).unwrap().unwrap();
        assert_eq!(l.pool_get(g, pool_field::IN_USE).unwrap(), 1);
        // headroom 2 (two requests of one unit) → low-water mark 1: q - in_use = 0 < 1
        assert_eq!(l.take_kicks(), vec![s]);
        l.try_admit(plan, 5, 0.0).unwrap().unwrap();
        assert_eq!(l.pool_get(burst, pool_field::IN_USE).unwrap(), 1);
        assert!(l.take_kicks().is_empty(), "2 left of 3: above the mark");
    }

    #[test]
    fn a_take_decided_by_the_agent_counts_like_a_hold_and_tells_the_low_water_mark() {
        let mut l = QuotaLedger::new(0.0);
        let s = l.add_scope();
        let p = l.add_pool(s, 100).unwrap();
        l.pool_set(p, pool_field::Q, 4).unwrap();
        // headroom 2 × 3 tokens = 6 → low-water mark 3: 4 - 3 = 1 left is under it
        assert!(l.pool_take(p, 3).unwrap());
        assert_eq!(l.pool_get(p, pool_field::IN_USE).unwrap(), 3);
        assert_eq!(l.pool_get(p, pool_field::TAKEN).unwrap(), 3);
        assert_eq!(l.pool_get(p, pool_field::UNIT).unwrap(), 3);
        l.pool_set(p, pool_field::Q, 20).unwrap();
        // headroom 2 × 1 = 2 → mark 1: 20 - 4 = 16 left is above it
        assert!(!l.pool_take(p, 1).unwrap());
        assert_eq!(l.pool_get(p, pool_field::IN_USE).unwrap(), 4);
        assert_eq!(l.pool_get(p, pool_field::TAKEN).unwrap(), 4);
        assert_eq!(l.pool_get(p, pool_field::UNIT).unwrap(), 1);
        assert!(l.pool_take(p + 1, 1).is_err(), "an unknown pool");
        assert!(l.take_kicks().is_empty(), "the agent kicks, not the ledger");
    }

    #[test]
    fn tokens_alternative_and_first_chunk() {
        let mut l = QuotaLedger::new(0.5);
        let s = l.add_scope();
        l.scope_mut(s).unwrap().lease_until = 10.0;
        let inflight = l.add_pool(s, 1_000_000).unwrap();
        l.pool_set(inflight, pool_field::Q, 1000).unwrap();
        let b = l.add_bucket(s, 10_000).unwrap();
        l.bucket_set(b, bucket_field::AVAIL, 5000).unwrap();
        let plan = l
            .add_plan(
                &[Part {
                    scope: s,
                    alts: vec![Alternative {
                        counts_tokens: true,
                        pools: vec![inflight],
                    }],
                    buckets: vec![b],
                }],
                None,
            )
            .unwrap();
        let h = l.try_admit(plan, 400, 0.0).unwrap().unwrap();
        assert_eq!(l.pool_get(inflight, pool_field::IN_USE).unwrap(), 400);
        assert_eq!(l.pool_get(inflight, pool_field::UNIT).unwrap(), 400);
        // eight requests of 400 = 3,200 within half of the burst (5,000)
        assert_eq!(l.bucket_get(b, bucket_field::CHUNK).unwrap(), 3200);
        assert_eq!(l.bucket_chunk_cap(b).unwrap(), 5000);
        assert_eq!(l.bucket_first_chunk(b, 1000).unwrap(), 5000, "capped");
        assert_eq!(l.hold_parts(h), Some((vec![(inflight, 400)], vec![b])));
        assert!(l.try_admit(plan, 700, 0.0).unwrap().is_none(), "600 left");
    }

    #[test]
    fn keyed_plans_until_cleared() {
        let mut l = QuotaLedger::new(0.01);
        let s = l.add_scope();
        l.scope_mut(s).unwrap().lease_until = 10.0;
        let p = l.add_pool(s, 10).unwrap();
        l.pool_set(p, pool_field::Q, 5).unwrap();
        let part = |pool| slot_part(s, pool);
        assert_eq!(l.try_admit_key(7, 1, 0.0), Err(LedgerError::NoPlan(7)));
        l.add_plan(&[part(p)], Some(7)).unwrap();
        let h = l.try_admit_key(7, 1, 0.0).unwrap().unwrap();
        assert_eq!(l.pool_get(p, pool_field::IN_USE).unwrap(), 1);
        l.clear_plans();
        assert_eq!(l.try_admit_key(7, 1, 0.0), Err(LedgerError::NoPlan(7)));
        // a hold outlives the plans it came from
        assert!(l.release(h, 1, 1));
        assert_eq!(l.pool_get(p, pool_field::IN_USE).unwrap(), 0);
    }

    #[test]
    fn while_warming_up_a_small_pool_keeps_no_headroom_and_a_large_one_its_fraction() {
        let mut l = QuotaLedger::new(0.1);
        let s = l.add_scope();
        l.scope_mut(s).unwrap().live = 1; // the replica counts itself alone
        let small = l.add_pool(s, 4).unwrap();
        let large = l.add_pool(s, 100).unwrap();
        for p in [small, large] {
            l.pool_set(p, pool_field::UNIT, 1).unwrap();
        }
        // two requests' room, within half of the even share: half of the small limit
        assert_eq!(l.pool_headroom(small).unwrap(), 2);
        assert_eq!(l.pool_headroom(large).unwrap(), 10);
        l.set_warming(true);
        assert!(l.warming());
        assert_eq!(l.pool_headroom(small).unwrap(), 0);
        assert_eq!(l.pool_headroom(large).unwrap(), 10);
        l.set_warming(false);
        assert_eq!(l.pool_headroom(small).unwrap(), 2);
    }

    #[test]
    fn no_headroom_under_twice_the_live_replicas_and_excess_goes_back_at_release() {
        let mut l = QuotaLedger::new(0.1);
        let s = l.add_scope();
        {
            let sc = l.scope_mut(s).unwrap();
            sc.lease_until = 10.0;
            sc.live = 3;
        }
        let small = l.add_pool(s, 4).unwrap();
        let medium = l.add_pool(s, 10).unwrap();
        // half an even share of 4 slots over 3 replicas is under one slot: none kept
        assert_eq!(l.pool_headroom(small).unwrap(), 0);
        assert_eq!(l.pool_headroom(medium).unwrap(), 1);
        let plan = |l: &mut QuotaLedger, pool| l.add_plan(&[slot_part(s, pool)], None).unwrap();
        let (ps, pm) = (plan(&mut l, small), plan(&mut l, medium));
        l.pool_set(small, pool_field::Q, 1).unwrap();
        l.pool_set(medium, pool_field::Q, 3).unwrap();
        let h = l.try_admit(ps, 1, 0.0).unwrap().unwrap();
        l.take_kicks();
        assert!(l.release(h, 1, 1));
        assert_eq!(
            l.take_kicks(),
            vec![s],
            "an unused slot of the small pool goes back now"
        );
        // the medium pool keeps up to twice its headroom (2) unused, then gives back
        let a = l.try_admit(pm, 1, 0.0).unwrap().unwrap();
        l.take_kicks();
        assert!(l.release(a, 1, 1));
        assert_eq!(l.take_kicks(), vec![s], "3 unused > 2");
        l.pool_set(medium, pool_field::Q, 2).unwrap();
        let a = l.try_admit(pm, 1, 0.0).unwrap().unwrap();
        l.take_kicks();
        assert!(l.release(a, 1, 1));
        assert!(l.take_kicks().is_empty(), "2 unused: kept");
        assert!(!l.pool_gives_back(medium).unwrap());
        l.pool_set(medium, pool_field::Q, 3).unwrap();
        assert!(l.pool_gives_back(medium).unwrap());
        assert!(
            l.pool_gives_back(small).unwrap() == (l.pool_get(small, pool_field::Q).unwrap() > 0)
        );
        assert!(l.pool_gives_back(99).is_err());
    }

    #[test]
    fn pools_in_use_are_those_of_the_scope_with_units_held() {
        let mut l = QuotaLedger::new(0.01);
        let (s, other) = (l.add_scope(), l.add_scope());
        let pools: Vec<u32> = (0..4).map(|_| l.add_pool(s, 10).unwrap()).collect();
        let elsewhere = l.add_pool(other, 10).unwrap();
        for &p in &[pools[1], pools[3], elsewhere] {
            l.pool_take(p, 2).unwrap();
        }
        l.pool_take(pools[3], 1).unwrap();
        assert_eq!(
            l.pools_in_use(s).unwrap(),
            vec![(pools[1], 2), (pools[3], 3)]
        );
        assert_eq!(l.pools_in_use(other).unwrap(), vec![(elsewhere, 2)]);
        assert!(l.pools_in_use(9).is_err());
    }

    #[test]
    fn keyed_plans_of_one_group_and_of_huge_groups() {
        let mut l = QuotaLedger::new(0.01);
        let s = l.add_scope();
        l.scope_mut(s).unwrap().lease_until = 10.0;
        let part = |pool| slot_part(s, pool);
        let pools: Vec<u32> = (0..5).map(|_| l.add_pool(s, 10).unwrap()).collect();
        for &p in &pools {
            l.pool_set(p, pool_field::Q, 5).unwrap();
        }
        // one tenant (group 3) on two backends, sheddable or not; a tenant id past the table
        let keys = [
            3 << 1,
            3 << 1 | 1,
            1 << 33 | 3 << 1,
            (1 << 33) | (3 << 1) | 1,
            (u64::from(u32::MAX) << 1) | 1,
        ];
        for (&key, &p) in keys.iter().zip(&pools) {
            l.add_plan(&[part(p)], Some(key)).unwrap();
        }
        for (&key, &p) in keys.iter().zip(&pools) {
            let h = l.try_admit_key(key, 1, 0.0).unwrap().unwrap();
            assert_eq!(l.hold_parts(h), Some((vec![(p, 1)], vec![])), "key {key}");
            assert!(l.release(h, 1, 1));
        }
        assert_eq!(l.try_admit_key(2 << 1, 1, 0.0), Err(LedgerError::NoPlan(4)));
        assert_eq!(
            l.try_admit_key(5 << 33, 1, 0.0),
            Err(LedgerError::NoPlan(5 << 33))
        );
        // the same key again: the newer plan
        l.add_plan(&[part(pools[4])], Some(keys[0])).unwrap();
        let h = l.try_admit_key(keys[0], 1, 0.0).unwrap().unwrap();
        assert_eq!(l.hold_parts(h), Some((vec![(pools[4], 1)], vec![])));
        l.clear_plans();
        for &key in &keys {
            assert_eq!(l.try_admit_key(key, 1, 0.0), Err(LedgerError::NoPlan(key)));
        }
    }

    #[test]
    fn bad_indices_are_errors() {
        let mut l = QuotaLedger::new(0.01);
        assert!(l.add_pool(3, 1).is_err());
        assert!(l.try_admit(0, 1, 0.0).is_err());
        let s = l.add_scope();
        assert!(l
            .add_plan(
                &[Part {
                    scope: s,
                    alts: vec![Alternative {
                        counts_tokens: false,
                        pools: vec![9]
                    }],
                    buckets: vec![]
                }],
                None
            )
            .is_err());
        assert!(l.pool_get(0, 0).is_err());
        let p = l.add_pool(s, 1).unwrap();
        assert!(l.pool_get(p, 99).is_err());
    }
}
