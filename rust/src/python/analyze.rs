//! pyo3 bindings of the request analyser (`rust/src/analyze/`): `RequestAnalyzer`,
//! `ModelRegistry`, `Analysis`, `AnalysisError`, `check_content_length`, `peek_model`.
//!
//! Analysis of a body of 1 KiB or more runs with the GIL released (`py.detach`), following
//! tokenizers' `encode_batch`: extract → detach → compute → convert. Any panic inside is caught
//! here and raised as a 500 `AnalysisError`, so none crosses into Python.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyPermissionError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::analyze::{
    self, AnalysisError, AnalyzerConfig, ChatTemplate, Counter, ModelRegistry, RequestAnalyzer,
};
use crate::python::py_repr;

/// Bodies below this many bytes are analysed without releasing the GIL (detaching would cost
/// more than the work).
const DETACH_MIN_BYTES: usize = 1024;

/// The OpenAI-shaped refusal raised by the analyser (a `ValueError`).
#[pyclass(name = "AnalysisError", extends = PyValueError, module = "kvgate._core", subclass, frozen)]
pub struct PyAnalysisError {
    #[pyo3(get)]
    status: u16,
    #[pyo3(get, name = "type")]
    kind: String,
    #[pyo3(get)]
    param: Option<String>,
    #[pyo3(get)]
    code: Option<String>,
    #[pyo3(get)]
    message: String,
}

#[pymethods]
impl PyAnalysisError {
    #[new]
    #[pyo3(signature = (message, status = 400, r#type = "invalid_request_error".to_owned(), param = None, code = None, /))]
    fn new(
        message: String,
        status: u16,
        r#type: String,
        param: Option<String>,
        code: Option<String>,
    ) -> Self {
        Self {
            status,
            kind: r#type,
            param,
            code,
            message,
        }
    }

    /// `{"error": {"message", "type", "param", "code"}}` as a dict.
    fn body<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let inner = PyDict::new(py);
        inner.set_item("message", &self.message)?;
        inner.set_item("type", &self.kind)?;
        inner.set_item("param", &self.param)?;
        inner.set_item("code", &self.code)?;
        let outer = PyDict::new(py);
        outer.set_item("error", inner)?;
        Ok(outer)
    }

    /// The same body as compact JSON bytes.
    fn to_json<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let body = serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        });
        PyBytes::new(py, &serde_json::to_vec(&body).unwrap_or_default())
    }

    fn __str__(&self) -> String {
        self.message.clone()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "AnalysisError(status={}, type={}, param={}, code={}, message={})",
            self.status,
            py_repr(py, &self.kind)?,
            py_repr(py, &self.param)?,
            py_repr(py, &self.code)?,
            py_repr(py, &self.message)?
        ))
    }
}

fn raise(py: Python<'_>, e: AnalysisError) -> PyErr {
    let obj = PyAnalysisError {
        status: e.status,
        kind: e.kind.to_owned(),
        param: e.param,
        code: e.code.map(str::to_owned),
        message: e.message,
    };
    match Py::new(py, obj) {
        Ok(o) => PyErr::from_value(o.into_bound(py).into_any()),
        Err(err) => err,
    }
}

/// Runs `f`, turning a panic into a 500 `AnalysisError`.
fn guarded<T>(f: impl FnOnce() -> Result<T, AnalysisError>) -> Result<T, AnalysisError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let what = p
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(AnalysisError::internal(format!(
            "internal error in request analysis: {what}"
        )))
    })
}

fn run<T: Send>(
    py: Python<'_>,
    body_len: usize,
    f: impl FnOnce() -> Result<T, AnalysisError> + Send,
) -> PyResult<T> {
    let res = if body_len >= DETACH_MIN_BYTES {
        py.detach(|| guarded(f))
    } else {
        guarded(f)
    };
    res.map_err(|e| raise(py, e))
}

/// What a request costs (see `kvgate._core.pyi`).
#[pyclass(name = "Analysis", module = "kvgate._core", frozen, get_all, eq)]
#[derive(PartialEq)]
pub struct PyAnalysis {
    model: String,
    route: &'static str,
    prompt_tokens: u64,
    completion_tokens: u64,
    n: u64,
    stream: bool,
    include_usage: bool,
    addable: bool,
    reserved_tokens: u64,
    inject_max_tokens: Option<u64>,
    counting: &'static str,
    drop_cap: Option<&'static str>,
}

impl From<analyze::Analysis> for PyAnalysis {
    fn from(a: analyze::Analysis) -> Self {
        Self {
            model: a.model,
            route: a.route.as_str(),
            prompt_tokens: a.prompt_tokens,
            completion_tokens: a.completion_tokens,
            n: a.n,
            stream: a.stream,
            include_usage: a.include_usage,
            addable: a.addable,
            reserved_tokens: a.reserved_tokens,
            inject_max_tokens: a.inject_max_tokens,
            counting: a.counting.as_str(),
            drop_cap: a.drop_cap,
        }
    }
}

#[pymethods]
impl PyAnalysis {
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Analysis(model={}, route={}, prompt_tokens={}, completion_tokens={}, n={}, \
             stream={}, include_usage={}, addable={}, reserved_tokens={}, inject_max_tokens={}, \
             counting={}, drop_cap={})",
            py_repr(py, &self.model)?,
            py_repr(py, self.route)?,
            self.prompt_tokens,
            self.completion_tokens,
            self.n,
            py_repr(py, self.stream)?,
            py_repr(py, self.include_usage)?,
            py_repr(py, self.addable)?,
            self.reserved_tokens,
            py_repr(py, self.inject_max_tokens)?,
            py_repr(py, self.counting)?,
            py_repr(py, self.drop_cap)?
        ))
    }
}

/// One model's request analyser (see `kvgate._core.pyi`).
#[pyclass(name = "RequestAnalyzer", module = "kvgate._core", frozen)]
pub struct PyRequestAnalyzer {
    inner: Arc<RequestAnalyzer>,
}

/// A file's text; the error (`FileNotFoundError`, `PermissionError`, else `OSError`) names
/// what the file is for and its path.
fn read(what: &str, path: &str) -> PyResult<String> {
    std::fs::read_to_string(path).map_err(|e| {
        let msg = format!("cannot read {what} {path}: {e}");
        match e.kind() {
            std::io::ErrorKind::NotFound => PyFileNotFoundError::new_err(msg),
            std::io::ErrorKind::PermissionDenied => PyPermissionError::new_err(msg),
            _ => PyOSError::new_err(msg),
        }
    })
}

#[pymethods]
impl PyRequestAnalyzer {
    #[new]
    #[pyo3(signature = (
        *, model, context_window, tokenizer_path = None, tokenizer_json = None,
        chat_template = None, tokenizer_config_path = None, per_message_overhead = 4,
        image_tokens = 765, audio_tokens = 200, default_max_tokens = None,
        max_body_bytes = analyze::DEFAULT_MAX_BODY_BYTES, chat_template_path = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: String,
        context_window: u64,
        tokenizer_path: Option<String>,
        tokenizer_json: Option<String>,
        chat_template: Option<String>,
        tokenizer_config_path: Option<String>,
        per_message_overhead: u64,
        image_tokens: u64,
        audio_tokens: u64,
        default_max_tokens: Option<u64>,
        max_body_bytes: u64,
        chat_template_path: Option<String>,
    ) -> PyResult<Self> {
        let tok_text = match (tokenizer_path, tokenizer_json) {
            (Some(_), Some(_)) => {
                return Err(PyValueError::new_err(
                    "give tokenizer_path or tokenizer_json, not both",
                ))
            }
            (Some(p), None) => Some(read("tokenizer_path", &p)?),
            (None, t) => t,
        };
        let cfg_text = tokenizer_config_path
            .as_deref()
            .map(|p| read("tokenizer_config_path", p))
            .transpose()?;
        let template_override: Option<(String, String)> = match (chat_template, chat_template_path)
        {
            (Some(_), Some(_)) => {
                return Err(PyValueError::new_err(
                    "give chat_template or chat_template_path, not both",
                ))
            }
            (Some(t), None) => Some(("chat_template".to_owned(), t)),
            (None, Some(p)) => {
                let text = read("chat_template_path", &p)?;
                Some((p, text))
            }
            (None, None) => None,
        };
        let cfg_name = tokenizer_config_path.unwrap_or_default();
        let cfg = AnalyzerConfig {
            model,
            context_window,
            per_message_overhead,
            image_tokens,
            audio_tokens,
            default_max_tokens,
            max_body_bytes,
        };
        let built = py.detach(move || -> Result<RequestAnalyzer, String> {
            let counter = match tok_text {
                Some(t) => Counter::from_json(&t)?,
                None => Counter::Estimate,
            };
            let template = ChatTemplate::from_tokenizer_config_named(
                cfg_text.as_deref(),
                &cfg_name,
                template_override
                    .as_ref()
                    .map(|(name, text)| (name.as_str(), text.as_str())),
            )?;
            if let Some(t) = &template {
                t.check()?;
            }
            RequestAnalyzer::new(cfg, counter, template)
        });
        built
            .map(|a| Self { inner: Arc::new(a) })
            .map_err(PyValueError::new_err)
    }

    /// Analyse a request body; raises `AnalysisError`.
    fn analyze(&self, py: Python<'_>, route: &str, body: &[u8]) -> PyResult<PyAnalysis> {
        let inner = &self.inner;
        run(py, body.len(), || inner.analyze(route, body)).map(PyAnalysis::from)
    }

    #[getter]
    fn model(&self) -> &str {
        &self.inner.config().model
    }

    #[getter]
    fn context_window(&self) -> u64 {
        self.inner.config().context_window
    }

    #[getter]
    fn max_body_bytes(&self) -> u64 {
        self.inner.config().max_body_bytes
    }

    #[getter]
    fn default_max_tokens(&self) -> Option<u64> {
        self.inner.config().default_max_tokens
    }

    #[getter]
    fn has_chat_template(&self) -> bool {
        self.inner.has_chat_template()
    }

    #[getter]
    fn has_tokenizer(&self) -> bool {
        self.inner.has_tokenizer()
    }

    /// Tokens in generated text (no special tokens); raises `AnalysisError` (500) if the
    /// tokenizer fails.
    fn count_tokens(&self, py: Python<'_>, text: &str) -> PyResult<u64> {
        let inner = &self.inner;
        run(py, text.len(), || inner.count_text(text))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let c = self.inner.config();
        Ok(format!(
            "RequestAnalyzer(model={}, context_window={}, tokenizer={}, chat_template={})",
            py_repr(py, &c.model)?,
            c.context_window,
            py_repr(py, self.inner.has_tokenizer())?,
            py_repr(py, self.inner.has_chat_template())?
        ))
    }
}

/// Analysers of several models, picked by the body's `model` (see `kvgate._core.pyi`).
#[pyclass(name = "ModelRegistry", module = "kvgate._core", frozen)]
pub struct PyModelRegistry {
    inner: ModelRegistry,
    py_analyzers: Vec<Py<PyRequestAnalyzer>>,
}

#[pymethods]
impl PyModelRegistry {
    #[new]
    fn new(analyzers: Vec<Py<PyRequestAnalyzer>>) -> PyResult<Self> {
        let mut inner = ModelRegistry::new();
        for a in &analyzers {
            let a = a.get();
            if inner.get(&a.inner.config().model).is_some() {
                return Err(PyValueError::new_err(format!(
                    "two analysers for model {:?}",
                    a.inner.config().model
                )));
            }
            inner.insert(a.inner.clone());
        }
        Ok(Self {
            inner,
            py_analyzers: analyzers,
        })
    }

    /// Analyse a request body with the analyser of its `model`; raises `AnalysisError`.
    fn analyze(&self, py: Python<'_>, route: &str, body: &[u8]) -> PyResult<PyAnalysis> {
        let inner = &self.inner;
        run(py, body.len(), || inner.analyze(route, body)).map(PyAnalysis::from)
    }

    /// The analyser for `model`, or None.
    fn get(&self, py: Python<'_>, model: &str) -> Option<Py<PyRequestAnalyzer>> {
        self.py_analyzers
            .iter()
            .find(|a| a.get().inner.config().model == model)
            .map(|a| a.clone_ref(py))
    }

    /// Model names, sorted.
    fn models(&self) -> Vec<String> {
        self.inner.models()
    }

    #[getter]
    fn max_body_bytes(&self) -> u64 {
        self.inner.max_body_bytes()
    }

    fn __len__(&self) -> usize {
        self.py_analyzers.len()
    }

    fn __contains__(&self, model: &str) -> bool {
        self.inner.get(model).is_some()
    }
}

/// Raise the 413 `AnalysisError` when `content_length` is over `max_body_bytes`.
#[pyfunction]
#[pyo3(signature = (content_length, max_body_bytes))]
fn check_content_length(
    py: Python<'_>,
    content_length: Option<u64>,
    max_body_bytes: u64,
) -> PyResult<()> {
    analyze::check_content_length(content_length, max_body_bytes).map_err(|e| raise(py, e))
}

/// The body's `model`; raises `AnalysisError` (400) when it is missing or the body is not JSON.
#[pyfunction]
fn peek_model(py: Python<'_>, body: &[u8]) -> PyResult<String> {
    run(py, body.len(), || analyze::peek_model(body))
}

/// Adds the request-analysis classes and functions to `kvgate._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyAnalysisError>()?;
    m.add_class::<PyAnalysis>()?;
    m.add_class::<PyRequestAnalyzer>()?;
    m.add_class::<PyModelRegistry>()?;
    m.add_function(wrap_pyfunction!(check_content_length, m)?)?;
    m.add_function(wrap_pyfunction!(peek_model, m)?)?;
    Ok(())
}
