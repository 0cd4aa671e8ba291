//! Priority classes (the Gateway API Inference Extension's terms).

use crate::error::CoreError;

/// A request's priority class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Priority {
    /// Online traffic that must not be shed (chat, code completion). May use its tenant's
    /// guaranteed slots and the burst pool.
    Critical = 0,
    /// Normal traffic. May use its tenant's guaranteed slots and the burst pool.
    Standard = 1,
    /// Offline / batch traffic. Uses only the burst pool, and is refused as a whole while the
    /// backend is shedding.
    Sheddable = 2,
}

impl Priority {
    /// Parses `"critical"`, `"standard"` or `"sheddable"`.
    pub fn parse(s: &str) -> Result<Self, CoreError> {
        match s {
            "critical" => Ok(Self::Critical),
            "standard" => Ok(Self::Standard),
            "sheddable" => Ok(Self::Sheddable),
            other => Err(CoreError::InvalidConfig(format!(
                "unknown priority class {other:?}: expected 'critical', 'standard' or 'sheddable'"
            ))),
        }
    }

    /// From the numeric code 0 (critical), 1 (standard), 2 (sheddable).
    pub fn from_code(code: u64) -> Result<Self, CoreError> {
        match code {
            0 => Ok(Self::Critical),
            1 => Ok(Self::Standard),
            2 => Ok(Self::Sheddable),
            other => Err(CoreError::InvalidConfig(format!(
                "unknown priority code {other}: expected 0 (critical), 1 (standard), 2 (sheddable)"
            ))),
        }
    }

    /// The class name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Critical => "critical",
            Self::Standard => "standard",
            Self::Sheddable => "sheddable",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        for p in [Priority::Critical, Priority::Standard, Priority::Sheddable] {
            assert_eq!(Priority::parse(p.as_str()).unwrap(), p);
            assert_eq!(Priority::from_code(p as u64).unwrap(), p);
        }
        assert!(Priority::parse("high").is_err());
        assert!(Priority::from_code(3).is_err());
    }
}
