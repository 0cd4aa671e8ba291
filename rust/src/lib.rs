//! kvgate's native core, imported from Python as `kvgate._core`.
//!
//! The admission primitives (slots, token bucket, in-flight token budget, priority classes,
//! adaptive control law, shared-memory state) and the request analyser live in plain Rust modules
//! with no pyo3; `python` (behind the default `python` feature) is the only file that talks to
//! Python.

pub mod adaptive;
pub mod admission;
pub mod assemble;
pub mod clock;
pub mod error;
pub mod headers;
pub mod priority;
pub mod quota_ledger;
pub mod shm;
pub mod slots;
pub mod sse;
pub mod token_bucket;

#[cfg(feature = "python")]
mod python;

#[cfg(feature = "python")]
pub use python::_core;

/// Request analysis: body-size pre-reject, OpenAI body fields, prompt token count, context check.
pub mod analyze;
