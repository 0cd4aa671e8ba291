"""A fast OpenAI-compatible upstream for the load benchmark (not an engine: fixed answers).

``POST /v1/chat/completions`` answers a fixed chat completion with ``usage``; with
``"stream": true`` in the body it answers a few SSE chunks, a usage chunk and ``[DONE]``. A body
containing ``__hold__`` is held open (used to keep one gateway slot busy for the refusal path).
``GET /v1/models``, ``/health`` and ``/metrics`` answer what the gateway asks at start-up;
``/metrics`` carries no sample (a scrape of it is a failure the gateway counts), unless started
with ``--vllm-metrics``: then vLLM's KV-cache, running and waiting gauges for the model, as an
engine's scrape (``benches/tenants/many_backends.py --workers``). ``GET /scrapes``: the
``/metrics`` answered so far.

Usage: ``python fast_upstream.py PORT [--vllm-metrics]``
"""

from __future__ import annotations

import asyncio
import sys

import orjson
import uvloop
from aiohttp import web

MODEL = "fast"
_USAGE = {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}
COMPLETION = orjson.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Fine, thanks. And you, friend?"},
                "finish_reason": "stop",
            }
        ],
        "usage": _USAGE,
    }
)


def _chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
    choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]
    obj = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": MODEL,
        "choices": choices,
        "usage": usage,
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


STREAM_CHUNKS = (
    _chunk({"role": "assistant", "content": "Fine,"}),
    _chunk({"content": " thanks."}),
    _chunk({"content": " And you?"}),
    _chunk({}, finish="stop"),
    _chunk({}, usage=_USAGE),
    b"data: [DONE]\n\n",
)
MODELS = orjson.dumps({"object": "list", "data": [{"id": MODEL, "max_model_len": 8192}]})
METRICS = b"# HELP vllm:num_requests_running running\n# TYPE vllm:num_requests_running gauge\n"


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    if b"__hold__" in body:
        await asyncio.sleep(3600)
    if orjson.loads(body).get("stream"):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in STREAM_CHUNKS:
            await response.write(chunk)
        await response.write_eof()
        return response
    return web.Response(body=COMPLETION, content_type="application/json")


async def models(_request: web.Request) -> web.Response:
    return web.Response(body=MODELS, content_type="application/json")


async def health(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


SCRAPES = [0]  # GET /metrics answered (benches/tenants/many_backends.py --workers)


#: ``--vllm-metrics``: an engine's gauges for the model
VLLM_METRICS = (
    f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.25\n'
    f'vllm:num_requests_running{{model_name="{MODEL}"}} 3\n'
    f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n'
).encode()


async def metrics(_request: web.Request) -> web.Response:
    SCRAPES[0] += 1
    body = VLLM_METRICS if "--vllm-metrics" in sys.argv[2:] else METRICS
    return web.Response(body=body, content_type="text/plain")


async def scrapes(_request: web.Request) -> web.Response:
    return web.Response(text=str(SCRAPES[0]))


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/scrapes", scrapes)
    uvloop.install()
    # in-flight requests (the `__hold__` ones sleep an hour) are cut after 1 s at SIGTERM
    web.run_app(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        access_log=None,
        print=None,
        shutdown_timeout=1,
    )


if __name__ == "__main__":
    main()
