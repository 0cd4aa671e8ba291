//! `OpenAI`'s rate-limit header values (docs/engines.md §4), formatted once per response in Rust.
//!
//! `OpenAI` sends `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` on every response; the
//! reset values are Go `time.Duration` strings (`1s`, `12ms`, `6m0s`). kvgate's "requests" limit
//! is a concurrency limit (slots), not a per-minute count; its "tokens" limit is the TPM bucket.

use crate::admission::RateLimits;

/// The text for durations at or past Go's `math.MaxInt64` nanoseconds, in whole milliseconds.
const GO_MAX: &str = "2562047h47m16.854s";

const MS: u64 = 1_000_000;
const SEC_MS: u64 = 1_000;
const MINUTE_MS: u64 = 60 * SEC_MS;
const HOUR_MS: u64 = 60 * MINUTE_MS;

/// Formats `ns` nanoseconds the way Go's `time.Duration.String` does, in whole milliseconds:
/// `0s`, `850ms`, `1.5s`, `6m0s`, `1h2m3s`. The duration is rounded to the nearest
/// millisecond first, so a value computed in floating point reads `88ms`, never
/// `88.000004ms`, and the text has at most three decimals (of seconds) and parses back
/// within half a millisecond. Below one second the unit is `ms`; trailing zeros of fractions
/// are dropped. A non-zero duration under 1 ms is `1ms` (Go's `µs` is not ASCII, and a header
/// must be); from Go's `MaxInt64` nanoseconds on the text is that maximum (in milliseconds).
#[must_use]
pub fn go_duration_ns(ns: u64) -> String {
    if ns == 0 {
        return "0s".to_owned();
    }
    if ns >= i64::MAX as u64 {
        return GO_MAX.to_owned();
    }
    // nearest millisecond, half up (no overflow: ns < 2**63)
    let ms = ((ns + MS / 2) / MS).max(1);
    if ms < SEC_MS {
        return format!("{ms}ms");
    }
    let (hours, rem) = (ms / HOUR_MS, ms % HOUR_MS);
    let (minutes, rem) = (rem / MINUTE_MS, rem % MINUTE_MS);
    let secs = frac(rem, SEC_MS, 3);
    if hours > 0 {
        format!("{hours}h{minutes}m{secs}s")
    } else if minutes > 0 {
        format!("{minutes}m{secs}s")
    } else {
        format!("{secs}s")
    }
}

/// [`go_duration_ns`] of a duration in seconds: negative, zero and NaN give `0s`, infinity
/// Go's maximum; nanoseconds are rounded to the nearest.
#[must_use]
pub fn go_duration_secs(seconds: f64) -> String {
    if seconds.is_nan() || seconds <= 0.0 {
        return "0s".to_owned();
    }
    let ns = (seconds * 1e9).round();
    if ns >= i64::MAX as f64 {
        return GO_MAX.to_owned();
    }
    // in range: finite, positive, below 2**63
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    go_duration_ns(ns as u64)
}

/// Whether a refusal of this `reason` ends when a request holding a slot (or in-flight tokens)
/// ends: `tenant-concurrency`, `backend-slots`, `inflight-tokens`, and the wait queue's
/// `queued` and `queue-full`.
#[must_use]
pub fn waits_for_a_slot(reason: &str) -> bool {
    matches!(
        reason,
        "tenant-concurrency" | "backend-slots" | "inflight-tokens" | "queued" | "queue-full"
    )
}

/// Puts what a refusal knows of the limit that refused into `limits`, where the headers
/// describe that limit: `remaining` units left under it (slots, or tokens in its bucket) and
/// `reset_ns` until its bucket is full again. With several replicas the store decides across
/// all of them, and this replica's core sees only its own share: without this, a refusal for
/// `tenant-concurrency` would say `x-ratelimit-remaining-requests: 5` of 8. The request
/// figures describe `tenant-concurrency` (a tenant's own limit) or, for a tenant without one,
/// `backend-slots`; the token figures `tenant-tpm` or, for a tenant without its own TPM,
/// `backend-tpm`. Other reasons, and `None` values, change nothing.
pub fn apply_refusing_limit(
    limits: &mut RateLimits,
    reason: &str,
    remaining: Option<u64>,
    reset_ns: Option<u64>,
) {
    let requests = match reason {
        "tenant-concurrency" => limits.tenant_requests,
        "backend-slots" => !limits.tenant_requests,
        _ => false,
    };
    let tokens = match reason {
        "tenant-tpm" => limits.tenant_tokens,
        "backend-tpm" => !limits.tenant_tokens,
        _ => false,
    };
    if requests {
        if let Some(left) = remaining {
            limits.remaining_requests = left.min(limits.limit_requests);
        }
    }
    if tokens {
        if let Some(left) = remaining {
            limits.remaining_tokens = left;
        }
        if let Some(ns) = reset_ns {
            limits.reset_tokens_ns = ns;
        }
    }
}

/// `seconds` in whole nanoseconds (rounded to the nearest; negative and NaN give 0, beyond
/// `u64::MAX` nanoseconds saturates).
#[must_use]
pub fn secs_to_ns(seconds: f64) -> u64 {
    if seconds.is_nan() || seconds <= 0.0 {
        return 0;
    }
    // `as` saturates for floats past u64::MAX
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let ns = (seconds * 1e9).round() as u64;
    ns
}

/// `value / unit` with the fraction's `digits` decimal digits, trailing zeros dropped.
fn frac(value: u64, unit: u64, digits: usize) -> String {
    let (whole, rest) = (value / unit, value % unit);
    if rest == 0 {
        return whole.to_string();
    }
    let mut s = format!("{whole}.{rest:0digits$}");
    while s.ends_with('0') {
        s.pop();
    }
    s
}

/// Names of the six headers, in the order [`rate_limit_headers`] returns them.
pub const RATE_LIMIT_HEADER_NAMES: [&str; 6] = [
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
];

/// How many of the [`rate_limit_headers`] to send, in order: all six, or the three request
/// headers when no token limit applies (`limits.tokens_limited` false: neither the tenant nor
/// its backend has one), rather than a limit of 2^40 tokens per minute that means "none".
#[must_use]
pub fn rate_limit_header_count(limits: &RateLimits) -> usize {
    if limits.tokens_limited {
        6
    } else {
        3
    }
}

/// The six `x-ratelimit-*` header values of `limits`, in [`RATE_LIMIT_HEADER_NAMES`] order:
/// limit and remaining as decimal integers (remaining never negative), resets as Go durations.
/// Only the first [`rate_limit_header_count`] are sent.
#[must_use]
pub fn rate_limit_headers(limits: &RateLimits) -> [String; 6] {
    [
        limits.limit_requests.to_string(),
        limits.remaining_requests.to_string(),
        go_duration_ns(limits.reset_requests_ns),
        limits.limit_tokens.to_string(),
        limits.remaining_tokens.to_string(),
        go_duration_ns(limits.reset_tokens_ns),
    ]
}

/// `Retry-After` (RFC 9110: whole seconds, rounded up, at least 1) and `retry-after-ms` (the
/// milliseconds the official `OpenAI` Python client reads first, rounded up, at least 1) for a
/// wait of `seconds`. Waits under 1 ms, negative or NaN count as 1 ms; beyond about 31,700
/// years they are capped there.
#[must_use]
pub fn retry_after_values(seconds: f64) -> (String, String) {
    const MAX_SECONDS: f64 = 1e12;
    let s = if seconds.is_nan() {
        0.001
    } else {
        seconds.clamp(0.001, MAX_SECONDS)
    };
    let secs = s.ceil().max(1.0) as u64;
    let ms = (s * 1000.0).ceil().max(1.0) as u64;
    (secs.to_string(), ms.to_string())
}

/// The headers of a refusal, in order: the [`rate_limit_headers`] that apply
/// ([`rate_limit_header_count`]), then `Retry-After` and
/// `retry-after-ms` ([`retry_after_values`]) for a wait of `retry_after` seconds — or
/// `x-should-retry: false` when it is `None` (never admissible) — then
/// `x-kvgate-reject-reason: <reason>` and `Content-Type: application/json`.
#[must_use]
pub fn refusal_headers(
    limits: &RateLimits,
    retry_after: Option<f64>,
    reason: &str,
) -> Vec<(&'static str, String)> {
    let mut headers: Vec<(&'static str, String)> = Vec::with_capacity(10);
    headers.extend(
        RATE_LIMIT_HEADER_NAMES
            .into_iter()
            .zip(rate_limit_headers(limits))
            .take(rate_limit_header_count(limits)),
    );
    if let Some(seconds) = retry_after {
        let (secs, ms) = retry_after_values(seconds);
        headers.push(("Retry-After", secs));
        headers.push(("retry-after-ms", ms));
    } else {
        headers.push(("x-should-retry", "false".to_owned()));
    }
    headers.push(("x-kvgate-reject-reason", reason.to_owned()));
    headers.push(("Content-Type", "application/json".to_owned()));
    headers
}

/// What a refusal says: its parts, as the gateway knows them.
#[derive(Debug, Clone, Copy)]
pub struct RefusalText<'a> {
    /// The low-cardinality reason (`tenant-tpm`, `backend-slots`, `shed`, `queue-full`, ...).
    pub reason: &'a str,
    /// Whether the tenant's own quota refused it (429) rather than the backend (503).
    pub tenant_scope: bool,
    /// It can never be admitted (no retry).
    pub never: bool,
    /// Seconds until a retry may succeed, when known.
    pub retry_after: Option<f64>,
    /// The model asked for (`None`: a passthrough route, "this backend").
    pub model: Option<&'a str>,
    /// The tenant's name.
    pub tenant: &'a str,
    /// Tokens the request would reserve (prompt + completion).
    pub requested: u64,
    /// How the refusal was decided, when that is not the limit itself (e.g. by a replica
    /// alone while the shared store did not answer); added to the message after the reason.
    pub note: Option<&'a str>,
}

/// Appends `s` to `out` as the inside of a JSON string (RFC 8259 §7 escapes).
fn push_json_str(out: &mut Vec<u8>, s: &str) {
    for b in s.bytes() {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0..=0x1f => {
                let hex = b"0123456789abcdef";
                out.extend_from_slice(b"\\u00");
                out.push(hex[usize::from(b >> 4)]);
                out.push(hex[usize::from(b & 0xf)]);
            }
            _ => {
                out.push(b);
            }
        }
    }
}

/// A wait in seconds as the refusal message gives it: rounded up to the millisecond, trailing
/// zeros dropped (`24s`, `0.5s`, `23.999s`); unknown → `a while`.
fn wait_text(retry_after: Option<f64>) -> String {
    match retry_after {
        Some(s) if s.is_finite() && s > 0.0 => {
            let ms = (s * 1000.0).ceil().min(1e15) as u64;
            let mut t = frac(ms, 1000, 3);
            t.push('s');
            t
        }
        Some(_) => "0s".to_owned(),
        None => "a while".to_owned(),
    }
}

/// The status (429 for a tenant's quota and for a request that can never fit any limit, 503
/// for a busy backend) and `OpenAI` error body of a refusal: `{"error": {"message", "type",
/// "param": null, "code"}}` with `type` `tokens` / `requests` and code `rate_limit_exceeded`
/// for 429, `server_error` / `server_is_overloaded` for 503 (docs/engines.md §4). A request larger
/// than a whole limit (TPM burst, in-flight budget) is `OpenAI`'s "Request too large" 429 with
/// type `tokens`, sent with `x-should-retry: false` (docs/engines.md §4: it can never succeed, so it must not look retryable).
#[must_use]
pub fn refusal_body(t: &RefusalText<'_>) -> (u16, Vec<u8>) {
    let name = t.model.unwrap_or("this backend");
    let wait = wait_text(t.retry_after);
    let owned_reason;
    let reason = match t.note {
        Some(note) if !note.is_empty() => {
            owned_reason = format!("{}; {note}", t.reason);
            owned_reason.as_str()
        }
        _ => t.reason,
    };
    let (status, kind, code) = if t.never {
        (429, "tokens", "rate_limit_exceeded")
    } else if t.tenant_scope {
        let kind = if t.reason.contains("tpm") {
            "tokens"
        } else {
            "requests"
        };
        (429, kind, "rate_limit_exceeded")
    } else {
        (503, "server_error", "server_is_overloaded")
    };
    let message = match (t.tenant_scope, t.never) {
        (true, true) => format!(
            "Request too large for {name} for tenant {} ({}): Requested {} tokens, which can \
             never fit.",
            t.tenant, reason, t.requested
        ),
        (true, false) => format!(
            "Rate limit reached for {name} for tenant {} ({}). Please try again in {wait}.",
            t.tenant, reason
        ),
        (false, true) => {
            let held = if t.reason == "backend-tpm" {
                "token bucket (TPM burst)"
            } else {
                "in-flight budget"
            };
            format!(
                "Request too large for {name}: {} tokens exceed the backend's whole {held} ({}).",
                t.requested, reason
            )
        }
        (false, false) if t.reason == "shed" => format!(
            "{name} is under memory pressure; sheddable traffic is refused for now. Please try \
             again in {wait}."
        ),
        (false, false) if t.reason == "store-unavailable" => format!(
            "{name}: the shared limit store did not answer, and without it this limit admits \
             nothing ({reason}). Please try again in {wait}."
        ),
        (false, false) => format!("{name} is saturated ({reason}). Please try again in {wait}."),
    };
    let mut body = Vec::with_capacity(message.len() + 96);
    body.extend_from_slice(b"{\"error\":{\"message\":\"");
    push_json_str(&mut body, &message);
    body.extend_from_slice(b"\",\"type\":\"");
    body.extend_from_slice(kind.as_bytes());
    body.extend_from_slice(b"\",\"param\":null,\"code\":\"");
    body.extend_from_slice(code.as_bytes());
    body.extend_from_slice(b"\"}}");
    (status, body)
}

/// The reason phrase of an HTTP status code (RFC 9110 §15): every code kvgate sends itself and
/// the common ones an engine's relayed answer carries; `""` for others (the phrase is optional
/// on the wire).
#[must_use]
pub fn reason_phrase(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        304 => "Not Modified",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Request Entity Too Large",
        409 => "Conflict",
        415 => "Unsupported Media Type",
        417 => "Expectation Failed",
        422 => "Unprocessable Content",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "",
    }
}

/// `Date` header value (RFC 9110 §5.6.7 IMF-fixdate, e.g. `Mon, 30 Nov 2026 11:05:41 GMT`) of the
/// system clock now (whole seconds).
/// Formatted once per second per thread.
#[must_use]
pub fn http_date_now() -> String {
    thread_local! {
        static CACHED: std::cell::RefCell<(u64, String)> = const {
            std::cell::RefCell::new((u64::MAX, String::new()))
        };
    }
    let now = std::time::SystemTime::now();
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    CACHED.with(|c| {
        let mut c = c.borrow_mut();
        if c.0 != secs {
            *c = (secs, httpdate::fmt_http_date(now));
        }
        c.1.clone()
    })
}

/// Why a response could not be serialized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResponseError {
    /// Status outside 100..=999.
    Status(u16),
    /// A header name that is not an RFC 9110 token, or a value with CR, LF or NUL (response
    /// splitting).
    Header(String),
}

impl std::fmt::Display for ResponseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Status(s) => write!(f, "HTTP status {s} is outside 100..=999"),
            Self::Header(name) => write!(f, "header {name:?} has an invalid name or value"),
        }
    }
}

fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// How the body of a response is delimited (RFC 9112 §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `Content-Length: n`.
    Length(usize),
    /// `Transfer-Encoding: chunked` (HTTP/1.1 clients).
    Chunked,
    /// Neither: the body ends when the connection closes (HTTP/1.0 clients).
    Close,
}

/// The head of an HTTP/1.1 response: the status line, `headers` in order, the framing header,
/// `Date` (`date`, see [`http_date_now`]), `Connection: <connection>` when given (`close`, or
/// `keep-alive` for an HTTP/1.0 client), and the blank line. `extra` bytes of capacity are
/// reserved for what the caller appends (the body).
///
/// Callers must not pass `Content-Length`, `Date`, `Connection` or `Transfer-Encoding` in
/// `headers` (they are written here).
///
/// Errors: [`ResponseError`] for a status outside 100..=999 or a header that could split the
/// response (nothing is built).
pub fn http_head<N: AsRef<[u8]>, V: AsRef<[u8]>>(
    status: u16,
    headers: &[(N, V)],
    framing: Framing,
    date: &str,
    connection: Option<&str>,
    extra: usize,
) -> Result<Vec<u8>, ResponseError> {
    use std::io::Write as _;
    if !(100..=999).contains(&status) {
        return Err(ResponseError::Status(status));
    }
    let mut len = 96 + date.len() + extra;
    for (name, value) in headers {
        let (name, value) = (name.as_ref(), value.as_ref());
        if !is_safe_header(name, value) {
            return Err(ResponseError::Header(
                String::from_utf8_lossy(name).into_owned(),
            ));
        }
        len += name.len() + value.len() + 4;
    }
    if let Some(c) = connection {
        if !is_safe_header(b"Connection", c.as_bytes()) {
            return Err(ResponseError::Header("Connection".to_owned()));
        }
        len += c.len() + 14;
    }
    let mut out = Vec::with_capacity(len);
    // writes into a Vec cannot fail
    let _ = write!(out, "HTTP/1.1 {status} {}\r\n", reason_phrase(status));
    for (name, value) in headers {
        for part in [name.as_ref(), b": ", value.as_ref(), b"\r\n"] {
            out.extend_from_slice(part);
        }
    }
    match framing {
        Framing::Length(n) => {
            let _ = write!(out, "Content-Length: {n}\r\n");
        }
        Framing::Chunked => out.extend_from_slice(b"Transfer-Encoding: chunked\r\n"),
        Framing::Close => {}
    }
    let _ = write!(out, "Date: {date}\r\n");
    if let Some(c) = connection {
        let _ = write!(out, "Connection: {c}\r\n");
    }
    out.extend_from_slice(b"\r\n");
    Ok(out)
}

/// Whether a header can be written as is: the name an RFC 9110 token, the value only field
/// characters (RFC 9110 §5.5: visible ASCII, space, tab, and bytes from 0x80 up; no CR, LF, NUL
/// or other control character, which could split the response or confuse a parser).
#[must_use]
pub fn is_safe_header(name: &[u8], value: &[u8]) -> bool {
    !name.is_empty()
        && name.iter().all(|&b| is_token_byte(b))
        && value
            .iter()
            .all(|&b| b == b'\t' || (b >= 0x20 && b != 0x7f))
}

/// Response headers never relayed from an engine: hop-by-hop ones (RFC 9110 §7.6.1) and those
/// the gateway writes itself (framing, `Date`; `Content-Encoding` because the body is relayed
/// decoded; `Server`).
pub const NOT_RELAYED: [&str; 13] = [
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "content-encoding",
    "date",
    "server",
];

/// The headers of a relayed response: the engine's (`upstream`, in order, each value) minus
/// [`NOT_RELAYED`], minus those its `Connection` header names (RFC 9110 §7.6.1: hop-by-hop
/// too), minus the names `ours` sets (all ASCII case-insensitive) and minus any that could
/// split the response ([`is_safe_header`]), then `ours`.
#[must_use]
pub fn relayed_headers<'a>(
    upstream: &[(&'a [u8], &'a [u8])],
    ours: &[(&'a [u8], &'a [u8])],
) -> Vec<(&'a [u8], &'a [u8])> {
    // connection options: comma-separated tokens of every Connection header
    let named: Vec<&[u8]> = upstream
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case(b"connection"))
        .flat_map(|(_, v)| v.split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
        .collect();
    let mut out = Vec::with_capacity(upstream.len() + ours.len());
    for &(name, value) in upstream {
        let dropped = NOT_RELAYED
            .iter()
            .any(|n| name.eq_ignore_ascii_case(n.as_bytes()))
            || named.iter().any(|n| name.eq_ignore_ascii_case(n))
            || ours.iter().any(|(n, _)| name.eq_ignore_ascii_case(n))
            || !is_safe_header(name, value);
        if !dropped {
            out.push((name, value));
        }
    }
    out.extend_from_slice(ours);
    out
}

/// A complete HTTP/1.1 response in one buffer: [`http_head`] with `Content-Length` of `body`,
/// then `body`.
///
/// Errors: as [`http_head`].
pub fn http_response<N: AsRef<[u8]>, V: AsRef<[u8]>>(
    status: u16,
    headers: &[(N, V)],
    body: &[u8],
    date: &str,
    connection: Option<&str>,
) -> Result<Vec<u8>, ResponseError> {
    let mut out = http_head(
        status,
        headers,
        Framing::Length(body.len()),
        date,
        connection,
        body.len(),
    )?;
    out.extend_from_slice(body);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: &[(&str, &str)] = &[];

    #[test]
    fn go_durations_match_go() {
        // (seconds, Go's text) — the same table as tests/gateway/test_wire_formats.py
        let cases: [(f64, &str); 13] = [
            (0.0, "0s"),
            (-1.0, "0s"),
            (0.004, "4ms"),
            (0.012, "12ms"),
            (1.0, "1s"),
            (9.816, "9.816s"),
            (360.0, "6m0s"),
            (864.0, "14m24s"),
            (90.5, "1m30.5s"),
            (3723.0, "1h2m3s"),
            (0.000_001_5, "1ms"),
            (0.000_351_521, "1ms"),
            (0.088_000_004, "88ms"),
        ];
        for (secs, text) in cases {
            assert_eq!(go_duration_secs(secs), text, "{secs} s");
        }
        assert_eq!(go_duration_secs(f64::NAN), "0s");
        assert_eq!(go_duration_secs(f64::INFINITY), GO_MAX);
        assert_eq!(go_duration_ns(u64::MAX), GO_MAX);
        assert_eq!(go_duration_ns(1_500_000), "2ms");
        assert_eq!(go_duration_ns(88_000_004), "88ms");
        assert_eq!(go_duration_ns(1_499_999), "1ms");
        assert_eq!(go_duration_ns(999_600_000), "1s");
        assert_eq!(go_duration_ns(1_234_567_891), "1.235s");
        assert_eq!(go_duration_ns(3_600_000_000_000), "1h0m0s");
        assert_eq!(go_duration_ns(i64::MAX as u64), GO_MAX);
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds_and_milliseconds() {
        let pair = |a: &str, b: &str| (a.to_owned(), b.to_owned());
        assert_eq!(retry_after_values(0.2), pair("1", "200"));
        assert_eq!(retry_after_values(2.0001), pair("3", "2001"));
        assert_eq!(retry_after_values(7.98), pair("8", "7980"));
        assert_eq!(retry_after_values(0.0), pair("1", "1"));
        assert_eq!(retry_after_values(-5.0), pair("1", "1"));
        assert_eq!(retry_after_values(f64::NAN), pair("1", "1"));
        assert_eq!(
            retry_after_values(f64::INFINITY),
            pair("1000000000000", "1000000000000000")
        );
    }

    #[test]
    fn headers_are_in_name_order() {
        let h = rate_limit_headers(&RateLimits {
            limit_requests: 4,
            remaining_requests: 0,
            reset_requests_ns: 500 * MS,
            limit_tokens: 1000,
            remaining_tokens: 0,
            reset_tokens_ns: 360_000 * MS,
            tenant_requests: true,
            tenant_tokens: true,
            tokens_limited: true,
        });
        assert_eq!(h, ["4", "0", "500ms", "1000", "0", "6m0s"]);
    }

    #[test]
    fn without_a_token_limit_only_the_request_headers_are_sent() {
        let limited = RateLimits {
            limit_requests: 4,
            remaining_requests: 3,
            reset_requests_ns: 0,
            limit_tokens: 1 << 40,
            remaining_tokens: 1 << 40,
            reset_tokens_ns: 0,
            tenant_requests: true,
            tenant_tokens: false,
            tokens_limited: true,
        };
        assert_eq!(rate_limit_header_count(&limited), 6);
        let none = RateLimits {
            tokens_limited: false,
            ..limited
        };
        assert_eq!(rate_limit_header_count(&none), 3);
        let names: Vec<&str> = refusal_headers(&none, Some(1.0), "tenant-concurrency")
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(
            names,
            [
                "x-ratelimit-limit-requests",
                "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-requests",
                "Retry-After",
                "retry-after-ms",
                "x-kvgate-reject-reason",
                "Content-Type"
            ]
        );
        assert_eq!(
            refusal_headers(&limited, Some(1.0), "tenant-concurrency").len(),
            10
        );
    }

    #[test]
    fn http_response_is_one_well_formed_message() {
        let raw = http_response(
            429,
            &[("Retry-After", "2"), ("Content-Type", "application/json")],
            b"{}",
            "Mon, 30 Nov 2026 11:05:41 GMT",
            None,
        )
        .unwrap();
        assert_eq!(
            raw,
            b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 2\r\nContent-Type: application/json\r\n\
              Content-Length: 2\r\nDate: Mon, 30 Nov 2026 11:05:41 GMT\r\n\r\n{}"
        );
        let close = http_response(503, NONE, b"", "d", Some("close")).unwrap();
        assert_eq!(
            close,
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nDate: d\r\nConnection: close\r\n\r\n"
        );
        let odd = http_response(299, NONE, b"x", "d", None).unwrap();
        assert!(odd.starts_with(b"HTTP/1.1 299 \r\n"));
    }

    #[test]
    fn http_response_refuses_splitting_and_bad_status() {
        let date = "d";
        assert_eq!(
            http_response(99, NONE, b"", date, None),
            Err(ResponseError::Status(99))
        );
        assert_eq!(
            http_response(1000, NONE, b"", date, None),
            Err(ResponseError::Status(1000))
        );
        for (name, value) in [
            ("X", "a\r\nSet-Cookie: x"),
            ("X", "a\nb"),
            ("X", "a\0"),
            ("", "a"),
            ("A B", "a"),
            ("A:", "a"),
        ] {
            assert!(
                http_response(200, &[(name, value)], b"", date, None).is_err(),
                "{name:?}"
            );
        }
        assert!(http_response(200, NONE, b"", date, Some("close\r\nX: y")).is_err());
    }

    /// A tenant's TPM refusal with awkward text (quotes, a newline) for the body tests.
    fn tpm_refusal() -> RefusalText<'static> {
        RefusalText {
            reason: "tenant-tpm",
            tenant_scope: true,
            never: false,
            retry_after: Some(23.9991),
            model: Some("m\"x"),
            tenant: "t\n1",
            requested: 28,
            note: None,
        }
    }

    /// A refusal's status and its body's `error` object.
    fn parse(t: &RefusalText<'_>) -> (u16, serde_json::Value) {
        let (status, body) = refusal_body(t);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        (status, v["error"].clone())
    }

    #[test]
    fn refusal_bodies_are_openai_errors() {
        let base = tpm_refusal();
        let (status, err) = parse(&base);
        assert_eq!(status, 429);
        assert_eq!(err["type"], "tokens");
        assert_eq!(err["code"], "rate_limit_exceeded");
        assert!(err["param"].is_null());
        assert_eq!(
            err["message"],
            "Rate limit reached for m\"x for tenant t\n1 (tenant-tpm). Please try again in 24s."
        );
        let (_, err) = parse(&RefusalText {
            reason: "tenant-concurrency",
            retry_after: Some(0.5),
            ..base
        });
        assert_eq!(err["type"], "requests");
        assert!(err["message"]
            .as_str()
            .unwrap()
            .ends_with("try again in 0.5s."));
        let (_, err) = parse(&RefusalText {
            never: true,
            retry_after: None,
            ..base
        });
        assert!(err["message"]
            .as_str()
            .unwrap()
            .contains("Requested 28 tokens"));
        let backend = RefusalText {
            reason: "backend-tpm",
            tenant_scope: false,
            never: true,
            retry_after: None,
            model: None,
            ..base
        };
        let (status, err) = parse(&backend);
        assert_eq!(status, 429);
        assert_eq!(
            (&err["type"], &err["code"]),
            (&"tokens".into(), &"rate_limit_exceeded".into())
        );
        assert_eq!(
            err["message"],
            "Request too large for this backend: 28 tokens exceed the backend's whole token \
             bucket (TPM burst) (backend-tpm)."
        );
        let (_, err) = parse(&RefusalText {
            reason: "shed",
            never: false,
            retry_after: Some(2.0),
            ..backend
        });
        assert!(err["message"].as_str().unwrap().contains("memory pressure"));
        let (_, err) = parse(&RefusalText {
            reason: "queue-full",
            never: false,
            retry_after: None,
            ..backend
        });
        assert!(err["message"]
            .as_str()
            .unwrap()
            .ends_with("try again in a while."));
        let ctl: String = (0u8..0x20).map(char::from).collect();
        let (_, err) = parse(&RefusalText {
            tenant: &ctl,
            ..base
        });
        assert!(err["message"].as_str().unwrap().contains(&ctl));
    }

    #[test]
    fn a_refusal_by_the_fallback_or_the_store_says_so() {
        let base = tpm_refusal();
        let (_, err) = parse(&RefusalText {
            note: Some("decided by this replica alone"),
            ..base
        });
        assert_eq!(
            err["message"],
            "Rate limit reached for m\"x for tenant t\n1 (tenant-tpm; decided by this replica \
             alone). Please try again in 24s."
        );
        let (status, err) = parse(&RefusalText {
            reason: "store-unavailable",
            tenant_scope: false,
            retry_after: Some(1.0),
            model: None,
            ..base
        });
        assert_eq!(status, 503);
        let text = err["message"].as_str().unwrap();
        assert!(text.contains("shared limit store did not answer"), "{text}");
        assert!(!text.contains("saturated"), "{text}");
    }

    #[test]
    fn a_refusal_puts_its_own_limit_in_the_headers() {
        let local = RateLimits {
            limit_requests: 8,
            remaining_requests: 6,
            reset_requests_ns: 0,
            limit_tokens: 1000,
            remaining_tokens: 990,
            reset_tokens_ns: 600 * MS,
            tenant_requests: true,
            tenant_tokens: true,
            tokens_limited: true,
        };
        let mut l = local;
        apply_refusing_limit(&mut l, "tenant-concurrency", Some(0), Some(5 * MS));
        assert_eq!((l.remaining_requests, l.reset_requests_ns), (0, 0));
        assert_eq!((l.remaining_tokens, l.reset_tokens_ns), (990, 600 * MS));
        let mut l = local;
        apply_refusing_limit(&mut l, "tenant-tpm", Some(12), Some(30_000 * MS));
        assert_eq!(l.remaining_requests, 6);
        assert_eq!((l.remaining_tokens, l.reset_tokens_ns), (12, 30_000 * MS));
        // the headers show the tenant's own limits: a backend refusal leaves them alone
        let mut l = local;
        apply_refusing_limit(&mut l, "backend-slots", Some(0), None);
        apply_refusing_limit(&mut l, "backend-tpm", Some(0), Some(MS));
        assert_eq!(l, local);
        // a tenant without limits of its own: the headers are the backend's
        let shared = RateLimits {
            tenant_requests: false,
            tenant_tokens: false,
            ..local
        };
        let mut l = shared;
        apply_refusing_limit(&mut l, "backend-slots", Some(99), None);
        assert_eq!(l.remaining_requests, 8);
        apply_refusing_limit(&mut l, "backend-tpm", Some(0), None);
        assert_eq!((l.remaining_tokens, l.reset_tokens_ns), (0, 600 * MS));
        let mut l = shared;
        apply_refusing_limit(&mut l, "shed", Some(0), Some(0));
        apply_refusing_limit(&mut l, "backend-slots", None, None);
        assert_eq!(l, shared);
    }

    #[test]
    fn relayed_headers_drop_hop_by_hop_ours_and_unsafe() {
        let up: Vec<(&[u8], &[u8])> = vec![
            (b"Content-Type", b"text/event-stream"),
            (b"Transfer-Encoding", b"chunked"),
            (b"CONNECTION", b"keep-alive"),
            (b"x-request-id", b"r1"),
            (b"X-RateLimit-Limit-Tokens", b"999"),
            (b"x-evil", b"a\r\nb"),
            (b"bad name", b"v"),
            (b"set-cookie", b"a=1"),
            (b"set-cookie", b"b=2"),
            (b"Date", b"yesterday"),
            (b"Connection", b"close, X-Hop ,x-other"),
            (b"x-hop", b"secret"),
            (b"X-Other", b"o"),
            (b"Proxy-Connection", b"keep-alive"),
            (b"x-ctl", b"\x01a"),
            (b"x-del", b"a\x7f"),
            (b"x-tab-utf8", b"a\tb \xc3\xa9"),
        ];
        let ours: Vec<(&[u8], &[u8])> = vec![(b"x-ratelimit-limit-tokens", b"60")];
        let out = relayed_headers(&up, &ours);
        let names: Vec<&[u8]> = out.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                &b"Content-Type"[..],
                b"x-request-id",
                b"set-cookie",
                b"set-cookie",
                b"x-tab-utf8",
                b"x-ratelimit-limit-tokens"
            ]
        );
        assert_eq!(out[5].1, b"60");
    }

    #[test]
    fn stream_heads_carry_their_framing() {
        let chunked = http_head(200, &[("X", "1")], Framing::Chunked, "d", None, 0).unwrap();
        assert_eq!(
            chunked,
            b"HTTP/1.1 200 OK\r\nX: 1\r\nTransfer-Encoding: chunked\r\nDate: d\r\n\r\n"
        );
        let close = http_head(200, NONE, Framing::Close, "d", Some("close"), 0).unwrap();
        assert_eq!(
            close,
            b"HTTP/1.1 200 OK\r\nDate: d\r\nConnection: close\r\n\r\n"
        );
    }

    #[test]
    fn http_date_is_imf_fixdate() {
        let d = http_date_now();
        assert_eq!(d.len(), 29, "{d}");
        assert!(d.ends_with(" GMT"), "{d}");
        assert!(httpdate::parse_http_date(&d).is_ok());
    }
}
