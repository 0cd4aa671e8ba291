//! pyo3 binding of the stream assembler (`rust/src/assemble.rs`): `StreamAssembler`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use serde_json::Value;

use super::sse::to_py;
use crate::assemble::{Kind, StreamAssembler};

/// Rebuilds the non-streamed answer of one request from the SSE stream the engine sent instead
/// (one per request; not shared between threads).
#[pyclass(name = "StreamAssembler", module = "kvgate")]
pub struct PyStreamAssembler {
    inner: StreamAssembler,
}

#[pymethods]
impl PyStreamAssembler {
    #[new]
    fn new(kind: &str) -> PyResult<Self> {
        let kind = match kind {
            "chat" => Kind::Chat,
            "completions" => Kind::Completions,
            "responses" => Kind::Responses,
            other => {
                return Err(PyValueError::new_err(format!(
                    "stream kind {other:?}: expected 'chat', 'completions' or 'responses'"
                )))
            }
        };
        Ok(Self {
            inner: StreamAssembler::new(kind),
        })
    }

    fn feed(&mut self, data: &Bound<'_, PyBytes>) {
        self.inner.feed(data.as_bytes());
    }

    fn finish(&mut self) {
        self.inner.finish();
    }

    #[getter]
    fn complete(&self) -> bool {
        self.inner.complete()
    }

    #[getter]
    fn overlong(&self) -> bool {
        self.inner.overlong()
    }

    #[getter]
    fn all_finished(&self) -> bool {
        self.inner.all_finished()
    }

    #[getter]
    fn error<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self.inner.error() {
            None => Ok(None),
            Some(err) => {
                let obj = to_py(py, &Value::Object(err.clone()))?;
                Ok(Some(obj.cast_into::<PyDict>()?))
            }
        }
    }

    fn answer<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let raw = serde_json::to_vec(&self.inner.answer())
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(PyBytes::new(py, &raw))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStreamAssembler>()
}
