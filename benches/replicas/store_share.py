"""What the Redis store costs a replica per request, far from the limits, without the noise of
wall-clock throughput on a shared machine: the Python functions each request runs, counted and
timed by :mod:`cProfile` in one gateway on its local store and in one of three gateways on one
``redis-server`` (the other two live in Redis, idle), both driven by ``wrk`` the same way.

Each gateway runs under a small wrapper that turns the profiler on at ``SIGUSR1`` and off at
``SIGUSR2`` (writing its statistics), so start-up and warm-up are left out: the profile covers
only ``--seconds`` of steady load. The setups take turns ``--rounds`` times. Printed per round:
requests, the gateway process's CPU per request over the profiled window (µs, ``/proc``; the
profiler's own cost included) and the own time of the functions that a request on the Redis
store runs and one on the local store does not: those of ``kvgate/store/``,
:class:`kvgate.admission.stage.StoreAdmission` and the :class:`kvgate._core.QuotaLedger`
methods (the profiler slows such small functions more than the rest, so their share is if
anything overstated).

Usage: ``.venv/bin/python benches/replicas/store_share.py [--rounds 2] [--seconds 6]``
(needs ``redis-server``, ``wrk`` and ``taskset``; about a minute).
"""

from __future__ import annotations

import argparse
import json
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import run  # benches/replicas/run.py: the gateways' configuration, wrk, Server
from run_load import Server, free_port, run_wrk, tree_cpu_seconds

#: turns a new cProfile on at SIGUSR1 and off at SIGUSR2 (dumping to argv[1]), then runs kvgate
WRAPPER = """
import cProfile, runpy, signal, sys
out = sys.argv.pop(1)
prof = [cProfile.Profile()]
def _start(*_):
    prof[0] = cProfile.Profile()  # a new one each time: a profile's statistics add up
    prof[0].enable()
def _dump(*_):
    prof[0].disable()
    prof[0].dump_stats(out)
signal.signal(signal.SIGUSR1, _start)
signal.signal(signal.SIGUSR2, _dump)
sys.argv[0] = "kvgate"
runpy.run_module("kvgate", run_name="__main__")
"""

#: the functions a request runs only on the Redis store (file, or qualified name, fragments)
STORE_FILES = ("kvgate/store/",)
STORE_NAMES = ("QuotaLedger", "StoreAdmission", "stage.py:53(release)", "stage.py:47(__init__)")


def profiled(server: Server, out: Path) -> Server:
    """``server`` started under :data:`WRAPPER`, its profile written to ``out``."""
    argv = [sys.executable, "-c", WRAPPER, str(out), *server.argv[3:]]
    return Server(server.name, argv, server.port, ready_path="/healthz")


def own_time(path: Path) -> float:
    """The store's functions' own time in a profile (seconds)."""
    store = 0.0
    for (file, line, name), (_, _, tt, _, _) in pstats.Stats(str(path)).stats.items():  # type: ignore[attr-defined]
        where = f"{file}:{line}({name})"
        if any(f in file for f in STORE_FILES) or any(n in where for n in STORE_NAMES):
            store += tt
    return store


def measure(
    args: argparse.Namespace, logdir: Path, up: Server, redis_url: str, started: list[Server]
) -> dict[str, list[tuple[int, float, float]]]:
    """The rounds: by setup, (requests, CPU µs per request of the profiled gateway process,
    the store's functions' own µs per request)."""
    body = logdir / "body.json"
    body.write_text(json.dumps(run.BODY))
    store = {"url": redis_url, "key_prefix": "kvgshare"}
    gw = {
        "local": profiled(run.gateway_server(logdir, up.url, "local", None), logdir / "local.prof"),
        "redis": profiled(
            run.gateway_server(logdir, up.url, "redis0", store), logdir / "redis.prof"
        ),
    }
    # the two other replicas: live in Redis (each scope counts three), idle
    idle = [run.gateway_server(logdir, up.url, f"redis{i}", store) for i in (1, 2)]
    run.start_all(up, [*gw.values(), *idle], started, args.client_cpu, args.server_cpu, logdir)
    headers = {"Authorization": f"Bearer {run.KEY}"}
    rows: dict[str, list[tuple[int, float, float]]] = {"local": [], "redis": []}
    for r in range(args.rounds):
        for mode in ("local", "redis") if r % 2 == 0 else ("redis", "local"):
            s = gw[mode]
            assert s.proc is not None
            run_wrk(s.url, body, connections=args.connections, seconds=1, cpu=args.client_cpu,
                    headers=headers)  # fmt: skip
            prof = logdir / f"{mode}.prof"
            prof.unlink(missing_ok=True)
            cpu0 = tree_cpu_seconds(s.proc.pid)
            s.proc.send_signal(signal.SIGUSR1)
            w = run_wrk(s.url, body, connections=args.connections, seconds=args.seconds,
                        cpu=args.client_cpu, headers=headers)  # fmt: skip
            s.proc.send_signal(signal.SIGUSR2)
            cpu = tree_cpu_seconds(s.proc.pid) - cpu0
            size, deadline = -1, time.monotonic() + 30
            while time.monotonic() < deadline:  # written, and no longer growing
                now = prof.stat().st_size if prof.exists() else -1
                if now > 0 and now == size:
                    break
                size = now
                time.sleep(0.1)
            n = int(w["requests"])
            own = own_time(prof)
            rows[mode].append((n, cpu / n * 1e6, own / n * 1e6))
            print(f"round {r + 1} {mode:5}: {n:6,} requests ({int(w['status_errors'])} not 2xx), "
                  f"CPU {cpu / n * 1e6:6.0f} µs/request (profiled), of it the store's functions "
                  f"{own / n * 1e6:5.1f} µs ({own / cpu:.1%})", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--server-cpu", default="1")
    p.add_argument("--client-cpu", default="0")
    args = p.parse_args(argv)
    for tool in ("wrk", "taskset", "redis-server"):
        if shutil.which(tool) is None:
            print(f"store_share: needs {tool}", file=sys.stderr)
            return 2
    sys.path.insert(0, str(run.ROOT))
    from tests.store.redis_servers import start_redis

    logdir = Path(tempfile.mkdtemp(prefix="kvgate-share-"))
    up_port = free_port()
    up = Server(
        "upstream",
        [sys.executable, str(run.HERE.parent / "load" / "fast_upstream.py"), str(up_port)],
        up_port,
    )
    started: list[Server] = []
    with start_redis(logdir / "redis") as redis:
        subprocess.run(["taskset", "-p", "-c", args.server_cpu, str(redis.pid)],
                       check=True, capture_output=True)  # fmt: skip
        try:
            rows = measure(args, logdir, up, redis.url, started)
        finally:
            for s in reversed(started):
                s.stop()
    shutil.rmtree(logdir, ignore_errors=True)
    share = statistics.median(o / t for _, t, o in rows["redis"])
    print(f"median share of the store's functions in a request on Redis: {share:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
