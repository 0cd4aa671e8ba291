"""The gateway end to end over loopback: real servers, the official openai client, raw sockets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable

import aiohttp
import openai
import orjson
import pytest

from kvgate.sim import SimConfig, run_sim

from .conftest import KEYS, config_for, sha
from .fake_upstream import EVENTS, STREAM, USAGE_EVENT, run_upstream
from .helpers import raw_chat_request


async def _until(pred, timeout: float = 2.0) -> None:
    """Wait (bounded) until ``pred()`` is true; fails the test on timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


@pytest.fixture
async def sim():
    async with run_sim(SimConfig.from_profile("tiny", speed=50, seed=3)) as running:
        yield running


async def test_openai_client_chat_and_completions_through_gateway(sim, gateway_for) -> None:
    cfg = config_for(sim.url, [sim.engine.config.model])
    async with gateway_for(cfg) as gw:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        model = sim.engine.config.model
        chat = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello there"}], max_tokens=8
        )
        assert chat.choices[0].message.content
        assert chat.usage is not None
        assert 1 <= chat.usage.completion_tokens <= 8
        comp = await client.completions.create(model=model, prompt="once upon", max_tokens=5)
        assert comp.usage is not None
        assert comp.usage.completion_tokens <= 5

        # streaming, with and without asking for usage
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "stream please"}],
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
        ]
        usage_chunk = chunks[-1].usage
        assert usage_chunk is not None
        assert chunks[-1].choices == []
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "stream please"}],
                max_tokens=6,
                stream=True,
            )
        ]
        assert all(c.usage is None for c in chunks)
        assert all(c.choices for c in chunks)
        await client.close()
        state = gw.backend_state()
        assert state["in_use"] == 0
        assert state["inflight_tokens"] == 0
        # every reservation was reconciled with the engine's usage: what the tenant was
        # charged is what the client saw in usage (the fourth stream's usage was stripped)
        m = gw.gateway.metrics
        m.flush()  # the per-request counts are batched until a flush (or a scrape)
        charged = m.tenant_tokens.labels("anonymous")._value.get()
        seen = chat.usage.total_tokens + comp.usage.total_tokens + usage_chunk.total_tokens
        assert seen < charged < seen + 64
        reserved = m.tokens_reserved.labels("b0")._value.get()
        refunded = m.tokens_refunded.labels("b0")._value.get()
        overrun = m.tokens_overrun.labels("b0")._value.get()
        assert reserved - refunded + overrun == charged


async def test_stream_is_byte_for_byte_except_the_usage_it_asked_for(gateway_for) -> None:
    async with run_upstream() as up, gateway_for(config_for(up.url, ["replay"])) as gw:
        async with aiohttp.ClientSession() as s:
            for include_usage in (True, False):
                body = {
                    "model": "replay",
                    "messages": [{"role": "user", "content": "x"}],
                    "stream": True,
                    "max_tokens": 50,
                }
                if include_usage:
                    body["stream_options"] = {"include_usage": True}
                async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    assert r.headers["Content-Type"].startswith("text/event-stream")
                    assert "x-ratelimit-remaining-tokens" in r.headers
                    raw = await r.read()
                # without include_usage an OpenAI-style engine sends neither the usage chunk
                # nor the `"usage":null` member of the other chunks: both are taken out
                expected = (
                    STREAM
                    if include_usage
                    else STREAM.replace(USAGE_EVENT, b"").replace(b',"usage":null}', b"}")
                )
                assert raw == expected
                assert (b'"usage"' in raw) == include_usage
                # the gateway asked the engine for usage in both cases
                assert up.requests[-1]["stream_options"] == {"include_usage": True}
        assert gw.backend_state()["in_use"] == 0
        # settled from the engine's usage (85 + 43 tokens) both times: an overrun of the
        # 50-token reservation, charged, never free
        m = gw.gateway.metrics
        m.flush()  # the per-request counts are batched until a flush (or a scrape)
        assert m.tenant_tokens.labels("anonymous")._value.get() == 2 * 128
        assert m.tokens_overrun.labels("b0")._value.get() > 0


async def test_client_disconnect_mid_stream_releases_at_once(gateway_for) -> None:
    async with run_upstream() as up, gateway_for(config_for(up.url, ["slow"])) as gw:
        gw.backend_state()["available_tokens"]
        reader, writer = await asyncio.open_connection(*gw.url[7:].split(":"))
        body = orjson.dumps(
            {
                "model": "slow",
                "stream": True,
                "max_tokens": 500,
                "messages": [{"role": "user", "content": "hi"}],
            }
        )
        writer.write(raw_chat_request(body))
        await writer.drain()
        seen = b""
        while seen.count(b"data: ") < 3:
            seen += await asyncio.wait_for(reader.read(4096), 5)
        assert gw.backend_state()["in_use"] == 1
        writer.close()
        await _until(lambda: gw.backend_state()["in_use"] == 0, timeout=1.0)
        await _until(lambda: up.cancelled == 1, timeout=1.0)
        state = gw.backend_state()
        assert state["inflight_tokens"] == 0
        # charged prompt + the few tokens delivered, the rest of the 500 refunded at once
        m = gw.gateway.metrics
        m.flush()  # the per-request counts are batched until a flush (or a scrape)
        charged = m.tenant_tokens.labels("anonymous")._value.get()
        assert 3 < charged < 100
        assert (
            m.tokens_refunded.labels("b0")._value.get()
            == m.tokens_reserved.labels("b0")._value.get() - charged
        )


async def test_content_length_over_cap_is_413_before_reading(gateway_for) -> None:
    async with run_upstream() as up:
        async with gateway_for(config_for(up.url, ["replay"], max_body_bytes=10_000)) as gw:
            reader, writer = await asyncio.open_connection(*gw.url[7:].split(":"))
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n"
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.read(4096), 2)
            writer.close()
            assert head.startswith(b"HTTP/1.1 413")
            body = head.split(b"\r\n\r\n", 1)[1]
            assert json.loads(body)["error"]["code"] == "request_too_large"
            # chunked body over the cap is cut off too
            async with aiohttp.ClientSession() as s:

                async def gen():
                    for _ in range(20):
                        yield b" " * 1000

                async with s.post(gw.url + "/v1/chat/completions", data=gen()) as r:
                    assert r.status == 413
            assert up.requests == []


async def test_chunked_body_that_arrives_whole_is_capped_and_read(gateway_for) -> None:
    """A chunked body (no Content-Length) that arrived with its head is taken without waiting:
    over the cap it is still refused (413), under it the request goes through."""

    def chunked(payload: bytes) -> bytes:
        return (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            + f"{len(payload):x}\r\n".encode()
            + payload
            + b"\r\n0\r\n\r\n"
        )

    async def send(gw_url: str, raw: bytes) -> bytes:
        reader, writer = await asyncio.open_connection(*gw_url[7:].split(":"))
        writer.write(raw)  # head and whole body in one write
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
        return head

    async with run_upstream() as up:
        async with gateway_for(config_for(up.url, ["replay"], max_body_bytes=2_000)) as gw:
            big = b'{"model": "replay", "messages": [], "pad": "' + b"x" * 3_000 + b'"}'
            assert (await send(gw.url, chunked(big))).startswith(b"HTTP/1.1 413")
            small = orjson.dumps(
                {"model": "replay", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5}
            )
            assert (await send(gw.url, chunked(small))).startswith(b"HTTP/1.1 200")
            assert len(up.requests) == 1


@pytest.mark.parametrize(("model", "status"), [("hang", 504), ("error500", 500)])
async def test_upstream_failures_before_headers(gateway_for, model: str, status: int) -> None:
    async with run_upstream() as up:
        cfg = config_for(up.url, [model], timeouts={"first_byte": 0.3})
        async with gateway_for(cfg) as gw:
            async with aiohttp.ClientSession() as s:
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 5,
                }
                async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == status
                    err = (await r.json())["error"]
                    assert set(err) == {"message", "type", "param", "code"}
            await _until(lambda: gw.backend_state()["in_use"] == 0)
            assert gw.backend_state()["inflight_tokens"] == 0


async def test_upstream_dies_mid_stream_ends_with_error_event(gateway_for) -> None:
    async with run_upstream() as up, gateway_for(config_for(up.url, ["die"])) as gw:
        async with aiohttp.ClientSession() as s:
            body = {
                "model": "die",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 5,
                "stream": True,
            }
            async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                raw = await r.read()
        # (the client did not ask for usage: the engine's `"usage":null` members are cut)
        assert raw.startswith((EVENTS[0] + EVENTS[1]).replace(b',"usage":null}', b"}"))
        last = raw.rstrip().rsplit(b"\n\n", 1)[-1]
        assert json.loads(last[len(b"data: ") :])["error"]["code"] == "upstream_broken"
        assert gw.backend_state()["in_use"] == 0


async def test_upstream_refused_is_502_and_charges_nothing(gateway_for) -> None:
    async with run_upstream() as up:
        dead = up.url
    async with gateway_for(config_for(dead, ["replay"])) as gw:
        before = gw.backend_state()["available_tokens"]
        async with aiohttp.ClientSession() as s:
            body = {
                "model": "replay",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 5,
            }
            async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 502
        st = gw.backend_state()
        assert st["in_use"] == 0
        assert st["available_tokens"] >= before


async def test_refusals_are_429_or_503_with_computed_headers(gateway_for) -> None:
    tenants = [
        {"name": "alice", "api_key_sha256": [sha(KEYS["alice"])], "tokens_per_minute": 600},
        {"name": "bob", "api_key_sha256": [sha(KEYS["bob"])]},
    ]
    async with run_upstream() as up:
        cfg = config_for(up.url, ["replay", "slow"], tenants=tenants)
        async with gateway_for(cfg) as gw, aiohttp.ClientSession() as s:
            url = gw.url + "/v1/chat/completions"

            def body(max_tokens: int) -> dict:
                return {
                    "model": "replay",
                    "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": "hi"}],
                }

            alice = {"Authorization": f"Bearer {KEYS['alice']}"}
            async with s.post(url, json=body(100), headers=alice) as r:
                assert r.status == 200
                assert int(r.headers["x-ratelimit-limit-tokens"]) == 600
            # a stream holding a 400-token reservation while it runs
            held = await s.post(
                url, json={**body(400), "model": "slow", "stream": True}, headers=alice
            )
            await held.content.readline()
            before = gw.tenant_state("alice")["available_tokens"]
            async with s.post(url, json=body(300), headers=alice) as r:
                assert r.status == 429
                assert r.headers["x-kvgate-reject-reason"] == "tenant-tpm"
                assert float(r.headers["retry-after-ms"]) > 0
                assert int(r.headers["Retry-After"]) >= 1
                err = (await r.json())["error"]
                assert err["type"] == "tokens"
                assert err["code"] == "rate_limit_exceeded"
            # a refusal charges nothing
            assert gw.tenant_state("alice")["available_tokens"] >= before
            held.close()
            await _until(lambda: gw.backend_state()["in_use"] == 0)
            # larger than the whole bucket: never admissible, no Retry-After
            async with s.post(url, json=body(700), headers=alice) as r:
                assert r.status == 429
                assert "Retry-After" not in r.headers
                assert r.headers["x-should-retry"] == "false"
            # unknown / missing key
            async with s.post(url, json=body(5), headers={"Authorization": "Bearer nope"}) as r:
                assert r.status == 401
                assert (await r.json())["error"]["code"] == "invalid_api_key"
            async with s.post(url, json=body(5)) as r:
                assert r.status == 401


def token_headers(headers: Iterable[str]) -> list[str]:
    return [h for h in headers if h.lower().startswith("x-ratelimit-") and h.endswith("-tokens")]


async def test_without_a_token_limit_the_token_headers_are_left_out(gateway_for) -> None:
    """A tenant without ``tokens_per_minute`` on a backend without one: no token limit applies,
    so answers (whole and streamed) and refusals carry the three request headers and none of
    the token headers (not kvgate's internal "no limit", 2**40 tokens per minute); a tenant
    with a TPM of its own gets all six."""
    tenants = [
        {"name": "alice", "api_key_sha256": [sha(KEYS["alice"])], "tokens_per_minute": 600},
        {"name": "bob", "api_key_sha256": [sha(KEYS["bob"])], "max_concurrency": 1},
    ]
    async with run_upstream() as up:
        cfg = config_for(up.url, ["replay", "slow"], tenants=tenants, tokens_per_minute=None)
        async with gateway_for(cfg) as gw, aiohttp.ClientSession() as s:
            url = gw.url + "/v1/chat/completions"
            body = {
                "model": "replay",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}],
            }
            bob = {"Authorization": f"Bearer {KEYS['bob']}"}
            for stream in (False, True):
                async with s.post(url, json={**body, "stream": stream}, headers=bob) as r:
                    assert r.status == 200
                    await r.read()
                    assert r.headers["x-ratelimit-limit-requests"] == "1"
                    assert token_headers(r.headers) == [], r.headers
            held = await s.post(
                url, json={**body, "model": "slow", "stream": True, "max_tokens": 300}, headers=bob
            )
            await held.content.readline()
            async with s.post(url, json=body, headers=bob) as r:
                assert r.status == 429
                assert r.headers["x-kvgate-reject-reason"] == "tenant-concurrency"
                assert r.headers["x-ratelimit-remaining-requests"] == "0"
                assert token_headers(r.headers) == [], r.headers
            held.close()
            await _until(lambda: gw.backend_state()["in_use"] == 0)
            alice = {"Authorization": f"Bearer {KEYS['alice']}"}
            async with s.post(url, json=body, headers=alice) as r:
                assert r.status == 200
                assert len(token_headers(r.headers)) == 3
                assert r.headers["x-ratelimit-limit-tokens"] == "600"


async def test_backend_saturation_is_503_with_retry_after(gateway_for) -> None:
    async with run_upstream() as up:
        cfg = config_for(up.url, ["slow", "replay"], max_concurrency=1)
        async with gateway_for(cfg) as gw, aiohttp.ClientSession() as s:
            url = gw.url + "/v1/chat/completions"
            slow = await s.post(
                url,
                json={
                    "model": "slow",
                    "stream": True,
                    "max_tokens": 300,
                    "messages": [{"role": "user", "content": "x"}],
                },
            )
            await slow.content.readline()
            async with s.post(
                url,
                json={
                    "model": "replay",
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": "x"}],
                },
            ) as r:
                assert r.status == 503
                assert r.headers["x-kvgate-reject-reason"] == "backend-slots"
                assert int(r.headers["Retry-After"]) >= 1
                assert r.headers["x-ratelimit-remaining-requests"] == "0"
            slow.close()
            await _until(lambda: gw.backend_state()["in_use"] == 0)


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b'{"model": "replay", "messages": [], "max_tokens": 5}', 400, "empty_array"),
        (
            b'{"model": "replay", "messages": [{"role": "user", "content": "x"}],'
            b' "max_tokens": "ten"}',
            400,
            "invalid_type",
        ),
        (
            b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}',
            404,
            "model_not_found",
        ),
        (
            b'{"model": "replay", "messages": [{"role": "user", "content": "x"}],'
            b' "max_tokens": 5000}',
            400,
            "context_length_exceeded",
        ),
    ],
)
async def test_bad_requests_never_reach_the_engine(
    gateway_for, body: bytes, status: int, code: str
) -> None:
    async with run_upstream() as up, gateway_for(config_for(up.url, ["replay"])) as gw:
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                gw.url + "/v1/chat/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            ) as r,
        ):
            assert r.status == status
            err = (await r.json())["error"]
            assert err["code"] == code
            assert err["type"] == "invalid_request_error"
        assert up.requests == []
        assert gw.backend_state()["in_use"] == 0


async def test_models_health_ready_and_metrics(sim, gateway_for) -> None:
    async with gateway_for(config_for(sim.url, [sim.engine.config.model])) as gw:
        async with aiohttp.ClientSession() as s:
            async with s.get(gw.url + "/v1/models") as r:
                ids = [m["id"] for m in (await r.json())["data"]]
                assert ids == [sim.engine.config.model]
            async with s.get(gw.url + "/healthz") as r:
                assert r.status == 200
            async with s.get(gw.url + "/readyz") as r:
                assert r.status == 200
            async with s.get(gw.url + "/metrics") as r:
                text = await r.text()
        for name in (
            "kvgate_slots_in_use",
            "kvgate_concurrency_limit",
            "kvgate_tpm_limit",
            "kvgate_tokens_available",
            "kvgate_inflight_tokens",
            "kvgate_inflight_token_limit",
            "kvgate_reservation_leaks_total",
            "kvgate_admission_seconds",
        ):
            assert name in text, name


async def test_slow_clients_are_cut_off(gateway_for) -> None:
    """A body trickling in slower than ``client_body`` gets 408; a request head that never
    completes is closed after ``client_header``; nothing reaches the engine."""
    async with run_upstream() as up:
        cfg = config_for(up.url, ["replay"], timeouts={"client_body": 0.3, "client_header": 0.5})
        async with gateway_for(cfg) as gw:
            host, port = gw.url[7:].split(":")
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"mo'
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.read(4096), 5)
            assert head.startswith(b"HTTP/1.1 408")
            writer.close()
            # slowloris: half a request line, then nothing
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/chat/comp")
            await writer.drain()
            assert await asyncio.wait_for(reader.read(4096), 5) == b""  # closed by the gateway
            writer.close()
            assert up.requests == []
            assert gw.backend_state()["in_use"] == 0


async def test_never_admissible_is_answered_at_once_even_behind_queued_requests(
    gateway_for,
) -> None:
    tenants = [{"name": "alice", "api_key_sha256": [sha(KEYS["alice"])], "max_wait_ms": 20_000}]
    async with run_upstream() as up:
        cfg = config_for(
            up.url, ["slow"], tenants=tenants, max_concurrency=1, inflight_token_limit=500
        )
        async with gateway_for(cfg) as gw, aiohttp.ClientSession() as s:
            url = gw.url + "/v1/chat/completions"
            alice = {"Authorization": f"Bearer {KEYS['alice']}"}

            def body(max_tokens: int, stream: bool = False) -> dict:
                return {
                    "model": "slow",
                    "max_tokens": max_tokens,
                    "stream": stream,
                    "messages": [{"role": "user", "content": "x"}],
                }

            held = await s.post(url, json=body(100, stream=True), headers=alice)
            await held.content.readline()
            queued = asyncio.create_task(s.post(url, json=body(100), headers=alice))
            await _until(lambda: len(gw.gateway.queue) == 1)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            async with s.post(url, json=body(900), headers=alice) as r:
                assert r.status == 429  # can never fit: OpenAI's "Request too large", not busy
                assert (await r.json())["error"]["type"] == "tokens"
                assert r.headers["x-kvgate-reject-reason"] == "inflight-tokens"
                assert r.headers["x-should-retry"] == "false"
                assert "Retry-After" not in r.headers
            assert loop.time() - t0 < 5  # not parked for the tenant's 20 s
            held.close()
            resp = await queued
            assert resp.status == 200
            resp.release()
            await _until(lambda: gw.backend_state()["in_use"] == 0)


async def test_http_level_errors_keep_the_openai_shape(gateway_for) -> None:
    """Wrong method, unknown path, an undecodable body and an engine's plain-text 404 on a
    passthrough route all answer with OpenAI's error body, never a bare 500."""
    async with run_upstream() as up, gateway_for(config_for(up.url, ["replay"])) as gw:
        async with aiohttp.ClientSession() as s:
            async with s.get(gw.url + "/v1/chat/completions") as r:
                assert r.status == 405
                assert (await r.json())["error"]["code"] == "method_not_allowed"
            async with s.get(gw.url + "/nope") as r:
                assert r.status == 404
                assert (await r.json())["error"]["code"] == "unknown_url"
            async with s.post(gw.url + "/v1/unknown-route", json={}) as r:
                assert r.status == 404  # the fake engine's plain-text 404, reshaped
                err = (await r.json())["error"]
                assert set(err) == {"message", "type", "param", "code"}
            async with s.post(
                gw.url + "/v1/chat/completions",
                data=b"this is not gzip",
                headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
            ) as r:
                assert r.status == 400
                assert (await r.json())["error"]["code"] == "invalid_body"
        assert up.requests == []
        assert gw.backend_state()["in_use"] == 0


async def test_non_streaming_body_that_stalls_times_out_after_idle(gateway_for) -> None:
    async with run_upstream() as up:
        cfg = config_for(up.url, ["stall"], timeouts={"idle": 0.3, "first_byte": 30, "total": 60})
        async with gateway_for(cfg) as gw, aiohttp.ClientSession() as s:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            body = {
                "model": "stall",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
            }
            async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 504
                assert (await r.json())["error"]["code"] == "upstream_timeout"
            assert loop.time() - t0 < 30  # idle (0.3 s), not total (60 s)
            await _until(lambda: gw.backend_state()["in_use"] == 0)
            await _until(lambda: up.cancelled == 1)
            metrics = gw.gateway.metrics
            metrics.flush()
            outcome = metrics.requests.labels("b0", "anonymous", "upstream_timeout")
            assert outcome._value.get() == 1  # counted as what it was, not as "ok"
            assert metrics.requests.labels("b0", "anonymous", "ok")._value.get() == 0


async def test_total_timeout_counts_from_the_start_of_the_request(gateway_for) -> None:
    async with run_upstream() as up:
        cfg = config_for(up.url, ["late"], timeouts={"first_byte": 1.2, "idle": 1.2, "total": 1.2})
        async with gateway_for(cfg) as gw, aiohttp.ClientSession() as s:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            body = {"model": "late", "stream": True, "messages": [{"role": "user", "content": "x"}]}
            async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                raw = await r.read()
            took = loop.time() - t0
            assert b'"code":"upstream_timeout"' in raw  # the stream ends with an error event
            # 1.2 s from the request (+ up to one 50 ms watchdog sweep, + a loaded machine's
            # delays), not from the head: that would be 0.6 s + 1.2 s
            assert 1.2 <= took < 1.7
            await _until(lambda: gw.backend_state()["in_use"] == 0)


async def test_absurd_usage_from_the_engine_is_ignored_and_nothing_leaks(gateway_for) -> None:
    async with run_upstream() as up, gateway_for(config_for(up.url, ["absurd"])) as gw:
        async with aiohttp.ClientSession() as s:
            body = {
                "model": "absurd",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
            }
            async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["completion_tokens"] == 2**62 + 1
        state = gw.backend_state()
        assert state["in_use"] == 0
        assert state["inflight_tokens"] == 0
        assert gw.gateway.controller.leaks == 0
        metrics = gw.gateway.metrics
        metrics.flush()
        # settled from the gateway's own prompt count (the engine's was ignored)
        assert 0 < metrics.tenant_tokens.labels("anonymous")._value.get() < 64
        assert metrics.requests.labels("b0", "anonymous", "ok")._value.get() == 1


@pytest.mark.parametrize("path", ["/v1/../health", "/v1/%2e%2e/metrics", "/v1/./models", "/.."])
async def test_dot_segments_never_reach_the_engine(gateway_for, path: str) -> None:
    async with run_upstream() as up, gateway_for(config_for(up.url, ["replay"])) as gw:
        reader, writer = await asyncio.open_connection(*gw.url[7:].split(":"))
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400"), head
        assert json.loads(body)["error"]["code"] == "invalid_path"
        assert up.requests == []


async def test_expect_100_continue(gateway_for) -> None:
    async with run_upstream() as up, gateway_for(config_for(up.url, ["replay"])) as gw:
        body = orjson.dumps(
            {"model": "replay", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
        )
        reader, writer = await asyncio.open_connection(*gw.url[7:].split(":"))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        await writer.drain()
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        writer.close()

        async def first_head(expect: str, with_body: bool) -> bytes:
            """Send a request with `Expect: <expect>` (its body in the same write, or never);
            return the head of the first answer."""
            reader, writer = await asyncio.open_connection(*gw.url[7:].split(":"))
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                + f"Content-Length: {len(body)}\r\nExpect: {expect}\r\n\r\n".encode()
                + (body if with_body else b"")
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.close()
            return head

        # an expectation the gateway cannot meet: 417 at once, without waiting for the body
        assert (await first_head("something-else", with_body=False)).startswith(b"HTTP/1.1 417")
        # the same with the body in the same write as the head: still 417, nothing forwarded
        assert (await first_head("something-else", with_body=True)).startswith(b"HTTP/1.1 417")
        # 100-continue with the body already sent along: answered without a 100
        assert (await first_head("100-Continue", with_body=True)).startswith(b"HTTP/1.1 200")
        assert len(up.requests) == 2


async def test_a_client_without_a_key_is_not_asked_for_its_body(gateway_for) -> None:
    """``Expect: 100-continue`` from a client without a valid key: 401 at once, no ``100
    Continue`` (the key is checked from the head, before the body is read) and ``Connection:
    close`` (a body it announced may still come), nothing forwarded; the same client with its
    key is asked for the body and served."""
    tenants = [{"name": "alice", "api_key_sha256": [sha(KEYS["alice"])]}]
    async with (
        run_upstream() as up,
        gateway_for(config_for(up.url, ["replay"], tenants=tenants)) as gw,
    ):
        body = orjson.dumps(
            {"model": "replay", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
        )

        async def first_head(key: str) -> bytes:
            reader, writer = await asyncio.open_connection(*gw.url[7:].split(":"))
            try:
                writer.write(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n".encode()
                    + b"Content-Type: application/json\r\nExpect: 100-continue\r\n\r\n"
                )
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                if head.startswith(b"HTTP/1.1 100"):
                    writer.write(body)
                    await writer.drain()
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                    return b"100 then " + head
                return head
            finally:
                writer.close()

        refused = await first_head("nope")
        assert refused.startswith(b"HTTP/1.1 401"), refused
        # the body it announced never comes: the connection cannot carry another request
        assert b"connection: close" in refused.lower(), refused
        assert up.requests == []
        served = await first_head(KEYS["alice"])
        assert served.startswith(b"100 then HTTP/1.1 200"), served
        assert len(up.requests) == 1


async def test_an_endless_body_without_a_key_is_read_for_seconds_not_forever(gateway_for) -> None:
    """A client without a valid key that streams an endless chunked body: 401 (``Connection:
    close``) at once, and the gateway reads and drops the rest for a couple of seconds
    (``LINGER_S``), then closes the connection (aiohttp's default went on for 10 s: 12 GB over
    loopback); nothing reaches the engine."""
    from kvgate.server import LINGER_S

    tenants = [{"name": "alice", "api_key_sha256": [sha(KEYS["alice"])]}]
    async with (
        run_upstream() as up,
        gateway_for(config_for(up.url, ["replay"], tenants=tenants)) as gw,
    ):
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection(*gw.url[7:].split(":"))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        answered = loop.time()
        assert head.startswith(b"HTTP/1.1 401"), head
        assert b"connection: close" in head.lower(), head
        chunk = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
        closed = None
        give_up = answered + 30
        while closed is None and loop.time() < give_up:
            try:
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 5)
            except (ConnectionError, TimeoutError):
                closed = loop.time()
        writer.close()
        assert closed is not None, "the gateway still reads the body after 30 s"
        # LINGER_S (2 s), plus a loaded machine's delays: well under aiohttp's default 10 s
        assert LINGER_S <= 2.0
        assert closed - answered < 6.0, closed - answered
        assert up.requests == []


async def test_a_reload_that_lowers_the_body_cap_applies_to_trickled_bodies(gateway_for) -> None:
    async with run_upstream() as up, gateway_for(config_for(up.url, ["replay"])) as gw:
        gw.gateway.max_body_bytes = 1_000  # what a reload does (gateway_build.apply_config)
        async with aiohttp.ClientSession() as s:

            async def trickle():
                for _ in range(10):
                    yield b" " * 500
                    await asyncio.sleep(0.01)

            async with s.post(gw.url + "/v1/chat/completions", data=trickle()) as r:
                assert r.status == 413
        assert up.requests == []


async def test_a_reload_that_raises_the_body_cap_admits_larger_bodies(gateway_for, caplog) -> None:
    """The cap is the gateway's (changed by a reload), not one the analysers kept from start-up;
    model settings a reload cannot apply are named in a warning."""
    import logging

    from kvgate.config import Config
    from kvgate.gateway_build import apply_config

    async with (
        run_upstream() as up,
        gateway_for(config_for(up.url, ["replay"], max_body_bytes=2_000)) as gw,
    ):
        body = {
            "model": "replay",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "x " * 1500}],
        }
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 413
            data = gw.gateway.config.model_dump()
            data["max_body_bytes"] = 100_000
            apply_config(gw.gateway, Config.model_validate(data))
            async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
            caplog.set_level(logging.WARNING, logger="kvgate")
            data["backends"][0]["models"][0]["context_window"] = 2048
            apply_config(gw.gateway, Config.model_validate(data))
            assert any("model settings" in r.getMessage() for r in caplog.records)
        assert gw.backend_state()["in_use"] == 0


async def test_shutdown_cuts_streams_at_the_grace_period(gateway_for) -> None:
    from kvgate.gateway_build import build_gateway
    from kvgate.server import run_gateway

    async with run_upstream() as up:
        gateway = build_gateway(config_for(up.url, ["slow"]), poll=False)
        loop = asyncio.get_running_loop()
        chunks = 0
        async with aiohttp.ClientSession() as s:
            async with run_gateway(gateway, shutdown_timeout=1.0) as url:
                body = {
                    "model": "slow",
                    "stream": True,
                    "messages": [{"role": "user", "content": "x"}],
                }
                resp = await s.post(url + "/v1/chat/completions", json=body)
                while chunks < 3:
                    await resp.content.readline()
                    chunks += 1
                t0 = loop.time()
            took = loop.time() - t0  # the stream runs for 10 s: only the grace period ends it
            resp.close()
        assert 0.9 <= took < 1.6  # the grace period (1 s), not aiohttp's twice that
        assert gateway.controller.backend_state(0)["in_use"] == 0


@pytest.mark.parametrize(("method", "path"), [("POST", "/metrics"), ("DELETE", "/v1/models")])
async def test_wrong_method_on_gateway_routes_is_405(gateway_for, method: str, path: str) -> None:
    async with run_upstream() as up, gateway_for(config_for(up.url, ["replay"])) as gw:
        async with aiohttp.ClientSession() as s, s.request(method, gw.url + path) as r:
            assert r.status == 405
            assert r.headers["Allow"] == "GET"
            assert (await r.json())["error"]["code"] == "method_not_allowed"
        assert up.requests == []  # answered by the gateway, never forwarded
