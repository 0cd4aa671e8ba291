"""The cyclic garbage collector's share of a request, with Python's default thresholds and with
``kvgate serve``'s own (``kvgate.cli_serve.YOUNG_COLLECTION``), side by side in one run.

Gateways of 10 and of 100,000 tenants on a Redis store (one replica each, its own key prefix) —
and, with ``--local``, the same on the local store — each run twice: as ``kvgate serve`` runs
(a young collection every 10,000 net allocations) and with ``YOUNG_COLLECTION`` set back to
Python's defaults (700, 10, 10) before ``serve`` starts. Every gateway runs in a wrapper process
that times each collection through ``gc.callbacks`` and writes the totals to a file. The load is
``make bench-tenants``'s (``benches/tenants/run.py``): ``wrk`` sends non-streamed chat requests,
each with the key of a tenant drawn at random, to the fast fixed-answer upstream; the gateways
and Redis are pinned to the server CPU, ``wrk`` and the upstream to the client CPU; the setups
take turns in each round (reversed the next). Per window: 2xx answers per second, the gateway's
CPU per request (utime + stime from ``/proc``, Redis's not counted), the collector's time per
request, and wrk's latency percentiles.

Prints a table and rewrites the ``## The collector's thresholds`` section of
``benches/RESULTS.md`` (``--no-write``: only print). Needs ``wrk``, ``taskset`` and
``redis-server``. About 3 minutes on 2 cores.

Usage: ``.venv/bin/python benches/tenants/gc_threshold.py [--rounds 3] [--duration 4] [--local]
[--no-write]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent / "load"))
sys.path.insert(0, str(HERE.parent))

from run_load import Server, fast_upstream, free_port, tree_cpu_seconds  # noqa: E402

from kvgate.cli_serve import YOUNG_COLLECTION as KVGATE  # noqa: E402
from tenants.run import (  # noqa: E402
    COUNTS,
    config,
    load_arguments,
    median,
    missing,
    publish,
    run_dir,
    start_all,
    wrk,
)
from tenants.run import Setup as WrkSetup  # noqa: E402

SECTION = "## The collector's thresholds"
PYTHON_DEFAULT = (700, 10, 10)

#: runs ``kvgate serve`` (the arguments after ``-c CODE``) with the collector timed, and with
#: ``YOUNG_COLLECTION`` replaced when ``KVB_GC_THRESHOLD`` names other thresholds
WRAPPER = """
import gc, json, os, runpy, sys, threading, time
import kvgate.cli_serve
if os.environ.get("KVB_GC_THRESHOLD"):
    kvgate.cli_serve.YOUNG_COLLECTION = tuple(map(int, os.environ["KVB_GC_THRESHOLD"].split(",")))
totals = {"collections": 0, "seconds": 0.0}
started = [0.0]
def timed(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        totals["collections"] += 1
        totals["seconds"] += time.perf_counter() - started[0]
gc.callbacks.append(timed)
def write():
    out = os.environ["KVB_GC_OUT"]
    while True:
        time.sleep(0.2)
        with open(out + ".part", "w") as f:
            json.dump({**totals, "thresholds": gc.get_threshold()}, f)
        os.replace(out + ".part", out)
threading.Thread(target=write, daemon=True).start()
sys.argv[0] = "kvgate"
runpy.run_module("kvgate", run_name="__main__", alter_sys=True)
"""


@dataclass
class Setup:
    name: str
    store: str
    tenants: int
    thresholds: tuple[int, int, int]
    server: Server
    out: Path
    windows: list[dict[str, float]] = field(default_factory=list)

    def totals(self) -> dict[str, Any]:
        """The wrapper's last totals: collections, seconds spent in them, thresholds in force."""
        return dict(json.loads(self.out.read_text()))


def window(s: Setup, body: Path, args: argparse.Namespace) -> dict[str, float]:
    """One measured window of ``args.duration`` seconds on ``s``."""
    w = WrkSetup(s.name, s.tenants, s.store, s.server)
    before, cpu0 = s.totals(), tree_cpu_seconds(s.server.proc.pid)
    got = wrk(w, body, args, args.duration)
    cpu1 = tree_cpu_seconds(s.server.proc.pid)
    time.sleep(0.5)  # the wrapper writes its totals every 0.2 s
    after = s.totals()
    n = max(1, got["requests"])
    row = {
        "rps": got["requests"] / max(1, round(args.duration)),
        "cpu_us": (cpu1 - cpu0) / n * 1e6,
        "gc_us": (after["seconds"] - before["seconds"]) / n * 1e6,
        "collections": after["collections"] - before["collections"],
        "p50_ms": got["p50_us"] / 1000,
        "p99_ms": got["p99_us"] / 1000,
        "non_2xx": got["status_errors"],
    }
    s.windows.append(row)
    return row


def render(setups: list[Setup], args: argparse.Namespace, machine: str, took: float) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        SECTION,
        "",
        f"`.venv/bin/python benches/tenants/gc_threshold.py{' --local' if args.local else ''}`, "
        f"{when}, {took:.0f} s; every figure below comes from that run.",
        "",
        machine,
        "",
        "Each gateway in a wrapper that times every collection (`gc.callbacks`); `kvgate serve`'s "
        "thresholds (`kvgate.cli_serve.YOUNG_COLLECTION`) against Python's defaults, set in the "
        f"same wrapper before `serve` starts. The load of `make bench-tenants` (keys drawn at "
        f"random, `wrk` {args.connections} connections, {args.rounds} rounds of "
        f"{args.duration:g} s windows, the setups in turn, reversed every other round; gateways "
        "and Redis on one core, `wrk` and the upstream on the other). CPU per request: the "
        "gateway's alone (Redis's not counted). Medians over the rounds:",
        "",
        "| store | tenants | thresholds | 2xx/s | CPU µs/request | collector µs/request "
        "| collections/s | p50 ms | p99 ms | non-2xx |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in setups:
        ws = s.windows
        lines.append(
            f"| {s.store} | {s.tenants:,} | {', '.join(f'{t:,}' for t in s.thresholds)} "
            f"| {median([w['rps'] for w in ws]):,.0f} | {median([w['cpu_us'] for w in ws]):.0f} "
            f"| {median([w['gc_us'] for w in ws]):.1f} "
            f"| {median([w['collections'] for w in ws]) / args.duration:.0f} "
            f"| {median([w['p50_ms'] for w in ws]):.2f} | {median([w['p99_ms'] for w in ws]):.2f} "
            f"| {sum(w['non_2xx'] for w in ws):.0f} |"
        )
    lines += ["", "The CPU per request with 100,000 tenants ÷ with 10 (medians):", ""]
    lines += ["| store | Python's thresholds | kvgate's |", "|---|---|---|"]
    by = {(s.store, s.tenants, s.thresholds): s for s in setups}
    for store in dict.fromkeys(s.store for s in setups):
        ratio = []
        for th in (PYTHON_DEFAULT, KVGATE):
            few, many = by[(store, COUNTS[0], th)], by[(store, COUNTS[-1], th)]
            ratio.append(
                median([w["cpu_us"] for w in many.windows])
                / median([w["cpu_us"] for w in few.windows])
            )
        lines.append(f"| {store} | {ratio[0]:.2f}× | {ratio[1]:.2f}× |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = load_arguments(__doc__, rounds=3, duration=4)
    p.add_argument("--local", action="store_true", help="also the local store")
    args = p.parse_args(argv)
    if missing(("wrk", "taskset", "redis-server"), "gc bench"):
        return 2
    from tests.store.redis_servers import start_redis

    t0 = time.monotonic()
    load_start = os.getloadavg()
    logdir, body = run_dir("gc-")
    up = fast_upstream()
    with start_redis(logdir / "redis") as redis:
        subprocess.run(["taskset", "-p", "-c", args.server_cpu, str(redis.pid)],
                       check=True, capture_output=True)  # fmt: skip
        version = redis.client().info("server")["redis_version"]
        setups: list[Setup] = []
        for store in ("local", "redis") if args.local else ("redis",):
            for n in COUNTS:
                for th in (PYTHON_DEFAULT, KVGATE):
                    tag = f"{store}-{n}-{th[0]}"
                    port = free_port()
                    st = {"url": redis.url, "key_prefix": f"kvbgc{n}x{th[0]}"}
                    path = logdir / f"{tag}.json"
                    path.write_text(
                        json.dumps(config(up.url, port, n, st if store == "redis" else None))
                    )
                    out = logdir / f"{tag}.gc.json"
                    env = ["env", f"KVB_GC_OUT={out}"]
                    if th != KVGATE:
                        env.append(f"KVB_GC_THRESHOLD={','.join(map(str, th))}")
                    argv = [*env, sys.executable, "-c", WRAPPER, "serve", "--config", str(path),
                            "--log-level", "WARNING"]  # fmt: skip
                    setups.append(
                        Setup(tag, store, n, th, Server(tag, argv, port, "/healthz"), out)
                    )
        try:
            start_all(up, [s.server for s in setups], args, logdir)
            for s in setups:
                wrk(WrkSetup(s.name, s.tenants, s.store, s.server), body, args, args.warmup)
                if tuple(s.totals()["thresholds"]) != s.thresholds:
                    raise RuntimeError(f"{s.name}: thresholds {s.totals()['thresholds']}")
            for r in range(args.rounds):
                for s in setups if r % 2 == 0 else setups[::-1]:
                    w = window(s, body, args)
                    print(f"  round {r + 1} {s.name:<18} {w['rps']:7,.0f} 2xx/s "
                          f"{w['cpu_us']:5.0f} µs/request, collector {w['gc_us']:6.1f} µs/request "
                          f"p99 {w['p99_ms']:.1f} ms", flush=True)  # fmt: skip
        finally:
            for s in setups:
                s.server.stop()
            up.stop()
    machine = (
        f"Machine: {os.cpu_count()} vCPUs, shared (load average {load_start[0]:.2f} at start, "
        f"{os.getloadavg()[0]:.2f} at end). redis-server {version}."
    )
    publish(SECTION, render(setups, args, machine, time.monotonic() - t0), args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
