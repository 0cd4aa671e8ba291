"""A scripted OpenAI-compatible upstream for the gateway's failure tests.

The request's ``model`` picks a behaviour:

* ``replay`` — streams the recorded OpenAI SSE fixture (the usage chunk only when the request
  asked for ``stream_options.include_usage``), cut into small TCP writes; non-streaming answers a
  fixed completion with usage.
* ``nousage`` — like ``replay`` but never sends usage (engines that send none); non-streaming
  answers :data:`NOUSAGE_COMPLETION` (two choices, text and a tool call, no ``usage``).
* ``slow`` — streams one chunk every 50 ms for up to 200 chunks (for disconnect tests).
* ``hang`` — never answers.
* ``die`` — sends the headers and two events, then drops the connection.
* ``error500`` — answers 500 with a vLLM-style flat error body.
* ``stall`` — non-streaming: sends the headers and the start of the body, then nothing.
* ``absurd`` — non-streaming: usage counts of 2**62 + 1 (past what the core accepts).
* ``late`` — the response head after 0.3 s, then a chunk every 50 ms for 10 s.
* ``flood`` — streams 4 KiB content chunks as fast as it may write them, for up to 64 MiB
  (fills a client that stops reading).

``Upstream.active`` counts handlers in progress; ``Upstream.cancelled`` counts handlers that ended
because the gateway closed the connection (the engine-side abort).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from aiohttp import web

FIXTURES = Path(__file__).parent.parent / "fixtures" / "responses"
STREAM = (FIXTURES / "openai-chat-stream-n2-tools-include-usage.sse").read_bytes()
EVENTS = [e + b"\n\n" for e in STREAM.split(b"\n\n") if e.strip()]
USAGE_EVENT = next(e for e in EVENTS if b'"choices":[]' in e)
COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "replay",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
}

#: ``nousage``'s non-streamed answer: 12 words in choice 0, a tool call in choice 1, no usage
#: (its text, ``"word " * 12 + "f" + '{"a": 1}'``, is 69 bytes: 18 tokens by the byte estimate)
NOUSAGE_COMPLETION = {
    **{k: v for k, v in COMPLETION.items() if k != "usage"},
    "model": "nousage",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "word " * 12},
            "finish_reason": "length",
        },
        {
            "index": 1,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"a": 1}'},
                    }
                ],
            },
            "finish_reason": "tool_calls",
        },
    ],
}


@dataclass
class Upstream:
    """State of a running fake upstream."""

    url: str = ""
    active: int = 0
    cancelled: int = 0
    requests: list[dict] = field(default_factory=list)
    raw_bodies: list[bytes] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)


def _app(state: Upstream) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        state.raw_bodies.append(raw)
        body = orjson.loads(raw)
        state.requests.append(body)
        state.active += 1
        state.started.set()
        try:
            return await _behave(request, body)
        except asyncio.CancelledError:
            state.cancelled += 1
            raise
        finally:
            state.active -= 1

    async def models(request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model"} for m in ("replay", "nousage", "slow")]
        return web.json_response({"object": "list", "data": data})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_post("/v1/completions", handle)
    app.router.add_get("/v1/models", models)
    return app


async def _behave(request: web.Request, body: dict) -> web.StreamResponse:
    model = body.get("model")
    stream = bool(body.get("stream"))
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    if model == "hang":
        await asyncio.sleep(3600)
    if model == "error500":
        return web.Response(
            status=500,
            body=b'{"object": "error", "message": "engine exploded", "type": "InternalServerError",'
            b' "param": null, "code": 500}',
            content_type="application/json",
        )
    if model == "absurd":  # usage counts past anything the core accepts (2**62)
        big = 2**62 + 1
        absurd = {**COMPLETION, "usage": {"prompt_tokens": big, "completion_tokens": big}}
        return web.Response(body=orjson.dumps(absurd), content_type="application/json")
    if model == "late":  # the head after 0.6 s, then a chunk every 50 ms for 10 s
        await asyncio.sleep(0.6)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(200):
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await asyncio.sleep(0.05)
        return resp
    if model == "flood":
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "delta": {"content": "x" * 4096}}]}
        event = b"data: " + orjson.dumps(chunk) + b"\n\n"
        for _ in range(16_384):
            await resp.write(event)
        await resp.write(b"data: [DONE]\n\n")
        return resp
    if model == "stall":
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"id": "chatcmpl-1", ')
        await asyncio.sleep(3600)
    if not stream:
        answer = NOUSAGE_COMPLETION if model == "nousage" else COMPLETION
        return web.Response(body=orjson.dumps(answer), content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if model == "die":
        await resp.write(EVENTS[0] + EVENTS[1])
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return resp
    if model == "slow":
        for i in range(200):
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}], "usage": None}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await asyncio.sleep(0.05)
        await resp.write(b"data: [DONE]\n\n")
        return resp
    events = [e for e in EVENTS if e is not USAGE_EVENT or (usage and model == "replay")]
    raw = b"".join(events)
    for i in range(0, len(raw), 97):  # split events across writes on purpose
        await resp.write(raw[i : i + 97])
    await resp.write_eof()
    return resp


@contextlib.asynccontextmanager
async def serve_app(
    app: web.Application, *, handler_cancellation: bool = True
) -> AsyncIterator[str]:
    """Serve a scripted engine's aiohttp ``app`` on 127.0.0.1 (ephemeral port) for a block;
    yields its base URL. ``handler_cancellation=False`` keeps a handler running after its client
    left, as llama.cpp's server does for a non-streamed request."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def run_upstream() -> AsyncIterator[Upstream]:
    """Serve the fake upstream on 127.0.0.1 (ephemeral port) for a block."""
    state = Upstream()
    async with serve_app(_app(state)) as state.url:
        yield state
