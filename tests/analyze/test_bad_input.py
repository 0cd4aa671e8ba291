"""Every kind of bad input the analyser meets gets a clear OpenAI-shaped AnalysisError, never a
crash: invalid JSON, wrong types, empty messages, invalid UTF-8, deep nesting,
128k characters of whitespace, unknown model, oversized bodies, context overflow."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvgate

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hello there"}]


def refused(a: kvgate.RequestAnalyzer, body: bytes, route: str = CHAT) -> kvgate.AnalysisError:
    with pytest.raises(kvgate.AnalysisError) as info:
        a.analyze(route, body)
    err = info.value
    assert isinstance(err, ValueError)
    shape = err.body()
    assert set(shape["error"]) == {"message", "type", "param", "code"}
    assert orjson.loads(err.to_json()) == shape
    assert str(err) == err.message
    return err


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"not json",
        b'{"model": "m", "messages": [}',
        b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        b"[" * 100_000,
        b'{"model": "m", "messages": ' + b"[" * 200 + b"]" * 200 + b"}",
        b"{" + b'"a":{' * 5000,
        b" " * 131_072,
        b"\n\t " * 43_691,
    ],
    ids=[
        "empty",
        "truncated",
        "not-json",
        "syntax",
        "invalid-utf8",
        "deep-array",
        "deep-messages",
        "deep-object",
        "128k-spaces",
        "128k-mixed-whitespace",
    ],
)
def test_invalid_json(overhead_analyzer: kvgate.RequestAnalyzer, body: bytes) -> None:
    err = refused(overhead_analyzer, body)
    assert (err.status, err.type, err.param, err.code) == (
        400,
        "invalid_request_error",
        None,
        "invalid_json",
    )


def test_128k_whitespace_content_is_counted(overhead_analyzer: kvgate.RequestAnalyzer) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": " " * 131_072}]}
    assert overhead_analyzer.analyze(CHAT, orjson.dumps(body)).prompt_tokens > 0


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"max_tokens": "ten"}, "max_tokens", "invalid_type"),
        ({"max_tokens": -1}, "max_tokens", "integer_below_min_value"),
        ({"max_tokens": 0}, "max_tokens", "integer_below_min_value"),
        ({"max_tokens": 1e12}, "max_tokens", "invalid_type"),
        ({"max_tokens": 10.5}, "max_tokens", "invalid_type"),
        ({"max_completion_tokens": [3]}, "max_completion_tokens", "invalid_type"),
        ({"n": 0}, "n", "integer_below_min_value"),
        ({"n": "2"}, "n", "invalid_type"),
        ({"n": 1000}, "n", "integer_above_max_value"),
        ({"stream": "yes"}, "stream", "invalid_type"),
        ({"stream_options": []}, "stream_options", "invalid_type"),
        ({"messages": None}, "messages", "invalid_type"),
        ({"messages": []}, "messages", "empty_array"),
        ({"messages": [None]}, "messages[0]", "invalid_type"),
        ({"messages": [{"role": None, "content": "x"}]}, "messages[0].role", "invalid_type"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "invalid_type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
            "messages[0].content[0].type",
            "invalid_value",
        ),
        ({"model": None}, "model", "invalid_type"),
        ({"tools": "all"}, "tools", "invalid_type"),
    ],
)
def test_wrong_types_name_the_param(
    overhead_analyzer: kvgate.RequestAnalyzer, extra: dict[str, Any], param: str, code: str
) -> None:
    err = refused(overhead_analyzer, orjson.dumps({"model": "m", "messages": MSGS, **extra}))
    assert (err.status, err.type, err.param, err.code) == (
        400,
        "invalid_request_error",
        param,
        code,
    )


def test_messages_missing_and_messages_text(overhead_analyzer: kvgate.RequestAnalyzer) -> None:
    err = refused(overhead_analyzer, b'{"model": "m"}')
    assert (err.param, err.code) == ("messages", "missing_required_parameter")
    err = refused(
        overhead_analyzer, orjson.dumps({"model": "m", "messages": MSGS, "max_tokens": "ten"})
    )
    assert err.message == (
        "Invalid type for 'max_tokens': expected an integer, but got a string instead."
    )


def test_wrong_prompt_and_input(overhead_analyzer: kvgate.RequestAnalyzer) -> None:
    for prompt, code in [(None, "invalid_type"), ([], "empty_array"), ([10**6], "invalid_value")]:
        err = refused(
            overhead_analyzer, orjson.dumps({"model": "m", "prompt": prompt}), "/v1/completions"
        )
        assert (err.param, err.code) == ("prompt", code)
    for inp, code in [("", "invalid_value"), (["a"] * 2049, "invalid_value"), ({}, "invalid_type")]:
        err = refused(
            overhead_analyzer, orjson.dumps({"model": "m", "input": inp}), "/v1/embeddings"
        )
        assert (err.param, err.code) == ("input", code)


def test_unknown_model_and_route(overhead_analyzer: kvgate.RequestAnalyzer) -> None:
    err = refused(overhead_analyzer, orjson.dumps({"model": "gpt-9", "messages": MSGS}))
    assert (err.status, err.type, err.param, err.code) == (
        404,
        "invalid_request_error",
        "model",
        "model_not_found",
    )
    assert "`gpt-9`" in err.message
    reg = kvgate.ModelRegistry([overhead_analyzer])
    with pytest.raises(kvgate.AnalysisError) as info:
        reg.analyze(CHAT, orjson.dumps({"model": "gpt-9", "messages": MSGS}))
    assert info.value.code == "model_not_found"
    err = refused(overhead_analyzer, b"{}", "/v1/images/generations")
    assert (err.status, err.code) == (404, "unknown_url")


def test_context_length_exceeded(model_dir: Any) -> None:
    a = kvgate.RequestAnalyzer(
        model="m", context_window=50, tokenizer_path=str(model_dir / "tokenizer.json")
    )
    ok = a.analyze(CHAT, orjson.dumps({"model": "m", "messages": MSGS}))
    p = ok.prompt_tokens
    err = refused(a, orjson.dumps({"model": "m", "messages": MSGS, "max_tokens": 51 - p}))
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")
    assert err.message.startswith(
        f"This model's maximum context length is 50 tokens. However, you requested 51 tokens "
        f"({p} in the messages, {51 - p} in the completion)."
    )
    long = [{"role": "user", "content": "word " * 200}]
    err = refused(a, orjson.dumps({"model": "m", "messages": long}))
    assert "maximum context length is 50 tokens. However, your messages resulted in" in err.message
    err = refused(a, orjson.dumps({"model": "m", "prompt": "word " * 200}), "/v1/completions")
    assert (err.param, err.code) == ("prompt", "context_length_exceeded")
    err = refused(a, orjson.dumps({"model": "m", "input": "word " * 200}), "/v1/embeddings")
    assert (err.param, err.code) == ("input", "context_length_exceeded")


def test_body_cap(model_dir: Any) -> None:
    a = kvgate.RequestAnalyzer(model="m", context_window=1000, max_body_bytes=64)
    err = refused(
        a, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 100}]})
    )
    assert (err.status, err.param, err.code) == (413, None, "request_too_large")
    kvgate.check_content_length(None, 64)
    kvgate.check_content_length(64, 64)
    with pytest.raises(kvgate.AnalysisError) as info:
        kvgate.check_content_length(128 * 1024 * 1024, 64)
    assert (info.value.status, info.value.code) == (413, "request_too_large")
    assert "134217728 bytes" in info.value.message
    with pytest.raises(OverflowError):
        kvgate.check_content_length(-1, 64)


def test_peek_model_errors() -> None:
    for body, code in [
        (b"{", "invalid_json"),
        (b"[]", "invalid_type"),
        (b'{"model": 1}', "invalid_type"),
        (b"{}", "missing_required_parameter"),
    ]:
        with pytest.raises(kvgate.AnalysisError) as info:
            kvgate.peek_model(body)
        assert info.value.code == code


def test_error_constructible_from_python() -> None:
    err = kvgate.AnalysisError("nope", 413, "invalid_request_error", None, "request_too_large")
    assert err.body() == {
        "error": {
            "message": "nope",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_too_large",
        }
    }


@settings(max_examples=150, deadline=None)
@given(body=st.binary(max_size=400))
def test_fuzz_arbitrary_bytes(template_analyzer: kvgate.RequestAnalyzer, body: bytes) -> None:
    for route in (CHAT, "/v1/completions", "/v1/embeddings"):
        try:
            r = template_analyzer.analyze(route, body)
        except kvgate.AnalysisError as err:
            assert err.status in (400, 404, 413)  # noqa: PT017 (either outcome is valid)
        else:
            assert r.reserved_tokens == r.prompt_tokens + r.completion_tokens


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),  # orjson serialises 64-bit integers only
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(
    messages=json_value,
    max_tokens=json_value,
    n=json_value,
    tools=json_value,
)
def test_fuzz_json_fields(
    template_analyzer: kvgate.RequestAnalyzer, messages: Any, max_tokens: Any, n: Any, tools: Any
) -> None:
    body = orjson.dumps(
        {"model": "m", "messages": messages, "max_tokens": max_tokens, "n": n, "tools": tools}
    )
    try:
        template_analyzer.analyze(CHAT, body)
    except kvgate.AnalysisError as err:
        assert err.status == 400  # noqa: PT017 (either outcome is valid)
        assert err.type == "invalid_request_error"  # noqa: PT017
