//! The admission controller: one call admits a request for (backend, tenant, priority class,
//! tokens) against every limit that applies, or says which limit refused and when to retry.
//!
//! All state lives in one fixed-capacity `#[repr(C)]` [`Region`] made only of atomics, either
//! heap-allocated (one process) or mapped from named shared memory (several worker processes
//! sharing one set of limits). The code path is the same both ways. The hot path (`admit`,
//! `release`) takes no lock: every limit is a compare-and-swap counter or a one-word GCRA token
//! bucket. Registration of backends / tenants (rare) takes a small spin lock in the region.
//!
//! Concurrency slots of a backend: the guaranteed slots of each tenant whose guarantee applies
//! to that backend ([`TenantConfig::guaranteed_backends`]; all backends by default) are carved
//! out of the backend's (scaled) concurrency limit; the rest is the shared burst pool. When the scale
//! shrinks the limit, the burst pool shrinks first; guarantees shrink (proportionally) only when
//! the limit is below their sum. `critical` and `standard` requests use the tenant's guaranteed
//! slots first, then the burst pool; `sheddable` requests use only the burst pool and are refused
//! as a whole while the backend is shedding. The in-flight token budget is scaled too, except
//! for a request holding a guaranteed slot, which is checked against the base (unscaled) budget.
//!
//! Crash safety: every process attached to a shared region keeps its own held counts in the
//! region (a private heap region, which dies with its one process, keeps none); `reclaim_dead`
//! (from any live process) gives back what a dead process held. A process is identified by pid and
//! start time, so a reused pid is not mistaken for the dead one. Counters are updated global
//! first, ledger second on acquire, and ledger first, global second on release: a kill between
//! the two can leak one unit (the limit shrinks by one) but never frees a unit twice.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::clock::Clock;
use crate::error::{check_amount, CoreError, MAX_AMOUNT};
use crate::priority::Priority;
use crate::shm::{process_alive, process_start_time, ShmMapping};
use crate::slots::{add, add_in, sub, sub_in, try_acquire_in, Rmw, SlotCounter, UNLIMITED};
use crate::token_bucket::TokenBucket;

/// Most backends one region holds.
pub const MAX_BACKENDS: usize = 32;
/// Most tenants one region holds.
pub const MAX_TENANTS: usize = 256;
/// [`TenantConfig::guaranteed_backends`] value: the guarantee applies to every backend,
/// including backends registered later.
pub const ALL_BACKENDS: u64 = u64::MAX;
/// Most processes (controllers) attached to one region at a time.
pub const MAX_PROCS: usize = 64;
const NAME_WORDS: usize = 8;
/// Longest backend / tenant name in bytes.
pub const MAX_NAME_LEN: usize = NAME_WORDS * 8;
const MAGIC: u64 = 0x6b76_6761_7465_0002; // "kvgate" + layout version 2 (per-backend guarantees)
const SCALE_ONE: u64 = 1_000_000; // scale is stored in parts per million
const CLAIMING: u64 = u64::MAX;
const RECLAIMING: u64 = u64::MAX - 1;
/// Retry-after hint (ns) when a refusal depends on the adaptive scale (shed, scaled-down limit).
const SCALE_RETRY_NS: u64 = 1_000_000_000;
/// Retry-after hint (ns) for slot refusals before any hold time has been measured.
const DEFAULT_HOLD_NS: u64 = 1_000_000_000;
const MIN_RETRY_NS: u64 = 1_000_000;

/// Region header.
#[repr(C)]
#[derive(Debug)]
pub struct Header {
    magic: AtomicU64,
    size: AtomicU64,
    reg_lock: AtomicU64,
    n_backends: AtomicU64,
    n_tenants: AtomicU64,
}

/// One backend's limits and counters.
#[repr(C)]
#[derive(Debug)]
pub struct BackendState {
    ready: AtomicU64,
    name: [AtomicU64; NAME_WORDS],
    max_concurrency: AtomicU64,
    scale_ppm: AtomicU64,
    shedding: AtomicU64,
    in_use: AtomicU64,
    total_guaranteed: AtomicU64,
    burst: SlotCounter,
    inflight: SlotCounter,
    tpm: TokenBucket,
    ewma_hold_ns: AtomicU64,
}

/// One tenant's quota and counters.
#[repr(C)]
#[derive(Debug)]
pub struct TenantState {
    ready: AtomicU64,
    name: [AtomicU64; NAME_WORDS],
    priority: AtomicU64,
    guaranteed_slots: AtomicU64,
    guaranteed_backends: AtomicU64,
    guaranteed: [AtomicU64; MAX_BACKENDS],
    conc: SlotCounter,
    has_tpm: AtomicU64,
    tpm: TokenBucket,
    guar_in_use: [AtomicU64; MAX_BACKENDS],
}

/// One attached process's ledger of what it holds.
#[repr(C)]
#[derive(Debug)]
pub struct ProcState {
    pid: AtomicU64,
    start_time: AtomicU64,
    backend_total: [AtomicU64; MAX_BACKENDS],
    backend_burst: [AtomicU64; MAX_BACKENDS],
    backend_inflight: [AtomicU64; MAX_BACKENDS],
    tenant_conc: [AtomicU64; MAX_TENANTS],
    guar: [[AtomicU64; MAX_BACKENDS]; MAX_TENANTS],
}

/// The whole shared state. All-zero bytes are a valid (empty) region.
#[repr(C)]
#[derive(Debug)]
pub struct Region {
    header: Header,
    backends: [BackendState; MAX_BACKENDS],
    tenants: [TenantState; MAX_TENANTS],
    procs: [ProcState; MAX_PROCS],
}

/// Size in bytes of the shared-memory region.
pub const REGION_SIZE: usize = std::mem::size_of::<Region>();

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

/// A snapshot of a backend for status pages and `x-ratelimit-*` headers.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendSnapshot {
    /// Name.
    pub name: String,
    /// Current scale (0..1].
    pub scale: f64,
    /// Whether the sheddable class is shed.
    pub shedding: bool,
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
    /// Scaled in-flight budget.
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
}

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

enum Storage {
    Heap(NonNull<Region>),
    Shm(ShmMapping),
}

/// The admission controller over one region.
pub struct Admission {
    storage: Storage,
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

fn layout() -> std::alloc::Layout {
    std::alloc::Layout::new::<Region>()
}

#[inline]
fn scaled(base: u64, ppm: u64) -> u64 {
    if base == UNLIMITED || base == 0 || ppm == SCALE_ONE {
        return base;
    }
    ((u128::from(base) * u128::from(ppm) / u128::from(SCALE_ONE)) as u64).max(1)
}

fn write_name(dst: &[AtomicU64; NAME_WORDS], name: &str) {
    let mut buf = [0u8; MAX_NAME_LEN];
    buf[..name.len()].copy_from_slice(name.as_bytes());
    for (i, w) in dst.iter().enumerate() {
        let mut b = [0u8; 8];
        b.copy_from_slice(&buf[i * 8..i * 8 + 8]);
        w.store(u64::from_le_bytes(b), Ordering::Release);
    }
}

fn read_name(src: &[AtomicU64; NAME_WORDS]) -> String {
    let mut buf = Vec::with_capacity(MAX_NAME_LEN);
    for w in src {
        buf.extend_from_slice(&w.load(Ordering::Acquire).to_le_bytes());
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Whether a guarantee with backend mask `mask` applies to backend `bi`.
#[inline]
fn applies(mask: u64, bi: usize) -> bool {
    bi < 64 && (mask >> bi) & 1 == 1
}

fn check_name(name: &str) -> Result<(), CoreError> {
    if name.is_empty() || name.len() > MAX_NAME_LEN || name.contains('\0') {
        return Err(CoreError::InvalidConfig(format!(
            "name {name:?} must be 1..={MAX_NAME_LEN} bytes without NUL"
        )));
    }
    Ok(())
}

fn config_err<T>(msg: String) -> Result<T, CoreError> {
    Err(CoreError::InvalidConfig(msg))
}

/// Releases the region's registration lock on drop.
struct RegGuard<'a>(&'a AtomicU64);

impl Drop for RegGuard<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Release);
    }
}

impl Admission {
    /// A controller over a private heap region.
    pub fn new_heap(clock: Clock) -> Result<Arc<Self>, CoreError> {
        // SAFETY: Region is not zero-sized; all-zero bytes are a valid Region (atomics only).
        #[allow(clippy::cast_ptr_alignment)] // the layout is Region's, so the block is aligned
        let ptr = unsafe { std::alloc::alloc_zeroed(layout()) }.cast::<Region>();
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| CoreError::SharedState("out of memory for the region".into()))?;
        Self::finish(Storage::Heap(ptr), clock, true)
    }

    /// A controller over a private heap region whose every call the caller serialises (e.g.
    /// CPython's GIL, held by the bindings through each call): admit and release update the
    /// limits with plain atomic loads and stores ([`Rmw::Serialized`]) instead of locked
    /// read-modify-writes. Calls made at once from several threads would lose updates; use
    /// [`Admission::new_heap`] for those, and a shared region for several processes.
    pub fn new_heap_serialized(clock: Clock) -> Result<Arc<Self>, CoreError> {
        let mut me = Self::new_heap(clock)?;
        Arc::get_mut(&mut me)
            .ok_or_else(|| CoreError::SharedState("controller already shared".into()))?
            .rmw = Rmw::Serialized;
        Ok(me)
    }

    /// A controller over a new shared-memory region `name` (replacing any stale one).
    pub fn create_shm(name: &str, clock: Clock) -> Result<Arc<Self>, CoreError> {
        let map = ShmMapping::create(name, REGION_SIZE)?;
        Self::finish(Storage::Shm(map), clock, true)
    }

    /// A controller attached to the existing shared-memory region `name`.
    pub fn attach_shm(name: &str, clock: Clock) -> Result<Arc<Self>, CoreError> {
        let map = ShmMapping::open(name, REGION_SIZE)?;
        Self::finish(Storage::Shm(map), clock, false)
    }

    fn finish(storage: Storage, clock: Clock, create: bool) -> Result<Arc<Self>, CoreError> {
        let ledger = matches!(storage, Storage::Shm(_));
        let mut me = Self {
            storage,
            clock,
            proc_idx: 0,
            ledger,
            rmw: Rmw::Atomic,
            leaks: AtomicU64::new(0),
        };
        let h = &me.region().header;
        if create {
            h.size.store(REGION_SIZE as u64, Ordering::Release);
            h.magic.store(MAGIC, Ordering::Release);
        } else {
            let mut tries = 0;
            while h.magic.load(Ordering::Acquire) == 0 && tries < 1000 {
                std::thread::sleep(std::time::Duration::from_millis(1));
                tries += 1;
            }
            if h.magic.load(Ordering::Acquire) != MAGIC
                || h.size.load(Ordering::Acquire) != REGION_SIZE as u64
            {
                return Err(CoreError::SharedState(format!(
                    "shared memory {:?} is not a kvgate region of this version",
                    me.shm_name().unwrap_or_default()
                )));
            }
        }
        me.proc_idx = me.claim_proc()?;
        Ok(Arc::new(me))
    }

    fn claim_proc(&self) -> Result<usize, CoreError> {
        let pid = u64::from(std::process::id());
        let start = process_start_time(std::process::id()).unwrap_or(0);
        for (i, p) in self.region().procs.iter().enumerate() {
            if p.pid
                .compare_exchange(0, CLAIMING, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                p.start_time.store(start, Ordering::Release);
                p.pid.store(pid, Ordering::Release);
                return Ok(i);
            }
        }
        Err(CoreError::SharedState(format!(
            "all {MAX_PROCS} process entries of the region are taken; call reclaim_dead()"
        )))
    }

    /// The region.
    #[inline]
    pub fn region(&self) -> &Region {
        match &self.storage {
            // SAFETY: allocated in new_heap, freed only in Drop.
            Storage::Heap(p) => unsafe { p.as_ref() },
            // SAFETY: the mapping is REGION_SIZE bytes, page aligned, lives as long as self.
            Storage::Shm(m) => unsafe { m.as_ptr().cast::<Region>().as_ref() },
        }
    }

    /// The shared-memory name, if the region is shared.
    pub fn shm_name(&self) -> Option<String> {
        match &self.storage {
            Storage::Heap(_) => None,
            Storage::Shm(m) => Some(m.name().to_owned()),
        }
    }

    /// The controller's clock.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Reservations dropped without release (released automatically), in this process.
    pub fn leaks(&self) -> u64 {
        self.leaks.load(Ordering::Relaxed)
    }

    /// Counts one leak.
    pub fn count_leak(&self) {
        self.leaks.fetch_add(1, Ordering::Relaxed);
    }

    fn lock_registration(&self) -> RegGuard<'_> {
        let lock = &self.region().header.reg_lock;
        let me = u64::from(std::process::id());
        let mut spins = 0u32;
        loop {
            match lock.compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return RegGuard(lock),
                Err(holder) => {
                    spins += 1;
                    if spins % 1000 == 0 {
                        // A holder killed mid-registration must not block everyone forever.
                        let dead = process_start_time(holder as u32).is_none();
                        if dead
                            && lock
                                .compare_exchange(holder, me, Ordering::AcqRel, Ordering::Acquire)
                                .is_ok()
                        {
                            return RegGuard(lock);
                        }
                    }
                    std::thread::yield_now();
                }
            }
        }
    }

    fn backend(&self, id: u32) -> Result<&BackendState, CoreError> {
        let r = self.region();
        let n = r.header.n_backends.load(Ordering::Acquire);
        if u64::from(id) < n {
            let b = &r.backends[id as usize];
            if b.ready.load(Ordering::Acquire) == 1 {
                return Ok(b);
            }
        }
        config_err(format!("unknown backend id {id} ({n} backends registered)"))
    }

    fn tenant(&self, id: u32) -> Result<&TenantState, CoreError> {
        let r = self.region();
        let n = r.header.n_tenants.load(Ordering::Acquire);
        if u64::from(id) < n {
            let t = &r.tenants[id as usize];
            if t.ready.load(Ordering::Acquire) == 1 {
                return Ok(t);
            }
        }
        config_err(format!("unknown tenant id {id} ({n} tenants registered)"))
    }

    /// Number of registered backends.
    pub fn backend_count(&self) -> u32 {
        self.region().header.n_backends.load(Ordering::Acquire) as u32
    }

    /// Number of registered tenants.
    pub fn tenant_count(&self) -> u32 {
        self.region().header.n_tenants.load(Ordering::Acquire) as u32
    }

    /// The id of the backend called `name`.
    pub fn backend_id(&self, name: &str) -> Option<u32> {
        (0..self.backend_count())
            .find(|&i| self.backend(i).is_ok_and(|b| read_name(&b.name) == name))
    }

    /// The id of the tenant called `name`.
    pub fn tenant_id(&self, name: &str) -> Option<u32> {
        (0..self.tenant_count()).find(|&i| self.tenant(i).is_ok_and(|t| read_name(&t.name) == name))
    }

    fn check_backend_config(c: &BackendConfig) -> Result<(u64, u64), CoreError> {
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

    fn check_tenant_config(c: &TenantConfig) -> Result<Option<(u64, u64)>, CoreError> {
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
    fn check_guarantees(
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
    fn store_guarantees(&self, t: &TenantState, c: &TenantConfig, totals: &[u64; MAX_BACKENDS]) {
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
        if priority == Priority::Sheddable && b.shedding.load(Ordering::Acquire) != 0 {
            return refuse(Reason::Shed, Some(SCALE_RETRY_NS));
        }
        let now = self.clock.now_ns();
        let ppm = b.scale_ppm.load(Ordering::Acquire);
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
        let g_t = t.guaranteed[backend as usize].load(Ordering::Acquire);
        let guar = &t.guar_in_use[backend as usize];
        let mut pool = None;
        if priority != Priority::Sheddable && g_t > 0 {
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
            Pool::Guaranteed => sub_in(rmw, guar, 1),
            Pool::Burst => b.burst.release_saturating_in(rmw, 1).into_unit(),
        };
        // In-flight tokens. A request on a guaranteed slot is held to the base budget (the
        // engine's KV capacity × safety factor, so the engine stays protected), not the scaled
        // one: the adaptive scale shrinks what the others share, never a guarantee. Without
        // this, a scale below the tokens already in flight (long generations holding their
        // reservations) refuses even a critical tenant's short chat until they finish.
        let base_inflight = b.inflight.limit();
        let inflight_limit = if pool == Pool::Guaranteed {
            base_inflight
        } else {
            scaled(base_inflight, ppm)
        };
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
            let p = &self.region().procs[self.proc_idx];
            let bi = backend as usize;
            add(&p.backend_total[bi], 1);
            match pool {
                Pool::Guaranteed => add(&p.guar[tenant as usize][bi], 1),
                Pool::Burst => add(&p.backend_burst[bi], 1),
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
        if self.ledger {
            // Ledger first, global second.
            let p = &self.region().procs[self.proc_idx];
            sub(&p.backend_total[bi], 1);
            match ticket.pool {
                Pool::Guaranteed => sub(&p.guar[ti][bi], 1),
                Pool::Burst => sub(&p.backend_burst[bi], 1),
            }
            sub(&p.backend_inflight[bi], ticket.tokens);
            sub(&p.tenant_conc[ti], 1);
        }
        sub_in(rmw, &b.in_use, 1);
        match ticket.pool {
            Pool::Guaranteed => sub_in(rmw, &t.guar_in_use[bi], 1),
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

    /// Reclaims what dead processes attached to this region held (slots, in-flight tokens,
    /// tenant concurrency). Returns the number of concurrency slots given back.
    pub fn reclaim_dead(&self) -> u64 {
        let r = self.region();
        let mut slots = 0;
        for p in &r.procs {
            let pid = p.pid.load(Ordering::Acquire);
            if pid == 0 || pid == CLAIMING || pid == RECLAIMING {
                continue;
            }
            if process_alive(pid as u32, p.start_time.load(Ordering::Acquire)) {
                continue;
            }
            if p.pid
                .compare_exchange(pid, RECLAIMING, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            slots += Self::drain(r, p);
            p.start_time.store(0, Ordering::Release);
            p.pid.store(0, Ordering::Release);
        }
        slots
    }

    /// Moves a ledger's holdings out of the global counters; returns slots given back.
    fn drain(r: &Region, p: &ProcState) -> u64 {
        let mut slots = 0;
        for (bi, b) in r.backends.iter().enumerate() {
            let total = p.backend_total[bi].swap(0, Ordering::AcqRel);
            sub(&b.in_use, total);
            slots += total;
            b.burst
                .release_saturating(p.backend_burst[bi].swap(0, Ordering::AcqRel))
                .into_unit();
            b.inflight
                .release_saturating(p.backend_inflight[bi].swap(0, Ordering::AcqRel))
                .into_unit();
        }
        for (ti, t) in r.tenants.iter().enumerate() {
            t.conc
                .release_saturating(p.tenant_conc[ti].swap(0, Ordering::AcqRel))
                .into_unit();
            for (bi, g) in p.guar[ti].iter().enumerate() {
                sub(&t.guar_in_use[bi], g.swap(0, Ordering::AcqRel));
            }
        }
        slots
    }

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
            shedding: b.shedding.load(Ordering::Acquire) != 0,
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
            effective_inflight_token_limit: (il != UNLIMITED).then(|| scaled(il, ppm)),
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
        let (limit_t, avail, full) = if t.has_tpm.load(Ordering::Acquire) == 1 {
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
            guaranteed_backends: (0..self.backend_count())
                .filter(|&bi| applies(c.guaranteed_backends, bi as usize))
                .collect(),
            max_concurrency: c.max_concurrency,
            in_use,
            tokens_per_minute: c.tokens_per_minute,
            burst_tokens: c.burst_tokens,
            available_tokens: has.then(|| t.tpm.available(now)),
            time_to_full_ns: has.then(|| t.tpm.time_to_full_ns(now)),
        })
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

impl Drop for Admission {
    fn drop(&mut self) {
        let r = self.region();
        let p = &r.procs[self.proc_idx];
        // Anything still in this controller's ledger is given back (leaked reservations release
        // themselves before the controller can drop, so this is normally empty).
        Self::drain(r, p);
        p.start_time.store(0, Ordering::Release);
        p.pid.store(0, Ordering::Release);
        if let Storage::Heap(ptr) = self.storage {
            // SAFETY: allocated with this layout in new_heap; no reference outlives self.
            unsafe { std::alloc::dealloc(ptr.as_ptr().cast(), layout()) };
        }
    }
}

#[cfg(test)]
#[allow(clippy::many_single_char_names)] // a: admission, b: backend, t: tenant, r: refusal
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn setup() -> (Arc<Admission>, Arc<ManualClock>, u32) {
        setup_in(Rmw::Atomic)
    }

    /// A controller in mode `rmw` on a manual clock with one backend: 4 slots, 6,000 TPM,
    /// 1,000 in-flight tokens.
    fn setup_in(rmw: Rmw) -> (Arc<Admission>, Arc<ManualClock>, u32) {
        let mc = Arc::new(ManualClock::new(0));
        let clock = Clock::Manual(mc.clone());
        let a = match rmw {
            Rmw::Atomic => Admission::new_heap(clock),
            Rmw::Serialized => Admission::new_heap_serialized(clock),
        }
        .unwrap();
        let b = a
            .add_backend(
                "b0",
                &BackendConfig {
                    max_concurrency: 4,
                    tokens_per_minute: 6000,
                    burst_tokens: None,
                    inflight_token_limit: Some(1000),
                },
            )
            .unwrap();
        (a, mc, b)
    }

    fn tenant(a: &Admission, name: &str, p: Priority, g: u64, tpm: Option<u64>) -> u32 {
        a.add_tenant(
            name,
            &TenantConfig {
                priority: p,
                tokens_per_minute: tpm,
                burst_tokens: None,
                max_concurrency: None,
                guaranteed_slots: g,
                guaranteed_backends: ALL_BACKENDS,
            },
        )
        .unwrap()
    }

    /// `(controller, its clock, backend id, [(tenant id, its priority); 3])`.
    type ModelController = (Arc<Admission>, Arc<ManualClock>, u32, [(u32, Priority); 3]);

    /// [`setup_in`]'s controller with three tenants: critical with 2 guaranteed slots and
    /// 3,000 TPM, standard limited to 3 at once, sheddable.
    fn model_controller(rmw: Rmw) -> ModelController {
        let (a, mc, b) = setup_in(rmw);
        let mut tenants = [(0, Priority::Critical); 3];
        for (i, (p, g, tpm, conc)) in [
            (Priority::Critical, 2, Some(3000), None),
            (Priority::Standard, 0, None, Some(3)),
            (Priority::Sheddable, 0, None, None),
        ]
        .into_iter()
        .enumerate()
        {
            let id = a
                .add_tenant(
                    &format!("t{i}"),
                    &TenantConfig {
                        priority: p,
                        tokens_per_minute: tpm,
                        burst_tokens: None,
                        max_concurrency: conc,
                        guaranteed_slots: g,
                        guaranteed_backends: ALL_BACKENDS,
                    },
                )
                .unwrap();
            tenants[i] = (id, p);
        }
        (a, mc, b, tenants)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]

        /// The serialised mode (plain loads and stores, for callers that serialise every call)
        /// decides and counts exactly as compare-and-swap does, call for call: the same
        /// admissions and refusals (reasons and retry hints), the same snapshots after every
        /// step, through scale changes, shedding, refunds, overruns and clock steps, and
        /// nothing held at the end.
        #[test]
        fn serialized_mode_matches_atomic_mode(
            ops in proptest::collection::vec((0u8..6, 0u64..1_300, 0usize..3), 1..150)
        ) {
            let (x, mcx, b, tenants) = model_controller(Rmw::Atomic);
            let (y, mcy, _, _) = model_controller(Rmw::Serialized);
            let mut held: Vec<(Ticket, Ticket)> = Vec::new();
            for (op, n, k) in ops {
                match op {
                    0..=2 => {
                        let (t, p) = tenants[k];
                        let (rx, ry) = (x.admit(b, t, p, n).unwrap(), y.admit(b, t, p, n).unwrap());
                        match (rx, ry) {
                            (Ok(tx), Ok(ty)) => {
                                proptest::prop_assert_eq!(tx, ty);
                                held.push((tx, ty));
                            }
                            (rx, ry) => proptest::prop_assert_eq!(rx, ry),
                        }
                    }
                    3 if !held.is_empty() => {
                        let (tx, ty) = held.swap_remove(n as usize % held.len());
                        let actual = (k > 0).then_some(n);
                        x.release(&tx, actual).unwrap();
                        y.release(&ty, actual).unwrap();
                    }
                    4 => {
                        mcx.advance_ns(n * 10_000_000);
                        mcy.advance_ns(n * 10_000_000);
                    }
                    5 => {
                        let scale = [0.6, 0.8, 1.0][k];
                        x.set_scale(b, scale).unwrap();
                        y.set_scale(b, scale).unwrap();
                        x.set_shedding(b, n % 2 == 0).unwrap();
                        y.set_shedding(b, n % 2 == 0).unwrap();
                    }
                    _ => {}
                }
                proptest::prop_assert_eq!(x.backend_state(b).unwrap(), y.backend_state(b).unwrap());
                for (t, _) in tenants {
                    proptest::prop_assert_eq!(x.tenant_state(t).unwrap(), y.tenant_state(t).unwrap());
                }
            }
            for (tx, ty) in held.drain(..) {
                x.release(&tx, None).unwrap();
                y.release(&ty, None).unwrap();
            }
            let (sx, sy) = (x.backend_state(b).unwrap(), y.backend_state(b).unwrap());
            proptest::prop_assert_eq!((sx.in_use, sx.inflight_tokens), (0, 0));
            proptest::prop_assert_eq!(sx, sy);
        }
    }

    #[test]
    fn zero_tokens_fit_above_a_lowered_budget_in_both_modes() {
        // Found by `serialized_mode_matches_atomic_mode`: the serialised mode refused a
        // zero-token request while the in-flight tokens were above the scaled budget.
        for rmw in [Rmw::Atomic, Rmw::Serialized] {
            let (a, _mc, b, [(crit, pc), (std_t, ps), _]) = model_controller(rmw);
            a.set_scale(b, 0.8).unwrap();
            assert!(a.admit(b, crit, pc, 801).unwrap().is_ok(), "{rmw:?}"); // base budget
            assert!(a.admit(b, std_t, ps, 0).unwrap().is_ok(), "{rmw:?}");
            assert_eq!(a.backend_state(b).unwrap().inflight_tokens, 801, "{rmw:?}");
        }
    }

    #[test]
    fn admits_and_releases_everything() {
        let (a, _mc, b) = setup();
        let t = tenant(&a, "t", Priority::Standard, 0, Some(600));
        let tk = a.admit(b, t, Priority::Standard, 100).unwrap().unwrap();
        let s = a.backend_state(b).unwrap();
        assert_eq!(
            (s.in_use, s.inflight_tokens, s.available_tokens),
            (1, 100, 5900)
        );
        a.release(&tk, Some(40)).unwrap();
        let s = a.backend_state(b).unwrap();
        assert_eq!(
            (s.in_use, s.inflight_tokens, s.available_tokens),
            (0, 0, 5960)
        );
        assert_eq!(a.tenant_state(t).unwrap().available_tokens, Some(560));
    }

    #[test]
    fn refusal_reasons_and_nothing_held() {
        let (a, _mc, b) = setup();
        let t = tenant(&a, "t", Priority::Standard, 0, Some(600));
        let r = a.admit(b, t, Priority::Standard, 601).unwrap().unwrap_err();
        assert_eq!((r.reason, r.retry_after_ns), (Reason::TenantTpm, None));
        let zero = a.admit(b, t, Priority::Standard, 0).unwrap().unwrap();
        a.release(&zero, None).unwrap();
        let u = tenant(&a, "u", Priority::Standard, 0, None);
        let r = a
            .admit(b, u, Priority::Standard, 1001)
            .unwrap()
            .unwrap_err();
        assert_eq!((r.reason, r.retry_after_ns), (Reason::InflightTokens, None));
        let mut held: Vec<_> = (0..3)
            .map(|_| a.admit(b, u, Priority::Standard, 300).unwrap().unwrap())
            .collect();
        let r = a.admit(b, u, Priority::Standard, 200).unwrap().unwrap_err();
        assert_eq!(r.reason, Reason::InflightTokens);
        assert!(r.retry_after_ns.is_some());
        held.push(a.admit(b, u, Priority::Standard, 50).unwrap().unwrap());
        let r = a.admit(b, u, Priority::Standard, 1).unwrap().unwrap_err();
        assert_eq!(r.reason, Reason::BackendSlots);
        assert_eq!(r.reason.scope(), "backend");
        let s = a.backend_state(b).unwrap();
        assert_eq!((s.in_use, s.inflight_tokens), (4, 950));
        for tk in &held {
            a.release(tk, None).unwrap();
        }
        a.set_shedding(b, true).unwrap();
        let r = a.admit(b, u, Priority::Sheddable, 1).unwrap().unwrap_err();
        assert_eq!(r.reason, Reason::Shed);
        assert!(a.admit(b, u, Priority::Critical, 1).unwrap().is_ok());
    }

    #[test]
    fn guarantees_and_burst_pool_under_scale() {
        let (a, _mc, b) = setup(); // 4 slots
        let gold = tenant(&a, "gold", Priority::Critical, 2, None);
        let batch = tenant(&a, "batch", Priority::Sheddable, 0, None);
        // Burst pool = 4 - 2 = 2: sheddable gets two, not more.
        let s1 = a.admit(b, batch, Priority::Sheddable, 1).unwrap().unwrap();
        let _s2 = a.admit(b, batch, Priority::Sheddable, 1).unwrap().unwrap();
        assert_eq!(
            a.admit(b, batch, Priority::Sheddable, 1)
                .unwrap()
                .unwrap_err()
                .reason,
            Reason::BackendSlots
        );
        // The guarantee is still there for gold.
        let g1 = a.admit(b, gold, Priority::Critical, 1).unwrap().unwrap();
        assert_eq!(g1.pool, Pool::Guaranteed);
        let _g2 = a.admit(b, gold, Priority::Critical, 1).unwrap().unwrap();
        assert!(a.admit(b, gold, Priority::Critical, 1).unwrap().is_err());
        // Scale 0.5: limit 2 -> burst pool 0, guarantees intact.
        a.set_scale(b, 0.5).unwrap();
        a.release(&s1, None).unwrap();
        assert!(a.admit(b, batch, Priority::Sheddable, 1).unwrap().is_err());
        a.release(&g1, None).unwrap();
        assert!(a.admit(b, gold, Priority::Critical, 1).unwrap().is_ok());
        // Scale 0.25: limit 1 < guarantees 2 -> gold keeps only 1 (already held 2).
        a.set_scale(b, 0.25).unwrap();
        assert_eq!(a.backend_state(b).unwrap().burst_pool, 0);
        assert!(a.admit(b, gold, Priority::Critical, 1).unwrap().is_err());
        assert!(a.set_scale(b, 0.0).is_err());
        assert!(a.set_scale(b, 1.5).is_err());
    }

    #[test]
    fn guaranteed_slot_keeps_the_base_inflight_budget_under_scale() {
        let (a, _mc, b) = setup(); // 4 slots, in-flight budget 1000 tokens
        let gold = tenant(&a, "gold", Priority::Critical, 1, None);
        let std_t = tenant(&a, "std", Priority::Standard, 0, None);
        let long = a.admit(b, std_t, Priority::Standard, 700).unwrap().unwrap();
        // Scale 0.75: 3 slots (1 guaranteed + 2 burst), scaled budget 750 tokens.
        a.set_scale(b, 0.75).unwrap();
        let r = a
            .admit(b, std_t, Priority::Standard, 100)
            .unwrap()
            .unwrap_err();
        assert_eq!(r.reason, Reason::InflightTokens);
        // The guaranteed slot is held to the base budget: 700 + 100 <= 1000.
        let g = a.admit(b, gold, Priority::Critical, 100).unwrap().unwrap();
        assert_eq!(g.pool, Pool::Guaranteed);
        // Its guarantee used up, gold falls back to the burst pool and the scaled budget.
        let r = a
            .admit(b, gold, Priority::Critical, 100)
            .unwrap()
            .unwrap_err();
        assert_eq!(r.reason, Reason::InflightTokens);
        a.release(&g, None).unwrap();
        // Never past the base budget, guarantee or not: 700 + 301 > 1000.
        let r = a
            .admit(b, gold, Priority::Critical, 301)
            .unwrap()
            .unwrap_err();
        assert_eq!(r.reason, Reason::InflightTokens);
        a.release(&long, None).unwrap();
        assert_eq!(a.backend_state(b).unwrap().inflight_tokens, 0);
    }

    #[test]
    fn config_validation() {
        let (a, _mc, _b) = setup();
        let bad = TenantConfig {
            priority: Priority::Sheddable,
            tokens_per_minute: None,
            burst_tokens: None,
            max_concurrency: None,
            guaranteed_slots: 1,
            guaranteed_backends: ALL_BACKENDS,
        };
        assert!(a.add_tenant("x", &bad).is_err());
        let too_many = TenantConfig {
            priority: Priority::Critical,
            guaranteed_slots: 5,
            ..bad
        };
        assert!(a.add_tenant("x", &too_many).is_err());
        assert!(a.admit(9, 0, Priority::Critical, 1).is_err());
    }

    fn two_backends() -> (Arc<Admission>, u32, u32) {
        let (a, _mc, b0) = setup(); // 4 slots
        let b1 = a
            .add_backend(
                "b1",
                &BackendConfig {
                    max_concurrency: 4,
                    tokens_per_minute: 6000,
                    burst_tokens: None,
                    inflight_token_limit: None,
                },
            )
            .unwrap();
        (a, b0, b1)
    }

    fn scoped(p: Priority, g: u64, backends: &[u32]) -> TenantConfig {
        TenantConfig {
            priority: p,
            tokens_per_minute: None,
            burst_tokens: None,
            max_concurrency: None,
            guaranteed_slots: g,
            guaranteed_backends: backends.iter().fold(0, |m, &b| m | 1 << b),
        }
    }

    #[test]
    fn guarantee_applies_only_to_its_backends() {
        let (a, b0, b1) = two_backends();
        let gold = a
            .add_tenant("gold", &scoped(Priority::Critical, 3, &[b0]))
            .unwrap();
        let other = tenant(&a, "other", Priority::Standard, 0, None);
        let (s0, s1) = (a.backend_state(b0).unwrap(), a.backend_state(b1).unwrap());
        assert_eq!((s0.guaranteed_slots, s0.burst_pool), (3, 1));
        assert_eq!((s1.guaranteed_slots, s1.burst_pool), (0, 4));
        let ts = a.tenant_state(gold).unwrap();
        assert_eq!((ts.guaranteed_slots, ts.guaranteed_backends), (3, vec![b0]));
        // b1's burst pool is whole: four burst slots for anyone, gold's requests included.
        let g = a.admit(b1, gold, Priority::Critical, 1).unwrap().unwrap();
        assert_eq!(g.pool, Pool::Burst);
        let held: Vec<_> = (0..3)
            .map(|_| a.admit(b1, other, Priority::Standard, 1).unwrap().unwrap())
            .collect();
        assert!(held.iter().all(|tk| tk.pool == Pool::Burst));
        let r = a
            .admit(b1, gold, Priority::Critical, 1)
            .unwrap()
            .unwrap_err();
        assert_eq!(r.reason, Reason::BackendSlots);
        // b0: one burst slot for others, three only for gold.
        let o = a.admit(b0, other, Priority::Standard, 1).unwrap().unwrap();
        assert!(a.admit(b0, other, Priority::Standard, 1).unwrap().is_err());
        for _ in 0..3 {
            let tk = a.admit(b0, gold, Priority::Critical, 1).unwrap().unwrap();
            assert_eq!(tk.pool, Pool::Guaranteed);
        }
        a.release(&o, None).unwrap();
        a.release(&g, None).unwrap();
        for tk in &held {
            a.release(tk, None).unwrap();
        }
        assert_eq!(a.backend_state(b1).unwrap().in_use, 0);
        assert_eq!(a.backend_state(b0).unwrap().in_use, 3);
    }

    #[test]
    fn guarantee_sums_are_checked_per_backend() {
        let (a, b0, b1) = two_backends(); // 4 slots each
        a.add_tenant("g0", &scoped(Priority::Critical, 3, &[b0]))
            .unwrap();
        // 3 + 3 fits nowhere if both were on every backend; on separate backends it fits.
        let g1 = a
            .add_tenant("g1", &scoped(Priority::Critical, 3, &[b1]))
            .unwrap();
        // On every backend: b0 would hold 3 + 2 > 4.
        let all = TenantConfig {
            guaranteed_backends: ALL_BACKENDS,
            ..scoped(Priority::Critical, 2, &[])
        };
        let e = a.add_tenant("x", &all).unwrap_err().to_string();
        assert!(e.contains("\"b0\"") && e.contains("total 5"), "{e}");
        assert_eq!(a.tenant_id("x"), None);
        // A backend id that is not registered.
        let e = a
            .add_tenant("y", &scoped(Priority::Critical, 1, &[5]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("backend id 5"), "{e}");
        // Nothing changed by the refusals.
        assert_eq!(a.backend_state(b0).unwrap().guaranteed_slots, 3);
        assert_eq!(a.backend_state(b1).unwrap().guaranteed_slots, 3);
        // One slot on every backend fits (4 and 4), also on a backend added later.
        let one = a
            .add_tenant(
                "one",
                &TenantConfig {
                    guaranteed_backends: ALL_BACKENDS,
                    ..scoped(Priority::Standard, 1, &[])
                },
            )
            .unwrap();
        let mut cfg = BackendConfig {
            max_concurrency: 1,
            tokens_per_minute: 6000,
            burst_tokens: None,
            inflight_token_limit: None,
        };
        let b2 = a.add_backend("b2", &cfg).unwrap();
        assert_eq!(a.backend_state(b2).unwrap().guaranteed_slots, 1);
        assert_eq!(
            a.tenant_state(one).unwrap().guaranteed_backends,
            vec![b0, b1, b2]
        );
        assert_eq!(a.tenant_state(g1).unwrap().guaranteed_backends, vec![b1]);
        let tk = a.admit(b2, one, Priority::Standard, 1).unwrap().unwrap();
        assert_eq!(tk.pool, Pool::Guaranteed);
        a.release(&tk, None).unwrap();
        // b1 cannot shrink below its own total (3 + 1); b2 is not bound by b0's.
        cfg.max_concurrency = 3;
        assert!(a.update_backend(b1, &cfg).is_err());
        cfg.max_concurrency = 2;
        a.update_backend(b2, &cfg).unwrap();
        // A new backend must have room for the every-backend guarantees only.
        cfg.max_concurrency = 1;
        assert!(a.add_backend("b3", &cfg).is_ok());
    }

    #[test]
    fn moving_a_guarantee_keeps_held_slots() {
        let (a, b0, b1) = two_backends(); // 4 slots each
        let gold = a
            .add_tenant("gold", &scoped(Priority::Critical, 2, &[b0]))
            .unwrap();
        let other = tenant(&a, "other", Priority::Standard, 0, None);
        let held: Vec<_> = (0..2)
            .map(|_| a.admit(b0, gold, Priority::Critical, 10).unwrap().unwrap())
            .collect();
        assert!(held.iter().all(|tk| tk.pool == Pool::Guaranteed));
        a.update_tenant(gold, &scoped(Priority::Critical, 2, &[b1]))
            .unwrap();
        let (s0, s1) = (a.backend_state(b0).unwrap(), a.backend_state(b1).unwrap());
        assert_eq!((s0.guaranteed_slots, s0.in_use), (0, 2));
        assert_eq!((s1.guaranteed_slots, s1.burst_pool), (2, 2));
        assert_eq!(a.tenant_state(gold).unwrap().in_use, 2);
        // b0: the held slots still count, so the grown burst pool stops at the limit.
        let burst: Vec<_> = (0..2)
            .map(|_| a.admit(b0, other, Priority::Standard, 1).unwrap().unwrap())
            .collect();
        let r = a
            .admit(b0, other, Priority::Standard, 1)
            .unwrap()
            .unwrap_err();
        assert_eq!(r.reason, Reason::BackendSlots);
        // b1: gold's guarantee is there now.
        let g1 = a.admit(b1, gold, Priority::Critical, 1).unwrap().unwrap();
        assert_eq!(g1.pool, Pool::Guaranteed);
        // The old tickets release cleanly; b0 is then all burst pool.
        for tk in held.iter().chain(&burst) {
            a.release(tk, None).unwrap();
        }
        let s0 = a.backend_state(b0).unwrap();
        assert_eq!((s0.in_use, s0.inflight_tokens, s0.burst_in_use), (0, 0, 0));
        let four: Vec<_> = (0..4)
            .map(|_| a.admit(b0, other, Priority::Standard, 1).unwrap().unwrap())
            .collect();
        assert_eq!(four.len(), 4);
        assert_eq!(a.tenant_state(gold).unwrap().in_use, 1);
        // A move that does not fit is refused and changes nothing.
        a.add_tenant("big", &scoped(Priority::Critical, 3, &[b0]))
            .unwrap();
        assert!(a
            .update_tenant(gold, &scoped(Priority::Critical, 2, &[b0, b1]))
            .is_err());
        assert_eq!(a.tenant_config(gold).unwrap().guaranteed_backends, 1 << b1);
        assert_eq!(a.backend_state(b0).unwrap().guaranteed_slots, 3);
    }

    #[test]
    fn shm_shared_and_reclaim() {
        let name = format!("kvgate-test-adm-{}", std::process::id());
        let a = Admission::create_shm(&name, Clock::Monotonic).unwrap();
        let b = a
            .add_backend(
                "b",
                &BackendConfig {
                    max_concurrency: 3,
                    tokens_per_minute: 1_000_000,
                    burst_tokens: None,
                    inflight_token_limit: None,
                },
            )
            .unwrap();
        let t = tenant(&a, "t", Priority::Standard, 0, None);
        let w = Admission::attach_shm(&name, Clock::Monotonic).unwrap();
        assert_eq!(w.backend_id("b"), Some(b));
        let tk = w.admit(b, t, Priority::Standard, 10).unwrap().unwrap();
        assert_eq!(a.backend_state(b).unwrap().in_use, 1);
        // Pretend the worker died: mark its ledger with a pid that is not alive.
        let p = &a.region().procs[w.proc_idx];
        p.pid.store(0x3fff_fff0, Ordering::Release);
        assert_eq!(a.reclaim_dead(), 1);
        let s = a.backend_state(b).unwrap();
        assert_eq!((s.in_use, s.inflight_tokens), (0, 0));
        assert_eq!(tk.tokens, 10);
    }

    #[test]
    fn hold_time_ewma_is_sampled_with_the_system_clock() {
        let a = Admission::new_heap(Clock::Monotonic).unwrap();
        let b = a
            .add_backend(
                "b",
                &BackendConfig {
                    max_concurrency: 4,
                    tokens_per_minute: 1_000_000,
                    burst_tokens: None,
                    inflight_token_limit: None,
                },
            )
            .unwrap();
        let t = tenant(&a, "t", Priority::Standard, 0, None);
        let hold = |a: &Admission| a.backend_state(b).unwrap().hold_time_ewma_ns;
        // The first release is always timed: the EWMA starts from a measured hold.
        let tk = a.admit(b, t, Priority::Standard, 10).unwrap().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        a.release(&tk, None).unwrap();
        let first = hold(&a);
        // The clock advances by ticks: a 20 ms hold reads at least 20 ms less one tick.
        let tick = crate::clock::resolution_ns();
        assert!(first >= 20_000_000 - tick.min(20_000_000), "{first}");
        // Then about one release in HOLD_SAMPLE_EVERY: a run of instant releases moves the EWMA
        // down, by one 1/8 step per sampled release, so far less than if every release were
        // timed (0.875^64 of the first hold, about 0.02%).
        for _ in 0..HOLD_SAMPLE_EVERY * 8 {
            let tk = a.admit(b, t, Priority::Standard, 10).unwrap().unwrap();
            a.release(&tk, None).unwrap();
        }
        let after = hold(&a);
        assert!(after < first, "{after} vs {first}");
        assert!(after > first / 1000, "{after}: every release was timed");
        assert_eq!(a.backend_state(b).unwrap().in_use, 0);
    }

    #[test]
    fn refund_gives_back_what_was_charged_across_a_scale_change() {
        let mc = Arc::new(ManualClock::new(0));
        let a = Admission::new_heap(Clock::Manual(mc.clone())).unwrap();
        let b = a
            .add_backend(
                "b",
                &BackendConfig {
                    max_concurrency: 8,
                    tokens_per_minute: 6000, // 100 tokens/s
                    burst_tokens: Some(3000),
                    inflight_token_limit: None,
                },
            )
            .unwrap();
        let t = tenant(&a, "t", Priority::Standard, 0, Some(6000));
        let avail = |a: &Admission| a.backend_state(b).unwrap().available_tokens;
        let tenant_avail = |a: &Admission| a.tenant_state(t).unwrap().available_tokens;
        // use 2000 of the 3000: the refunds below are not hidden by the cap at a full bucket
        let tk = a.admit(b, t, Priority::Standard, 2000).unwrap().unwrap();
        a.release(&tk, None).unwrap();
        let (b0, t0) = (avail(&a), tenant_avail(&a));
        assert_eq!((b0, t0), (1000, Some(4000)));
        for (at_admit, at_release) in [(1.0, 0.6), (0.6, 1.0), (1.0, 1.0)] {
            a.set_scale(b, at_admit).unwrap();
            let tk = a.admit(b, t, Priority::Standard, 500).unwrap().unwrap();
            a.set_scale(b, at_release).unwrap();
            a.release(&tk, Some(0)).unwrap(); // nothing used: all 500 back
            a.set_scale(b, 1.0).unwrap();
            // as before, to within the rounding that never grants (cost up, refund down: 1 ns)
            let got = avail(&a);
            assert!(
                (b0 - 1..=b0).contains(&got),
                "admit at {at_admit}, release at {at_release}: {got} vs {b0}"
            );
            assert_eq!(tenant_avail(&a), t0);
        }
        let b0 = avail(&a);
        // a partial refund under a lower scale returns the unused part at the admission's rate
        let tk = a.admit(b, t, Priority::Standard, 900).unwrap().unwrap();
        a.set_scale(b, 0.6).unwrap();
        a.release(&tk, Some(400)).unwrap();
        a.set_scale(b, 1.0).unwrap();
        assert!((b0 - 401..=b0 - 400).contains(&avail(&a)), "{}", avail(&a));
        // an overrun is charged at the rates in force when it is reported
        mc.advance_ns(60_000_000_000); // full again
        let tk = a.admit(b, t, Priority::Standard, 100).unwrap().unwrap();
        a.release(&tk, Some(700)).unwrap();
        assert_eq!(avail(&a), 3000 - 700);
        assert_eq!(tenant_avail(&a), Some(6000 - 700));
    }

    #[test]
    fn hold_time_samples_reach_every_backend_of_a_round_robin() {
        let a = Admission::new_heap(Clock::Monotonic).unwrap();
        let cfg = BackendConfig {
            max_concurrency: 4,
            tokens_per_minute: 1_000_000,
            burst_tokens: None,
            inflight_token_limit: None,
        };
        let ids: Vec<u32> = (0..8)
            .map(|i| a.add_backend(&format!("b{i}"), &cfg).unwrap())
            .collect();
        let t = tenant(&a, "t", Priority::Standard, 0, None);
        // First releases after a 20 ms hold: every backend's EWMA starts there.
        let held: Vec<Ticket> = ids
            .iter()
            .map(|&b| a.admit(b, t, Priority::Standard, 1).unwrap().unwrap())
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(20));
        for tk in &held {
            a.release(tk, None).unwrap();
        }
        // Then one thread releases round-robin over the eight: each must see samples.
        for _ in 0..200 {
            for &b in &ids {
                let tk = a.admit(b, t, Priority::Standard, 1).unwrap().unwrap();
                a.release(&tk, None).unwrap();
            }
        }
        for &b in &ids {
            let h = a.backend_state(b).unwrap().hold_time_ewma_ns;
            assert!(
                h < 10_000_000,
                "backend {b}: EWMA {h} ns never sampled again"
            );
        }
    }

    /// Rust-only throughput of admit + release (run with
    /// `cargo test --release -p kvgate-core --no-default-features -- --ignored --nocapture`).
    #[test]
    #[ignore = "benchmark"]
    fn bench_admit_release() {
        // The mode the Python bindings give a private controller (the GIL serialises calls).
        let a = Admission::new_heap_serialized(Clock::Monotonic).unwrap();
        let b = a
            .add_backend(
                "b",
                &BackendConfig {
                    max_concurrency: 1024,
                    tokens_per_minute: MAX_AMOUNT,
                    burst_tokens: None,
                    inflight_token_limit: Some(1 << 40),
                },
            )
            .unwrap();
        let t = a
            .add_tenant(
                "t",
                &TenantConfig {
                    priority: Priority::Standard,
                    tokens_per_minute: Some(MAX_AMOUNT),
                    burst_tokens: None,
                    max_concurrency: Some(1024),
                    guaranteed_slots: 0,
                    guaranteed_backends: ALL_BACKENDS,
                },
            )
            .unwrap();
        let n = 5_000_000u32;
        let start = std::time::Instant::now();
        for _ in 0..n {
            let tk = a.admit(b, t, Priority::Standard, 500).unwrap().unwrap();
            a.release(&tk, Some(400)).unwrap();
        }
        let el = start.elapsed().as_secs_f64();
        println!(
            "rust admit+release: {n} pairs in {el:.3} s = {:.0} pairs/s ({:.1} ns/pair)",
            f64::from(n) / el,
            el * 1e9 / f64::from(n)
        );
        assert_eq!(a.backend_state(b).unwrap().in_use, 0);
    }

    /// The two primitives admit + release are built from, timed alone: one atomic
    /// read-modify-write (a `fetch_add` / `fetch_sub` on one of twelve counters in separate
    /// cache lines, as the limits are) and one `CLOCK_MONOTONIC` reading. A pair makes twelve of
    /// the first (six limits each way) and one of the second; `benches/core_results.py` turns
    /// this line into the floor under the pair's cost.
    #[test]
    #[ignore = "benchmark"]
    fn bench_floor_primitives() {
        #[repr(align(64))]
        struct Line(AtomicU64);
        let counters: Vec<Line> = (0..12).map(|_| Line(AtomicU64::new(1 << 40))).collect();
        let rounds = 2_000_000u32;
        let start = std::time::Instant::now();
        for i in 0..rounds {
            for c in &counters {
                if i % 2 == 0 {
                    c.0.fetch_add(1, Ordering::AcqRel);
                } else {
                    c.0.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
        let rmw_ns = start.elapsed().as_secs_f64() * 1e9 / f64::from(rounds) / 12.0;
        assert!(counters
            .iter()
            .all(|c| c.0.load(Ordering::Relaxed) == 1 << 40));
        let reads = 5_000_000u32;
        let time_reads = |read: &dyn Fn() -> u64| {
            let start = std::time::Instant::now();
            let mut sum = 0u64;
            for _ in 0..reads {
                sum = sum.wrapping_add(std::hint::black_box(read)());
            }
            assert!(sum > 0);
            start.elapsed().as_secs_f64() * 1e9 / f64::from(reads)
        };
        let clock = Clock::Monotonic;
        let clock_ns = time_reads(&|| clock.now_ns());
        let precise_ns = time_reads(&crate::clock::precise_monotonic_ns);
        println!(
            "rust floor: atomic read-modify-write {rmw_ns:.2} ns, \
             clock_gettime(CLOCK_MONOTONIC_COARSE) {clock_ns:.2} ns \
             (CLOCK_MONOTONIC {precise_ns:.2} ns)"
        );
    }
}
