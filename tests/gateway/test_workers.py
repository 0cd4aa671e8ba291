"""Several workers end to end: `kvgate serve --workers 2` as a subprocess in front of the simulator (also
a subprocess) and the fake upstream: a 1,000-request soak with disconnects and upstream errors,
SIGKILL of a worker mid-flight, graceful SIGTERM; and the non-streaming disconnect path."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from kvgate.config import Config
from kvgate.gateway_build import build_gateway
from kvgate.server import run_gateway
from kvgate.sim import SimConfig, run_sim

from .fake_upstream import run_upstream
from .helpers import (
    STARTUP_SERIES,
    chat,
    exited_stderr,
    free_port,
    get_text,
    metric,
    raw_chat_request,
    samples,
    start_kvgate,
    stderr_so_far,
    stop_process,
    until,
    wait_http_up,
)

SIM_MODEL = "kvgate-sim-tiny"


# ---- non-streaming disconnect (in process) ---------------------------------------------------


async def test_non_streaming_disconnect_aborts_upstream_and_releases() -> None:
    sim_cfg = SimConfig.from_profile("tiny", speed=5, seed=9)
    async with run_sim(sim_cfg) as sim:
        cfg = Config.model_validate(
            {
                "backends": [
                    {
                        "name": "b0",
                        "url": sim.url,
                        "models": [{"name": SIM_MODEL, "context_window": 1024}],
                        "max_concurrency": 4,
                    }
                ]
            }
        )
        gateway = build_gateway(cfg, poll=False)
        ctl = gateway.controller
        async with run_gateway(gateway) as url:
            before = ctl.backend_state(0)["available_tokens"]
            _reader, writer = await asyncio.open_connection(*url[7:].split(":"))
            body = orjson.dumps(chat(SIM_MODEL, "write a lot", max_tokens=400, ignore_eos=True))
            writer.write(raw_chat_request(body))
            await writer.drain()
            # generating (non-streaming: nothing is sent to the client yet)
            await until(lambda: sim.engine.generation_tokens_total >= 20, timeout=10)
            assert ctl.backend_state(0)["in_use"] == 1
            writer.close()
            await until(lambda: ctl.backend_state(0)["in_use"] == 0, timeout=1.0)
            await until(lambda: sim.engine.aborted == 1, timeout=1.0)
            assert sim.engine.running == []
            st = ctl.backend_state(0)
            assert st["inflight_tokens"] == 0
            # the reservation (prompt + 400) was settled, not kept: no completion was delivered
            assert st["available_tokens"] >= before - 50


# ---- kvgate serve --workers 2 -----------------------------------------------------------------


@contextlib.asynccontextmanager
async def workers_stack(tmp_path: Path, *, grace: float = 10.0) -> AsyncIterator[dict[str, Any]]:
    """Simulator (subprocess) + fake upstream (in process) + `kvgate serve --workers 2`."""
    sim_port, gw_port = free_port(), free_port()
    sim = await start_kvgate(
        "sim", "--profile", "tiny", "--speed", "20", "--port", str(sim_port), "--seed", "3"
    )
    gw = None
    try:
        async with run_upstream() as up:
            dead = f"http://127.0.0.1:{free_port()}"
            sim_url = f"http://127.0.0.1:{sim_port}"

            def backend(name: str, url: str, models: list[str], **kw: Any) -> dict[str, Any]:
                return {
                    "name": name,
                    "url": url,
                    "models": [{"name": m, "context_window": 1024} for m in models],
                    "max_concurrency": 32,
                    "tokens_per_minute": 10_000_000,
                    **kw,
                }

            config = {
                "listen": {"host": "127.0.0.1", "port": gw_port},
                "workers": 2,
                "backends": [
                    backend(
                        "sim",
                        sim_url,
                        [SIM_MODEL],
                        adaptive={"enabled": True, "poll_interval": 0.2, "stale_after": 2.0},
                    ),
                    # health checked on the simulator: these stay in routing for the whole
                    # run (their own /health would take them out after 3 s, and a request
                    # queued behind the simulator's past that would get 503, not their error)
                    backend(
                        "fake", up.url, ["error500", "die", "slow"], health_url=sim_url + "/health"
                    ),
                    backend(
                        "dead", dead, ["gone"], max_concurrency=8, health_url=sim_url + "/health"
                    ),
                ],
                "tenants": [{"name": "anon", "max_wait_ms": 3000}],
                "anonymous_tenant": "anon",
                "queue": {"max_size": 300},
            }
            path = tmp_path / "kvgate.yaml"
            path.write_text(json.dumps(config))
            await wait_http_up(sim_url + "/health")
            gw = await start_kvgate("serve", "--config", str(path), "--grace", str(grace))
            url = f"http://127.0.0.1:{gw_port}"
            await wait_http_up(url + "/healthz")
            yield {"url": url, "sim": sim_url, "proc": gw, "up": up, "port": gw_port}
    finally:
        if gw is not None:
            await stop_process(gw)
        await stop_process(sim)


def children(pid: int) -> set[int]:
    """PIDs whose parent is ``pid`` (from /proc)."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out.add(int(entry))
    return out


def worker_holding(client_port: int, server_port: int, workers: set[int]) -> int | None:
    """The worker process whose socket is the server end of the client's connection."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        local, remote = parts[1], parts[2]
        if (
            int(local.split(":")[1], 16) == server_port
            and int(remote.split(":")[1], 16) == client_port
        ):
            inode = parts[9]
    if inode is None:
        return None
    for pid in workers:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                        return pid
    return None


async def idle(url: str) -> str:
    """Wait until every backend's slots and in-flight tokens are back to 0; return /metrics."""
    last = ""

    async def check() -> bool:
        nonlocal last
        last = await get_text(url + "/metrics")
        return all(
            metric(last, name, backend=b) == 0
            for b in ("sim", "fake", "dead")
            for name in ("kvgate_slots_in_use", "kvgate_inflight_tokens")
        )

    await until(check, timeout=20, interval=0.1)
    return last


@pytest.mark.slow
async def test_soak_1000_requests_over_two_workers(tmp_path: Path) -> None:
    rng = random.Random(1234)
    async with workers_stack(tmp_path) as st:
        url = st["url"]
        outcomes: dict[str, int] = {}
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as s:

            async def one(i: int) -> None:
                kind = rng.choices(
                    [
                        "stream",
                        "stream_cut",
                        "plain",
                        "plain_cut",
                        "error500",
                        "die",
                        "gone",
                        "bad",
                    ],
                    weights=[25, 20, 20, 10, 8, 7, 5, 5],
                )[0]
                model = {"error500": "error500", "die": "die", "gone": "gone"}.get(kind, SIM_MODEL)
                body = chat(model, f"soak {i}", max_tokens=rng.randint(5, 40))
                if kind.startswith("stream") or kind == "die":
                    body["stream"] = True
                data = b"{broken" if kind == "bad" else orjson.dumps(body)
                key = kind
                try:
                    async with asyncio.timeout(60):
                        if kind == "plain_cut":
                            req = asyncio.create_task(
                                s.post(url + "/v1/chat/completions", data=data)
                            )
                            await asyncio.sleep(rng.uniform(0, 0.05))
                            req.cancel()
                            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                                r = await req
                                r.close()
                            key = "plain_cut"
                        else:
                            async with s.post(url + "/v1/chat/completions", data=data) as r:
                                key = f"{kind}:{r.status}"
                                if kind == "stream_cut" and r.status == 200:
                                    for _ in range(rng.randint(1, 3)):
                                        await r.content.readline()
                                    r.close()
                                else:
                                    await r.read()
                except aiohttp.ClientError as exc:
                    key = f"{kind}:{type(exc).__name__}"
                outcomes[key] = outcomes.get(key, 0) + 1

            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(1000))), 120)
        print("\nsoak outcomes:", dict(sorted(outcomes.items())))
        assert sum(outcomes.values()) == 1000
        assert outcomes.get("stream:200", 0) > 50
        assert outcomes.get("error500:500", 0) > 0
        assert outcomes.get("gone:502", 0) > 0
        assert outcomes.get("bad:400", 0) > 0
        text = await idle(url)
        # scrape each worker (new connections spread over SO_REUSEPORT): no leak anywhere
        for _ in range(6):
            text = await get_text(url + "/metrics")
            assert metric(text, "kvgate_reservation_leaks_total") == 0

        # each worker adds its batched per-request counts to the shared metrics once a second
        # (metrics.FLUSH_SECONDS): the other worker's reach a scrape within about that
        async def counted() -> bool:
            scraped = await get_text(url + "/metrics")
            return metric(scraped, "kvgate_requests_total") >= 900

        await until(counted, timeout=5, interval=0.2)
        async with aiohttp.ClientSession() as s, s.get(st["sim"] + "/sim/state") as r:
            sim_state = await r.json()
        assert sim_state["num_running"] == 0
        assert sim_state["num_waiting"] == 0
        assert st["up"].active == 0


async def test_sigkill_worker_is_restarted_and_its_slots_reclaimed_then_sigterm(
    tmp_path: Path,
) -> None:
    async with workers_stack(tmp_path, grace=10.0) as st:
        url, proc = st["url"], st["proc"]
        await until(lambda: len(children(proc.pid)) == 2)
        workers = children(proc.pid)
        s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))
        held = []
        try:
            for i in range(8):
                r = await s.post(
                    url + "/v1/chat/completions",
                    json=chat("slow", f"hold {i}", max_tokens=300, stream=True),
                )
                assert r.status == 200
                await r.content.readline()
                held.append(r)
            state = await get_text(url + "/metrics")
            assert metric(state, "kvgate_slots_in_use", backend="fake") == 8
            owners = [
                worker_holding(
                    r.connection.transport.get_extra_info("sockname")[1], st["port"], workers
                )
                for r in held
            ]
            victim = next(p for p in owners if p is not None)
            os.kill(victim, signal.SIGKILL)
            # the master restarts it
            await until(lambda: len(children(proc.pid) - {victim}) == 2, timeout=20)
            assert victim not in children(proc.pid)
            await wait_http_up(url + "/healthz")
            # the survivors' streams are still running; close them
            for r, owner in zip(held, owners, strict=True):
                if owner != victim:
                    r.close()
            # the victim's slots were reclaimed by the master: in use back to 0
            await idle(url)
            await until(lambda: st["up"].active == 0, timeout=5)
        finally:
            for r in held:
                r.close()
            await s.close()

        # SIGTERM: a running stream finishes within the grace period, then the gateway exits
        async with aiohttp.ClientSession() as c:
            body = chat(SIM_MODEL, "last one", max_tokens=400, ignore_eos=True, stream=True)
            body["stream_options"] = {"include_usage": True}
            async with c.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                first = await r.content.readline()
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.1)
                proc.send_signal(signal.SIGTERM)  # repeated: must not cut the drain
                raw = first + await r.read()
        events = [e for e in raw.split(b"\n\n") if e.strip()]
        assert events[-1] == b"data: [DONE]"
        assert orjson.loads(events[-2][6:])["usage"]["completion_tokens"] == 400
        err = await exited_stderr(proc, 15)
        assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
        async with aiohttp.ClientSession() as c, c.get(st["sim"] + "/sim/state") as r:
            assert (await r.json())["num_running"] == 0


async def test_sighup_without_a_config_file_is_logged_not_fatal() -> None:
    """Started from flags (no file to reload), SIGHUP must not kill the gateway (the default
    action of SIGHUP) — single process and with --workers."""
    for workers in ("1", "2"):
        port = free_port()
        proc = await start_kvgate(
            "serve",
            "--upstream",
            "http://127.0.0.1:9",
            "--model",
            "m",
            "--port",
            str(port),
            "--no-adaptive",
            "--workers",
            workers,
        )
        try:
            await wait_http_up(f"http://127.0.0.1:{port}/healthz")
            proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.5)
            assert proc.returncode is None
            await wait_http_up(f"http://127.0.0.1:{port}/healthz", timeout=5)
        finally:
            err = await stop_process(proc)
        assert proc.returncode == 0
        assert b"SIGHUP ignored" in err


async def test_a_restarted_worker_serves_the_reloaded_configuration(tmp_path: Path) -> None:
    """SIGHUP reloads every worker; a worker that dies afterwards is restarted with the reloaded
    file, not the one read at start-up (the master reloads it too), and its live-summed gauge
    files are removed when it is reaped."""
    import hashlib

    def config(key: str) -> str:
        digest = hashlib.sha256(key.encode()).hexdigest()
        return json.dumps(
            {
                "listen": {"host": "127.0.0.1", "port": port},
                "workers": 2,
                "backends": [
                    {
                        "name": "fake",
                        "url": up.url,
                        "models": [{"name": "replay", "context_window": 1024}],
                        "max_concurrency": 8,
                    }
                ],
                "tenants": [{"name": "a", "api_key_sha256": [digest]}],
            }
        )

    async def statuses(key: str, n: int = 12) -> list[int]:
        # a new connection each time, so both workers answer
        out = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            for _ in range(n):
                async with s.post(
                    url + "/v1/chat/completions",
                    json=chat("replay", "hi", max_tokens=5),
                    headers={"Authorization": f"Bearer {key}"},
                ) as r:
                    out.append(r.status)
        return out

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with run_upstream() as up:
        path = tmp_path / "kvgate.yaml"
        path.write_text(config("key-one"))
        gw = await start_kvgate("serve", "--config", str(path), "--grace", "2")
        try:
            await wait_http_up(url + "/healthz")
            await until(lambda: len(children(gw.pid)) == 2)
            assert set(await statuses("key-one")) == {200}
            path.write_text(config("key-two"))
            gw.send_signal(signal.SIGHUP)

            async def reloaded() -> bool:
                return set(await statuses("key-two", 6)) == {200}

            await until(reloaded, timeout=10, interval=0.2)
            victim = min(children(gw.pid))
            # each worker writes its queue-depth gauge file at its first flush (1 s)
            await until(lambda: _livesum_file(victim))
            os.kill(victim, signal.SIGKILL)
            await until(lambda: len(children(gw.pid) - {victim}) == 2, timeout=20)
            await wait_http_up(url + "/healthz")
            assert not _livesum_file(victim)
            assert set(await statuses("key-two")) == {200}
            assert set(await statuses("key-one")) == {401}
        finally:
            await stop_process(gw)


def _livesum_file(pid: int) -> bool:
    """Whether worker ``pid`` has a live-summed gauge file in a gateway's multiprocess dir."""
    import tempfile

    return any(Path(tempfile.gettempdir()).glob(f"kvgate-prom-*/gauge_livesum_{pid}.db"))


async def test_two_workers_export_the_startup_series_for_every_backend(tmp_path: Path) -> None:
    """Multiprocess mode: kvgate_shedding / kvgate_metrics_stale / scrape errors exist for every
    backend from start-up, one merged series each (gauges: max, counter: sum over workers)."""
    async with workers_stack(tmp_path) as st:
        await until(lambda: len(children(st["proc"].pid)) == 2)
        # new connections spread over SO_REUSEPORT: several scrapes reach both workers
        for _ in range(4):
            text = await get_text(st["url"] + "/metrics")
            for name, extra in STARTUP_SERIES:
                found = samples(text, name)
                assert sorted(found) == ["dead", "fake", "sim"], (name, found)
                for backend, series in found.items():
                    assert [labels for labels, _ in series] == [{"backend": backend, **extra}]
                # the simulator answers its /metrics: nothing shed, stale or failed
                assert found["sim"][0][1] == 0, (name, found)


async def test_two_workers_serve_https(tmp_path: Path) -> None:
    """`--workers 2` with ``listen.tls``: every worker's socket serves TLS (fresh connections
    spread over both with SO_REUSEPORT), the openai client is answered over HTTPS."""
    import openai

    from .tls_certs import self_signed, wait_https_up

    cert = self_signed(tmp_path)
    async with run_sim(SimConfig.from_profile("tiny", speed=50, seed=6)) as sim:
        port = free_port()
        config = {
            "listen": {
                "host": "127.0.0.1",
                "port": port,
                "tls": {"certificate": cert.certificate.name, "key": cert.key.name},
            },
            "workers": 2,
            "backends": [
                {
                    "name": "sim",
                    "url": sim.url,
                    "models": [{"name": SIM_MODEL, "context_window": 1024}],
                    "max_concurrency": 8,
                    "adaptive": {"enabled": False},
                }
            ],
        }
        path = tmp_path / "kvgate.yaml"
        path.write_text(json.dumps(config))
        gw = await start_kvgate("serve", "--config", str(path))
        try:
            url = f"https://127.0.0.1:{port}"
            await wait_https_up(url + "/readyz", cert)
            await until(lambda: len(children(gw.pid)) == 2)
            ctx = cert.client_context()
            for _ in range(8):  # a fresh connection each: both workers answer
                async with aiohttp.ClientSession() as s, s.get(url + "/readyz", ssl=ctx) as r:
                    assert r.status == 200
            http = openai.DefaultAsyncHttpxClient(verify=ctx)
            async with openai.AsyncOpenAI(
                base_url=url + "/v1", api_key="unused", http_client=http, max_retries=0
            ) as client:
                for stream in (False, True):
                    answer = await client.chat.completions.create(
                        model=SIM_MODEL,
                        messages=[{"role": "user", "content": "hi"}],
                        max_tokens=4,
                        stream=stream,
                    )
                    if stream:
                        assert [c async for c in answer]  # type: ignore[union-attr]
                    else:
                        assert answer.choices[0].message.content  # type: ignore[union-attr]
        finally:
            err = await stop_process(gw)
        assert gw.returncode == 0, err.decode(errors="replace")[-2000:]


async def test_quick_start_with_workers_sums_every_workers_counters() -> None:
    """``kvgate serve --upstream URL --workers 2``: the quick start asks the engine before the
    workers start (and so imports prometheus_client first); the counters on ``/metrics`` are
    still every worker's, summed: requests on fresh connections, spread over both workers,
    all counted."""
    async with run_upstream() as up:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = await start_kvgate(
            "serve", "--upstream", up.url, "--model", "replay", "--port", str(port),
            "--no-adaptive", "--workers", "2",
        )  # fmt: skip
        try:
            await wait_http_up(url + "/healthz")
            await until(lambda: len(children(proc.pid)) == 2)
            sent = 24
            connector = aiohttp.TCPConnector(force_close=True)  # a new connection each time
            async with aiohttp.ClientSession(connector=connector) as s:
                for i in range(sent):
                    async with s.post(
                        url + "/v1/chat/completions", json=chat("replay", f"hi {i}", max_tokens=5)
                    ) as r:
                        assert r.status == 200, await r.text()
                        await r.read()

            async def counted() -> bool:
                text = await get_text(url + "/metrics")
                by_backend = samples(text, "kvgate_requests_total")
                return sum(v for rows in by_backend.values() for _, v in rows) == sent

            await until(counted, timeout=15, interval=0.2)
        finally:
            await stop_process(proc)


# ---- the workers share one poll of each engine -----------------------------------------------


class CountingEngine:
    """An engine's ``/metrics`` (vLLM's KV gauge at ``kv``) and ``/health`` on 127.0.0.1, which
    counts the scrapes it answers."""

    def __init__(self, model: str, kv: float) -> None:
        self.model, self.kv, self.scrapes = model, kv, 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        return web.Response(
            text=(
                f'vllm:kv_cache_usage_perc{{model_name="{self.model}"}} {self.kv}\n'
                f'vllm:num_requests_running{{model_name="{self.model}"}} 0\n'
                f'vllm:num_requests_waiting{{model_name="{self.model}"}} 0\n'
            )
        )

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", lambda _: web.Response(text="ok"))
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def admin_state_of(port: int, worker: int, workers: set[int]) -> dict[str, Any]:
    """``GET /admin/state`` answered by the worker process ``worker`` (fresh connections until
    the kernel hands one to it)."""
    for _ in range(200):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            if worker_holding(writer.get_extra_info("sockname")[1], port, workers) != worker:
                continue
            writer.write(b"GET /admin/state HTTP/1.1\r\nHost: k\r\nConnection: close\r\n\r\n")
            head, _, body = (await reader.read()).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            return dict(orjson.loads(body))
        finally:
            writer.close()
    raise AssertionError(f"no connection reached worker {worker}")


async def test_workers_share_one_scrape_of_each_engine(tmp_path: Path) -> None:
    """``--workers 2`` in front of four engines: each engine is scraped once per interval, not
    once per worker; each worker knows every engine's KV usage (its own polls and the other's,
    followed through the shared region); a worker frozen past three intervals (SIGSTOP) has
    its engines polled by the other meanwhile."""
    interval = 0.5
    engines = [CountingEngine(f"m{i}", kv) for i, kv in enumerate((0.11, 0.22, 0.33, 0.44))]
    for e in engines:
        await e.start()
    port = free_port()
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "workers": 2,
        "backends": [
            {
                "name": f"e{i}",
                "url": e.url,
                "engine": "vllm",
                "models": [{"name": f"m{i}", "context_window": 1024}],
                "max_concurrency": 8,
                "adaptive": {"enabled": True, "poll_interval": interval, "stale_after": 5.0},
            }
            for i, e in enumerate(engines)
        ],
        "tenants": [{"name": "anon"}],
        "anonymous_tenant": "anon",
    }
    path = tmp_path / "kvgate.json"
    path.write_text(json.dumps(config))
    gw = await start_kvgate("serve", "--config", str(path))
    stopped: int | None = None
    try:
        await wait_http_up(f"http://127.0.0.1:{port}/healthz")
        await until(lambda: len(children(gw.pid)) == 2, timeout=20)
        workers = children(gw.pid)
        await until(lambda: min(e.scrapes for e in engines) >= 2, timeout=20)

        # both workers hold every engine's reading
        async def knows_all(pid: int) -> bool:
            state = await admin_state_of(port, pid, workers)
            kv = {b["name"]: b["kv_usage"] for b in state["backends"]}
            return kv == {f"e{i}": e.kv for i, e in enumerate(engines)}

        for pid in workers:
            await until(lambda pid=pid: knows_all(pid), timeout=20, interval=0.2)

        # one scrape an interval per engine (two workers polling each would make twice that)
        loop = asyncio.get_running_loop()
        start, before = loop.time(), [e.scrapes for e in engines]
        await until(lambda: engines[0].scrapes >= before[0] + 8, timeout=30, interval=0.05)
        rounds = (loop.time() - start) / interval
        for e, b in zip(engines, before, strict=True):
            assert e.scrapes - b <= 1.25 * rounds + 2, (e.scrapes - b, rounds)

        # a frozen worker: the other polls its engines until it wakes up
        stopped = min(workers)
        os.kill(stopped, signal.SIGSTOP)
        frozen = [e.scrapes for e in engines]
        await until(
            lambda: all(e.scrapes >= f + 3 for e, f in zip(engines, frozen, strict=True)),
            timeout=30,
            interval=0.1,
        )
        engines[1].kv = engines[2].kv = 0.5
        other = max(workers)
        await until(lambda: knows_all(other), timeout=20, interval=0.2)
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        for pid in workers:
            await until(lambda pid=pid: knows_all(pid), timeout=20, interval=0.2)

        # a reload asks for 3 workers (applied at the next start), then a worker dies: the one
        # restarted in its place still shares the polls as one of 2
        path.write_text(json.dumps({**config, "workers": 3}))
        gw.send_signal(signal.SIGHUP)
        await until(lambda: b"workers changed in the file" in stderr_so_far(gw), timeout=20)
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        await until(lambda: len(children(gw.pid) - {victim}) == 2, timeout=30)
        workers = children(gw.pid)
        for pid in workers:
            await until(lambda pid=pid: knows_all(pid), timeout=20, interval=0.2)
        start, before = loop.time(), [e.scrapes for e in engines]
        await until(lambda: engines[0].scrapes >= before[0] + 8, timeout=30, interval=0.05)
        rounds = (loop.time() - start) / interval
        for e, b in zip(engines, before, strict=True):
            assert e.scrapes - b <= 1.25 * rounds + 2, (e.scrapes - b, rounds)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        await stop_process(gw)
        for e in engines:
            assert e.runner is not None
            await e.runner.cleanup()
