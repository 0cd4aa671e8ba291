//! The pyo3 bindings: the only code that knows about Python, one file per concern. User docs
//! live in `python/kvgate/_core.pyi`.

mod analyze;
mod assemble;
mod controller;
mod convert;
mod fast;
mod http;
mod ledger;
mod primitives;
mod route;
mod sse;

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::admission::{Reason, MAX_PROCS};
use crate::error::MAX_AMOUNT;

use controller::{AdmissionController, Rejection, Reservation};
use convert::{
    err_type, init_errors, CORE_ERROR, INVALID_AMOUNT, INVALID_CONFIG, NEVER_ADMISSIBLE,
    OVER_RELEASE, SHARED_STATE,
};
use http::{go_duration, http_response, relay_http};
use primitives::{AdaptiveLaw, ManualClock, SlotPool, TokenBucket};

use convert::{amount, id_of, opt_amount, priority_of, py_repr};

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
    m.add("BOARD_PAYLOAD_BYTES", crate::admission::BOARD_PAYLOAD_BYTES)?;
    m.add("UNLIMITED_TPM", crate::admission::UNLIMITED_TPM)?;
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
    fast::install(py)?;
    m.add_class::<TokenBucket>()?;
    m.add_class::<AdaptiveLaw>()?;
    m.add_class::<AdmissionController>()?;
    m.add_class::<Reservation>()?;
    m.add_class::<Rejection>()?;
    analyze::register(m)?;
    sse::register(m)?;
    assemble::register(m)?;
    ledger::register(m)?;
    route::register(m)?;
    Ok(())
}
