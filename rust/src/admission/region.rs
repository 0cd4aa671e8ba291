//! The region: memory layout of the shared state (backends, tenants, per-process ledgers),
//! its allocation on the heap or in named shared memory, process entries, dead-process reclaim.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::config::config_err;
use super::{Admission, IntoUnit};
use crate::clock::Clock;
use crate::error::CoreError;
use crate::shm::{process_alive, process_start_time, ShmMapping};
use crate::slots::{sub, Rmw, SlotCounter};
use crate::token_bucket::TokenBucket;

/// Most backends one region holds.
pub const MAX_BACKENDS: usize = 32;
/// Most tenants one region holds.
pub const MAX_TENANTS: usize = 256;
/// Most processes (controllers) attached to one region at a time.
pub const MAX_PROCS: usize = 64;
pub(super) const NAME_WORDS: usize = 8;
/// Longest backend / tenant name in bytes.
pub const MAX_NAME_LEN: usize = NAME_WORDS * 8;
pub(super) const MAGIC: u64 = 0x6b76_6761_7465_0002; // "kvgate" + layout version 2 (per-backend guarantees)
pub(super) const CLAIMING: u64 = u64::MAX;
pub(super) const RECLAIMING: u64 = u64::MAX - 1;

/// Region header.
#[repr(C)]
#[derive(Debug)]
pub struct Header {
    pub(super) magic: AtomicU64,
    pub(super) size: AtomicU64,
    pub(super) reg_lock: AtomicU64,
    pub(super) n_backends: AtomicU64,
    pub(super) n_tenants: AtomicU64,
}

/// One backend's limits and counters.
#[repr(C)]
#[derive(Debug)]
pub struct BackendState {
    pub(super) ready: AtomicU64,
    pub(super) name: [AtomicU64; NAME_WORDS],
    pub(super) max_concurrency: AtomicU64,
    pub(super) scale_ppm: AtomicU64,
    pub(super) shedding: AtomicU64,
    pub(super) in_use: AtomicU64,
    pub(super) total_guaranteed: AtomicU64,
    pub(super) burst: SlotCounter,
    pub(super) inflight: SlotCounter,
    pub(super) tpm: TokenBucket,
    pub(super) ewma_hold_ns: AtomicU64,
}

/// One tenant's quota and counters.
#[repr(C)]
#[derive(Debug)]
pub struct TenantState {
    pub(super) ready: AtomicU64,
    pub(super) name: [AtomicU64; NAME_WORDS],
    pub(super) priority: AtomicU64,
    pub(super) guaranteed_slots: AtomicU64,
    pub(super) guaranteed_backends: AtomicU64,
    pub(super) guaranteed: [AtomicU64; MAX_BACKENDS],
    pub(super) conc: SlotCounter,
    pub(super) has_tpm: AtomicU64,
    pub(super) tpm: TokenBucket,
    pub(super) guar_in_use: [AtomicU64; MAX_BACKENDS],
}

/// One attached process's ledger of what it holds.
#[repr(C)]
#[derive(Debug)]
pub struct ProcState {
    pub(super) pid: AtomicU64,
    pub(super) start_time: AtomicU64,
    pub(super) backend_total: [AtomicU64; MAX_BACKENDS],
    pub(super) backend_burst: [AtomicU64; MAX_BACKENDS],
    pub(super) backend_inflight: [AtomicU64; MAX_BACKENDS],
    pub(super) tenant_conc: [AtomicU64; MAX_TENANTS],
    pub(super) guar: [[AtomicU64; MAX_BACKENDS]; MAX_TENANTS],
}

/// The whole shared state. All-zero bytes are a valid (empty) region.
#[repr(C)]
#[derive(Debug)]
pub struct Region {
    pub(super) header: Header,
    pub(super) backends: [BackendState; MAX_BACKENDS],
    pub(super) tenants: [TenantState; MAX_TENANTS],
    pub(super) procs: [ProcState; MAX_PROCS],
}

/// Size in bytes of the shared-memory region.
pub const REGION_SIZE: usize = std::mem::size_of::<Region>();

pub(super) enum Storage {
    Heap(NonNull<Region>),
    Shm(ShmMapping),
}

pub(super) fn layout() -> std::alloc::Layout {
    std::alloc::Layout::new::<Region>()
}

pub(super) fn write_name(dst: &[AtomicU64; NAME_WORDS], name: &str) {
    let mut buf = [0u8; MAX_NAME_LEN];
    buf[..name.len()].copy_from_slice(name.as_bytes());
    for (i, w) in dst.iter().enumerate() {
        let mut b = [0u8; 8];
        b.copy_from_slice(&buf[i * 8..i * 8 + 8]);
        w.store(u64::from_le_bytes(b), Ordering::Release);
    }
}

pub(super) fn read_name(src: &[AtomicU64; NAME_WORDS]) -> String {
    let mut buf = Vec::with_capacity(MAX_NAME_LEN);
    for w in src {
        buf.extend_from_slice(&w.load(Ordering::Acquire).to_le_bytes());
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Releases the region's registration lock on drop.
pub(super) struct RegGuard<'a>(&'a AtomicU64);

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

    pub(super) fn finish(
        storage: Storage,
        clock: Clock,
        create: bool,
    ) -> Result<Arc<Self>, CoreError> {
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

    pub(super) fn claim_proc(&self) -> Result<usize, CoreError> {
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

    pub(super) fn lock_registration(&self) -> RegGuard<'_> {
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

    pub(super) fn backend(&self, id: u32) -> Result<&BackendState, CoreError> {
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

    pub(super) fn tenant(&self, id: u32) -> Result<&TenantState, CoreError> {
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
}

impl Admission {
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
    pub(super) fn drain(r: &Region, p: &ProcState) -> u64 {
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
