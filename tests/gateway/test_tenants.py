"""Tenants end to end: tenants and keys, priority classes and shedding, the priority wait queue,
shadow mode, /admin/state and hot reload (in process and by a real SIGHUP)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import types
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp
import orjson
import pytest

from kvgate.admission import retry_hint
from kvgate.config import Config, load_config
from kvgate.gateway_build import build_gateway
from kvgate.server import run_gateway
from kvgate.sim import SimConfig, run_sim

from .conftest import sha
from .fake_upstream import run_upstream
from .helpers import (
    bearer,
    chat,
    free_port,
    get_text,
    metric,
    start_kvgate,
    stop_process,
    until,
    wait_http_up,
)

ADMIN_KEY = "sk-admin-0123456789"


def config_data(
    url: str,
    models: list[str],
    *,
    max_concurrency: int = 8,
    tenants: list[dict[str, Any]] | None = None,
    adaptive: dict[str, Any] | None = None,
    inflight: int | None = None,
    **top: Any,
) -> dict[str, Any]:
    """A one-backend configuration document (the shape of the YAML file)."""
    backend: dict[str, Any] = {
        "name": "b0",
        "url": url,
        "models": [{"name": m, "context_window": 1024} for m in models],
        "max_concurrency": max_concurrency,
        "tokens_per_minute": 1_000_000,
        "adaptive": adaptive or {"enabled": False},
        "stream_upstream": False,  # the engine's own non-streamed answers
    }
    if inflight is not None:
        backend["inflight_token_limit"] = inflight
    data: dict[str, Any] = {"backends": [backend], **top}
    if tenants is not None:
        data["tenants"] = tenants
    return data


def tenant(name: str, key: str, priority: str = "standard", **kw: Any) -> dict[str, Any]:
    return {"name": name, "api_key_sha256": [sha(key)], "priority": priority, **kw}


async def post(
    s: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str | None, **headers: str
) -> tuple[int, str | None, bytes]:
    h = dict(headers)
    if key is not None:
        h.update(bearer(key))
    async with s.post(url + "/v1/chat/completions", json=body, headers=h) as r:
        return r.status, r.headers.get("x-kvgate-reject-reason"), await r.read()


# ---- two tenants on one simulated engine --------------------------------------------------


async def test_critical_chat_keeps_its_guarantee_while_sheddable_flood_is_shed() -> None:
    sim_cfg = SimConfig.from_profile("tiny", speed=10, seed=1)
    model = sim_cfg.model
    async with run_sim(sim_cfg) as sim:
        data = config_data(
            sim.url,
            [model],
            max_concurrency=8,
            inflight=100_000,  # no in-flight budget from discovery: let KV usage climb
            adaptive={
                "enabled": True,
                "poll_interval": 0.05,
                "stale_after": 2.0,
                "recovery_per_second": 0.5,
            },
            tenants=[
                tenant("chat", "sk-chat", "critical", guaranteed_slots=2, max_wait_ms=3000),
                tenant("batch", "sk-batch", "sheddable"),
            ],
        )
        gateway = build_gateway(Config.model_validate(data), poll=True)
        async with run_gateway(gateway) as url, aiohttp.ClientSession() as s:
            long_doc = " ".join(f"paragraph{i}" for i in range(100))  # ~300 prompt tokens
            batch: list[tuple[int, str | None]] = []
            chats: list[tuple[int, float]] = []
            stop = asyncio.Event()

            async def flood() -> None:
                while not stop.is_set():
                    body = chat(model, long_doc, max_tokens=300, ignore_eos=True)
                    status, reason, _ = await post(s, url, body, "sk-batch")
                    batch.append((status, reason))
                    if status != 200:
                        await asyncio.sleep(0.02)

            async def online() -> None:
                for i in range(12):
                    started = time.monotonic()
                    status, _, _ = await post(s, url, chat(model, f"hello {i}", 8), "sk-chat")
                    chats.append((status, time.monotonic() - started))
                    await asyncio.sleep(0.05)

            flooders = [asyncio.create_task(flood()) for _ in range(6)]
            try:
                await until(lambda: sim.engine.kv_cache_usage >= 0.85, timeout=15)
                await online()
                await until(lambda: any(r == "shed" for _, r in batch), timeout=15)
            finally:
                stop.set()
                for t in flooders:
                    t.cancel()
                await asyncio.gather(*flooders, return_exceptions=True)
            # the critical tenant: every request admitted, and what it waited in the queue is
            # bounded by its max_wait (histogram of kvgate_queue_wait_seconds)
            assert [st for st, _ in chats] == [200] * 12, chats
            text = await get_text(url + "/metrics")
            waited = metric(text, "kvgate_queue_wait_seconds_count", **{"class": "critical"})
            within = metric(
                text, "kvgate_queue_wait_seconds_bucket", **{"class": "critical", "le": "5.0"}
            )
            assert (waited or 0) == (within or 0)
            # the sheddable tenant was shed with 503 / reason shed once KV usage crossed high
            shed = [st for st, r in batch if r == "shed"]
            assert shed
            assert set(shed) == {503}
            assert metric(text, "kvgate_rejections_total", backend="b0", reason="shed")
            await until(lambda: gateway.controller.backend_state(0)["in_use"] == 0)
            assert gateway.controller.backend_state(0)["inflight_tokens"] == 0


async def test_fairness_between_two_standard_tenants() -> None:
    sim_cfg = SimConfig.from_profile("tiny", speed=10, seed=2)
    model = sim_cfg.model
    async with run_sim(sim_cfg) as sim:
        data = config_data(
            sim.url,
            [model],
            max_concurrency=2,
            tenants=[
                tenant("flood", "sk-flood", max_wait_ms=30_000),
                tenant("quiet", "sk-quiet", max_wait_ms=30_000),
            ],
        )
        gateway = build_gateway(Config.model_validate(data), poll=False)
        async with run_gateway(gateway) as url, aiohttp.ClientSession() as s:
            done: list[str] = []

            async def one(who: str, key: str, i: int) -> int:
                body = chat(model, f"{who} {i}", max_tokens=40, ignore_eos=True)
                status, _, _ = await post(s, url, body, key)
                done.append(who)
                return status

            floods = [asyncio.create_task(one("flood", "sk-flood", i)) for i in range(16)]
            await until(lambda: gateway.queue.tenant_depth("flood") >= 10)
            quiet = [asyncio.create_task(one("quiet", "sk-quiet", i)) for i in range(4)]
            assert await asyncio.gather(*quiet) == [200] * 4
            # the quiet tenant took turns with the flood instead of waiting behind all of it
            flood_left = 16 - done.count("flood")
            assert flood_left >= 4, done
            assert await asyncio.gather(*floods) == [200] * 16
            assert gateway.controller.backend_state(0)["in_use"] == 0


# ---- keys, priority header, secrets -------------------------------------------------------


async def test_keys_priority_header_and_secrets_never_leak(caplog) -> None:
    caplog.set_level(logging.DEBUG)
    secret, batch_key, wrong = "sk-alice-TOPSECRET-1", "sk-batch-TOPSECRET-2", "sk-WRONG-3"
    async with run_upstream() as up:
        data = config_data(
            up.url,
            ["replay"],
            tenants=[tenant("alice", secret, "critical"), tenant("batch", batch_key, "sheddable")],
            admin_key_sha256=sha(ADMIN_KEY),
        )
        gateway = build_gateway(Config.model_validate(data), poll=False)
        async with run_gateway(gateway) as url, aiohttp.ClientSession() as s:
            body = chat("replay")
            for key in (None, wrong, ""):
                status, _, raw = await post(s, url, body, key)
                assert status == 401
                assert json.loads(raw)["error"]["code"] == "invalid_api_key"
            assert (await post(s, url, body, secret))[0] == 200
            gateway.controller.set_shedding(0, True)
            # the sheddable tenant asking for critical is still shed
            assert (await post(s, url, body, batch_key))[:2] == (503, "shed")
            status, reason, _ = await post(
                s, url, body, batch_key, **{"x-kvgate-priority": "critical"}
            )
            assert (status, reason) == (503, "shed")
            # a critical tenant may lower itself (and then is shed); junk values are ignored
            status, reason, _ = await post(
                s, url, body, secret, **{"x-kvgate-priority": "sheddable"}
            )
            assert (status, reason) == (503, "shed")
            for junk in ("bogus", "CRITICAL", "sheddable,critical"):
                status, _, _ = await post(s, url, body, secret, **{"x-kvgate-priority": junk})
                assert status == 200, junk
            gateway.controller.set_shedding(0, False)
            # /admin/state needs the admin key, not a tenant key
            for headers in ({}, bearer(secret), bearer("sk-admin-wrong")):
                async with s.get(url + "/admin/state", headers=headers) as r:
                    assert r.status == 401
            async with s.get(url + "/admin/state", headers=bearer(ADMIN_KEY)) as r:
                assert r.status == 200
                state_raw = await r.read()
            state = orjson.loads(state_raw)
            assert {t["name"] for t in state["tenants"]} == {"alice", "batch"}
            assert all("queue_depth" in t for t in state["tenants"])
            metrics_raw = await get_text(url + "/metrics")
        gateway.reload()  # no config path: a no-op, but must not log a key either
    logged = caplog.text + "".join(str(r.args) for r in caplog.records)
    for key in (secret, batch_key, wrong, ADMIN_KEY):
        assert key not in logged
        assert key not in metrics_raw
        assert key.encode() not in state_raw
    assert 'tenant="alice"' in metrics_raw


# ---- queue: bounded, cancel-safe, client-shortened waits ----------------------------------


async def test_wait_queue_bound_cancel_and_client_max_wait() -> None:
    async with run_upstream() as up:
        data = config_data(
            up.url,
            ["slow", "replay"],
            max_concurrency=1,
            tenants=[tenant("t", "sk-t", max_wait_ms=20_000)],
            queue={"max_size": 2},
        )
        gateway = build_gateway(Config.model_validate(data), poll=False)
        queue = gateway.queue
        async with run_gateway(gateway) as url, aiohttp.ClientSession() as s:
            held = await s.post(
                url + "/v1/chat/completions",
                json=chat("slow", max_tokens=300, stream=True),
                headers=bearer("sk-t"),
            )
            await held.content.readline()
            waiters = [asyncio.create_task(post(s, url, chat("replay"), "sk-t")) for _ in range(2)]
            await until(lambda: queue.depth() == 2)
            # over the bound: 503 queue-full at once
            status, reason, raw = await post(s, url, chat("replay"), "sk-t")
            assert (status, reason) == (503, "queue-full")
            assert json.loads(raw)["error"]["type"] == "server_error"
            # a client that goes away while waiting leaves the queue at once
            waiters[1].cancel()
            await until(lambda: queue.depth() == 1, timeout=1.0)
            # the client's own header shortens its wait (tenant allows 20 s)
            started = time.monotonic()
            status, _, _ = await post(
                s, url, chat("replay"), "sk-t", **{"x-kvgate-max-wait-ms": "100"}
            )
            assert status == 503
            assert time.monotonic() - started < 5.0
            # a longer header never lengthens it past the tenant's max_wait (here: not refused
            # early either; it is admitted once the held stream ends)
            assert queue.depth() == 1
            held.close()
            assert (await waiters[0])[0] == 200
            await until(lambda: gateway.controller.backend_state(0)["in_use"] == 0)
            assert queue.depth() == 0
            text = await get_text(url + "/metrics")
            assert metric(text, "kvgate_rejections_total", reason="queue-full") == 1
            assert metric(text, "kvgate_queue_depth", **{"class": "standard"}) == 0


async def test_a_waiter_refused_by_its_token_bucket_is_admitted_once_the_bucket_refills() -> None:
    """Nothing is released while a tenant's token bucket refills, so the wait queue must look
    again on its own when the refusal's retry hint has passed (it used to wait for some other
    request to end, or for its max_wait, and answer 429)."""
    async with run_upstream() as up:
        data = config_data(
            up.url,
            ["replay"],
            tenants=[
                tenant("t", "sk-t", tokens_per_minute=600, burst_tokens=100, max_wait_ms=8_000)
            ],
        )
        gateway = build_gateway(Config.model_validate(data), poll=False)
        ctl = gateway.controller
        async with run_gateway(gateway) as url, aiohttp.ClientSession() as s:
            # drain the bucket (10 tokens/s refill) with short answers (18 tokens each)
            while ctl.tenant_state(0)["available_tokens"] >= 30:
                assert (await post(s, url, chat("replay"), "sk-t"))[0] == 200
            started = time.monotonic()
            status, reason, _ = await post(s, url, chat("replay", max_tokens=40), "sk-t")
            took = time.monotonic() - started
            assert (status, reason) == (200, None)
            # admitted once about 40 - 30 tokens had refilled (1-4 s), well before max_wait
            assert 0.5 < took < 6.0, took
            text = await get_text(url + "/metrics")
            assert metric(text, "kvgate_rejections_total", reason="tenant-tpm") in (None, 0)


# ---- shadow mode ----------------------------------------------------------------------------


async def test_shadow_tenant_over_quota_is_admitted_and_counted() -> None:
    async with run_upstream() as up:
        data = config_data(
            up.url,
            ["slow", "replay"],
            tenants=[
                tenant("trial", "sk-trial", max_concurrency=1, mode="shadow"),
                tenant("strict", "sk-strict", max_concurrency=1),
            ],
        )
        gateway = build_gateway(Config.model_validate(data), poll=False)
        async with run_gateway(gateway) as url, aiohttp.ClientSession() as s:
            held = []
            for key in ("sk-trial", "sk-strict"):
                r = await s.post(
                    url + "/v1/chat/completions",
                    json=chat("slow", max_tokens=300, stream=True),
                    headers=bearer(key),
                )
                await r.content.readline()
                held.append(r)
            # both over their concurrency cap: shadow admits (and counts), enforce refuses
            assert (await post(s, url, chat("replay"), "sk-trial"))[0] == 200
            assert (await post(s, url, chat("replay"), "sk-strict"))[:2] == (
                429,
                "tenant-concurrency",
            )
            text = await get_text(url + "/metrics")
            assert metric(text, "kvgate_shadow_rejections_total", reason="tenant-concurrency") == 1
            for r in held:
                r.close()
            await until(lambda: gateway.controller.backend_state(0)["in_use"] == 0)


# ---- hot reload -----------------------------------------------------------------------------


async def _stream_to_end(s: aiohttp.ClientSession, url: str, body: dict, key: str, started):
    async with s.post(url + "/v1/chat/completions", json=body, headers=bearer(key)) as r:
        assert r.status == 200
        first = await r.content.readline()
        started.set()
        raw = first + await r.read()
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    assert events[-1] == b"data: [DONE]", events[-3:]
    usage = orjson.loads(events[-2][6:])["usage"]
    assert b'"error"' not in raw
    return usage["completion_tokens"]


async def test_hot_reload_under_load(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.gateway")
    sim_cfg = SimConfig.from_profile("tiny", speed=5, seed=4)
    model = sim_cfg.model
    path = tmp_path / "kvgate.yaml"
    alice = tenant("alice", "sk-alice", tokens_per_minute=100_000)
    async with run_sim(sim_cfg) as sim:
        path.write_text(json.dumps(config_data(sim.url, [model], tenants=[alice])))
        gateway = build_gateway(load_config(path), config_path=str(path), poll=False)
        ctl = gateway.controller
        async with run_gateway(gateway) as url, aiohttp.ClientSession() as s:
            body = chat(model, "a story", max_tokens=150, ignore_eos=True, stream=True)
            body["stream_options"] = {"include_usage": True}
            events = [asyncio.Event() for _ in range(4)]
            streams = [
                asyncio.create_task(_stream_to_end(s, url, body, "sk-alice", ev)) for ev in events
            ]
            for ev in events:
                await asyncio.wait_for(ev.wait(), 10)
            assert ctl.backend_state(0)["in_use"] == 4
            # new limits (below what is in flight) and a new tenant, while the streams run
            carol = tenant("carol", "sk-carol", "critical")
            alice2 = {**alice, "tokens_per_minute": 50_000}
            new = config_data(sim.url, [model], max_concurrency=2, tenants=[alice2, carol])
            path.write_text(json.dumps(new))
            assert gateway.reload() is True
            st = ctl.backend_state(0)
            assert (st["max_concurrency"], st["in_use"]) == (2, 4)  # held slots untouched
            assert ctl.tenant_state(ctl.tenant_id("alice"))["tokens_per_minute"] == 50_000
            # the new limit applies at once; the new tenant's key is known (503, not 401)
            assert (await post(s, url, chat(model), "sk-alice"))[:2] == (503, "backend-slots")
            assert (await post(s, url, chat(model), "sk-carol"))[:2] == (503, "backend-slots")
            # an invalid file is refused; the running configuration stays
            path.write_text(
                json.dumps(
                    config_data(
                        sim.url, [model], max_concurrency=5, tenants=[{**carol, "priority": "vip"}]
                    )
                )
            )
            assert gateway.reload() is False
            assert ctl.backend_state(0)["max_concurrency"] == 2
            assert "reload" in caplog.text
            assert "refused" in caplog.text
            # no stream was cut
            assert await asyncio.gather(*streams) == [150] * 4
            await until(lambda: ctl.backend_state(0)["in_use"] == 0)
            assert ctl.backend_state(0)["inflight_tokens"] == 0
            assert (await post(s, url, chat(model), "sk-carol"))[0] == 200


async def test_sighup_reloads_a_running_kvgate_serve(tmp_path: Path) -> None:
    sim_cfg = SimConfig.from_profile("tiny", speed=5, seed=5)
    model = sim_cfg.model
    path = tmp_path / "kvgate.yaml"
    port = free_port()
    top = {"listen": {"host": "127.0.0.1", "port": port}, "admin_key_sha256": sha(ADMIN_KEY)}
    alice = tenant("alice", "sk-alice")
    async with run_sim(sim_cfg) as sim:
        path.write_text(json.dumps(config_data(sim.url, [model], tenants=[alice], **top)))
        proc = await start_kvgate("serve", "--config", str(path))
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                await wait_http_up(url + "/healthz")

                async def limit() -> int:
                    async with s.get(url + "/admin/state", headers=bearer(ADMIN_KEY)) as r:
                        return (await r.json())["backends"][0]["max_concurrency"]

                assert await limit() == 8
                started = asyncio.Event()
                body = chat(model, "x", max_tokens=150, ignore_eos=True, stream=True)
                body["stream_options"] = {"include_usage": True}
                stream = asyncio.create_task(_stream_to_end(s, url, body, "sk-alice", started))
                await asyncio.wait_for(started.wait(), 10)
                assert (await post(s, url, chat(model), "sk-carol"))[0] == 401
                new = config_data(
                    sim.url,
                    [model],
                    max_concurrency=3,
                    tenants=[alice, tenant("carol", "sk-carol")],
                    **top,
                )
                path.write_text(json.dumps(new))
                proc.send_signal(signal.SIGHUP)

                async def reloaded() -> bool:
                    return await limit() == 3

                await until(reloaded, timeout=10, interval=0.05)
                assert (await post(s, url, chat(model), "sk-carol"))[0] == 200
                # an invalid file: refused, old configuration in force, process alive
                path.write_text("backends: [")
                proc.send_signal(signal.SIGHUP)
                await asyncio.sleep(0.5)
                assert proc.returncode is None
                assert await limit() == 3
                assert (await post(s, url, chat(model), "sk-carol"))[0] == 200
                assert await stream == 150  # the stream ran through both reloads
        finally:
            err = await stop_process(proc)
        assert b"refused" in err
        assert b"not valid YAML" in err
        assert b"sk-alice" not in err
        assert b"sk-carol" not in err


async def test_sheddable_is_shed_at_once_even_behind_queued_requests() -> None:
    async with run_upstream() as up:
        data = config_data(
            up.url,
            ["slow", "replay"],
            max_concurrency=1,
            tenants=[
                tenant("chat", "sk-chat", "critical", max_wait_ms=20_000),
                tenant("batch", "sk-batch", "sheddable", max_wait_ms=20_000),
            ],
        )
        gateway = build_gateway(Config.model_validate(data), poll=False)
        async with run_gateway(gateway) as url, aiohttp.ClientSession() as s:
            held = await s.post(
                url + "/v1/chat/completions",
                json=chat("slow", max_tokens=300, stream=True),
                headers=bearer("sk-chat"),
            )
            await held.content.readline()
            batch_waiter = asyncio.create_task(post(s, url, chat("replay"), "sk-batch"))
            chat_waiter = asyncio.create_task(post(s, url, chat("replay"), "sk-chat"))
            await until(lambda: gateway.queue.depth() == 2)
            # shedding starts (as the adaptive sink does it): queued sheddable answered at once
            gateway.controller.set_shedding(0, True)
            gateway.queue.shed("sheddable")
            assert (await asyncio.wait_for(batch_waiter, 2))[:2] == (503, "shed")
            # a new sheddable request is shed at once, not parked behind the critical waiter
            started = time.monotonic()
            assert (await post(s, url, chat("replay"), "sk-batch"))[:2] == (503, "shed")
            assert time.monotonic() - started < 5.0
            held.close()
            assert (await chat_waiter)[0] == 200
            await until(lambda: gateway.controller.backend_state(0)["in_use"] == 0)


def test_reload_keeps_the_command_line_overrides_and_warns_about_listen(
    tmp_path: Path, caplog
) -> None:
    """`kvgate serve --config F --max-body-bytes N`: a SIGHUP reload applies the file with the
    flags still winning; a changed listen address is reported as needing a restart."""
    caplog.set_level(logging.WARNING, logger="kvgate.gateway")
    path = tmp_path / "kvgate.yaml"
    data = config_data("http://127.0.0.1:9", ["m"])
    path.write_text(json.dumps(data))
    gateway = build_gateway(load_config(path), config_path=str(path), poll=False)
    gateway.config_overrides = lambda c: c.model_copy(update={"max_body_bytes": 12_345})
    data["max_body_bytes"] = 999_999
    data["listen"] = {"host": "127.0.0.1", "port": 18999}
    path.write_text(json.dumps(data))
    assert gateway.reload() is True
    assert gateway.max_body_bytes == 12_345
    assert "next start" in caplog.text
    assert "still 127.0.0.1:8080" in caplog.text, caplog.text


def test_a_store_section_changed_on_reload_is_told_against_the_running_one(
    tmp_path: Path, caplog
) -> None:
    """The store section applies only at start: a reload that changes it says so, and so does
    the next reload of the same file (still not applied); a file that restores the section
    the gateway runs with says nothing (it was compared with the last file read)."""
    caplog.set_level(logging.WARNING, logger="kvgate.gateway")
    path = tmp_path / "kvgate.yaml"
    data = config_data("http://127.0.0.1:9", ["m"])
    data["store"] = {"url": "redis://127.0.0.1:1/0"}
    path.write_text(json.dumps(data))
    gateway = build_gateway(load_config(path), config_path=str(path), poll=False)
    for url, said in (
        ("redis://127.0.0.1:2/0", True),
        ("redis://127.0.0.1:2/0", True),
        ("redis://127.0.0.1:1/0", False),
    ):
        caplog.clear()
        data["store"] = {"url": url}
        path.write_text(json.dumps(data))
        assert gateway.reload() is True
        assert ("store section changed" in caplog.text) is said, (url, caplog.text)


def test_tenant_burst_tokens_size_its_bucket_and_a_reload_resets_it(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    t = tenant("alice", "sk-alice", tokens_per_minute=60_000, burst_tokens=5_000)
    path.write_text(json.dumps(config_data("http://127.0.0.1:9", ["m"], tenants=[t])))
    gateway = build_gateway(load_config(path), config_path=str(path), poll=False)
    ctl = gateway.controller
    state = ctl.tenant_state(ctl.tenant_id("alice"))
    assert (state["tokens_per_minute"], state["burst_tokens"]) == (60_000, 5_000)
    del t["burst_tokens"]  # back to the default: one minute's worth
    path.write_text(json.dumps(config_data("http://127.0.0.1:9", ["m"], tenants=[t])))
    assert gateway.reload() is True
    assert ctl.tenant_state(ctl.tenant_id("alice"))["burst_tokens"] == 60_000


async def test_shadow_tenant_is_not_queued_behind_others_and_queue_refusals_are_computed() -> None:
    """With requests queued, a shadow tenant is still decided at once (admitted, its refusal
    counted); the queue's refusals carry a Retry-After computed from the requests running on
    the backend and the requests queued ahead (not a constant); a fractional
    x-kvgate-max-wait-ms is honoured."""
    async with run_upstream() as up:
        data = config_data(
            up.url,
            ["slow", "replay"],
            max_concurrency=1,
            tenants=[
                tenant("t", "sk-t", max_wait_ms=20_000),
                tenant("trial", "sk-trial", mode="shadow", max_wait_ms=20_000),
            ],
            queue={"max_size": 2},
        )
        gateway = build_gateway(Config.model_validate(data), poll=False)
        queue = gateway.queue
        async with run_gateway(gateway) as url, aiohttp.ClientSession() as s:
            # one short request first, so the backend has a hold-time estimate
            assert (await post(s, url, chat("replay"), "sk-t"))[0] == 200
            hold = gateway.controller.backend_state(0)["hold_time_ewma"]
            assert 0 < hold < 5
            held = await s.post(
                url + "/v1/chat/completions",
                json=chat("slow", max_tokens=300, stream=True),
                headers=bearer("sk-t"),
            )
            await held.content.readline()
            waiters = [asyncio.create_task(post(s, url, chat("replay"), "sk-t"))]
            await until(lambda: queue.depth() == 1)
            # the shadow tenant: decided now, not parked behind the waiter
            started = time.monotonic()
            assert (await post(s, url, chat("replay"), "sk-trial"))[0] == 200
            assert time.monotonic() - started < 2.0
            text = await get_text(url + "/metrics")
            assert metric(text, "kvgate_shadow_rejections_total", reason="backend-slots") == 1
            # a fractional client wait is honoured (not ignored): refused at once, `queued`,
            # with a computed wait (the running stream's end, then a hold for the one ahead)
            started = time.monotonic()
            async with s.post(
                url + "/v1/chat/completions",
                json=chat("replay"),
                headers={**bearer("sk-t"), "x-kvgate-max-wait-ms": "0.5"},
            ) as r:
                assert (r.status, r.headers["x-kvgate-reject-reason"]) == (503, "queued")
                queued_ms = int(r.headers["retry-after-ms"])
            elapsed = time.monotonic() - started
            assert elapsed < 2.0
            # the running stream's expected remaining time shrinks while the answer travels:
            # the hint computed now is at most `elapsed` below the one in the header
            expected = gateway.running.hint(0, ahead=1)
            assert expected is not None
            assert queued_ms / 1000 == pytest.approx(expected, abs=0.05 + elapsed)
            # queue full: one more ahead
            waiters.append(asyncio.create_task(post(s, url, chat("replay"), "sk-t")))
            await until(lambda: queue.depth() == 2)
            started = time.monotonic()
            async with s.post(
                url + "/v1/chat/completions", json=chat("replay"), headers=bearer("sk-t")
            ) as r:
                assert r.headers["x-kvgate-reject-reason"] == "queue-full"
                full_ms = int(r.headers["retry-after-ms"])
            elapsed = time.monotonic() - started
            expected = gateway.running.hint(0, ahead=2)
            assert expected is not None
            assert full_ms / 1000 == pytest.approx(expected, abs=0.05 + elapsed)
            # one more queued ahead: one more hold. Compared at one instant (the running
            # stream's expected remaining time moves between the two refusals above) and afresh
            # (a hint is remembered for a few milliseconds: the two calls could otherwise get
            # values computed at different times)
            instant = types.SimpleNamespace(monotonic=lambda: now)
            now = time.monotonic()
            gateway.running._recent.clear()
            with mock.patch.object(retry_hint, "time", instant):
                one_ahead = gateway.running.hint(0, ahead=1)
                two_ahead = gateway.running.hint(0, ahead=2)
            assert one_ahead is not None
            assert two_ahead is not None
            assert two_ahead >= one_ahead  # equal only when both are at the 50 ms floor
            held.close()
            assert [(await w)[0] for w in waiters] == [200, 200]
            await until(lambda: gateway.controller.backend_state(0)["in_use"] == 0)


async def test_a_sighup_reload_reads_the_file_off_the_event_loop_and_a_second_one_rereads_it(
    tmp_path: Path,
) -> None:
    """SIGHUP's reload (``reload_soon``) reads and checks the file on a worker thread: here the
    read waits until a coroutine on the event loop has run (on the loop it could not: the
    wait would time out). A SIGHUP during that reload reads the file again once it is done,
    so the last version of the file is the one in force."""
    import threading

    path = tmp_path / "kvgate.json"
    alice = tenant("alice", "sk-alice", tokens_per_minute=100_000)
    path.write_text(json.dumps(config_data("http://127.0.0.1:9", ["m"], tenants=[alice])))
    gateway = build_gateway(load_config(path), config_path=str(path), poll=False)
    ctl = gateway.controller
    loop_ran, reading = threading.Event(), threading.Event()
    reads: list[bool] = []
    read = gateway._read_config

    def slow_read() -> Any:
        new = read()
        reading.set()
        reads.append(loop_ran.wait(10))
        return new

    gateway._read_config = slow_read  # type: ignore[method-assign]
    carol = tenant("carol", "sk-carol")
    path.write_text(json.dumps(config_data("http://127.0.0.1:9", ["m"], tenants=[alice, carol])))
    gateway.reload_soon()
    await until(reading.is_set, timeout=10)  # the loop runs while the file is read
    # a second SIGHUP while the first reload is under way: the file is read again after it
    dave = tenant("dave", "sk-dave")
    path.write_text(json.dumps(config_data("http://127.0.0.1:9", ["m"], tenants=[alice, dave])))
    gateway.reload_soon()
    loop_ran.set()
    assert gateway._reloading is not None
    await asyncio.wait_for(asyncio.shield(gateway._reloading), 20)
    assert reads == [True, True]
    assert ctl.tenant_id("dave") is not None
    assert ctl.tenant_id("carol") is None


async def test_a_waiter_whose_tenant_a_reload_removes_is_refused_and_never_takes_another_id(
    tmp_path: Path,
) -> None:
    """alice's request waits for the backend's only slot (bob holds it). A reload removes
    alice and adds eve while every id of the core is taken, so eve takes alice's id (alice
    holds nothing). The waiter is refused at once (429, no retry hint: its key no longer
    works), before bob's slot frees: it must not be admitted, let alone under eve's id and
    limits (it was, once the slot freed, before: eve was charged for alice's request)."""
    sim_cfg = SimConfig.from_profile("tiny", speed=5, seed=4)
    model = sim_cfg.model
    path = tmp_path / "kvgate.json"
    alice = tenant("alice", "sk-alice", max_wait_ms=30_000)
    bob = tenant("bob", "sk-bob")
    fill = [tenant(f"f{i}", f"sk-f{i}") for i in range(1022)]
    async with run_sim(sim_cfg) as sim:

        def write(tenants: list[dict[str, Any]]) -> None:
            path.write_text(
                json.dumps(config_data(sim.url, [model], max_concurrency=1, tenants=tenants))
            )

        write([alice, bob, *fill[:510]])
        gateway = build_gateway(load_config(path), config_path=str(path), poll=False)
        ctl = gateway.controller
        write([alice, bob, *fill])
        assert gateway.reload() is True
        assert ctl.free_tenant_ids == 0
        alice_id = ctl.tenant_id("alice")
        held = ctl.admit(0, ctl.tenant_id("bob"), "standard", 10)
        assert held.admitted
        async with run_gateway(gateway) as url, aiohttp.ClientSession() as s:
            waiter = asyncio.create_task(post(s, url, chat(model), "sk-alice"))
            await until(lambda: gateway.queue is not None and gateway.queue.waiting == 1)
            write([bob, tenant("eve", "sk-eve"), *fill])
            assert gateway.reload() is True
            assert ctl.tenant_id("eve") == alice_id  # the id went to eve
            status, reason, _ = await asyncio.wait_for(waiter, 10)
            assert (status, reason) == (429, "tenant-concurrency")
            assert ctl.tenant_state(alice_id)["in_use"] == 0  # eve runs nothing
            held.release()
            assert (await post(s, url, chat(model), "sk-eve"))[0] == 200
