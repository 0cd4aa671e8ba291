//! The region: memory layout of the shared state (backends, tenants, the sparse table of
//! per-backend guarantees, per-process ledgers), its allocation on the heap or in named shared
//! memory, process entries, dead-process reclaim.
//!
//! The region has no fixed ceiling: its [`Capacity`] is chosen when it is created (from the
//! configured counts, with headroom) and written into its [`Header`], so a process that attaches
//! reads the layout from the region itself. Memory is proportional to the capacity: one
//! [`TenantState`] per tenant, one [`BackendState`] per backend, one [`GuarEntry`] per
//! (tenant, backend) pair a guarantee names (an open-addressing hash table, never tenants ×
//! backends), and per attached process one ledger word per backend (× 3), tenant and entry.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::config::config_err;
use super::{Admission, IntoUnit};
use crate::clock::Clock;
use crate::error::CoreError;
use crate::shm::{process_alive, process_start_time, ShmMapping};
use crate::slots::{sub, Rmw, SlotCounter, UNLIMITED};
use crate::token_bucket::TokenBucket;

/// Default number of process entries of a shared region (controllers attached at once).
pub const MAX_PROCS: usize = 64;
pub(super) const NAME_WORDS: usize = 8;
/// Longest backend / tenant name in bytes.
pub const MAX_NAME_LEN: usize = NAME_WORDS * 8;
// "kvgate" + layout version 4 (capacity in the header, sparse guarantees, external KV
// occupancy per backend)
pub(super) const MAGIC: u64 = 0x6b76_6761_7465_0005;
pub(super) const CLAIMING: u64 = u64::MAX;
pub(super) const RECLAIMING: u64 = u64::MAX - 1;
/// Alignment of every array of the region (one cache line).
const ALIGN: usize = 64;

/// Tenant state: the id was never used.
pub(super) const FREE: u64 = 0;
/// Tenant state: registered (admits, found by name).
pub(super) const LIVE: u64 = 1;
/// Tenant state: removed by a reload. Its limits are zero (every admission is refused), its
/// held slots and tokens are released as usual; the id is given to a new tenant only once it
/// holds nothing.
pub(super) const TOMBSTONE: u64 = 2;

/// How many backends, tenants, guarantee entries and processes a region can hold, fixed when it
/// is created. [`Capacity::for_counts`] gives the usual headroom.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// Backends (ids `0..backends`).
    pub backends: u32,
    /// Tenants, removed ones that still hold something included.
    pub tenants: u32,
    /// (tenant, backend) guarantee entries: one per backend a tenant's guarantee names (one
    /// per registered backend for a tenant with guaranteed slots on every backend).
    pub guarantees: u32,
    /// Processes attached at once (1 for a private heap region).
    pub processes: u32,
}

impl Capacity {
    /// Fewest backends a region is sized for.
    pub const MIN_BACKENDS: u32 = 64;
    /// Fewest tenants a region is sized for.
    pub const MIN_TENANTS: u32 = 1024;
    /// Fewest guarantee entries a region is sized for.
    pub const MIN_GUARANTEES: u32 = 1024;

    /// Room for `backends`, `tenants` and `guarantees` configured now and as many again added
    /// later by reloads: `max(2 × configured, minimum)` of each, for `processes` processes.
    pub fn for_counts(backends: u32, tenants: u32, guarantees: u32, processes: u32) -> Self {
        Self {
            backends: backends.saturating_mul(2).max(Self::MIN_BACKENDS),
            tenants: tenants.saturating_mul(2).max(Self::MIN_TENANTS),
            guarantees: guarantees.saturating_mul(2).max(Self::MIN_GUARANTEES),
            processes: processes.max(1),
        }
    }
}

impl Default for Capacity {
    /// The minimum sizes, [`MAX_PROCS`] processes.
    fn default() -> Self {
        Self::for_counts(0, 0, 0, MAX_PROCS as u32)
    }
}

/// Byte offsets of the arrays of a region of a given [`Capacity`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Layout {
    pub(super) cap: Capacity,
    /// Slots of the guarantee hash table (a power of two, at least twice `cap.guarantees`).
    pub(super) guar_slots: usize,
    off_backends: usize,
    off_tenants: usize,
    off_guar: usize,
    off_procs: usize,
    proc_words: usize,
    off_board: usize,
    pub(super) size: usize,
}

fn round_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

impl Layout {
    pub(super) fn new(cap: Capacity) -> Result<Self, CoreError> {
        if cap.backends == 0 || cap.tenants == 0 || cap.processes == 0 {
            return config_err(format!("a region needs room for something (got {cap:?})"));
        }
        let guar_slots = (cap.guarantees.max(1) as usize * 2).next_power_of_two();
        let (b, t) = (cap.backends as usize, cap.tenants as usize);
        let off_backends = round_up(std::mem::size_of::<Header>());
        let off_tenants = round_up(off_backends + b * std::mem::size_of::<BackendState>());
        let off_guar = round_up(off_tenants + t * std::mem::size_of::<TenantState>());
        let off_procs = round_up(off_guar + guar_slots * std::mem::size_of::<GuarEntry>());
        let proc_words = 2 + 3 * b + t + guar_slots;
        let off_board = round_up(off_procs + cap.processes as usize * proc_words * 8);
        let size = round_up(off_board + b * std::mem::size_of::<BoardEntry>());
        Ok(Self {
            cap,
            guar_slots,
            off_backends,
            off_tenants,
            off_guar,
            off_procs,
            proc_words,
            off_board,
            size,
        })
    }

    fn heap(&self) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(self.size, ALIGN).expect("region layout")
    }
}

/// Region header: what the region is and how big.
#[repr(C)]
#[derive(Debug)]
pub struct Header {
    pub(super) magic: AtomicU64,
    pub(super) size: AtomicU64,
    pub(super) reg_lock: AtomicU64,
    pub(super) n_backends: AtomicU64,
    pub(super) n_tenants: AtomicU64,
    pub(super) cap_backends: AtomicU64,
    pub(super) cap_tenants: AtomicU64,
    pub(super) cap_guarantees: AtomicU64,
    pub(super) cap_processes: AtomicU64,
    /// Guarantee entries in use.
    pub(super) n_guar: AtomicU64,
    /// Bumped whenever a tenant id changes name (removal, reuse): name caches are rebuilt.
    pub(super) name_gen: AtomicU64,
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
    /// The engine's KV occupancy beyond kvgate's own in-flight tokens (tokens), set from its
    /// metrics ([`Admission::set_inflight_external`]); the in-flight budget in force is the
    /// base budget less this.
    pub(super) inflight_external: AtomicU64,
}

impl BackendState {
    /// The in-flight token budget in force: the base budget less the engine's external KV
    /// occupancy, never below 0 ([`UNLIMITED`] stays unlimited).
    #[inline]
    pub(super) fn effective_inflight_limit(&self) -> u64 {
        let base = self.inflight.limit();
        if base == UNLIMITED {
            return base;
        }
        base.saturating_sub(self.inflight_external.load(Ordering::Acquire))
    }
}

/// One tenant's quota and counters. Its guarantees live in the guarantee table
/// ([`GuarEntry`]), looked up only when `guaranteed_slots` is not 0 (or on release of a
/// guaranteed slot). What admit and release read comes first, in one cache line (64 bytes),
/// so a table of many tenants costs one line per admission, not three.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct TenantState {
    /// [`FREE`], [`LIVE`] or [`TOMBSTONE`].
    pub(super) ready: AtomicU64,
    pub(super) has_tpm: AtomicU64,
    pub(super) guaranteed_slots: AtomicU64,
    pub(super) conc: SlotCounter,
    pub(super) tpm: TokenBucket,
    pub(super) priority: AtomicU64,
    /// 1: the guarantee applies to every backend; 0: to the entries marked `member`.
    pub(super) guar_all: AtomicU64,
    /// 1 once any guarantee entry was made for this id.
    pub(super) has_entries: AtomicU64,
    pub(super) name: [AtomicU64; NAME_WORDS],
}

/// One (tenant, backend) entry of the guarantee table. Entries are never removed (a lowered or
/// moved guarantee keeps its held slots counted here until they are released).
#[repr(C)]
#[derive(Debug)]
pub struct GuarEntry {
    /// `(tenant << 32 | backend) + 1`; 0 = empty slot.
    pub(super) key: AtomicU64,
    /// 1 when the tenant's guarantee names this backend.
    pub(super) member: AtomicU64,
    /// Guaranteed slots of the tenant on this backend.
    pub(super) guaranteed: AtomicU64,
    /// Guaranteed slots held.
    pub(super) in_use: AtomicU64,
}

/// Words of a [`BoardEntry`]'s payload.
pub(super) const BOARD_WORDS: usize = 61;

/// One backend's entry of the poll board: the latest state its polling process published
/// (an opaque payload, written and read under a sequence lock).
#[repr(C, align(64))]
#[derive(Debug)]
pub struct BoardEntry {
    /// The sequence word: the time the last write began (milliseconds of the system's
    /// monotonic clock) in the high bits, a counter in the low bits whose lowest bit is 1
    /// while a write is in progress. 0: nothing published yet.
    pub(super) seq: AtomicU64,
    /// Payload length in bytes.
    pub(super) len: AtomicU64,
    /// Checksum of (the sequence word the write ends with, length, payload): a payload stored
    /// by a writer whose entry was taken over meanwhile does not match it.
    pub(super) sum: AtomicU64,
    pub(super) data: [AtomicU64; BOARD_WORDS],
}

/// One attached process's ledger of what it holds (views into the region).
#[derive(Debug)]
pub struct ProcLedger<'a> {
    pub(super) pid: &'a AtomicU64,
    pub(super) start_time: &'a AtomicU64,
    pub(super) backend_total: &'a [AtomicU64],
    pub(super) backend_burst: &'a [AtomicU64],
    pub(super) backend_inflight: &'a [AtomicU64],
    pub(super) tenant_conc: &'a [AtomicU64],
    /// Guaranteed slots held, by guarantee-table slot.
    pub(super) guar: &'a [AtomicU64],
}

pub(super) enum Storage {
    Heap(NonNull<u8>),
    Shm(ShmMapping),
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

/// A process-local name → id cache over the region's names (one per kind).
#[derive(Debug, Default)]
pub(super) struct Names {
    /// The header's `name_gen` the map was built at (tenants; always 0 for backends).
    pub(super) gen: u64,
    /// Ids below this were read into the map.
    pub(super) scanned: u64,
    pub(super) map: HashMap<String, u32>,
}

#[inline]
fn guar_key(tenant: u32, backend: u32) -> u64 {
    ((u64::from(tenant) << 32) | u64::from(backend)) + 1
}

impl Admission {
    /// A controller over a private heap region of the default [`Capacity`] (1 process).
    pub fn new_heap(clock: Clock) -> Result<Arc<Self>, CoreError> {
        Self::new_heap_with(clock, Capacity::default())
    }

    /// A controller over a private heap region of capacity `cap` (its `processes` is ignored:
    /// a private region has one).
    pub fn new_heap_with(clock: Clock, cap: Capacity) -> Result<Arc<Self>, CoreError> {
        let lay = Layout::new(Capacity {
            processes: 1,
            ..cap
        })?;
        // SAFETY: the layout is not zero-sized; all-zero bytes are a valid region (atomics only).
        let ptr = unsafe { std::alloc::alloc_zeroed(lay.heap()) };
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| CoreError::SharedState("out of memory for the region".into()))?;
        Self::finish(Storage::Heap(ptr), lay, clock, true)
    }

    /// A controller over a private heap region whose every call the caller serialises (e.g.
    /// CPython's GIL, held by the bindings through each call): admit and release update the
    /// limits with plain atomic loads and stores ([`Rmw::Serialized`]) instead of locked
    /// read-modify-writes. Calls made at once from several threads would lose updates; use
    /// [`Admission::new_heap`] for those, and a shared region for several processes.
    pub fn new_heap_serialized(clock: Clock) -> Result<Arc<Self>, CoreError> {
        Self::new_heap_serialized_with(clock, Capacity::default())
    }

    /// [`Admission::new_heap_serialized`] with capacity `cap`.
    pub fn new_heap_serialized_with(clock: Clock, cap: Capacity) -> Result<Arc<Self>, CoreError> {
        let mut me = Self::new_heap_with(clock, cap)?;
        Arc::get_mut(&mut me)
            .ok_or_else(|| CoreError::SharedState("controller already shared".into()))?
            .rmw = Rmw::Serialized;
        Ok(me)
    }

    /// A controller over a new shared-memory region `name` of the default [`Capacity`]
    /// (replacing any stale one).
    pub fn create_shm(name: &str, clock: Clock) -> Result<Arc<Self>, CoreError> {
        Self::create_shm_with(name, clock, Capacity::default())
    }

    /// A controller over a new shared-memory region `name` of capacity `cap` (replacing any
    /// stale one). The object is sized once, here; pages are given memory when first written.
    pub fn create_shm_with(
        name: &str,
        clock: Clock,
        cap: Capacity,
    ) -> Result<Arc<Self>, CoreError> {
        let lay = Layout::new(cap)?;
        let map = ShmMapping::create(name, lay.size)?;
        Self::finish(Storage::Shm(map), lay, clock, true)
    }

    /// A controller attached to the existing shared-memory region `name` (its capacity is
    /// read from the region).
    pub fn attach_shm(name: &str, clock: Clock) -> Result<Arc<Self>, CoreError> {
        let bad = || {
            CoreError::SharedState(format!(
                "shared memory {name:?} is not a kvgate region of this version"
            ))
        };
        let head = ShmMapping::open(name, std::mem::size_of::<Header>())?;
        // SAFETY: the mapping holds at least a Header (atomics only), and lives through here.
        let h = unsafe { head.as_ptr().cast::<Header>().as_ref() };
        let mut tries = 0;
        while h.magic.load(Ordering::Acquire) == 0 && tries < 1000 {
            std::thread::sleep(std::time::Duration::from_millis(1));
            tries += 1;
        }
        if h.magic.load(Ordering::Acquire) != MAGIC {
            return Err(bad());
        }
        let word = |a: &AtomicU64| u32::try_from(a.load(Ordering::Acquire)).map_err(|_| bad());
        let cap = Capacity {
            backends: word(&h.cap_backends)?,
            tenants: word(&h.cap_tenants)?,
            guarantees: word(&h.cap_guarantees)?,
            processes: word(&h.cap_processes)?,
        };
        let lay = Layout::new(cap).map_err(|_| bad())?;
        if h.size.load(Ordering::Acquire) != lay.size as u64 {
            return Err(bad());
        }
        drop(head);
        let map = ShmMapping::open(name, lay.size)?;
        Self::finish(Storage::Shm(map), lay, clock, false)
    }

    fn finish(
        storage: Storage,
        lay: Layout,
        clock: Clock,
        create: bool,
    ) -> Result<Arc<Self>, CoreError> {
        let ledger = matches!(storage, Storage::Shm(_));
        let base = match &storage {
            Storage::Heap(p) => *p,
            Storage::Shm(m) => m.as_ptr(),
        };
        let mut me = Self {
            storage,
            base,
            lay,
            clock,
            proc_idx: 0,
            ledger,
            rmw: Rmw::Atomic,
            leaks: AtomicU64::new(0),
            backend_names: std::sync::Mutex::default(),
            tenant_names: std::sync::Mutex::default(),
        };
        if create {
            let h = me.header();
            let c = lay.cap;
            h.cap_backends
                .store(u64::from(c.backends), Ordering::Release);
            h.cap_tenants.store(u64::from(c.tenants), Ordering::Release);
            h.cap_guarantees
                .store(u64::from(c.guarantees), Ordering::Release);
            h.cap_processes
                .store(u64::from(c.processes), Ordering::Release);
            h.size.store(lay.size as u64, Ordering::Release);
            h.magic.store(MAGIC, Ordering::Release);
        }
        me.proc_idx = me.claim_proc()?;
        Ok(Arc::new(me))
    }

    fn claim_proc(&self) -> Result<usize, CoreError> {
        let pid = u64::from(std::process::id());
        let start = process_start_time(std::process::id()).unwrap_or(0);
        let n = self.lay.cap.processes as usize;
        for i in 0..n {
            let p = self.proc_at(i);
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
            "all {n} process entries of the region are taken; call reclaim_dead()"
        )))
    }

    /// The region's header.
    #[inline]
    pub fn header(&self) -> &Header {
        // SAFETY: the region starts with a Header; it lives as long as self (owned by storage).
        unsafe { self.base.cast::<Header>().as_ref() }
    }

    /// # Safety
    /// `off` is the offset of a `T` inside the region (from the layout).
    #[inline]
    unsafe fn at<T>(&self, off: usize) -> &T {
        // SAFETY: per the caller; the region is zero-initialised atomics, aligned to ALIGN.
        unsafe { self.base.as_ptr().add(off).cast::<T>().as_ref() }.expect("non-null")
    }

    /// Backend slot `i` (`i` < capacity).
    #[inline]
    pub(super) fn backend_at(&self, i: usize) -> &BackendState {
        assert!(i < self.lay.cap.backends as usize);
        // SAFETY: in bounds of the backends array.
        unsafe { self.at(self.lay.off_backends + i * std::mem::size_of::<BackendState>()) }
    }

    /// Tenant slot `i` (`i` < capacity).
    #[inline]
    pub(super) fn tenant_at(&self, i: usize) -> &TenantState {
        assert!(i < self.lay.cap.tenants as usize);
        // SAFETY: in bounds of the tenants array.
        unsafe { self.at(self.lay.off_tenants + i * std::mem::size_of::<TenantState>()) }
    }

    /// Guarantee-table slot `i`.
    #[inline]
    pub(super) fn entry_at(&self, i: usize) -> &GuarEntry {
        assert!(i < self.lay.guar_slots);
        // SAFETY: in bounds of the guarantee table.
        unsafe { self.at(self.lay.off_guar + i * std::mem::size_of::<GuarEntry>()) }
    }

    /// Board entry `i` (`i` < backend capacity).
    #[inline]
    pub(super) fn board_at(&self, i: usize) -> &BoardEntry {
        assert!(i < self.lay.cap.backends as usize);
        // SAFETY: in bounds of the board array.
        unsafe { self.at(self.lay.off_board + i * std::mem::size_of::<BoardEntry>()) }
    }

    /// The ledger of process entry `i`.
    pub(super) fn proc_at(&self, i: usize) -> ProcLedger<'_> {
        assert!(i < self.lay.cap.processes as usize);
        let (b, t, g) = (
            self.lay.cap.backends as usize,
            self.lay.cap.tenants as usize,
            self.lay.guar_slots,
        );
        let off = self.lay.off_procs + i * self.lay.proc_words * 8;
        // SAFETY: the ledger of entry i is proc_words words at off, inside the region; off is
        // a multiple of 8 from a base aligned to ALIGN.
        #[allow(clippy::cast_ptr_alignment)]
        let words: &[AtomicU64] = unsafe {
            std::slice::from_raw_parts(
                self.base.as_ptr().add(off).cast::<AtomicU64>(),
                self.lay.proc_words,
            )
        };
        let (head, rest) = words.split_at(2);
        let (backend_total, rest) = rest.split_at(b);
        let (backend_burst, rest) = rest.split_at(b);
        let (backend_inflight, rest) = rest.split_at(b);
        let (tenant_conc, guar) = rest.split_at(t);
        debug_assert_eq!(guar.len(), g);
        ProcLedger {
            pid: &head[0],
            start_time: &head[1],
            backend_total,
            backend_burst,
            backend_inflight,
            tenant_conc,
            guar,
        }
    }

    /// The guarantee-table slot of (`tenant`, `backend`), if it has one. Lock-free: a key is
    /// published (Release) only once, and never removed.
    #[inline]
    pub(super) fn find_entry(&self, tenant: u32, backend: u32) -> Option<usize> {
        let key = guar_key(tenant, backend);
        let mask = self.lay.guar_slots - 1;
        let mut i = (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize & mask;
        loop {
            match self.entry_at(i).key.load(Ordering::Acquire) {
                k if k == key => return Some(i),
                0 => return None,
                _ => i = (i + 1) & mask,
            }
        }
    }

    /// The guarantee-table slot of (`tenant`, `backend`), made if missing. Call with the
    /// registration lock held.
    ///
    /// Errors: the table is full (a restart is needed to grow it).
    pub(super) fn entry_for(&self, tenant: u32, backend: u32) -> Result<usize, CoreError> {
        if let Some(i) = self.find_entry(tenant, backend) {
            return Ok(i);
        }
        let h = self.header();
        let used = h.n_guar.load(Ordering::Acquire);
        if used >= u64::from(self.lay.cap.guarantees) {
            return config_err(format!(
                "the guarantee table is full ({} (tenant, backend) entries, sized when kvgate \
                 started); restart kvgate to size it for the new configuration",
                self.lay.cap.guarantees
            ));
        }
        let key = guar_key(tenant, backend);
        let mask = self.lay.guar_slots - 1;
        let mut i = (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize & mask;
        while self.entry_at(i).key.load(Ordering::Acquire) != 0 {
            i = (i + 1) & mask;
        }
        let e = self.entry_at(i);
        e.member.store(0, Ordering::Release);
        e.guaranteed.store(0, Ordering::Release);
        e.key.store(key, Ordering::Release);
        h.n_guar.store(used + 1, Ordering::Release);
        Ok(i)
    }

    /// The capacity the region was created with.
    pub fn capacity(&self) -> Capacity {
        self.lay.cap
    }

    /// Size of the region in bytes.
    pub fn region_bytes(&self) -> usize {
        self.lay.size
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
        let lock = &self.header().reg_lock;
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
        let n = self.header().n_backends.load(Ordering::Acquire);
        if u64::from(id) < n {
            let b = self.backend_at(id as usize);
            if b.ready.load(Ordering::Acquire) == 1 {
                return Ok(b);
            }
        }
        config_err(format!("unknown backend id {id} ({n} backends registered)"))
    }

    /// A registered tenant, live or removed (a removed one refuses every admission but still
    /// releases what it holds).
    pub(super) fn tenant(&self, id: u32) -> Result<&TenantState, CoreError> {
        let n = self.header().n_tenants.load(Ordering::Acquire);
        if u64::from(id) < n {
            let t = self.tenant_at(id as usize);
            if t.ready.load(Ordering::Acquire) != FREE {
                return Ok(t);
            }
        }
        config_err(format!("unknown tenant id {id} ({n} tenants registered)"))
    }

    /// Number of registered backends.
    pub fn backend_count(&self) -> u32 {
        self.header().n_backends.load(Ordering::Acquire) as u32
    }

    /// Number of tenant ids in use (live tenants, and removed ones until their id is reused).
    pub fn tenant_count(&self) -> u32 {
        self.header().n_tenants.load(Ordering::Acquire) as u32
    }

    /// The id of the backend called `name` (a process-local index: O(1)).
    pub fn backend_id(&self, name: &str) -> Option<u32> {
        let mut names = self
            .backend_names
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = self.header().n_backends.load(Ordering::Acquire);
        for i in names.scanned..n {
            let b = self.backend_at(i as usize);
            if b.ready.load(Ordering::Acquire) == 1 {
                names.map.insert(read_name(&b.name), i as u32);
            }
        }
        names.scanned = n;
        names.map.get(name).copied()
    }

    /// Brings the tenant name cache up to date with the region.
    pub(super) fn sync_tenant_names(&self, names: &mut Names) {
        let h = self.header();
        let gen = h.name_gen.load(Ordering::Acquire);
        if gen != names.gen {
            names.map.clear();
            names.scanned = 0;
            names.gen = gen;
        }
        let n = h.n_tenants.load(Ordering::Acquire);
        for i in names.scanned..n {
            let t = self.tenant_at(i as usize);
            if t.ready.load(Ordering::Acquire) == LIVE {
                names.map.insert(read_name(&t.name), i as u32);
            }
        }
        names.scanned = n;
    }

    /// The id of the live tenant called `name` (a process-local index, rebuilt only after a
    /// tenant was removed or its id reused: O(1)).
    pub fn tenant_id(&self, name: &str) -> Option<u32> {
        let mut names = self
            .tenant_names
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.sync_tenant_names(&mut names);
        let id = *names.map.get(name)?;
        let t = self.tenant_at(id as usize);
        (t.ready.load(Ordering::Acquire) == LIVE && read_name(&t.name) == name).then_some(id)
    }

    /// Reclaims what dead processes attached to this region held (slots, in-flight tokens,
    /// tenant concurrency). Returns the number of concurrency slots given back.
    pub fn reclaim_dead(&self) -> u64 {
        let mut slots = 0;
        for i in 0..self.lay.cap.processes as usize {
            let p = self.proc_at(i);
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
            slots += self.drain(&p);
            p.start_time.store(0, Ordering::Release);
            p.pid.store(0, Ordering::Release);
        }
        slots
    }

    /// Moves a ledger's holdings out of the global counters; returns slots given back.
    fn drain(&self, p: &ProcLedger<'_>) -> u64 {
        let take = |w: &AtomicU64| {
            if w.load(Ordering::Acquire) == 0 {
                0
            } else {
                w.swap(0, Ordering::AcqRel)
            }
        };
        let mut slots = 0;
        for bi in 0..self.backend_count() as usize {
            let b = self.backend_at(bi);
            let total = take(&p.backend_total[bi]);
            sub(&b.in_use, total);
            slots += total;
            b.burst
                .release_saturating(take(&p.backend_burst[bi]))
                .into_unit();
            b.inflight
                .release_saturating(take(&p.backend_inflight[bi]))
                .into_unit();
        }
        for ti in 0..self.tenant_count() as usize {
            self.tenant_at(ti)
                .conc
                .release_saturating(take(&p.tenant_conc[ti]))
                .into_unit();
        }
        for (gi, g) in p.guar.iter().enumerate() {
            let n = take(g);
            if n != 0 {
                sub(&self.entry_at(gi).in_use, n);
            }
        }
        slots
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        let p = self.proc_at(self.proc_idx);
        // Anything still in this controller's ledger is given back (leaked reservations release
        // themselves before the controller can drop, so this is normally empty).
        if self.ledger {
            self.drain(&p);
        }
        p.start_time.store(0, Ordering::Release);
        p.pid.store(0, Ordering::Release);
        if let Storage::Heap(ptr) = self.storage {
            // SAFETY: allocated with this layout in new_heap_with; no reference outlives self.
            unsafe { std::alloc::dealloc(ptr.as_ptr(), self.lay.heap()) };
        }
    }
}
