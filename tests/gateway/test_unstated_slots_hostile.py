"""Backends without ``max_concurrency`` in front of engines that misbehave when ``kvgate serve
--config`` asks them for their batch limit: engines that accept the connection and never
answer, drip their answer byte by byte, redirect elsewhere, or send a body too large to hold.
The start stays short however many such engines there are, and their slot limit is the default
(64)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from kvgate.cli_serve import DISCOVERY_SECONDS, discover_unset_slots
from kvgate.config import parse_config
from kvgate.gateway_build import build_gateway
from kvgate.server import run_gateway
from kvgate.telemetry.discovery import MAX_BODY_BYTES, DiscoveryError, discover_engine

from .helpers import until
from .test_unstated_slots import (
    KEY,
    admin_state,
    backend,
    by_name,
    chat_once,
    engine,
    llamacpp,
    serving,
    tenant,
)

MODELS = {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "llamacpp"}]}


@contextlib.asynccontextmanager
async def hung_engine() -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP server that accepts every connection and never answers; its URL and the count of
    connections it accepted."""
    accepted = [0]
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0, backlog=512)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()


async def test_many_hung_engines_delay_the_start_by_the_deadline_only() -> None:
    """100 backends whose engine accepts the connection and never answers: each request gives
    up after 2 s, and all of them together after ``DISCOVERY_SECONDS`` (asked 8 at a time
    they took 2 s per 8 backends, 26 s here)."""
    async with hung_engine() as (url, accepted):
        cfg = parse_config(
            {
                "backends": [backend(f"b{i}", url) for i in range(100)],
                "tenants": [tenant()],
            }
        )
        started = time.monotonic()
        found = await asyncio.to_thread(discover_unset_slots, cfg)
        took = time.monotonic() - started
    assert found == {}
    assert accepted[0] >= 32  # they were asked
    assert took < DISCOVERY_SECONDS + 5, took


async def test_an_answer_dripping_forever_is_dropped_at_the_deadline() -> None:
    """``/v1/models`` answers its headers, then one byte every 0.2 s without end: each read
    returns before the 2 s timeout, so only the deadline ends it (it never ended before)."""

    async def drip(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):
            await resp.write(b'{"object": "list", "data": [')
            while True:
                await resp.write(b" ")
                await asyncio.sleep(0.2)
        return resp

    async with engine({"/v1/models": drip}) as url:
        started = time.monotonic()
        with pytest.raises(DiscoveryError, match="deadline"):
            await asyncio.to_thread(
                discover_engine, url, timeout=2.0, deadline=time.monotonic() + 1.5
            )
        assert time.monotonic() - started < 10


async def test_a_redirect_is_not_followed_with_the_key() -> None:
    """An engine whose ``/v1/models`` redirects to another host: the backend's engine key is
    not sent there (urllib's redirect kept the ``Authorization`` header); the engine cannot be
    asked."""
    seen: list[str | None] = []

    async def elsewhere(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response(MODELS)

    async with engine({"/{tail:.*}": elsewhere}) as other:

        async def moved(request: web.Request) -> web.Response:
            raise web.HTTPFound(other + request.path)

        async with engine({"/{tail:.*}": moved}) as url:
            with pytest.raises(DiscoveryError, match="302"):
                await asyncio.to_thread(discover_engine, url, timeout=2.0, api_key="sk-engine")
    assert seen == []


async def test_a_body_too_large_is_no_answer() -> None:
    """``/props`` stating 5 slots inside a body over ``MAX_BODY_BYTES`` (a chat template of
    that size): not read past the cap, so no slot count is taken from it."""
    huge = b'{"total_slots": 5, "chat_template": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}'

    async def models(request: web.Request) -> web.Response:
        return web.json_response(MODELS)

    async def props(request: web.Request) -> web.Response:
        return web.Response(body=huge, content_type="application/json")

    async with engine({"/v1/models": models, "/props": props}) as url:
        info = await asyncio.to_thread(discover_engine, url, timeout=5.0)
    assert info.slots is None
    assert info.chat_template is None


async def test_serve_starts_soon_in_front_of_hung_engines(tmp_path: Path) -> None:
    """``kvgate serve --config`` with 80 backends whose engines never answer: up and serving
    within the discovery deadline (plus the process start), every slot limit 64."""
    async with hung_engine() as (url, _):
        data = {
            "backends": [backend(f"b{i}", url) for i in range(80)],
            "tenants": [tenant()],
        }
        started = time.monotonic()
        async with serving(tmp_path, data) as (gw, _):
            took = time.monotonic() - started
            backends = by_name(await admin_state(gw))
    assert {b["max_concurrency"] for b in backends.values()} == {64}
    assert took < DISCOVERY_SECONDS + 10, took


# ---- a slot count that changes wildly between polls ------------------------------------------


async def test_waiters_get_the_slots_a_poll_adds() -> None:
    """The engine states 1 slot, one request holds it and two wait in the queue; the engine
    then states 10: the waiters are admitted at that poll, not when the first request ends
    (nothing woke the queue when a poll raised the limit). 0 slots is no statement (the limit
    stays); 10,000 and then 1 are followed; all finish and nothing stays held."""
    slots = [1]
    release = asyncio.Event()
    async with llamacpp(slots, release) as url:
        adaptive = {"enabled": True, "poll_interval": 0.05, "stale_after": 2.0}
        cfg = parse_config(
            {
                "backends": [backend("own", url, engine="llamacpp", adaptive=adaptive)],
                "tenants": [tenant()],
            }
        )
        discovery = await asyncio.to_thread(discover_unset_slots, cfg)
        gateway = build_gateway(cfg, poll=True, discovery=discovery)
        ctl = gateway.controller
        bid = ctl.backend_id("own")

        def state(field: str) -> int:
            return int(ctl.backend_state(bid)[field])

        assert state("max_concurrency") == 1
        async with run_gateway(gateway) as gw:
            client = openai.AsyncOpenAI(base_url=gw + "/v1", api_key=KEY, max_retries=0)

            async def one(i: int) -> str:
                return await chat_once(client, i, 10)

            try:
                first = asyncio.create_task(one(0))
                await until(lambda: state("in_use") == 1, timeout=10)
                others = [asyncio.create_task(one(i)) for i in (1, 2)]
                assert gateway.queue is not None
                await until(lambda: len(gateway.queue) == 2, timeout=10)
                slots[0] = 0  # no statement: the limit stays
                await asyncio.sleep(0)  # (the wait below also covers polls of the 0)
                slots[0] = 10
                await until(lambda: state("max_concurrency") == 10, timeout=10)
                await until(lambda: state("in_use") == 3, timeout=5)
                assert len(gateway.queue) == 0
                slots[0] = 10_000
                await until(lambda: state("max_concurrency") == 10_000, timeout=10)
                slots[0] = 1
                await until(lambda: state("max_concurrency") == 1, timeout=10)
                late = asyncio.create_task(one(3))  # over the limit of 1 now: it waits
                await until(lambda: len(gateway.queue) == 1, timeout=10)
                assert state("in_use") == 3
                release.set()
                assert await asyncio.gather(first, *others, late) == ["stop"] * 4
                await until(lambda: state("in_use") == 0, timeout=10)
            finally:
                release.set()
                await client.close()


async def test_waiters_get_the_kv_capacity_a_poll_adds() -> None:
    """The engine's 10 slots of 10 tokens (KV capacity 100, in-flight budget 90) hold one
    request of 10 + 40 tokens; a second waits for the budget. The slots grow to 1000 tokens
    each: the waiter is admitted at that poll, not when the first request ends."""
    slots, n_ctx = [10], [10]
    release = asyncio.Event()
    async with llamacpp(slots, release, n_ctx=n_ctx) as url:
        adaptive = {"enabled": True, "poll_interval": 0.05, "stale_after": 2.0}
        cfg = parse_config(
            {
                "backends": [backend("own", url, engine="llamacpp", adaptive=adaptive)],
                "tenants": [tenant()],
            }
        )
        discovery = await asyncio.to_thread(discover_unset_slots, cfg)
        assert discovery["own"].kv_capacity_tokens == 100
        gateway = build_gateway(cfg, poll=True, discovery=discovery)
        ctl = gateway.controller
        bid = ctl.backend_id("own")

        def state(field: str) -> int:
            return int(ctl.backend_state(bid)[field])

        async with run_gateway(gateway) as gw:
            client = openai.AsyncOpenAI(base_url=gw + "/v1", api_key=KEY, max_retries=0)

            async def one(i: int) -> str:
                return await chat_once(client, i, 40)

            try:
                tasks = [asyncio.create_task(one(0))]
                await until(lambda: state("in_use") == 1, timeout=10)
                tasks.append(asyncio.create_task(one(1)))
                assert gateway.queue is not None
                await until(lambda: len(gateway.queue) == 1, timeout=10)
                n_ctx[0] = 1000
                await until(lambda: state("inflight_token_limit") == 9000, timeout=10)
                await until(lambda: state("in_use") == 2, timeout=5)
                release.set()
                assert await asyncio.gather(*tasks) == ["stop"] * 2
                await until(lambda: state("in_use") == 0, timeout=10)
            finally:
                release.set()
                await client.close()


async def test_sighup_flips_between_set_and_unset_with_requests_in_flight(tmp_path: Path) -> None:
    """``kvgate serve --config`` in front of an engine stating 2 slots, ``max_concurrency``
    left out: 2 requests held at the engine, 2 waiting. A SIGHUP with ``max_concurrency: 4``
    admits the waiters at once; a SIGHUP leaving it out again brings back the engine's 2 with
    4 in flight, so a fifth request waits until the in-flight ones end. The engine never holds
    more requests than the limit in force when they were admitted; nothing stays held."""
    slots = [2]
    release = asyncio.Event()
    at_engine = [0, 0]  # now, most at once

    async with llamacpp(slots, release, at_engine) as url:
        data: dict[str, Any] = {"backends": [backend("own", url)], "tenants": [tenant()]}
        async with serving(tmp_path, data) as (gw, proc):
            path = tmp_path / "kvgate.yaml"
            original = path.read_text()

            async def own(field: str) -> int:
                return int(by_name(await admin_state(gw))["own"][field])

            async def reload(text: str, limit: int) -> None:
                path.write_text(text)
                proc.send_signal(signal.SIGHUP)

                async def applied() -> bool:
                    return await own("max_concurrency") == limit

                await until(applied, timeout=10)

            assert await own("max_concurrency") == 2
            client = openai.AsyncOpenAI(base_url=gw + "/v1", api_key=KEY, max_retries=0)

            async def one(i: int) -> str:
                return await chat_once(client, i, 10)

            tasks: list[asyncio.Task[str]] = []
            try:
                tasks += [asyncio.create_task(one(i)) for i in range(4)]
                await until(lambda: at_engine[0] == 2, timeout=10)
                assert at_engine[1] == 2
                configured = json.loads(original)
                configured["backends"][0]["max_concurrency"] = 4
                await reload(json.dumps(configured), 4)
                await until(lambda: at_engine[0] == 4, timeout=10)
                await reload(original, 2)  # left out again: the engine's 2
                tasks.append(asyncio.create_task(one(4)))

                async def queued() -> bool:
                    state = await admin_state(gw)
                    return sum(int(t["queue_depth"]) for t in state["tenants"]) == 1

                await until(queued, timeout=10)
                assert (at_engine[0], at_engine[1]) == (4, 4)
                release.set()
                assert await asyncio.gather(*tasks) == ["stop"] * 5
                assert at_engine[1] == 4

                async def released() -> bool:
                    return await own("in_use") == 0

                await until(released, timeout=10)
            finally:
                release.set()
                await asyncio.gather(*tasks, return_exceptions=True)
                await client.close()


async def test_the_quick_start_gives_up_on_an_engine_that_never_finishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``kvgate serve --upstream URL --model m`` in front of an engine whose ``/v1/models``
    drips forever: given up at the quick start's deadline (it waited forever), served with
    ``--model`` as given and the default slot limit."""
    import argparse

    from kvgate import cli_serve

    async def drip(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):
            while True:
                await resp.write(b" ")
                await asyncio.sleep(0.2)
        return resp

    monkeypatch.setattr(cli_serve, "QUICK_DISCOVERY_SECONDS", 1.0)
    parser = argparse.ArgumentParser()
    cli_serve.add_arguments(parser)
    async with engine({"/{tail:.*}": drip}) as url:
        args = parser.parse_args(["--upstream", url, "--model", "m"])
        config, found = await asyncio.wait_for(
            asyncio.to_thread(cli_serve._config_from_flags, args), timeout=30
        )
    assert [m.name for m in config.backends[0].models] == ["m"]
    assert config.backends[0].max_concurrency == 64
    assert found["default"].slots is None
