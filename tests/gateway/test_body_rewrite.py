"""What kvgate adds to a forwarded body (``stream_options.include_usage``, a reserved
``default_max_tokens``) and that everything else reaches the engine as the client sent it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from kvgate.proxy.handler import rewrite_body

from .conftest import config_for
from .fake_upstream import run_upstream
from .helpers import get_text, metric

BIG = 123456789012345678901234567890  # beyond 64 bits: orjson would decode it as a float


def analysis(inject: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(inject_max_tokens=inject)


def test_nothing_to_add_forwards_the_same_bytes() -> None:
    body = b'{"model": "m", "seed": %d}' % BIG
    assert rewrite_body(body, analysis(), add_usage=False) is body


@pytest.mark.parametrize(
    ("add_usage", "inject", "members"),
    [
        (True, None, b'"stream_options":{"include_usage":true}'),
        (False, 64, b'"max_tokens":64'),
        (True, 64, b'"stream_options":{"include_usage":true},"max_tokens":64'),
    ],
)
def test_absent_keys_are_spliced_in_and_every_client_byte_kept(
    add_usage: bool, inject: int | None, members: bytes
) -> None:
    tail = (
        b' "model" : "m",\n "seed": %d, "messages": [{"role": "user", '
        b'"content": "h\\u00e9 \\ud83d\\ude00"}], "temperature": 0.10000000000000001}' % BIG
    )
    body = b"\n {" + tail
    out = rewrite_body(body, analysis(inject), add_usage=add_usage)
    assert out == b"\n {" + members + b"," + tail
    data = json.loads(out)
    assert data["seed"] == BIG
    assert data["messages"][0]["content"] == "hé 😀"
    if add_usage:
        assert data["stream_options"] == {"include_usage": True}
    if inject is not None:
        assert data["max_tokens"] == inject


def test_empty_object_gets_no_dangling_comma() -> None:
    assert rewrite_body(b"{ }", analysis(7), add_usage=True) == (
        b'{"stream_options":{"include_usage":true},"max_tokens":7 }'
    )
    json.loads(rewrite_body(b"{}", analysis(7), add_usage=False))


@pytest.mark.parametrize(
    ("body", "inject", "expected_opts", "expected_max"),
    [
        (
            b'{"stream_options": {"x": 1}, "seed": %d}' % BIG,
            None,
            {"x": 1, "include_usage": True},
            None,
        ),
        (b'{"stream_options": null, "seed": %d}' % BIG, None, {"include_usage": True}, None),
        (b'{"max_tokens": null, "seed": %d}' % BIG, 32, {"include_usage": True}, 32),
    ],
)
def test_present_keys_are_changed_in_place_with_integers_exact(
    body: bytes, inject: int | None, expected_opts: dict[str, object], expected_max: int | None
) -> None:
    out = rewrite_body(body, analysis(inject), add_usage=True)
    data = json.loads(out)
    assert data["seed"] == BIG
    assert str(BIG).encode() in out
    assert data["stream_options"] == expected_opts
    assert data.get("max_tokens") == expected_max


def test_in_place_change_writes_non_ascii_as_escapes() -> None:
    body = '{"stream_options": {}, "content": "h\\u00e9, €, 😀"}'.encode()
    out = rewrite_body(body, analysis(), add_usage=True)
    assert out.isascii()
    assert json.loads(out)["content"] == "hé, €, 😀"


async def test_engine_receives_the_clients_bytes_plus_include_usage(gateway_for) -> None:
    async with run_upstream() as up, gateway_for(config_for(up.url, ["replay"])) as gw:
        body = (
            b'{"model":"replay","messages":[{"role":"user","content":"x"}],'
            b'"stream":true,"max_tokens":50,"seed":%d,"logit_bias":{"50256":-100}}' % BIG
        )
        async with aiohttp.ClientSession() as s:
            headers = {"Content-Type": "application/json"}
            async with s.post(gw.url + "/v1/chat/completions", data=body, headers=headers) as r:
                assert r.status == 200
                await r.read()
        assert up.raw_bodies[-1] == b'{"stream_options":{"include_usage":true},' + body[1:]
        assert gw.backend_state()["in_use"] == 0


def test_the_cap_not_reserved_is_dropped_and_integers_kept_exact() -> None:
    body = b'{"max_tokens": 900, "seed": %d, "max_completion_tokens": 50, "n": 1}' % BIG
    out = rewrite_body(body, SimpleNamespace(inject_max_tokens=None, drop_cap="max_tokens"), False)
    data = json.loads(out)
    assert data == {"seed": BIG, "max_completion_tokens": 50, "n": 1}
    assert str(BIG).encode() in out
    out = rewrite_body(
        body, SimpleNamespace(inject_max_tokens=None, drop_cap="max_completion_tokens"), True
    )
    assert json.loads(out) == {
        "max_tokens": 900,
        "seed": BIG,
        "n": 1,
        "stream_options": {"include_usage": True},
    }


@pytest.mark.parametrize(
    ("route", "extra", "kept", "value"),
    [
        ("/v1/chat/completions", {}, "max_completion_tokens", 20),
        ("/v1/chat/completions", {"max_completion_tokens": None}, "max_tokens", 30),
        ("/v1/completions", {}, "max_tokens", 30),
    ],
)
async def test_engine_receives_exactly_the_cap_reserved(
    gateway_for, route: str, extra: dict[str, object], kept: str, value: int
) -> None:
    """A body with both ``max_tokens`` and ``max_completion_tokens``: the engine gets one key,
    with the value the reservation used (engines differ in which one they read)."""
    async with run_upstream() as up, gateway_for(config_for(up.url, ["replay"])) as gw:
        body: dict[str, object] = {"model": "replay", "max_tokens": 30, "max_completion_tokens": 20}
        if route == "/v1/completions":
            body["prompt"] = "hello"
        else:
            body["messages"] = [{"role": "user", "content": "hello"}]
        body.update(extra)
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + route, data=json.dumps(body).encode()) as r:
                assert r.status == 200, await r.text()
                await r.read()
        forwarded = up.requests[-1]
        assert {k for k in forwarded if "max" in k} == {kept}
        assert forwarded[kept] == value
        analysis = gw.gateway.registry.analyze(route, json.dumps(body).encode())
        assert analysis.completion_tokens == value
        reserved = metric(await get_text(gw.url + "/metrics"), "kvgate_tokens_reserved_total")
        assert reserved == analysis.reserved_tokens
        assert gw.backend_state()["in_use"] == 0


async def test_lone_surrogate_is_forwarded_not_a_500(gateway_for) -> None:
    """``"\\ud800"`` (accepted by Python's json and vLLM) is analysed and forwarded, also when
    the body must be rewritten (a stream without include_usage)."""
    received: list[bytes] = []

    async def engine(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        received.append(raw)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with gateway_for(config_for(url, ["m"])) as gw:
            body = (
                b'{"model": "m", "stream": true, "max_tokens": 5,'
                b' "messages": [{"role": "user", "content": "a\\ud800b"}]}'
            )
            async with aiohttp.ClientSession() as s:
                async with s.post(gw.url + "/v1/chat/completions", data=body) as r:
                    text = await r.text()
                    assert r.status == 200, text
            assert "[DONE]" in text
            assert '"ok"' in text
            assert json.loads(received[-1])["messages"][0]["content"] == "a\ud800b"
            assert json.loads(received[-1])["stream_options"] == {"include_usage": True}
            assert gw.backend_state()["in_use"] == 0
    finally:
        await runner.cleanup()
