//! Chat templates: render the prompt the way the engines do (HuggingFace `apply_chat_template`,
//! vLLM, TGI), with minijinja, so the count is the count of what the engine tokenizes.
//!
//! The environment mirrors transformers' `ImmutableSandboxedEnvironment(trim_blocks=True,
//! lstrip_blocks=True)` with the `loopcontrols` extension; the context has `messages`, `tools`
//! (or none), `add_generation_prompt` (the request's, default true), `bos_token`, `eos_token`,
//! the request's `chat_template_kwargs` as further variables (as vLLM passes them to
//! `apply_chat_template`), and the functions `raise_exception(msg)` and `strftime_now(fmt)`. A `tojson` filter writes JSON like Python's
//! `json.dumps(ensure_ascii=False)` (transformers' own filter), and the common Python `str` /
//! `dict` methods templates call (`strip`, `startswith`, `split`, `items`, `get`, ...) are
//! provided.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Value};
use minijinja::{Environment, Error, ErrorKind, State};

use super::error::AnalysisError;

const DEFAULT: &str = "default";
const TOOL_USE: &str = "tool_use";
/// Marker put in front of messages raised by `raise_exception`, to tell them from other
/// render errors.
const RAISED: &str = "kvgate-raised:";

/// A compiled chat template plus the special tokens it refers to.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The name the default template is registered (and its errors reported) under: its file
    /// path, or `chat_template` for an inline one.
    default_name: String,
    /// The `tool_use` variant's name, when there is one.
    tool_use_name: Option<String>,
    bos_token: String,
    eos_token: String,
}

/// What a request sets in the template's context beside `messages` and `tools`.
#[derive(Debug, Clone, Copy)]
pub struct RenderOptions<'a> {
    /// `add_generation_prompt` (the chat body's, default true as in vLLM).
    pub add_generation_prompt: bool,
    /// The body's `chat_template_kwargs`: extra template variables (vLLM's field; e.g.
    /// `enable_thinking`). They may replace `bos_token` / `eos_token` as in transformers, never
    /// `messages`, `tools` or `add_generation_prompt`.
    pub kwargs: Option<&'a serde_json::Map<String, serde_json::Value>>,
}

impl Default for RenderOptions<'_> {
    fn default() -> Self {
        Self {
            add_generation_prompt: true,
            kwargs: None,
        }
    }
}

impl ChatTemplate {
    /// Compiles `default` (and, when given, the `tool_use` variant that HuggingFace repos may
    /// ship beside it, picked when the request has `tools`). Errors name it `chat_template`.
    pub fn new(
        default: &str,
        tool_use: Option<&str>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, String> {
        Self::named("chat_template", default, tool_use, bos_token, eos_token)
    }

    /// [`Self::new`] with the name compile and start-up check errors give for the template
    /// (minijinja reports it with the line: `(in NAME:LINE)`), e.g. the template file's path.
    pub fn named(
        name: &str,
        default: &str,
        tool_use: Option<&str>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| e.to_string())?,
        );
        // transformers never escapes; minijinja would by the name's extension (a template
        // named after a `.json` or `.html` file)
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.set_unknown_method_callback(pycompat);
        let default_name = name.to_owned();
        env.add_template_owned(default_name.clone(), default.to_owned())
            .map_err(|e| format!("invalid chat template: {e}"))?;
        let tool_use_name = match tool_use {
            Some(t) => {
                let n = format!("{name} ({TOOL_USE})");
                env.add_template_owned(n.clone(), t.to_owned())
                    .map_err(|e| format!("invalid tool_use chat template: {e}"))?;
                Some(n)
            }
            None => None,
        };
        Ok(Self {
            env,
            default_name,
            tool_use_name,
            bos_token: bos_token.unwrap_or_default(),
            eos_token: eos_token.unwrap_or_default(),
        })
    }

    /// Reads `chat_template`, `bos_token` and `eos_token` from a HuggingFace
    /// `tokenizer_config.json`. `chat_template` may be a string or a list of
    /// `{"name", "template"}` (names `default` and `tool_use`). `override_template`, when given,
    /// replaces the file's template. Returns `Ok(None)` when there is no template at all.
    pub fn from_tokenizer_config(
        config_json: Option<&str>,
        override_template: Option<&str>,
    ) -> Result<Option<Self>, String> {
        Self::from_tokenizer_config_named(
            config_json,
            "tokenizer_config.json",
            override_template.map(|t| ("chat_template", t)),
        )
    }

    /// [`Self::from_tokenizer_config`] with names for errors: `config_name` for the file's own
    /// template (e.g. its path), and the override as `(name, text)` (e.g. a template file's
    /// path and contents).
    pub fn from_tokenizer_config_named(
        config_json: Option<&str>,
        config_name: &str,
        override_template: Option<(&str, &str)>,
    ) -> Result<Option<Self>, String> {
        let cfg: serde_json::Value = match config_json {
            Some(text) => serde_json::from_str(text)
                .map_err(|e| format!("invalid tokenizer_config.json: {e}"))?,
            None => serde_json::Value::Null,
        };
        let special = |key: &str| match cfg.get(key) {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Object(o)) => {
                o.get("content").and_then(|c| c.as_str()).map(str::to_owned)
            }
            _ => None,
        };
        let (bos, eos) = (special("bos_token"), special("eos_token"));
        let (mut default, mut tool_use) = (None, None);
        match cfg.get("chat_template") {
            Some(serde_json::Value::String(s)) => default = Some(s.clone()),
            Some(serde_json::Value::Array(list)) => {
                for item in list {
                    let name = item.get("name").and_then(|v| v.as_str());
                    let tpl = item.get("template").and_then(|v| v.as_str());
                    match (name, tpl) {
                        (Some(DEFAULT), Some(t)) => default = Some(t.to_owned()),
                        (Some(TOOL_USE), Some(t)) => tool_use = Some(t.to_owned()),
                        _ => {}
                    }
                }
            }
            None | Some(serde_json::Value::Null) => {}
            Some(_) => {
                return Err(
                    "tokenizer_config.json: chat_template must be a string or a list".into(),
                )
            }
        }
        let mut name = config_name;
        if let Some((n, t)) = override_template {
            default = Some(t.to_owned());
            tool_use = None;
            name = n;
        }
        match default {
            Some(d) => Self::named(name, &d, tool_use.as_deref(), bos, eos).map(Some),
            None => Ok(None),
        }
    }

    /// Renders the prompt with the defaults (`add_generation_prompt` true, no extra variables).
    /// `messages` and `tools` are already normalised template values.
    pub fn render(&self, messages: Value, tools: Option<Value>) -> Result<String, AnalysisError> {
        self.render_with(messages, tools, &RenderOptions::default())
    }

    /// Renders the prompt with the request's template options. A `raise_exception(msg)` in the
    /// template, or any other render failure, is a 400 `chat_template_error` (param
    /// `messages`); its message gives the template line, never the template's file path.
    pub fn render_with(
        &self,
        messages: Value,
        tools: Option<Value>,
        opts: &RenderOptions<'_>,
    ) -> Result<String, AnalysisError> {
        self.render_raw(messages, tools, opts).map_err(|e| {
            let text = e.detail().unwrap_or_default();
            match text.strip_prefix(RAISED) {
                Some(msg) => AnalysisError::bad(Some("messages"), "chat_template_error", msg),
                None => {
                    let line = e
                        .line()
                        .map(|l| format!(" (template line {l})"))
                        .unwrap_or_default();
                    let what = match e.detail() {
                        Some(d) => format!("{}: {d}", e.kind()),
                        None => e.kind().to_string(),
                    };
                    AnalysisError::bad(
                        Some("messages"),
                        "chat_template_error",
                        format!("The chat template could not render these messages: {what}{line}"),
                    )
                }
            }
        })
    }

    fn render_raw(
        &self,
        messages: Value,
        tools: Option<Value>,
        opts: &RenderOptions<'_>,
    ) -> Result<String, Error> {
        let name = match (&tools, &self.tool_use_name) {
            (Some(_), Some(n)) => n,
            _ => &self.default_name,
        };
        let tmpl = self.env.get_template(name)?;
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        ctx.insert("bos_token".into(), Value::from(self.bos_token.as_str()));
        ctx.insert("eos_token".into(), Value::from(self.eos_token.as_str()));
        if let Some(kwargs) = opts.kwargs {
            for (k, v) in kwargs {
                ctx.insert(k.clone(), to_value(v));
            }
        }
        ctx.insert("messages".into(), messages);
        ctx.insert("tools".into(), tools.unwrap_or(Value::from(())));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(opts.add_generation_prompt),
        );
        tmpl.render(Value::from(ctx))
    }

    /// Renders the template once on a sample conversation (system, user, an assistant tool
    /// call, its tool result, with `tools`), as start-up and `kvgate check-config` do, so a
    /// template that cannot render (an unknown filter or method, a type error) is refused
    /// before the first request. A template may refuse a conversation on purpose with
    /// `raise_exception` (many refuse a system message or tool roles), or fail on its data (a
    /// type error or an undefined value: plain `ChatML` adds a tool call's null content to a
    /// string); then it is tried on the conversation without the system message, then on one
    /// user message, which it must render.
    ///
    /// # Errors
    /// The failure as minijinja words it, with the template's name and line, e.g.
    /// `chat template /models/chat.jinja cannot render a sample conversation: unknown method:
    /// string has no method named casefold (in /models/chat.jinja:3)`.
    pub fn check(&self) -> Result<(), String> {
        let call = serde_json::json!([{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]);
        let system =
            serde_json::json!({"role": "system", "content": "You are a helpful assistant."});
        let user = serde_json::json!({"role": "user", "content": "What is the weather in Paris?"});
        let assistant =
            serde_json::json!({"role": "assistant", "content": null, "tool_calls": call});
        let tool = serde_json::json!({"role": "tool", "tool_call_id": "call_1",
            "name": "get_weather", "content": "{\"temperature_c\": 21}"});
        let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}}]);
        let samples = [
            (
                vec![system, user.clone(), assistant.clone(), tool.clone()],
                Some(&tools),
            ),
            (vec![user.clone(), assistant, tool], Some(&tools)),
            (vec![user], None),
        ];
        let last = samples.len() - 1;
        for (i, (messages, tools)) in samples.iter().enumerate() {
            let messages = to_value(&serde_json::Value::Array(messages.clone()));
            match self.render_raw(messages, tools.map(to_value), &RenderOptions::default()) {
                Ok(_) => return Ok(()),
                Err(e) => {
                    // a refusal on purpose, or a type error on the sample's data (plain ChatML
                    // adds a tool call's null content to a string): a simpler conversation
                    // next; an unknown method, filter or function is a broken template
                    let raised = e.detail().is_some_and(|d| d.starts_with(RAISED));
                    let data_dependent = matches!(
                        e.kind(),
                        minijinja::ErrorKind::InvalidOperation
                            | minijinja::ErrorKind::UndefinedError
                    );
                    if !(raised || data_dependent) || i == last {
                        let shown = e.to_string().replace(RAISED, "raise_exception: ");
                        return Err(format!(
                            "chat template {} cannot render a sample conversation: {shown}",
                            self.default_name
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// Converts a parsed JSON value into a template value, keeping object key order.
pub fn to_value(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(0.0))
            }
        }
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(a) => Value::from(a.iter().map(to_value).collect::<Vec<_>>()),
        serde_json::Value::Object(o) => Value::from_object(OrderedMap(
            o.iter()
                .map(|(k, v)| (Value::from(k.as_str()), to_value(v)))
                .collect(),
        )),
    }
}

/// A map that iterates in insertion order (Python dict semantics), for messages and tools.
#[derive(Debug)]
pub struct OrderedMap(pub Vec<(Value, Value)>);

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.0.iter().map(|(k, _)| k.clone()).collect())
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.0.len())
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED}{msg}"),
    ))
}

/// `strftime_now(fmt)` (used by Llama 3.x templates): the current UTC date. Supports `%d %m %Y
/// %y %b %B %H %M %S %%`; any other directive is copied as is.
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_time(&fmt, secs)
}

pub(crate) fn format_time(fmt: &str, secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('d') => write!(out, "{day:02}"),
            Some('m') => write!(out, "{month:02}"),
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year % 100),
            Some('b') => write!(out, "{}", &month_name[..3]),
            Some('B') => write!(out, "{month_name}"),
            Some('H') => write!(out, "{:02}", rem / 3600),
            Some('M') => write!(out, "{:02}", rem % 3600 / 60),
            Some('S') => write!(out, "{:02}", rem % 60),
            Some('%') => out.write_char('%'),
            Some(o) => write!(out, "%{o}"),
            None => write!(out, "%"),
        };
    }
    out
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`,
/// so `", "` / `": "` separators and no HTML escaping (minijinja's own filter escapes `<>&'`,
/// which would change token counts).
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<Value> = kwargs.get("separators")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, indent, 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    out: &mut String,
    v: &Value,
    indent: Option<usize>,
    level: usize,
) -> Result<(), Error> {
    use minijinja::value::ValueKind;
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                let _ = write!(out, "{i}");
            } else if let Ok(f) = f64::try_from(v.clone()) {
                if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
                    let _ = write!(out, "{f:.1}");
                } else {
                    let _ = write!(out, "{f}");
                }
            } else {
                let _ = write!(out, "{v}");
            }
        }
        ValueKind::String => {
            let _ = write!(
                out,
                "{}",
                serde_json::Value::from(v.as_str().unwrap_or_default())
            );
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            let mut first = true;
            for item in v.try_iter()? {
                if !first {
                    out.push_str(item_sep);
                }
                first = false;
                newline(out, level + 1);
                write_json(out, &item, indent, level + 1)?;
            }
            if !first {
                newline(out, level);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            let mut first = true;
            for key in v.try_iter()? {
                if !first {
                    out.push_str(item_sep);
                }
                first = false;
                newline(out, level + 1);
                let k = key.as_str().map_or_else(|| key.to_string(), str::to_owned);
                let _ = write!(out, "{}: ", serde_json::Value::from(k));
                write_json(out, &v.get_item(&key)?, indent, level + 1)?;
            }
            if !first {
                newline(out, level);
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{}", serde_json::Value::from(v.to_string()));
        }
    }
    Ok(())
}

/// The Python methods chat templates call on strings and dicts.
fn pycompat(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    let arg_str = |i: usize| args.get(i).and_then(Value::as_str);
    if let Some(s) = value.as_str() {
        let chars: Option<Vec<char>> = arg_str(0).map(|c| c.chars().collect());
        let trim = |f: fn(&str, &[char]) -> String| -> Value {
            match &chars {
                Some(c) => Value::from(f(s, c)),
                None => Value::from(f(s, &[])),
            }
        };
        return Ok(match method {
            "strip" => trim(|s, c| {
                if c.is_empty() {
                    s.trim().into()
                } else {
                    s.trim_matches(c).into()
                }
            }),
            "lstrip" => trim(|s, c| {
                if c.is_empty() {
                    s.trim_start().into()
                } else {
                    s.trim_start_matches(c).into()
                }
            }),
            "rstrip" => trim(|s, c| {
                if c.is_empty() {
                    s.trim_end().into()
                } else {
                    s.trim_end_matches(c).into()
                }
            }),
            "startswith" => Value::from(str_or_tuple(args.first(), |p| s.starts_with(p))),
            "endswith" => Value::from(str_or_tuple(args.first(), |p| s.ends_with(p))),
            "upper" => Value::from(s.to_uppercase()),
            "lower" => Value::from(s.to_lowercase()),
            "title" | "capitalize" => state.apply_filter(method, std::slice::from_ref(value))?,
            "replace" => match (arg_str(0), arg_str(1)) {
                (Some(a), Some(b)) => Value::from(s.replace(a, b)),
                _ => return Err(Error::new(ErrorKind::MissingArgument, "replace(old, new)")),
            },
            "find" => Value::from(
                arg_str(0)
                    .and_then(|p| s.find(p))
                    .map_or(-1, |i| s[..i].chars().count() as i64),
            ),
            "split" => {
                let max = args.get(1).and_then(Value::as_i64).unwrap_or(-1);
                let parts: Vec<Value> = match arg_str(0) {
                    Some(sep) if !sep.is_empty() => {
                        if max >= 0 {
                            s.splitn(max as usize + 1, sep).map(Value::from).collect()
                        } else {
                            s.split(sep).map(Value::from).collect()
                        }
                    }
                    _ => s.split_whitespace().map(Value::from).collect(),
                };
                Value::from(parts)
            }
            _ => return Err(Error::from(ErrorKind::UnknownMethod)),
        });
    }
    if matches!(value.kind(), minijinja::value::ValueKind::Map) {
        return match method {
            "items" => state.apply_filter("items", std::slice::from_ref(value)),
            "keys" => Ok(Value::from(value.try_iter()?.collect::<Vec<_>>())),
            "values" => {
                let vals: Result<Vec<_>, _> =
                    value.try_iter()?.map(|k| value.get_item(&k)).collect();
                Ok(Value::from(vals?))
            }
            "get" => {
                let key = args.first().cloned().unwrap_or_default();
                let got = value.get_item(&key)?;
                Ok(if got.is_undefined() {
                    args.get(1).cloned().unwrap_or(Value::from(()))
                } else {
                    got
                })
            }
            _ => Err(Error::from(ErrorKind::UnknownMethod)),
        };
    }
    Err(Error::from(ErrorKind::UnknownMethod))
}

fn str_or_tuple(arg: Option<&Value>, test: impl Fn(&str) -> bool) -> bool {
    match arg {
        Some(v) if v.as_str().is_some() => test(v.as_str().unwrap_or_default()),
        Some(v) => v
            .try_iter()
            .is_ok_and(|mut it| it.any(|p| p.as_str().is_some_and(&test))),
        None => false,
    }
}
