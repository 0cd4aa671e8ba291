"""Engine answers relayed the way clients expect, end to end through a gateway on 127.0.0.1 in
front of scripted fake engines (raw asyncio socket servers, for byte-level control):

* error bodies of every engine in OpenAI's shape, context overflows as
  ``context_length_exceeded``, a proxy's HTML page not relayed; nothing charged for them;
* the engine's ``Retry-After`` / ``retry-after-ms`` reach the client (the ``openai`` client waits
  it out);
* streams carry ``Cache-Control: no-cache`` and ``X-Accel-Buffering: no``;
* ``data: [DONE]`` ends the client's stream and frees the slot at once, whatever the engine does
  with its connection afterwards;
* a pooled connection the engine closed after a stream (llama.cpp's server does) never becomes a
  502;
* one long stream without usage grows the gateway's memory by a bounded amount and is charged
  the tokenizer count of its text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvgate.config import Config
from kvgate.routing import analyze_now

from .conftest import config_for, sha
from .helpers import (
    chat,
    free_port,
    metric,
    start_kvgate,
    stop_process,
    until,
    wait_http_up,
)

RESPONSES = Path(__file__).parent.parent / "fixtures" / "responses"

#: ``script(writer, body)`` answers one request; returns whether to keep the connection open.
Script = Callable[[asyncio.StreamWriter, dict[str, Any]], Awaitable[bool]]


class RawEngine:
    """A fake engine on a raw asyncio socket: reads each request (head + ``Content-Length``
    body) and hands each ``POST`` to ``script``, which writes the answer bytes itself (anything
    else is answered 404)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests = 0
        self.connections = 0
        self.url = ""
        self.writers: list[asyncio.StreamWriter] = []
        self.reader_of: dict[asyncio.StreamWriter, asyncio.StreamReader] = {}

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        self.reader_of[writer] = reader
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                raw = await reader.readexactly(length)
                if not head.startswith(b"POST "):  # a gateway's poller: /metrics, /health
                    writer.write(answer(404, b"{}"))
                    continue
                body = orjson.loads(raw)
                self.requests += 1
                if not await self.script(writer, body):
                    break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def raw_engine(script: Script) -> AsyncIterator[RawEngine]:
    engine = RawEngine(script)
    server = await asyncio.start_server(engine.serve, "127.0.0.1", 0)
    engine.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield engine
    finally:
        for w in engine.writers:
            w.close()
        server.close()


def answer(status: int, body: bytes, content_type: str = "application/json", **extra: str) -> bytes:
    """A whole HTTP/1.1 answer with ``Content-Length``."""
    head = [f"HTTP/1.1 {status} X", f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
    head += [f"{k.replace('_', '-')}: {v}" for k, v in extra.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def busy(status: int, **headers: str) -> Script:
    """An engine that answers every request ``status`` with an OpenAI error body (``busy``)
    and ``headers`` (``_`` for ``-`` in their names)."""

    async def script(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        err = b'{"error":{"message":"busy","type":"overloaded","param":null,"code":null}}'
        writer.write(answer(status, err, **headers))
        return True

    return script


def chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def stream_head(*extra: str) -> bytes:
    lines = ["HTTP/1.1 200 OK", "Content-Type: text/event-stream", "Transfer-Encoding: chunked"]
    return ("\r\n".join([*lines, *extra]) + "\r\n\r\n").encode()


def delta(text: str) -> bytes:
    event = {"id": "c1", "choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + orjson.dumps(event) + b"\n\n"


def tenant_config(url: str, model: str) -> Config:
    """One backend, one tenant ``t`` (key ``sk-t``) whose TPM bucket (1000 tokens) refills one
    token a minute: whatever a request is charged stays visible in ``available_tokens``."""
    cfg = config_for(url, [model]).model_dump()
    cfg["tenants"] = [
        {
            "name": "t",
            "api_key_sha256": [sha("sk-t")],
            "tokens_per_minute": 1,
            "burst_tokens": 1000,
        }
    ]
    return Config.model_validate(cfg)


# ---- A1 + A3: error bodies ------------------------------------------------------------------

#: (fixture, status, window named in the message or None, code)
ERRORS = [
    ("vllm-error-400-context-length-flat-pre-0.10.1.json", 400, 2048, "context_length_exceeded"),
    ("vllm-error-400-context-length-nested-0.10.1plus.json", 400, 32768, "context_length_exceeded"),
    ("llamacpp-error-400-exceed-context-size.json", 400, 4096, "context_length_exceeded"),
    ("sglang-error-400-context-length-requested.json", 400, 8192, "context_length_exceeded"),
    ("sglang-error-400-input-longer-than-context.json", 400, 8192, "context_length_exceeded"),
    ("tgi-error-422-inputs-plus-max-new-tokens.json", 422, 4096, "context_length_exceeded"),
    ("openai-error-400-context-length-exceeded.json", 400, 4097, "context_length_exceeded"),
    ("proxy-502-bad-gateway.html", 502, None, None),
]


async def test_engine_errors_come_out_in_openai_shape_and_charge_nothing(gateway_for) -> None:
    current: dict[str, Any] = {}

    async def script(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        name, status = current["name"], current["status"]
        kind = "text/html" if name.endswith(".html") else "application/json"
        writer.write(answer(status, (RESPONSES / name).read_bytes(), kind))
        return True

    async with raw_engine(script) as engine, gateway_for(tenant_config(engine.url, "m")) as gw:
        full = gw.tenant_state("t")["available_tokens"]
        assert full == 1000
        async with aiohttp.ClientSession() as s:
            for name, status, window, code in ERRORS:
                current.update(name=name, status=status)
                for stream in (False, True):
                    body = chat("m", "hello there", max_tokens=20, stream=stream)
                    headers = {"Authorization": "Bearer sk-t"}
                    async with s.post(
                        gw.url + "/v1/chat/completions", json=body, headers=headers
                    ) as r:
                        assert r.status == status, name
                        assert r.content_type == "application/json"
                        data = await r.json()
                    err = data["error"]
                    assert set(err) == {"message", "type", "param", "code"}, name
                    assert err["code"] == code, name
                    if code == "context_length_exceeded":
                        assert err["type"] == "invalid_request_error", name
                        assert f"maximum context length is {window} tokens" in err["message"]
                    else:
                        assert "<" not in err["message"], err
                        assert err["message"] == (
                            "The upstream engine answered 502 Bad Gateway (non-JSON body)."
                        )
                        assert err["type"] == "server_error"
                    # an engine error before any token charges the tenant nothing
                    state = gw.tenant_state("t")
                    assert state["available_tokens"] == full, (name, state)
                    assert state["in_use"] == 0
                    backend = gw.backend_state()
                    assert backend["in_use"] == 0
                    assert backend["inflight_tokens"] == 0
        assert engine.requests == 2 * len(ERRORS)


async def test_an_error_event_after_tokens_charges_prompt_and_delivered(gateway_for) -> None:
    """The other side of the rule: an engine error mid-stream charges what was delivered."""

    async def script(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        err = b'data: {"error":{"message":"engine died","type":"server_error","code":500}}\n\n'
        writer.write(stream_head() + chunk(delta("one two three")) + chunk(err) + b"0\r\n\r\n")
        return True

    async with raw_engine(script) as engine, gateway_for(tenant_config(engine.url, "m")) as gw:
        body = orjson.dumps(chat("m", "hello there", max_tokens=20, stream=True))
        _, analysis = analyze_now(gw.gateway, "/v1/chat/completions", body)
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                gw.url + "/v1/chat/completions",
                data=body,
                headers={"Authorization": "Bearer sk-t", "Content-Type": "application/json"},
            ) as r,
        ):
            raw = await r.read()
        assert b"engine died" in raw
        charged = 1000 - gw.tenant_state("t")["available_tokens"]
        # the prompt plus "one two three" (13 bytes: 4 tokens by the byte estimate, no tokenizer)
        assert charged == analysis.prompt_tokens + 4


async def test_a_non_streamed_responses_answer_cut_mid_way_is_charged_its_text(
    gateway_for,
) -> None:
    """A Responses request the client did not stream goes to the engine as a stream and is
    assembled; when that stream ends before its terminal event (here the engine breaks off;
    a client that leaves takes the same settlement), the tenant is charged the prompt plus the
    text generated so far, as for chat — it was charged the prompt only, so a client leaving
    just before each answer's end paid no completion tokens."""
    words = " ".join(["alpha"] * 40)  # 239 bytes: 60 tokens by the byte estimate (no tokenizer)

    async def script(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        created = {"type": "response.created", "response": {"id": "r", "status": "in_progress"}}
        delta = {"type": "response.output_text.delta", "delta": words}
        events = b"".join(
            b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n"
            for e in (created, delta)
        )
        writer.write(stream_head() + chunk(events) + b"0\r\n\r\n")  # no terminal event
        return False

    async with raw_engine(script) as engine, gateway_for(tenant_config(engine.url, "m")) as gw:
        body = {"model": "m", "input": "hello there", "max_output_tokens": 200}
        raw = orjson.dumps(body)
        _, analysis = analyze_now(gw.gateway, "/v1/responses", raw)
        headers = {"Authorization": "Bearer sk-t", "Content-Type": "application/json"}
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw.url + "/v1/responses", data=raw, headers=headers) as r,
        ):
            assert r.status == 502
            assert (await r.json())["error"]["code"] == "upstream_broken"
        await until(lambda: gw.tenant_state("t")["in_use"] == 0, timeout=10)
        charged = 1000 - gw.tenant_state("t")["available_tokens"]
        assert charged == analysis.prompt_tokens + 60


# ---- A2: the engine's Retry-After -------------------------------------------------------------


async def test_the_engines_retry_after_reaches_the_openai_client(gateway_for) -> None:
    async with (
        raw_engine(busy(429, retry_after_ms="1500", Retry_After="2")) as engine,
        gateway_for(config_for(engine.url, ["m"])) as gw,
    ):
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions", json=chat("m")) as r:
                assert r.status == 429
                # kvgate's own hint (1 s on a backend with no history) is shorter: the engine's
                assert r.headers["retry-after-ms"] == "1500"
                assert r.headers["Retry-After"] == "2"
                assert "x-ratelimit-limit-requests" in r.headers
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused")  # max_retries=2
        started = time.monotonic()
        async with client:
            with pytest.raises(openai.RateLimitError):
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5
                )
        elapsed = time.monotonic() - started
        # two waits of the engine's 1.5 s (the client's own backoff would be under 1.5 s in all)
        assert elapsed >= 2.9, elapsed
        assert engine.requests == 1 + 3
        assert gw.backend_state()["in_use"] == 0


async def test_kvgates_longer_hint_wins_over_the_engines(gateway_for) -> None:
    async with (
        raw_engine(busy(503, retry_after_ms="20")) as engine,
        gateway_for(config_for(engine.url, ["m"])) as gw,
    ):
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw.url + "/v1/chat/completions", json=chat("m")) as r,
        ):
            assert r.status == 503
            # no request finished on this backend yet: kvgate assumes a 1 s hold (the queue's
            # rule), longer than the engine's 20 ms
            assert r.headers["retry-after-ms"] == "1000"
            assert r.headers["Retry-After"] == "1"


@pytest.mark.parametrize(
    "header",
    [
        {"Retry_After": "99999999999999999999"},
        {"retry_after_ms": "1e300"},
        {"Retry_After": "Wed, 21 Oct 2099 07:28:00 GMT"},
    ],
)
async def test_an_absurd_engine_wait_is_relayed_as_an_hour(
    gateway_for, header: dict[str, str]
) -> None:
    """An engine's wait of centuries (a huge number, a date decades ahead) reaches the client
    as at most an hour, in whole seconds and whole milliseconds (no float digits)."""

    async with (
        raw_engine(busy(503, **header)) as engine,
        gateway_for(config_for(engine.url, ["m"])) as gw,
    ):
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw.url + "/v1/chat/completions", json=chat("m")) as r,
        ):
            assert r.status == 503
            assert r.headers["Retry-After"] == "3600"
            assert r.headers["retry-after-ms"] == "3600000"


# ---- A4 + A5: stream heads, [DONE] ------------------------------------------------------------


async def test_done_ends_the_stream_and_frees_the_slot_while_the_engine_holds_on(
    gateway_for,
) -> None:
    """The engine sends its events, ``[DONE]`` and a stray event, then keeps the connection
    open for 30 s without ending the chunked body."""
    events = delta("Hello") + delta(" world") + b"data: [DONE]\n\n" + delta(" late")

    async def script(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        writer.write(stream_head("Cache-Control: no-store") + chunk(events))
        await writer.drain()
        await asyncio.sleep(30)
        return False

    async with raw_engine(script) as engine, gateway_for(config_for(engine.url, ["m"])) as gw:
        started = time.monotonic()
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw.url + "/v1/chat/completions", json=chat("m", stream=True)) as r,
        ):
            # the engine's Cache-Control is kept, not doubled; the proxy switch is added
            assert r.headers.getall("Cache-Control") == ["no-store"]
            assert r.headers["X-Accel-Buffering"] == "no"
            raw = await asyncio.wait_for(r.read(), 10)
        assert time.monotonic() - started < 5
        assert raw.endswith(b"data: [DONE]\n\n")
        assert b"late" not in raw
        await until(lambda: gw.backend_state()["in_use"] == 0, timeout=2)
        assert gw.backend_state()["inflight_tokens"] == 0

        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        started = time.monotonic()
        async with client:
            parts = []
            async for piece in await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True
            ):
                parts.extend(c.delta.content or "" for c in piece.choices)
        assert "".join(parts) == "Hello world"
        assert time.monotonic() - started < 5
        await until(lambda: gw.backend_state()["in_use"] == 0, timeout=2)
        assert engine.requests == 2


async def test_streams_carry_no_buffering_headers(gateway_for) -> None:
    async def script(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        writer.write(stream_head() + chunk(delta("a") + b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return True

    async with raw_engine(script) as engine, gateway_for(config_for(engine.url, ["m"])) as gw:
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw.url + "/v1/chat/completions", json=chat("m", stream=True)) as r,
        ):
            assert r.headers.getall("Cache-Control") == ["no-cache"]
            assert r.headers.getall("X-Accel-Buffering") == ["no"]
            await r.read()


# ---- A6: a pooled connection the engine closed ------------------------------------------------


async def test_connections_closed_after_a_stream_never_become_502s(gateway_for) -> None:
    """llama.cpp's pattern: a streamed answer announces ``Keep-Alive`` but the engine closes the
    connection right after the final chunk; here it closes it as the next request arrives on it
    (the worst case of that race: the request is never read). Non-streamed answers keep their
    connection open."""

    async def script(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        if not body.get("stream"):
            completion = {
                "id": "c",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
            writer.write(answer(200, orjson.dumps(completion), Keep_Alive="timeout=5, max=100"))
            return True
        writer.write(
            stream_head("Keep-Alive: timeout=5, max=100")
            + chunk(delta("ok") + b"data: [DONE]\n\n")
            + b"0\r\n\r\n"
        )
        await writer.drain()
        # close once the next request shows up on this connection (or soon anyway), unread
        reader = engine.reader_of[writer]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reader.read(1), 0.2)
        return False

    async with raw_engine(script) as engine, gateway_for(config_for(engine.url, ["m"])) as gw:
        errors: list[str] = []
        async with aiohttp.ClientSession() as s:

            async def one(i: int) -> None:
                stream = i % 3 != 0
                body = chat("m", stream=stream)
                async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                    raw = await r.read()
                    if r.status != 200 or (stream and not raw.endswith(b"[DONE]\n\n")):
                        errors.append(f"{i}: {r.status} {raw[:200]!r}")

            for i in range(0, 200, 2):  # back to back, two at a time
                await asyncio.gather(one(i), one(i + 1))
        assert errors == []
        assert engine.requests == 200
        assert engine.connections > 50  # the pattern really closed connections
        await until(lambda: gw.backend_state()["in_use"] == 0, timeout=2)


# ---- B: bounded memory per stream ---------------------------------------------------------------

#: Distinct words the long stream cycles through (each delta one word and a space).
WORDS = [f"w{i} " for i in range(1000)]


def byte_level_tokenizer(path: Path) -> Tokenizer:
    """A small byte-level BPE (GPT-2 style pre-tokenization) trained on :data:`WORDS` here,
    saved to ``path``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["".join(WORDS)] * 4, trainer=trainer)
    tok.save(str(path))
    return tok


def peak_rss_kib(pid: int) -> int:
    """``VmHWM`` (peak resident set, KiB) of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


async def test_one_long_stream_without_usage_keeps_gateway_memory_bounded(
    tmp_path: Path,
) -> None:
    """About 20 MB of delta events without usage through a gateway process: its peak RSS grows
    by less than 4 MiB (before, every event was kept until the end: 12 MiB here), and the
    tenant is charged the tokenizer count of the delivered text plus the prompt."""
    tok = byte_level_tokenizer(tmp_path / "tokenizer.json")
    block = b"".join(delta(w) for w in WORDS)  # one pass over the words, ~60 KB
    passes = {"n": 1}

    async def script(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        writer.write(stream_head())
        for _ in range(passes["n"]):
            writer.write(chunk(block))
            await writer.drain()
        # the engine's prompt count only (no completion count): the text is counted
        usage = b'data: {"choices":[],"usage":{"prompt_tokens":7}}\n\n'
        writer.write(chunk(usage + b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return True

    async with raw_engine(script) as engine:
        port = free_port()
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "backends": [
                {
                    "name": "b0",
                    "url": engine.url,
                    "models": [
                        {
                            "name": "m",
                            "context_window": 1024,
                            "tokenizer": str(tmp_path / "tokenizer.json"),
                        }
                    ],
                    "max_concurrency": 4,
                }
            ],
        }
        path = tmp_path / "kvgate.yaml"
        path.write_text(json.dumps(config))
        proc = await start_kvgate("serve", "--config", str(path))
        url = f"http://127.0.0.1:{port}"
        try:
            await wait_http_up(url + "/healthz")

            async def stream_once(s: aiohttp.ClientSession) -> int:
                async with s.post(url + "/v1/chat/completions", json=chat("m", stream=True)) as r:
                    assert r.status == 200
                    size = 0
                    async for part in r.content.iter_any():
                        size += len(part)
                    return size

            async def charged(s: aiohttp.ClientSession) -> float:
                async with s.get(url + "/metrics") as r:
                    text = await r.text()
                return metric(text, "kvgate_tenant_tokens_total") or 0.0

            async with aiohttp.ClientSession() as s:
                passes["n"] = 30  # warm up (~2 MB): buffers, allocator arenas, tokenizer
                for _ in range(3):
                    await stream_once(s)
                await until(lambda: charged(s), timeout=10)
                before_tokens = await charged(s)
                before = peak_rss_kib(proc.pid)
                passes["n"] = 330  # ~20 MB of events, ~1.6 MB of text
                size = await stream_once(s)
                assert size > 19_000_000
                growth = peak_rss_kib(proc.pid) - before
                assert growth < 4 * 1024, f"peak RSS grew by {growth} KiB"
                text = "".join(WORDS) * 330
                want = 7 + len(tok.encode(text, add_special_tokens=False).ids)

                async def settled() -> bool:
                    return await charged(s) - before_tokens == want

                await until(settled, timeout=10)
        finally:
            await stop_process(proc)


async def test_an_engine_that_never_ends_an_event_or_an_error_body_cannot_grow_memory(
    tmp_path: Path,
) -> None:
    """200 MiB without an event's end (``data: xxxx…``, no newline) to a streaming client and
    to one that did not stream (the answer is assembled), and a 200 MiB error page: the
    streaming client gets an ``upstream_broken`` error event once 32 MiB are held, the other a
    502 ``upstream_broken``, the error page's client the engine's status with the non-JSON
    message; the gateway's peak RSS grows by far less than what the engine sent (before: 1.3
    GB, 0.3 GB and 0.5 GB for 400 / 200 MB), and every slot goes back."""
    piece = b"x" * (1024 * 1024)

    async def script(writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        if body["messages"][0]["content"] == "error page":
            head = "HTTP/1.1 500 X\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n"
            writer.write((head % (200 * len(piece))).encode())
            try:
                for _ in range(200):
                    writer.write(piece)
                    await writer.drain()
            except ConnectionError:
                pass
            return False
        writer.write(stream_head() + chunk(delta("before")) + chunk(b"data: "))
        try:
            for _ in range(200):
                writer.write(chunk(piece))
                await writer.drain()
        except ConnectionError:
            pass
        return False

    async with raw_engine(script) as engine:
        port = free_port()
        config = {
            "listen": {"host": "127.0.0.1", "port": port},
            "backends": [
                {
                    "name": "b0",
                    "url": engine.url,
                    "models": [{"name": "m", "context_window": 1024}],
                    "max_concurrency": 4,
                }
            ],
        }
        path = tmp_path / "kvgate.yaml"
        path.write_text(json.dumps(config))
        proc = await start_kvgate("serve", "--config", str(path))
        url = f"http://127.0.0.1:{port}"
        try:
            await wait_http_up(url + "/healthz")
            before = peak_rss_kib(proc.pid)
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/chat/completions", json=chat("m", stream=True)) as r:
                    assert r.status == 200
                    raw = await r.read()
                assert b'"before"' in raw
                assert b"upstream_broken" in raw
                assert b"over 32 MiB" in raw
                async with s.post(url + "/v1/chat/completions", json=chat("m")) as r:
                    assert r.status == 502
                    error = (await r.json())["error"]
                    assert error["code"] == "upstream_broken"
                    assert "32 MiB" in error["message"]
                async with s.post(url + "/v1/chat/completions", json=chat("m", "error page")) as r:
                    assert r.status == 500
                    assert "non-JSON body" in (await r.json())["error"]["message"]
                async with s.get(url + "/admin/state") as r:
                    state = await r.json()
            growth = peak_rss_kib(proc.pid) - before
            assert growth < 160 * 1024, f"peak RSS grew by {growth} KiB for 600 MiB sent"
            assert all(b["in_use"] == 0 for b in state["backends"]), state["backends"]
        finally:
            await stop_process(proc)
