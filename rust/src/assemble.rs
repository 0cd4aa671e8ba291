//! A non-streamed answer rebuilt from the stream the engine sent instead.
//!
//! kvgate forwards a request whose client did not ask for streaming to the engine as a stream
//! (`"stream": true`), so that the engine notices at its next token write that the client went
//! away; the client still gets the one JSON body the engine would have sent. [`StreamAssembler`]
//! cuts the engine's SSE bytes into the `data:` payloads of their events ([`SseLines`]), parses
//! each one and merges it into the answer being built:
//!
//! * chat completions and legacy completions (OpenAI's streaming chunk format, which vLLM,
//!   SGLang, TGI and llama.cpp's server follow): [`StreamAssembler::answer`] describes the merge;
//! * OpenAI's Responses API: the `response` object of the terminal `response.completed` /
//!   `response.incomplete` event is the whole answer.
//!
//! Only the answer being built is kept (its text, logprobs and tool-call pieces, each once),
//! never the events themselves; an event that grows past [`EVENT_LIMIT`] bytes before its end
//! breaks the stream off ([`StreamAssembler::overlong`]).

use std::collections::BTreeMap;

use indexmap::IndexMap;
use serde_json::{Map, Value};

use crate::sse::{lines, EVENT_LIMIT, RESPONSES_TEXT_EVENTS};

/// Cuts an SSE byte stream into the `data:` payloads of its events (the SSE format of the
/// WHATWG HTML standard: lines end with LF, CRLF or CR; an empty line ends an event; the
/// `data:` lines of one event are joined with LF; one space after the colon is dropped; other
/// fields and comments are skipped).
///
/// Only the unfinished last line and the unfinished event's `data:` lines are held between
/// calls, at most [`EVENT_LIMIT`] bytes of them.
#[derive(Debug, Default)]
pub struct SseLines {
    /// The unfinished last line (a trailing CR may be the first half of a CRLF).
    rest: Vec<u8>,
    /// The unfinished event's `data:` values, joined with LF.
    data: Vec<u8>,
    /// Whether `data` holds at least one `data:` line (an empty one counts).
    has_data: bool,
    /// Bytes of the `data:` values held (each counted with its optional leading space and a
    /// line end).
    held: usize,
}

/// An event grew past [`EVENT_LIMIT`] bytes before its end.
#[derive(Debug, PartialEq, Eq)]
pub struct Overlong;

impl SseLines {
    /// The payloads of the events that `chunk` completes (maybe none), in order.
    ///
    /// Errors: [`Overlong`] when the unfinished event (its lines, and the line without its
    /// end) holds more than [`EVENT_LIMIT`] bytes; everything held is dropped.
    pub fn feed(&mut self, chunk: &[u8]) -> Result<Vec<Vec<u8>>, Overlong> {
        let has_end = memchr::memchr2(b'\n', b'\r', chunk).is_some();
        if !self.rest.is_empty() && !has_end {
            // more of an unfinished line: kept, not split again
            self.rest.extend_from_slice(chunk);
            self.check()?;
            return Ok(Vec::new());
        }
        let joined;
        let buf: &[u8] = if self.rest.is_empty() {
            chunk
        } else {
            let mut all = std::mem::take(&mut self.rest);
            all.extend_from_slice(chunk);
            joined = all;
            &joined
        };
        // a line is complete once its end arrived; a trailing CR may be the first half of CRLF,
        // so the line it ends waits too
        let cut = if buf.ends_with(b"\n") {
            buf.len()
        } else {
            let search = buf.strip_suffix(b"\r").unwrap_or(buf);
            search
                .iter()
                .rposition(|&c| c == b'\n' || c == b'\r')
                .map_or(0, |i| i + 1)
        };
        let mut out = Vec::new();
        for line in lines(&buf[..cut]) {
            self.take(line, &mut out);
        }
        let rest = buf[cut..].to_vec();
        self.rest = rest;
        self.check()?;
        Ok(out)
    }

    /// The payloads left at the end of the stream (an event without its closing empty line
    /// counts: the stream ended).
    pub fn flush(&mut self) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.rest);
        if !rest.is_empty() {
            self.take(&rest, &mut out);
        }
        if self.has_data {
            out.push(std::mem::take(&mut self.data));
            self.has_data = false;
            self.held = 0;
        }
        out
    }

    fn check(&mut self) -> Result<(), Overlong> {
        if self.held + self.rest.len() > EVENT_LIMIT {
            *self = Self::default();
            return Err(Overlong);
        }
        Ok(())
    }

    /// One line, its end dropped (the line held at the stream's end may still carry its CR): an
    /// empty one ends the event, a `data:` one adds to it.
    fn take(&mut self, raw: &[u8], out: &mut Vec<Vec<u8>>) {
        let end = raw
            .iter()
            .rposition(|&c| c != b'\r' && c != b'\n')
            .map_or(0, |i| i + 1);
        let line = &raw[..end];
        if line.is_empty() {
            if self.has_data {
                out.push(std::mem::take(&mut self.data));
                self.has_data = false;
                self.held = 0;
            }
        } else if let Some(value) = line.strip_prefix(b"data:") {
            if self.has_data {
                self.data.push(b'\n');
            }
            self.data
                .extend_from_slice(value.strip_prefix(b" ").unwrap_or(value));
            self.has_data = true;
            // the line's LF counts: empty `data:` lines must not hold bytes past the limit
            self.held += value.len() + 1;
        }
        // `event:`, `id:`, `retry:` and comments carry nothing the answer needs
    }
}

/// Which answer a stream is rebuilt into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `POST /v1/chat/completions`: `object: chat.completion`.
    Chat,
    /// `POST /v1/completions`: `object: text_completion`.
    Completions,
    /// `POST /v1/responses`: `object: response`.
    Responses,
}

/// A string member being assembled from pieces (kept as one string, appended to), or a
/// member's last value.
#[derive(Debug, Clone)]
enum Part {
    Text(String),
    Json(Value),
}

impl Part {
    fn into_value(self) -> Value {
        match self {
            Part::Text(text) => Value::String(text),
            Part::Json(value) => value,
        }
    }

    fn is_null(&self) -> bool {
        matches!(self, Part::Json(Value::Null))
    }
}

/// Members in their first-insertion order, found by hash (an engine may send thousands of
/// member names: a linear search would make one event cost their square).
#[derive(Debug)]
struct Members<T>(IndexMap<String, T>);

impl<T> Default for Members<T> {
    fn default() -> Self {
        Self(IndexMap::new())
    }
}

impl<T> Members<T> {
    fn get(&self, key: &str) -> Option<&T> {
        self.0.get(key)
    }

    fn get_mut(&mut self, key: &str) -> Option<&mut T> {
        self.0.get_mut(key)
    }

    /// Sets `key` to `value`, in its place when it is there, else at the end.
    fn set(&mut self, key: &str, value: T) {
        match self.0.get_mut(key) {
            Some(slot) => *slot = value,
            None => {
                self.0.insert(key.to_owned(), value);
            }
        }
    }
}

/// A message member of a chat choice being assembled.
#[derive(Debug)]
enum Member {
    Part(Part),
    /// The deprecated single `function_call`: its `name` once, its `arguments` in pieces.
    Function(Members<Part>),
}

/// One tool call being assembled: `id`, `type` and other members (the first non-null value
/// of each), `function.name` once, `function.arguments` in pieces.
#[derive(Debug)]
struct ToolCall {
    fields: Members<Value>,
    function: Members<Part>,
}

/// One choice being assembled.
#[derive(Debug, Default)]
struct Choice {
    message: Members<Member>,
    text: String,
    tool_calls: BTreeMap<i128, ToolCall>,
    logprobs: Option<Map<String, Value>>,
    finish_reason: Value,
    extra: Map<String, Value>,
}

/// Top-level keys of a chunk that are not copied into the answer as they are.
const TOP_KEYS: [&str; 4] = ["choices", "usage", "object", "error"];
/// Top-level keys whose first non-null value is kept.
const FIRST_KEYS: [&str; 3] = ["id", "created", "model"];
/// The Responses events that end a stream with the whole `response` object.
const RESPONSES_TERMINAL: [&str; 2] = ["response.completed", "response.incomplete"];

/// Rebuilds the non-streamed answer of one request from its stream (see the module docs).
#[derive(Debug)]
pub struct StreamAssembler {
    kind: Kind,
    lines: SseLines,
    complete: bool,
    overlong: bool,
    error: Option<Map<String, Value>>,
    // chat and legacy completions
    top: Map<String, Value>,
    choices: BTreeMap<i128, Choice>,
    usage: Option<Value>,
    // Responses
    response: Option<Map<String, Value>>,
    deltas: String,
    delta_count: usize,
}

impl StreamAssembler {
    /// An assembler of `kind`'s answer, empty.
    pub fn new(kind: Kind) -> Self {
        Self {
            kind,
            lines: SseLines::default(),
            complete: false,
            overlong: false,
            error: None,
            top: Map::new(),
            choices: BTreeMap::new(),
            usage: None,
            response: None,
            deltas: String::new(),
            delta_count: 0,
        }
    }

    /// Takes the next bytes of the stream: every event they complete is merged in (`data:
    /// [DONE]` marks the stream complete; a payload that is not JSON is skipped). An event that
    /// grows past [`EVENT_LIMIT`] bytes before its end sets [`Self::overlong`], after which
    /// nothing more is taken.
    pub fn feed(&mut self, data: &[u8]) {
        if self.overlong {
            return;
        }
        match self.lines.feed(data) {
            Ok(payloads) => self.take(&payloads),
            Err(Overlong) => self.overlong = true,
        }
    }

    /// The stream ended: what it left unfinished is merged in (an event without its closing
    /// empty line counts).
    pub fn finish(&mut self) {
        if !self.overlong {
            let payloads = self.lines.flush();
            self.take(&payloads);
        }
    }

    fn take(&mut self, payloads: &[Vec<u8>]) {
        for payload in payloads {
            if payload == b"[DONE]" {
                self.complete = true;
            } else if let Ok(Value::Object(event)) = serde_json::from_slice::<Value>(payload) {
                match self.kind {
                    Kind::Responses => self.add_responses(event),
                    Kind::Chat | Kind::Completions => self.add_chunk(event),
                }
            }
        }
    }

    /// Whether the stream's end was seen: `data: [DONE]`, or a Responses terminal or
    /// `response.failed` event.
    pub fn complete(&self) -> bool {
        self.complete
    }

    /// Whether an event grew past [`EVENT_LIMIT`] bytes before its end (the stream is broken).
    pub fn overlong(&self) -> bool {
        self.overlong
    }

    /// The `error` object of the last error event (a chunk with an `error` object; a Responses
    /// `response.failed` event's `response.error`, or `{"message": "response failed"}`; a
    /// Responses `error` event's `message`, `param` and `code`): the answer is then an error.
    pub fn error(&self) -> Option<&Map<String, Value>> {
        self.error.as_ref()
    }

    /// Whether the answer so far has choices, each with its `finish_reason` (a chat or
    /// completions stream complete without `data: [DONE]`); never for a Responses stream.
    pub fn all_finished(&self) -> bool {
        self.kind != Kind::Responses
            && !self.choices.is_empty()
            && self.choices.values().all(|c| !c.finish_reason.is_null())
    }

    fn add_chunk(&mut self, event: Map<String, Value>) {
        if let Some(Value::Object(err)) = event.get("error") {
            self.error = Some(err.clone());
            return;
        }
        if let Some(usage @ Value::Object(_)) = event.get("usage") {
            self.usage = Some(usage.clone());
        }
        let mut choices = None;
        for (key, value) in event {
            if key == "choices" {
                choices = Some(value);
                continue;
            }
            if TOP_KEYS.contains(&key.as_str()) || value.is_null() && self.top.contains_key(&key) {
                continue;
            }
            if FIRST_KEYS.contains(&key.as_str())
                && self.top.get(&key).is_some_and(|v| !v.is_null())
            {
                continue;
            }
            self.top.insert(key, value);
        }
        if let Some(Value::Array(choices)) = choices {
            for choice in choices {
                if let Value::Object(choice) = choice {
                    self.add_choice(choice);
                }
            }
        }
    }

    fn add_choice(&mut self, data: Map<String, Value>) {
        let Some(index) = int_member(&data, "index") else {
            return;
        };
        let choice = self.choices.entry(index).or_default();
        for (key, value) in data {
            match key.as_str() {
                "text" => {
                    if let Value::String(text) = value {
                        choice.text.push_str(&text);
                    }
                }
                "delta" => {
                    if let Value::Object(delta) = value {
                        add_delta(choice, delta);
                    }
                }
                "logprobs" => {
                    if let Value::Object(part) = value {
                        merge_logprobs(choice.logprobs.get_or_insert_with(Map::new), part);
                    }
                }
                "finish_reason" => {
                    if !value.is_null() {
                        choice.finish_reason = value;
                    }
                }
                "index" => {}
                _ => {
                    if !value.is_null() || !choice.extra.contains_key(&key) {
                        choice.extra.insert(key, value);
                    }
                }
            }
        }
    }

    fn add_responses(&mut self, mut event: Map<String, Value>) {
        let kind = match event.get("type") {
            Some(Value::String(kind)) => kind.clone(),
            _ => return,
        };
        if RESPONSES_TEXT_EVENTS.contains(&kind.as_str()) && self.response.is_none() {
            if let Some(Value::String(delta)) = event.get("delta") {
                self.deltas.push_str(delta);
                self.delta_count += 1;
            }
        } else if RESPONSES_TERMINAL.contains(&kind.as_str())
            && matches!(event.get("response"), Some(Value::Object(_)))
        {
            if let Some(Value::Object(response)) = event.remove("response") {
                self.response = Some(response);
            }
            self.deltas = String::new(); // the response holds the text now
            self.delta_count = 0;
            self.complete = true;
        } else if kind == "response.failed" {
            self.complete = true;
            let err = match event.get("response") {
                Some(Value::Object(response)) => response.get("error"),
                _ => None,
            };
            self.error = Some(if let Some(Value::Object(err)) = err {
                err.clone()
            } else {
                let mut err = Map::new();
                err.insert("message".into(), "response failed".into());
                err
            });
        } else if kind == "error" {
            // {"type": "error", "code", "message", "param"}, or those inside an `error` object
            let fields = match event.get("error") {
                Some(Value::Object(inner)) => inner,
                _ => &event,
            };
            let mut err = Map::new();
            for key in ["message", "param", "code"] {
                err.insert(key.into(), fields.get(key).cloned().unwrap_or(Value::Null));
            }
            self.error = Some(err);
        }
    }

    /// The non-streamed answer built so far.
    ///
    /// Chat and legacy completions: `id`, `object` (`chat.completion` / `text_completion`),
    /// `created` and `model` (the first non-null value of each), every other top-level member
    /// the chunks carry (`system_fingerprint`, `service_tier`, llama.cpp's `timings`: the last
    /// non-null value), `choices` in `index` order and the last `usage` object (OpenAI and vLLM
    /// send it on a last `choices: []` chunk, llama.cpp on the `finish_reason` chunk). Each
    /// choice has `index`, `logprobs` (its list members — `content`, `refusal`; legacy
    /// `tokens`, `token_logprobs`, `top_logprobs`, `text_offset` — concatenated over the
    /// chunks), the last non-null `finish_reason`, and its other members' last non-null value
    /// (vLLM's `stop_reason`). A chat choice's `message` has `role` (`assistant` unless the
    /// deltas said otherwise), its string members (`content`, `reasoning_content`, `refusal`,
    /// ...) concatenated (`content` null when none came), the deprecated `function_call` and
    /// `tool_calls` put together by their `index` (the first `id`, `type` and
    /// `function.name`, the `function.arguments` concatenated). A legacy choice has `text`.
    ///
    /// Responses: the terminal event's `response` object; before it arrived, `{}`, or an
    /// answer of one message holding the text of the `delta` events so far (what a cut stream
    /// is charged).
    pub fn answer(&self) -> Value {
        if self.kind == Kind::Responses {
            return self.responses_answer();
        }
        let mut out = Map::new();
        for key in ["id", "object", "created", "model"] {
            let value = if key == "object" {
                Value::from(if self.kind == Kind::Chat {
                    "chat.completion"
                } else {
                    "text_completion"
                })
            } else {
                self.top.get(key).cloned().unwrap_or(Value::Null)
            };
            out.insert(key.into(), value);
        }
        for (key, value) in &self.top {
            if !out.contains_key(key) {
                out.insert(key.clone(), value.clone());
            }
        }
        let choices = self
            .choices
            .iter()
            .map(|(&index, choice)| self.choice(index, choice))
            .collect();
        out.insert("choices".into(), Value::Array(choices));
        if let Some(usage) = &self.usage {
            out.insert("usage".into(), usage.clone());
        }
        Value::Object(out)
    }

    fn responses_answer(&self) -> Value {
        if let Some(response) = &self.response {
            return Value::Object(response.clone());
        }
        if self.delta_count == 0 {
            return Value::Object(Map::new());
        }
        serde_json::json!({"output": [{"type": "message", "content": [
            {"type": "output_text", "text": self.deltas}
        ]}]})
    }

    fn choice(&self, index: i128, choice: &Choice) -> Value {
        let mut out = Map::new();
        out.insert("index".into(), int_value(index));
        if self.kind == Kind::Chat {
            let mut message = Map::new();
            message.insert("role".into(), "assistant".into());
            message.insert("content".into(), Value::Null);
            for (key, member) in &choice.message.0 {
                let value = match member {
                    Member::Part(part) => part.clone().into_value(),
                    Member::Function(function) => function_value(function, false),
                };
                message.insert(key.clone(), value);
            }
            if !choice.tool_calls.is_empty() {
                let calls = choice.tool_calls.values().map(tool_call_value).collect();
                message.insert("tool_calls".into(), Value::Array(calls));
            }
            out.insert("message".into(), Value::Object(message));
        } else {
            out.insert("text".into(), Value::String(choice.text.clone()));
        }
        out.insert(
            "logprobs".into(),
            choice
                .logprobs
                .as_ref()
                .map_or(Value::Null, |l| Value::Object(l.clone())),
        );
        out.insert("finish_reason".into(), choice.finish_reason.clone());
        for (key, value) in &choice.extra {
            out.insert(key.clone(), value.clone());
        }
        Value::Object(out)
    }
}

/// `data[key]` as a JSON integer (`0` when it is absent), `None` when it is anything else.
fn int_member(data: &Map<String, Value>, key: &str) -> Option<i128> {
    match data.get(key) {
        None => Some(0),
        Some(Value::Number(n)) => n
            .as_i64()
            .map(i128::from)
            .or_else(|| n.as_u64().map(i128::from)),
        Some(_) => None,
    }
}

fn int_value(index: i128) -> Value {
    match i64::try_from(index) {
        Ok(i) => Value::from(i),
        Err(_) => Value::from(index as u64),
    }
}

fn add_delta(choice: &mut Choice, delta: Map<String, Value>) {
    let message = &mut choice.message;
    for (key, value) in delta {
        match key.as_str() {
            "tool_calls" => {
                if let Value::Array(calls) = value {
                    for call in calls {
                        if let Value::Object(call) = call {
                            add_tool_call(&mut choice.tool_calls, call);
                        }
                    }
                }
            }
            "function_call" => {
                if let Value::Object(part) = value {
                    if let Some(Member::Function(function)) = message.get_mut(&key) {
                        add_function(function, part);
                    } else {
                        let mut function = Members::default();
                        add_function(&mut function, part);
                        message.set(&key, Member::Function(function));
                    }
                }
            }
            "role" => {
                let unset = !matches!(message.get("role"), Some(Member::Part(p)) if !p.is_null());
                if !value.is_null() && unset {
                    message.set("role", Member::Part(Part::Json(value)));
                }
            }
            _ => match value {
                Value::String(text) => match message.get_mut(&key) {
                    Some(Member::Part(Part::Text(old))) => old.push_str(&text),
                    _ => message.set(&key, Member::Part(Part::Text(text))),
                },
                value => {
                    if !value.is_null() || message.get(&key).is_none() {
                        message.set(&key, Member::Part(Part::Json(value)));
                    }
                }
            },
        }
    }
}

fn add_tool_call(calls: &mut BTreeMap<i128, ToolCall>, delta: Map<String, Value>) {
    let Some(index) = int_member(&delta, "index") else {
        return;
    };
    let call = calls.entry(index).or_insert_with(|| ToolCall {
        fields: Members(IndexMap::from([
            ("id".into(), Value::Null),
            ("type".into(), Value::Null),
        ])),
        function: Members::default(),
    });
    for (key, value) in delta {
        match key.as_str() {
            "index" => {}
            "function" => {
                if let Value::Object(part) = value {
                    add_function(&mut call.function, part);
                }
            }
            _ => {
                if !value.is_null() && !matches!(call.fields.get(&key), Some(v) if !v.is_null()) {
                    call.fields.set(&key, value);
                }
            }
        }
    }
}

/// `name` (and any other member) taken once, `arguments` concatenated.
fn add_function(function: &mut Members<Part>, delta: Map<String, Value>) {
    for (key, value) in delta {
        match (key.as_str(), value) {
            ("arguments", Value::String(text)) => match function.get_mut("arguments") {
                Some(Part::Text(old)) => old.push_str(&text),
                _ => function.set("arguments", Part::Text(text)),
            },
            (_, value) => {
                if !value.is_null() && !matches!(function.get(&key), Some(p) if !p.is_null()) {
                    function.set(&key, Part::Json(value));
                }
            }
        }
    }
}

/// A function's members as JSON; `defaults`: `name` null and `arguments` `""` first (a tool
/// call's function always has both).
fn function_value(function: &Members<Part>, defaults: bool) -> Value {
    let mut out = Map::new();
    if defaults {
        out.insert("name".into(), Value::Null);
        out.insert("arguments".into(), Value::from(""));
    }
    for (key, part) in &function.0 {
        out.insert(key.clone(), part.clone().into_value());
    }
    Value::Object(out)
}

fn tool_call_value(call: &ToolCall) -> Value {
    let mut out = Map::new();
    for (key, value) in &call.fields.0 {
        let value = if key == "type" && !truthy(value) {
            Value::from("function")
        } else {
            value.clone()
        };
        out.insert(key.clone(), value);
        if key == "type" {
            out.insert("function".into(), function_value(&call.function, true));
        }
    }
    Value::Object(out)
}

/// Python's truth value of a JSON value (`null`, `false`, `0`, `""`, `[]`, `{}` are false).
fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Concatenates the list members of a chunk's `logprobs` onto `into` (other members: the last
/// non-null value).
fn merge_logprobs(into: &mut Map<String, Value>, part: Map<String, Value>) {
    for (key, value) in part {
        if let Value::Array(more) = value {
            if let Some(Value::Array(old)) = into.get_mut(&key) {
                old.extend(more);
            } else {
                into.insert(key, Value::Array(more));
            }
        } else if !value.is_null() || !into.contains_key(&key) {
            into.insert(key, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sse(events: &[Value]) -> Vec<u8> {
        let mut out = Vec::new();
        for event in events {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(&serde_json::to_vec(event).unwrap());
            out.extend_from_slice(b"\n\n");
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        out
    }

    fn assembled(kind: Kind, raw: &[u8], piece: usize) -> StreamAssembler {
        let mut asm = StreamAssembler::new(kind);
        for part in raw.chunks(piece) {
            asm.feed(part);
        }
        asm.finish();
        asm
    }

    #[test]
    fn lines_accept_crlf_cr_and_multiline_data_cut_anywhere() {
        let raw = b"data: {\"a\":\r\ndata: 1}\r\n\r\ndata: [DONE]\r\rdata:{\"b\":2}\n\n";
        for piece in [1, 2, 5, raw.len()] {
            let mut lines = SseLines::default();
            let mut out = Vec::new();
            for part in raw.chunks(piece) {
                out.extend(lines.feed(part).unwrap());
            }
            out.extend(lines.flush());
            let want: Vec<Vec<u8>> = vec![
                b"{\"a\":\n1}".to_vec(),
                b"[DONE]".to_vec(),
                b"{\"b\":2}".to_vec(),
            ];
            assert_eq!(out, want, "piece {piece}");
        }
    }

    #[test]
    fn an_event_past_the_limit_breaks_the_stream_off() {
        let mut asm = StreamAssembler::new(Kind::Chat);
        asm.feed(b"data: ");
        let piece = vec![b'x'; 1 << 20];
        for _ in 0..EVENT_LIMIT / piece.len() - 1 {
            asm.feed(&piece);
            assert!(!asm.overlong());
        }
        asm.feed(&piece);
        assert!(asm.overlong());
        assert!(
            asm.lines.rest.capacity() < 1024,
            "what was held is given back"
        );
    }

    #[test]
    fn chat_chunks_merge_into_one_message_with_tool_calls() {
        let raw = sse(&[
            json!({"id": "c1", "created": 7, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": null}], "system_fingerprint": null}),
            json!({"id": "c2", "choices": [{"index": 0, "delta": {"content": "lo", "tool_calls": [{"index": 0, "id": "t", "type": "function", "function": {"name": "f", "arguments": "{\"a\""}}]}}], "system_fingerprint": "fp"}),
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}, "logprobs": {"content": [{"token": "x"}]}}]}),
            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls", "logprobs": {"content": [{"token": "y"}]}, "stop_reason": 3}]}),
            json!({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}),
        ]);
        for piece in [1, 9, raw.len()] {
            let asm = assembled(Kind::Chat, &raw, piece);
            assert!(asm.complete());
            assert!(asm.error().is_none());
            let want = json!({
                "id": "c1", "object": "chat.completion", "created": 7, "model": "m",
                "system_fingerprint": "fp",
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello", "tool_calls": [
                        {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}
                    ]},
                    "logprobs": {"content": [{"token": "x"}, {"token": "y"}]},
                    "finish_reason": "tool_calls",
                    "stop_reason": 3,
                }],
                "usage": {"prompt_tokens": 4, "completion_tokens": 2},
            });
            assert_eq!(asm.answer(), want);
            // the members keep the order OpenAI gives them
            let text = serde_json::to_string(&asm.answer()).unwrap();
            assert!(text.starts_with(
                "{\"id\":\"c1\",\"object\":\"chat.completion\",\"created\":7,\"model\":\"m\""
            ));
        }
    }

    #[test]
    fn legacy_completions_concatenate_text_in_index_order() {
        let raw = sse(&[
            json!({"id": "x", "choices": [{"index": 1, "text": "b"}, {"index": 0, "text": "a"}]}),
            json!({"choices": [{"index": 1, "text": "B", "finish_reason": "stop"}, {"index": 0, "text": "A", "finish_reason": "length"}]}),
        ]);
        let asm = assembled(Kind::Completions, &raw, 4);
        let answer = asm.answer();
        assert_eq!(answer["object"], "text_completion");
        assert_eq!(answer["choices"][0]["text"], "aA");
        assert_eq!(answer["choices"][1]["text"], "bB");
        assert_eq!(answer["choices"][1]["finish_reason"], "stop");
        assert!(asm.all_finished());
    }

    #[test]
    fn an_error_chunk_sets_the_error() {
        let raw = b"data: {\"error\": {\"message\": \"boom\", \"code\": 503}}\n\n";
        let asm = assembled(Kind::Chat, raw, 100);
        assert_eq!(asm.error().unwrap()["message"], "boom");
        assert!(!asm.complete());
        assert!(!asm.all_finished());
    }

    #[test]
    fn responses_answer_is_the_terminal_events_response_else_the_text_so_far() {
        let delta = json!({"type": "response.output_text.delta", "delta": "hi "});
        let done = json!({"type": "response.completed", "response": {"id": "r", "usage": {"input_tokens": 3}}});
        let mut asm = StreamAssembler::new(Kind::Responses);
        asm.feed(&sse(&[delta.clone(), delta.clone()])[..]);
        assert_eq!(
            asm.answer()["output"][0]["content"][0]["text"],
            Value::from("hi hi ")
        );
        let mut asm = StreamAssembler::new(Kind::Responses);
        let mut raw = Vec::new();
        for event in [&delta, &done] {
            raw.extend_from_slice(format!("event: x\ndata: {event}\n\n").as_bytes());
        }
        asm.feed(&raw);
        assert!(asm.complete());
        assert_eq!(
            asm.answer(),
            json!({"id": "r", "usage": {"input_tokens": 3}})
        );
        let mut failed = StreamAssembler::new(Kind::Responses);
        failed.feed(b"data: {\"type\": \"response.failed\", \"response\": {}}\n\n");
        assert_eq!(failed.error().unwrap()["message"], "response failed");
        assert!(StreamAssembler::new(Kind::Responses).answer() == json!({}));
    }
}
