"""A backend without ``max_concurrency``: its slot limit is the engine's own batch limit, asked
when ``kvgate serve --config`` starts (the simulator states its ``max_num_seqs`` as llama.cpp's
``/props`` ``total_slots``), 64 when the engine cannot be asked, never below the guaranteed
slots of its tenants, kept by a reload and followed on later polls (llama.cpp ``/slots``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from kvgate.cli_check import summary
from kvgate.cli_serve import discover_unset_slots
from kvgate.config import DEFAULT_SLOTS, Config, ConfigError, parse_config
from kvgate.gateway_build import apply_config, build_gateway
from kvgate.server import run_gateway
from kvgate.sim import SimConfig
from kvgate.sim.server import run_sim

from .conftest import sha
from .helpers import (
    free_port,
    get_text,
    metric,
    start_kvgate,
    stderr_so_far,
    stop_process,
    until,
    wait_http_up,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "metrics"
SIM = SimConfig.from_profile("tiny", speed=1, seed=5, max_num_seqs=7)
KEY = "sk-unstated"


def backend(name: str, url: str, **kw: Any) -> dict[str, Any]:
    """A backend without ``max_concurrency`` (unless ``kw`` sets one) serving the sim's model."""
    return {
        "name": name,
        "url": url,
        "models": [{"name": SIM.model, "context_window": 1024}],
        "adaptive": {"enabled": False},
        **kw,
    }


def tenant(**kw: Any) -> dict[str, Any]:
    return {"name": "t", "api_key_sha256": [sha(KEY)], "max_wait_ms": 60_000, **kw}


async def admin_state(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/admin/state") as r:
        assert r.status == 200
        data: dict[str, Any] = await r.json()
        return data


def by_name(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {b["name"]: b for b in state["backends"]}


async def chat_once(
    client: openai.AsyncOpenAI, i: int, max_tokens: int, *, ignore_eos: bool = False
) -> str:
    """Chat request ``i`` of the simulator's model through the official client; its finish
    reason."""
    r = await client.chat.completions.create(
        model=SIM.model,
        messages=[{"role": "user", "content": f"request {i}"}],
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True} if ignore_eos else None,
    )
    return str(r.choices[0].finish_reason)


async def burst(url: str, n: int, *, max_tokens: int = 30) -> list[str]:
    """``n`` concurrent chat requests through the official client; their finish reasons."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)

    async def one(i: int) -> str:
        return await chat_once(client, i, max_tokens, ignore_eos=True)

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, data: dict[str, Any]) -> AsyncIterator[tuple[str, Any]]:
    """``kvgate serve --config FILE`` (a child process) for ``data``; its URL and process."""
    port = free_port()
    path = tmp_path / "kvgate.yaml"
    path.write_text(json.dumps({"listen": {"host": "127.0.0.1", "port": port}, **data}))
    proc = await start_kvgate("serve", "--config", str(path))
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_http_up(url + "/healthz")
        yield url, proc
    finally:
        err = await stop_process(proc)
        assert b"Traceback" not in err, err.decode(errors="replace")


# ---- the file's rules ------------------------------------------------------------------------


def test_max_concurrency_may_be_left_out() -> None:
    """Without ``max_concurrency`` any guarantee is accepted (the limit is raised to it at
    start-up); with one, guarantees above it are still refused."""
    data = {
        "backends": [backend("b", "http://127.0.0.1:1")],
        "tenants": [tenant(guaranteed_slots=500)],
    }
    cfg = parse_config(data)
    assert cfg.backends[0].max_concurrency is None
    assert "concurrency the engine's batch limit (else 64)" in summary(cfg)
    data["backends"] = [backend("b", "http://127.0.0.1:1", max_concurrency=8)]
    with pytest.raises(ConfigError, match=r"backends\[0\]\.max_concurrency.*8 is less than"):
        parse_config(data)


def test_the_quick_start_and_files_share_the_default() -> None:
    from kvgate.cli_serve import QUICK_DEFAULTS

    assert QUICK_DEFAULTS["max_concurrency"] == DEFAULT_SLOTS == 64


# ---- kvgate serve --config -------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
async def test_serve_takes_the_engines_batch_limit(tmp_path: Path, workers: int) -> None:
    """The simulator states 7 slots: the backend's slot limit is 7 (with ``--workers 2`` too:
    the master builds the shared core, and the workers' metrics are still summed); a burst of
    12 runs at most 7 at once at the engine (the rest wait in the queue), all finish, nothing
    stays held."""
    async with run_sim(SIM) as sim:
        data = {"backends": [backend("sim", sim.url)], "tenants": [tenant()], "workers": workers}
        async with serving(tmp_path, data) as (url, _):
            b = by_name(await admin_state(url))["sim"]
            assert (b["max_concurrency"], b["discovered"]["slots"]) == (7, 7)
            in_use: list[int] = []
            done = asyncio.Event()

            async def watch() -> None:
                while not done.is_set():
                    in_use.append(by_name(await admin_state(url))["sim"]["in_use"])
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch())
            try:
                reasons = await burst(url, 12)
            finally:
                done.set()
                await watcher
            assert reasons == ["length"] * 12
            # the engine is the judge (its peak is exact, kept at each request's start): never
            # more than its 7 slots at once, and the burst did run in parallel
            async with aiohttp.ClientSession() as s, s.get(sim.url + "/sim/state") as r:
                peak = int((await r.json())["peak_in_flight"])
            assert 1 < peak <= 7, peak
            assert max(in_use) <= 7

            async def released() -> bool:
                return int(by_name(await admin_state(url))["sim"]["in_use"]) == 0

            await until(released, timeout=10)

            async def counted() -> bool:  # every worker's requests, whichever one answers
                text = await get_text(url + "/metrics")
                return metric(text, "kvgate_requests_total", backend="sim") == 12

            await until(counted, timeout=10)


async def test_an_engine_that_cannot_be_asked_gets_64(tmp_path: Path) -> None:
    """An unreachable engine: one warning line, slot limit 64; a backend with a configured
    ``max_concurrency`` is not asked at all."""
    asked: list[str] = []

    async def record(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({"object": "list", "data": []})

    async with engine({"/{tail:.*}": record}) as configured:
        dead = f"http://127.0.0.1:{free_port()}"
        data = {
            "backends": [
                backend("dead", dead, health_url=configured + "/health"),
                backend("set", configured, max_concurrency=3),
            ],
            "tenants": [tenant()],
        }
        async with serving(tmp_path, data) as (url, proc):
            backends = by_name(await admin_state(url))
            assert backends["dead"]["max_concurrency"] == 64
            assert "discovered" not in backends["dead"]
            assert backends["set"]["max_concurrency"] == 3
            err = stderr_so_far(proc).decode()
            lines = [ln for ln in err.splitlines() if "cannot ask the engine" in ln]
            assert len(lines) == 1, err
            assert "backend dead:" in lines[0]
            assert "slot limit 64 until it states one" in lines[0]
            assert not [p for p in asked if p in ("/v1/models", "/props")], asked


# ---- guarantees, reload ----------------------------------------------------------------------


async def test_guaranteed_slots_above_the_engines_limit_win() -> None:
    """Guaranteed slots 10 on an engine stating 7: the slot limit is 10 (all of it guaranteed);
    the tenant runs 10 at once, and gives everything back."""
    async with run_sim(SIM) as sim:
        cfg = parse_config(
            {"backends": [backend("sim", sim.url)], "tenants": [tenant(guaranteed_slots=10)]}
        )
        discovery = await asyncio.to_thread(discover_unset_slots, cfg)
        assert discovery["sim"].slots == 7
        gateway = build_gateway(cfg, poll=False, discovery=discovery)
        ctl = gateway.controller
        st = ctl.backend_state(0)
        assert (st["max_concurrency"], st["guaranteed_slots"], st["burst_pool"]) == (10, 10, 0)
        async with run_gateway(gateway) as url:
            peak = 0
            done = asyncio.Event()

            async def watch() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, int(ctl.backend_state(0)["in_use"]))
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            try:
                assert await burst(url, 14) == ["length"] * 14
            finally:
                done.set()
                await watcher
            assert peak == 10
            await until(lambda: ctl.backend_state(0)["in_use"] == 0, timeout=10)
            assert ctl.tenant_state(ctl.tenant_id("t"))["in_use"] == 0


async def test_a_reload_keeps_the_engines_limit() -> None:
    """A reload keeps an unset limit the engine's (7), raises it to new guarantees and lowers
    it back when they go; a configured limit replaces it (and may drop below the guarantees
    the same reload removes), and leaving it out again returns to the engine's."""
    async with run_sim(SIM) as sim:

        def config(b: dict[str, Any], **t: Any) -> Config:
            return parse_config({"backends": [b], "tenants": [tenant(**t)]})

        cfg = config(backend("sim", sim.url))
        discovery = await asyncio.to_thread(discover_unset_slots, cfg)
        gateway = build_gateway(cfg, poll=False, discovery=discovery)
        ctl = gateway.controller

        def slots() -> int:
            return int(ctl.backend_state(0)["max_concurrency"])

        assert slots() == 7
        apply_config(gateway, config(backend("sim", sim.url), tokens_per_minute=50_000))
        assert slots() == 7
        apply_config(gateway, config(backend("sim", sim.url), guaranteed_slots=10))
        assert (slots(), ctl.backend_state(0)["guaranteed_slots"]) == (10, 10)
        apply_config(gateway, config(backend("sim", sim.url)))  # the guarantee goes: back to 7
        assert (slots(), ctl.backend_state(0)["guaranteed_slots"]) == (7, 0)
        apply_config(gateway, config(backend("sim", sim.url, max_concurrency=5)))
        assert slots() == 5
        assert "sim" not in gateway.engine_slots  # polls leave a configured limit alone
        # a configured limit lowered with the guarantees that held it up, in one reload
        apply_config(
            gateway, config(backend("sim", sim.url, max_concurrency=10), guaranteed_slots=10)
        )
        apply_config(gateway, config(backend("sim", sim.url, max_concurrency=4)))
        assert (slots(), ctl.backend_state(0)["guaranteed_slots"]) == (4, 0)
        apply_config(gateway, config(backend("sim", sim.url)))
        assert slots() == 7
        async with run_gateway(gateway) as url:
            assert await burst(url, 3) == ["length"] * 3
        assert ctl.backend_state(0)["in_use"] == 0


# ---- later polls (llama.cpp /slots) ----------------------------------------------------------


@contextlib.asynccontextmanager
async def engine(routes: dict[str, Any]) -> AsyncIterator[str]:
    """An aiohttp stand-in: path → handler."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_route("*", path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def llamacpp(
    slots: list[int],
    release: asyncio.Event | None = None,
    at_engine: list[int] | None = None,
    n_ctx: list[int] | None = None,
) -> AsyncIterator[str]:
    """A llama-server stand-in stating ``slots[0]`` slots (``/props``, ``/slots``; the test
    changes it) of ``n_ctx[0]`` tokens each (default 1024), with llama.cpp's metrics (no KV
    gauge, so polls read ``/slots``); each chat completion is answered at once, or once
    ``release`` is set when given. ``at_engine``: chat requests at the engine now, and the most
    at once."""
    count = at_engine if at_engine is not None else [0, 0]
    context = n_ctx if n_ctx is not None else [1024]
    prom = (FIXTURES / "llamacpp-mainline-no-kv-metrics.prom").read_text()

    async def models(request: web.Request) -> web.Response:
        data = [{"id": SIM.model, "object": "model", "owned_by": "llamacpp"}]
        return web.json_response({"object": "list", "data": data})

    async def props(request: web.Request) -> web.Response:
        return web.json_response({"total_slots": slots[0]})

    async def slot_list(request: web.Request) -> web.Response:
        entries = [{"id": i, "n_ctx": context[0], "is_processing": False} for i in range(slots[0])]
        return web.json_response(entries)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=prom)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        count[0] += 1
        count[1] = max(count[1], count[0])
        try:
            if release is not None:
                await release.wait()
        finally:
            count[0] -= 1
        return web.json_response(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": SIM.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
            }
        )

    async with engine(
        {
            "/v1/models": models,
            "/props": props,
            "/slots": slot_list,
            "/metrics": metrics,
            "/health": health,
            "/v1/chat/completions": chat,
        }
    ) as url:
        yield url


async def test_polls_follow_the_engines_slots_above_the_guarantees() -> None:
    """The engine restarts with 3 slots, then 12: the limit follows (never below the tenant's
    5 guaranteed slots); a configured backend on the same engine keeps its own."""
    slots = [8]
    async with llamacpp(slots) as engine:
        adaptive = {"enabled": True, "poll_interval": 0.05, "stale_after": 2.0}
        cfg = parse_config(
            {
                "backends": [
                    backend("own", engine, engine="llamacpp", adaptive=adaptive),
                    backend("set", engine, engine="llamacpp", adaptive=adaptive, max_concurrency=6),
                ],
                "tenants": [tenant(guaranteed_slots=5, backends=["own"])],
            }
        )
        discovery = await asyncio.to_thread(discover_unset_slots, cfg)
        assert set(discovery) == {"own"}
        gateway = build_gateway(cfg, poll=True, discovery=discovery)
        ctl = gateway.controller
        own, configured = ctl.backend_id("own"), ctl.backend_id("set")

        def limit(bid: int) -> int:
            return int(ctl.backend_state(bid)["max_concurrency"])

        assert (limit(own), limit(configured)) == (8, 6)
        async with run_gateway(gateway):
            slots[0] = 3
            await until(lambda: gateway.engine_slots.get("own") == 3, timeout=10)
            assert limit(own) == 5  # the guarantee, not the engine's 3
            slots[0] = 12
            await until(lambda: limit(own) == 12, timeout=10)
            assert limit(configured) == 6


async def test_an_engine_with_an_api_key_is_asked_with_the_backends_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine started with an API key refuses every question without it: start-up asks
    with the backend's key (``api_key_env``) and takes the 5 slots it states, no warning."""

    async def guarded(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer engine-key":
            return web.json_response({"error": {"message": "Invalid API Key"}}, status=401)
        if request.path == "/v1/models":
            data = [{"id": SIM.model, "object": "model", "owned_by": "llamacpp"}]
            return web.json_response({"object": "list", "data": data})
        if request.path == "/props":
            return web.json_response({"total_slots": 5})
        return web.json_response({"error": {"message": "not found"}}, status=404)

    monkeypatch.setenv("KVGATE_TEST_ENGINE_KEY", "engine-key")
    async with engine({"/{tail:.*}": guarded}) as url_engine:
        data = {
            "backends": [backend("keyed", url_engine, api_key_env="KVGATE_TEST_ENGINE_KEY")],
            "tenants": [tenant()],
        }
        async with serving(tmp_path, data) as (url, proc):
            assert by_name(await admin_state(url))["keyed"]["max_concurrency"] == 5
            assert b"cannot ask the engine" not in stderr_so_far(proc)
