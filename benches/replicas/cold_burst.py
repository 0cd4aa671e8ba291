"""Bursts after a quiet spell, on replicas that share their limits through Redis.

A tenant far from its limits goes quiet long enough for every replica to give its quota back
(``--idle`` seconds, past the lease), then ``wrk`` sends a burst (``--connections`` at once for
``--burst`` seconds) to every replica. Until a replica holds quota again, its admissions are
decided in Redis; one whose reply comes later than ``deadline_ms`` (the replica's event loop busy
with the burst) is decided by the fallback policy instead: ``kvgate_store_failures_total
{kind="late"}``, one per such admission. Prints, per burst: 2xx/s, late admissions, Redis
calls, per replica.

Setup as in ``run.py``'s throughput part: the fast fixed-answer upstream and ``wrk`` on
``--client-cpu``, the gateways and a ``redis-server`` of its own on ``--server-cpu``.

Usage (from the repository root, after ``make build``; needs ``wrk``, ``redis-server``,
``taskset``)::

    .venv/bin/python benches/replicas/cold_burst.py [--replicas 1] [--bursts 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "load"), str(HERE.parent), str(HERE.parents[1])]

import run as R  # noqa: E402
from run_load import Server, fast_upstream  # noqa: E402


def store_counts(servers: list[Server]) -> list[tuple[int, int]]:
    """(late admissions, Redis calls) of each replica so far (``/admin/state``)."""
    out = []
    for s in servers:
        st = json.loads(R.get_text(s.url + "/admin/state"))["store"]
        out.append((int(st["failures"]["late"]), int(st["calls"])))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=1, help="gateways on one Redis (default 1)")
    p.add_argument("--bursts", type=int, default=4, help="bursts (default 4)")
    p.add_argument("--idle", type=float, default=6.0, help="quiet seconds before each (6)")
    p.add_argument("--burst", type=float, default=1.0, help="seconds of each burst (1)")
    p.add_argument("--connections", type=int, default=48, help="wrk connections in all (48)")
    p.add_argument("--server-cpu", default="1", help="taskset CPU list: gateways and Redis")
    p.add_argument("--client-cpu", default="0", help="taskset CPU list: wrk and upstream")
    args = p.parse_args(argv)
    from tests.store.redis_servers import start_redis

    logdir = Path(tempfile.mkdtemp(prefix="cold-burst-"))
    body = logdir / "body.json"
    body.write_text(json.dumps(R.BODY))
    up = fast_upstream()
    with start_redis(logdir / "redis") as redis:
        subprocess.run(["taskset", "-p", "-c", args.server_cpu, str(redis.pid)],
                       check=True, capture_output=True)  # fmt: skip
        store = {"url": redis.url, "key_prefix": "kvgcold"}
        servers = [R.gateway_server(logdir, up.url, f"g{i}", store) for i in range(args.replicas)]
        setup = R.Setup("cold", "redis", servers)
        started: list[Server] = []
        try:
            R.start_all(up, servers, started, args.client_cpu, args.server_cpu, logdir)
            for k in range(args.bursts):
                time.sleep(args.idle)
                before = store_counts(servers)
                runs = R.parallel_wrk(setup, body, args.connections, args.burst, args.client_cpu)
                time.sleep(0.3)  # the requests wrk abandoned at its end finish
                after = store_counts(servers)
                rps = sum(
                    (r["requests"] - r["status_errors"]) / (r["duration_us"] / 1e6) for r in runs
                )
                late = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
                calls = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
                print(
                    f"burst {k + 1}: {rps:,.0f} 2xx/s, late admissions {late}, Redis calls "
                    f"{calls} (per replica)",
                    flush=True,
                )
        finally:
            for s in reversed(started):
                s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
