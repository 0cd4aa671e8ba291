"""A gateway of one backend and one of 1,000 backends serving the same model, side by side in
one run, end to end.

Each ``kvgate serve`` sits in front of the fast fixed-answer upstream
(``benches/load/fast_upstream.py``, which also answers ``/metrics`` and ``/health``); every
backend points at it, serves the model ``fast``, has 100,000 slots and adaptive limits off, so
each request is routed among all of a gateway's backends (the one with the most headroom). The
engine pollers run as in production: each backend's metrics and health are read every second.
First, in this process, the time of the choice alone among 1 to 1,000 replicas, and what a
scrape of ``/metrics`` and the dashboard's data cost on the event loop and off it when every
one of 1,000 backends has served. Then, per
gateway: CPU per second while idle (the pollers), then ``wrk`` windows (32 connections,
one tenant far from its limits; the gateways pinned to the *server CPU*, ``wrk`` and the
upstream to the *client CPU*, the two gateways in turn): 2xx/s, CPU per request, and CPU per
request less the idle rate (what a request itself costs). Then ``GET /metrics``: its time and
size, and the event loop's longest stop while it is served (the gap between answers of
``GET /healthz`` sent one after another meanwhile).

With ``--redis`` both gateways keep their limits on a Redis store (a ``redis-server`` of the
bench's own, pinned to the server CPU, its CPU counted with the gateway's), and the Redis calls
per second while idle and per request are printed too.

With ``--workers N`` it measures only a gateway of 1,000 backends run with ``kvgate serve
--workers N``, idle: its CPU per second (all workers) and the scrapes of ``/metrics`` per second
the upstream answers (1,000 when each engine is scraped once a second, ``N`` × 1,000 when
every worker scrapes every engine), ``--rounds`` windows of 5 s after a 5 s warm-up. The
upstream's ``/metrics`` then carries vLLM's gauges (``--vllm-metrics``), so every scrape is a
good reading that goes through each worker's sink, as with an engine.

Usage: ``.venv/bin/python benches/tenants/many_backends.py [--rounds 3] [--duration 3]
[--redis] [--workers N]`` (prints only; figures go into ``benches/RESULTS.md`` by hand)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE.parent / "load"), str(HERE.parent), str(HERE), str(ROOT)]

import run as tenants_run  # noqa: E402
from run_load import Server, fast_upstream, free_port, tree_cpu_seconds  # noqa: E402

COUNTS = (1, 1_000)


def config(upstream: str, port: int, n: int, store: dict[str, Any] | None) -> dict[str, Any]:
    """The tenants bench's gateway of one tenant (``t0``, key ``sk-t0``, far from its limits)
    with ``n`` backends ``b<i>`` serving the model ``fast``."""
    cfg = tenants_run.config(upstream, port, 1, store)
    one = cfg["backends"][0]
    cfg["backends"] = [{**one, "name": f"b{i}"} for i in range(n)]
    return cfg


def cpu(server: Server, redis_url: str | None) -> float:
    """CPU seconds the gateway (and the Redis server, with one) used so far."""
    assert server.proc is not None
    return tree_cpu_seconds(server.proc.pid) + tenants_run.redis_cpu(redis_url)


def idle_cpu(server: Server, redis_url: str | None, seconds: float) -> float:
    """CPU seconds per second the idle gateway (and Redis) use."""
    c0 = cpu(server, redis_url)
    time.sleep(seconds)
    return (cpu(server, redis_url) - c0) / seconds


def choice_alone() -> None:
    """Prints the time of one ``ReplicaSet.most_headroom`` (the routing stage's choice) among
    1, 10, 100 and 1,000 replicas, in this process (best of 5 rounds of 20,000)."""
    from kvgate import AdmissionController, ReplicaSet

    for n in (1, 10, 100, 1000):
        ctl = AdmissionController(backends=n, tenants=1)
        ids = [ctl.add_backend(f"b{i}", max_concurrency=100, tokens_per_minute=10**9)
               for i in range(n)]  # fmt: skip
        replicas = ReplicaSet(ids)
        for i in ids:
            replicas.set_kv_usage(i, (i % 7) / 10)
        choose = functools.partial(replicas.most_headroom, ctl)
        best = min(timeit.repeat(choose, number=20_000, repeat=5))
        print(f"  the choice among {n:5,} replicas: {best / 20_000 * 1e6:.2f} µs", flush=True)


def scrape_parts(n: int = 1_000) -> None:
    """Prints, in this process, what ``GET /metrics`` and ``GET /dashboard/data`` cost a gateway
    of ``n`` backends whose every backend has served (a refusal, a request, a first token
    each): the part on the event loop and the part a worker thread takes, against all of it
    on the loop (best of 5)."""
    from prometheus_client import generate_latest

    from kvgate.config import Config
    from kvgate.gateway_build import build_gateway

    cfg = Config.model_validate(
        {
            "backends": [
                {
                    "name": f"b{i}",
                    "url": "http://127.0.0.1:9",
                    "models": [{"name": "fast", "context_window": 8192}],
                    "max_concurrency": 100,
                }
                for i in range(n)
            ],
            "tenants": [{"name": "t0", "api_key_sha256": ["0" * 64]}],
        }
    )
    m = build_gateway(cfg, poll=False).metrics
    for i in range(n):
        m.rejections.labels(f"b{i}", "backend-slots").inc()
        m.requests.labels(f"b{i}", "t0", "ok").inc()
        m.ttft_seconds.labels(f"b{i}", "standard").observe(0.3)
        m.tokens_reserved.labels(f"b{i}").inc(16)

    def every_family() -> list[Any]:  # what the dashboard read before: the whole registry
        m.flush()
        return list(m.registry.collect())

    def best(f: Any) -> float:
        return min(timeit.repeat(f, number=1, repeat=5)) * 1000

    rows = [
        ("`GET /metrics`, all on the loop (before)", best(lambda: generate_latest(m.registry)), 0.0),
        ("`GET /metrics`, now", best(m.snapshot), best(m.snapshot())),
        ("`GET /dashboard/data`'s families, all on the loop (before)", best(every_family), 0.0),
        ("`GET /dashboard/data`'s families, now", best(m.dashboard_families),
         best(m.dashboard_families())),
    ]  # fmt: skip
    for what, loop, thread in rows:
        print(f"  {what}: {loop:.1f} ms on the loop, {thread:.1f} ms on a worker thread")


def store_calls(url: str, redis_url: str | None) -> int:
    """Redis calls the gateway made so far (0 on the local store)."""
    return tenants_run.store_calls(url)[0] if redis_url else 0


def scrape_stall(url: str) -> tuple[float, float, float]:
    """``GET /metrics``: seconds, kB, and the longest gap (s) between answers of ``/healthz``
    requested one after another while it is served."""
    gaps: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            with urllib.request.urlopen(url + "/healthz", timeout=10) as r:
                r.read()
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    th = threading.Thread(target=probe)
    th.start()
    time.sleep(0.2)
    secs, body = tenants_run.get(url + "/metrics")
    time.sleep(0.1)
    stop.set()
    th.join()
    return secs, len(body) / 1000, max(gaps)


def scrapes(up: Server) -> int:
    """``GET /metrics`` the fast upstream has answered so far."""
    with urllib.request.urlopen(up.url + "/scrapes", timeout=10) as r:
        return int(r.read())


def workers_idle(args: argparse.Namespace, logdir: Path) -> None:
    """Prints the idle CPU and the engine scrapes per second of a gateway of 1,000 backends
    with ``args.workers`` workers (see the module docstring)."""
    up = fast_upstream()
    up.argv.append("--vllm-metrics")
    port = free_port()
    path = logdir / "backends-workers.json"
    cfg = config(up.url, port, COUNTS[-1], None)
    cfg["workers"] = args.workers
    path.write_text(json.dumps(cfg))
    argv = [sys.executable, "-m", "kvgate", "serve", "--config", str(path), "--log-level",
            "WARNING"]  # fmt: skip
    gw = Server("backends-workers", argv, port, "/healthz")
    try:
        tenants_run.start_all(up, [gw], args, logdir)
        time.sleep(5)  # every worker started and polling
        for r in range(args.rounds):
            s0, c0, t0 = scrapes(up), cpu(gw, None), time.monotonic()
            time.sleep(5)
            s1, c1, t1 = scrapes(up), cpu(gw, None), time.monotonic()
            print(f"  round {r + 1}: {args.workers} workers, {COUNTS[-1]:,} backends, idle: "
                  f"{100 * (c1 - c0) / (t1 - t0):.1f}% of a core, "
                  f"{(s1 - s0) / (t1 - t0):,.0f} engine scrapes/s", flush=True)  # fmt: skip
    finally:
        gw.stop()
        up.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=3)
    p.add_argument("--server-cpu", default="1")
    p.add_argument("--client-cpu", default="0")
    p.add_argument("--redis", action="store_true", help="both gateways on a Redis store")
    p.add_argument("--workers", type=int, default=0,
                   help="only the idle cost of a gateway of 1,000 backends with N workers")  # fmt: skip
    args = p.parse_args()
    args.connections = 32
    if args.workers:
        workers_idle(args, Path(tempfile.mkdtemp(prefix="backends-")))
        return 0
    choice_alone()
    scrape_parts()
    logdir = Path(tempfile.mkdtemp(prefix="backends-"))
    body = logdir / "body.json"
    body.write_text(json.dumps(tenants_run.BODY))
    py = sys.executable
    up = fast_upstream()
    stack = contextlib.ExitStack()
    redis_url = None
    if args.redis:
        from tests.store.redis_servers import start_redis

        redis = stack.enter_context(start_redis(logdir / "redis"))
        subprocess.run(["taskset", "-p", "-c", args.server_cpu, str(redis.pid)], check=True,
                       capture_output=True)  # fmt: skip
        redis_url = redis.url
    setups: list[tenants_run.Setup] = []
    for n in COUNTS:
        port = free_port()
        path = logdir / f"backends-{n}.json"
        store = None if redis_url is None else {"url": redis_url, "key_prefix": f"kvgb{n}"}
        path.write_text(json.dumps(config(up.url, port, n, store)))
        argv = [py, "-m", "kvgate", "serve", "--config", str(path), "--log-level", "WARNING"]
        setups.append(tenants_run.Setup(f"{n} backends", 1, "local",
                                        Server(f"backends-{n}", argv, port, "/healthz")))  # fmt: skip
    idle: dict[str, list[float]] = {s.name: [] for s in setups}
    rows: dict[str, list[tuple[float, float, float]]] = {s.name: [] for s in setups}
    try:
        stack.__enter__()
        tenants_run.start_all(up, [s.server for s in setups], args, logdir)
        for s in setups:
            tenants_run.wrk(s, body, args, 1)  # warm-up
        time.sleep(2)
        for r in range(args.rounds):
            for s in setups if r % 2 == 0 else setups[::-1]:
                calls0 = store_calls(s.server.url, redis_url)
                rate = idle_cpu(s.server, redis_url, 3)
                calls1 = store_calls(s.server.url, redis_url)
                idle[s.name].append(rate)
                c1 = cpu(s.server, redis_url)
                w = tenants_run.wrk(s, body, args, args.duration)
                used = cpu(s.server, redis_url) - c1
                secs = w["duration_us"] / 1e6
                n = w["requests"]
                calls2 = store_calls(s.server.url, redis_url)
                rows[s.name].append((n / secs, used / n * 1e6, (used - rate * secs) / n * 1e6))
                calls = ""
                if redis_url:
                    calls = (f"  Redis calls: idle {(calls1 - calls0) / 3:.1f}/s, "
                             f"{(calls2 - calls1) / n:.4f} per request")  # fmt: skip
                print(f"  round {r + 1} {s.name:<14} idle {100 * rate:4.1f}% of a core  "
                      f"{n / secs:7,.0f} 2xx/s  {used / n * 1e6:5.0f} µs/request  "
                      f"{(used - rate * secs) / n * 1e6:5.0f} less idle  non-2xx "
                      f"{w['status_errors']}{calls}", flush=True)  # fmt: skip
        print()
        print("| gateway | idle CPU (% of a core) | 2xx/s | CPU µs/request | less idle | "
              "`GET /metrics` s / kB | loop's longest stop meanwhile (ms) |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for s in setups:
            secs, kb, stall = scrape_stall(s.server.url)
            med = [statistics.median(x[i] for x in rows[s.name]) for i in range(3)]
            print(f"| {s.name} | {100 * statistics.median(idle[s.name]):.1f} | {med[0]:,.0f} | "
                  f"{med[1]:.0f} | {med[2]:.0f} | {secs:.3f} / {kb:.0f} | {1000 * stall:.0f} |")  # fmt: skip
    finally:
        for s in setups:
            s.server.stop()
        up.stop()
        stack.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
