//! OpenAI-shaped errors of the request analyser.
//!
//! Every refusal carries what the gateway needs to answer without further thought: the HTTP
//! status and the four keys of OpenAI's `Error` schema (`openai/openai-openapi` `openapi.yaml`,
//! schema `Error`: `message`, `type`, `param`, `code`; `param` and `code` may be null).

use std::fmt;

/// The `type` used for every client-side refusal (OpenAI's value for 400 / 404 / 413).
pub const INVALID_REQUEST: &str = "invalid_request_error";
/// The `type` used for an internal failure (a bug, never the client's fault).
pub const SERVER_ERROR: &str = "server_error";

/// A refused request: HTTP status plus OpenAI's error body fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnalysisError {
    /// HTTP status: 400 (bad body / context overflow), 404 (unknown model or route),
    /// 413 (body over the byte cap), 500 (internal failure).
    pub status: u16,
    /// OpenAI `type`: [`INVALID_REQUEST`] or [`SERVER_ERROR`].
    pub kind: &'static str,
    /// The offending body field (`"messages"`, `"max_tokens"`, `"messages[2].content"`), if any.
    pub param: Option<String>,
    /// Machine-readable code (`"context_length_exceeded"`, `"invalid_json"`, ...), if any.
    pub code: Option<&'static str>,
    /// Human-readable message.
    pub message: String,
}

impl AnalysisError {
    /// A 400 `invalid_request_error`.
    #[cold]
    pub fn bad(param: Option<&str>, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: 400,
            kind: INVALID_REQUEST,
            param: param.map(str::to_owned),
            code: Some(code),
            message: message.into(),
        }
    }

    /// 400 `invalid_json`: the body is not valid JSON (or not UTF-8, or nested too deep).
    #[cold]
    pub fn invalid_json(detail: impl fmt::Display) -> Self {
        Self::bad(
            None,
            "invalid_json",
            format!("We could not parse the JSON body of your request: {detail}. Send a valid JSON object."),
        )
    }

    /// 400 `invalid_type`: a field has the wrong JSON type.
    #[cold]
    pub fn invalid_type(param: &str, expected: &str, got: &serde_json::Value) -> Self {
        Self::bad(
            Some(param),
            "invalid_type",
            format!(
                "Invalid type for '{param}': expected {expected}, but got {} instead.",
                json_kind(got)
            ),
        )
    }

    /// 400 `missing_required_parameter`.
    #[cold]
    pub fn missing(param: &str) -> Self {
        Self::bad(
            Some(param),
            "missing_required_parameter",
            format!("Missing required parameter: '{param}'."),
        )
    }

    /// 400 `invalid_value`: the type is right but the value is not allowed.
    #[cold]
    pub fn invalid_value(param: &str, message: impl Into<String>) -> Self {
        Self::bad(Some(param), "invalid_value", message)
    }

    /// 404 `model_not_found`.
    #[cold]
    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: 404,
            kind: INVALID_REQUEST,
            param: Some("model".to_owned()),
            code: Some("model_not_found"),
            message: format!("The model `{model}` does not exist or you do not have access to it."),
        }
    }

    /// 404 `unknown_url`: a route the analyser does not handle.
    #[cold]
    pub fn unknown_route(route: &str) -> Self {
        Self {
            status: 404,
            kind: INVALID_REQUEST,
            param: None,
            code: Some("unknown_url"),
            message: format!(
                "Invalid URL (POST {route}): request analysis handles /v1/chat/completions, \
                 /v1/completions, /v1/embeddings and /v1/responses."
            ),
        }
    }

    /// 413 `request_too_large`: the body (or its declared `Content-Length`) is over the cap.
    #[cold]
    pub fn too_large(size: u64, max_body_bytes: u64) -> Self {
        Self {
            status: 413,
            kind: INVALID_REQUEST,
            param: None,
            code: Some("request_too_large"),
            message: format!(
                "Request body too large: {size} bytes, the limit is {max_body_bytes} bytes."
            ),
        }
    }

    /// 400 `context_length_exceeded`, keeping OpenAI's "maximum context length is N tokens"
    /// phrase (clients search the message for it, see docs/engines.md §4).
    ///
    /// `what` names the prompt field in prose ("messages", "prompt", "input");
    /// `completion` is `None` when the prompt alone is over the window.
    #[cold]
    pub fn context_length(
        param: &str,
        what: &str,
        context_window: u64,
        prompt: u64,
        completion: Option<u64>,
    ) -> Self {
        let message = match completion {
            Some(c) => format!(
                "This model's maximum context length is {context_window} tokens. However, you \
                 requested {} tokens ({prompt} in the {what}, {c} in the completion). Please \
                 reduce the length of the {what} or completion.",
                prompt.saturating_add(c)
            ),
            None => format!(
                "This model's maximum context length is {context_window} tokens. However, your \
                 {what} resulted in {prompt} tokens. Please reduce the length of the {what}."
            ),
        };
        Self::bad(Some(param), "context_length_exceeded", message)
    }

    /// 500 `server_error`: a bug inside the analyser (for example a caught panic).
    #[cold]
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: 500,
            kind: SERVER_ERROR,
            param: None,
            code: Some("internal_error"),
            message: message.into(),
        }
    }

    /// The OpenAI error body `{"error": {"message", "type", "param", "code"}}` as a JSON value.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }

    /// [`Self::body`] serialized to compact JSON bytes.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(&self.body()).unwrap_or_default()
    }
}

impl fmt::Display for AnalysisError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for AnalysisError {}

/// OpenAI's words for a JSON value's type, used in `invalid_type` messages.
pub(crate) fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(n) if n.is_f64() => "a decimal",
        serde_json::Value::Number(_) => "an integer",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}
