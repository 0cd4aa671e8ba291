//! The pyo3 bindings: the only file that knows about Python. User docs live in
//! `python/kvgate/_core.pyi`.

// Python methods with constant answers (`admitted`, `__bool__`) still take `&self`.
#![allow(clippy::unused_self)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyString, PyTuple, PyType};
use pyo3::IntoPyObjectExt;

use crate::adaptive::{AdaptiveLaw as RustLaw, LawParams};
use crate::admission::{
    Admission, BackendConfig, Capacity, GuaranteedBackends, Pool, Reason, Refusal, TenantConfig,
    Ticket, ALL_BACKENDS, MAX_PROCS,
};
use crate::clock::{Clock, ManualClock as RustManualClock};
use crate::error::{CoreError, MAX_AMOUNT};
use crate::headers::RATE_LIMIT_HEADER_NAMES;
use crate::priority::Priority;
use crate::slots::SlotCounter;
use crate::token_bucket::TokenBucket as RustBucket;

static CORE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INVALID_AMOUNT: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static NEVER_ADMISSIBLE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static OVER_RELEASE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INVALID_CONFIG: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static SHARED_STATE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
/// The `x-ratelimit-*` header names, interned once.
static RATE_LIMIT_NAMES: PyOnceLock<[Py<PyString>; 6]> = PyOnceLock::new();

/// Python's `repr()` of `value` (`None`, `True`, `'text'`, `1.0`), so that a binding's
/// `__repr__` reads as Python, not as Rust's `Debug` (`Some(1.0)`, `true`, `"text"`).
pub(crate) fn py_repr<'py, T: IntoPyObject<'py>>(py: Python<'py>, value: T) -> PyResult<String> {
    Ok(value.into_bound_py_any(py)?.repr()?.to_str()?.to_owned())
}

fn make_type(
    py: Python<'_>,
    name: &str,
    doc: &str,
    bases: &Bound<'_, PyTuple>,
) -> PyResult<Py<PyType>> {
    let ns = PyDict::new(py);
    ns.set_item("__module__", "kvgate")?;
    ns.set_item("__doc__", doc)?;
    let ty = py
        .import("builtins")?
        .getattr("type")?
        .call1((name, bases, ns))?;
    Ok(ty.cast_into::<PyType>()?.unbind())
}

fn init_errors(py: Python<'_>) -> PyResult<()> {
    let exc = py.get_type::<pyo3::exceptions::PyException>();
    let core = make_type(
        py,
        "CoreError",
        "Base of every kvgate core error.",
        &PyTuple::new(py, [exc])?,
    )?;
    let core_b = core.bind(py).clone();
    let value = py.get_type::<pyo3::exceptions::PyValueError>();
    let os = py.get_type::<pyo3::exceptions::PyOSError>();
    let leaf = |name: &str, doc: &str, other: &Bound<'_, PyType>| -> PyResult<Py<PyType>> {
        make_type(
            py,
            name,
            doc,
            &PyTuple::new(py, [core_b.clone(), other.clone()])?,
        )
    };
    let _ = INVALID_AMOUNT.set(
        py,
        leaf(
            "InvalidAmountError",
            "A token/slot amount is negative or absurd (> 2**62).",
            &value,
        )?,
    );
    let _ = NEVER_ADMISSIBLE.set(
        py,
        leaf(
            "NeverAdmissibleError",
            "More than the limit can ever hold; has .requested and .limit.",
            &value,
        )?,
    );
    let _ = OVER_RELEASE.set(
        py,
        leaf(
            "OverReleaseError",
            "A release of more than is held.",
            &value,
        )?,
    );
    let _ = INVALID_CONFIG.set(
        py,
        leaf(
            "InvalidConfigError",
            "Invalid configuration value or unknown id.",
            &value,
        )?,
    );
    let _ = SHARED_STATE.set(
        py,
        leaf(
            "SharedStateError",
            "Shared-memory region could not be created or attached.",
            &os,
        )?,
    );
    let _ = CORE_ERROR.set(py, core);
    Ok(())
}

fn err_type<'py>(py: Python<'py>, cell: &PyOnceLock<Py<PyType>>) -> Bound<'py, PyType> {
    cell.get(py)
        .expect("kvgate._core errors initialised")
        .bind(py)
        .clone()
}

fn to_pyerr(py: Python<'_>, e: &CoreError) -> PyErr {
    let msg = e.to_string();
    let cell = match e {
        CoreError::InvalidAmount { .. } => &INVALID_AMOUNT,
        CoreError::NeverAdmissible { .. } => &NEVER_ADMISSIBLE,
        CoreError::OverRelease { .. } => &OVER_RELEASE,
        CoreError::InvalidConfig(_) => &INVALID_CONFIG,
        CoreError::SharedState(_) => &SHARED_STATE,
    };
    let ty = err_type(py, cell);
    let inst = match ty.call1((msg,)) {
        Ok(i) => i,
        Err(err) => return err,
    };
    if let CoreError::NeverAdmissible { requested, limit } = e {
        let _ = inst.setattr("requested", requested);
        let _ = inst.setattr("limit", limit);
    }
    PyErr::from_value(inst)
}

impl From<CoreError> for PyErr {
    fn from(e: CoreError) -> Self {
        Python::attach(|py| to_pyerr(py, &e))
    }
}

/// Reads a token/slot amount: an `int` in 0..=2**62. Floats, None, bools and other types raise
/// `TypeError`; negative or huge ints raise `InvalidAmountError`.
#[inline]
pub(crate) fn amount(obj: &Bound<'_, PyAny>, what: &'static str) -> PyResult<u64> {
    // Fast path: an exact `int` in range, read with one C call that cannot raise for an int.
    if obj.is_exact_instance_of::<PyInt>() {
        let mut overflow = 0;
        // SAFETY: `obj` is a live `int` (checked above) and the GIL is held (`Bound`).
        let v = unsafe { pyo3::ffi::PyLong_AsLongLongAndOverflow(obj.as_ptr(), &mut overflow) };
        if overflow == 0 && (0..=MAX_AMOUNT as i64).contains(&v) {
            return Ok(v as u64);
        }
    }
    amount_slow(obj, what)
}

#[cold]
fn amount_slow(obj: &Bound<'_, PyAny>, what: &'static str) -> PyResult<u64> {
    if !obj.is_exact_instance_of::<PyInt>()
        && (obj.is_instance_of::<PyBool>() || !obj.is_instance_of::<PyInt>())
    {
        return Err(PyTypeError::new_err(format!(
            "{what} must be an int (a whole number of tokens/slots), got {}",
            obj.get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        )));
    }
    if let Ok(v) = obj.extract::<i64>() {
        Ok(crate::error::check_amount(what, i128::from(v))?)
    } else {
        let v: i128 = obj.extract().unwrap_or(i128::MAX);
        Err(CoreError::InvalidAmount { what, value: v }.into())
    }
}

pub(crate) fn opt_amount(
    obj: Option<&Bound<'_, PyAny>>,
    what: &'static str,
) -> PyResult<Option<u64>> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => amount(o, what).map(Some),
    }
}

/// `guaranteed_backends`: `None` (absent), `"all"` ([`ALL_BACKENDS`]) or an iterable of
/// backend ids (ids past the registered backends are refused by the core).
fn backend_mask(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<GuaranteedBackends>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    if let Ok(s) = obj.cast::<PyString>() {
        if s.to_str()? == "all" {
            return Ok(Some(ALL_BACKENDS));
        }
        return Err(PyTypeError::new_err(
            "guaranteed_backends must be a list of backend ids, 'all' or None",
        ));
    }
    let mut ids = Vec::new();
    for item in obj.try_iter().map_err(|_| {
        PyTypeError::new_err("guaranteed_backends must be a list of backend ids, 'all' or None")
    })? {
        let item = item?;
        if !item.is_instance_of::<PyInt>() || item.is_instance_of::<PyBool>() {
            return Err(PyTypeError::new_err(format!(
                "guaranteed_backends must hold int backend ids, got {}",
                item.get_type()
                    .name()
                    .map_or_else(|_| "?".into(), |n| n.to_string())
            )));
        }
        let id: i128 = item.extract().unwrap_or(i128::MAX);
        let Ok(id) = u32::try_from(id) else {
            return Err(CoreError::InvalidConfig(format!(
                "guaranteed_backends: no backend id {id} (ids are 0..2**32)"
            ))
            .into());
        };
        ids.push(id);
    }
    Ok(Some(GuaranteedBackends::Only(ids)))
}

/// A backend or tenant id (as returned by `add_backend` / `add_tenant`): an `int` in `0..2**32`.
///
/// Like the amounts ([`amount`]), a bool or another type (a float, a str, an object with
/// `__index__`) is refused, and no Python code runs while reading it.
///
/// Errors: `TypeError` for a bool or a non-int, `OverflowError` for an int outside `0..2**32`;
/// both name the argument.
#[inline]
pub(crate) fn id_of(obj: &Bound<'_, PyAny>, what: &'static str) -> PyResult<u32> {
    if obj.is_exact_instance_of::<PyInt>() {
        let mut overflow = 0;
        // SAFETY: `obj` is a live `int` (checked above) and the GIL is held (`Bound`).
        let v = unsafe { pyo3::ffi::PyLong_AsLongLongAndOverflow(obj.as_ptr(), &mut overflow) };
        if overflow == 0 {
            if let Ok(id) = u32::try_from(v) {
                return Ok(id);
            }
        }
    }
    id_slow(obj, what)
}

/// A `backend` id argument of a pyo3-generated method ([`id_of`]).
fn backend_id_arg(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    id_of(obj, "backend")
}

/// A `tenant` id argument of a pyo3-generated method ([`id_of`]).
fn tenant_id_arg(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    id_of(obj, "tenant")
}

#[cold]
fn id_slow(obj: &Bound<'_, PyAny>, what: &'static str) -> PyResult<u32> {
    if obj.is_instance_of::<PyBool>() || !obj.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(format!(
            "argument '{what}': must be an int (an id from add_{what}), got {}",
            obj.get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        )));
    }
    // An `int` (or a subclass: its value is read without calling `__index__`).
    match obj.extract::<i128>() {
        Ok(v) => u32::try_from(v).map_err(|_| {
            PyOverflowError::new_err(format!("argument '{what}': id {v} is outside 0..2**32"))
        }),
        Err(_) => Err(PyOverflowError::new_err(format!(
            "argument '{what}': id is outside 0..2**32"
        ))),
    }
}

/// A priority class: `'critical'`, `'standard'`, `'sheddable'` or its code 0 / 1 / 2.
///
/// Errors: `InvalidConfigError` for an unknown name or code, `TypeError` for another type.
#[inline]
pub(crate) fn priority_of(obj: &Bound<'_, PyAny>) -> PyResult<Priority> {
    // Fast path: the interned names (string literals in the caller's code are interned).
    let py = obj.py();
    if obj.is(pyo3::intern!(py, "standard")) {
        return Ok(Priority::Standard);
    }
    if obj.is(pyo3::intern!(py, "critical")) {
        return Ok(Priority::Critical);
    }
    if obj.is(pyo3::intern!(py, "sheddable")) {
        return Ok(Priority::Sheddable);
    }
    priority_slow(obj)
}

#[cold]
fn priority_slow(obj: &Bound<'_, PyAny>) -> PyResult<Priority> {
    if let Ok(s) = obj.cast::<PyString>() {
        // Lossy: a str that is not valid UTF-8 (a lone surrogate) is an unknown name too.
        return Ok(Priority::parse(&s.to_string_lossy())?);
    }
    if obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>() {
        let code = obj.extract::<i128>().ok();
        if let Some(code) = code.and_then(|v| u64::try_from(v).ok()) {
            return Ok(Priority::from_code(code)?);
        }
        // Negative or huge: the error shows the value given, not a wrapped one.
        return Err(CoreError::InvalidConfig(format!(
            "unknown priority code {}: expected 0 (critical), 1 (standard), 2 (sheddable)",
            code.map_or_else(|| "outside the 128-bit range".into(), |v| v.to_string())
        ))
        .into());
    }
    Err(PyTypeError::new_err(
        "priority must be 'critical', 'standard', 'sheddable' or 0/1/2",
    ))
}

fn clock_of(clock: Option<&Bound<'_, ManualClock>>) -> Clock {
    clock.map_or(Clock::Monotonic, |c| Clock::Manual(c.get().inner.clone()))
}

#[allow(clippy::cast_precision_loss)]
fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// A test clock that only moves when advanced.
#[pyclass(frozen, module = "kvgate")]
pub struct ManualClock {
    inner: Arc<RustManualClock>,
}

#[pymethods]
impl ManualClock {
    #[new]
    #[pyo3(signature = (start_ns=0))]
    fn new(start_ns: u64) -> Self {
        Self {
            inner: Arc::new(RustManualClock::new(start_ns)),
        }
    }

    fn advance(&self, seconds: f64) -> PyResult<()> {
        if !(seconds.is_finite() && seconds >= 0.0) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "seconds must be a finite number >= 0 (got {seconds})"
            )));
        }
        self.inner.advance_ns((seconds * 1e9).round() as u64);
        Ok(())
    }

    fn advance_ns(&self, ns: u64) {
        self.inner.advance_ns(ns);
    }

    #[getter]
    fn now_ns(&self) -> u64 {
        self.inner.now_ns()
    }

    fn __repr__(&self) -> String {
        format!("ManualClock(now_ns={})", self.inner.now_ns())
    }
}

/// A lock-free pool of concurrency slots.
#[pyclass(frozen, module = "kvgate")]
pub struct SlotPool {
    pub(crate) c: SlotCounter,
}

#[pymethods]
impl SlotPool {
    #[new]
    #[pyo3(signature = (limit, *, clock=None))]
    fn new(limit: &Bound<'_, PyAny>, clock: Option<&Bound<'_, ManualClock>>) -> PyResult<Self> {
        let _ = clock; // slots do not depend on time; accepted for a uniform constructor.
        Ok(Self {
            c: SlotCounter::new(amount(limit, "limit")?),
        })
    }

    // `try_acquire(n=None)` and `release(n=None)` are hand-written CPython entry points,
    // installed on the type at module initialisation (`python_fast.rs`).

    #[getter]
    fn in_use(&self) -> u64 {
        self.c.in_use()
    }

    #[getter]
    fn limit(&self) -> u64 {
        self.c.limit()
    }

    #[setter]
    fn set_limit(&self, limit: &Bound<'_, PyAny>) -> PyResult<()> {
        self.c.set_limit(amount(limit, "limit")?);
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "SlotPool(in_use={}, limit={})",
            self.c.in_use(),
            self.c.limit()
        )
    }
}

/// A lock-free token bucket (tokens per minute) with reserve / reconcile.
///
/// Without a manual clock it reads the precise system clock (`CLOCK_MONOTONIC`, the clock of
/// `time.monotonic()`), not the controller's tick clock, so a `retry_after` waited out by
/// Python's clock finds the tokens (one reading per call is no cost for a standalone bucket).
#[pyclass(frozen, module = "kvgate")]
pub struct TokenBucket {
    b: RustBucket,
    clock: Clock,
}

#[pymethods]
impl TokenBucket {
    #[new]
    #[pyo3(signature = (tokens_per_minute, burst_tokens=None, *, clock=None))]
    fn new(
        tokens_per_minute: &Bound<'_, PyAny>,
        burst_tokens: Option<&Bound<'_, PyAny>>,
        clock: Option<&Bound<'_, ManualClock>>,
    ) -> PyResult<Self> {
        let rate = amount(tokens_per_minute, "tokens_per_minute")?;
        let burst = opt_amount(burst_tokens, "burst_tokens")?.unwrap_or(rate);
        Ok(Self {
            b: RustBucket::new(rate, burst)?,
            clock: clock_of(clock),
        })
    }

    fn try_reserve(&self, tokens: &Bound<'_, PyAny>) -> PyResult<bool> {
        let n = amount(tokens, "tokens")?;
        Ok(self.b.try_reserve(n, self.clock.precise_now_ns())?)
    }

    fn reconcile(&self, reserved: &Bound<'_, PyAny>, actual: &Bound<'_, PyAny>) -> PyResult<()> {
        let r = amount(reserved, "reserved")?;
        let a = amount(actual, "actual")?;
        let clock = &self.clock;
        self.b.reconcile_with(
            r,
            a,
            || clock.precise_now_ns(),
            self.b.rate(),
            self.b.burst(),
        );
        Ok(())
    }

    #[getter]
    fn available(&self) -> i64 {
        self.b.available(self.clock.precise_now_ns())
    }

    #[getter]
    fn tokens_per_minute(&self) -> u64 {
        self.b.rate()
    }

    #[setter]
    fn set_tokens_per_minute(&self, rate: &Bound<'_, PyAny>) -> PyResult<()> {
        let rate = amount(rate, "tokens_per_minute")?;
        Ok(self
            .b
            .set_params(rate, self.b.burst(), self.clock.precise_now_ns())?)
    }

    #[getter]
    fn burst_tokens(&self) -> u64 {
        self.b.burst()
    }

    fn retry_after(&self, tokens: &Bound<'_, PyAny>) -> PyResult<f64> {
        let n = amount(tokens, "tokens")?;
        Ok(secs(self.b.retry_after_ns(n, self.clock.precise_now_ns())?))
    }

    fn time_to_full(&self) -> f64 {
        secs(self.b.time_to_full_ns(self.clock.precise_now_ns()))
    }

    fn __repr__(&self) -> String {
        format!(
            "TokenBucket(tokens_per_minute={}, burst_tokens={}, available={})",
            self.b.rate(),
            self.b.burst(),
            self.b.available(self.clock.precise_now_ns())
        )
    }
}

/// The adaptive control law (KV-cache usage + waiting requests → scale).
#[pyclass(module = "kvgate")]
pub struct AdaptiveLaw {
    law: RustLaw,
    clock: Clock,
}

fn waiting_of(w: i64) -> PyResult<u64> {
    u64::try_from(w).map_err(|_| {
        pyo3::exceptions::PyValueError::new_err(format!("waiting must be >= 0 (got {w})"))
    })
}

#[pymethods]
impl AdaptiveLaw {
    #[new]
    #[pyo3(signature = (high=0.85, low=0.70, floor=0.6, recovery_per_second=0.05, waiting_threshold=8, *, clock=None))]
    fn new(
        high: f64,
        low: f64,
        floor: f64,
        recovery_per_second: f64,
        waiting_threshold: u64,
        clock: Option<&Bound<'_, ManualClock>>,
    ) -> PyResult<Self> {
        let params = LawParams {
            high,
            low,
            floor,
            recovery_per_second,
            waiting_threshold,
        };
        Ok(Self {
            law: RustLaw::new(params)?,
            clock: clock_of(clock),
        })
    }

    #[pyo3(signature = (kv_usage, waiting=0))]
    fn target(&self, kv_usage: Option<f64>, waiting: i64) -> PyResult<f64> {
        Ok(self.law.target(kv_usage, waiting_of(waiting)?)?)
    }

    #[pyo3(signature = (kv_usage, waiting=0))]
    fn update(&mut self, kv_usage: Option<f64>, waiting: i64) -> PyResult<f64> {
        // Once a poll: the precise clock, which the poller's own times (asyncio's loop) use.
        let now = self.clock.precise_now_ns();
        Ok(self.law.update(kv_usage, waiting_of(waiting)?, now)?)
    }

    #[getter]
    fn scale(&self) -> f64 {
        self.law.scale()
    }

    #[getter]
    fn shedding(&self) -> bool {
        self.law.shedding()
    }

    #[getter]
    fn overloaded(&self) -> bool {
        self.law.overloaded()
    }

    #[getter]
    fn high(&self) -> f64 {
        self.law.params().high
    }

    #[getter]
    fn low(&self) -> f64 {
        self.law.params().low
    }

    #[getter]
    fn floor(&self) -> f64 {
        self.law.params().floor
    }

    #[getter]
    fn recovery_per_second(&self) -> f64 {
        self.law.params().recovery_per_second
    }

    #[getter]
    fn waiting_threshold(&self) -> u64 {
        self.law.params().waiting_threshold
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "AdaptiveLaw(scale={}, shedding={})",
            py_repr(py, (self.law.scale() * 1000.0).round() / 1000.0)?,
            py_repr(py, self.law.shedding())?
        ))
    }
}

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
    pub(crate) fn new(ctl: Py<AdmissionController>, ticket: Ticket) -> Self {
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

    /// `release(actual_tokens)` (the hand-written entry point in `python_fast.rs`, and
    /// `__exit__`): releases once, reconciling with `actual` tokens (`None` = as reserved).
    #[inline]
    pub(crate) fn release_once(&self, actual: Option<u64>) -> PyResult<()> {
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
    // type at module initialisation (`python_fast.rs`).

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
    pub(crate) fn new(refusal: Refusal) -> Self {
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
    pub(crate) core: Arc<Admission>,
}

impl AdmissionController {
    /// The six `x-ratelimit-*` headers as Python `(name, value)` tuples.
    fn rate_limit_pairs<'py>(
        &self,
        py: Python<'py>,
        backend: u32,
        tenant: u32,
    ) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        let values = crate::headers::rate_limit_headers(&self.core.rate_limits(backend, tenant)?);
        let names = RATE_LIMIT_NAMES.get_or_init(py, || {
            RATE_LIMIT_HEADER_NAMES.map(|n| PyString::intern(py, n).unbind())
        });
        let mut pairs = Vec::with_capacity(10);
        for (name, value) in names.iter().zip(values) {
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

    fn remove_tenant(&self, #[pyo3(from_py_with = tenant_id_arg)] tenant: u32) -> PyResult<()> {
        Ok(self.core.remove_tenant(tenant)?)
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
        let c = BackendConfig {
            max_concurrency: amount(max_concurrency, "max_concurrency")?,
            tokens_per_minute: amount(tokens_per_minute, "tokens_per_minute")?,
            burst_tokens: opt_amount(burst_tokens, "burst_tokens")?,
            inflight_token_limit: opt_amount(inflight_token_limit, "inflight_token_limit")?,
        };
        Ok(self.core.add_backend(name, &c)?)
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
        let c = TenantConfig {
            priority: priority_of(priority)?,
            tokens_per_minute: opt_amount(tokens_per_minute, "tokens_per_minute")?,
            burst_tokens: opt_amount(burst_tokens, "burst_tokens")?,
            max_concurrency: opt_amount(max_concurrency, "max_concurrency")?,
            guaranteed_slots: opt_amount(guaranteed_slots, "guaranteed_slots")?.unwrap_or(0),
            guaranteed_backends: backend_mask(guaranteed_backends)?.unwrap_or(ALL_BACKENDS),
        };
        Ok(self.core.add_tenant(name, &c)?)
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

    fn set_overload(
        &self,
        #[pyo3(from_py_with = backend_id_arg)] backend: u32,
        on: bool,
    ) -> PyResult<()> {
        Ok(self.core.set_overload(backend, on)?)
    }

    // `admit(backend, tenant, priority, tokens)` is a hand-written CPython entry point, installed
    // on the type at module initialisation (`python_fast.rs`).

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
            (owned_reason.as_str(), scope == "tenant", never, retry)
        };
        let mut limits = self.core.rate_limits(backend, tenant)?;
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
        });
        let date = crate::headers::http_date_now();
        let raw = crate::headers::http_response(status, &headers, &body, &date, connection)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok((status, PyString::intern(py, reason), PyBytes::new(py, &raw)))
    }

    #[pyo3(signature = (backend, tenant, status, upstream_headers, body=None, connection=None, chunked=true))]
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
    ) -> PyResult<Bound<'py, PyBytes>> {
        let values = crate::headers::rate_limit_headers(&self.core.rate_limits(backend, tenant)?);
        let ours: Vec<(&[u8], &[u8])> = RATE_LIMIT_HEADER_NAMES
            .iter()
            .zip(values.iter())
            .map(|(n, v)| (n.as_bytes(), v.as_bytes()))
            .collect();
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

/// Go's `time.Duration.String` of `seconds` (see [`crate::headers::go_duration_secs`]).
#[pyfunction]
fn go_duration(seconds: f64) -> String {
    crate::headers::go_duration_secs(seconds)
}

/// A complete HTTP/1.1 response (see [`crate::headers::http_response`]) with today's `Date`.
#[pyfunction]
#[pyo3(signature = (status, headers, body, connection=None))]
fn http_response<'py>(
    py: Python<'py>,
    status: u16,
    headers: Vec<(String, String)>,
    body: &[u8],
    connection: Option<&str>,
) -> PyResult<Bound<'py, PyBytes>> {
    let pairs: Vec<(&str, &str)> = headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    let date = crate::headers::http_date_now();
    let raw = crate::headers::http_response(status, &pairs, body, &date, connection)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(PyBytes::new(py, &raw))
}

/// `(name, value)` byte pairs of a Python sequence (aiohttp's `raw_headers`).
fn byte_pairs<'py>(
    headers: &Bound<'py, PyAny>,
) -> PyResult<Vec<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)>> {
    let mut out = Vec::new();
    for item in headers.try_iter()? {
        let item = item?;
        let pair = item
            .cast::<PyTuple>()
            .map_err(|_| PyTypeError::new_err("headers must be (bytes, bytes) pairs"))?;
        if pair.len() != 2 {
            return Err(PyTypeError::new_err("headers must be (bytes, bytes) pairs"));
        }
        let name = pair.get_item(0)?;
        let value = pair.get_item(1)?;
        let (Ok(name), Ok(value)) = (name.cast_into::<PyBytes>(), value.cast_into::<PyBytes>())
        else {
            return Err(PyTypeError::new_err("headers must be (bytes, bytes) pairs"));
        };
        out.push((name, value));
    }
    Ok(out)
}

/// A relayed response or stream head (see [`crate::headers::relayed_headers`]): the engine's
/// headers then `ours`; with `body` a whole response, else a stream head.
fn relay_bytes<'py>(
    py: Python<'py>,
    status: u16,
    upstream: &Bound<'py, PyAny>,
    ours: &[(&[u8], &[u8])],
    body: Option<&[u8]>,
    connection: Option<&str>,
    chunked: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    let held = byte_pairs(upstream)?;
    let pairs: Vec<(&[u8], &[u8])> = held
        .iter()
        .map(|(n, v)| (n.as_bytes(), v.as_bytes()))
        .collect();
    let headers = crate::headers::relayed_headers(&pairs, ours);
    let date = crate::headers::http_date_now();
    let framing = match body {
        Some(b) => crate::headers::Framing::Length(b.len()),
        None if chunked => crate::headers::Framing::Chunked,
        None => crate::headers::Framing::Close,
    };
    let extra = body.map_or(0, <[u8]>::len);
    let mut raw = crate::headers::http_head(status, &headers, framing, &date, connection, extra)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    if let Some(b) = body {
        raw.extend_from_slice(b);
    }
    Ok(PyBytes::new(py, &raw))
}

/// A relayed engine response (see [`relay_bytes`]) without kvgate's own headers.
#[pyfunction]
#[pyo3(signature = (status, upstream_headers, body=None, connection=None, chunked=true))]
fn relay_http<'py>(
    py: Python<'py>,
    status: u16,
    upstream_headers: &Bound<'py, PyAny>,
    body: Option<&[u8]>,
    connection: Option<&str>,
    chunked: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    relay_bytes(py, status, upstream_headers, &[], body, connection, chunked)
}

/// The native module `kvgate._core`.
#[pymodule(gil_used = false)]
pub fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    init_errors(py)?;
    m.add("CoreError", err_type(py, &CORE_ERROR))?;
    m.add("InvalidAmountError", err_type(py, &INVALID_AMOUNT))?;
    m.add("NeverAdmissibleError", err_type(py, &NEVER_ADMISSIBLE))?;
    m.add("OverReleaseError", err_type(py, &OVER_RELEASE))?;
    m.add("InvalidConfigError", err_type(py, &INVALID_CONFIG))?;
    m.add("SharedStateError", err_type(py, &SHARED_STATE))?;
    m.add("MAX_AMOUNT", MAX_AMOUNT)?;
    m.add("MAX_PROCS", MAX_PROCS)?;
    m.add("REASONS", {
        let all = [
            Reason::TenantTpm,
            Reason::TenantConcurrency,
            Reason::BackendSlots,
            Reason::BackendTpm,
            Reason::InflightTokens,
            Reason::Shed,
        ];
        PyTuple::new(py, all.map(Reason::as_str))?
    })?;
    m.add_function(wrap_pyfunction!(go_duration, m)?)?;
    m.add_function(wrap_pyfunction!(http_response, m)?)?;
    m.add_function(wrap_pyfunction!(relay_http, m)?)?;
    m.add_class::<ManualClock>()?;
    m.add_class::<SlotPool>()?;
    crate::python_fast::install(py)?;
    m.add_class::<TokenBucket>()?;
    m.add_class::<AdaptiveLaw>()?;
    m.add_class::<AdmissionController>()?;
    m.add_class::<Reservation>()?;
    m.add_class::<Rejection>()?;
    crate::python_analyze::register(m)?;
    crate::python_sse::register(m)?;
    crate::python_ledger::register(m)?;
    Ok(())
}
