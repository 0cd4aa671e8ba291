"""What kvgate adds to a forwarded body (``stream_options.include_usage``, a reserved
``default_max_tokens``) and that everything else reaches the engine as the client sent it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import aiohttp
import pytest

from kvgate.proxy.handler import rewrite_body

from .conftest import config_for
from .fake_upstream import run_upstream

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
