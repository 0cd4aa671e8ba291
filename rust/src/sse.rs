//! Server-sent events relay bookkeeping: split, inspect, optionally strip, never re-frame.
//!
//! The gateway writes upstream bytes to the client event by event, exactly as the engine framed
//! them (`data: <json>\n\n`, docs/engines.md §4). While doing so it reads what it needs to settle
//! the token account: the `usage` object (on a `choices: []` chunk for OpenAI/vLLM, on the
//! `finish_reason` chunk for llama.cpp), the text delivered so far (for a stream that breaks or
//! whose engine sends no usage), and `error` events. Only events that may carry a non-null
//! `usage` or an `error` are parsed as they pass; the others are kept as bytes and parsed for
//! their text only if it is asked for (most streams end with the engine's usage and never are)
//! or when more than [`RAW_LIMIT`] bytes of them are waiting.
//!
//! Memory per stream is bounded whatever its length: unparsed events are kept in one buffer up
//! to [`RAW_LIMIT`] bytes, their text in one string up to [`TEXT_LIMIT`] bytes before it is
//! handed to the token counter piece by piece ([`SseInspector::take_countable`]; the caller
//! must take them), and only the last usage and error objects are kept. Both buffers are reused
//! (no allocation per event). Nothing after `data: [DONE]` is handed out or kept.
//!
//! A Responses stream (`POST /v1/responses`, [`SseInspector::new_responses`]) names its events
//! (`event: response.output_text.delta` and a `type` member in the data): the text is the
//! `delta` of the text events, the usage (`input_tokens`, `output_tokens`) is in
//! `response.usage` of the terminal `response.completed` / `response.incomplete` event, which
//! also ends the stream (there is no `[DONE]`), and `response.failed` or an `error` event is an
//! error.

/// Bytes of unparsed events kept before they are parsed for their text (the text is all a
/// settlement needs of them).
pub const RAW_LIMIT: usize = 4 * 1024;

/// Bytes of delivered text kept before a piece of it is handed to the token counter (each
/// piece boundary kept counts 8 bytes more: with one token per event, most pieces are a few
/// bytes).
pub const TEXT_LIMIT: usize = 2 * 1024;

/// Bytes of delivered text without a whitespace boundary after which a piece is handed to the
/// counter anyway, cut at a character boundary (the count is then approximate).
pub const TEXT_HARD_LIMIT: usize = 4 * TEXT_LIMIT;

/// Bytes of one event (or of a line of it) held while its end has not arrived: past this the
/// stream is broken off ([`SseInspector::overlong`]). The largest events an engine sends are
/// a Responses stream's terminal event, which repeats the whole answer (with 20 top logprobs
/// about 1.3 KB a token: 32 MiB is some 25,000 tokens of it); an upstream that sends more
/// without an event's end would otherwise grow the gateway's memory without bound.
pub const EVENT_LIMIT: usize = 32 * 1024 * 1024;

/// The most an inspector keeps allocated for a partial event between reads when that event
/// is short (bytes): a larger buffer, left by a large read, is given back.
const HELD_CAPACITY: usize = 4 * 1024;

/// The most text pieces' ends an inspector keeps allocated once they are counted (a larger
/// vector, left by a large read, is given back).
const HELD_ENDS: usize = 256;

use serde_json::{Map, Value};

/// What [`SseInspector::feed`] hands back.
#[derive(Debug, PartialEq, Eq)]
pub enum Fed {
    /// Exactly the bytes that were fed: write them as they are.
    Same,
    /// These bytes (held bytes of earlier calls, or a stripped event) — maybe empty.
    Bytes(Vec<u8>),
}

/// Cuts an upstream SSE byte stream into complete events and inspects each one.
#[derive(Debug)]
pub struct SseInspector {
    strip: bool,
    buf: Vec<u8>,
    /// A CR was seen: events may end with `\r\n\r\n` or `\r\r` too.
    cr: bool,
    /// `data:` lines (or whole events) handed out without usage or error, not parsed yet, in
    /// stream order (everything before them is in `text`).
    raw: Vec<u8>,
    /// Delivered text not yet handed to the counter, in stream order.
    text: String,
    /// End offsets in `text` of its pieces (one per text field of an event).
    ends: Vec<usize>,
    chunks: u64,
    usage: Option<Value>,
    error: Option<Value>,
    /// Whether the stream is over for the inspector: `[DONE]` (or a Responses terminal event)
    /// passed, or an event grew past [`EVENT_LIMIT`] before its end.
    end: End,
    /// Bytes at the start of `buf` already searched for an event's end (none there): the next
    /// search starts just before them, not at 0 (an event arriving in many reads is searched
    /// once, not once per read).
    scanned: usize,
    /// Which API's stream this is.
    dialect: Dialect,
}

/// Whether a stream is still read ([`SseInspector`]'s `end`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Events are read and handed out.
    Open,
    /// `[DONE]` (a Responses terminal event) passed: nothing after it is handed out.
    Done,
    /// An event grew past [`EVENT_LIMIT`] before its end: nothing more is handed out or kept.
    Overlong,
}

/// The API whose stream an inspector reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dialect {
    /// Chat / completions chunks: text in `choices`, usage at the top level, `[DONE]` at the end.
    Chat,
    /// The Responses API: named events, usage in the terminal event.
    Responses,
}

impl SseInspector {
    /// A new inspector. `strip_usage_chunk`: drop the usage-only chunk (`"choices": []` with a
    /// `usage` object) and the `"usage": null` member of the other chunks — set when the
    /// gateway added `stream_options.include_usage` itself and the client did not ask for it,
    /// so the client sees what it would have seen (an OpenAI-style engine sends neither then).
    pub fn new(strip_usage_chunk: bool) -> Self {
        Self {
            strip: strip_usage_chunk,
            buf: Vec::new(),
            cr: false,
            raw: Vec::new(),
            text: String::new(),
            ends: Vec::new(),
            chunks: 0,
            usage: None,
            error: None,
            end: End::Open,
            scanned: 0,
            dialect: Dialect::Chat,
        }
    }

    /// A new inspector for a Responses stream (`POST /v1/responses`): text from the `delta` of
    /// the text events, usage and the end of the stream from the terminal event, errors from
    /// `response.failed` and `error` events. Nothing is stripped (a Responses stream always
    /// ends with its usage).
    pub fn new_responses() -> Self {
        Self {
            dialect: Dialect::Responses,
            ..Self::new(false)
        }
    }

    /// Whether this inspector reads a Responses stream.
    fn is_responses(&self) -> bool {
        self.dialect == Dialect::Responses
    }

    /// Whether `payload` (one `data:` payload, or several whole events) may hold what settles
    /// the stream: a non-null `usage`, an `error`, or a Responses terminal event.
    fn may_settle(&self, payload: &[u8]) -> bool {
        may_carry_usage_or_error(payload) || (self.is_responses() && responses_terminal(payload))
    }

    /// Takes the next upstream bytes; returns the complete events to write now. Bytes of an
    /// event whose end has not arrived yet are held until it does; nothing is re-encoded, so
    /// what comes back is byte for byte what upstream sent (minus, when stripping, the usage
    /// chunk and each chunk's `"usage": null` member).
    ///
    /// Once `data: [DONE]` has passed, the stream is over: the events after it (in the same
    /// bytes or later ones) are neither handed out nor kept. Once an event has grown past
    /// [`EVENT_LIMIT`] bytes without its end, the stream is broken off ([`Self::overlong`]):
    /// its bytes are dropped, and so is everything after them.
    pub fn feed(&mut self, data: &[u8]) -> Fed {
        if self.end != End::Open {
            return Fed::Bytes(Vec::new());
        }
        if !self.cr && memchr::memchr(b'\r', data).is_some() {
            self.cr = true;
        }
        let fresh = self.buf.is_empty();
        // Whole events with nothing to read now (the common case): kept as they are.
        if fresh
            && !self.cr
            && data.ends_with(b"\n\n")
            && find(data, b"[DONE]", 0).is_none()
            && !self.may_settle(data)
            && !(self.strip && find(data, b"\"usage\"", 0).is_some())
        {
            self.push_raw(data, false);
            return Fed::Same;
        }
        self.buf.extend_from_slice(data);
        let mut out: Option<Vec<u8>> = None; // set once an event is dropped
        let mut pos = 0;
        // (a separator may begin in the last bytes searched: up to 3 of them again)
        let mut from = self.scanned.saturating_sub(3);
        while let Some((end, size)) = self.split_point(from) {
            let stop = end + size;
            let event = self.buf[pos..stop].to_vec();
            match self.inspect(&event) {
                Verdict::Keep => {
                    if let Some(out) = out.as_mut() {
                        out.extend_from_slice(&event);
                    }
                }
                verdict => {
                    let out = out.get_or_insert_with(|| self.buf[..pos].to_vec());
                    if let Verdict::Replace(bytes) = verdict {
                        out.extend_from_slice(&bytes);
                    }
                }
            }
            pos = stop;
            from = stop;
        }
        let all = fresh && pos == self.buf.len();
        let kept = match out {
            Some(out) => Fed::Bytes(out),
            None if all => Fed::Same,
            None => Fed::Bytes(self.buf[..pos].to_vec()),
        };
        self.buf.drain(..pos);
        if self.done() {
            self.buf = Vec::new(); // a partial event after [DONE]: dropped, not kept
        } else if self.buf.len() > EVENT_LIMIT {
            self.end = End::Overlong;
            self.buf = Vec::new();
        } else if self.buf.capacity() > HELD_CAPACITY && self.buf.len() <= HELD_CAPACITY / 2 {
            // one large read (a gateway behind a fast engine reads what piled up) must not keep
            // its buffer for the rest of the stream: only the partial event stays
            self.buf.shrink_to(HELD_CAPACITY / 2);
        }
        self.scanned = self.buf.len(); // what is held has no event's end
        kept
    }

    /// Whatever partial event remains at the end of the stream (to be written as is, or
    /// without its `"usage": null` / usage chunk when stripping).
    pub fn flush(&mut self) -> Vec<u8> {
        let rest = std::mem::take(&mut self.buf);
        self.scanned = 0;
        if self.done() || rest.trim_ascii().is_empty() {
            return rest;
        }
        match self.inspect(&rest) {
            Verdict::Keep => rest,
            Verdict::Drop => Vec::new(),
            Verdict::Replace(bytes) => bytes,
        }
    }

    /// The last non-null `usage` object seen.
    pub fn usage(&self) -> Option<&Value> {
        self.usage.as_ref()
    }

    /// `prompt_tokens` and `completion_tokens` of the last usage object seen, each only when it
    /// is a non-negative integer; `None` when no usage was seen.
    pub fn usage_tokens(&self) -> Option<(Option<u64>, Option<u64>)> {
        self.usage.as_ref().map(usage_counts)
    }

    /// The `error` object of an error event, if one was seen.
    pub fn error(&self) -> Option<&Value> {
        self.error.as_ref()
    }

    /// Whether `data: [DONE]` was seen.
    pub fn done(&self) -> bool {
        self.end == End::Done
    }

    /// Whether an event grew past [`EVENT_LIMIT`] bytes before its end (the stream is broken:
    /// the caller ends it with an error).
    pub fn overlong(&self) -> bool {
        self.end == End::Overlong
    }

    /// Text pieces (content, reasoning, tool-call name and arguments, legacy `text`) of the
    /// events handed out so far and not yet taken by [`Self::take_countable`], in stream order
    /// (all of them for a stream shorter than [`RAW_LIMIT`] + [`TEXT_LIMIT`]).
    pub fn delivered_text(&mut self) -> Vec<String> {
        self.parse_pending();
        let mut start = 0;
        self.ends
            .iter()
            .map(|&end| {
                let piece = self.text[start..end].to_owned();
                start = end;
                piece
            })
            .collect()
    }

    /// Events handed out so far that carried generated text.
    pub fn content_chunks(&mut self) -> u64 {
        self.parse_pending();
        self.chunks
    }

    /// A piece of the delivered text for the token counter, taken out of what is kept: `None`
    /// while less than [`TEXT_LIMIT`] bytes are kept (unless `all`). The piece ends just before
    /// the last run of ASCII whitespace that follows a non-whitespace byte; the rest (starting
    /// with that whitespace) stays. Summing the counts of the pieces is then exact for a
    /// tokenizer that pre-splits text before whitespace (GPT-2-style byte-level BPE, the
    /// `Whitespace` and `Metaspace` pre-tokenizers: no token spans such a boundary), and an
    /// approximation (usually a slight over-count) for one that merges across whitespace, or for
    /// a text with no such boundary in [`TEXT_HARD_LIMIT`] bytes (cut at a character boundary
    /// then). `all`: take everything that is left (the end of the stream).
    pub fn take_countable(&mut self, all: bool) -> Option<String> {
        if self.raw.len() > RAW_LIMIT || all {
            self.parse_pending();
        }
        let kept = self.text.len() + 8 * self.ends.len();
        if self.text.is_empty() || (!all && kept < TEXT_LIMIT) {
            return None;
        }
        let cut = if all {
            Some(self.text.len())
        } else {
            whitespace_cut(self.text.as_bytes()).or_else(|| {
                (self.text.len() >= TEXT_HARD_LIMIT).then(|| {
                    let mut i = self.text.len() - TEXT_LIMIT;
                    while !self.text.is_char_boundary(i) {
                        i -= 1;
                    }
                    i
                })
            })
        };
        let cut = cut.filter(|&i| i > 0)?;
        let piece = self.text[..cut].to_owned();
        self.text.drain(..cut);
        // the rest is one piece now
        self.ends.clear();
        if !self.text.is_empty() {
            self.ends.push(self.text.len());
        }
        // what one large read left allocated (thousands of events' text and ends, when the
        // gateway was behind a fast engine) is given back, not kept for the rest of the stream
        if self.text.capacity() > TEXT_HARD_LIMIT && self.text.len() <= TEXT_LIMIT {
            self.text.shrink_to(TEXT_LIMIT);
        }
        if self.ends.capacity() > HELD_ENDS {
            self.ends.shrink_to(HELD_ENDS / 8);
        }
        Some(piece)
    }

    /// Keeps `bytes` (whole events, or one `data:` line when `line`) to parse for their text
    /// later.
    fn push_raw(&mut self, bytes: &[u8], line: bool) {
        self.raw.extend_from_slice(bytes);
        if line {
            self.raw.push(b'\n');
        }
    }

    /// Appends one event's text pieces to `text` (after the pending raw events' text). An event
    /// without text (the usage chunk that ends most streams) leaves the pending events
    /// unparsed: nothing has to go after their text, which may never be asked for.
    fn push_text(&mut self, pieces: Vec<String>, found: bool) {
        if !pieces.is_empty() {
            self.parse_pending();
        }
        for piece in pieces {
            self.text.push_str(&piece);
            self.ends.push(self.text.len());
        }
        self.chunks += u64::from(found);
    }

    fn parse_pending(&mut self) {
        if self.raw.is_empty() {
            return;
        }
        let mut raw = std::mem::take(&mut self.raw);
        let mut pieces = Vec::new();
        for line in lines(&raw) {
            let Some(payload) = data_payload(line) else {
                continue;
            };
            if payload == b"[DONE]" {
                continue;
            }
            if let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(payload) {
                if let Some(found) = event_text(self.is_responses(), &obj, &mut pieces) {
                    self.chunks += u64::from(found);
                    for piece in pieces.drain(..) {
                        self.text.push_str(&piece);
                        self.ends.push(self.text.len());
                    }
                }
            }
        }
        raw.clear();
        if raw.capacity() <= 2 * RAW_LIMIT {
            self.raw = raw; // reused; a larger one (after a large read) is freed
        }
    }

    /// Earliest event end in the buffer from `start`: (index of the separator, its length).
    fn split_point(&self, start: usize) -> Option<(usize, usize)> {
        if !self.cr {
            // only LF line ends so far (every engine we know): one separator to look for
            return find(&self.buf, b"\n\n", start).map(|i| (i, 2));
        }
        [&b"\n\n"[..], b"\r\n\r\n", b"\r\r"]
            .iter()
            .filter_map(|sep| find(&self.buf, sep, start).map(|i| (i, sep.len())))
            .min_by_key(|&(i, _)| i)
    }

    /// Reads one complete event; says whether to forward it as is, drop it (the usage chunk
    /// when stripping) or forward it rewritten (without `"usage": null` when stripping).
    fn inspect(&mut self, event: &[u8]) -> Verdict {
        if self.done() {
            return Verdict::Drop; // the stream ended at [DONE]
        }
        let mut null_usage = false;
        for line in lines(event) {
            let Some(payload) = data_payload(line) else {
                continue;
            };
            if payload == b"[DONE]" {
                self.end = End::Done;
                continue;
            }
            let stripping = self.strip && find(payload, b"\"usage\"", 0).is_some();
            if !stripping && !self.may_settle(payload) {
                self.push_raw(line, true);
                continue;
            }
            let Ok(Value::Object(mut obj)) = serde_json::from_slice::<Value>(payload) else {
                continue;
            };
            if let Some(err @ Value::Object(_)) = obj.get("error") {
                self.error = Some(err.clone());
            }
            if self.is_responses() {
                self.responses_event(&obj);
            }
            let empty_choices = matches!(obj.get("choices"), Some(Value::Array(c)) if c.is_empty());
            match obj.remove("usage") {
                Some(usage @ Value::Object(_)) => {
                    self.usage = Some(usage);
                    if self.strip && empty_choices {
                        return Verdict::Drop;
                    }
                }
                Some(Value::Null) if stripping => null_usage = true,
                _ => {}
            }
            let mut pieces = Vec::new();
            if let Some(found) = event_text(self.is_responses(), &obj, &mut pieces) {
                self.push_text(pieces, found);
            }
        }
        if null_usage {
            if let Some(bytes) = without_null_usage(event) {
                return Verdict::Replace(bytes);
            }
        }
        Verdict::Keep
    }

    /// Reads a parsed Responses event for what settles the stream: the terminal event's
    /// `response.usage` (and the end of the stream), a `response.failed` event's
    /// `response.error`, an `error` event.
    fn responses_event(&mut self, obj: &Map<String, Value>) {
        let Some(kind) = obj.get("type").and_then(Value::as_str) else {
            return;
        };
        match kind {
            "response.completed" | "response.incomplete" | "response.failed" => {
                self.end = End::Done;
                let Some(Value::Object(response)) = obj.get("response") else {
                    return;
                };
                if let Some(usage @ Value::Object(_)) = response.get("usage") {
                    self.usage = Some(usage.clone());
                }
                if kind == "response.failed" {
                    self.error = Some(match response.get("error") {
                        Some(err @ Value::Object(_)) => err.clone(),
                        _ => Value::Object(response.clone()),
                    });
                }
            }
            "error" if self.error.is_none() => {
                // `{"type": "error", "code", "message", "param"}`
                self.error = Some(Value::Object(obj.clone()));
            }
            _ => {}
        }
    }
}

/// Whether `payload` holds a Responses terminal event's `type` (a quote inside generated text
/// is escaped, so the quoted name is a JSON string of its own).
fn responses_terminal(payload: &[u8]) -> bool {
    [
        &b"\"response.completed\""[..],
        b"\"response.incomplete\"",
        b"\"response.failed\"",
    ]
    .iter()
    .any(|name| find(payload, name, 0).is_some())
}

/// The Responses events whose `delta` is generated text (output, refusal, reasoning, tool-call
/// arguments).
pub const RESPONSES_TEXT_EVENTS: [&str; 5] = [
    "response.output_text.delta",
    "response.refusal.delta",
    "response.reasoning_text.delta",
    "response.reasoning_summary_text.delta",
    "response.function_call_arguments.delta",
];

/// Appends the generated text of one parsed event to `out`: the `choices` of a chat or
/// completions chunk, or (`responses`) the `delta` of a Responses text event. Returns whether
/// there was any, or `None` when the event is not one that carries text.
fn event_text(responses: bool, obj: &Map<String, Value>, out: &mut Vec<String>) -> Option<bool> {
    if responses {
        let kind = obj.get("type").and_then(Value::as_str)?;
        if !RESPONSES_TEXT_EVENTS.contains(&kind) {
            return None;
        }
        return Some(match obj.get("delta") {
            Some(Value::String(text)) if !text.is_empty() => {
                out.push(text.clone());
                true
            }
            _ => false,
        });
    }
    match obj.get("choices") {
        Some(Value::Array(choices)) => Some(collect_text(choices, out)),
        _ => None,
    }
}

/// What to do with one event.
#[derive(Debug)]
enum Verdict {
    /// Forward it as it came.
    Keep,
    /// Do not forward it (the usage chunk the gateway asked for).
    Drop,
    /// Forward these bytes instead (the event without its `"usage": null` member).
    Replace(Vec<u8>),
}

/// `event` without its one `"usage": null` member (what an OpenAI-style engine adds to every
/// chunk only because `include_usage` was asked), or `None` when the bytes do not hold exactly
/// one such member in a form that can be cut cleanly (then the event is forwarded as it came).
/// The caller has parsed the event and seen a top-level `"usage": null`; a quote inside a JSON
/// string is escaped, so the unescaped `"usage"` found here is a key.
fn without_null_usage(event: &[u8]) -> Option<Vec<u8>> {
    let ws = |c: &u8| matches!(c, b' ' | b'\t' | b'\r' | b'\n');
    // the first index from `i` that is not JSON whitespace
    let skip = |i: usize| i + event[i..].iter().take_while(|c| ws(c)).count();
    let mut found = None;
    let mut from = 0;
    while let Some(i) = find(event, b"\"usage\"", from) {
        from = i + 7;
        // `"usage"` ws* `:` ws* `null`
        let colon = skip(i + 7);
        if event.get(colon) != Some(&b':') {
            continue;
        }
        let value = skip(colon + 1);
        if !event[value..].starts_with(b"null") {
            continue;
        }
        if found.is_some() {
            return None; // two of them: leave the event alone
        }
        found = Some((i, value + 4));
    }
    let (start, end) = found?;
    let before = start - event[..start].iter().rev().take_while(|c| ws(c)).count();
    let after = skip(end);
    let (cut_from, cut_to) = match (before.checked_sub(1).map(|k| event[k]), event.get(after)) {
        // `, "usage": null` before `}` or `,`: cut from the comma
        (Some(b','), Some(b'}' | b',')) => (before - 1, end),
        // `{"usage": null, ...`: cut through the following comma and its spaces
        (Some(b'{'), Some(b',')) => (start, skip(after + 1)),
        // `{"usage": null}`: the object becomes `{}`
        (Some(b'{'), Some(b'}')) => (start, end),
        _ => return None,
    };
    let mut out = Vec::with_capacity(event.len());
    out.extend_from_slice(&event[..cut_from]);
    out.extend_from_slice(&event[cut_to..]);
    Some(out)
}

/// `prompt_tokens` and `completion_tokens` of a usage object (a Responses usage object's
/// `input_tokens` and `output_tokens`), each only when it is a non-negative integer.
fn usage_counts(usage: &Value) -> (Option<u64>, Option<u64>) {
    let count = |key| usage.get(key).and_then(Value::as_u64);
    (
        count("prompt_tokens").or_else(|| count("input_tokens")),
        count("completion_tokens").or_else(|| count("output_tokens")),
    )
}

/// The top level of a non-streamed response, read for its `usage` only (every other field is
/// skipped without building it).
#[derive(serde::Deserialize)]
struct UsageOnly {
    #[serde(default)]
    usage: Option<Value>,
}

/// `prompt_tokens` and `completion_tokens` of the `usage` object of a non-streamed JSON
/// response body (see [`SseInspector::usage_tokens`]); `None` when the body is not a JSON object
/// or has no usage object.
pub fn body_usage_tokens(body: &[u8]) -> Option<(Option<u64>, Option<u64>)> {
    match serde_json::from_slice::<UsageOnly>(body).ok()?.usage {
        Some(usage @ Value::Object(_)) => Some(usage_counts(&usage)),
        _ => None,
    }
}

/// The payload of a `data:` line, ASCII whitespace trimmed (as Python's `bytes.strip`).
fn data_payload(line: &[u8]) -> Option<&[u8]> {
    line.strip_prefix(b"data:").map(trim)
}

/// Python's `bytes.strip()`: ASCII whitespace including vertical tab and form feed.
fn trim(b: &[u8]) -> &[u8] {
    let ws = |c: &u8| matches!(c, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c);
    let start = b.iter().position(|c| !ws(c)).unwrap_or(b.len());
    let end = b.iter().rposition(|c| !ws(c)).map_or(start, |i| i + 1);
    &b[start..end]
}

/// Lines as Python's `bytes.splitlines()` cuts them: at `\n`, `\r\n` and `\r`.
pub(crate) fn lines(b: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = b;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let i = rest
            .iter()
            .position(|&c| c == b'\n' || c == b'\r')
            .unwrap_or(rest.len());
        let line = &rest[..i];
        let skip = match rest.get(i..i + 2) {
            Some(b"\r\n") => 2,
            _ if i < rest.len() => 1,
            _ => 0,
        };
        rest = &rest[i + skip..];
        Some(line)
    })
}

/// First index of `needle` in `hay` at or after `from`.
fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    hay.get(from..)
        .and_then(|rest| memchr::memmem::find(rest, needle))
        .map(|i| i + from)
}

/// Whether `payload` (one `data:` payload, or several whole events) may hold a non-null
/// `usage` or an `error` key (a cheap byte test; true when unsure). Inside JSON strings a
/// quote is escaped, so `"usage"` in the bytes is a key (or a string value), never generated
/// text; `"usage": null` (every chunk of an OpenAI-style stream that asked for usage) does not
/// count.
fn may_carry_usage_or_error(payload: &[u8]) -> bool {
    if find(payload, b"\"error\"", 0).is_some() {
        return true;
    }
    let mut from = 0;
    while let Some(i) = find(payload, b"\"usage\"", from) {
        let after = &payload[i + 7..payload.len().min(i + 24)];
        let value = trim_start(after, |c| matches!(c, b' ' | b'\t' | b'\r' | b'\n' | b':'));
        if !value.starts_with(b"null") {
            return true;
        }
        from = i + 7;
    }
    false
}

fn trim_start(b: &[u8], strip: impl Fn(u8) -> bool) -> &[u8] {
    let start = b.iter().position(|&c| !strip(c)).unwrap_or(b.len());
    &b[start..]
}

/// Index of the start of the last run of ASCII whitespace in `text` that follows a
/// non-whitespace byte (a character boundary), or `None` when there is none.
fn whitespace_cut(text: &[u8]) -> Option<usize> {
    let ws = |c: u8| matches!(c, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c);
    (1..text.len())
        .rev()
        .find(|&i| ws(text[i]) && !ws(text[i - 1]))
}

/// Appends the generated text of `choices` to `out`; returns whether there was any.
fn collect_text(choices: &[Value], out: &mut Vec<String>) -> bool {
    let mut found = false;
    let mut take = |v: Option<&Value>| {
        if let Some(Value::String(s)) = v {
            if !s.is_empty() {
                out.push(s.clone());
                found = true;
            }
        }
    };
    for choice in choices {
        let Value::Object(choice) = choice else {
            continue;
        };
        take(choice.get("text"));
        let Some(Value::Object(delta)) = choice.get("delta") else {
            continue;
        };
        for key in ["content", "reasoning_content", "reasoning"] {
            take(delta.get(key));
        }
        if let Some(Value::Array(calls)) = delta.get("tool_calls") {
            for call in calls {
                if let Some(Value::Object(f)) = call.get("function") {
                    take(f.get("name"));
                    take(f.get("arguments"));
                }
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(text: &str) -> Vec<u8> {
        format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{}}}}}],\"usage\":null}}\n\n",
            serde_json::to_string(text).unwrap()
        )
        .into_bytes()
    }

    const USAGE: &[u8] =
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n";

    #[test]
    fn an_event_without_an_end_is_cut_off_at_the_event_limit() {
        let mut insp = SseInspector::new(false);
        assert_eq!(insp.feed(&chunk("before")), Fed::Same);
        // an event whose end never comes, fed in 64 KiB pieces: held up to the limit only
        let piece = vec![b'x'; 64 * 1024];
        assert_eq!(insp.feed(b"data: "), Fed::Bytes(Vec::new()));
        let mut fed = 6;
        while !insp.overlong() {
            assert_eq!(insp.feed(&piece), Fed::Bytes(Vec::new()));
            fed += piece.len();
            assert!(insp.buf.len() <= EVENT_LIMIT);
            assert!(fed <= EVENT_LIMIT + piece.len(), "{fed} bytes held");
        }
        assert!(fed > EVENT_LIMIT);
        assert!(insp.buf.is_empty());
        // nothing more is handed out, even whole events
        assert_eq!(insp.feed(&chunk("after")), Fed::Bytes(Vec::new()));
        assert!(insp.buf.is_empty());
        assert!(!insp.done());
        assert_eq!(insp.delivered_text(), ["before"]);
    }

    #[test]
    fn an_event_just_under_the_limit_passes() {
        let mut insp = SseInspector::new(false);
        let text = "y".repeat(EVENT_LIMIT - 200);
        let event = chunk(&text);
        let (head, tail) = event.split_at(event.len() - 10);
        assert_eq!(insp.feed(head), Fed::Bytes(Vec::new()));
        assert_eq!(insp.feed(tail), Fed::Bytes(event.clone()));
        assert!(!insp.overlong());
    }

    #[test]
    fn whole_stream_in_one_read_is_passed_through_and_read() {
        let mut stream = chunk("Hel");
        stream.extend(chunk("lo"));
        stream.extend_from_slice(USAGE);
        stream.extend_from_slice(b"data: [DONE]\n\n");
        let mut insp = SseInspector::new(false);
        assert_eq!(insp.feed(&stream), Fed::Same);
        assert!(insp.done());
        // the text events are still unparsed: the usage chunk carries no text to order after
        // them, and with the engine's usage their text is never asked for
        assert!(!insp.raw.is_empty() && insp.text.is_empty());
        assert_eq!(insp.usage().unwrap()["prompt_tokens"], 3);
        assert_eq!(insp.usage_tokens(), Some((Some(3), Some(2))));
        assert_eq!(insp.delivered_text(), ["Hel", "lo"]);
        assert_eq!(insp.content_chunks(), 2);
    }

    #[test]
    fn usage_chunk_is_stripped_when_asked() {
        let mut stream = chunk("a");
        stream.extend_from_slice(USAGE);
        stream.extend_from_slice(b"data: [DONE]\n\n");
        let mut insp = SseInspector::new(true);
        let Fed::Bytes(out) = insp.feed(&stream) else {
            panic!("a chunk was stripped")
        };
        // the usage chunk is gone, and so is the `"usage":null` the engine added to the others
        let mut want =
            b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n".to_vec();
        want.extend_from_slice(b"data: [DONE]\n\n");
        assert_eq!(out, want);
        assert_eq!(insp.usage().unwrap()["completion_tokens"], 2);
        assert_eq!(insp.delivered_text(), ["a"]);
    }

    #[test]
    fn null_usage_members_are_cut_cleanly_or_left_alone() {
        let cut = |e: &str| without_null_usage(e.as_bytes()).map(|b| String::from_utf8(b).unwrap());
        assert_eq!(
            cut("data: {\"a\":1,\"usage\":null}\n\n").as_deref(),
            Some("data: {\"a\":1}\n\n")
        );
        assert_eq!(
            cut("data: {\"a\": 1, \"usage\": null, \"b\": 2}\n\n").as_deref(),
            Some("data: {\"a\": 1, \"b\": 2}\n\n")
        );
        assert_eq!(
            cut("data: {\"usage\": null, \"b\": 2}\n\n").as_deref(),
            Some("data: {\"b\": 2}\n\n")
        );
        assert_eq!(
            cut("data: {\"usage\":null}\n\n").as_deref(),
            Some("data: {}\n\n")
        );
        // two of them (one nested): left as it came
        assert_eq!(
            cut("data: {\"x\":{\"usage\":null},\"usage\":null}\n\n"),
            None
        );
        // the words inside generated text are escaped: not a key, not cut
        let text = "data: {\"choices\":[{\"delta\":{\"content\":\"say \\\"usage\\\":null\"}}],\"usage\":null}\n\n";
        let out = cut(text).unwrap();
        assert!(out.contains("say \\\"usage\\\":null"), "{out}");
        assert!(out.ends_with("}]}\n\n"), "{out}");
        // through the inspector: stripping on, the text and the JSON survive
        let mut insp = SseInspector::new(true);
        let Fed::Bytes(fed) = insp.feed(text.as_bytes()) else {
            panic!("rewritten")
        };
        let payload = fed.strip_prefix(b"data: ").unwrap();
        let v: Value = serde_json::from_slice(payload.trim_ascii()).unwrap();
        assert!(v.get("usage").is_none());
        assert_eq!(v["choices"][0]["delta"]["content"], "say \"usage\":null");
        // stripping off: untouched
        let mut keep = SseInspector::new(false);
        assert_eq!(keep.feed(text.as_bytes()), Fed::Same);
    }

    #[test]
    fn partial_events_are_held_until_complete() {
        let whole = chunk("xyz");
        let mut insp = SseInspector::new(false);
        assert_eq!(insp.feed(&whole[..10]), Fed::Bytes(Vec::new()));
        assert_eq!(insp.feed(&whole[10..]), Fed::Bytes(whole.clone()));
        assert_eq!(insp.delivered_text(), ["xyz"]);
    }

    #[test]
    fn crlf_and_cr_events_split_like_python() {
        let mut insp = SseInspector::new(false);
        let data = b"data: {\"choices\":[{\"text\":\"a\"}]}\r\n\r\ndata: {\"choices\":[{\"text\":\"b\"}]}\r\r";
        assert_eq!(insp.feed(data), Fed::Same);
        assert_eq!(insp.delivered_text(), ["a", "b"]);
        assert_eq!(
            lines(b"a\r\nb\rc\n\nd").collect::<Vec<_>>(),
            [&b"a"[..], b"b", b"c", b"", b"d"]
        );
        assert_eq!(trim(b" \x0b[DONE]\x0c\t"), b"[DONE]");
    }

    #[test]
    fn error_events_and_garbage() {
        let mut insp = SseInspector::new(false);
        let data =
            b": keep-alive\n\ndata: not json\n\ndata: {\"error\":{\"message\":\"boom\"}}\n\n";
        assert_eq!(insp.feed(data), Fed::Same);
        assert_eq!(insp.error().unwrap()["message"], "boom");
        assert!(!insp.done());
        assert_eq!(insp.flush(), b"");
        let mut tail = SseInspector::new(false);
        assert_eq!(
            tail.feed(b"data: {\"choices\":[{\"text\":\"t\"}]}"),
            Fed::Bytes(Vec::new())
        );
        assert_eq!(tail.flush(), b"data: {\"choices\":[{\"text\":\"t\"}]}");
        assert_eq!(tail.delivered_text(), ["t"]);
    }

    #[test]
    fn usage_of_a_whole_response_body() {
        let body = br#"{"id":"x","choices":[{"message":{"content":"hi \"usage\""}}],
            "usage":{"prompt_tokens":12,"completion_tokens":8,"total_tokens":20}}"#;
        assert_eq!(body_usage_tokens(body), Some((Some(12), Some(8))));
        let odd = br#"{"usage":{"prompt_tokens":-1,"completion_tokens":1.5}}"#;
        assert_eq!(body_usage_tokens(odd), Some((None, None)));
        assert_eq!(body_usage_tokens(br#"{"usage":null}"#), None);
        assert_eq!(body_usage_tokens(br#"{"id":1}"#), None);
        assert_eq!(body_usage_tokens(b"[1,2]"), None);
        assert_eq!(body_usage_tokens(b"not json"), None);
    }

    /// One event of a generated stream: (kind, text).
    fn event(kind: u8, text: &str, sep: &str) -> String {
        let t = serde_json::to_string(text).unwrap();
        match kind % 5 {
            0 => format!("data: {{\"choices\":[{{\"delta\":{{\"content\":{t}}}}}],\"usage\":null}}{sep}"),
            1 => format!("data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":2,\"completion_tokens\":{}}}}}{sep}", text.len()),
            2 => format!(": comment {}{sep}", text.len()),
            3 => format!("data: {{\"error\":{{\"message\":{t}}}}}{sep}"),
            _ => format!("data: {{\"choices\":[{{\"text\":{t}}}]}}{sep}"),
        }
    }

    proptest::proptest! {
        /// Any stream cut at any points gives the same bytes, usage, error, text and chunk
        /// count as the whole stream fed at once; without stripping, the bytes are the input.
        #[test]
        fn any_chunking_matches_one_feed(
            events in proptest::collection::vec((0u8..5, "[a-z \"\\\\]{0,6}"), 0..10),
            crlf in proptest::bool::ANY,
            strip in proptest::bool::ANY,
            cuts in proptest::collection::vec(1usize..300, 0..8),
        ) {
            let sep = if crlf { "\r\n\r\n" } else { "\n\n" };
            let mut raw: String = events.iter().map(|(k, t)| event(*k, t, sep)).collect();
            raw.push_str("data: [DONE]");
            raw.push_str(sep);
            let raw = raw.into_bytes();
            let feed_all = |insp: &mut SseInspector, parts: &[&[u8]]| -> Vec<u8> {
                let mut out = Vec::new();
                for part in parts {
                    match insp.feed(part) {
                        Fed::Same => out.extend_from_slice(part),
                        Fed::Bytes(b) => out.extend(b),
                    }
                }
                out.extend(insp.flush());
                out
            };
            let mut whole = SseInspector::new(strip);
            let want = feed_all(&mut whole, &[&raw]);
            let mut bounds: Vec<usize> = cuts.into_iter().filter(|&c| c < raw.len()).collect();
            bounds.sort_unstable();
            bounds.dedup();
            let mut parts = Vec::new();
            let mut prev = 0;
            for b in bounds.into_iter().chain(std::iter::once(raw.len())) {
                parts.push(&raw[prev..b]);
                prev = b;
            }
            let mut cut = SseInspector::new(strip);
            let got = feed_all(&mut cut, &parts);
            proptest::prop_assert_eq!(&got, &want);
            if !strip {
                proptest::prop_assert_eq!(&got, &raw);
            }
            proptest::prop_assert!(cut.done());
            proptest::prop_assert_eq!(cut.usage(), whole.usage());
            proptest::prop_assert_eq!(cut.error(), whole.error());
            proptest::prop_assert_eq!(cut.delivered_text(), whole.delivered_text());
            proptest::prop_assert_eq!(cut.content_chunks(), whole.content_chunks());
        }
    }

    /// A Responses stream as the engines send it: named events, a `type` in each data.
    fn responses_stream(texts: &[&str], terminal: &str) -> Vec<u8> {
        let mut out = String::new();
        let mut ev = |name: &str, data: serde_json::Value| {
            out.push_str("event: ");
            out.push_str(name);
            out.push_str("\ndata: ");
            out.push_str(&data.to_string());
            out.push_str("\n\n");
        };
        let pending = serde_json::json!({"id": "resp_1", "status": "in_progress", "error": null,
            "usage": null, "output": []});
        ev(
            "response.created",
            serde_json::json!({"type": "response.created", "response": pending}),
        );
        for t in texts {
            ev(
                "response.output_text.delta",
                serde_json::json!({"type": "response.output_text.delta", "item_id": "m",
                    "output_index": 0, "content_index": 0, "delta": t}),
            );
        }
        let whole: String = texts.concat();
        ev(
            "response.output_text.done",
            serde_json::json!({"type": "response.output_text.done", "text": whole}),
        );
        let done = serde_json::json!({"id": "resp_1", "status": "completed", "output": [
            {"type": "message", "content": [{"type": "output_text", "text": whole}]}],
            "usage": {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13}});
        ev(
            terminal,
            serde_json::json!({"type": terminal, "response": done}),
        );
        out.into_bytes()
    }

    #[test]
    fn responses_stream_text_usage_and_end() {
        let raw = responses_stream(&["Hel", "lo", " you"], "response.completed");
        let mut insp = SseInspector::new_responses();
        let mut out = Vec::new();
        for part in raw.chunks(37) {
            match insp.feed(part) {
                Fed::Same => out.extend_from_slice(part),
                Fed::Bytes(b) => out.extend(b),
            }
        }
        out.extend(insp.flush());
        assert_eq!(out, raw, "relayed byte for byte");
        assert!(insp.done(), "response.completed ends the stream");
        assert!(insp.error().is_none());
        assert_eq!(insp.usage_tokens(), Some((Some(9), Some(4))));
        // only the deltas count, never the `done` events that repeat the whole text
        assert_eq!(insp.delivered_text(), ["Hel", "lo", " you"]);
        assert_eq!(insp.content_chunks(), 3);
        // the same stream read as a chat stream finds neither its text nor its end
        let mut chat = SseInspector::new(false);
        assert_eq!(chat.feed(&raw), Fed::Same);
        assert!(!chat.done());
        assert!(chat.delivered_text().is_empty());
    }

    #[test]
    fn responses_terminal_without_usage_still_ends_and_errors_are_seen() {
        let raw = responses_stream(&["a"], "response.incomplete");
        let mut insp = SseInspector::new_responses();
        let text = String::from_utf8(raw).unwrap().replace(
            "\"usage\":{\"input_tokens\":9,\"output_tokens\":4,\"total_tokens\":13}",
            "\"usage\":null",
        );
        assert_eq!(insp.feed(text.as_bytes()), Fed::Same);
        assert!(insp.done());
        assert_eq!(insp.usage_tokens(), None);
        assert_eq!(insp.delivered_text(), ["a"]);
        let mut failed = SseInspector::new_responses();
        failed.feed(b"event: response.failed\ndata: {\"type\":\"response.failed\",\"response\":{\"error\":{\"code\":\"server_error\",\"message\":\"boom\"}}}\n\n");
        assert_eq!(failed.error().unwrap()["message"], "boom");
        let mut error = SseInspector::new_responses();
        error.feed(b"event: error\ndata: {\"type\":\"error\",\"code\":\"x\",\"message\":\"bad\",\"param\":null}\n\n");
        assert_eq!(error.error().unwrap()["message"], "bad");
        assert!(!error.done());
    }

    #[test]
    fn responses_usage_of_a_whole_body() {
        let body = br#"{"id":"resp_1","output":[{"type":"message","content":[{"type":"output_text","text":"hi"}]}],
            "usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":0},"output_tokens":8,"total_tokens":20}}"#;
        assert_eq!(body_usage_tokens(body), Some((Some(12), Some(8))));
    }

    #[test]
    fn nothing_after_done_is_handed_out_or_kept() {
        let mut insp = SseInspector::new(false);
        let mut data = chunk("a");
        data.extend_from_slice(b"data: [DONE]\n\n");
        let want = data.clone();
        data.extend(chunk("late"));
        data.extend_from_slice(b"data: {\"partial");
        assert_eq!(insp.feed(&data), Fed::Bytes(want));
        assert!(insp.done());
        assert_eq!(insp.feed(&chunk("later")), Fed::Bytes(Vec::new()));
        assert_eq!(insp.flush(), b"");
        assert_eq!(insp.delivered_text(), ["a"]);
    }

    #[test]
    fn delivered_text_is_handed_out_in_bounded_pieces_cut_before_whitespace() {
        let mut insp = SseInspector::new(false);
        let mut pieces = Vec::new();
        let mut whole = String::new();
        for i in 0..20_000 {
            let word = format!("w{i} ");
            whole.push_str(&word);
            assert_eq!(insp.feed(&chunk(&word)), Fed::Same);
            while let Some(piece) = insp.take_countable(false) {
                pieces.push(piece);
            }
            assert!(insp.raw.len() <= RAW_LIMIT + 200);
            assert!(insp.text.len() < TEXT_HARD_LIMIT);
        }
        pieces.extend(insp.take_countable(true));
        assert!(pieces.len() > 10);
        for piece in &pieces[1..] {
            assert!(piece.starts_with(' '), "{piece:?}");
        }
        assert_eq!(pieces.concat(), whole);
        assert_eq!(insp.content_chunks(), 20_000);
        // no whitespace at all: cut at a character boundary past the hard limit
        let mut cjk = SseInspector::new(false);
        let mut got = String::new();
        for _ in 0..10_000 {
            cjk.feed(&chunk("語"));
            while let Some(piece) = cjk.take_countable(false) {
                got.push_str(&piece);
            }
            assert!(cjk.text.len() < TEXT_HARD_LIMIT + 200);
        }
        got.extend(cjk.take_countable(true));
        assert_eq!(got, "語".repeat(10_000));
    }

    #[test]
    fn a_large_read_leaves_no_large_buffer_behind() {
        // a gateway behind a fast engine reads 128 KiB at once, ending inside an event; once
        // its text is counted, what the inspector keeps allocated is back to a few KiB
        let event = chunk(" tok");
        let mut big: Vec<u8> = event.repeat(2_000);
        big.extend_from_slice(&event[..20]);
        let mut insp = SseInspector::new(false);
        let out = insp.feed(&big);
        assert_eq!(out, Fed::Bytes(event.repeat(2_000)));
        while insp.take_countable(false).is_some() {}
        assert_eq!(insp.buf.len(), 20);
        assert!(
            insp.buf.capacity() <= HELD_CAPACITY,
            "{}",
            insp.buf.capacity()
        );
        assert!(
            insp.raw.capacity() <= 2 * RAW_LIMIT,
            "{}",
            insp.raw.capacity()
        );
        assert!(
            insp.text.capacity() <= TEXT_HARD_LIMIT,
            "{}",
            insp.text.capacity()
        );
        assert!(
            insp.ends.capacity() <= HELD_ENDS,
            "{}",
            insp.ends.capacity()
        );
        // and the stream goes on as before: the rest of the event, then the next ones
        assert_eq!(insp.feed(&event[20..]), Fed::Bytes(event.clone()));
        assert_eq!(insp.feed(&event), Fed::Same);
        let mut text: String = std::iter::from_fn(|| insp.take_countable(false)).collect();
        text.extend(insp.take_countable(true));
        assert!(text.ends_with(" tok tok"), "{text:?}");
        assert_eq!(insp.content_chunks(), 2_002);
    }

    #[test]
    fn usage_words_inside_text_are_only_text() {
        assert!(!may_carry_usage_or_error(&chunk(
            "\"usage\": {} and \"error\""
        )));
        assert!(may_carry_usage_or_error(b"{\"usage\" : {\"a\":1}}"));
        assert!(!may_carry_usage_or_error(
            b"{\"usage\":null,\"x\":{\"usage\": null}}"
        ));
    }
}
