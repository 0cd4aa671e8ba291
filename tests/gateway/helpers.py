"""Small helpers shared by the end-to-end gateway tests: bounded polling, metrics parsing, bodies,
and a scripted engine (``/metrics`` with a KV gauge the test sets, ``/health``, a chat route)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families


async def until(
    pred: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0, interval: float = 0.02
) -> None:
    """Poll ``pred`` (sync or async) until it is true; fail the test after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = pred()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of sample ``name`` whose labels include ``labels`` in a Prometheus text body
    (summed over the matching series), or ``None`` if no sample matches."""
    total: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total = (total or 0.0) + sample.value
    return total


#: the series every backend has from start-up: (sample name, labels besides ``backend``)
STARTUP_SERIES = (
    ("kvgate_shedding", {"class": "sheddable"}),
    ("kvgate_metrics_stale", {}),
    ("kvgate_metrics_scrape_errors_total", {}),
)


def samples(text: str, name: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``{backend: [(labels, value), ...]}`` of the samples called ``name``."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out.setdefault(s.labels["backend"], []).append((dict(s.labels), s.value))
    return out


async def get_text(url: str, headers: dict[str, str] | None = None) -> str:
    """``GET url`` and return the body as text (a fresh connection each time)."""
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        return await r.text()


def chat(model: str, content: str = "hi", max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    """A chat completions request body."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }


def raw_chat_request(body: bytes) -> bytes:
    """An HTTP/1.1 ``POST /v1/chat/completions`` of JSON ``body`` as bytes, for tests that
    drive the gateway over a bare socket."""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def free_port() -> int:
    """A loopback port that was free a moment ago, for a subprocess that needs one up front.

    Drawn at random below the kernel's ephemeral range (``ip_local_port_range``, 32768-60999
    by default), not from it: every server a test binds to port 0 (the simulator, a fake
    engine, an in-process gateway) gets a port from that range, and could otherwise be given
    this one between now and the subprocess's bind (the subprocess then fails to start, and
    the test waits out its timeout)."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    floor = max(1024, low - 12_000)
    for _ in range(200):
        port = random.randint(floor, low - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use (or in TIME_WAIT): another draw
                continue
            return port
    with socket.socket() as s:  # a machine with no room below its range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- a scripted engine -------------------------------------------------------------------


@dataclass
class ScriptedEngine:
    """A fake vLLM whose ``/metrics`` and ``/health`` the test drives.

    Attributes:
        kv_usage: the ``vllm:kv_cache_usage_perc`` value served.
        waiting: ``vllm:num_requests_waiting``.
        mode: ``ok``, ``hang`` (never answers), ``500``, ``garbage`` (not Prometheus text),
            ``nokv`` (every vLLM series except the KV gauge).
        health: status ``/health`` answers.
        num_gpu_blocks / block_size: ``vllm:cache_config_info`` labels (capacity discovery).
        served: chat requests answered.
        scrapes: ``/metrics`` requests seen.
    """

    kv_usage: float = 0.1
    waiting: int = 0
    mode: str = "ok"
    health: int = 200
    num_gpu_blocks: int = 100
    block_size: int = 16
    served: int = 0
    scrapes: int = 0
    url: str = ""
    hold: asyncio.Event = field(default_factory=asyncio.Event)

    def metrics_text(self) -> str:
        labels = 'engine="0",model_name="m"'
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} 0.0",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(self.waiting)}",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{self.block_size}",engine="0",'
            f'num_gpu_blocks="{self.num_gpu_blocks}"}} 1.0',
        ]
        if self.mode != "nokv":
            lines += [
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f"vllm:kv_cache_usage_perc{{{labels}}} {self.kv_usage}",
            ]
        return "\n".join(lines) + "\n"


def scripted_app(state: ScriptedEngine) -> web.Application:
    async def metrics(request: web.Request) -> web.StreamResponse:
        state.scrapes += 1
        if state.mode == "hang":
            await asyncio.sleep(3600)
        if state.mode == "500":
            return web.Response(status=500, text="internal error")
        if state.mode == "garbage":
            return web.Response(
                body=b"\x00\xff<html>not metrics</html>{{{", content_type="text/plain"
            )
        return web.Response(text=state.metrics_text(), content_type="text/plain")

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=state.health)

    async def completions(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        state.served += 1
        if body.get("max_tokens") == 999:  # "hold": answer only when the test says so
            await state.hold.wait()
        answer = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": body.get("model"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        }
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", completions)
    return app


@contextlib.asynccontextmanager
async def run_scripted(port: int = 0) -> AsyncIterator[tuple[ScriptedEngine, web.AppRunner]]:
    """Serve a :class:`ScriptedEngine` on 127.0.0.1 for a block."""
    state = ScriptedEngine()
    runner = web.AppRunner(scripted_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        state.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        yield state, runner
    finally:
        state.hold.set()
        await runner.cleanup()


# ---- kvgate as a subprocess ----------------------------------------------------------------


#: stderr read so far from each child started by :func:`start_kvgate`, and its reader task
_STDERR: dict[int, tuple[bytearray, asyncio.Task[None]]] = {}


async def start_kvgate(*args: str) -> asyncio.subprocess.Process:
    """``python -m kvgate ARGS`` as a child process (stdout discarded). Its stderr is read as
    it comes (:func:`stderr_so_far`), so the access log a busy gateway writes there never fills
    the pipe and blocks it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgate",
        *args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    stream, proc.stderr = proc.stderr, None  # communicate() only waits for the exit now
    buf = bytearray()

    async def drain() -> None:
        assert stream is not None
        while chunk := await stream.read(65536):
            buf.extend(chunk)

    _STDERR[proc.pid] = (buf, asyncio.create_task(drain()))
    return proc


def stderr_so_far(proc: asyncio.subprocess.Process) -> bytes:
    """What a child started by :func:`start_kvgate` wrote to stderr until now."""
    return bytes(_STDERR[proc.pid][0])


async def exited_stderr(proc: asyncio.subprocess.Process, timeout: float = 15.0) -> bytes:
    """Wait (bounded) for a child started by :func:`start_kvgate` to exit; its whole stderr."""
    await asyncio.wait_for(proc.wait(), timeout)
    buf, task = _STDERR.pop(proc.pid)
    await asyncio.wait_for(task, timeout)
    return bytes(buf)


async def wait_http_up(url: str, timeout: float = 30.0) -> None:
    """Poll ``GET url`` until it answers 200."""

    async def up() -> bool:
        try:
            async with aiohttp.ClientSession() as s, s.get(url) as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    await until(up, timeout=timeout, interval=0.1)


async def stop_process(
    proc: asyncio.subprocess.Process, sig: int = signal.SIGTERM, timeout: float = 20.0
) -> bytes:
    """Send ``sig`` and wait (bounded) for the exit; SIGKILL if it does not exit. Returns its
    stderr."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
    try:
        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
    if proc.pid in _STDERR:
        return await exited_stderr(proc, timeout)
    _, err = await proc.communicate()
    return err or b""
