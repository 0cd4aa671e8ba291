"""Pure wire-format pieces of the gateway: SSE inspection, error reshaping, rate-limit headers."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate import AdmissionController, InvalidConfigError, ManualClock
from kvgate._core import go_duration
from kvgate.errors import reshape_upstream_error
from kvgate.proxy.sse import SSEInspector

FIXTURES = Path(__file__).parent.parent / "fixtures" / "responses"
STREAM = (FIXTURES / "openai-chat-stream-n2-tools-include-usage.sse").read_bytes()


def _events(raw: bytes) -> list[bytes]:
    parts = raw.split(b"\n\n")
    return [p + b"\n\n" for p in parts if p.strip()]


def test_sse_passthrough_is_byte_for_byte_and_reads_usage() -> None:
    insp = SSEInspector(strip_usage_chunk=False)
    out = insp.feed(STREAM) + insp.flush()
    assert out == STREAM
    assert insp.usage is not None
    assert insp.usage["prompt_tokens"] == 85
    assert insp.usage["completion_tokens"] == 43
    assert insp.done


def test_sse_strips_the_usage_chunk_and_the_null_usage_members() -> None:
    """What the client would have received without include_usage: no usage chunk, and no
    `"usage":null` on the other chunks (OpenAI sends it only when usage was asked for)."""
    insp = SSEInspector(strip_usage_chunk=True)
    out = insp.feed(STREAM) + insp.flush()
    events = _events(STREAM)
    usage_events = [e for e in events if b'"choices":[]' in e]
    assert len(usage_events) == 1
    want = b"".join(e.replace(b',"usage":null}', b"}") for e in events if e not in usage_events)
    assert out == want
    assert b'"usage"' not in out
    # every remaining event is still valid JSON, its other members untouched
    for event in _events(out):
        if event.startswith(b"data: {"):
            assert "usage" not in json.loads(event[6:])
    assert insp.usage is not None
    assert insp.usage["total_tokens"] == 128


# no per-example deadline (default 200 ms): a loaded CI machine can stall any example that long
@settings(deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=40))
def test_sse_any_chunking_gives_the_same_bytes(cuts: list[int]) -> None:
    """Upstream TCP chunks can split an event anywhere: output never re-frames."""
    bounds = [0, *sorted(set(cuts)), len(STREAM)]
    insp = SSEInspector(strip_usage_chunk=True)
    out = b"".join(insp.feed(STREAM[a:b]) for a, b in itertools.pairwise(bounds))
    out += insp.flush()
    ref = SSEInspector(strip_usage_chunk=True)
    assert out == ref.feed(STREAM) + ref.flush()
    assert insp.usage == ref.usage
    assert insp.delivered_text == ref.delivered_text


def test_sse_collects_delivered_text_and_errors() -> None:
    chunks = [
        {"choices": [{"index": 0, "delta": {"content": "Hello"}}]},
        {"choices": [{"index": 0, "text": " world"}]},
        {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}},
    ]
    raw = b"".join(b"data: " + orjson.dumps(c) + b"\r\n\r\n" for c in chunks)
    insp = SSEInspector(strip_usage_chunk=False)
    assert insp.feed(raw) == raw
    assert "".join(insp.delivered_text) == "Hello world"
    assert insp.content_chunks == 2
    assert insp.error is not None
    assert insp.error["message"] == "boom"
    assert not insp.done


def test_sse_garbage_events_pass_through() -> None:
    raw = b": keep-alive\n\ndata: {not json\n\ndata: [1,2]\n\n"
    insp = SSEInspector(strip_usage_chunk=True)
    assert insp.feed(raw) == raw
    assert insp.usage is None


def test_sse_partial_tail_is_flushed() -> None:
    insp = SSEInspector(strip_usage_chunk=False)
    assert insp.feed(b'data: {"choices":[]}') == b""
    assert insp.flush() == b'data: {"choices":[]}'


@pytest.mark.parametrize(
    "name",
    [
        "vllm-error-400-context-length-flat-pre-0.10.1.json",
        "vllm-error-400-context-length-nested-0.10.1plus.json",
    ],
)
def test_vllm_errors_are_reshaped_to_openai(name: str) -> None:
    raw = (FIXTURES / name).read_bytes()
    err = json.loads(reshape_upstream_error(400, raw))["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "context_length_exceeded"
    assert "maximum context length" in err["message"]


def test_openai_shaped_error_passes_unchanged() -> None:
    raw = (FIXTURES / "openai-error-400-context-length-exceeded.json").read_bytes()
    assert reshape_upstream_error(400, raw) == raw


@pytest.mark.parametrize(
    ("status", "body", "type_"),
    [
        (429, b'{"error": "Model is overloaded", "error_type": "overloaded"}', "overloaded"),
        (500, b"<html>Internal Server Error</html>", "server_error"),
        (502, b"", "server_error"),
        (
            501,
            b'{"error": {"code": 501, "message": "metrics off", "type": "not_supported_error"}}',
            "not_supported_error",
        ),
    ],
)
def test_other_engine_errors_are_reshaped(status: int, body: bytes, type_: str) -> None:
    err = json.loads(reshape_upstream_error(status, body))["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_
    assert err["message"]
    assert err["code"] is None or isinstance(err["code"], str)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-1, "0s"),
        (0.004, "4ms"),
        (0.012, "12ms"),
        (1, "1s"),
        (9.816, "9.816s"),
        (360, "6m0s"),
        (864, "14m24s"),
        (90.5, "1m30.5s"),
        (3723, "1h2m3s"),
        (0.0000015, "1ms"),
        (0.000351521, "1ms"),
    ],
)
def test_go_duration_matches_go(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


def test_retry_after_rounds_up_and_never_is_explicit() -> None:
    ctl = AdmissionController()
    b = ctl.add_backend("b", max_concurrency=4, tokens_per_minute=600)
    t = ctl.add_tenant("t", priority="standard")

    def refusal(retry_after: float | None) -> dict[str, str]:
        pairs = ctl.refusal_headers(b, t, retry_after, "backend-tpm")
        names = [name for name, _ in pairs]
        assert names[:6] == [name for name, _ in ctl.rate_limit_headers(b, t)]
        assert names[-2:] == ["x-kvgate-reject-reason", "Content-Type"]
        return dict(pairs)

    h = refusal(0.2)
    assert (h["Retry-After"], h["retry-after-ms"]) == ("1", "200")
    assert h["x-kvgate-reject-reason"] == "backend-tpm"
    assert h["Content-Type"] == "application/json"
    assert "x-should-retry" not in h
    assert refusal(2.0001)["Retry-After"] == "3"
    assert refusal(-1.0)["retry-after-ms"] == "1"
    never = refusal(None)  # never admissible: no Retry-After at all
    assert never["x-should-retry"] == "false"
    assert "Retry-After" not in never
    assert "retry-after-ms" not in never
    with pytest.raises(TypeError):
        ctl.refusal_headers(b, t, "soon", "backend-tpm")  # type: ignore[arg-type]


def test_rate_limit_headers_never_negative() -> None:
    clock = ManualClock()
    ctl = AdmissionController(clock=clock)
    b = ctl.add_backend("b", max_concurrency=2, tokens_per_minute=1200)
    t = ctl.add_tenant("t", priority="standard")
    held = [ctl.admit(b, t, "standard", 500), ctl.admit(b, t, "standard", 500)]
    clock.advance(0.5)
    held[0].release(1300)  # 800 tokens over the reservation: the bucket goes into debt
    clock.advance(0.25)
    held.append(ctl.admit(b, t, "standard", 0))  # both slots held again
    h = dict(ctl.rate_limit_headers(b, t))
    assert [name for name, _ in ctl.rate_limit_headers(b, t)] == [
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    ]
    assert h["x-ratelimit-limit-requests"] == "2"
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"] == "500ms"  # hold-time EWMA: one 0.5 s hold
    assert h["x-ratelimit-limit-tokens"] == "1200"
    assert ctl.backend_state(b)["available_tokens"] < 0
    assert h["x-ratelimit-remaining-tokens"] == "0"  # debt is never shown as negative
    # 1200 tokens/min = 20/s: from the debt back to the full 1200-token bucket
    full = ctl.backend_state(b)["time_to_full"]
    assert h["x-ratelimit-reset-tokens"] == go_duration(full)
    assert 60 < full < 120
    for r in held[1:]:
        r.release()


def test_rate_limit_headers_use_the_tenants_own_limits() -> None:
    clock = ManualClock()
    ctl = AdmissionController(clock=clock)
    b = ctl.add_backend("b", max_concurrency=64, tokens_per_minute=60_000)
    t = ctl.add_tenant("t", priority="standard", tokens_per_minute=600, max_concurrency=3)
    r = ctl.admit(b, t, "standard", 100)
    h = dict(ctl.rate_limit_headers(b, t))
    assert h["x-ratelimit-limit-requests"] == "3"
    assert h["x-ratelimit-remaining-requests"] == "2"
    assert h["x-ratelimit-reset-requests"] == "0s"  # a slot is free
    assert h["x-ratelimit-limit-tokens"] == "600"
    assert h["x-ratelimit-remaining-tokens"] == "500"
    assert h["x-ratelimit-reset-tokens"] == "10s"  # 100 tokens at 10 tokens/s
    r.release()
    with pytest.raises(InvalidConfigError):
        ctl.rate_limit_headers(b, 7)


def test_usage_tokens_of_a_response_body() -> None:
    from kvgate._core import usage_tokens

    body = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 85, "completion_tokens": 43}})
    assert usage_tokens(body) == (85, 43)
    assert usage_tokens(b'{"usage": {"prompt_tokens": true, "completion_tokens": -2}}') == (
        None,
        None,
    )
    assert usage_tokens(b'{"usage": null}') is None
    assert usage_tokens(b"<html>bad gateway</html>") is None
    with pytest.raises(TypeError):
        usage_tokens("{}")  # type: ignore[arg-type]
