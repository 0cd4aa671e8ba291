"""OpenAI's rate-limit headers and ``Retry-After`` (ENGINES.md §5.3).

OpenAI sends ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` on every response; the
reset values are Go ``time.Duration`` strings (``1s``, ``12ms``, ``6m0s``). ``Retry-After`` is
whole seconds (RFC 9110) and ``retry-after-ms`` the float milliseconds the official Python client
reads first (openai-python ``_base_client.py``).
"""

from __future__ import annotations

import math

__all__ = ["go_duration", "rate_limit_headers", "retry_after_headers"]


def go_duration(seconds: float) -> str:
    """Format a duration the way Go's ``time.Duration.String`` does.

    Args:
        seconds: a duration in seconds (negative or NaN count as 0).

    Returns:
        ``"0s"``, ``"850ms"``, ``"1.5s"``, ``"6m0s"``, ``"1h2m3s"``, ... Below one second the
        unit is ``ms``; trailing zeros of fractions are dropped. Durations under 1 ms are
        ``"1ms"`` (Go's ``µs`` is not ASCII, and a header must be).
    """
    if not seconds > 0 or math.isinf(seconds):
        return "0s" if not seconds > 0 else "2562047h47m16.854775807s"
    ns = round(seconds * 1e9)
    if ns == 0:
        return "0s"
    if ns < 1_000_000:
        # Go would write "351.5µs"; a header must stay ASCII (clients decode it as latin-1),
        # so anything under a millisecond is rounded up to the smallest unit OpenAI sends
        return "1ms"
    if ns < 1_000_000_000:
        return _frac(ns, 1_000_000) + "ms"
    hours, rem = divmod(ns, 3_600 * 10**9)
    minutes, rem = divmod(rem, 60 * 10**9)
    secs = _frac(rem, 10**9) + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    if minutes:
        return f"{minutes}m{secs}"
    return secs


def _frac(value: int, unit: int) -> str:
    whole, frac = divmod(value, unit)
    if not frac:
        return str(whole)
    digits = len(str(unit)) - 1
    return f"{whole}." + f"{frac:0{digits}d}".rstrip("0")


def retry_after_headers(seconds: float | None) -> dict[str, str]:
    """``Retry-After`` (ceil whole seconds, at least 1) and ``retry-after-ms`` for a refusal.

    Args:
        seconds: the computed wait, or ``None`` when the request can never be admitted — then
            no ``Retry-After`` is sent and ``x-should-retry: false`` tells clients not to retry.
    """
    if seconds is None:
        return {"x-should-retry": "false"}
    seconds = max(seconds, 0.001)
    return {
        "Retry-After": str(max(1, math.ceil(seconds))),
        "retry-after-ms": str(max(1, math.ceil(seconds * 1000))),
    }


def rate_limit_headers(
    *,
    limit_requests: int,
    remaining_requests: int,
    reset_requests: float,
    limit_tokens: int,
    remaining_tokens: int,
    reset_tokens: float,
) -> dict[str, str]:
    """The six ``x-ratelimit-*`` headers.

    kvgate's "requests" limit is a concurrency limit (slots), not a per-minute count: limit is the
    effective concurrency limit, remaining the free slots, reset an estimate of the time until
    the slots in use are back (seconds). Tokens are the TPM bucket: limit is tokens per minute,
    remaining the tokens available now (never negative in the header), reset the time until the
    bucket is full again (seconds).
    """
    return {
        "x-ratelimit-limit-requests": str(max(0, limit_requests)),
        "x-ratelimit-remaining-requests": str(max(0, remaining_requests)),
        "x-ratelimit-reset-requests": go_duration(reset_requests),
        "x-ratelimit-limit-tokens": str(max(0, limit_tokens)),
        "x-ratelimit-remaining-tokens": str(max(0, remaining_tokens)),
        "x-ratelimit-reset-tokens": go_duration(reset_tokens),
    }
