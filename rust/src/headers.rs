//! `OpenAI`'s rate-limit header values (ENGINES.md §5.3), formatted once per response in Rust.
//!
//! `OpenAI` sends `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` on every response; the
//! reset values are Go `time.Duration` strings (`1s`, `12ms`, `6m0s`). kvgate's "requests" limit
//! is a concurrency limit (slots), not a per-minute count; its "tokens" limit is the TPM bucket.

use crate::admission::RateLimits;

/// Largest duration Go prints (`math.MaxInt64` nanoseconds).
const GO_MAX: &str = "2562047h47m16.854775807s";

const MS: u64 = 1_000_000;
const SEC: u64 = 1_000_000_000;
const MINUTE: u64 = 60 * SEC;
const HOUR: u64 = 60 * MINUTE;

/// Formats `ns` nanoseconds the way Go's `time.Duration.String` does: `0s`, `850ms`, `1.5s`,
/// `6m0s`, `1h2m3s`. Below one second the unit is `ms`; trailing zeros of fractions are
/// dropped. Durations under 1 ms are `1ms` (Go's `µs` is not ASCII, and a header must be);
/// beyond Go's `MaxInt64` nanoseconds the text is Go's maximum.
#[must_use]
pub fn go_duration_ns(ns: u64) -> String {
    if ns == 0 {
        return "0s".to_owned();
    }
    if ns < MS {
        return "1ms".to_owned();
    }
    if ns > i64::MAX as u64 {
        return GO_MAX.to_owned();
    }
    if ns < SEC {
        let mut s = frac(ns, MS, 6);
        s.push_str("ms");
        return s;
    }
    let (hours, rem) = (ns / HOUR, ns % HOUR);
    let (minutes, rem) = (rem / MINUTE, rem % MINUTE);
    let secs = frac(rem, SEC, 9);
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

/// The six `x-ratelimit-*` header values of `limits`, in [`RATE_LIMIT_HEADER_NAMES`] order:
/// limit and remaining as decimal integers (remaining never negative), resets as Go durations.
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

/// The headers of a refusal, in order: the six [`rate_limit_headers`], then `Retry-After` and
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
            .zip(rate_limit_headers(limits)),
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

/// The reason phrase of an HTTP status code (RFC 9110 §15); `""` for codes kvgate never sends
/// (the phrase is optional on the wire).
#[must_use]
pub fn reason_phrase(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Request Entity Too Large",
        417 => "Expectation Failed",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "",
    }
}

/// `Date` header value (RFC 9110 §5.6.7 IMF-fixdate, e.g. `Mon, 30 Nov 2026 11:05:41 GMT`) of the
/// system clock now.
#[must_use]
pub fn http_date_now() -> String {
    httpdate::fmt_http_date(std::time::SystemTime::now())
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
pub fn http_head(
    status: u16,
    headers: &[(&str, &str)],
    framing: Framing,
    date: &str,
    connection: Option<&str>,
    extra: usize,
) -> Result<Vec<u8>, ResponseError> {
    use std::io::Write as _;
    if !(100..=999).contains(&status) {
        return Err(ResponseError::Status(status));
    }
    let bad_value = |v: &str| v.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0);
    let mut len = 96 + date.len() + extra;
    for (name, value) in headers {
        if name.is_empty() || !name.bytes().all(is_token_byte) || bad_value(value) {
            return Err(ResponseError::Header((*name).to_owned()));
        }
        len += name.len() + value.len() + 4;
    }
    if let Some(c) = connection {
        if bad_value(c) {
            return Err(ResponseError::Header("Connection".to_owned()));
        }
        len += c.len() + 14;
    }
    let mut out = Vec::with_capacity(len);
    // writes into a Vec cannot fail
    let _ = write!(out, "HTTP/1.1 {status} {}\r\n", reason_phrase(status));
    for (name, value) in headers {
        for part in [name.as_bytes(), b": ", value.as_bytes(), b"\r\n"] {
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

/// A complete HTTP/1.1 response in one buffer: [`http_head`] with `Content-Length` of `body`,
/// then `body`.
///
/// Errors: as [`http_head`].
pub fn http_response(
    status: u16,
    headers: &[(&str, &str)],
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

    #[test]
    fn go_durations_match_go() {
        // (seconds, Go's text) — the same table as tests/gateway/test_wire_formats.py
        let cases: [(f64, &str); 12] = [
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
        ];
        for (secs, text) in cases {
            assert_eq!(go_duration_secs(secs), text, "{secs} s");
        }
        assert_eq!(go_duration_secs(f64::NAN), "0s");
        assert_eq!(go_duration_secs(f64::INFINITY), GO_MAX);
        assert_eq!(go_duration_ns(u64::MAX), GO_MAX);
        assert_eq!(go_duration_ns(1_500_000), "1.5ms");
        assert_eq!(go_duration_ns(HOUR), "1h0m0s");
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
            reset_requests_ns: SEC / 2,
            limit_tokens: 1000,
            remaining_tokens: 0,
            reset_tokens_ns: 360 * SEC,
        });
        assert_eq!(h, ["4", "0", "500ms", "1000", "0", "6m0s"]);
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
        let close = http_response(503, &[], b"", "d", Some("close")).unwrap();
        assert_eq!(
            close,
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nDate: d\r\nConnection: close\r\n\r\n"
        );
        let odd = http_response(299, &[], b"x", "d", None).unwrap();
        assert!(odd.starts_with(b"HTTP/1.1 299 \r\n"));
    }

    #[test]
    fn http_response_refuses_splitting_and_bad_status() {
        let date = "d";
        assert_eq!(
            http_response(99, &[], b"", date, None),
            Err(ResponseError::Status(99))
        );
        assert_eq!(
            http_response(1000, &[], b"", date, None),
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
        assert!(http_response(200, &[], b"", date, Some("close\r\nX: y")).is_err());
    }

    #[test]
    fn stream_heads_carry_their_framing() {
        let chunked = http_head(200, &[("X", "1")], Framing::Chunked, "d", None, 0).unwrap();
        assert_eq!(
            chunked,
            b"HTTP/1.1 200 OK\r\nX: 1\r\nTransfer-Encoding: chunked\r\nDate: d\r\n\r\n"
        );
        let close = http_head(200, &[], Framing::Close, "d", Some("close"), 0).unwrap();
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
