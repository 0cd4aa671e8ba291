//! pyo3 binding of the store's quota ledger (`rust/src/quota_ledger.rs`): `QuotaLedger`.

use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;

use crate::quota_ledger::{Alternative, HoldParts, LedgerError, Part, QuotaLedger};

fn err(e: LedgerError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// One part of a plan as Python gives it: (scope, [(counts tokens, [pool, ...]), ...],
/// [bucket, ...]).
type PartSpec = (u32, Vec<(bool, Vec<u32>)>, Vec<u32>);

/// A replica's quotas in a shared store, and the admissions taken from them without a call to
/// the store (see `python/kvgate/_core.pyi`). Used from one event loop.
#[pyclass(name = "QuotaLedger", module = "kvgate")]
pub struct PyQuotaLedger {
    inner: QuotaLedger,
    on_kick: Option<Py<PyAny>>,
    on_active: Option<Py<PyAny>>,
}

impl PyQuotaLedger {
    /// Calls `on_active` for each scope that became active and `on_kick` for each scope to
    /// tell the store about, after the ledger's borrow is given back (the callbacks may read
    /// the ledger).
    fn dispatch(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let (active, kicks, on_active, on_kick) = {
            let mut me = slf.borrow_mut();
            if !me.inner.has_events() {
                return Ok(());
            }
            (
                me.inner.take_activated(),
                me.inner.take_kicks(),
                me.on_active.as_ref().map(|c| c.clone_ref(py)),
                me.on_kick.as_ref().map(|c| c.clone_ref(py)),
            )
        };
        if let Some(cb) = on_active {
            for s in active {
                cb.call1(py, (s,))?;
            }
        }
        if let Some(cb) = on_kick {
            for s in kicks {
                cb.call1(py, (s,))?;
            }
        }
        Ok(())
    }
}

#[pymethods]
impl PyQuotaLedger {
    #[new]
    #[pyo3(signature = (chunk_fraction, *, on_kick=None, on_active=None))]
    fn new(
        chunk_fraction: f64,
        on_kick: Option<Py<PyAny>>,
        on_active: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        if !(chunk_fraction.is_finite() && (0.0..=1.0).contains(&chunk_fraction)) {
            return Err(PyValueError::new_err(format!(
                "chunk_fraction must be a ratio in [0, 1] (got {chunk_fraction})"
            )));
        }
        Ok(Self {
            inner: QuotaLedger::new(chunk_fraction),
            on_kick,
            on_active,
        })
    }

    fn add_scope(&mut self) -> u32 {
        self.inner.add_scope()
    }

    fn add_pool(&mut self, scope: u32, base: i64) -> PyResult<u32> {
        self.inner.add_pool(scope, base).map_err(err)
    }

    fn add_bucket(&mut self, scope: u32, burst: i64) -> PyResult<u32> {
        self.inner.add_bucket(scope, burst).map_err(err)
    }

    #[pyo3(signature = (parts, key=None))]
    fn add_plan(&mut self, parts: Vec<PartSpec>, key: Option<u64>) -> PyResult<u32> {
        let parts = parts
            .into_iter()
            .map(|(scope, alts, buckets)| Part {
                scope,
                alts: alts
                    .into_iter()
                    .map(|(counts_tokens, pools)| Alternative {
                        counts_tokens,
                        pools,
                    })
                    .collect(),
                buckets,
            })
            .collect::<Vec<_>>();
        self.inner.add_plan(&parts, key).map_err(err)
    }

    fn clear_plans(&mut self) {
        self.inner.clear_plans();
    }

    fn pool_get(&self, pool: u32, field: u8) -> PyResult<i64> {
        self.inner.pool_get(pool, field).map_err(err)
    }

    fn pool_set(&mut self, pool: u32, field: u8, value: i64) -> PyResult<()> {
        self.inner.pool_set(pool, field, value).map_err(err)
    }

    fn bucket_get(&self, bucket: u32, field: u8) -> PyResult<i64> {
        self.inner.bucket_get(bucket, field).map_err(err)
    }

    fn bucket_set(&mut self, bucket: u32, field: u8, value: i64) -> PyResult<()> {
        self.inner.bucket_set(bucket, field, value).map_err(err)
    }

    fn pool_take(&mut self, pool: u32, n: i64) -> PyResult<bool> {
        self.inner.pool_take(pool, n).map_err(err)
    }

    fn pool_gives_back(&self, pool: u32) -> PyResult<bool> {
        self.inner.pool_gives_back(pool).map_err(err)
    }

    fn pool_headroom(&self, pool: u32) -> PyResult<i64> {
        self.inner.pool_headroom(pool).map_err(err)
    }

    fn bucket_chunk_cap(&self, bucket: u32) -> PyResult<i64> {
        self.inner.bucket_chunk_cap(bucket).map_err(err)
    }

    fn bucket_first_chunk(&self, bucket: u32, tokens: i64) -> PyResult<i64> {
        self.inner.bucket_first_chunk(bucket, tokens).map_err(err)
    }

    fn scope_lease(&self, scope: u32) -> PyResult<f64> {
        Ok(self.inner.scope(scope).map_err(err)?.lease_until)
    }

    fn set_scope_lease(&mut self, scope: u32, until: f64) -> PyResult<()> {
        self.inner.scope_mut(scope).map_err(err)?.lease_until = until;
        Ok(())
    }

    fn scope_live(&self, scope: u32) -> PyResult<i64> {
        Ok(self.inner.scope(scope).map_err(err)?.live)
    }

    fn set_scope_live(&mut self, scope: u32, live: i64) -> PyResult<()> {
        self.inner.scope_mut(scope).map_err(err)?.live = live;
        Ok(())
    }

    fn set_active(&mut self, scope: u32, active: bool) -> PyResult<()> {
        self.inner.scope_mut(scope).map_err(err)?.active = active;
        Ok(())
    }

    fn try_admit(slf: &Bound<'_, Self>, plan: u32, tokens: i64, now: f64) -> PyResult<Option<u64>> {
        let got = slf
            .borrow_mut()
            .inner
            .try_admit(plan, tokens, now)
            .map_err(err)?;
        Self::dispatch(slf)?;
        Ok(got)
    }

    fn try_admit_key(
        slf: &Bound<'_, Self>,
        key: u64,
        tokens: i64,
        now: f64,
    ) -> PyResult<Option<u64>> {
        let got = match slf.borrow_mut().inner.try_admit_key(key, tokens, now) {
            Ok(got) => got,
            Err(LedgerError::NoPlan(key)) => return Err(PyKeyError::new_err(key)),
            Err(e) => return Err(err(e)),
        };
        Self::dispatch(slf)?;
        Ok(got)
    }

    fn release(slf: &Bound<'_, Self>, hold: u64, reserved: i64, actual: i64) -> PyResult<bool> {
        let done = slf.borrow_mut().inner.release(hold, reserved, actual);
        Self::dispatch(slf)?;
        Ok(done)
    }

    fn hold_parts(&self, hold: u64) -> Option<HoldParts> {
        self.inner.hold_parts(hold)
    }

    fn pools_in_use(&self, scope: u32) -> PyResult<Vec<(u32, i64)>> {
        self.inner.pools_in_use(scope).map_err(err)
    }

    #[getter]
    fn admissions(&self) -> i64 {
        self.inner.admissions
    }

    #[setter]
    fn set_admissions(&mut self, value: i64) {
        self.inner.admissions = value;
    }

    #[getter]
    fn warming(&self) -> bool {
        self.inner.warming()
    }

    #[setter]
    fn set_warming(&mut self, on: bool) {
        self.inner.set_warming(on);
    }
}

/// Adds `QuotaLedger` to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyQuotaLedger>()
}
