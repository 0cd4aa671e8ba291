//! Which of a model's replicas has the most headroom (the routing stage's choice), read from
//! the same atomics admission uses, so that a model served by a thousand replicas is routed
//! in microseconds rather than by a snapshot of each.

use std::sync::atomic::Ordering;

use super::{scaled, Admission};
use crate::error::CoreError;

impl Admission {
    /// The candidate with the most headroom: the largest free slot ratio
    /// `(limit - in_use) / limit` of its effective (scaled) concurrency limit (`limit` at least
    /// 1; negative when more are held than the scaled limit allows), then the lowest KV-cache
    /// usage (ratio 0..1; `None` counts as 0). Ties go to the earlier candidate.
    ///
    /// `candidates` are `(tag, backend id, KV-cache usage)`; returns the chosen one's tag, or
    /// `None` when there is none.
    ///
    /// Errors: [`CoreError::InvalidConfig`] for an id that is not a registered backend.
    pub fn most_headroom<T, I>(&self, candidates: I) -> Result<Option<T>, CoreError>
    where
        I: IntoIterator<Item = (T, u32, Option<f64>)>,
    {
        let mut best: Option<(T, f64, f64)> = None;
        for (tag, id, kv) in candidates {
            let b = self.backend(id)?;
            let ppm = b.scale_ppm.load(Ordering::Acquire);
            let limit = scaled(b.max_concurrency.load(Ordering::Acquire), ppm).max(1) as f64;
            let free = (limit - b.in_use.load(Ordering::Acquire) as f64) / limit;
            let kv = kv.unwrap_or(0.0);
            let better = match &best {
                None => true,
                // (as Python compares tuples: the free ratio, then the KV usage, exactly)
                Some((_, f, k)) => (free, -kv) > (*f, -*k),
            };
            if better {
                best = Some((tag, free, kv));
            }
        }
        Ok(best.map(|(tag, _, _)| tag))
    }
}
