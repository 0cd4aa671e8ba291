"""OpenAI's rate-limit headers and ``Retry-After`` (ENGINES.md §5.3).

OpenAI sends ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` on every response; the
reset values are Go ``time.Duration`` strings (``1s``, ``12ms``, ``6m0s``), formatted in Rust with
the numbers they carry (``AdmissionController.rate_limit_headers``, ``go_duration``). ``Retry-After`` is
whole seconds (RFC 9110) and ``retry-after-ms`` the float milliseconds the official Python client
reads first (openai-python ``_base_client.py``).
"""

from __future__ import annotations

import math

from kvgate._core import go_duration

__all__ = ["go_duration", "retry_after_headers"]


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
