"""Request bodies sent with ``Content-Encoding``: gzip and deflate are decoded under the body cap
(on the DECODED size, without inflating more than the cap), anything else is refused."""

from __future__ import annotations

import asyncio
import gzip
import io
import resource
import struct
import time
import zlib
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from kvgate.gateway_build import build_gateway
from kvgate.server import run_gateway

from .conftest import config_for
from .fake_upstream import run_upstream

CHAT = orjson.dumps(
    {"model": "replay", "messages": [{"role": "user", "content": "hello " * 50}], "max_tokens": 8}
)
CAP = 2_000_000


def gzip_bomb(mib: int) -> bytes:
    """A valid one-member gzip of ``mib`` MiB of zeros, built without compressing them all: each
    MiB after the first, fully flushed, compresses to the same bytes (about 1 KB)."""
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = b"\0" * (1 << 20)
    first = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    big = b"\0" * (16 << 20)
    for _ in range(mib // 16):
        crc = zlib.crc32(big, crc)
    for _ in range(mib % 16):
        crc = zlib.crc32(zeros, crc)
    size = (mib << 20) & 0xFFFFFFFF
    return first + block * (mib - 1) + b"\x03\x00" + struct.pack("<II", crc, size)


def test_the_bomb_is_what_it_claims() -> None:
    bomb = gzip_bomb(20)
    assert len(bomb) < 25_000
    assert gzip.decompress(bomb) == b"\0" * (20 << 20)


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, object, object]]:
    async with run_upstream() as up:
        # the engine gets the decoded body as it came (not turned into a stream)
        cfg = config_for(up.url, ["replay"], max_body_bytes=CAP, stream_upstream=False)
        gateway = build_gateway(cfg, poll=False)
        async with run_gateway(gateway) as url:
            yield url, gateway, up


async def _post(url: str, body: bytes, encoding: str | None, **headers: str) -> tuple:
    hdrs = {"Content-Type": "application/json", **headers}
    if encoding is not None:
        hdrs["Content-Encoding"] = encoding
    async with (
        aiohttp.ClientSession(auto_decompress=False) as s,
        s.post(url + "/v1/chat/completions", data=io.BytesIO(body), headers=hdrs) as r,
    ):
        return r.status, await r.read(), r.headers


def _error(raw: bytes) -> dict:
    err = orjson.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


@pytest.mark.parametrize(
    ("encoding", "encode"),
    [
        ("gzip", gzip.compress),
        ("x-gzip", gzip.compress),
        ("GZIP", lambda b: gzip.compress(b[:10]) + gzip.compress(b[10:])),  # two members
        ("deflate", zlib.compress),  # the zlib format
        ("deflate", _raw_deflate),  # raw deflate, as some clients send it
        ("identity", lambda b: b),
    ],
)
async def test_compressed_bodies_are_decoded(served, encoding, encode) -> None:  # type: ignore[no-untyped-def]
    url, gateway, up = served
    status, raw, _ = await _post(url, encode(CHAT), encoding)
    assert status == 200, raw
    assert up.raw_bodies[-1] == CHAT  # the engine gets the decoded bytes, nothing else
    assert gateway.controller.backend_state(0)["in_use"] == 0


async def test_a_chunked_compressed_body_is_decoded(served) -> None:  # type: ignore[no-untyped-def]
    url, _, up = served
    packed = gzip.compress(CHAT)

    async def parts() -> AsyncIterator[bytes]:
        for i in range(0, len(packed), 50):
            yield packed[i : i + 50]

    async with (
        aiohttp.ClientSession() as s,
        s.post(
            url + "/v1/chat/completions",
            data=parts(),
            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
        ) as r,
    ):
        assert r.status == 200, await r.text()
    assert up.raw_bodies[-1] == CHAT


async def test_a_decompression_bomb_is_refused_without_inflating_it(served) -> None:  # type: ignore[no-untyped-def]
    """1 GiB of zeros in about 1 MB of gzip, under a 2 MB cap: 413 on the decoded size, having
    inflated no more than the cap — measured as the process's CPU time and peak memory, and as
    the gateway answering the next request at once (not busy inflating the rest)."""
    url, gateway, up = served
    bomb = await asyncio.to_thread(gzip_bomb, 1024)
    assert len(bomb) < CAP
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    status, raw, headers = await _post(url, bomb, "gzip")
    assert status == 413
    err = _error(raw)
    assert err["code"] == "request_too_large"
    assert "decodes" in err["message"]
    assert headers.get("Connection") == "close"
    # the gateway is free at once: nothing is left inflating in the background
    async with aiohttp.ClientSession() as s, s.get(url + "/healthz") as r:
        assert r.status == 200
    elapsed = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    grown_mib = (after.ru_maxrss - before.ru_maxrss) / 1024
    # inflating 1 GiB takes seconds of CPU; the cap's 2 MB a few ms (bounds generous for load)
    assert cpu < 0.5, cpu
    assert elapsed < 3.0, elapsed
    assert grown_mib < 64, grown_mib
    assert up.requests == []  # nothing reached the engine
    assert gateway.controller.backend_state(0)["in_use"] == 0


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, gzip", "bogus"])
async def test_unsupported_encodings_are_415(served, encoding: str) -> None:  # type: ignore[no-untyped-def]
    url, gateway, up = served
    status, raw, headers = await _post(url, gzip.compress(CHAT), encoding)
    assert status == 415
    err = _error(raw)
    assert err["code"] == "unsupported_content_encoding"
    assert err["type"] == "invalid_request_error"
    assert encoding in err["message"]
    assert headers["Accept-Encoding"] == "gzip, deflate"
    assert up.requests == []
    assert gateway.controller.backend_state(0)["in_use"] == 0


async def test_the_415_status_line_names_its_reason(served) -> None:  # type: ignore[no-untyped-def]
    """The 415's status line carries its reason phrase (RFC 9110 §15.5.16) like every other
    status kvgate writes (it went out as ``HTTP/1.1 415 `` with none)."""
    url, _, _ = served
    headers = {"Content-Type": "application/json", "Content-Encoding": "br"}
    async with (
        aiohttp.ClientSession(auto_decompress=False) as s,
        s.post(url + "/v1/chat/completions", data=b"x", headers=headers) as r,
    ):
        assert (r.status, r.reason) == (415, "Unsupported Media Type")


@pytest.mark.parametrize(
    ("encoding", "body", "why"),
    [
        ("gzip", b"\x1f\x8bnot really gzip at all", "not valid gzip"),
        ("gzip", gzip.compress(CHAT)[:-12], "ends early"),
        ("gzip", gzip.compress(CHAT) + b"trailing", "not valid gzip"),
        ("deflate", zlib.compress(CHAT) + b"x", "follow the end"),
        ("deflate", b"\x00\x01\x02garbage", "not valid deflate"),
    ],
)
async def test_corrupt_compressed_bodies_are_400(served, encoding, body, why) -> None:  # type: ignore[no-untyped-def]
    url, gateway, up = served
    status, raw, _ = await _post(url, body, encoding)
    assert status == 400
    err = _error(raw)
    assert err["code"] == "invalid_body"
    assert why in err["message"]
    assert up.requests == []
    assert gateway.controller.backend_state(0)["in_use"] == 0


async def test_the_decoded_cap_applies_to_small_ratios_too() -> None:
    """A body that decodes to just over the cap is refused; just under it gets through."""
    cap = 200_000
    async with run_upstream() as up:
        # the engine gets the decoded body as it came (not turned into a stream)
        cfg = config_for(up.url, ["replay"], max_body_bytes=cap, stream_upstream=False)
        gateway = build_gateway(cfg, poll=False)
        async with run_gateway(gateway) as url:
            pad = cap - len(CHAT) - 20
            over = CHAT[:-1] + b', "user": "' + b"u" * (pad + 40) + b'"}'
            under = CHAT[:-1] + b', "user": "' + b"u" * (pad - 40) + b'"}'
            assert len(over) > cap >= len(under)
            status, raw, _ = await _post(url, gzip.compress(over), "gzip")
            assert status == 413, raw
            status, raw, _ = await _post(url, gzip.compress(under), "gzip")
            assert status == 200, raw
            assert up.raw_bodies[-1] == under
