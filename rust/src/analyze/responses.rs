//! OpenAI's Responses API (`POST /v1/responses`, served by vLLM, SGLang and llama.cpp's
//! server): its body read as the chat conversation the engine renders.
//!
//! Engines turn a Responses request into chat messages before applying the chat template:
//! `instructions` becomes a system message; `input` is either a string (one user message) or a
//! list of items — messages (`role` + `content`, a string or a list of content parts
//! `{"type": "input_text" | "output_text", "text"}`, images, audio), and the tool-call items
//! `function_call` (an assistant tool call) and `function_call_output` (a tool message). Tool
//! definitions are flat (`{"type": "function", "name", "parameters"}`) and are nested under
//! `function` as chat has them. [`as_chat`] builds that chat body, validating every field on
//! the way so a refusal names the Responses field (`input[2].content[0].text`), and the chat
//! counting does the rest.

use serde_json::{json, Value};

use super::body::{self, Obj};
use super::error::AnalysisError;

/// The chat body (`messages`, and `tools` when given) a Responses body renders as.
///
/// # Errors
/// 400 `missing_required_parameter` (no `input`), `invalid_type`, `empty_array`,
/// `invalid_value` (an unknown content part type), each naming the Responses field.
pub fn as_chat(obj: &Obj) -> Result<Obj, AnalysisError> {
    let mut messages = Vec::new();
    if let Some(instructions) = body::opt_str(obj, "instructions", "instructions")? {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    match obj.get("input") {
        None => return Err(AnalysisError::missing("input")),
        Some(Value::String(text)) => messages.push(json!({"role": "user", "content": text})),
        Some(Value::Array(items)) => {
            if items.is_empty() {
                return Err(AnalysisError::bad(
                    Some("input"),
                    "empty_array",
                    "Invalid 'input': empty array. Expected an array with minimum length 1, but \
                     got an empty array instead.",
                ));
            }
            for (i, item) in items.iter().enumerate() {
                messages.push(item_message(i, item)?);
            }
        }
        Some(v) => {
            return Err(AnalysisError::invalid_type(
                "input",
                "a string or an array of input items",
                v,
            ))
        }
    }
    let mut chat = Obj::new();
    chat.insert("messages".to_owned(), Value::Array(messages));
    if let Some(tools) = body::opt_array(obj, "tools", "tools")? {
        chat.insert(
            "tools".to_owned(),
            Value::Array(tools.iter().map(chat_tool).collect()),
        );
    }
    Ok(chat)
}

/// One `input` item as a chat message.
fn item_message(i: usize, item: &Value) -> Result<Value, AnalysisError> {
    let param = format!("input[{i}]");
    let Value::Object(obj) = item else {
        return Err(AnalysisError::invalid_type(&param, "an object", item));
    };
    let kind = body::opt_str(obj, "type", &format!("{param}.type"))?;
    if obj.contains_key("role") || kind == Some("message") {
        return message(&param, obj);
    }
    Ok(match kind {
        Some("function_call") => {
            let name = body::req_str(obj, "name", &format!("{param}.name"))?;
            let arguments = body::req_str(obj, "arguments", &format!("{param}.arguments"))?;
            let id = body::opt_str(obj, "call_id", &format!("{param}.call_id"))?.unwrap_or("");
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}
            ]})
        }
        Some("function_call_output") => {
            let output = match obj.get("output") {
                None => return Err(AnalysisError::missing(&format!("{param}.output"))),
                Some(Value::String(s)) => s.clone(),
                Some(other) => body::compact(other),
            };
            let id = body::opt_str(obj, "call_id", &format!("{param}.call_id"))?.unwrap_or("");
            json!({"role": "tool", "content": output, "tool_call_id": id})
        }
        Some("reasoning") => {
            let mut texts = Vec::new();
            if let Some(summary) = body::opt_array(obj, "summary", &format!("{param}.summary"))? {
                for part in summary {
                    if let Some(Value::String(t)) = part.get("text") {
                        texts.push(t.as_str());
                    }
                }
            }
            json!({"role": "assistant", "content": texts.join("\n")})
        }
        // an item type the analyser does not know (a reference to a stored item, a built-in
        // tool's call): its JSON is counted as text, an over-estimate rather than a free ride
        _ => json!({"role": "user", "content": body::compact(item)}),
    })
}

/// A message item (`role`, `content`) as a chat message; `developer` is a system message.
fn message(param: &str, obj: &Obj) -> Result<Value, AnalysisError> {
    let role = body::req_str(obj, "role", &format!("{param}.role"))?;
    let role = if role == "developer" { "system" } else { role };
    let content = match obj.get("content") {
        Some(Value::String(s)) => Value::String(s.clone()),
        None | Some(Value::Null) if role == "assistant" => Value::Null,
        None => return Err(AnalysisError::missing(&format!("{param}.content"))),
        Some(Value::Array(parts)) => {
            let mut out = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                out.push(content_part(&format!("{param}.content[{j}]"), part)?);
            }
            Value::Array(out)
        }
        Some(v) => {
            return Err(AnalysisError::invalid_type(
                &format!("{param}.content"),
                "a string or an array of content parts",
                v,
            ))
        }
    };
    Ok(json!({"role": role, "content": content}))
}

/// A Responses content part as the chat content part counted the same way.
fn content_part(param: &str, part: &Value) -> Result<Value, AnalysisError> {
    let Value::Object(p) = part else {
        return Err(AnalysisError::invalid_type(param, "an object", part));
    };
    let kind = body::req_str(p, "type", &format!("{param}.type"))?;
    Ok(match kind {
        "input_text" | "output_text" | "text" => {
            json!({"type": "text", "text": body::req_str(p, "text", &format!("{param}.text"))?})
        }
        "refusal" => json!({
            "type": "refusal",
            "refusal": body::req_str(p, "refusal", &format!("{param}.refusal"))?
        }),
        "input_image" | "image_url" | "image" => json!({"type": "input_image"}),
        "input_audio" | "audio_url" => json!({"type": "input_audio"}),
        other => {
            return Err(AnalysisError::invalid_value(
                &format!("{param}.type"),
                format!(
                    "Invalid content part type '{other}': expected one of 'input_text', \
                     'output_text', 'input_image', 'input_audio', 'refusal'."
                ),
            ))
        }
    })
}

/// A Responses tool definition as chat has it: a flat function tool (`name`, `description`,
/// `parameters` beside `type`) nested under `function`; any other tool as it came.
fn chat_tool(tool: &Value) -> Value {
    match tool {
        Value::Object(t)
            if t.get("type").and_then(Value::as_str) == Some("function")
                && !t.contains_key("function") =>
        {
            let mut function = Obj::new();
            for key in ["name", "description", "parameters"] {
                if let Some(v) = t.get(key) {
                    function.insert(key.to_owned(), v.clone());
                }
            }
            json!({"type": "function", "function": function})
        }
        other => other.clone(),
    }
}
