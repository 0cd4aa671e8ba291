//! Bindings of the building blocks: `ManualClock`, `SlotPool`, `TokenBucket`, `AdaptiveLaw`.

use std::sync::Arc;

use pyo3::prelude::*;

use crate::adaptive::{AdaptiveLaw as RustLaw, LawParams};
use crate::clock::{Clock, ManualClock as RustManualClock};
use crate::slots::SlotCounter;
use crate::token_bucket::TokenBucket as RustBucket;

use super::convert::{amount, opt_amount, py_repr, secs};

/// A test clock that only moves when advanced.
#[pyclass(frozen, module = "kvgate")]
pub struct ManualClock {
    inner: Arc<RustManualClock>,
}

#[pymethods]
impl ManualClock {
    #[new]
    #[pyo3(signature = (start_ns=0))]
    fn new(start_ns: u64) -> Self {
        Self {
            inner: Arc::new(RustManualClock::new(start_ns)),
        }
    }

    fn advance(&self, seconds: f64) -> PyResult<()> {
        if !(seconds.is_finite() && seconds >= 0.0) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "seconds must be a finite number >= 0 (got {seconds})"
            )));
        }
        self.inner.advance_ns((seconds * 1e9).round() as u64);
        Ok(())
    }

    fn advance_ns(&self, ns: u64) {
        self.inner.advance_ns(ns);
    }

    #[getter]
    fn now_ns(&self) -> u64 {
        self.inner.now_ns()
    }

    fn __repr__(&self) -> String {
        format!("ManualClock(now_ns={})", self.inner.now_ns())
    }
}

/// A lock-free pool of concurrency slots.
#[pyclass(frozen, module = "kvgate")]
pub struct SlotPool {
    pub(super) c: SlotCounter,
}

#[pymethods]
impl SlotPool {
    #[new]
    #[pyo3(signature = (limit, *, clock=None))]
    fn new(limit: &Bound<'_, PyAny>, clock: Option<&Bound<'_, ManualClock>>) -> PyResult<Self> {
        let _ = clock; // slots do not depend on time; accepted for a uniform constructor.
        Ok(Self {
            c: SlotCounter::new(amount(limit, "limit")?),
        })
    }

    // `try_acquire(n=None)` and `release(n=None)` are hand-written CPython entry points,
    // installed on the type at module initialisation (`python/fast.rs`).

    #[getter]
    fn in_use(&self) -> u64 {
        self.c.in_use()
    }

    #[getter]
    fn limit(&self) -> u64 {
        self.c.limit()
    }

    #[setter]
    fn set_limit(&self, limit: &Bound<'_, PyAny>) -> PyResult<()> {
        self.c.set_limit(amount(limit, "limit")?);
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "SlotPool(in_use={}, limit={})",
            self.c.in_use(),
            self.c.limit()
        )
    }
}

/// A lock-free token bucket (tokens per minute) with reserve / reconcile.
///
/// Without a manual clock it reads the precise system clock (`CLOCK_MONOTONIC`, the clock of
/// `time.monotonic()`), not the controller's tick clock, so a `retry_after` waited out by
/// Python's clock finds the tokens (one reading per call is no cost for a standalone bucket).
#[pyclass(frozen, module = "kvgate")]
pub struct TokenBucket {
    b: RustBucket,
    clock: Clock,
}

#[pymethods]
impl TokenBucket {
    #[new]
    #[pyo3(signature = (tokens_per_minute, burst_tokens=None, *, clock=None))]
    fn new(
        tokens_per_minute: &Bound<'_, PyAny>,
        burst_tokens: Option<&Bound<'_, PyAny>>,
        clock: Option<&Bound<'_, ManualClock>>,
    ) -> PyResult<Self> {
        let rate = amount(tokens_per_minute, "tokens_per_minute")?;
        let burst = opt_amount(burst_tokens, "burst_tokens")?.unwrap_or(rate);
        Ok(Self {
            b: RustBucket::new(rate, burst)?,
            clock: clock_of(clock),
        })
    }

    fn try_reserve(&self, tokens: &Bound<'_, PyAny>) -> PyResult<bool> {
        let n = amount(tokens, "tokens")?;
        Ok(self.b.try_reserve(n, self.clock.precise_now_ns())?)
    }

    fn reconcile(&self, reserved: &Bound<'_, PyAny>, actual: &Bound<'_, PyAny>) -> PyResult<()> {
        let r = amount(reserved, "reserved")?;
        let a = amount(actual, "actual")?;
        let clock = &self.clock;
        self.b.reconcile_with(
            r,
            a,
            || clock.precise_now_ns(),
            self.b.rate(),
            self.b.burst(),
        );
        Ok(())
    }

    #[getter]
    fn available(&self) -> i64 {
        self.b.available(self.clock.precise_now_ns())
    }

    #[getter]
    fn tokens_per_minute(&self) -> u64 {
        self.b.rate()
    }

    #[setter]
    fn set_tokens_per_minute(&self, rate: &Bound<'_, PyAny>) -> PyResult<()> {
        let rate = amount(rate, "tokens_per_minute")?;
        Ok(self
            .b
            .set_params(rate, self.b.burst(), self.clock.precise_now_ns())?)
    }

    #[getter]
    fn burst_tokens(&self) -> u64 {
        self.b.burst()
    }

    fn retry_after(&self, tokens: &Bound<'_, PyAny>) -> PyResult<f64> {
        let n = amount(tokens, "tokens")?;
        Ok(secs(self.b.retry_after_ns(n, self.clock.precise_now_ns())?))
    }

    fn time_to_full(&self) -> f64 {
        secs(self.b.time_to_full_ns(self.clock.precise_now_ns()))
    }

    fn __repr__(&self) -> String {
        format!(
            "TokenBucket(tokens_per_minute={}, burst_tokens={}, available={})",
            self.b.rate(),
            self.b.burst(),
            self.b.available(self.clock.precise_now_ns())
        )
    }
}

/// The adaptive control law (KV-cache usage + waiting requests → scale).
#[pyclass(module = "kvgate")]
pub struct AdaptiveLaw {
    law: RustLaw,
    clock: Clock,
}

fn waiting_of(w: i64) -> PyResult<u64> {
    u64::try_from(w).map_err(|_| {
        pyo3::exceptions::PyValueError::new_err(format!("waiting must be >= 0 (got {w})"))
    })
}

#[pymethods]
impl AdaptiveLaw {
    #[new]
    #[pyo3(signature = (high=0.85, low=0.70, floor=0.6, recovery_per_second=0.05, waiting_threshold=8, *, clock=None))]
    fn new(
        high: f64,
        low: f64,
        floor: f64,
        recovery_per_second: f64,
        waiting_threshold: u64,
        clock: Option<&Bound<'_, ManualClock>>,
    ) -> PyResult<Self> {
        let params = LawParams {
            high,
            low,
            floor,
            recovery_per_second,
            waiting_threshold,
        };
        Ok(Self {
            law: RustLaw::new(params)?,
            clock: clock_of(clock),
        })
    }

    #[pyo3(signature = (kv_usage, waiting=0))]
    fn target(&self, kv_usage: Option<f64>, waiting: i64) -> PyResult<f64> {
        Ok(self.law.target(kv_usage, waiting_of(waiting)?)?)
    }

    #[pyo3(signature = (kv_usage, waiting=0))]
    fn update(&mut self, kv_usage: Option<f64>, waiting: i64) -> PyResult<f64> {
        // Once a poll: the precise clock, which the poller's own times (asyncio's loop) use.
        let now = self.clock.precise_now_ns();
        Ok(self.law.update(kv_usage, waiting_of(waiting)?, now)?)
    }

    #[getter]
    fn scale(&self) -> f64 {
        self.law.scale()
    }

    #[getter]
    fn shedding(&self) -> bool {
        self.law.shedding()
    }

    #[getter]
    fn overloaded(&self) -> bool {
        self.law.overloaded()
    }

    #[getter]
    fn high(&self) -> f64 {
        self.law.params().high
    }

    #[getter]
    fn low(&self) -> f64 {
        self.law.params().low
    }

    #[getter]
    fn floor(&self) -> f64 {
        self.law.params().floor
    }

    #[getter]
    fn recovery_per_second(&self) -> f64 {
        self.law.params().recovery_per_second
    }

    #[getter]
    fn waiting_threshold(&self) -> u64 {
        self.law.params().waiting_threshold
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "AdaptiveLaw(scale={}, shedding={})",
            py_repr(py, (self.law.scale() * 1000.0).round() / 1000.0)?,
            py_repr(py, self.law.shedding())?
        ))
    }
}

pub(super) fn clock_of(clock: Option<&Bound<'_, ManualClock>>) -> Clock {
    clock.map_or(Clock::Monotonic, |c| Clock::Manual(c.get().inner.clone()))
}
