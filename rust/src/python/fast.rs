//! Hand-written CPython entry points for the calls a caller makes per request:
//! `SlotPool.try_acquire(n=None)`, `SlotPool.release(n=None)`,
//! `AdmissionController.admit(backend, tenant, priority, tokens)` and
//! `Reservation.release(actual_tokens=None)`.
//!
//! pyo3's generated wrappers cost about as much as the limit updates themselves (the generic
//! argument parser, the trampoline's attach-count bookkeeping through thread-local storage);
//! these functions are plain `METH_FASTCALL | METH_KEYWORDS` methods that bind their arguments
//! directly. They are installed on their types by [`install`] at module initialisation, as
//! method descriptors, so they are bound, introspected (`__text_signature__`) and type-checked by
//! CPython like any other method. Their behaviour, argument handling and error messages are those
//! of the rest of the bindings.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};
use pyo3::PyClass;

use crate::python::{
    amount, id_of, opt_amount, priority_of, AdmissionController, Rejection, Reservation, SlotPool,
};

/// The arguments of one `METH_FASTCALL | METH_KEYWORDS` call.
struct FastArgs {
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
}

impl FastArgs {
    /// Binds the call's arguments to the parameters `names` (positional or keyword), in order,
    /// as borrowed object pointers; the first `required` must be given, an absent optional one
    /// is `None`.
    ///
    /// Errors: `TypeError` for more positional arguments than parameters, an unknown keyword, a parameter
    /// given twice or a missing required one.
    ///
    /// # Safety
    /// `args` must hold `nargs` positional arguments followed by one value per name in
    /// `kwnames` (a tuple of `str`, or null), as CPython passes them, and the GIL must be held.
    #[inline]
    unsafe fn bind<const N: usize>(
        &self,
        py: Python<'_>,
        method: &str,
        names: &[&str; N],
        required: usize,
    ) -> PyResult<[*mut ffi::PyObject; N]> {
        // The common call: every parameter given by position, no keyword.
        if self.kwnames.is_null() && self.nargs as usize == N {
            // SAFETY: `args` holds `nargs` = N positional arguments (this function's contract).
            return Ok(std::array::from_fn(|i| unsafe { *self.args.add(i) }));
        }
        // SAFETY: the same contract.
        unsafe { self.bind_general(py, method, names, required) }
    }

    /// [`Self::bind`] for every other form of call (keywords, absent optional parameters,
    /// errors).
    ///
    /// # Safety
    /// As [`Self::bind`].
    #[inline(never)]
    unsafe fn bind_general<const N: usize>(
        &self,
        py: Python<'_>,
        method: &str,
        names: &[&str; N],
        required: usize,
    ) -> PyResult<[*mut ffi::PyObject; N]> {
        let nkw = if self.kwnames.is_null() {
            0
        } else {
            // SAFETY: CPython passes a tuple of names (or null, handled above).
            unsafe { ffi::PyTuple_GET_SIZE(self.kwnames) }
        };
        let (nargs, nkw) = (self.nargs as usize, nkw as usize);
        if nargs > N {
            return Err(PyTypeError::new_err(format!(
                "{method}() takes at most {N} argument{} ({}), got {nargs}",
                if N == 1 { "" } else { "s" },
                names.join(", "),
            )));
        }
        let mut bound = [std::ptr::null_mut(); N];
        for (i, slot) in bound.iter_mut().enumerate().take(nargs) {
            // SAFETY: `args` holds `nargs` positional arguments (this function's contract).
            *slot = unsafe { *self.args.add(i) };
        }
        if nkw > 0 {
            // SAFETY: a live tuple of `str` (checked non-null above), borrowed for this call.
            let kwnames =
                unsafe { Bound::ref_from_ptr(py, &self.kwnames).cast_unchecked::<PyTuple>() };
            for (k, name) in kwnames.iter().enumerate() {
                let name = name.cast_into::<PyString>()?;
                // Lossy: a name that is not valid UTF-8 (a lone surrogate) matches no parameter
                // and is reported as unexpected, as Python reports it.
                let name = name.to_string_lossy();
                let Some(pos) = names.iter().position(|n| *n == name) else {
                    return Err(PyTypeError::new_err(format!(
                        "{method}() got an unexpected keyword argument '{name}'"
                    )));
                };
                if !bound[pos].is_null() {
                    return Err(PyTypeError::new_err(format!(
                        "{method}() got multiple values for argument '{name}'"
                    )));
                }
                // SAFETY: the keyword values follow the positional ones (this function's
                // contract).
                bound[pos] = unsafe { *self.args.add(nargs + k) };
            }
        }
        for (i, (slot, name)) in bound.iter_mut().zip(names).enumerate() {
            if slot.is_null() {
                if i < required {
                    return Err(PyTypeError::new_err(format!(
                        "{method}() missing required argument '{name}'"
                    )));
                }
                // SAFETY: `None` is a static object; the pointer is borrowed.
                *slot = unsafe { ffi::Py_None() };
            }
        }
        Ok(bound)
    }
}

/// One call of `method` on a `T`: binds the arguments to `names` (the first `required` of them
/// required) and runs `body`, which returns the new reference to hand back; an error or a panic
/// becomes a raised exception (null return).
///
/// # Safety
/// As CPython calls a `METH_FASTCALL | METH_KEYWORDS` method: `slf` a live `T` (the method
/// descriptor checks the type before calling), the arguments as described on
/// [`FastArgs::bind`], the GIL held.
unsafe fn call<T: PyClass, const N: usize>(
    slf: *mut ffi::PyObject,
    args: &FastArgs,
    method: &str,
    names: &[&str; N],
    required: usize,
    body: impl FnOnce(&Bound<'_, T>, [&Bound<'_, PyAny>; N]) -> PyResult<*mut ffi::PyObject>,
) -> *mut ffi::PyObject {
    // SAFETY: CPython calls methods with the GIL held.
    let py = unsafe { Python::assume_attached() };
    // SAFETY: the descriptor was created for the type `T`, so `slf` is one (borrowed).
    let obj = unsafe { Bound::ref_from_ptr(py, &slf).cast_unchecked::<T>() };
    let result = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the arguments are CPython's vectorcall arguments (this function's contract).
        let ptrs = unsafe { args.bind(py, method, names, required) }?;
        // SAFETY: each pointer is an argument or `None`, alive for the call, borrowed.
        let bound = ptrs
            .each_ref()
            .map(|p| unsafe { Bound::ref_from_ptr(py, p) });
        body(obj, bound)
    }))
    .unwrap_or_else(|_| {
        Err(PyRuntimeError::new_err(format!(
            "kvgate: panic in {method}()"
        )))
    });
    match result {
        Ok(obj) => obj,
        Err(e) => {
            // Raising a lazily built error drops the Python references it holds; inside
            // `attach` (which raises pyo3's attach count, unlike `assume_attached`) they are
            // released at once instead of waiting in pyo3's deferred reference pool.
            Python::attach(|py| e.restore(py));
            std::ptr::null_mut()
        }
    }
}

/// A new reference to `True` or `False`.
fn py_bool(v: bool) -> *mut ffi::PyObject {
    // SAFETY: the bool singletons are static objects; the caller receives a new reference.
    unsafe { ffi::Py_NewRef(if v { ffi::Py_True() } else { ffi::Py_False() }) }
}

/// A new reference to `None`.
fn py_none() -> *mut ffi::PyObject {
    // SAFETY: `None` is a static object; the caller receives a new reference.
    unsafe { ffi::Py_NewRef(ffi::Py_None()) }
}

/// A slot count argument: `None` (or absent) means 1.
fn slots_n(n: &Bound<'_, PyAny>) -> PyResult<u64> {
    if n.is_none() {
        Ok(1)
    } else {
        amount(n, "n")
    }
}

/// Defines the `METH_FASTCALL | METH_KEYWORDS` entry point `$fn_name` of `$ty.$method`: its
/// parameters `$param`s (the first `$required` required) bound by [`call`], then `$body`.
macro_rules! fast_method {
    ($fn_name:ident, $ty:ty, $method:literal, [$($param:literal),+], $required:expr, $body:expr) => {
        unsafe extern "C" fn $fn_name(
            slf: *mut ffi::PyObject,
            args: *const *mut ffi::PyObject,
            nargs: ffi::Py_ssize_t,
            kwnames: *mut ffi::PyObject,
        ) -> *mut ffi::PyObject {
            let args = FastArgs {
                args,
                nargs,
                kwnames,
            };
            // SAFETY: CPython calls it as a method of the type it was installed on (the
            // descriptor checks the type), with the GIL held and vectorcall arguments.
            unsafe { call::<$ty, _>(slf, &args, $method, &[$($param),+], $required, $body) }
        }
    };
}

fast_method!(
    slot_try_acquire,
    SlotPool,
    "SlotPool.try_acquire",
    ["n"],
    0,
    |pool, [n]| Ok(py_bool(pool.get().c.try_acquire(slots_n(n)?)))
);

fast_method!(
    slot_release,
    SlotPool,
    "SlotPool.release",
    ["n"],
    0,
    |pool, [n]| {
        pool.get().c.release(slots_n(n)?)?;
        Ok(py_none())
    }
);

fast_method!(
    controller_admit,
    AdmissionController,
    "AdmissionController.admit",
    ["backend", "tenant", "priority", "tokens"],
    4,
    |ctl, [backend, tenant, priority, tokens]| {
        let backend = id_of(backend, "backend")?;
        let tenant = id_of(tenant, "tenant")?;
        let n = amount(tokens, "tokens")?;
        let p = priority_of(priority)?;
        let py = ctl.py();
        let obj = match ctl.get().core.admit(backend, tenant, p, n)? {
            Ok(ticket) => {
                Bound::new(py, Reservation::new(ctl.clone().unbind(), ticket))?.into_any()
            }
            Err(refusal) => Bound::new(py, Rejection::new(refusal))?.into_any(),
        };
        Ok(obj.into_ptr())
    }
);

fast_method!(
    reservation_release,
    Reservation,
    "Reservation.release",
    ["actual_tokens"],
    0,
    |res, [actual]| {
        res.get()
            .release_once(opt_amount(Some(actual), "actual_tokens")?)?;
        Ok(py_none())
    }
);

/// A `PyMethodDef` in a static: CPython keeps a pointer to it and never writes through it.
struct MethodDef(ffi::PyMethodDef);

// SAFETY: the definitions are immutable after construction (read-only pointers to static data).
unsafe impl Sync for MethodDef {}

/// A `METH_FASTCALL | METH_KEYWORDS` definition; `doc` starts with the text signature.
const fn def(
    name: &'static std::ffi::CStr,
    meth: ffi::PyCFunctionFastWithKeywords,
    doc: &'static std::ffi::CStr,
) -> MethodDef {
    MethodDef(ffi::PyMethodDef {
        ml_name: name.as_ptr(),
        ml_meth: ffi::PyMethodDefPointer {
            PyCFunctionFastWithKeywords: meth,
        },
        ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
        ml_doc: doc.as_ptr(),
    })
}

static SLOT_POOL: [MethodDef; 2] = [
    def(
        c"try_acquire",
        slot_try_acquire,
        c"try_acquire($self, n=None)\n--\n\nTakes n slots (None = 1) if that stays within the limit; returns whether it did.",
    ),
    def(
        c"release",
        slot_release,
        c"release($self, n=None)\n--\n\nGives n slots (None = 1) back; raises OverReleaseError (changing nothing) when fewer are held.",
    ),
];

static CONTROLLER: [MethodDef; 1] = [def(
    c"admit",
    controller_admit,
    c"admit($self, backend, tenant, priority, tokens)\n--\n\nAdmits a request of tokens (prompt + reserved completion) for tenant at priority on backend against every limit that applies: a Reservation, or a Rejection that tells which limit refused (nothing is held after it).",
)];

static RESERVATION: [MethodDef; 1] = [def(
    c"release",
    reservation_release,
    c"release($self, actual_tokens=None)\n--\n\nReleases everything held and reconciles the token buckets with actual_tokens (prompt + real completion; None = as reserved). Idempotent; a bad actual_tokens raises before anything is released.",
)];

/// Installs `defs` on the type `T` as method descriptors.
fn install_on<T: PyClass>(py: Python<'_>, defs: &'static [MethodDef]) -> PyResult<()> {
    let ty = py.get_type::<T>();
    for def in defs {
        // SAFETY: `def` is a static, valid method definition; CPython only reads it.
        let descr = unsafe {
            Bound::from_owned_ptr_or_err(
                py,
                ffi::PyDescr_NewMethod(ty.as_type_ptr(), std::ptr::from_ref(&def.0).cast_mut()),
            )?
        };
        // SAFETY: `ml_name` is a static NUL-terminated ASCII string.
        let name = unsafe { std::ffi::CStr::from_ptr(def.0.ml_name) };
        ty.setattr(name.to_string_lossy().as_ref(), descr)?;
    }
    Ok(())
}

/// Installs the hand-written methods on `SlotPool`, `AdmissionController` and `Reservation`.
pub(super) fn install(py: Python<'_>) -> PyResult<()> {
    install_on::<SlotPool>(py, &SLOT_POOL)?;
    install_on::<AdmissionController>(py, &CONTROLLER)?;
    install_on::<Reservation>(py, &RESERVATION)
}
