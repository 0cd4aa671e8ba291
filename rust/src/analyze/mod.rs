//! Request analysis: what a request will cost before it reaches a GPU, and refusal of what can
//! never fit.
//!
//! What: for `POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and
//! `/v1/responses` bodies, read the OpenAI fields that set the cost (`model`, `messages` /
//! `prompt` / `input` / `instructions`, `max_tokens` / `max_completion_tokens` /
//! `max_output_tokens`, `n`, `best_of`, `stream`, `stream_options.include_usage`), count the
//! prompt tokens with the model's tokenizer, and compute the TPM reservation
//! (prompt + completion tokens reserved up front, reconciled with the real usage later).
//!
//! Inputs: the raw body bytes and the route. Config: [`AnalyzerConfig`] per model.
//!
//! Rules:
//! - completion reservation = the per-choice cap × n, where n is `max(n, best_of)` on
//!   `/v1/completions`, × the number of prompts for a batched prompt. The cap is
//!   `max_completion_tokens`, else `max_tokens` on chat (OpenAI deprecated `max_tokens` there;
//!   vLLM and SGLang read `max_completion_tokens` first), and `max_tokens`, else
//!   `max_completion_tokens` on `/v1/completions` (the legacy API's field). A body with both
//!   has the other one dropped before forwarding ([`Analysis::drop_cap`]): engines differ in
//!   which one they read (TGI takes the two as one field), so the engine sees the cap reserved;
//! - both absent: `default_max_tokens` if configured (capped at the room left in the window,
//!   and reported in [`Analysis::inject_max_tokens`] so the gateway writes it into the forwarded
//!   body), else the rest of the window, `context_window − prompt_tokens`, per choice (what
//!   vLLM, SGLang and TGI allow);
//! - `prompt ≥ context_window`, or `prompt + max_tokens > context_window` → 400
//!   `context_length_exceeded`;
//! - embeddings reserve no completion; each input must fit the window by itself;
//! - Responses (`/v1/responses`) is counted as the chat conversation it renders as
//!   ([`responses::as_chat`]) and reserves `max_output_tokens` (absent: as chat), `n` = 1.
//!
//! Counting ([`Counting`]): a chat template, when configured, is rendered and the result counted
//! without adding special tokens (the template writes them, as in vLLM), with the body's
//! `chat_template_kwargs`, `add_generation_prompt` and `continue_final_message` applied as vLLM
//! applies them; without one, each
//! message costs its text tokens plus `per_message_overhead`. Raw prompts and embedding inputs
//! are counted with the tokenizer's special tokens (BOS/EOS post-processor), as engines encode
//! them. Image parts cost `image_tokens`, audio parts `audio_tokens`.
//!
//! Trade-offs: the body is parsed once into a `serde_json::Value` (simple and robust; a body is at
//! most `max_body_bytes`); a body over the cap is refused before parsing.

// Product names in prose (OpenAI, HuggingFace, serde_json) are not code identifiers.
#![allow(clippy::doc_markdown)]
// `match` on an Option with two substantial arms reads better than `if let ... else` here.
#![allow(clippy::single_match_else)]

pub mod body;
pub mod chat;
pub mod count;
pub mod error;
pub mod responses;

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;

pub use body::Obj;
pub use chat::{ChatTemplate, RenderOptions};
pub use count::Counter;
pub use error::AnalysisError;

/// OpenAI's documented maximum for `n` (openapi.yaml `CreateChatCompletionRequest.n`).
pub const MAX_N: u64 = 128;
/// OpenAI's documented maximum number of embedding inputs per request.
pub const MAX_EMBEDDING_INPUTS: usize = 2048;
/// Default body cap in bytes: 32 MiB, far above any 1M-token prompt in JSON.
pub const DEFAULT_MAX_BODY_BYTES: u64 = 32 * 1024 * 1024;

/// The routes whose bodies are analysed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions` (legacy).
    Completions,
    /// `POST /v1/embeddings`.
    Embeddings,
    /// `POST /v1/responses` (OpenAI's Responses API).
    Responses,
}

impl Route {
    /// Parses a request path (query string ignored; the `/v1` prefix is optional).
    pub fn parse(path: &str) -> Option<Self> {
        let path = path
            .split('?')
            .next()
            .unwrap_or_default()
            .trim_end_matches('/');
        let path = path.strip_prefix("/v1").unwrap_or(path);
        match path {
            "/chat/completions" => Some(Self::Chat),
            "/completions" => Some(Self::Completions),
            "/embeddings" => Some(Self::Embeddings),
            "/responses" => Some(Self::Responses),
            _ => None,
        }
    }

    /// The canonical path, e.g. `/v1/chat/completions`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
            Self::Embeddings => "/v1/embeddings",
            Self::Responses => "/v1/responses",
        }
    }
}

/// How `prompt_tokens` was counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counting {
    /// Chat: the rendered chat template, counted exactly with the tokenizer.
    ChatTemplate,
    /// Chat without a template: content tokens (exact) + `per_message_overhead` per message.
    Overhead,
    /// Completions / embeddings: the prompt or input counted exactly with the tokenizer.
    Tokenizer,
    /// No tokenizer configured: `ceil(utf8_bytes / 4)` per text (plus the overhead for chat).
    Estimate,
}

impl Counting {
    /// `"chat_template"`, `"overhead"`, `"tokenizer"` or `"estimate"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ChatTemplate => "chat_template",
            Self::Overhead => "overhead",
            Self::Tokenizer => "tokenizer",
            Self::Estimate => "estimate",
        }
    }
}

/// Per-model settings.
#[derive(Debug, Clone)]
pub struct AnalyzerConfig {
    /// The model name clients send in `model`.
    pub model: String,
    /// Context window in tokens (prompt + completion), e.g. vLLM's `max_model_len`.
    pub context_window: u64,
    /// Chat without a template: tokens added per message for role and delimiters.
    pub per_message_overhead: u64,
    /// Tokens charged per image content part.
    pub image_tokens: u64,
    /// Tokens charged per audio content part.
    pub audio_tokens: u64,
    /// Completion tokens to reserve (and inject) when the request sets no limit.
    pub default_max_tokens: Option<u64>,
    /// Cap on the raw body, in bytes (413 above it).
    pub max_body_bytes: u64,
}

impl AnalyzerConfig {
    /// A config with the defaults: overhead 4, image 765 (OpenAI's high-detail 512×512 tile
    /// price, 85 + 170 × 4), audio 200, no default max tokens, a 32 MiB body cap.
    pub fn new(model: impl Into<String>, context_window: u64) -> Self {
        Self {
            model: model.into(),
            context_window,
            per_message_overhead: 4,
            image_tokens: 765,
            audio_tokens: 200,
            default_max_tokens: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        }
    }
}

/// What a request costs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Analysis {
    /// The body's `model`.
    pub model: String,
    /// The route analysed.
    pub route: Route,
    /// Prompt tokens (summed over the prompts of a batched completions / embeddings request).
    pub prompt_tokens: u64,
    /// Completion tokens reserved (per-choice limit × n × prompts; 0 for embeddings).
    pub completion_tokens: u64,
    /// Choices generated per prompt: `n`, or `max(n, best_of)` on `/v1/completions`.
    pub n: u64,
    /// `stream` in the body.
    pub stream: bool,
    /// `stream_options.include_usage` in the body.
    pub include_usage: bool,
    /// None of the members the gateway may add to the forwarded body — `stream` (it adds none
    /// when the body has `"stream": true`), `stream_options` and the output cap (`max_tokens`;
    /// `max_output_tokens` on Responses) — is in the body, whatever its value: they can be
    /// spliced in without parsing it again.
    pub addable: bool,
    /// `prompt_tokens + completion_tokens`: the TPM / in-flight reservation.
    pub reserved_tokens: u64,
    /// When `default_max_tokens` was applied: the per-choice limit the gateway must write into
    /// the forwarded body as `max_tokens` (`max_output_tokens` on `/v1/responses`).
    pub inject_max_tokens: Option<u64>,
    /// How the prompt was counted.
    pub counting: Counting,
    /// The completion cap the gateway must remove from the forwarded body
    /// (`"max_tokens"` or `"max_completion_tokens"`): the body had both keys and the other one
    /// was reserved, so the engine receives exactly the cap kvgate reserved for.
    pub drop_cap: Option<&'static str>,
}

/// One model's analyser: tokenizer, optional chat template, limits. Immutable and `Sync`.
pub struct RequestAnalyzer {
    cfg: AnalyzerConfig,
    counter: Counter,
    template: Option<ChatTemplate>,
}

/// Refuses a body over the cap from its declared `Content-Length`, before any byte is read.
/// Also call it with the running byte count while reading a chunked body.
pub fn check_content_length(
    content_length: Option<u64>,
    max_body_bytes: u64,
) -> Result<(), AnalysisError> {
    match content_length {
        Some(n) if n > max_body_bytes => Err(AnalysisError::too_large(n, max_body_bytes)),
        _ => Ok(()),
    }
}

/// Reads only `model` from a body (the rest is skipped without building values).
pub fn peek_model(body: &[u8]) -> Result<String, AnalysisError> {
    /// The body's `model` member (the last one when the key repeats, as a full parse keeps);
    /// every other value is skipped without being built.
    struct Peek {
        model: Option<Value>,
    }
    impl<'de> serde::Deserialize<'de> for Peek {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Visit;
            impl<'de> serde::de::Visitor<'de> for Visit {
                type Value = Peek;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    mut map: A,
                ) -> Result<Peek, A::Error> {
                    let mut model = None;
                    while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                        if key == "model" {
                            model = Some(map.next_value::<Value>()?);
                        } else {
                            map.next_value::<serde::de::IgnoredAny>()?;
                        }
                    }
                    Ok(Peek { model })
                }
            }
            d.deserialize_map(Visit)
        }
    }
    let peek: Peek = body::parse_lenient(body).map_err(|e| {
        if e.is_data() {
            AnalysisError::bad(
                None,
                "invalid_type",
                "The request body must be a JSON object.",
            )
        } else {
            AnalysisError::invalid_json(e)
        }
    })?;
    match peek.model {
        None => Err(AnalysisError::missing("model")),
        Some(Value::String(s)) => Ok(s),
        Some(v) => Err(AnalysisError::invalid_type("model", "a string", &v)),
    }
}

/// The per-choice completion cap a body asks for, and the other cap key to drop from the
/// forwarded body when it has both (see the module rules): on chat `max_completion_tokens`
/// wins, on `/v1/completions` `max_tokens`. Both are validated as integers in
/// `1..=2**62` (larger is never needed: the context check refuses anything over the window).
fn completion_cap(
    route: Route,
    obj: &Obj,
) -> Result<(Option<u64>, Option<&'static str>), AnalysisError> {
    const MT: &str = "max_tokens";
    const MCT: &str = "max_completion_tokens";
    let max = crate::error::MAX_AMOUNT;
    if route == Route::Responses {
        // the Responses API has one cap of its own; chat's keys mean nothing there
        return Ok((body::opt_uint(obj, "max_output_tokens", 1, max)?, None));
    }
    let mct = body::opt_uint(obj, MCT, 1, max)?;
    let mt = body::opt_uint(obj, MT, 1, max)?;
    let ((first, first_key), (second, other_key)) = if route == Route::Completions {
        ((mt, MT), (mct, MCT))
    } else {
        ((mct, MCT), (mt, MT))
    };
    Ok(match (first, second) {
        (Some(m), _) => (Some(m), obj.contains_key(other_key).then_some(other_key)),
        (None, Some(m)) => (Some(m), obj.contains_key(first_key).then_some(first_key)),
        (None, None) => (None, None),
    })
}

impl RequestAnalyzer {
    /// Builds an analyser. Fails on a zero context window.
    pub fn new(
        cfg: AnalyzerConfig,
        counter: Counter,
        template: Option<ChatTemplate>,
    ) -> Result<Self, String> {
        if cfg.context_window == 0 {
            return Err("context_window must be at least 1 token".into());
        }
        let max = crate::error::MAX_AMOUNT;
        for (name, value) in [
            ("context_window", cfg.context_window),
            ("per_message_overhead", cfg.per_message_overhead),
            ("image_tokens", cfg.image_tokens),
            ("audio_tokens", cfg.audio_tokens),
            ("default_max_tokens", cfg.default_max_tokens.unwrap_or(0)),
        ] {
            if value > max {
                return Err(format!("{name} must be at most 2**62 tokens (got {value})"));
            }
        }
        if cfg.default_max_tokens == Some(0) {
            return Err("default_max_tokens must be at least 1 token".into());
        }
        Ok(Self {
            cfg,
            counter,
            template,
        })
    }

    /// The settings.
    pub fn config(&self) -> &AnalyzerConfig {
        &self.cfg
    }

    /// Whether a chat template is configured.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Whether counts come from a tokenizer (else the byte estimate).
    pub fn has_tokenizer(&self) -> bool {
        self.counter.is_exact()
    }

    /// Tokens in a piece of generated text (no special tokens added): the tokenizer's count,
    /// or the byte estimate without one. The gateway uses it to settle a stream whose engine
    /// sent no usage.
    pub fn count_text(&self, text: &str) -> Result<u64, AnalysisError> {
        self.counter.count(text, false)
    }

    /// Analyses a raw body: size cap, JSON, `model` must equal this analyser's model (else 404),
    /// fields, count, context check.
    pub fn analyze(&self, route: &str, body: &[u8]) -> Result<Analysis, AnalysisError> {
        let route = Route::parse(route).ok_or_else(|| AnalysisError::unknown_route(route))?;
        check_content_length(Some(body.len() as u64), self.cfg.max_body_bytes)?;
        let obj = body::parse_object(body)?;
        let model = body::req_str(&obj, "model", "model")?;
        if model != self.cfg.model {
            return Err(AnalysisError::model_not_found(model));
        }
        self.analyze_object(route, &obj)
    }

    /// Analyses an already parsed body (its `model` is taken as is).
    #[allow(clippy::too_many_lines)] // one linear pass over the fields, clearer unsplit
    pub fn analyze_object(&self, route: Route, obj: &Obj) -> Result<Analysis, AnalysisError> {
        let model = body::req_str(obj, "model", "model")?.to_owned();
        let (stream, include_usage) = if route == Route::Embeddings {
            (false, false)
        } else if route == Route::Responses {
            // usage always comes with `response.completed`: there is no include_usage to ask
            (
                body::opt_bool(obj, "stream", "stream")?.unwrap_or(false),
                false,
            )
        } else {
            let stream = body::opt_bool(obj, "stream", "stream")?.unwrap_or(false);
            let include_usage = match obj.get("stream_options") {
                None | Some(Value::Null) => false,
                Some(Value::Object(o)) => {
                    body::opt_bool(o, "include_usage", "stream_options.include_usage")?
                        .unwrap_or(false)
                }
                Some(v) => {
                    return Err(AnalysisError::invalid_type(
                        "stream_options",
                        "an object",
                        v,
                    ))
                }
            };
            (stream, include_usage)
        };
        let (prompts, counting, what, param) = match route {
            Route::Chat => {
                let (p, c) = self.chat_prompt(obj)?;
                (vec![p], c, "messages", "messages")
            }
            Route::Completions => {
                let p = self.prompt_counts(obj, "prompt", false)?;
                (p, self.plain_counting(), "prompt", "prompt")
            }
            Route::Embeddings => {
                let p = self.prompt_counts(obj, "input", true)?;
                (p, self.plain_counting(), "input", "input")
            }
            Route::Responses => {
                let (p, c) = self.chat_prompt(&responses::as_chat(obj)?)?;
                (vec![p], c, "input", "input")
            }
        };
        let prompt_tokens = prompts.iter().fold(0u64, |a, p| a.saturating_add(*p));
        let window = self.cfg.context_window;
        let longest = prompts.iter().copied().max().unwrap_or(0);

        if route == Route::Embeddings {
            if longest > window {
                return Err(AnalysisError::context_length(
                    param, what, window, longest, None,
                ));
            }
            return Ok(Analysis {
                model,
                route,
                prompt_tokens,
                completion_tokens: 0,
                n: 1,
                stream,
                include_usage,
                addable: false,
                reserved_tokens: prompt_tokens,
                inject_max_tokens: None,
                counting,
                drop_cap: None,
            });
        }

        let n = if route == Route::Responses {
            1
        } else {
            body::opt_uint(obj, "n", 1, MAX_N)?.unwrap_or(1)
        };
        let n = if route == Route::Completions {
            let best_of = body::opt_uint(obj, "best_of", 1, MAX_N)?;
            if let Some(b) = best_of {
                if b < n {
                    return Err(AnalysisError::invalid_value(
                        "best_of",
                        format!("Invalid 'best_of': must be >= n ({n}), but got {b}."),
                    ));
                }
            }
            best_of.unwrap_or(n)
        } else {
            n
        };
        let limit_key = if route == Route::Responses {
            "max_output_tokens"
        } else {
            "max_tokens"
        };
        let (requested, drop_cap) = completion_cap(route, obj)?;
        let per_prompt = |per_choice: u64| per_choice.saturating_mul(n);
        let (completion_tokens, inject_max_tokens) = match requested {
            Some(m) => {
                if longest.saturating_add(m) > window {
                    return Err(AnalysisError::context_length(
                        param,
                        what,
                        window,
                        longest,
                        Some(m),
                    ));
                }
                (per_prompt(m).saturating_mul(prompts.len() as u64), None)
            }
            None => {
                if longest >= window {
                    return Err(AnalysisError::context_length(
                        param, what, window, longest, None,
                    ));
                }
                match self.cfg.default_max_tokens {
                    Some(d) => {
                        let inj = d.min(window - longest);
                        (
                            per_prompt(inj).saturating_mul(prompts.len() as u64),
                            Some(inj),
                        )
                    }
                    None => (
                        prompts
                            .iter()
                            .fold(0u64, |a, p| a.saturating_add(per_prompt(window - p))),
                        None,
                    ),
                }
            }
        };
        let reserved_tokens = prompt_tokens.saturating_add(completion_tokens);
        if reserved_tokens > crate::error::MAX_AMOUNT {
            // n × max_tokens × prompts past what any limit can account for
            return Err(AnalysisError::invalid_value(
                limit_key,
                format!(
                    "This request would reserve {reserved_tokens} tokens (prompt + {limit_key} × \
                     n per prompt), more than 2**62; lower {limit_key} or n."
                ),
            ));
        }
        // `"stream": true`: the gateway adds no `stream` to a streamed request
        let addable = matches!(obj.get("stream"), None | Some(Value::Bool(true)))
            && !obj.contains_key("stream_options")
            && !obj.contains_key(limit_key);
        Ok(Analysis {
            model,
            route,
            prompt_tokens,
            completion_tokens,
            n,
            stream,
            include_usage,
            addable,
            reserved_tokens,
            inject_max_tokens,
            counting,
            drop_cap,
        })
    }

    fn plain_counting(&self) -> Counting {
        if self.counter.is_exact() {
            Counting::Tokenizer
        } else {
            Counting::Estimate
        }
    }

    /// Prompt tokens of a chat body, and how they were counted.
    fn chat_prompt(&self, obj: &Obj) -> Result<(u64, Counting), AnalysisError> {
        let messages = match obj.get("messages") {
            None => return Err(AnalysisError::missing("messages")),
            Some(Value::Array(a)) => a,
            Some(v) => return Err(AnalysisError::invalid_type("messages", "an array", v)),
        };
        if messages.is_empty() {
            return Err(AnalysisError::bad(
                Some("messages"),
                "empty_array",
                "Invalid 'messages': empty array. Expected an array with minimum length 1, but \
                 got an empty array instead.",
            ));
        }
        let tools = body::opt_array(obj, "tools", "tools")?;
        let functions = body::opt_array(obj, "functions", "functions")?;
        let (opts, continue_final_message) = template_inputs(obj)?;
        let mut media = 0u64;
        let mut parsed = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let msg = self.chat_message(i, m, &mut media)?;
            parsed.push(msg);
        }
        match &self.template {
            Some(tpl) => {
                let values: Vec<minijinja::Value> =
                    parsed.iter().map(ChatMessage::template_value).collect();
                let tools_value = tools.map(|t| chat::to_value(&Value::Array(t.clone())));
                let mut rendered =
                    tpl.render_with(minijinja::Value::from(values), tools_value, &opts)?;
                if continue_final_message {
                    let end = continued_end(&rendered, parsed.last())?;
                    rendered.truncate(end);
                }
                let count = self.counter.count(&rendered, false)?;
                let counting = if self.counter.is_exact() {
                    Counting::ChatTemplate
                } else {
                    Counting::Estimate
                };
                Ok((count.saturating_add(media), counting))
            }
            None => {
                let mut pieces: Vec<Cow<'_, str>> = Vec::with_capacity(parsed.len() + 2);
                for m in &parsed {
                    if let Some(t) = &m.text {
                        pieces.push(Cow::Borrowed(t.as_ref()));
                    }
                    if let Some(name) = m.name {
                        pieces.push(Cow::Borrowed(name));
                    }
                    if let Some(tc) = m.tool_calls {
                        pieces.push(Cow::Owned(body::compact(tc)));
                    }
                    if let Some(fc) = m.function_call {
                        pieces.push(Cow::Owned(body::compact(fc)));
                    }
                }
                for defs in [tools, functions].into_iter().flatten() {
                    if !defs.is_empty() {
                        pieces.push(Cow::Owned(serde_json::to_string(defs).unwrap_or_default()));
                    }
                }
                let refs: Vec<&str> = pieces.iter().map(AsRef::as_ref).collect();
                let counts = self.counter.count_many(&refs, false)?;
                let total = counts
                    .iter()
                    .fold(media, |a, c| a.saturating_add(*c))
                    .saturating_add(
                        self.cfg
                            .per_message_overhead
                            .saturating_mul(parsed.len() as u64),
                    );
                let counting = if self.counter.is_exact() {
                    Counting::Overhead
                } else {
                    Counting::Estimate
                };
                Ok((total, counting))
            }
        }
    }

    /// Validates one chat message and collects what is counted.
    fn chat_message<'a>(
        &self,
        i: usize,
        m: &'a Value,
        media: &mut u64,
    ) -> Result<ChatMessage<'a>, AnalysisError> {
        let Value::Object(obj) = m else {
            return Err(AnalysisError::invalid_type(
                &format!("messages[{i}]"),
                "an object",
                m,
            ));
        };
        let role = body::req_str(obj, "role", &format!("messages[{i}].role"))?;
        let text: Option<Cow<'a, str>> = match obj.get("content") {
            Some(Value::String(s)) => Some(Cow::Borrowed(s.as_str())),
            None | Some(Value::Null) if role == "assistant" => None,
            None => return Err(AnalysisError::missing(&format!("messages[{i}].content"))),
            Some(Value::Array(parts)) => Some(self.content_parts(i, parts, media)?),
            Some(v) => {
                return Err(AnalysisError::invalid_type(
                    &format!("messages[{i}].content"),
                    "a string or an array of content parts",
                    v,
                ))
            }
        };
        let name = body::opt_str(obj, "name", &format!("messages[{i}].name"))?;
        let tool_calls = match obj.get("tool_calls") {
            None | Some(Value::Null) => None,
            Some(v @ Value::Array(_)) => Some(v),
            Some(v) => {
                return Err(AnalysisError::invalid_type(
                    &format!("messages[{i}].tool_calls"),
                    "an array",
                    v,
                ))
            }
        };
        let function_call = match obj.get("function_call") {
            None | Some(Value::Null) => None,
            Some(v @ Value::Object(_)) => Some(v),
            Some(v) => {
                return Err(AnalysisError::invalid_type(
                    &format!("messages[{i}].function_call"),
                    "an object",
                    v,
                ))
            }
        };
        Ok(ChatMessage {
            obj,
            text,
            name,
            tool_calls,
            function_call,
        })
    }

    /// Joins the text parts of a content array with `"\n"` (vLLM's "string" content format) and
    /// charges media parts to `media`.
    fn content_parts<'a>(
        &self,
        i: usize,
        parts: &'a [Value],
        media: &mut u64,
    ) -> Result<Cow<'a, str>, AnalysisError> {
        let mut texts: Vec<&'a str> = Vec::new();
        for (j, part) in parts.iter().enumerate() {
            let Value::Object(p) = part else {
                return Err(AnalysisError::invalid_type(
                    &format!("messages[{i}].content[{j}]"),
                    "an object",
                    part,
                ));
            };
            let ty = body::req_str(p, "type", &format!("messages[{i}].content[{j}].type"))?;
            match ty {
                "text" | "input_text" => {
                    texts.push(body::req_str(
                        p,
                        "text",
                        &format!("messages[{i}].content[{j}].text"),
                    )?);
                }
                "refusal" => texts.push(body::req_str(
                    p,
                    "refusal",
                    &format!("messages[{i}].content[{j}].refusal"),
                )?),
                "image_url" | "input_image" | "image" => {
                    *media = media.saturating_add(self.cfg.image_tokens);
                }
                "input_audio" | "audio_url" => {
                    *media = media.saturating_add(self.cfg.audio_tokens);
                }
                other => {
                    return Err(AnalysisError::invalid_value(
                        &format!("messages[{i}].content[{j}].type"),
                        format!(
                            "Invalid content part type '{other}': expected one of 'text', \
                             'image_url', 'input_audio', 'refusal'."
                        ),
                    ))
                }
            }
        }
        Ok(match texts.as_slice() {
            [] => Cow::Borrowed(""),
            [one] => Cow::Borrowed(one),
            many => Cow::Owned(many.join("\n")),
        })
    }

    /// Token counts of each prompt in `prompt` / `input`: a string, strings, token ids, or
    /// lists of token ids.
    fn prompt_counts(
        &self,
        obj: &Obj,
        key: &str,
        embeddings: bool,
    ) -> Result<Vec<u64>, AnalysisError> {
        const EXPECTED: &str =
            "a string, an array of strings, an array of integers, or an array of arrays of integers";
        let Some(v) = obj.get(key) else {
            return Err(AnalysisError::missing(key));
        };
        let empty_string = || {
            AnalysisError::invalid_value(
                key,
                format!("Invalid '{key}': empty string. Expected a non-empty string."),
            )
        };
        match v {
            Value::String(s) => {
                if embeddings && s.is_empty() {
                    return Err(empty_string());
                }
                Ok(vec![self.counter.count(s, true)?])
            }
            Value::Array(items) => {
                if items.is_empty() {
                    return Err(AnalysisError::bad(
                        Some(key),
                        "empty_array",
                        format!(
                            "Invalid '{key}': empty array. Expected an array with minimum length \
                             1, but got an empty array instead."
                        ),
                    ));
                }
                if embeddings && items.len() > MAX_EMBEDDING_INPUTS {
                    return Err(AnalysisError::invalid_value(
                        key,
                        format!(
                            "Invalid '{key}': array too long. Expected at most \
                             {MAX_EMBEDDING_INPUTS} items, but got {}.",
                            items.len()
                        ),
                    ));
                }
                match &items[0] {
                    Value::String(_) => {
                        let mut texts = Vec::with_capacity(items.len());
                        for item in items {
                            match item {
                                Value::String(s) if embeddings && s.is_empty() => {
                                    return Err(empty_string())
                                }
                                Value::String(s) => texts.push(s.as_str()),
                                other => {
                                    return Err(AnalysisError::invalid_type(key, EXPECTED, other))
                                }
                            }
                        }
                        self.counter.count_many(&texts, true)
                    }
                    Value::Number(_) => Ok(vec![self.token_ids(key, items)?]),
                    Value::Array(_) => items
                        .iter()
                        .map(|item| match item {
                            Value::Array(ids) if !ids.is_empty() => self.token_ids(key, ids),
                            Value::Array(_) => Err(AnalysisError::bad(
                                Some(key),
                                "empty_array",
                                format!("Invalid '{key}': a token-id list is empty."),
                            )),
                            other => Err(AnalysisError::invalid_type(key, EXPECTED, other)),
                        })
                        .collect(),
                    other => Err(AnalysisError::invalid_type(key, EXPECTED, other)),
                }
            }
            other => Err(AnalysisError::invalid_type(key, EXPECTED, other)),
        }
    }

    /// Validates a token-id list (non-negative integers below the vocabulary size) and returns
    /// its length.
    fn token_ids(&self, key: &str, ids: &[Value]) -> Result<u64, AnalysisError> {
        let vocab = self.counter.vocab_size();
        for id in ids {
            let ok = id.as_u64().is_some_and(|x| vocab.map_or(true, |v| x < v));
            if !ok {
                return Err(AnalysisError::invalid_value(
                    key,
                    format!(
                        "Invalid '{key}': token ids must be integers in [0, {}), got {id}.",
                        vocab.map_or_else(|| "2^64".to_owned(), |v| v.to_string())
                    ),
                ));
            }
        }
        Ok(ids.len() as u64)
    }
}

/// What a chat body sets for its template: `add_generation_prompt` (default true, false
/// when the final message is continued), `chat_template_kwargs` (an object), and whether
/// `continue_final_message` is set. Validated with or without a template.
fn template_inputs(obj: &Obj) -> Result<(RenderOptions<'_>, bool), AnalysisError> {
    let add_generation_prompt =
        body::opt_bool(obj, "add_generation_prompt", "add_generation_prompt")?;
    let continue_final_message =
        body::opt_bool(obj, "continue_final_message", "continue_final_message")?.unwrap_or(false);
    if continue_final_message && add_generation_prompt == Some(true) {
        // vLLM refuses the pair the same way (a generation prompt after a message that is
        // to be continued makes no sense)
        return Err(AnalysisError::invalid_value(
            "continue_final_message",
            "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true.",
        ));
    }
    let kwargs = match obj.get("chat_template_kwargs") {
        None | Some(Value::Null) => None,
        Some(Value::Object(o)) => Some(o),
        Some(v) => {
            return Err(AnalysisError::invalid_type(
                "chat_template_kwargs",
                "an object",
                v,
            ))
        }
    };
    let opts = RenderOptions {
        add_generation_prompt: add_generation_prompt.unwrap_or(!continue_final_message),
        kwargs,
    };
    Ok((opts, continue_final_message))
}

/// Where the rendered prompt ends when the final message is continued: right after the last
/// occurrence of that message's text (stripped of surrounding whitespace), so the template's
/// end-of-turn tokens after it are not counted. This is transformers' `continue_final_message`
/// rule, which vLLM applies.
fn continued_end(rendered: &str, last: Option<&ChatMessage<'_>>) -> Result<usize, AnalysisError> {
    let text = last
        .and_then(|m| m.text.as_deref())
        .unwrap_or_default()
        .trim();
    match rendered.rfind(text) {
        Some(at) => Ok(at + text.len()),
        None => Err(AnalysisError::bad(
            Some("continue_final_message"),
            "chat_template_error",
            "continue_final_message is set but the final message's text does not appear in the \
             prompt the chat template renders, so it cannot be continued.",
        )),
    }
}

/// A validated chat message, borrowing from the body.
struct ChatMessage<'a> {
    obj: &'a Obj,
    text: Option<Cow<'a, str>>,
    name: Option<&'a str>,
    tool_calls: Option<&'a Value>,
    function_call: Option<&'a Value>,
}

impl ChatMessage<'_> {
    /// The message as the template sees it: keys in body order, `content` as one string (or
    /// none), tool-call `arguments` given as a JSON string parsed into an object (as vLLM does
    /// before rendering).
    fn template_value(&self) -> minijinja::Value {
        let mut entries = Vec::with_capacity(self.obj.len());
        for (k, v) in self.obj {
            let value = match k.as_str() {
                "content" => match &self.text {
                    Some(t) => minijinja::Value::from(t.as_ref()),
                    None => minijinja::Value::from(()),
                },
                "tool_calls" => match v {
                    Value::Array(calls) => minijinja::Value::from(
                        calls.iter().map(tool_call_value).collect::<Vec<_>>(),
                    ),
                    _ => chat::to_value(v),
                },
                _ => chat::to_value(v),
            };
            entries.push((minijinja::Value::from(k.as_str()), value));
        }
        minijinja::Value::from_object(chat::OrderedMap(entries))
    }
}

fn tool_call_value(call: &Value) -> minijinja::Value {
    let args = call
        .get("function")
        .and_then(|f| f.get("arguments"))
        .and_then(Value::as_str)
        .and_then(|s| serde_json::from_str::<Value>(s).ok())
        .filter(Value::is_object);
    match (call, args) {
        (Value::Object(c), Some(parsed)) => {
            let mut c = c.clone();
            if let Some(Value::Object(f)) = c.get_mut("function") {
                f.insert("arguments".to_owned(), parsed);
            }
            chat::to_value(&Value::Object(c))
        }
        _ => chat::to_value(call),
    }
}

/// Several models' analysers, chosen by the body's `model` (unknown → 404 `model_not_found`).
#[derive(Clone, Default)]
pub struct ModelRegistry {
    analyzers: HashMap<String, Arc<RequestAnalyzer>>,
    max_body_bytes: u64,
}

impl ModelRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the analyser for its model name.
    pub fn insert(&mut self, analyzer: Arc<RequestAnalyzer>) {
        self.analyzers.insert(analyzer.cfg.model.clone(), analyzer);
        self.max_body_bytes = self
            .analyzers
            .values()
            .map(|a| a.cfg.max_body_bytes)
            .max()
            .unwrap_or(0);
    }

    /// The analyser for `model`.
    pub fn get(&self, model: &str) -> Option<&Arc<RequestAnalyzer>> {
        self.analyzers.get(model)
    }

    /// Model names, sorted.
    pub fn models(&self) -> Vec<String> {
        let mut m: Vec<String> = self.analyzers.keys().cloned().collect();
        m.sort();
        m
    }

    /// The largest body cap of the registered models (what a gateway checks `Content-Length`
    /// against before it knows the model).
    pub fn max_body_bytes(&self) -> u64 {
        self.max_body_bytes
    }

    /// Parses the body once, picks the analyser by `model`, checks that model's body cap, then
    /// analyses.
    pub fn analyze(&self, route: &str, body: &[u8]) -> Result<Analysis, AnalysisError> {
        let route = Route::parse(route).ok_or_else(|| AnalysisError::unknown_route(route))?;
        check_content_length(Some(body.len() as u64), self.max_body_bytes)?;
        let obj = body::parse_object(body)?;
        let model = body::req_str(&obj, "model", "model")?;
        let analyzer = self
            .get(model)
            .ok_or_else(|| AnalysisError::model_not_found(model))?;
        check_content_length(Some(body.len() as u64), analyzer.cfg.max_body_bytes)?;
        analyzer.analyze_object(route, &obj)
    }
}

#[cfg(test)]
mod tests;
