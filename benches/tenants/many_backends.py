"""A gateway of one backend and one of 1,000 backends serving the same model, side by side in
one run, end to end.

Each ``kvgate serve`` sits in front of the fast fixed-answer upstream
(``benches/load/fast_upstream.py``, which also answers ``/metrics`` and ``/health``); every
backend points at it, serves the model ``fast``, has 100,000 slots and adaptive limits off, so
each request is routed among all of a gateway's backends (the one with the most headroom). The
engine pollers run as in production: each backend's metrics and health are read every second.
Per gateway: CPU per second while idle (the pollers), then ``wrk`` windows (32 connections,
one tenant far from its limits; the gateways pinned to the *server CPU*, ``wrk`` and the
upstream to the *client CPU*, the two gateways in turn): 2xx/s, CPU per request, and CPU per
request less the idle rate (what a request itself costs). Then ``GET /metrics``: its time and
size, and the event loop's longest stop while it is served (the gap between answers of
``GET /healthz`` sent one after another meanwhile).

Usage: ``.venv/bin/python benches/tenants/many_backends.py [--rounds 3] [--duration 3]``
(prints only; figures go into ``benches/RESULTS.md`` by hand)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE.parent / "load"), str(HERE.parent), str(HERE), str(ROOT)]

import run as tenants_run  # noqa: E402
from run_load import Server, fast_upstream, free_port, tree_cpu_seconds  # noqa: E402

COUNTS = (1, 1_000)


def config(upstream: str, port: int, n: int) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "backends": [
            {
                "name": f"b{i}",
                "url": upstream,
                "models": [{"name": "fast", "context_window": 8192}],
                "max_concurrency": 100_000,
                "adaptive": {"enabled": False},
            }
            for i in range(n)
        ],
        "tenants": [
            {
                "name": "t0",
                "api_key_sha256": [hashlib.sha256(b"sk-t0").hexdigest()],
                "max_concurrency": 1000,
                "tokens_per_minute": 10**12,
            }
        ],
        "access_log": {"enabled": False},
    }


def idle_cpu(server: Server, seconds: float) -> float:
    """CPU seconds per second the idle gateway uses."""
    assert server.proc is not None
    c0 = tree_cpu_seconds(server.proc.pid)
    time.sleep(seconds)
    return (tree_cpu_seconds(server.proc.pid) - c0) / seconds


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=3)
    p.add_argument("--server-cpu", default="1")
    p.add_argument("--client-cpu", default="0")
    args = p.parse_args()
    args.connections = 32
    logdir = Path(tempfile.mkdtemp(prefix="backends-"))
    body = logdir / "body.json"
    body.write_text(json.dumps(tenants_run.BODY))
    py = sys.executable
    up = fast_upstream()
    setups: list[tenants_run.Setup] = []
    for n in COUNTS:
        port = free_port()
        path = logdir / f"backends-{n}.json"
        path.write_text(json.dumps(config(up.url, port, n)))
        argv = [py, "-m", "kvgate", "serve", "--config", str(path), "--log-level", "WARNING"]
        setups.append(tenants_run.Setup(f"{n} backends", 1, "local",
                                        Server(f"backends-{n}", argv, port, "/healthz")))  # fmt: skip
    idle: dict[str, list[float]] = {s.name: [] for s in setups}
    rows: dict[str, list[tuple[float, float, float]]] = {s.name: [] for s in setups}
    try:
        tenants_run.start_all(up, [s.server for s in setups], args, logdir)
        for s in setups:
            tenants_run.wrk(s, body, args, 1)  # warm-up
        time.sleep(2)
        for r in range(args.rounds):
            for s in setups if r % 2 == 0 else setups[::-1]:
                rate = idle_cpu(s.server, 3)
                idle[s.name].append(rate)
                assert s.server.proc is not None
                cpu0 = tree_cpu_seconds(s.server.proc.pid)
                w = tenants_run.wrk(s, body, args, args.duration)
                cpu = tree_cpu_seconds(s.server.proc.pid) - cpu0
                secs = w["duration_us"] / 1e6
                n = w["requests"]
                rows[s.name].append((n / secs, cpu / n * 1e6, (cpu - rate * secs) / n * 1e6))
                print(f"  round {r + 1} {s.name:<14} idle {100 * rate:4.1f}% of a core  "
                      f"{n / secs:7,.0f} 2xx/s  {cpu / n * 1e6:5.0f} µs/request  "
                      f"{(cpu - rate * secs) / n * 1e6:5.0f} less idle  non-2xx "
                      f"{w['status_errors']}", flush=True)  # fmt: skip
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
