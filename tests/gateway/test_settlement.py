"""Settlement end to end: what a finished request is charged when the engine's answer does not
carry usage (the completion is counted from the answer's text, never free: an overrun is charged, never
silently free; docs/admission.md, step 5), and a client that
stops reading a stream, which must not hold its slot past the ``total`` timeout."""

from __future__ import annotations

import asyncio
import math
import socket

import openai
import orjson

from kvgate.routing import analyze_now

from .conftest import config_for
from .fake_upstream import run_upstream
from .helpers import chat, raw_chat_request, until


async def test_non_streamed_answer_without_usage_is_charged_from_its_text(gateway_for) -> None:
    # the engine's own non-streamed answer (not assembled from a stream: see test_assemble.py)
    async with (
        run_upstream() as up,
        gateway_for(config_for(up.url, ["nousage"], stream_upstream=False)) as gw,
    ):
        messages = [{"role": "user", "content": "tell me something"}]
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            answer = await client.chat.completions.create(
                model="nousage", messages=messages, max_tokens=50, n=2
            )
        assert answer.usage is None
        assert up.requests[-1]["n"] == 2
        body = orjson.dumps({"model": "nousage", "messages": messages, "max_tokens": 50, "n": 2})
        _, analysis = analyze_now(gw.gateway, "/v1/chat/completions", body)
        # both choices' text: 12 words and a tool call, 69 bytes = 18 tokens by the byte estimate
        # the gateway uses without a tokenizer
        text = "word " * 12 + "f" + '{"a": 1}'
        assert answer.choices[0].message.content + "f" + '{"a": 1}' == text
        completion = math.ceil(len(text.encode()) / 4)
        m = gw.gateway.metrics
        m.flush()
        charged = m.tenant_tokens.labels("anonymous")._value.get()
        assert charged == analysis.prompt_tokens + completion
        reserved = m.tokens_reserved.labels("b0")._value.get()
        assert reserved == analysis.prompt_tokens + 2 * 50
        assert m.tokens_refunded.labels("b0")._value.get() == reserved - charged
        state = gw.backend_state()
        assert state["in_use"] == 0
        assert state["inflight_tokens"] == 0


async def test_a_client_that_stops_reading_a_stream_is_cut_off_at_the_total_timeout(
    gateway_for,
) -> None:
    """The slot, the reservation and the engine's request must not be held past ``total`` by a
    client that keeps its connection open but reads nothing (its buffers full)."""
    async with run_upstream() as up:
        cfg = config_for(up.url, ["flood"], timeouts={"total": 1.5, "idle": 1.5, "first_byte": 1.5})
        async with gateway_for(cfg) as gw:
            host, port = gw.url[7:].split(":")
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
            reader, writer = await asyncio.open_connection(sock=sock)
            try:
                body = orjson.dumps(chat("flood", max_tokens=100, stream=True))
                writer.write(raw_chat_request(body))
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                assert head.startswith(b"HTTP/1.1 200")
                # the client reads nothing more: the gateway's writes block, then `total` fires
                assert gw.backend_state()["in_use"] == 1
                await until(lambda: gw.backend_state()["in_use"] == 0, timeout=8)
                await until(lambda: up.active == 0, timeout=2)  # the engine's request was closed
                state = gw.backend_state()
                assert state["inflight_tokens"] == 0
                m = gw.gateway.metrics
                m.flush()
                assert m.requests.labels("b0", "anonymous", "client_timeout")._value.get() == 1
                # charged the prompt and the text relayed before the cut (more than the 100
                # reserved: an overrun is charged, never free)
                assert m.tenant_tokens.labels("anonymous")._value.get() > 100
            finally:
                writer.transport.abort()
