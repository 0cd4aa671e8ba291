"""A scripted engine for the route tests: OpenAI's Responses API, a chat route that reports a
chosen usage, and any other path (for ``other_routes: forward``).

``POST /v1/responses`` — the request's ``model`` picks a behaviour:

* ``pause`` — streams ``response.created`` and two text deltas, then waits until
  :attr:`RoutesEngine.release` is set, then one more delta and ``response.completed`` with
  :data:`RESPONSES_USAGE`; non-streamed, answers at once with that usage.
* ``slow`` — a text delta (``"word "``) every 50 ms for 10 s, never a usage (disconnect tests).
* ``nousage`` — non-streamed, an answer whose ``output`` holds :data:`NOUSAGE_TEXT` and no usage.

``POST /v1/chat/completions`` — answers with ``usage`` of :attr:`RoutesEngine.chat_usage`.

Any other path — ``/v1/paused``: a JSON body written in two parts, the second once
:attr:`RoutesEngine.release` is set, with :data:`FORWARD_USAGE`; ``/v1/events``: an SSE stream of
two chunks and a usage chunk; else a JSON answer with :data:`FORWARD_USAGE`.

:attr:`RoutesEngine.seen` records ``(method, path_qs, body)`` of every request,
:attr:`RoutesEngine.cancelled` the handlers that ended because the gateway closed the connection,
:attr:`RoutesEngine.finished` the Responses streams that ran to their end.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from tests.gateway.fake_upstream import serve_app

RESPONSES_USAGE = {"input_tokens": 40, "output_tokens": 3, "total_tokens": 43}
FORWARD_USAGE = {"prompt_tokens": 30, "total_tokens": 30}
#: 40 bytes: 10 tokens by the byte estimate (no tokenizer configured)
NOUSAGE_TEXT = "0123456789" * 4


@dataclass
class RoutesEngine:
    url: str = ""
    seen: list[tuple[str, str, bytes]] = field(default_factory=list)
    cancelled: int = 0
    finished: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)
    chat_usage: dict[str, int] = field(
        default_factory=lambda: {"prompt_tokens": 5, "completion_tokens": 1}
    )


def _event(name: str, **data: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"


def _delta(text: str) -> bytes:
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    return _event("response.output_text.delta", **where, delta=text)


def _response(status: str, text: str, usage: dict[str, int] | None) -> dict[str, Any]:
    output = [
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
    ]
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "status": status,
        "model": "m",
        "error": None,
        "output": output if text else [],
        "usage": usage,
    }


def _app(state: RoutesEngine) -> web.Application:
    async def responses(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        state.seen.append((request.method, request.path_qs, raw))
        body = orjson.loads(raw)
        model = body.get("model")
        try:
            if not body.get("stream"):
                if model == "nousage":
                    answer = _response("completed", NOUSAGE_TEXT, None)
                else:
                    answer = _response("completed", "abc", RESPONSES_USAGE)
                return web.Response(body=orjson.dumps(answer), content_type="application/json")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(
                _event("response.created", response=_response("in_progress", "", None))
            )
            if model == "slow":
                for _ in range(200):
                    await resp.write(_delta("word "))
                    await asyncio.sleep(0.05)
                return resp
            await resp.write(_delta("a") + _delta("b"))
            await state.release.wait()
            await resp.write(_delta("c"))
            done = _response("completed", "abc", RESPONSES_USAGE)
            await resp.write(_event("response.completed", response=done))
            await resp.write_eof()
            state.finished += 1
            return resp
        except asyncio.CancelledError:
            state.cancelled += 1
            raise

    async def chat(request: web.Request) -> web.Response:
        raw = await request.read()
        state.seen.append((request.method, request.path_qs, raw))
        answer = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
            "usage": state.chat_usage,
        }
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def other(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        state.seen.append((request.method, request.path_qs, raw))
        if request.path == "/v1/paused":
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(b'{"part": 1, ')
            await state.release.wait()
            await resp.write(b'"usage": ' + orjson.dumps(FORWARD_USAGE) + b"}")
            await resp.write_eof()
            return resp
        if request.path == "/v1/events":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for text in ("x", "y"):
                chunk = {"choices": [{"index": 0, "delta": {"content": text}}]}
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}
            await resp.write(b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if request.path == "/v1/nocontent":
            return web.Response(status=204)
        if request.path == "/v1/unchanged":
            return web.Response(status=304, headers={"ETag": '"v1"'})
        answer = {"path": request.path, "usage": FORWARD_USAGE}
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_route("*", "/{tail:.*}", other)
    return app


@contextlib.asynccontextmanager
async def run_routes_engine() -> AsyncIterator[RoutesEngine]:
    """Serve a :class:`RoutesEngine` on 127.0.0.1 (ephemeral port) for a block."""
    state = RoutesEngine()
    async with serve_app(_app(state)) as state.url:
        try:
            yield state
        finally:
            state.release.set()
