//! Typed reads of OpenAI body fields, each failure an [`AnalysisError`] naming the field.

use serde_json::{Map, Value};

use super::error::AnalysisError;

/// A parsed JSON object body.
pub type Obj = Map<String, Value>;

/// Parses a request body that must be a JSON object.
///
/// serde_json refuses invalid UTF-8 and nesting deeper than 128 levels (its recursion limit),
/// so neither can reach the counting code. A lone UTF-16 surrogate escape (`"\ud800"` without
/// its pair), which Python's `json` and so vLLM accept, is read as U+FFFD, the replacement
/// character, and counted as such (see [`parse_lenient`]).
pub fn parse_object(body: &[u8]) -> Result<Obj, AnalysisError> {
    match parse_lenient::<Value>(body) {
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

/// `serde_json::from_slice`, except that lone surrogate escapes are read as `\ufffd`: when the
/// strict parse fails, a copy of the body with each lone `\uD800`–`\uDFFF` escape rewritten to
/// `\ufffd` (six bytes for six, so error positions are unchanged) is parsed instead. The
/// strict error is kept when the body has no lone surrogate. The happy path costs nothing.
///
/// # Errors
/// serde_json's error for a body that is not valid JSON.
pub fn parse_lenient<T: serde::de::DeserializeOwned>(body: &[u8]) -> serde_json::Result<T> {
    match serde_json::from_slice::<T>(body) {
        Ok(v) => Ok(v),
        Err(e) => match replace_lone_surrogates(body) {
            Some(fixed) => serde_json::from_slice(&fixed),
            None => Err(e),
        },
    }
}

/// A copy of `body` with every lone UTF-16 surrogate escape (a `\uD800`–`\uDBFF` not followed
/// by a `\uDC00`–`\uDFFF`, or a `\uDC00`–`\uDFFF` on its own) replaced by `\ufffd`; `None`
/// when there is none. Escapes are found by walking backslashes (`\\` is skipped as a pair),
/// which only occur inside strings in valid JSON.
pub fn replace_lone_surrogates(body: &[u8]) -> Option<Vec<u8>> {
    fn hex4(b: &[u8], at: usize) -> Option<u32> {
        let digits = b.get(at..at + 4)?;
        let text = std::str::from_utf8(digits).ok()?;
        u32::from_str_radix(text, 16).ok()
    }
    let is_escape_u = |at: usize| body.get(at) == Some(&b'\\') && body.get(at + 1) == Some(&b'u');
    let mut out: Option<Vec<u8>> = None;
    let mut i = 0;
    while let Some(off) = body
        .get(i..)
        .and_then(|rest| rest.iter().position(|&b| b == b'\\'))
    {
        let p = i + off;
        if body.get(p + 1) != Some(&b'u') {
            i = p + 2; // `\\`, `\"`, `\n`, ...: the escaped byte is not a backslash to read
            continue;
        }
        let lone = match hex4(body, p + 2) {
            Some(0xD800..=0xDBFF) => {
                let paired = is_escape_u(p + 6)
                    && hex4(body, p + 8).is_some_and(|lo| (0xDC00..=0xDFFF).contains(&lo));
                if paired {
                    i = p + 12;
                    continue;
                }
                true
            }
            Some(0xDC00..=0xDFFF) => true,
            _ => false,
        };
        if lone {
            out.get_or_insert_with(|| body.to_vec())[p..p + 6].copy_from_slice(b"\\ufffd");
        }
        i = p + 6;
    }
    out
}

/// An optional integer field (`null` or absent → `None`) within `min..=max`. Only JSON integers
/// are accepted (`10`, not `10.0`, `1e3` or `"10"`), as in OpenAI's schema (`type: integer`).
/// A number past the range is refused as out of range whatever its form: an integer too large
/// for 64 bits (`99999999999999999999999`, which the JSON parser can only read as a decimal)
/// or a decimal such as `1e30` gets `integer_above_max_value` naming `max`, not a type error.
pub fn opt_uint(obj: &Obj, key: &str, min: u64, max: u64) -> Result<Option<u64>, AnalysisError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Number(n)) => {
            if let Some(u) = n.as_u64() {
                if u < min {
                    Err(below_min(key, min, &u.to_string()))
                } else if u > max {
                    Err(above_max(key, max, &u.to_string()))
                } else {
                    Ok(Some(u))
                }
            } else if let Some(i) = n.as_i64() {
                Err(below_min(key, min, &i.to_string()))
            } else {
                match n.as_f64() {
                    #[allow(clippy::cast_precision_loss)] // a bound, compared approximately
                    Some(f) if f > max as f64 && f.fract() == 0.0 => {
                        Err(above_max(key, max, &n.to_string()))
                    }
                    #[allow(clippy::cast_precision_loss)]
                    Some(f) if f < min as f64 && f.fract() == 0.0 => {
                        Err(below_min(key, min, &n.to_string()))
                    }
                    _ => Err(AnalysisError::invalid_type(key, "an integer", v)),
                }
            }
        }
        Some(v) => Err(AnalysisError::invalid_type(key, "an integer", v)),
    }
}

#[cold]
fn above_max(key: &str, max: u64, got: &str) -> AnalysisError {
    AnalysisError::bad(
        Some(key),
        "integer_above_max_value",
        format!(
            "Invalid '{key}': integer above maximum value. Expected a value <= {max}, but got \
             {got} instead."
        ),
    )
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
