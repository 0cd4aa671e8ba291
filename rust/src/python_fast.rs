//! Hand-written CPython entry points for `SlotPool.try_acquire(n=None)` and
//! `SlotPool.release(n=None)`, the two calls a caller makes per request on a slot pool.
//!
//! pyo3's generated wrappers cost about as much as the slot update itself (the argument parser
//! for an optional argument, the trampoline's attach-count bookkeeping through thread-local
//! storage); these functions are plain `METH_FASTCALL | METH_KEYWORDS` methods that read their
//! one optional argument directly. They are installed on the `SlotPool` type by [`install`] at
//! module initialisation, as method descriptors, so they are bound, introspected
//! (`__text_signature__`) and type-checked by CPython like any other method. Their behaviour,
//! argument handling and error messages are those of the rest of the bindings.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};

use crate::python::{amount, SlotPool};

/// The argument tuple of a `METH_FASTCALL | METH_KEYWORDS` call.
struct FastArgs {
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
}

impl FastArgs {
    /// The single optional argument `n` (positional or keyword `n`) of `method`, as an amount;
    /// absent or `None` means 1.
    ///
    /// Errors: `TypeError` for more than one argument, an unknown keyword or a non-int;
    /// `InvalidAmountError` for an amount outside `0..=2**62`.
    ///
    /// # Safety
    /// `args` must hold `nargs` positional arguments followed by one value per name in
    /// `kwnames` (a tuple of `str`, or null), as CPython passes them, and the GIL must be held.
    unsafe fn n(&self, py: Python<'_>, method: &str) -> PyResult<u64> {
        let nkw = if self.kwnames.is_null() {
            0
        } else {
            // SAFETY: CPython passes a tuple (or null, handled above).
            unsafe { ffi::PyTuple_GET_SIZE(self.kwnames) }
        };
        if self.nargs + nkw > 1 {
            return Err(PyTypeError::new_err(format!(
                "{method}() takes at most 1 argument (n), got {}",
                self.nargs + nkw
            )));
        }
        if self.nargs + nkw == 0 {
            return Ok(1);
        }
        if nkw == 1 {
            // SAFETY: a live tuple of one `str`, borrowed for this call.
            let names =
                unsafe { Bound::ref_from_ptr(py, &self.kwnames).cast_unchecked::<PyTuple>() };
            let name = names.get_item(0)?;
            let name = name.cast::<PyString>()?;
            if name.to_str()? != "n" {
                return Err(PyTypeError::new_err(format!(
                    "{method}() got an unexpected keyword argument '{name}'"
                )));
            }
        }
        // SAFETY: one argument is present (checked above); CPython keeps it alive for the call.
        let value = unsafe { Bound::ref_from_ptr(py, &*self.args) };
        if value.is_none() {
            return Ok(1);
        }
        amount(value, "n")
    }
}

/// One call of `method`: reads its argument `n` and runs `body` with the pool behind `slf`,
/// turning an error or a panic into a raised exception (null return).
///
/// # Safety
/// As CPython calls a `METH_FASTCALL | METH_KEYWORDS` method: `slf` a live `SlotPool` (the
/// method descriptor checks the type before calling), the arguments as described on
/// [`FastArgs::n`], the GIL held.
unsafe fn call(
    slf: *mut ffi::PyObject,
    args: FastArgs,
    method: &str,
    body: impl FnOnce(&SlotPool, u64) -> PyResult<*mut ffi::PyObject>,
) -> *mut ffi::PyObject {
    // SAFETY: CPython calls methods with the GIL held.
    let py = unsafe { Python::assume_attached() };
    // SAFETY: the descriptor was created for the SlotPool type, so `slf` is one (borrowed).
    let pool = unsafe { Bound::ref_from_ptr(py, &slf).cast_unchecked::<SlotPool>() };
    let result = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the arguments are CPython's vectorcall arguments (this function's contract).
        let n = unsafe { args.n(py, method) }?;
        body(pool.get(), n)
    }))
    .unwrap_or_else(|_| Err(PyRuntimeError::new_err("kvgate: panic in SlotPool")));
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

/// Defines the `METH_FASTCALL | METH_KEYWORDS` entry point `$name`: its one argument `n` read by
/// [`call`], then `$body(pool, n)`.
macro_rules! fast_method {
    ($name:ident, $body:expr) => {
        unsafe extern "C" fn $name(
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
            // SAFETY: CPython calls it as a SlotPool method (the descriptor checks the type),
            // with the GIL held and vectorcall arguments.
            unsafe { call(slf, args, stringify!($name), $body) }
        }
    };
}

fast_method!(try_acquire, |pool: &SlotPool, n| Ok(py_bool(
    pool.c.try_acquire(n)
)));
fast_method!(release, |pool: &SlotPool, n| {
    pool.c.release(n)?;
    Ok(py_none())
});

/// A `PyMethodDef` in a static: CPython keeps a pointer to it and never writes through it.
struct MethodDef(ffi::PyMethodDef);

// SAFETY: the definitions are immutable after construction (read-only pointers to static data).
unsafe impl Sync for MethodDef {}

static METHODS: [MethodDef; 2] = [
    MethodDef(ffi::PyMethodDef {
        ml_name: c"try_acquire".as_ptr(),
        ml_meth: ffi::PyMethodDefPointer {
            PyCFunctionFastWithKeywords: try_acquire,
        },
        ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
        ml_doc: c"try_acquire($self, n=None)\n--\n\nTakes n slots (None = 1) if that stays within the limit; returns whether it did.".as_ptr(),
    }),
    MethodDef(ffi::PyMethodDef {
        ml_name: c"release".as_ptr(),
        ml_meth: ffi::PyMethodDefPointer {
            PyCFunctionFastWithKeywords: release,
        },
        ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
        ml_doc: c"release($self, n=None)\n--\n\nGives n slots (None = 1) back; raises OverReleaseError (changing nothing) when fewer are held.".as_ptr(),
    }),
];

/// Installs the hand-written `try_acquire` and `release` on the `SlotPool` type.
pub(crate) fn install(py: Python<'_>) -> PyResult<()> {
    let ty = py.get_type::<SlotPool>();
    for def in &METHODS {
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
