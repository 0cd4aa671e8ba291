"""Non-streamed requests go upstream as streams and their JSON answer is assembled by kvgate
(``stream_upstream``, :mod:`kvgate.proxy.assemble`): the same answer as the engine's own
non-streamed one, and an abandoned request stops at the engine at once."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.gateway import assemble_reference as reference
from tests.gateway.conftest import config_for
from tests.gateway.fake_upstream import run_upstream, serve_app
from tests.gateway.helpers import until

from kvgate.config import Config
from kvgate.gateway_build import build_gateway
from kvgate.proxy.assemble import EVENT_LIMIT, StreamAssembler
from kvgate.proxy.handler import rewrite_body
from kvgate.routing import analyze_now
from kvgate.sim import SimConfig, run_sim

FIXTURES = Path(__file__).parent.parent / "fixtures" / "responses"
TOOLS_SSE = (FIXTURES / "openai-chat-stream-n2-tools-include-usage.sse").read_bytes()
TOOLS_JSON = orjson.loads((FIXTURES / "openai-chat-n2-tools-assembled.json").read_bytes())


def _config(url: str, model: str, **backend: Any) -> Config:
    cfg = config_for(url, [model]).model_dump()
    cfg["backends"][0].update(backend)
    return Config.model_validate(cfg)


def _without_ids(answer: dict[str, Any]) -> dict[str, Any]:
    """``answer`` without what differs between two calls: ids and creation times."""
    out = copy.deepcopy(answer)
    for key in ("id", "created", "created_at"):
        out.pop(key, None)
    for item in out.get("output") or ():
        item.pop("id", None)
    return out


# ---- the assembler alone ------------------------------------------------------------------


def _feed(asm: StreamAssembler, sse: bytes, piece: int) -> StreamAssembler:
    for i in range(0, len(sse), piece):
        asm.feed(sse[i : i + piece])
    asm.finish()
    return asm


def _assemble(sse: bytes, piece: int = 7, kind: str = "chat") -> dict[str, Any]:
    asm = _feed(StreamAssembler(kind), sse, piece)
    assert asm.complete
    assert asm.error is None
    return dict(orjson.loads(asm.answer()))


def _sse(*events: Any, done: bool = True) -> bytes:
    out = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def test_recorded_openai_stream_assembles_to_its_non_streamed_answer() -> None:
    # n=2, interleaved tool-call deltas, include_usage: the answer OpenAI gives without a stream
    for piece in (1, 7, 97, len(TOOLS_SSE)):
        assert _assemble(TOOLS_SSE, piece) == TOOLS_JSON


def test_sse_lines_accept_crlf_and_cr_line_ends_and_multiline_data() -> None:
    sse = b'data: {"a":\r\ndata: 1}\r\n\r\ndata: [DONE]\r\rdata:{"model":"m","choices":[]}\n\n'
    for piece in (1, 2, 5, len(sse)):
        asm = _feed(StreamAssembler("chat"), sse, piece)
        assert asm.complete
        assert orjson.loads(asm.answer())["model"] == "m"  # the event after [DONE] still read


def test_an_event_past_the_limit_breaks_the_stream_off() -> None:
    asm = StreamAssembler("chat")
    asm.feed(b"data: ")
    piece = b"x" * (1 << 20)
    for _ in range(EVENT_LIMIT // len(piece) - 1):
        asm.feed(piece)
        assert not asm.overlong
    asm.feed(piece)
    assert asm.overlong
    # an event under the limit, in pieces, passes whole
    asm = StreamAssembler("completions")
    text = "y" * (EVENT_LIMIT - 100)
    event = orjson.dumps({"choices": [{"text": text}]})[: EVENT_LIMIT - 100]
    assert len(event) < EVENT_LIMIT
    asm.feed(b"data: ")
    asm.feed(event[:10])
    asm.feed(event[10:] + b"\n\n")
    assert not asm.overlong


def test_empty_data_lines_count_toward_the_event_limit() -> None:
    """``data:`` lines with nothing after the colon still grow the event (its line ends): a
    stream of them breaks off at the limit instead of growing the gateway's memory."""
    asm = StreamAssembler("chat")
    asm.feed(b"data: {}\n")
    piece = b"data:\n" * (1 << 20)
    for _ in range(EVENT_LIMIT // (1 << 20) + 1):
        asm.feed(piece)
        if asm.overlong:
            break
    assert asm.overlong


def test_an_event_with_many_member_names_costs_their_number_not_its_square() -> None:
    """An engine (or anything answering in its place) may send thousands of member names in
    one delta or tool call; merging them must stay linear (a search per name through a list
    took 2.8 s for 40,000 names, and the event loop waits meanwhile)."""
    names = 100_000
    delta = {f"k{i}": None for i in range(names)}
    call = {"index": 0, **{f"t{i}": 1 for i in range(names)}}
    event = {"choices": [{"index": 0, "delta": {**delta, "tool_calls": [call]}}]}
    asm = StreamAssembler("chat")
    started = time.perf_counter()
    asm.feed(_sse(event))
    elapsed = time.perf_counter() - started
    message = orjson.loads(asm.answer())["choices"][0]["message"]
    assert len(message) == 2 + names + 1  # role, content, the names, tool_calls
    assert elapsed < 3.0, f"{elapsed:.2f} s"  # linear: about 0.1 s; quadratic: over 10 s


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="expected 'chat'"):
        StreamAssembler("embeddings")


def test_chunk_error_event_sets_the_error() -> None:
    asm = StreamAssembler("chat")
    asm.feed(_sse({"id": "x", "choices": [{"index": 0, "delta": {"content": "hi"}}]}, done=False))
    err = {"message": "CUDA out of memory", "type": "InternalServerError"}
    asm.feed(_sse({"error": err}, done=False))
    assert asm.error == err
    assert not asm.complete


def test_responses_answer_is_the_terminal_events_response() -> None:
    asm = StreamAssembler("responses")
    asm.feed(b"event: response.created\n")
    asm.feed(_sse({"type": "response.created", "response": {"id": "r"}}, done=False))
    asm.feed(_sse({"type": "response.output_text.delta", "delta": "hi"}, done=False))
    assert not asm.complete
    final = {"id": "r", "object": "response", "status": "completed", "usage": {}}
    asm.feed(_sse({"type": "response.completed", "response": final}, done=False))
    assert asm.complete
    assert orjson.loads(asm.answer()) == final
    failed = StreamAssembler("responses")
    boom = {"type": "error", "code": "server_error", "message": "boom", "param": None}
    failed.feed(_sse(boom, done=False))
    assert failed.error == {"message": "boom", "param": None, "code": "server_error"}


def test_a_responses_stream_cut_before_its_end_answers_the_text_so_far() -> None:
    """What a cut stream is charged (the client gone, the engine broken): the text of the
    ``delta`` events so far, as an answer of one message (it was ``{}``: nothing charged)."""
    asm = StreamAssembler("responses")
    assert orjson.loads(asm.answer()) == {}
    events = [{"type": "response.created", "response": {"id": "r", "status": "in_progress"}}]
    events += [{"type": "response.output_text.delta", "delta": d} for d in ("Hel", "lo", " x")]
    events.append({"type": "response.function_call_arguments.delta", "delta": '{"a":1}'})
    events.append({"type": "response.output_text.delta", "delta": 5})  # not text: ignored
    asm.feed(_sse(*events, done=False))
    assert not asm.complete
    out = orjson.loads(asm.answer())["output"]
    assert out == [
        {"type": "message", "content": [{"type": "output_text", "text": 'Hello x{"a":1}'}]}
    ]
    final = {"id": "r", "object": "response", "status": "completed", "output": []}
    asm.feed(_sse({"type": "response.completed", "response": final}, done=False))
    assert orjson.loads(asm.answer()) == final


# ---- the Rust assembler against the reference (the first, Python, version) -------------------

_KEYS = st.sampled_from(
    ["id", "created", "model", "object", "usage", "error", "choices", "system_fingerprint",
     "index", "delta", "text", "logprobs", "finish_reason", "stop_reason", "role", "content",
     "reasoning_content", "refusal", "tool_calls", "function_call", "function", "name",
     "arguments", "type", "message", "tokens", "response", "code", "param"]
)  # fmt: skip
_WORDS = st.sampled_from(
    ["response.completed", "response.output_text.delta", "error", "response.failed", "stop",
     "function"]
)  # fmt: skip
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-3, max_value=3)
    | st.floats(min_value=-1e300, max_value=1e300, allow_nan=False)
    | st.text(alphabet='ab é\n"\\', max_size=4)
    | _WORDS
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=5),
    max_leaves=8,
)
_EVENT = st.dictionaries(_KEYS, _JSON, max_size=6)


#: a small JSON value of any type (a member of the wrong type)
_ANY = _SCALARS | st.lists(_SCALARS, max_size=2) | st.dictionaries(_KEYS, _SCALARS, max_size=2)


def _or_any(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``strategy`` mostly, any small JSON value sometimes."""
    return st.one_of(strategy, strategy, strategy, _ANY)


_INDEX = _or_any(st.integers(min_value=0, max_value=2))
_TEXT = _or_any(st.text(alphabet="ab {}", max_size=3))
_FUNCTION = st.fixed_dictionaries({}, optional={"name": _TEXT, "arguments": _TEXT, "x": _ANY})
_TOOL_CALL = st.fixed_dictionaries(
    {},
    optional={"index": _INDEX, "id": _TEXT, "type": _or_any(st.just("function")),
              "function": _or_any(_FUNCTION), "x": _ANY},
)  # fmt: skip
_DELTA = st.fixed_dictionaries(
    {},
    optional={"role": _or_any(st.just("assistant")), "content": _TEXT,
              "reasoning_content": _TEXT, "refusal": _TEXT,
              "tool_calls": _or_any(st.lists(_or_any(_TOOL_CALL), max_size=2)),
              "function_call": _or_any(_FUNCTION), "x": _ANY},
)  # fmt: skip
_LOGPROBS = st.fixed_dictionaries(
    {},
    optional={"content": _or_any(st.lists(_ANY, max_size=2)),
              "tokens": _or_any(st.lists(_TEXT, max_size=2)), "x": _ANY},
)  # fmt: skip
_CHOICE = st.fixed_dictionaries(
    {},
    optional={"index": _INDEX, "delta": _or_any(_DELTA), "text": _TEXT,
              "logprobs": _or_any(_LOGPROBS), "finish_reason": _or_any(st.just("stop")),
              "stop_reason": _ANY, "message": _ANY},
)  # fmt: skip
_CHUNK = st.fixed_dictionaries(
    {},
    optional={"id": _TEXT, "created": _INDEX, "model": _TEXT, "object": _TEXT,
              "choices": _or_any(st.lists(_or_any(_CHOICE), max_size=2)),
              "usage": _or_any(st.fixed_dictionaries({"prompt_tokens": _INDEX})),
              "error": _or_any(st.fixed_dictionaries({"message": _TEXT})),
              "system_fingerprint": _ANY},
)  # fmt: skip
_RESPONSES_EVENT = st.fixed_dictionaries(
    {"type": _or_any(st.sampled_from(
        ["response.output_text.delta", "response.refusal.delta", "response.completed",
         "response.incomplete", "response.failed", "error", "response.created"]))},
    optional={"delta": _TEXT, "response": _or_any(st.fixed_dictionaries(
        {}, optional={"id": _TEXT, "error": _ANY, "usage": _ANY})),
        "error": _ANY, "message": _TEXT, "code": _ANY},
)  # fmt: skip


def _reference(kind: str, payloads: list[bytes]) -> tuple[Any, Any, bool, bool]:
    """(answer, error, complete, all finished) by the reference assembler."""
    ref: reference.Assembler = (
        reference.ResponsesAssembler() if kind == "responses" else
        reference.ChunkAssembler(chat=kind == "chat")
    )  # fmt: skip
    for payload in payloads:
        if payload == b"[DONE]":
            ref.done()
            continue
        try:
            ref.add(orjson.loads(payload))
        except orjson.JSONDecodeError:
            continue
    answer = ref.answer()
    choices = answer.get("choices")
    finished = (
        kind != "responses"
        and isinstance(choices, list)
        and bool(choices)
        and all(isinstance(c, dict) and c.get("finish_reason") is not None for c in choices)
    )
    return answer, ref.error, ref.complete, finished


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["chat", "completions", "responses"]),
    st.lists(
        _CHUNK | _RESPONSES_EVENT | _EVENT | st.sampled_from([b"[DONE]", b"not json", b"[1]"]),
        max_size=6,
    ),
    st.sampled_from(["\n", "\r\n", "\r"]),
    st.lists(st.integers(min_value=1, max_value=400), max_size=8),
)
def test_the_rust_assembler_builds_the_references_answer_from_any_stream(
    kind: str, events: list[Any], end: str, cuts: list[int]
) -> None:
    """On any stream of events (chunks and Responses events with every member the merge reads,
    each sometimes of the wrong type; any JSON object; payloads that are not objects or not
    JSON), cut anywhere, with any line end, the Rust assembler gives the answer (its members in
    the same order), error and end state of the reference."""
    payloads = [e if isinstance(e, bytes) else orjson.dumps(e) for e in events]
    eol = end.encode()
    raw = b"".join(b"data: " + p + eol + eol for p in payloads)
    bounds = [0, *sorted({c for c in cuts if c < len(raw)}), len(raw)]
    asm = StreamAssembler(kind)
    for a, b in itertools.pairwise(bounds):
        asm.feed(raw[a:b])
    asm.finish()
    answer, error, complete, finished = _reference(kind, payloads)
    assert orjson.loads(asm.answer()) == answer
    assert list(orjson.loads(asm.answer())) == list(answer)  # the members' order too
    assert asm.error == error
    assert asm.complete == complete
    assert asm.all_finished == finished


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.text(alphabet='ab{}:" \u00e9', max_size=20), min_size=1, max_size=3),
            st.sampled_from(["\n", "\r\n", "\r"]),
        ),
        max_size=6,
    ),
    st.lists(st.integers(min_value=1, max_value=300), max_size=10),
)
def test_the_reference_sse_lines_any_chunking_gives_the_payloads_of_one_read(
    events: list[tuple[list[str], str]], cuts: list[int]
) -> None:
    """The reference's line splitting, cut anywhere (inside a line, between CR and LF), gives
    the payloads of the whole stream read at once (the Rust one is held to the reference)."""
    raw = b"".join(
        b"".join(f"data: {line}{end}".encode() for line in lines) + end.encode()
        for lines, end in events
    )
    bounds = [0, *sorted({c for c in cuts if c < len(raw)}), len(raw)]
    lines = reference.SSELines()
    cut = [p for a, b in itertools.pairwise(bounds) for p in lines.feed(raw[a:b])]
    whole = reference.SSELines()
    assert cut + lines.flush() == whole.feed(raw) + whole.flush()


def test_rewrite_body_asks_for_a_stream() -> None:
    plain = SimpleNamespace(inject_max_tokens=None)
    body = b'{"model": "m", "seed": 123456789012345678901234567890}'
    # absent: spliced in, every byte of the client's kept
    out = rewrite_body(body, plain, add_usage=True, stream_upstream=True)
    assert out == b'{"stream":true,"stream_options":{"include_usage":true},' + body[1:]
    # present ("stream": false): changed in a re-encoded copy, the big integer exact
    body = b'{"model": "m", "stream": false, "seed": 123456789012345678901234567890}'
    out = rewrite_body(body, plain, add_usage=False, stream_upstream=True)
    assert out == b'{"model":"m","stream":true,"seed":123456789012345678901234567890}'


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hi"}], "stream": False},
        {"messages": [{"role": "user", "content": "hi"}], "stream": None},
        {"messages": [{"role": "user", "content": "hi"}], "stream_options": None},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": None},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
        {"messages": [{"role": "user", "content": "hi"}], "stream": True},
        {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 5},
    ],
)
def test_rewrite_body_skips_the_second_parse_only_when_the_analyser_saw_no_key_to_add(
    body: dict[str, Any],
) -> None:
    """``analysis.addable`` (the analyser saw none of ``stream`` — or ``"stream": true`` —,
    ``stream_options``, ``max_tokens``) lets the members be spliced without parsing the body
    again; the forwarded body is the one the second parse gives, and has each key once."""
    cfg = config_for("http://127.0.0.1:9", ["m"]).model_dump()
    cfg["backends"][0]["models"][0]["default_max_tokens"] = 7
    gw = build_gateway(Config.model_validate(cfg), poll=False)
    raw = orjson.dumps({"model": "m", **body})
    _model, analysis = analyze_now(gw, "/v1/chat/completions", raw)
    stream_ok = body.get("stream", True) is True
    assert analysis.addable == (stream_ok and not {"stream_options", "max_tokens"} & set(body))
    # as the handler asks: a streamed request gets include_usage, a non-streamed one a stream
    upstream = not analysis.stream
    reparsed = SimpleNamespace(inject_max_tokens=analysis.inject_max_tokens, drop_cap=None)
    out = rewrite_body(raw, analysis, add_usage=True, stream_upstream=upstream)
    assert out == rewrite_body(raw, reparsed, add_usage=True, stream_upstream=upstream)
    sent = orjson.loads(out)
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["max_tokens"] == (body.get("max_tokens") or 7)
    assert out.count(b'"stream"') == 1


# ---- through the gateway, against the simulator -------------------------------------------


@pytest.fixture
async def sim():
    async with run_sim(SimConfig.from_profile("tiny", speed=50, seed=3)) as running:
        yield running


async def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, r.headers, orjson.loads(await r.read())


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 12, "n": 2},
        ),
        ("/v1/completions", {"prompt": ["once upon", "a time"], "max_tokens": 9}),
        ("/v1/responses", {"input": "say something", "max_output_tokens": 10}),
        ("/v1/responses", {"input": "say more", "max_output_tokens": 3, "ignore_eos": True}),
    ],
)
async def test_sim_answer_through_gateway_equals_the_engines_own(
    sim, gateway_for, path: str, body: dict[str, Any]
) -> None:
    model = sim.engine.config.model
    body = {"model": model, **body}
    status, _, direct = await _post(sim.url, path, body)
    assert status == 200
    async with gateway_for(config_for(sim.url, [model])) as gw:
        status, headers, assembled = await _post(gw.url, path, body)
        assert status == 200
        assert headers["Content-Type"] == "application/json"
        assert "Cache-Control" not in headers  # the engine's stream header is not relayed
        assert _without_ids(assembled) == _without_ids(direct)
        # settled from the usage chunk: everything refunded, no slot held
        await until(lambda: gw.backend_state()["in_use"] == 0)
        assert gw.backend_state()["inflight_tokens"] == 0


async def test_stream_upstream_false_forwards_the_request_as_sent(gateway_for) -> None:
    body = {"model": "logprobs", "messages": [{"role": "user", "content": "Hello!"}]}
    async with (
        run_engine() as engine,
        gateway_for(_config(engine.url, "logprobs", stream_upstream=False)) as gw,
    ):
        status, _, answer = await _post(gw.url, "/v1/chat/completions", body)
        assert status == 200
        assert answer == LOGPROBS_JSON
        assert engine.bodies[-1] == body  # not turned into a stream


# ---- a scripted engine: recorded OpenAI answers, logprobs, a llama.cpp-like disconnect -----


#: a chat answer with logprobs as OpenAI streams it (two content tokens, then the usage chunk)
LOGPROBS_CHUNKS: list[dict[str, Any]] = [
    {
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": "", "refusal": None},
                "logprobs": {"content": [], "refusal": None},
                "finish_reason": None,
            }
        ]
    },
    {
        "choices": [
            {
                "index": 0,
                "delta": {"content": "Hello"},
                "logprobs": {
                    "content": [
                        {
                            "token": "Hello",
                            "logprob": -0.31725305,
                            "bytes": [72, 101, 108, 108, 111],
                            "top_logprobs": [
                                {
                                    "token": "Hello",
                                    "logprob": -0.31725305,
                                    "bytes": [72, 101, 108, 108, 111],
                                },
                                {"token": "Hi", "logprob": -1.3190403, "bytes": [72, 105]},
                            ],
                        }
                    ],
                    "refusal": None,
                },
                "finish_reason": None,
            }
        ]
    },
    {
        "choices": [
            {
                "index": 0,
                "delta": {"content": "!"},
                "logprobs": {
                    "content": [
                        {
                            "token": "!",
                            "logprob": -0.02380986,
                            "bytes": [33],
                            "top_logprobs": [
                                {"token": "!", "logprob": -0.02380986, "bytes": [33]},
                                {"token": " there", "logprob": -3.787621, "bytes": [32, 116]},
                            ],
                        }
                    ],
                    "refusal": None,
                },
                "finish_reason": None,
            }
        ]
    },
    {"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]},
]
LOGPROBS_HEAD = {
    "id": "chatcmpl-9",
    "object": "chat.completion.chunk",
    "created": 1702685778,
    "model": "gpt-4o-mini",
    "system_fingerprint": "fp_44709d6fcb",
}
LOGPROBS_USAGE = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
#: the same answer as OpenAI sends it without a stream
LOGPROBS_JSON = {
    **LOGPROBS_HEAD,
    "object": "chat.completion",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello!", "refusal": None},
            "logprobs": {
                "content": [
                    *LOGPROBS_CHUNKS[1]["choices"][0]["logprobs"]["content"],
                    *LOGPROBS_CHUNKS[2]["choices"][0]["logprobs"]["content"],
                ],
                "refusal": None,
            },
            "finish_reason": "stop",
        }
    ],
    "usage": LOGPROBS_USAGE,
}


@dataclass
class Engine:
    """A scripted engine. ``tools`` / ``logprobs`` answer the recorded answers (streamed or
    not); ``generate`` answers like llama.cpp's server: one token every 20 ms up to
    ``max_tokens``; a non-streamed request does not notice that its client went away (its
    server runs without handler cancellation and nothing is written until the end), a streamed
    one stops at the first failed write."""

    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    generating: int = 0
    aborted: int = 0
    completed: int = 0


def _engine_app(state: Engine) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state.bodies.append(body)
        stream = bool(body.get("stream"))
        model = body["model"]
        if model == "generate":
            return await _generate(request, state, stream, int(body["max_tokens"]))
        if model == "midfail":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chunk = {"choices": [{"index": 0, "delta": {"content": "par"}}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            err = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
            await resp.write(b"data: " + orjson.dumps(err) + b"\n\n")
            return resp
        if model == "cut":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chunk = {"choices": [{"index": 0, "delta": {"content": "par"}}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            return resp
        if model == "tools":
            if not stream:
                return web.json_response(TOOLS_JSON)
            sse = TOOLS_SSE
        else:
            if not stream:
                return web.json_response(LOGPROBS_JSON)
            events = [{**LOGPROBS_HEAD, **c, "usage": None} for c in LOGPROBS_CHUNKS]
            events.append({**LOGPROBS_HEAD, "choices": [], "usage": LOGPROBS_USAGE})
            sse = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
            sse += b"data: [DONE]\n\n"
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "x-engine": "scripted"}
        )
        await resp.prepare(request)
        for i in range(0, len(sse), 61):  # events cut across writes
            await resp.write(sse[i : i + 61])
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    return app


async def _generate(
    request: web.Request, state: Engine, stream: bool, max_tokens: int
) -> web.StreamResponse:
    state.generating += 1
    resp: web.StreamResponse | None = None
    try:
        if stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
        for i in range(max_tokens):
            await asyncio.sleep(0.02)
            if resp is not None:
                chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
                try:
                    await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                except (ConnectionError, RuntimeError):
                    state.aborted += 1
                    return resp
        state.completed += 1
        if resp is None:
            return web.json_response({"choices": [{"index": 0, "text": "done"}]})
        await resp.write(b"data: [DONE]\n\n")
        return resp
    finally:
        state.generating -= 1


@contextlib.asynccontextmanager
async def run_engine() -> AsyncIterator[Engine]:
    state = Engine()
    # like llama.cpp's server: a handler is not cancelled when its client goes away
    async with serve_app(_engine_app(state), handler_cancellation=False) as state.url:
        yield state


@pytest.mark.parametrize("model", ["tools", "logprobs"])
async def test_recorded_answers_through_gateway(gateway_for, model: str) -> None:
    messages = [{"role": "user", "content": "What is the weather like in San Francisco, CA?"}]
    async with run_engine() as engine, gateway_for(_config(engine.url, model)) as gw:
        direct = await _post(engine.url, "/v1/chat/completions", {"model": model})
        status, headers, answer = await _post(
            gw.url, "/v1/chat/completions", {"model": model, "messages": messages, "n": 2}
        )
        assert status == 200
        assert answer == direct[2]
        assert headers["x-engine"] == "scripted"  # the engine's own headers are kept
        assert headers["Content-Type"] == "application/json"
        forwarded = engine.bodies[-1]
        assert forwarded["stream"] is True
        assert forwarded["stream_options"] == {"include_usage": True}
        # the official client reads it as it reads OpenAI's answer
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as c:
            chat = await c.chat.completions.create(model=model, messages=messages)  # type: ignore[arg-type]
        assert chat.usage is not None
        assert chat.usage.total_tokens == direct[2]["usage"]["total_tokens"]
        await until(lambda: gw.backend_state()["in_use"] == 0)
        state = gw.tenant_state("anonymous")
        assert state["in_use"] == 0


async def test_error_event_mid_stream_becomes_an_error_answer(gateway_for) -> None:
    async with run_engine() as engine, gateway_for(_config(engine.url, "midfail")) as gw:
        body = {"model": "midfail", "messages": [{"role": "user", "content": "x"}]}
        status, _, answer = await _post(gw.url, "/v1/chat/completions", body)
        assert status == 500
        assert answer == {
            "error": {"message": "engine died", "type": "server_error", "param": None, "code": None}
        }
        await until(lambda: gw.backend_state()["in_use"] == 0)
    async with run_engine() as engine, gateway_for(_config(engine.url, "cut")) as gw:
        body = {"model": "cut", "messages": [{"role": "user", "content": "x"}]}
        status, _, answer = await _post(gw.url, "/v1/chat/completions", body)
        assert status == 502
        assert answer["error"]["code"] == "upstream_broken"
        await until(lambda: gw.backend_state()["in_use"] == 0)


async def _abandon(gw_url: str, body: dict[str, Any]) -> asyncio.StreamWriter:
    """Send ``body`` as a non-streamed chat request over a raw socket and close it unanswered."""
    raw = orjson.dumps(body)
    host, port = gw_url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    await writer.drain()
    return writer


async def test_abandoned_request_stops_at_a_llamacpp_like_engine(gateway_for) -> None:
    # 200 tokens × 20 ms = 4 s of generation; the client leaves after the engine started
    body = {"model": "generate", "messages": [{"role": "user", "content": "x"}], "max_tokens": 200}
    async with run_engine() as engine, gateway_for(_config(engine.url, "generate")) as gw:
        writer = await _abandon(gw.url, body)
        await until(lambda: engine.generating == 1 and gw.backend_state()["in_use"] == 1)
        writer.transport.abort()
        loop = asyncio.get_running_loop()
        left = loop.time()
        await until(lambda: engine.aborted == 1, timeout=2.0, interval=0.01)
        assert loop.time() - left < 1.0  # the next token write failed, not the end of 4 s
        assert engine.completed == 0
        await until(lambda: gw.backend_state()["in_use"] == 0)
        assert gw.backend_state()["inflight_tokens"] == 0


async def test_abandoned_request_is_aborted_by_the_simulator(sim, gateway_for) -> None:
    model = sim.engine.config.model
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 800,
        "ignore_eos": True,
    }
    async with gateway_for(config_for(sim.url, [model])) as gw:
        aborted = sim.engine.aborted
        writer = await _abandon(gw.url, body)
        await until(lambda: len(sim.engine.running) == 1)
        writer.transport.abort()
        loop = asyncio.get_running_loop()
        left = loop.time()
        await until(lambda: sim.engine.aborted == aborted + 1, timeout=2.0, interval=0.01)
        assert loop.time() - left < 0.5
        assert not sim.engine.running
        await until(lambda: gw.backend_state()["in_use"] == 0)
        assert gw.backend_state()["inflight_tokens"] == 0


async def test_assembled_answer_without_usage_is_charged_from_its_text(gateway_for) -> None:
    # the recorded n=2 tool-call stream without its usage chunk (an engine that sends none)
    async with run_upstream() as up, gateway_for(config_for(up.url, ["nousage"])) as gw:
        body = {"model": "nousage", "messages": [{"role": "user", "content": "x"}], "n": 2}
        status, _, answer = await _post(gw.url, "/v1/chat/completions", {**body, "max_tokens": 50})
        assert status == 200
        assert "usage" not in answer
        assert up.requests[-1]["stream"] is True
        calls = [c["message"]["tool_calls"][0]["function"] for c in answer["choices"]]
        assert calls == [c["message"]["tool_calls"][0]["function"] for c in TOOLS_JSON["choices"]]
        text = "".join(f["name"] + f["arguments"] for f in calls)
        _, analysis = analyze_now(
            gw.gateway, "/v1/chat/completions", orjson.dumps({**body, "max_tokens": 50})
        )
        m = gw.gateway.metrics
        m.flush()
        charged = m.tenant_tokens.labels("anonymous")._value.get()
        assert charged == analysis.prompt_tokens + math.ceil(len(text.encode()) / 4)
        assert gw.backend_state()["in_use"] == 0
        assert gw.backend_state()["inflight_tokens"] == 0
