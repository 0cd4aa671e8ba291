//! Typed reads of OpenAI body fields, each failure an [`AnalysisError`] naming the field.

use serde_json::{Map, Value};

use super::error::AnalysisError;

/// A parsed JSON object body.
pub type Obj = Map<String, Value>;

/// Parses a request body that must be a JSON object.
///
/// serde_json refuses invalid UTF-8, lone surrogate escapes (`"\ud800"`) and nesting deeper
/// than 128 levels (its recursion limit), so none of those can reach the counting code.
pub fn parse_object(body: &[u8]) -> Result<Obj, AnalysisError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(other) => Err(AnalysisError::bad(
            None,
            "invalid_type",
            format!(
                "The request body must be a JSON object, but got {} instead.",
                super::error::json_kind(&other)
            ),
        )),
        Err(e) => Err(AnalysisError::invalid_json(e)),
    }
}

/// An optional integer field (`null` or absent → `None`) within `min..=max`. Only JSON integers
/// are accepted (`10`, not `10.0`, `1e3` or `"10"`), as in OpenAI's schema (`type: integer`).
pub fn opt_uint(obj: &Obj, key: &str, min: u64, max: u64) -> Result<Option<u64>, AnalysisError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Number(n)) => {
            if let Some(u) = n.as_u64() {
                if u < min {
                    Err(below_min(key, min, &u.to_string()))
                } else if u > max {
                    Err(AnalysisError::bad(
                        Some(key),
                        "integer_above_max_value",
                        format!(
                            "Invalid '{key}': integer above maximum value. Expected a value <= \
                             {max}, but got {u} instead."
                        ),
                    ))
                } else {
                    Ok(Some(u))
                }
            } else if let Some(i) = n.as_i64() {
                Err(below_min(key, min, &i.to_string()))
            } else {
                Err(AnalysisError::invalid_type(key, "an integer", v))
            }
        }
        Some(v) => Err(AnalysisError::invalid_type(key, "an integer", v)),
    }
}

#[cold]
fn below_min(key: &str, min: u64, got: &str) -> AnalysisError {
    AnalysisError::bad(
        Some(key),
        "integer_below_min_value",
        format!(
            "Invalid '{key}': integer below minimum value. Expected a value >= {min}, but got \
             {got} instead."
        ),
    )
}

/// An optional boolean field (`null` or absent → `None`).
pub fn opt_bool(obj: &Obj, key: &str, param: &str) -> Result<Option<bool>, AnalysisError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(AnalysisError::invalid_type(param, "a boolean", v)),
    }
}

/// A required string field (`null` counts as the wrong type, absent as missing).
pub fn req_str<'a>(obj: &'a Obj, key: &str, param: &str) -> Result<&'a str, AnalysisError> {
    match obj.get(key) {
        None => Err(AnalysisError::missing(param)),
        Some(Value::String(s)) => Ok(s),
        Some(v) => Err(AnalysisError::invalid_type(param, "a string", v)),
    }
}

/// An optional string field (`null` or absent → `None`).
pub fn opt_str<'a>(obj: &'a Obj, key: &str, param: &str) -> Result<Option<&'a str>, AnalysisError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(AnalysisError::invalid_type(param, "a string", v)),
    }
}

/// An optional array field (`null` or absent → `None`).
pub fn opt_array<'a>(
    obj: &'a Obj,
    key: &str,
    param: &str,
) -> Result<Option<&'a Vec<Value>>, AnalysisError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(v) => Err(AnalysisError::invalid_type(param, "an array", v)),
    }
}

/// Compact JSON text of a value (serde_json's `to_string`: `,` / `:` separators, non-ASCII kept,
/// object keys in body order), the form in which tool definitions and tool calls are counted.
pub fn compact(v: &Value) -> String {
    serde_json::to_string(v).unwrap_or_default()
}
