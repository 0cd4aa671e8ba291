//! The adaptive control law: from an engine's KV-cache usage ratio and its waiting requests to a
//! scale factor for the backend's limits.
//!
//! * pressure `p` = KV-cache usage ratio (0..1), e.g. vLLM's `vllm:kv_cache_usage_perc`;
//!   when the engine's waiting requests (`vllm:num_requests_waiting`) exceed
//!   `waiting_threshold`, `p` is raised to the high watermark;
//! * `p >= high` → `floor`; `p <= low` → 1.0; linear in between;
//! * a missing / stale reading (`None`) → `floor` (conservative, never "unlimited");
//! * decreases apply at once; increases are bounded to `recovery_per_second` per second of the
//!   clock (no snap back);
//! * shedding (of the `sheddable` class) turns on at `p >= high` and off only when `p < low`
//!   (hysteresis);
//! * the backend is overloaded while `p >= high` (or the reading is missing): only then does the
//!   scale bind the `critical` and `standard` classes too (between the watermarks it binds the
//!   `sheddable` class alone, so low-priority work gives way first).

use crate::error::CoreError;

/// Settings of the control law.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LawParams {
    /// High watermark (ratio 0..1), default 0.85.
    pub high: f64,
    /// Low watermark (ratio 0..1, < high), default 0.70.
    pub low: f64,
    /// Scale at and above the high watermark (0 < floor <= 1), default 0.6.
    pub floor: f64,
    /// Largest increase of the scale per second, default 0.05 (floor → 1.0 in 8 s).
    pub recovery_per_second: f64,
    /// Waiting requests above this count as pressure at the high watermark; default 8.
    pub waiting_threshold: u64,
}

impl Default for LawParams {
    fn default() -> Self {
        Self {
            high: 0.85,
            low: 0.70,
            floor: 0.6,
            recovery_per_second: 0.05,
            waiting_threshold: 8,
        }
    }
}

impl LawParams {
    /// Checks `0 <= low < high <= 1`, `0 < floor <= 1`, `recovery_per_second > 0`, all finite.
    pub fn validate(&self) -> Result<(), CoreError> {
        let ok = self.high.is_finite()
            && self.low.is_finite()
            && self.floor.is_finite()
            && self.recovery_per_second.is_finite()
            && 0.0 <= self.low
            && self.low < self.high
            && self.high <= 1.0
            && 0.0 < self.floor
            && self.floor <= 1.0
            && self.recovery_per_second > 0.0;
        if ok {
            Ok(())
        } else {
            Err(CoreError::InvalidConfig(format!(
                "adaptive law needs 0 <= low < high <= 1, 0 < floor <= 1, recovery_per_second > 0 \
                 (got high={}, low={}, floor={}, recovery_per_second={})",
                self.high, self.low, self.floor, self.recovery_per_second
            )))
        }
    }
}

/// Validates a KV-cache usage ratio: `None` or a finite value in 0..=1.
pub fn check_usage(kv_usage: Option<f64>) -> Result<Option<f64>, CoreError> {
    match kv_usage {
        Some(u) if !(0.0..=1.0).contains(&u) => Err(CoreError::InvalidConfig(format!(
            "kv_usage must be a ratio in [0, 1] (got {u})"
        ))),
        other => Ok(other),
    }
}

/// The control law with its state (current scale, shedding flag, time of the last update).
#[derive(Debug, Clone)]
pub struct AdaptiveLaw {
    params: LawParams,
    scale: f64,
    shedding: bool,
    overloaded: bool,
    last_ns: Option<u64>,
}

impl AdaptiveLaw {
    /// A law at scale 1.0, not shedding.
    pub fn new(params: LawParams) -> Result<Self, CoreError> {
        params.validate()?;
        Ok(Self {
            params,
            scale: 1.0,
            shedding: false,
            overloaded: false,
            last_ns: None,
        })
    }

    /// The settings.
    pub fn params(&self) -> LawParams {
        self.params
    }

    /// The current scale (floor..=1).
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Whether the sheddable class is being shed.
    pub fn shedding(&self) -> bool {
        self.shedding
    }

    /// Whether the last reading was at or above the high watermark, or missing: the scale then
    /// binds every class, not only `sheddable`.
    pub fn overloaded(&self) -> bool {
        self.overloaded
    }

    /// The pressure for a reading; `None` for a missing reading.
    fn pressure(&self, kv_usage: Option<f64>, waiting: u64) -> Option<f64> {
        let p = kv_usage?;
        if waiting > self.params.waiting_threshold {
            Some(p.max(self.params.high))
        } else {
            Some(p)
        }
    }

    /// The scale the law aims at for this reading (pure; no smoothing).
    pub fn target(&self, kv_usage: Option<f64>, waiting: u64) -> Result<f64, CoreError> {
        let kv = check_usage(kv_usage)?;
        let LawParams {
            high, low, floor, ..
        } = self.params;
        Ok(match self.pressure(kv, waiting) {
            None => floor,
            Some(p) if p >= high => floor,
            Some(p) if p <= low => 1.0,
            Some(p) => 1.0 - (p - low) / (high - low) * (1.0 - floor),
        })
    }

    /// Feeds one reading taken at `now_ns`; returns the new scale. Decreases apply at once,
    /// increases by at most `recovery_per_second` × seconds since the previous update.
    pub fn update(
        &mut self,
        kv_usage: Option<f64>,
        waiting: u64,
        now_ns: u64,
    ) -> Result<f64, CoreError> {
        let target = self.target(kv_usage, waiting)?;
        let dt = self
            .last_ns
            .map_or(0.0, |last| now_ns.saturating_sub(last) as f64 / 1e9);
        self.last_ns = Some(now_ns);
        if target <= self.scale {
            self.scale = target;
        } else {
            self.scale = (self.scale + self.params.recovery_per_second * dt).min(target);
        }
        let pressure = self.pressure(kv_usage, waiting);
        self.overloaded = pressure.map_or(true, |p| p >= self.params.high);
        match pressure {
            None => self.shedding = true,
            Some(p) if p >= self.params.high => self.shedding = true,
            Some(p) if p < self.params.low => self.shedding = false,
            Some(_) => {}
        }
        Ok(self.scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn law() -> AdaptiveLaw {
        AdaptiveLaw::new(LawParams::default()).unwrap()
    }

    #[test]
    fn target_shape() {
        let l = law();
        assert!((l.target(Some(0.9), 0).unwrap() - 0.6).abs() < 1e-12);
        assert!((l.target(Some(0.85), 0).unwrap() - 0.6).abs() < 1e-12);
        assert!((l.target(Some(0.5), 0).unwrap() - 1.0).abs() < 1e-12);
        assert!((l.target(Some(0.775), 0).unwrap() - 0.8).abs() < 1e-9);
        assert!((l.target(None, 0).unwrap() - 0.6).abs() < 1e-12);
        assert!((l.target(Some(0.1), 9).unwrap() - 0.6).abs() < 1e-12);
        assert!((l.target(Some(0.1), 8).unwrap() - 1.0).abs() < 1e-12);
        assert!(l.target(Some(1.5), 0).is_err());
        assert!(l.target(Some(f64::NAN), 0).is_err());
    }

    #[test]
    fn drop_is_immediate_recovery_bounded_and_shedding_has_hysteresis() {
        let mut l = law();
        assert!((l.update(Some(0.95), 0, 0).unwrap() - 0.6).abs() < 1e-12);
        assert!(l.shedding());
        // Pressure gone: recover 0.05 per second.
        assert!((l.update(Some(0.1), 0, S).unwrap() - 0.65).abs() < 1e-9);
        assert!(!l.shedding());
        assert!((l.update(Some(0.1), 0, 3 * S).unwrap() - 0.75).abs() < 1e-9);
        assert!((l.update(Some(0.1), 0, 100 * S).unwrap() - 1.0).abs() < 1e-12);
        // Into the band: shedding on only at high, off only below low.
        l.update(Some(0.86), 0, 101 * S).unwrap();
        assert!(l.shedding());
        assert!(l.overloaded());
        l.update(Some(0.75), 0, 102 * S).unwrap();
        assert!(l.shedding());
        // overload has no hysteresis: only the sheddable class feels the band
        assert!(!l.overloaded());
        l.update(Some(0.69), 0, 103 * S).unwrap();
        assert!(!l.shedding());
        l.update(None, 0, 104 * S).unwrap();
        assert!(l.overloaded() && l.shedding());
    }

    #[test]
    fn rejects_bad_params() {
        let p = LawParams {
            low: 0.9,
            ..LawParams::default()
        };
        assert!(AdaptiveLaw::new(p).is_err());
        let p = LawParams {
            floor: 0.0,
            ..LawParams::default()
        };
        assert!(AdaptiveLaw::new(p).is_err());
    }
}
