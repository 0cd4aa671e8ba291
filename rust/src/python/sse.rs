//! pyo3 binding of the SSE relay inspector (`rust/src/sse.rs`): `SSEInspector`.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use serde_json::Value;

use crate::sse::{Fed, SseInspector};

/// Cuts an upstream SSE byte stream into complete events and inspects each one (one per
/// streamed response; not shared between threads).
#[pyclass(name = "SSEInspector", module = "kvgate")]
pub struct PySseInspector {
    inner: SseInspector,
    /// The tokenizer count of a piece of delivered text (`str` → `int`), if any.
    count_text: Option<Py<PyAny>>,
    /// Tokens counted so far by `count_text`.
    counted: u64,
}

#[pymethods]
impl PySseInspector {
    #[new]
    #[pyo3(signature = (*, strip_usage_chunk, count_text=None, responses = false))]
    fn new(strip_usage_chunk: bool, count_text: Option<Py<PyAny>>, responses: bool) -> Self {
        let inner = if responses {
            SseInspector::new_responses()
        } else {
            SseInspector::new(strip_usage_chunk)
        };
        Self {
            inner,
            count_text,
            counted: 0,
        }
    }

    fn feed<'py>(&mut self, data: &Bound<'py, PyBytes>) -> PyResult<Bound<'py, PyBytes>> {
        let out = match self.inner.feed(data.as_bytes()) {
            Fed::Same => data.clone(),
            Fed::Bytes(out) => PyBytes::new(data.py(), &out),
        };
        self.count(data.py(), false)?;
        Ok(out)
    }

    #[getter]
    fn delivered_tokens(&mut self, py: Python<'_>) -> PyResult<u64> {
        self.count(py, true)?;
        Ok(self.counted)
    }

    fn flush<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.flush())
    }

    #[getter]
    fn usage<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        self.inner.usage().map(|v| to_py(py, v)).transpose()
    }

    #[getter]
    fn usage_tokens(&self) -> Option<(Option<u64>, Option<u64>)> {
        self.inner.usage_tokens()
    }

    #[getter]
    fn error<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        self.inner.error().map(|v| to_py(py, v)).transpose()
    }

    #[getter]
    fn done(&self) -> bool {
        self.inner.done()
    }

    /// Whether an event grew past 32 MiB before its end (the stream is broken off).
    #[getter]
    fn overlong(&self) -> bool {
        self.inner.overlong()
    }

    #[getter]
    fn delivered_text(&mut self) -> Vec<String> {
        self.inner.delivered_text()
    }

    #[getter]
    fn content_chunks(&mut self) -> u64 {
        self.inner.content_chunks()
    }
}

impl PySseInspector {
    /// Hands the delivered text the inspector holds past its bound (everything, with `all`)
    /// to `count_text` and adds up the counts; without `count_text` the text is dropped.
    fn count(&mut self, py: Python<'_>, all: bool) -> PyResult<()> {
        while let Some(piece) = self.inner.take_countable(all) {
            if let Some(count) = &self.count_text {
                let n: u64 = count.bind(py).call1((piece,))?.extract()?;
                self.counted = self.counted.saturating_add(n);
            }
            if all {
                break;
            }
        }
        Ok(())
    }
}

/// A JSON value as the Python object `json.loads` would give.
pub(super) fn to_py<'py>(py: Python<'py>, v: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any(),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                i.into_pyobject(py)?.into_any()
            } else if let Some(u) = n.as_u64() {
                u.into_pyobject(py)?.into_any()
            } else {
                n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any()
            }
        }
        Value::String(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_py(py, item)?)?;
            }
            list.into_any()
        }
        Value::Object(map) => {
            let dict = PyDict::new(py);
            for (k, item) in map {
                dict.set_item(k, to_py(py, item)?)?;
            }
            dict.into_any()
        }
    })
}

/// `(prompt_tokens, completion_tokens)` of a non-streamed response body's usage object.
#[pyfunction]
fn usage_tokens(body: &[u8]) -> Option<(Option<u64>, Option<u64>)> {
    crate::sse::body_usage_tokens(body)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("EVENT_LIMIT", crate::sse::EVENT_LIMIT)?;
    m.add(
        "RESPONSES_TEXT_EVENTS",
        PyTuple::new(m.py(), crate::sse::RESPONSES_TEXT_EVENTS)?,
    )?;
    m.add_class::<PySseInspector>()?;
    m.add_function(wrap_pyfunction!(usage_tokens, m)?)
}
