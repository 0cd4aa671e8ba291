//! Errors and argument conversion shared by the bindings: the Python exception types, amounts,
//! ids and priority classes read from Python objects, Python-style `repr`.

use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyInt, PyString, PyTuple, PyType};
use pyo3::IntoPyObjectExt;

use crate::admission::{BackendConfig, GuaranteedBackends, TenantConfig, ALL_BACKENDS};
use crate::error::{CoreError, MAX_AMOUNT};
use crate::priority::Priority;

pub(super) static CORE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
pub(super) static INVALID_AMOUNT: PyOnceLock<Py<PyType>> = PyOnceLock::new();
pub(super) static NEVER_ADMISSIBLE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
pub(super) static OVER_RELEASE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
pub(super) static INVALID_CONFIG: PyOnceLock<Py<PyType>> = PyOnceLock::new();
pub(super) static SHARED_STATE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
/// The `x-ratelimit-*` header names, interned once.
pub(super) static RATE_LIMIT_NAMES: PyOnceLock<[Py<PyString>; 6]> = PyOnceLock::new();

/// Python's `repr()` of `value` (`None`, `True`, `'text'`, `1.0`), so that a binding's
/// `__repr__` reads as Python, not as Rust's `Debug` (`Some(1.0)`, `true`, `"text"`).
pub(super) fn py_repr<'py, T: IntoPyObject<'py>>(py: Python<'py>, value: T) -> PyResult<String> {
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

pub(super) fn init_errors(py: Python<'_>) -> PyResult<()> {
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

pub(super) fn err_type<'py>(py: Python<'py>, cell: &PyOnceLock<Py<PyType>>) -> Bound<'py, PyType> {
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
pub(super) fn amount(obj: &Bound<'_, PyAny>, what: &'static str) -> PyResult<u64> {
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

pub(super) fn opt_amount(
    obj: Option<&Bound<'_, PyAny>>,
    what: &'static str,
) -> PyResult<Option<u64>> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => amount(o, what).map(Some),
    }
}

/// A backend's whole configuration from `add_backend`'s / `replace_backend`'s arguments.
pub(super) fn backend_config(
    max_concurrency: &Bound<'_, PyAny>,
    tokens_per_minute: &Bound<'_, PyAny>,
    burst_tokens: Option<&Bound<'_, PyAny>>,
    inflight_token_limit: Option<&Bound<'_, PyAny>>,
) -> PyResult<BackendConfig> {
    Ok(BackendConfig {
        max_concurrency: amount(max_concurrency, "max_concurrency")?,
        tokens_per_minute: amount(tokens_per_minute, "tokens_per_minute")?,
        burst_tokens: opt_amount(burst_tokens, "burst_tokens")?,
        inflight_token_limit: opt_amount(inflight_token_limit, "inflight_token_limit")?,
    })
}

/// A tenant's whole configuration from `add_tenant`'s / `replace_tenant`'s arguments (`None`:
/// no limit, no guaranteed slot, every backend).
pub(super) fn tenant_config(
    priority: &Bound<'_, PyAny>,
    tokens_per_minute: Option<&Bound<'_, PyAny>>,
    max_concurrency: Option<&Bound<'_, PyAny>>,
    guaranteed_slots: Option<&Bound<'_, PyAny>>,
    burst_tokens: Option<&Bound<'_, PyAny>>,
    guaranteed_backends: Option<&Bound<'_, PyAny>>,
) -> PyResult<TenantConfig> {
    Ok(TenantConfig {
        priority: priority_of(priority)?,
        tokens_per_minute: opt_amount(tokens_per_minute, "tokens_per_minute")?,
        burst_tokens: opt_amount(burst_tokens, "burst_tokens")?,
        max_concurrency: opt_amount(max_concurrency, "max_concurrency")?,
        guaranteed_slots: opt_amount(guaranteed_slots, "guaranteed_slots")?.unwrap_or(0),
        guaranteed_backends: backend_mask(guaranteed_backends)?.unwrap_or(ALL_BACKENDS),
    })
}

/// `guaranteed_backends`: `None` (absent), `"all"` ([`ALL_BACKENDS`]) or an iterable of
/// backend ids (ids past the registered backends are refused by the core).
pub(super) fn backend_mask(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<GuaranteedBackends>> {
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
pub(super) fn id_of(obj: &Bound<'_, PyAny>, what: &'static str) -> PyResult<u32> {
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
pub(super) fn backend_id_arg(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    id_of(obj, "backend")
}

/// A `tenant` id argument of a pyo3-generated method ([`id_of`]).
pub(super) fn tenant_id_arg(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
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
pub(super) fn priority_of(obj: &Bound<'_, PyAny>) -> PyResult<Priority> {
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

#[allow(clippy::cast_precision_loss)]
pub(super) fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}
