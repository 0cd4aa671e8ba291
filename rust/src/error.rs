//! Errors of the admission core.
//!
//! Only bad arguments, bad configuration and shared-memory failures are errors: a refused
//! admission is a value ([`crate::admission::Refusal`]), never an error.

use std::fmt;

/// The largest token or slot amount any call accepts (2**62). Anything larger is treated as an
/// absurd estimate and refused with [`CoreError::InvalidAmount`], so sums of amounts can never
/// overflow a `u64`.
pub const MAX_AMOUNT: u64 = 1 << 62;

/// Every error the core can report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// An amount (tokens or slots) is negative or larger than [`MAX_AMOUNT`].
    InvalidAmount {
        /// What the amount was for, e.g. `"tokens"`.
        what: &'static str,
        /// The value as given (may be negative or huge).
        value: i128,
    },
    /// A request asks for more than the limit can ever hold (e.g. more tokens than a whole
    /// bucket): it can never succeed, so it is not a "retry later".
    NeverAdmissible {
        /// The amount asked for.
        requested: u64,
        /// The largest amount the limit can ever grant.
        limit: u64,
    },
    /// A release of more than is held (the counter would go negative).
    OverRelease {
        /// The amount given back.
        requested: u64,
        /// The amount actually held at that moment.
        held: u64,
    },
    /// A configuration value or an identifier is invalid (unknown backend/tenant id, rate of
    /// zero, watermarks out of order, capacity of the fixed region exhausted, ...).
    InvalidConfig(String),
    /// Creating, opening or validating the shared-memory region failed.
    SharedState(String),
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::InvalidAmount { what, value } => write!(
                f,
                "invalid {what} amount {value}: must be an integer in 0..={MAX_AMOUNT}"
            ),
            CoreError::NeverAdmissible { requested, limit } => write!(
                f,
                "{requested} can never be admitted: the limit can hold at most {limit}"
            ),
            CoreError::OverRelease { requested, held } => {
                write!(f, "release of {requested} but only {held} held")
            }
            CoreError::InvalidConfig(msg) | CoreError::SharedState(msg) => f.write_str(msg),
        }
    }
}

impl std::error::Error for CoreError {}

/// Checks that `value` is a valid amount (`0..=MAX_AMOUNT`) and returns it as `u64`.
pub fn check_amount(what: &'static str, value: i128) -> Result<u64, CoreError> {
    if (0..=i128::from(MAX_AMOUNT)).contains(&value) {
        Ok(value as u64)
    } else {
        Err(CoreError::InvalidAmount { what, value })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amount_bounds() {
        assert_eq!(check_amount("tokens", 0), Ok(0));
        assert_eq!(
            check_amount("tokens", i128::from(MAX_AMOUNT)),
            Ok(MAX_AMOUNT)
        );
        assert!(check_amount("tokens", -1).is_err());
        assert!(check_amount("tokens", 1 << 63).is_err());
        let msg = check_amount("tokens", -5).unwrap_err().to_string();
        assert!(msg.contains("-5"), "{msg}");
    }
}
