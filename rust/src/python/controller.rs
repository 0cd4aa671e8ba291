//! Bindings of the admission controller: `AdmissionController`, `Reservation`, `Rejection`.

// Python methods with constant answers (`admitted`, `__bool__`) still take `&self`.
#![allow(clippy::unused_self)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

use crate::admission::{Admission, Capacity, Pool, Refusal, TenantConfig, Ticket, ALL_BACKENDS};
use crate::clock::Clock;
use crate::error::CoreError;
use crate::headers::RATE_LIMIT_HEADER_NAMES;
use crate::priority::Priority;

use super::convert::{
    amount, backend_config, backend_id_arg, backend_mask, opt_amount, priority_of, py_repr, secs,
    tenant_config, tenant_id_arg, RATE_LIMIT_NAMES,
};
use super::http::relay_bytes;
use super::primitives::{clock_of, ManualClock};

/// Sets a reservation's released flag; returns whether it was already set (the release then does
/// nothing).
///
/// With the GIL (every CPython build but the free-threaded one) the caller holds it for the whole
/// release, which calls no Python code, so no other release of the same reservation can run in
/// between: a plain load and store suffice, saving a locked exchange per release. A free-threaded
/// build needs the atomic swap.
#[inline]
fn mark_released(flag: &AtomicBool) -> bool {
    #[cfg(not(Py_GIL_DISABLED))]
    {
        let was = flag.load(Ordering::Relaxed);
        flag.store(true, Ordering::Relaxed);
        was
    }
    #[cfg(Py_GIL_DISABLED)]
    {
        flag.swap(true, Ordering::AcqRel)
    }
}

/// The core of a private (one-process) controller.
///
/// With the GIL (every CPython build but the free-threaded one) every call into the controller
/// holds it from entry to return and runs no Python code while it updates the limits, so no two
/// updates can overlap: the limits are updated with plain atomic loads and stores
/// ([`Admission::new_heap_serialized`]), which saves a locked instruction per limit per call. A
/// free-threaded build, and every shared-memory controller (several processes), uses
/// compare-and-swap.
fn private_controller(clock: Clock, cap: Capacity) -> Result<Arc<Admission>, CoreError> {
    #[cfg(not(Py_GIL_DISABLED))]
    {
        Admission::new_heap_serialized_with(clock, cap)
    }
    #[cfg(Py_GIL_DISABLED)]
    {
        Admission::new_heap_with(clock, cap)
    }
}

/// An admitted request's hold on every limit.
///
/// Holds its controller by a Python reference (no atomic reference count on the hot path).
#[pyclass(frozen, module = "kvgate")]
pub struct Reservation {
    ctl: Py<AdmissionController>,
    ticket: Ticket,
    released: AtomicBool,
}

impl Reservation {
    /// A reservation of `ticket` on the controller `ctl`.
    #[inline]
    pub(super) fn new(ctl: Py<AdmissionController>, ticket: Ticket) -> Self {
        Self {
            ctl,
            ticket,
            released: AtomicBool::new(false),
        }
    }

    #[inline]
    fn core(&self) -> &Admission {
        &self.ctl.get().core
    }

    /// `release(actual_tokens)` (the hand-written entry point in `python/fast.rs`, and
    /// `__exit__`): releases once, reconciling with `actual` tokens (`None` = as reserved).
    #[inline]
    pub(super) fn release_once(&self, actual: Option<u64>) -> PyResult<()> {
        if mark_released(&self.released) {
            return Ok(());
        }
        Ok(self.core().release(&self.ticket, actual)?)
    }
}

#[pymethods]
impl Reservation {
    #[getter]
    fn admitted(&self) -> bool {
        true
    }

    #[getter]
    fn tokens(&self) -> u64 {
        self.ticket.tokens
    }

    #[getter]
    fn backend(&self) -> u32 {
        self.ticket.backend
    }

    #[getter]
    fn tenant(&self) -> u32 {
        self.ticket.tenant
    }

    #[getter]
    fn pool(&self) -> &'static str {
        match self.ticket.pool {
            Pool::Guaranteed => "guaranteed",
            Pool::Burst => "burst",
        }
    }

    #[getter]
    fn released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    // `release(actual_tokens=None)` is a hand-written CPython entry point, installed on the
    // type at module initialisation (`python/fast.rs`).

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (_exc_type=None, _exc=None, _tb=None))]
    fn __exit__(
        &self,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        self.release_once(None)?;
        Ok(false)
    }

    fn __bool__(&self) -> bool {
        true
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Reservation(backend={}, tenant={}, tokens={}, pool={}, released={})",
            self.ticket.backend,
            self.ticket.tenant,
            self.ticket.tokens,
            py_repr(py, self.pool())?,
            py_repr(py, self.released())?
        ))
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // `&mut self`: nobody else can see the object, so a plain read of the flag will do.
        if !*self.released.get_mut() {
            let _ = self.core().release(&self.ticket, None);
            self.core().count_leak();
        }
    }
}

/// A refusal: nothing is held.
#[pyclass(frozen, module = "kvgate")]
pub struct Rejection {
    refusal: Refusal,
}

impl Rejection {
    /// The rejection for `refusal`.
    pub(super) fn new(refusal: Refusal) -> Self {
        Self { refusal }
    }
}

#[pymethods]
impl Rejection {
    #[getter]
    fn admitted(&self) -> bool {
        false
    }

    #[getter]
    fn reason(&self) -> &'static str {
        self.refusal.reason.as_str()
    }

    #[getter]
    fn scope(&self) -> &'static str {
        self.refusal.reason.scope()
    }

    #[getter]
    fn retry_after(&self) -> Option<f64> {
        self.refusal.retry_after_ns.map(secs)
    }

    #[getter]
    fn never(&self) -> bool {
        self.refusal.retry_after_ns.is_none()
    }

    fn __bool__(&self) -> bool {
        false
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Rejection(reason={}, scope={}, retry_after={})",
            py_repr(py, self.reason())?,
            py_repr(py, self.scope())?,
            py_repr(py, self.retry_after())?
        ))
    }
}

/// Admission against every limit of a backend and a tenant.
#[pyclass(frozen, module = "kvgate")]
pub struct AdmissionController {
    pub(super) core: Arc<Admission>,
}

impl AdmissionController {
    /// The `x-ratelimit-*` headers that apply as Python `(name, value)` tuples (six, or the
    /// three request headers without a token limit).
    fn rate_limit_pairs<'py>(
        &self,
        py: Python<'py>,
        backend: u32,
        tenant: u32,
    ) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        let limits = self.core.rate_limits(backend, tenant)?;
        let values = crate::headers::rate_limit_headers(&limits);
        let names = RATE_LIMIT_NAMES.get_or_init(py, || {
            RATE_LIMIT_HEADER_NAMES.map(|n| PyString::intern(py, n).unbind())
        });
        let mut pairs = Vec::with_capacity(10);
        let count = crate::headers::rate_limit_header_count(&limits);
        for (name, value) in names.iter().zip(values).take(count) {
            pairs.push(PyTuple::new(
                py,
                [name.bind(py).clone(), PyString::new(py, &value)],
            )?);
        }
        Ok(pairs)
    }
}

#[pymethods]
impl AdmissionController {
    #[new]
    #[pyo3(signature = (*, clock=None, shm_name=None, create=true, backends=0, tenants=0, guarantees=0, processes=64))]
    fn new(
        clock: Option<&Bound<'_, ManualClock>>,
        shm_name: Option<&str>,
        create: bool,
        backends: u32,
        tenants: u32,
        guarantees: u32,
        processes: u32,
    ) -> PyResult<Self> {
        let clock = clock_of(clock);
        let cap = Capacity::for_counts(backends, tenants, guarantees, processes);
        let core = match (shm_name, create) {
            (None, _) => private_controller(clock, cap)?,
            (Some(name), true) => Admission::create_shm_with(name, clock, cap)?,
            (Some(name), false) => Admission::attach_shm(name, clock)?,
        };
        Ok(Self { core })
    }

    #[staticmethod]
    #[pyo3(signature = (shm_name, *, clock=None))]
    fn attach(shm_name: &str, clock: Option<&Bound<'_, ManualClock>>) -> PyResult<Self> {
        Ok(Self {
            core: Admission::attach_shm(shm_name, clock_of(clock))?,
        })
    }

    #[getter]
    fn shm_name(&self) -> Option<String> {
        self.core.shm_name()
    }

    #[getter]
    fn leaks(&self) -> u64 {
        self.core.leaks()
    }

    #[getter]
    fn capacity<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.core.capacity();
        let d = PyDict::new(py);
        d.set_item("backends", c.backends)?;
        d.set_item("tenants", c.tenants)?;
        d.set_item("guarantees", c.guarantees)?;
        d.set_item("processes", c.processes)?;
        Ok(d)
    }

    #[getter]
    fn region_bytes(&self) -> usize {
        self.core.region_bytes()
    }

    #[getter]
    fn free_tenant_ids(&self) -> u32 {
        self.core.free_tenant_ids()
    }

    #[getter]
    fn guarantee_entries_free(&self) -> u64 {
        self.core.guarantee_entries_free()
    }

    #[pyo3(signature = (tenant=None, *, guaranteed_slots=None, guaranteed_backends=None))]
    fn guarantee_entries_needed(
        &self,
        tenant: Option<&Bound<'_, PyAny>>,
        guaranteed_slots: Option<&Bound<'_, PyAny>>,
        guaranteed_backends: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<u32>> {
        let id = match tenant.filter(|t| !t.is_none()) {
            Some(t) => Some(tenant_id_arg(t)?),
            None => None,
        };
        // only the guarantee is read: the rest as a tenant without limits has it
        let c = TenantConfig {
            priority: Priority::Standard,
            tokens_per_minute: None,
            burst_tokens: None,
            max_concurrency: None,
            guaranteed_slots: opt_amount(guaranteed_slots, "guaranteed_slots")?.unwrap_or(0),
            guaranteed_backends: backend_mask(guaranteed_backends)?.unwrap_or(ALL_BACKENDS),
        };
        Ok(self.core.guarantee_entries_needed(id, &c))
    }

    fn guarantee_entries_of(&self, #[pyo3(from_py_with = tenant_id_arg)] tenant: u32) -> Vec<u32> {
        self.core.guarantee_entries_of(tenant)
    }

    fn remove_tenant(&self, #[pyo3(from_py_with = tenant_id_arg)] tenant: u32) -> PyResult<()> {
        Ok(self.core.remove_tenant(tenant)?)
    }

    fn remove_tenant_named(
        &self,
        #[pyo3(from_py_with = tenant_id_arg)] tenant: u32,
        name: &str,
    ) -> PyResult<bool> {
        Ok(self.core.remove_tenant_named(tenant, name)?)
    }

    fn tenant_removed(&self, #[pyo3(from_py_with = tenant_id_arg)] tenant: u32) -> PyResult<bool> {
        Ok(self.core.tenant_removed(tenant)?)
    }

    #[getter]
    fn backend_count(&self) -> u32 {
        self.core.backend_count()
    }

    #[getter]
    fn tenant_count(&self) -> u32 {
        self.core.tenant_count()
    }

    fn backend_id(&self, name: &str) -> Option<u32> {
        self.core.backend_id(name)
    }

    fn tenant_id(&self, name: &str) -> Option<u32> {
        self.core.tenant_id(name)
    }

    #[pyo3(signature = (name, *, max_concurrency, tokens_per_minute, burst_tokens=None, inflight_token_limit=None))]
    fn add_backend(
        &self,
        name: &str,
        max_concurrency: &Bound<'_, PyAny>,
        tokens_per_minute: &Bound<'_, PyAny>,
        burst_tokens: Option<&Bound<'_, PyAny>>,
        inflight_token_limit: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u32> {
        let c = backend_config(
            max_concurrency,
            tokens_per_minute,
            burst_tokens,
            inflight_token_limit,
        )?;
        Ok(self.core.add_backend(name, &c)?)
    }

    /// Hot reload of a backend with its whole configuration, as `add_backend` takes it:
    /// `burst_tokens` `None` is one minute's worth, `inflight_token_limit` `None` no budget
    /// (unlike `update_backend`, where `None` keeps the value in force).
    #[pyo3(signature = (backend, *, max_concurrency, tokens_per_minute, burst_tokens=None, inflight_token_limit=None))]
    fn replace_backend(
        &self,
        #[pyo3(from_py_with = backend_id_arg)] backend: u32,
        max_concurrency: &Bound<'_, PyAny>,
        tokens_per_minute: &Bound<'_, PyAny>,
        burst_tokens: Option<&Bound<'_, PyAny>>,
        inflight_token_limit: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let c = backend_config(
            max_concurrency,
            tokens_per_minute,
            burst_tokens,
            inflight_token_limit,
        )?;
        Ok(self.core.update_backend(backend, &c)?)
    }

    #[pyo3(signature = (backend, *, max_concurrency=None, tokens_per_minute=None, burst_tokens=None, inflight_token_limit=None))]
    fn update_backend(
        &self,
        #[pyo3(from_py_with = backend_id_arg)] backend: u32,
        max_concurrency: Option<&Bound<'_, PyAny>>,
        tokens_per_minute: Option<&Bound<'_, PyAny>>,
        burst_tokens: Option<&Bound<'_, PyAny>>,
        inflight_token_limit: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let mut c = self.core.backend_config(backend)?;
        if let Some(v) = opt_amount(max_concurrency, "max_concurrency")? {
            c.max_concurrency = v;
        }
        if let Some(v) = opt_amount(tokens_per_minute, "tokens_per_minute")? {
            c.tokens_per_minute = v;
        }
        if let Some(v) = opt_amount(burst_tokens, "burst_tokens")? {
            c.burst_tokens = Some(v);
        }
        if let Some(v) = opt_amount(inflight_token_limit, "inflight_token_limit")? {
            c.inflight_token_limit = Some(v);
        }
        Ok(self.core.update_backend(backend, &c)?)
    }

    #[pyo3(signature = (name, *, priority, tokens_per_minute=None, max_concurrency=None, guaranteed_slots=None, burst_tokens=None, guaranteed_backends=None))]
    #[allow(clippy::too_many_arguments)] // keyword-only Python arguments
    fn add_tenant(
        &self,
        name: &str,
        priority: &Bound<'_, PyAny>,
        tokens_per_minute: Option<&Bound<'_, PyAny>>,
        max_concurrency: Option<&Bound<'_, PyAny>>,
        guaranteed_slots: Option<&Bound<'_, PyAny>>,
        burst_tokens: Option<&Bound<'_, PyAny>>,
        guaranteed_backends: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u32> {
        let c = tenant_config(
            priority,
            tokens_per_minute,
            max_concurrency,
            guaranteed_slots,
            burst_tokens,
            guaranteed_backends,
        )?;
        Ok(self.core.add_tenant(name, &c)?)
    }

    /// Hot reload of a tenant with its whole configuration, as `add_tenant` takes it: `None`
    /// is no limit, no guaranteed slot, every backend (unlike `update_tenant`, where `None`
    /// keeps the value in force), so a reload that drops a limit from the file drops it here.
    #[pyo3(signature = (tenant, *, priority, tokens_per_minute=None, max_concurrency=None, guaranteed_slots=None, burst_tokens=None, guaranteed_backends=None))]
    #[allow(clippy::too_many_arguments)] // keyword-only Python arguments
    fn replace_tenant(
        &self,
        #[pyo3(from_py_with = tenant_id_arg)] tenant: u32,
        priority: &Bound<'_, PyAny>,
        tokens_per_minute: Option<&Bound<'_, PyAny>>,
        max_concurrency: Option<&Bound<'_, PyAny>>,
        guaranteed_slots: Option<&Bound<'_, PyAny>>,
        burst_tokens: Option<&Bound<'_, PyAny>>,
        guaranteed_backends: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let c = tenant_config(
            priority,
            tokens_per_minute,
            max_concurrency,
            guaranteed_slots,
            burst_tokens,
            guaranteed_backends,
        )?;
        Ok(self.core.update_tenant(tenant, &c)?)
    }

    #[pyo3(signature = (tenant, *, priority=None, tokens_per_minute=None, max_concurrency=None, guaranteed_slots=None, burst_tokens=None, guaranteed_backends=None))]
    #[allow(clippy::too_many_arguments)] // keyword-only Python arguments
    fn update_tenant(
        &self,
        #[pyo3(from_py_with = tenant_id_arg)] tenant: u32,
        priority: Option<&Bound<'_, PyAny>>,
        tokens_per_minute: Option<&Bound<'_, PyAny>>,
        max_concurrency: Option<&Bound<'_, PyAny>>,
        guaranteed_slots: Option<&Bound<'_, PyAny>>,
        burst_tokens: Option<&Bound<'_, PyAny>>,
        guaranteed_backends: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let mut c = self.core.tenant_config(tenant)?;
        if let Some(p) = priority.filter(|p| !p.is_none()) {
            c.priority = priority_of(p)?;
        }
        if let Some(v) = opt_amount(tokens_per_minute, "tokens_per_minute")? {
            c.tokens_per_minute = Some(v);
            if c.burst_tokens.is_some() && burst_tokens.is_none() {
                c.burst_tokens = Some(v);
            }
        }
        if let Some(v) = opt_amount(burst_tokens, "burst_tokens")? {
            c.burst_tokens = Some(v);
        }
        if let Some(v) = opt_amount(max_concurrency, "max_concurrency")? {
            c.max_concurrency = Some(v);
        }
        if let Some(v) = opt_amount(guaranteed_slots, "guaranteed_slots")? {
            c.guaranteed_slots = v;
        }
        if let Some(mask) = backend_mask(guaranteed_backends)? {
            c.guaranteed_backends = mask;
        }
        Ok(self.core.update_tenant(tenant, &c)?)
    }

    fn set_scale(
        &self,
        #[pyo3(from_py_with = backend_id_arg)] backend: u32,
        scale: f64,
    ) -> PyResult<()> {
        Ok(self.core.set_scale(backend, scale)?)
    }

    fn set_inflight_external(
        &self,
        #[pyo3(from_py_with = backend_id_arg)] backend: u32,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let tokens = amount(tokens, "tokens")?;
        Ok(self.core.set_inflight_external(backend, tokens)?)
    }

    fn set_shedding(
        &self,
        #[pyo3(from_py_with = backend_id_arg)] backend: u32,
        on: bool,
    ) -> PyResult<()> {
        Ok(self.core.set_shedding(backend, on)?)
    }

    fn publish_board(
        &self,
        #[pyo3(from_py_with = backend_id_arg)] backend: u32,
        payload: &[u8],
    ) -> PyResult<Option<u64>> {
        Ok(self.core.publish_board(backend, payload)?)
    }

    fn read_board<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = backend_id_arg)] backend: u32,
    ) -> PyResult<Option<(u64, Bound<'py, PyBytes>)>> {
        Ok(self
            .core
            .read_board(backend)?
            .map(|(seq, payload)| (seq, PyBytes::new(py, &payload))))
    }

    fn set_overload(
        &self,
        #[pyo3(from_py_with = backend_id_arg)] backend: u32,
        on: bool,
    ) -> PyResult<()> {
        Ok(self.core.set_overload(backend, on)?)
    }

    // `admit(backend, tenant, priority, tokens)` is a hand-written CPython entry point, installed
    // on the type at module initialisation (`python/fast.rs`).

    fn reclaim_dead(&self) -> u64 {
        self.core.reclaim_dead()
    }

    fn rate_limit_headers<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = backend_id_arg)] backend: u32,
        #[pyo3(from_py_with = tenant_id_arg)] tenant: u32,
    ) -> PyResult<Bound<'py, PyList>> {
        let pairs = self.rate_limit_pairs(py, backend, tenant)?;
        PyList::new(py, pairs)
    }

    #[pyo3(signature = (backend, tenant, retry_after, reason))]
    fn refusal_headers(
        &self,
        #[pyo3(from_py_with = backend_id_arg)] backend: u32,
        #[pyo3(from_py_with = tenant_id_arg)] tenant: u32,
        retry_after: Option<f64>,
        reason: &str,
    ) -> PyResult<Vec<(&'static str, String)>> {
        let limits = self.core.rate_limits(backend, tenant)?;
        Ok(crate::headers::refusal_headers(
            &limits,
            retry_after,
            reason,
        ))
    }

    #[pyo3(signature = (backend, tenant, refusal, model, tenant_name, requested, connection=None))]
    #[allow(clippy::too_many_arguments)]
    fn refusal_response<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = backend_id_arg)] backend: u32,
        #[pyo3(from_py_with = tenant_id_arg)] tenant: u32,
        refusal: &Bound<'py, PyAny>,
        model: Option<&str>,
        tenant_name: &str,
        requested: u64,
        connection: Option<&str>,
    ) -> PyResult<(u16, Bound<'py, PyString>, Bound<'py, PyBytes>)> {
        // the core's Rejection is read natively; anything else (the gateway's own refusals)
        // through its `reason`, `scope`, `retry_after` and `never` attributes
        let owned_reason: String;
        let mut note: Option<String> = None;
        let mut remaining: Option<u64> = None;
        let mut reset_after: Option<f64> = None;
        let (reason, tenant_scope, never, retry_after) = if let Ok(r) = refusal.cast::<Rejection>()
        {
            let r = r.get();
            (
                r.refusal.reason.as_str(),
                r.refusal.reason.scope() == "tenant",
                r.refusal.retry_after_ns.is_none(),
                r.refusal.retry_after_ns.map(secs),
            )
        } else {
            owned_reason = refusal.getattr(intern!(py, "reason"))?.extract()?;
            let scope: String = refusal.getattr(intern!(py, "scope"))?.extract()?;
            let never: bool = refusal.getattr(intern!(py, "never"))?.is_truthy()?;
            let retry: Option<f64> = refusal.getattr(intern!(py, "retry_after"))?.extract()?;
            // what a store's refusal knows beyond this replica's core (optional attributes)
            if let Ok(v) = refusal.getattr(intern!(py, "remaining")) {
                remaining = v.extract()?;
            }
            if let Ok(v) = refusal.getattr(intern!(py, "reset_after")) {
                reset_after = v.extract()?;
            }
            if let Ok(v) = refusal.getattr(intern!(py, "note")) {
                note = v.extract()?;
            }
            (owned_reason.as_str(), scope == "tenant", never, retry)
        };
        let mut limits = self.core.rate_limits(backend, tenant)?;
        crate::headers::apply_refusing_limit(
            &mut limits,
            reason,
            remaining,
            reset_after.map(crate::headers::secs_to_ns),
        );
        let retry_after = if never { None } else { retry_after };
        // a refusal that waits for a slot says the same wait in `x-ratelimit-reset-requests`
        // as in `Retry-After` (the gateway computes it from the requests holding the slots)
        if let Some(wait) = retry_after {
            if limits.remaining_requests == 0 && crate::headers::waits_for_a_slot(reason) {
                limits.reset_requests_ns = crate::headers::secs_to_ns(wait);
            }
        }
        let owned = crate::headers::refusal_headers(&limits, retry_after, reason);
        let headers: Vec<(&str, &str)> = owned.iter().map(|(n, v)| (*n, v.as_str())).collect();
        let (status, body) = crate::headers::refusal_body(&crate::headers::RefusalText {
            reason,
            tenant_scope,
            never,
            retry_after,
            model,
            tenant: tenant_name,
            requested,
            note: note.as_deref(),
        });
        let date = crate::headers::http_date_now();
        let raw = crate::headers::http_response(status, &headers, &body, &date, connection)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok((status, PyString::intern(py, reason), PyBytes::new(py, &raw)))
    }

    #[pyo3(signature = (backend, tenant, status, upstream_headers, body=None, connection=None, chunked=true, *, request_id=None))]
    #[allow(clippy::too_many_arguments)]
    fn relay_http<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = backend_id_arg)] backend: u32,
        #[pyo3(from_py_with = tenant_id_arg)] tenant: u32,
        status: u16,
        upstream_headers: &Bound<'py, PyAny>,
        body: Option<&[u8]>,
        connection: Option<&str>,
        chunked: bool,
        request_id: Option<&str>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let limits = self.core.rate_limits(backend, tenant)?;
        let values = crate::headers::rate_limit_headers(&limits);
        let mut ours: Vec<(&[u8], &[u8])> = Vec::with_capacity(values.len() + 1);
        if let Some(rid) = request_id {
            if rid.is_empty() || !rid.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
                return Err(PyValueError::new_err(
                    "request_id must be 1 or more printable ASCII characters",
                ));
            }
            ours.push((b"x-request-id", rid.as_bytes()));
        }
        ours.extend(
            RATE_LIMIT_HEADER_NAMES
                .iter()
                .zip(values.iter())
                .take(crate::headers::rate_limit_header_count(&limits))
                .map(|(n, v)| (n.as_bytes(), v.as_bytes())),
        );
        relay_bytes(
            py,
            status,
            upstream_headers,
            &ours,
            body,
            connection,
            chunked,
        )
    }

    fn backend_state<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = backend_id_arg)] backend: u32,
    ) -> PyResult<Bound<'py, PyDict>> {
        let s = self.core.backend_state(backend)?;
        let d = PyDict::new(py);
        d.set_item("name", s.name)?;
        d.set_item("scale", s.scale)?;
        d.set_item("shedding", s.shedding)?;
        d.set_item("overloaded", s.overloaded)?;
        d.set_item("max_concurrency", s.max_concurrency)?;
        d.set_item("effective_concurrency", s.effective_concurrency)?;
        d.set_item("in_use", s.in_use)?;
        d.set_item("guaranteed_slots", s.guaranteed_slots)?;
        d.set_item("burst_pool", s.burst_pool)?;
        d.set_item("burst_in_use", s.burst_in_use)?;
        d.set_item("tokens_per_minute", s.tokens_per_minute)?;
        d.set_item("effective_tokens_per_minute", s.effective_tokens_per_minute)?;
        d.set_item("burst_tokens", s.burst_tokens)?;
        d.set_item("effective_burst_tokens", s.effective_burst_tokens)?;
        d.set_item("available_tokens", s.available_tokens)?;
        d.set_item("time_to_full", secs(s.time_to_full_ns))?;
        d.set_item("inflight_tokens", s.inflight_tokens)?;
        d.set_item("inflight_token_limit", s.inflight_token_limit)?;
        d.set_item("inflight_external_tokens", s.inflight_external_tokens)?;
        d.set_item(
            "effective_inflight_token_limit",
            s.effective_inflight_token_limit,
        )?;
        d.set_item("hold_time_ewma", secs(s.hold_time_ewma_ns))?;
        Ok(d)
    }

    fn tenant_state<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = tenant_id_arg)] tenant: u32,
    ) -> PyResult<Bound<'py, PyDict>> {
        let s = self.core.tenant_state(tenant)?;
        let d = PyDict::new(py);
        d.set_item("name", s.name)?;
        d.set_item("priority", s.priority.as_str())?;
        d.set_item("guaranteed_slots", s.guaranteed_slots)?;
        d.set_item("guaranteed_backends", s.guaranteed_backends)?;
        d.set_item("max_concurrency", s.max_concurrency)?;
        d.set_item("in_use", s.in_use)?;
        d.set_item("tokens_per_minute", s.tokens_per_minute)?;
        d.set_item("burst_tokens", s.burst_tokens)?;
        d.set_item("available_tokens", s.available_tokens)?;
        d.set_item("time_to_full", s.time_to_full_ns.map(secs))?;
        Ok(d)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "AdmissionController(backends={}, tenants={}, shm_name={})",
            self.core.backend_count(),
            self.core.tenant_count(),
            py_repr(py, self.core.shm_name())?
        ))
    }
}
