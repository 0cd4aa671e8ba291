//! The pyo3 bindings: the only file that knows about Python.

use pyo3::prelude::*;

/// The native module `kvgate._core`.
#[pymodule(gil_used = false)]
pub fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    crate::python_analyze::register(m)?;
    Ok(())
}
