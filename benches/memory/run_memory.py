"""Memory per open stream: kvgate (one worker process) against a bare aiohttp pass-through.

For each proxy and each completion length, a fresh proxy process sits in front of a fast fake
engine (:func:`engine_main`, its own process). ``STREAMS`` concurrent streaming requests go
through it; the engine sends each one all its completion tokens (one SSE event per token, 16
per write, 10 ms apart: up to 1,600 tokens/s per stream, a fast engine), then holds the stream
open until every client has received them all. The
proxy's resident set (``VmRSS``) is read then, with all streams open, and before the round
(idle, after a short warm-up); the growth divided by the number of streams is the memory one
open stream costs. The engine then ends every stream (usage, ``[DONE]``).

Targets: kvgate ≤ 64 KiB per open stream, and the 1k- and 8k-token rounds within 10% of each
other (memory per stream independent of its length).

Usage: ``python benches/memory/run_memory.py [--streams N] [--lengths 1000,8000] [--batch 16]
[--pause 0.01]``; rewrites the "Memory per stream" section of ``benches/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benches" / "RESULTS.md"
SECTION = "## Memory per stream"
sys.path.insert(0, str(ROOT / "benches"))
import core_results  # noqa: E402

BARE = ROOT / "benches" / "load" / "bare_proxy.py"
MODEL = "fast"
TARGET_KIB = 64.0


# ---- the fake engine (run as `run_memory.py engine PORT`) -------------------------------------


def engine_main(port: int, batch: int, pause: float) -> None:
    """Serve the fake engine: ``POST /v1/chat/completions`` streams ``max_tokens`` token events
    (``batch`` per write, ``pause`` seconds between writes), then waits for ``GET /release``;
    ``GET /release`` ends every waiting stream."""
    import uvloop
    from aiohttp import web

    token = b'data: {"choices":[{"index":0,"delta":{"content":" tok"}}]}\n\n'
    tail = b'data: {"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":%d}}\n\n'
    state = {"release": asyncio.Event()}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        release = state["release"]
        sent = 0
        while sent < n:
            k = min(batch, n - sent)
            await resp.write(token * k)
            sent += k
            await asyncio.sleep(pause)
        await release.wait()
        await resp.write(tail % n + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def do_release(request: web.Request) -> web.Response:
        state["release"].set()
        state["release"] = asyncio.Event()
        return web.Response(text="ok")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/release", do_release)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, backlog=4096)


# ---- the round -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> int:
    """``VmRSS`` of ``pid`` (KiB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def wait_up(url: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url) as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up")
            await asyncio.sleep(0.2)


async def start(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )


async def start_kvgate(
    engine: str, port: int, streams: int, tmp: Path
) -> asyncio.subprocess.Process:
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "workers": 1,
        "backends": [
            {
                "name": "engine",
                "url": engine,
                "models": [{"name": MODEL, "context_window": 65536}],
                "max_concurrency": streams + 16,
                "adaptive": {"enabled": False},
            }
        ],
        "timeouts": {"total": 600, "idle": 300, "first_byte": 60},
    }
    path = tmp / "kvgate.yaml"
    path.write_text(json.dumps(config))
    proc = await start(sys.executable, "-m", "kvgate", "serve", "--config", str(path))
    await wait_up(f"http://127.0.0.1:{port}/healthz")
    return proc


async def one_round(
    proxy_url: str, engine_url: str, pid: int, streams: int, length: int
) -> dict[str, float]:
    """Idle RSS, RSS with ``streams`` streams of ``length`` tokens open, per-stream growth."""
    token_bytes = len(b'data: {"choices":[{"index":0,"delta":{"content":" tok"}}]}\n\n')
    want = token_bytes * length
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "count"}],
            "max_tokens": length,
            "stream": True,
        }
        full = 0
        all_full = asyncio.Event()

        async def stream(warm: bool = False) -> None:
            nonlocal full
            got = 0
            counted = False
            async with s.post(proxy_url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"{r.status}: {await r.text()}")
                async for part in r.content.iter_any():
                    got += len(part)
                    if not counted and got >= want and not warm:
                        counted = True
                        full += 1
                        if full == streams:
                            all_full.set()

        async def release() -> None:
            async with s.get(engine_url + "/release") as r:
                await r.read()

        # warm-up: a few streams through the proxy (imports, first buffers)
        warm = asyncio.gather(*(stream(warm=True) for _ in range(8)))
        while not warm.done():  # released until every warm-up stream has ended
            await asyncio.sleep(0.2)
            await release()
        await warm
        await asyncio.sleep(1.0)
        idle = rss_kib(pid)
        started = time.monotonic()
        tasks = [asyncio.create_task(stream()) for _ in range(streams)]
        while not all_full.is_set():
            await asyncio.sleep(0.5)
            failed = [t for t in tasks if t.done() and t.exception() is not None]
            if failed:
                raise RuntimeError(f"{len(failed)} streams failed: {failed[0].exception()!r}")
            if time.monotonic() - started > 600:
                raise RuntimeError(f"only {full} of {streams} streams filled in 600 s")
        await asyncio.sleep(1.0)  # let the last writes settle
        open_rss = rss_kib(pid)
        fill_s = time.monotonic() - started
        await release()
        await asyncio.gather(*tasks)
    return {
        "idle_kib": idle,
        "open_kib": open_rss,
        "per_stream_kib": (open_rss - idle) / streams,
        "fill_s": fill_s,
    }


async def measure(
    streams: int, lengths: list[int], batch: int, pause: float, only: str | None = None
) -> dict[str, dict[int, dict[str, float]]]:
    engine_port = free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    engine = await start(
        sys.executable, __file__, "engine", str(engine_port), str(batch), str(pause)
    )
    out: dict[str, dict[int, dict[str, float]]] = {"kvgate": {}, "bare aiohttp": {}}
    try:
        await wait_up(engine_url + "/v1/models")
        for name in out:
            if only is not None and name != only:
                continue
            for length in lengths:
                port = free_port()
                with tempfile.TemporaryDirectory() as tmp:
                    if name == "kvgate":
                        proc = await start_kvgate(engine_url, port, streams, Path(tmp))
                        pid = worker_pid(proc.pid)
                    else:
                        proc = await start(sys.executable, str(BARE), str(port), engine_url)
                        await wait_up(f"http://127.0.0.1:{port}/v1/chat/completions")
                        pid = proc.pid
                    try:
                        res = await one_round(
                            f"http://127.0.0.1:{port}", engine_url, pid, streams, length
                        )
                    finally:
                        proc.terminate()
                        await proc.wait()
                out[name][length] = res
                print(
                    f"{name:13s} {length:5d} tokens: idle {res['idle_kib'] / 1024:.1f} MiB, "
                    f"{streams} open {res['open_kib'] / 1024:.1f} MiB, "
                    f"{res['per_stream_kib']:.1f} KiB/stream (filled in {res['fill_s']:.1f} s)",
                    flush=True,
                )
    finally:
        engine.terminate()
        await engine.wait()
    return out


def worker_pid(pid: int) -> int:
    """The process serving requests: ``pid`` itself with one worker (kvgate serves in the
    master then), else its only child."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    kids = children.read_text().split() if children.exists() else []
    return int(kids[0]) if len(kids) == 1 else pid


def render(
    res: dict[str, dict[int, dict[str, float]]],
    streams: int,
    lengths: list[int],
    batch: int,
    pause: float,
) -> str:
    lines = [
        SECTION,
        "",
        f"`make bench-memory` (`benches/memory/run_memory.py --streams {streams}`): {streams} "
        "concurrent streams through one proxy process from a fast fake engine that sends each "
        f"stream all its completion tokens (one SSE event per token, {batch} per write, "
        f"{pause * 1000:g} ms apart; no tokenizer: the text is counted by the byte estimate) "
        "and then holds it open; the proxy's RSS with all streams "
        "open minus its RSS idle (after a warm-up), divided by the number of streams. A fresh "
        "proxy process per row.",
        "",
        "| proxy | tokens per stream | RSS idle (MiB) | RSS, all open (MiB) | per open stream (KiB) |",
        "|---|---|---|---|---|",
    ]
    for name, rows in res.items():
        for length in lengths:
            r = rows[length]
            lines.append(
                f"| {name} | {length} | {r['idle_kib'] / 1024:.1f} | {r['open_kib'] / 1024:.1f} "
                f"| {r['per_stream_kib']:.1f} |"
            )
    kv = [res["kvgate"][n]["per_stream_kib"] for n in lengths]
    spread = (max(kv) - min(kv)) / max(kv) if max(kv) > 0 else 0.0
    ok = max(kv) <= TARGET_KIB
    lines += [
        "",
        f"kvgate: at most {max(kv):.1f} KiB per open stream (target ≤ {TARGET_KIB:.0f} KiB: "
        f"{'met' if ok else 'not met'}); the lengths differ by {spread * 100:.0f}% "
        f"(target ≤ 10%: {'met' if spread <= 0.10 else 'not met'}). "
        f"{platform.node() and 'Measured'} {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, aiohttp {aiohttp.__version__}.",
    ]
    return "\n".join(lines) + "\n"


def write_section(text: str) -> None:
    """Replaces (or appends) :data:`SECTION` in ``benches/RESULTS.md``."""
    core_results.write_section(RESULTS, SECTION, text)


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "engine":
        engine_main(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--lengths", default="1000,8000")
    parser.add_argument("--batch", type=int, default=16, help="token events per engine write")
    parser.add_argument(
        "--pause", type=float, default=0.01, help="seconds between an engine's writes"
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--only", choices=["kvgate", "bare aiohttp"], help="one proxy (print only)")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    # each stream holds a socket in the client, two in the proxy and one in the engine
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * args.streams + 1024)), hard)
    )
    res = asyncio.run(measure(args.streams, lengths, args.batch, args.pause, args.only))
    if args.only:
        return
    text = render(res, args.streams, lengths, args.batch, args.pause)
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
