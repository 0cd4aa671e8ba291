//! Bindings of the answers serialized in Rust: `http_response`, `relay_http`, `go_duration`.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

/// Go's `time.Duration.String` of `seconds` (see [`crate::headers::go_duration_secs`]).
#[pyfunction]
pub(super) fn go_duration(seconds: f64) -> String {
    crate::headers::go_duration_secs(seconds)
}

/// A complete HTTP/1.1 response (see [`crate::headers::http_response`]) with today's `Date`.
#[pyfunction]
#[pyo3(signature = (status, headers, body, connection=None))]
pub(super) fn http_response<'py>(
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
pub(super) fn relay_bytes<'py>(
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
pub(super) fn relay_http<'py>(
    py: Python<'py>,
    status: u16,
    upstream_headers: &Bound<'py, PyAny>,
    body: Option<&[u8]>,
    connection: Option<&str>,
    chunked: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    relay_bytes(py, status, upstream_headers, &[], body, connection, chunked)
}
