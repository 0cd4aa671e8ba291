//! pyo3 binding of the routing stage's replica choice (`rust/src/admission/route.rs`):
//! `ReplicaSet`.

use std::collections::HashMap;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::controller::AdmissionController;

/// The replicas (backends) a model is served by, with what routing reads of each: whether it is
/// healthy and its last KV-cache usage (see `python/kvgate/_core.pyi`). Kept up to date by the
/// gateway as health checks and metrics arrive, so that a choice reads no Python object.
#[pyclass(name = "ReplicaSet", module = "kvgate")]
pub struct ReplicaSet {
    ids: Vec<u32>,
    healthy: Vec<bool>,
    kv: Vec<Option<f64>>,
    at: HashMap<u32, usize>,
    n_healthy: usize,
}

impl ReplicaSet {
    fn position(&self, backend: u32) -> PyResult<usize> {
        self.at.get(&backend).copied().ok_or_else(|| {
            PyValueError::new_err(format!("backend id {backend} is not in this replica set"))
        })
    }
}

#[pymethods]
impl ReplicaSet {
    #[new]
    fn new(backends: Vec<u32>) -> PyResult<Self> {
        let mut at = HashMap::with_capacity(backends.len());
        for (i, &id) in backends.iter().enumerate() {
            if at.insert(id, i).is_some() {
                return Err(PyValueError::new_err(format!(
                    "backend id {id} is twice in the replica set"
                )));
            }
        }
        let n = backends.len();
        Ok(Self {
            ids: backends,
            healthy: vec![true; n],
            kv: vec![None; n],
            at,
            n_healthy: n,
        })
    }

    fn __len__(&self) -> usize {
        self.ids.len()
    }

    #[getter]
    fn backends(&self) -> Vec<u32> {
        self.ids.clone()
    }

    #[getter]
    fn healthy(&self) -> usize {
        self.n_healthy
    }

    fn set_healthy(&mut self, backend: u32, healthy: bool) -> PyResult<()> {
        let i = self.position(backend)?;
        if self.healthy[i] != healthy {
            self.healthy[i] = healthy;
            if healthy {
                self.n_healthy += 1;
            } else {
                self.n_healthy -= 1;
            }
        }
        Ok(())
    }

    #[pyo3(signature = (backend, kv_usage))]
    fn set_kv_usage(&mut self, backend: u32, kv_usage: Option<f64>) -> PyResult<()> {
        let i = self.position(backend)?;
        if let Some(v) = kv_usage {
            if !v.is_finite() {
                return Err(PyValueError::new_err(format!(
                    "KV-cache usage {v} is not finite"
                )));
            }
        }
        self.kv[i] = kv_usage;
        Ok(())
    }

    fn most_headroom(&self, controller: &AdmissionController) -> PyResult<Option<usize>> {
        let healthy = (0..self.ids.len())
            .filter(|&i| self.healthy[i])
            .map(|i| (i, self.ids[i], self.kv[i]));
        Ok(controller.core.most_headroom(healthy)?)
    }

    fn __repr__(&self) -> String {
        format!(
            "ReplicaSet({} backends, {} healthy)",
            self.ids.len(),
            self.n_healthy
        )
    }
}

/// Adds `ReplicaSet` to the module.
pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ReplicaSet>()
}
