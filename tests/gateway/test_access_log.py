"""Access log, request ids and trace context, end to end: a gateway on 127.0.0.1 in front of a
scripted engine that records the headers it receives, the official openai client, the access
log read back from its file (and from ``kvgate serve``'s stderr)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import select
import signal
import sys
import threading
import time
import timeit
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from kvgate import accesslog
from kvgate.accesslog import (
    FLUSH_BYTES,
    FLUSH_SECONDS,
    JsonFormatter,
    configure_access_log,
    flush_access_log,
    log_access,
    request_id,
    valid_traceparent,
)
from kvgate.config import Config, ConfigError, parse_config
from kvgate.gateway_build import build_gateway
from kvgate.server import run_gateway

from .conftest import sha
from .fake_upstream import serve_app
from .helpers import (
    free_port,
    metric,
    start_kvgate,
    stderr_so_far,
    stop_process,
    until,
    wait_http_up,
)

SECRET = "sk-alice-secret-4711"
WORD = "zebrafrogquux"  # a prompt word that must never reach the log
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
HEX32 = re.compile(r"[0-9a-f]{32}")

COMPLETION = {
    "id": "c1",
    "object": "chat.completion",
    "model": "ok",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"}}],
    "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14},
}


def _chunk(text: str) -> bytes:
    return (
        b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}) + b"\n\n"
    )


def engine_app(seen: list[dict[str, str]]) -> web.Application:
    """Records each request's headers; ``ok`` answers (streamed or not, with an ``x-request-id``
    of its own that kvgate must not pass on), ``boom`` 500, ``slow`` streams for 10 s."""

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        body = await request.json()
        model = body["model"]
        if model == "boom":
            return web.json_response({"error": {"message": "exploded"}}, status=500)
        own = {"x-request-id": "engine-own-id"}
        if not body.get("stream"):
            return web.json_response(COMPLETION, headers=own)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **own})
        await resp.prepare(request)
        n = 200 if model == "slow" else 2
        for i in range(n):
            await resp.write(_chunk(f"t{i} "))
            if model == "slow":
                await asyncio.sleep(0.05)
        usage = {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 2}}
        await resp.write(b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n")
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "ok", "object": "model"}]})

    async def rerank(request: web.Request) -> web.Response:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        usage = {"prompt_tokens": 5, "total_tokens": 5}
        return web.json_response({"results": [], "usage": usage}, headers={"x-request-id": "e"})

    app = web.Application()
    app.router.add_post("/v1/rerank", rerank)
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_get("/v1/models", models)
    return app


@pytest.fixture
def access_file(tmp_path: Path) -> Iterator[Path]:
    """The access log appended to a file for the test; the logger put back as it was after."""
    path = tmp_path / "access.log"
    configure_access_log(True, str(path))
    try:
        yield path
    finally:
        configure_access_log(False)


def _size(path: Path) -> int:
    return path.stat().st_size


def log_text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def line_of(path: Path, rid: str) -> dict[str, Any] | None:
    found = [x for x in lines(path) if x["request_id"] == rid]
    assert len(found) <= 1, found
    return found[0] if found else None


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    seen: list[dict[str, str]] = []
    async with serve_app(engine_app(seen)) as url:
        yield url, seen


def config(url: str, **extra: Any) -> Config:
    return Config.model_validate(
        {
            **extra,
            "backends": [
                {
                    "name": "b0",
                    "url": url,
                    "models": [{"name": m, "context_window": 1024} for m in ("ok", "boom", "slow")],
                    "max_concurrency": 4,
                    "stream_upstream": False,
                }
            ],
            "tenants": [
                {"name": "alice", "api_key_sha256": [sha(SECRET)]},
                {"name": "tiny", "api_key_sha256": [sha("sk-tiny")], "tokens_per_minute": 20},
            ],
        }
    )


def test_request_id_and_traceparent_rules() -> None:
    assert request_id("abc-123") == "abc-123"
    assert request_id("x" * 128) == "x" * 128
    for bad in (None, "", "x" * 129, "a\nb", "é", "a\x7fb"):
        assert HEX32.fullmatch(request_id(bad)), bad
    assert valid_traceparent(TRACEPARENT)
    assert valid_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra")
    for bad in (
        TRACEPARENT.upper(),
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        TRACEPARENT + "-extra",  # version 00 has exactly four fields
        TRACEPARENT[:-1],
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
    ):
        assert not valid_traceparent(bad), bad


async def test_ids_trace_context_and_one_line_per_admitted_request(
    engine: tuple[str, list[dict[str, str]]], access_file: Path
) -> None:
    url, seen = engine
    gateway = build_gateway(config(url), poll=False)
    async with run_gateway(gateway) as gw_url:
        client = openai.AsyncOpenAI(base_url=gw_url + "/v1", api_key=SECRET, max_retries=0)
        msgs = [{"role": "user", "content": f"tell me about the {WORD}"}]
        headers = {"x-request-id": "client-id-1", "traceparent": TRACEPARENT, "tracestate": "k=v"}
        raw = await client.chat.completions.with_raw_response.create(
            model="ok", messages=msgs, max_tokens=8, extra_headers=headers
        )
        # one id, kvgate's: the engine's own x-request-id is not passed on
        assert raw.headers.get_list("x-request-id") == ["client-id-1"]
        assert raw.parse().choices[0].message.content == "fine"
        got = seen[-1]
        assert got["x-request-id"] == "client-id-1"
        assert got["traceparent"] == TRACEPARENT
        assert got["tracestate"] == "k=v"
        assert "authorization" not in got  # the client's key never goes upstream

        # streamed; an invalid traceparent is dropped with its tracestate; no id: one is made
        bad = {"traceparent": TRACEPARENT.upper(), "tracestate": "k=v"}
        async with client.chat.completions.with_streaming_response.create(
            model="ok", messages=msgs, max_tokens=8, stream=True, extra_headers=bad
        ) as resp:
            made = resp.headers.get("x-request-id")
            text = [c async for c in resp.iter_lines()]
        assert text
        assert made is not None
        assert HEX32.fullmatch(made)
        assert seen[-1]["x-request-id"] == made
        assert "traceparent" not in seen[-1]
        assert "tracestate" not in seen[-1]

        # an id that is not sane (over 128 characters) is replaced, the same one both ways
        raw = await client.chat.completions.with_raw_response.create(
            model="ok", messages=msgs, max_tokens=8, extra_headers={"x-request-id": "y" * 129}
        )
        replaced = raw.headers.get("x-request-id")
        assert replaced is not None
        assert HEX32.fullmatch(replaced)
        assert seen[-1]["x-request-id"] == replaced

        await until(lambda: line_of(access_file, replaced) is not None, timeout=10)
        first = line_of(access_file, "client-id-1")
        assert first is not None
        assert first["tenant"] == "alice"
        assert first["backend"] == "b0"
        assert first["model"] == "ok"
        assert first["route"] == "/v1/chat/completions"
        assert first["method"] == "POST"
        assert first["status"] == 200
        assert first["outcome"] == "ok"
        assert first["reason"] is None
        assert first["prompt_tokens"] == 11
        assert first["completion_tokens"] == 3
        assert first["reserved_tokens"] > 8
        assert first["ttft_s"] > 0
        assert first["duration_s"] >= first["ttft_s"]
        assert first["queue_wait_s"] >= 0
        assert first["bytes_sent"] > 100
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", first["time"])
        streamed = line_of(access_file, made)
        assert streamed is not None
        assert streamed["status"] == 200
        assert streamed["outcome"] == "ok"
        assert streamed["completion_tokens"] == 2
        assert streamed["bytes_sent"] > 100
        text_log = log_text(access_file)
        assert SECRET not in text_log
        assert WORD not in text_log
        assert len(lines(access_file)) == 3
        assert gateway.controller.backend_state(0)["in_use"] == 0
        await client.close()


async def test_every_refusal_and_error_has_an_id_and_a_line(
    engine: tuple[str, list[dict[str, str]]], access_file: Path
) -> None:
    url, _seen = engine
    gateway = build_gateway(config(url), poll=False)
    async with run_gateway(gateway) as gw_url, aiohttp.ClientSession() as s:

        async def post(rid: str, key: str, body: dict[str, Any]) -> tuple[int, str | None]:
            h = {"Authorization": f"Bearer {key}", "x-request-id": rid}
            async with s.post(gw_url + "/v1/chat/completions", json=body, headers=h) as r:
                await r.read()
                return r.status, r.headers.get("x-request-id")

        def body(model: str, max_tokens: int = 8) -> dict[str, Any]:
            msgs = [{"role": "user", "content": f"say {WORD}"}]
            return {"model": model, "messages": msgs, "max_tokens": max_tokens}

        assert await post("r-401", "sk-wrong", body("ok")) == (401, "r-401")
        assert await post("r-404", SECRET, body("nosuchmodel")) == (404, "r-404")
        assert await post("r-429", "sk-tiny", body("ok", max_tokens=500)) == (429, "r-429")
        assert await post("r-500", SECRET, body("boom")) == (500, "r-500")

        # answers of the routing table: an unknown route, a wrong method
        async with s.post(gw_url + "/v1/unknown", headers={"x-request-id": "r-url"}) as r:
            assert (r.status, r.headers.get("x-request-id")) == (404, "r-url")
        async with s.get(gw_url + "/v1/chat/completions", headers={"x-request-id": "r-405"}) as r:
            assert (r.status, r.headers.get("x-request-id")) == (405, "r-405")

        # a client that leaves mid-stream: a line with outcome client_disconnect
        h = {"Authorization": f"Bearer {SECRET}", "x-request-id": "r-gone"}
        async with s.post(
            gw_url + "/v1/chat/completions", json={**body("slow"), "stream": True}, headers=h
        ) as r:
            assert r.headers["x-request-id"] == "r-gone"
            await r.content.readany()
            r.close()

        await until(lambda: line_of(access_file, "r-gone") is not None, timeout=10)
        by_id = {x["request_id"]: x for x in lines(access_file)}
        assert by_id["r-401"]["status"] == 401
        assert by_id["r-401"]["outcome"] == "rejected"
        assert by_id["r-401"]["tenant"] is None
        assert by_id["r-404"]["status"] == 404
        assert by_id["r-404"]["tenant"] == "alice"
        assert by_id["r-404"]["reason"] == "model_not_found"
        refused = by_id["r-429"]
        assert refused["status"] == 429
        assert refused["outcome"] == "rejected"
        assert refused["tenant"] == "tiny"
        assert refused["backend"] == "b0"
        assert refused["reason"]
        assert refused["reserved_tokens"] > 500
        assert refused["bytes_sent"] > 0
        assert by_id["r-500"]["status"] == 500
        assert by_id["r-500"]["outcome"] == "upstream_error"
        gone = by_id["r-gone"]
        assert gone["outcome"] == "client_disconnect"
        assert gone["bytes_sent"] > 0
        assert by_id["r-url"]["route"] == "/v1/unknown"
        assert by_id["r-url"]["reason"] == "unknown_url"
        assert by_id["r-405"]["status"] == 405
        assert by_id["r-405"]["method"] == "GET"
        assert len(by_id) == 7 == len(lines(access_file))
        text_log = log_text(access_file)
        assert SECRET not in text_log
        assert WORD not in text_log
        await until(lambda: gateway.controller.backend_state(0)["in_use"] == 0, timeout=10)


async def test_disabled_access_log_writes_nothing(
    engine: tuple[str, list[dict[str, str]]], access_file: Path
) -> None:
    url, _seen = engine
    configure_access_log(False)
    gateway = build_gateway(config(url), poll=False)
    async with run_gateway(gateway) as gw_url:
        client = openai.AsyncOpenAI(base_url=gw_url + "/v1", api_key=SECRET, max_retries=0)
        raw = await client.chat.completions.with_raw_response.create(
            model="ok", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        assert raw.headers.get("x-request-id")
        await client.close()
    assert log_text(access_file) == ""


class _Named:
    name = "n"


class _Req:
    method = "POST"
    writer = None


def _emit(rid: str = "0" * 32) -> None:
    who = _Named()
    log_access(
        _Req(), rid, 0.0, 0.5, route="/v1/chat/completions", status=200, outcome="ok",
        tenant=who, backend=who, model=who, reserved=100, prompt=10, completion=5,
        queue_wait=0.001, ttft=0.1,
    )  # fmt: skip


def test_access_log_cost_per_request(access_file: Path) -> None:
    """The cost of a line, enabled (to a file, buffered as in a server: on a running event
    loop) and disabled; printed for the report. Every line reaches the file whole."""
    n = 2000

    async def timed() -> float:
        return min(timeit.repeat(_emit, number=n, repeat=3)) / n

    on = asyncio.run(timed())
    flush_access_log()
    written = lines(access_file)
    assert len(written) == 3 * n
    assert all(x["request_id"] == "0" * 32 and x["status"] == 200 for x in written)
    configure_access_log(False)
    off = min(timeit.repeat(_emit, number=n, repeat=3)) / n
    # the figures, in the report of a failure or with `pytest -s`
    print(f"\naccess log line: {on * 1e6:.1f} us enabled (file), {off * 1e6:.2f} us disabled")
    assert off < on
    assert on < 200e-6  # generous: a loaded 2-core machine


async def test_lines_wait_in_the_buffer_until_it_fills_or_the_flush_period_ends(
    access_file: Path,
) -> None:
    started = time.monotonic()
    _emit("first")
    assert log_text(access_file) == ""  # on a running loop: buffered, not yet written
    await until(lambda: line_of(access_file, "first") is not None, timeout=FLUSH_SECONDS + 10)
    assert time.monotonic() - started >= FLUSH_SECONDS * 0.9
    # a full buffer is written at once, without waiting for the period
    size = _size(access_file)
    for i in range(FLUSH_BYTES // 300 + 1):
        _emit(f"many-{i}")
    assert _size(access_file) - size >= FLUSH_BYTES
    flush_access_log()
    assert len(lines(access_file)) == 1 + FLUSH_BYTES // 300 + 1


def test_lines_go_out_in_whole_lines_of_at_most_pipe_buf_bytes(
    access_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers share stderr: a write of at most PIPE_BUF bytes to a pipe is never interleaved
    with another process's, so every write holds whole lines and at most that many bytes (a
    longer line goes alone, whole)."""
    writes: list[bytes] = []
    real = os.write

    def recording(fd: int, data: Any) -> int:
        writes.append(bytes(data))
        return real(fd, data)

    monkeypatch.setattr(accesslog.os, "write", recording)

    async def many() -> None:
        for i in range(200):
            _emit(f"id-{i}")
        _emit("x" * 128)  # the longest id kept
        flush_access_log()

    asyncio.run(many())
    assert len(writes) > 1
    assert all(w.endswith(b"\n") and len(w) <= select.PIPE_BUF for w in writes)
    assert b"".join(writes) == access_file.read_bytes()
    assert len(lines(access_file)) == 201


def test_a_timer_left_on_an_ended_loop_does_not_stop_the_periodic_flush(
    access_file: Path,
) -> None:
    """A line logged as a loop ends leaves its flush timer behind; the next loop's lines must
    still go out within the period, not wait for a full buffer."""

    async def log_one(rid: str) -> None:
        _emit(rid)

    async def log_and_wait(rid: str) -> bool:
        _emit(rid)
        deadline = time.monotonic() + FLUSH_SECONDS + 10
        while time.monotonic() < deadline:
            if line_of(access_file, rid) is not None:
                return True
            await asyncio.sleep(0.05)
        return False

    asyncio.run(log_one("first-loop"))
    assert asyncio.run(log_and_wait("second-loop"))


def test_lines_logged_from_many_threads_all_arrive_whole(access_file: Path) -> None:
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can
    errors: list[BaseException] = []

    def many(t: int) -> None:
        try:
            for i in range(1500):
                _emit(f"t{t}-{i}")
        except BaseException as exc:  # what a thread raised is the finding
            errors.append(exc)

    try:
        threads = [threading.Thread(target=many, args=(t,)) for t in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(switch)
    flush_access_log()
    assert errors == []
    assert len(lines(access_file)) == 6 * 1500


def test_no_stderr_means_no_access_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvgate serve 2>&-``: Python has no ``sys.stderr``; the log is off instead of raising
    on every line."""
    monkeypatch.setattr(sys, "stderr", None)
    configure_access_log(True)
    try:
        _emit("nowhere")  # nothing raised
        assert accesslog._ACCESS is None
    finally:
        configure_access_log(False)


def test_the_time_stamp_made_once_a_second_is_datetimes() -> None:
    from kvgate.accesslog import _stamp, _time

    now = time.time()
    for t in (now, now + 0.9995, now + 0.9999996, 0.0, 1.5, -0.5, -1e-06, 4e9 + 0.25):
        assert _stamp(t) == _time(t), t


def test_a_write_that_fails_loses_its_lines_with_one_warning(
    access_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    configure_access_log(True, "/dev/full")  # every write fails: ENOSPC
    with caplog.at_level(logging.WARNING, logger="kvgate.serve"):
        _emit("lost-1")
        _emit("lost-2")
    warned = [r for r in caplog.records if "access log lines lost" in r.getMessage()]
    assert len(warned) == 1


def test_json_formatter_plain_record() -> None:
    rec = logging.LogRecord("kvgate.serve", logging.WARNING, __file__, 1, "a %s", ("b",), None)
    out = json.loads(JsonFormatter().format(rec))
    assert out["level"] == "WARNING"
    assert out["logger"] == "kvgate.serve"
    assert out["message"] == "a b"
    assert out["time"].endswith("+00:00")


async def test_serve_logs_json_and_access_lines_to_stderr(
    engine: tuple[str, list[dict[str, str]]],
) -> None:
    """``kvgate serve --log-format json``: every stderr line is one JSON object; the access log
    is on by default, to stderr."""
    url, _seen = engine
    port = free_port()
    proc = await start_kvgate(
        "serve", "--upstream", url, "--port", str(port), "--log-format", "json"
    )
    gw = f"http://127.0.0.1:{port}"
    try:
        await wait_http_up(gw + "/healthz")
        client = openai.AsyncOpenAI(base_url=gw + "/v1", api_key=SECRET, max_retries=0)
        raw = await client.chat.completions.with_raw_response.create(
            model="ok",
            messages=[{"role": "user", "content": WORD}],
            max_tokens=8,
            extra_headers={"x-request-id": "cli-1"},
        )
        assert raw.headers.get("x-request-id") == "cli-1"
        await client.close()
        # without --config, SIGHUP is logged (a warning) and ignored: a line of the other logs
        proc.send_signal(signal.SIGHUP)
        await until(lambda: b"SIGHUP" in stderr_so_far(proc), timeout=20)
    finally:
        err = (await stop_process(proc)).decode()
    records = [json.loads(x) for x in err.splitlines() if x.strip()]
    access = [r for r in records if r.get("request_id") == "cli-1"]
    assert len(access) == 1
    assert access[0]["status"] == 200
    assert access[0]["tenant"] == "anonymous"
    warning = [r for r in records if "SIGHUP" in r.get("message", "")]
    assert len(warning) == 1
    assert warning[0]["level"] == "WARNING"
    assert warning[0]["logger"] == "kvgate.serve"
    assert SECRET not in err
    assert WORD not in err


def test_access_log_config_is_validated(tmp_path: Path) -> None:
    base = {
        "backends": [
            {
                "name": "b0",
                "url": "http://127.0.0.1:9",
                "models": [{"name": "m", "context_window": 1024}],
                "max_concurrency": 1,
            },
        ]
    }
    with pytest.raises(ConfigError, match=r"access_log\.path: .*directory not found"):
        parse_config({**base, "access_log": {"path": "nowhere/a.log"}}, base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"access_log\.path: .*is a directory"):
        parse_config({**base, "access_log": {"path": str(tmp_path)}}, base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"access_log\.enabled"):
        parse_config({**base, "access_log": {"enabled": "sometimes"}}, base_dir=tmp_path)
    (tmp_path / "logs").mkdir()
    cfg = parse_config({**base, "access_log": {"path": "logs/a.log"}}, base_dir=tmp_path)
    assert cfg.access_log.path == str(tmp_path / "logs" / "a.log")
    assert cfg.access_log.enabled
    assert parse_config(base).access_log.path is None


async def test_forwarded_route_has_an_id_trace_context_and_a_line(
    engine: tuple[str, list[dict[str, str]]], access_file: Path
) -> None:
    url, seen = engine
    gateway = build_gateway(config(url, other_routes="forward"), poll=False)
    async with run_gateway(gateway) as gw_url, aiohttp.ClientSession() as s:
        h = {"Authorization": f"Bearer {SECRET}", "traceparent": TRACEPARENT}
        async with s.post(gw_url + "/v1/rerank", json={"query": WORD}, headers=h) as r:
            assert r.status == 200
            rid = r.headers.getall("x-request-id")
        assert len(rid) == 1
        assert HEX32.fullmatch(rid[0])
        assert seen[-1]["x-request-id"] == rid[0]
        assert seen[-1]["traceparent"] == TRACEPARENT
        await until(lambda: line_of(access_file, rid[0]) is not None, timeout=10)
        line = line_of(access_file, rid[0])
        assert line is not None
        assert (line["route"], line["status"], line["outcome"]) == ("/v1/rerank", 200, "ok")
        assert (line["tenant"], line["backend"], line["prompt_tokens"]) == ("alice", "b0", 5)
        assert WORD not in log_text(access_file)
        assert SECRET not in log_text(access_file)


async def test_serve_no_access_log_flag(engine: tuple[str, list[dict[str, str]]]) -> None:
    """``kvgate serve --no-access-log``: the other log lines stay, no access line."""
    url, seen = engine
    port = free_port()
    proc = await start_kvgate("serve", "--upstream", url, "--port", str(port), "--no-access-log")
    gw = f"http://127.0.0.1:{port}"
    try:
        await wait_http_up(gw + "/healthz")
        async with aiohttp.ClientSession() as s:
            body = {"model": "ok", "messages": [{"role": "user", "content": "hi"}]}
            h = {"x-request-id": "quiet-1"}
            async with s.post(gw + "/v1/chat/completions", json=body, headers=h) as r:
                assert r.status == 200
        assert seen[-1]["x-request-id"] == "quiet-1"
        proc.send_signal(signal.SIGHUP)
        await until(lambda: b"SIGHUP" in stderr_so_far(proc), timeout=20)
    finally:
        err = (await stop_process(proc)).decode()
    assert "quiet-1" not in err


async def test_a_client_that_leaves_while_queued_has_a_line_and_a_count(
    engine: tuple[str, list[dict[str, str]]], access_file: Path
) -> None:
    """A request waiting for a slot (``max_wait_ms``) whose client hangs up: one access log
    line (outcome ``client_disconnect``, reason ``left_while_waiting``, status 0, the time it
    waited) and ``kvgate_requests_total{outcome="client_disconnect"}`` — before, such a client
    left no trace, so a client flooding the queue and hanging up was invisible."""
    url, _seen = engine
    data = config(url).model_dump()
    data["tenants"][0].update(max_concurrency=1, max_wait_ms=20_000)
    gateway = build_gateway(Config.model_validate(data), poll=False)
    h = {"Authorization": f"Bearer {SECRET}"}
    msgs = [{"role": "user", "content": "hold"}]
    async with run_gateway(gateway) as gw_url, aiohttp.ClientSession() as s:

        async def gone_count() -> float:
            async with s.get(gw_url + "/metrics") as r:
                text = await r.text()
            return metric(text, "kvgate_requests_total", outcome="client_disconnect") or 0.0

        async with s.post(
            gw_url + "/v1/chat/completions",
            json={"model": "slow", "messages": msgs, "max_tokens": 8, "stream": True},
            headers={**h, "x-request-id": "holder"},
        ) as holder:
            await holder.content.readany()  # alice's one slot is held
            waiters = [
                asyncio.create_task(
                    s.post(
                        gw_url + "/v1/chat/completions",
                        json={"model": "ok", "messages": msgs, "max_tokens": 8},
                        headers={**h, "x-request-id": f"waiter-{i}"},
                    )
                )
                for i in range(3)
            ]
            await until(lambda: gateway.queue is not None and gateway.queue.depth() == 3)
            for task in waiters:
                task.cancel()
            await until(lambda: gateway.queue.depth() == 0)
            await until(lambda: all(line_of(access_file, f"waiter-{i}") for i in range(3)))
            holder.close()
        for i in range(3):
            line = line_of(access_file, f"waiter-{i}")
            assert line is not None
            assert (line["outcome"], line["reason"], line["status"]) == (
                "client_disconnect",
                "left_while_waiting",
                0,
            )
            assert line["tenant"] == "alice"
            assert line["queue_wait_s"] > 0
            assert line["reserved_tokens"] > 0
        gateway.metrics.flush()

        async def counted() -> bool:
            return await gone_count() >= 3

        await until(counted, timeout=10)
        await until(lambda: gateway.controller.backend_state(0)["in_use"] == 0, timeout=10)
