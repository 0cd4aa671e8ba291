"""Clients that wait for each answer before the next request, at their tenant's concurrency
limit, across replicas that share their limits through Redis.

``--clients`` clients of a tenant whose ``max_concurrency`` is that number each send one
request at a time, each to the next of ``--replicas`` gateways (round robin), streamed and
whole answers in turn, for ``--seconds``. Such clients should never be refused: no more
requests run than the limit. They are when a replica gives a slot back to Redis after the
client has already asked the next replica, or keeps an unused slot as headroom while a request
on another replica is refused. Prints the answers by status, the refusals per thousand
requests and how many of them came in the run's first second.

Setup: ``kvgate sim`` (tiny profile, ``--speed 20``) and the gateways on loopback through the
tests' replica harness, a ``redis-server`` of its own.

Usage (from the repository root, after ``make build``; needs ``redis-server``)::

    .venv/bin/python benches/replicas/sequential.py [--replicas 3] [--clients 1] [--seconds 20]
        [--stall AT FOR]

``--stall AT FOR`` stops Redis FOR seconds, AT seconds into the run: the refusals that follow
are the fallback policy's while the breaker is open, then those of a replica that has not yet
re-asserted what it holds.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "load"), str(HERE.parent), str(HERE.parents[1])]

import run as R  # noqa: E402

KEY = "sk-sequential"


async def measure(
    redis: Any,
    replicas: int,
    clients: int,
    seconds: float,
    stall: tuple[float, float] | None = None,
) -> tuple[Counter[int], int]:
    """Answers by HTTP status over ``seconds`` of ``clients`` sequential clients (the tenant's
    ``max_concurrency``), and how many of the refusals came in the first second (while the
    replicas, started together, learn of each other). ``stall``: (when, how long) in seconds,
    Redis stopped (SIGSTOP) that long at that moment of the run."""
    redis_url = redis.url
    from tests.store.replicas import run_replicas

    config = {
        "backends": [R.SIM_BACKEND],
        "tenants": [
            {
                "name": "one",
                "api_key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
                "max_concurrency": clients,
            }
        ],
        "store": {"url": redis_url, "key_prefix": "kvgseq"},
        "access_log": {"enabled": False},
    }
    statuses: Counter[int] = Counter()
    early = 0  # refusals in the run's first second
    async with run_replicas(config, n=replicas, ready_timeout=120) as reps:
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

        async def client(first: int, session: aiohttp.ClientSession, give_up: float) -> None:
            nonlocal early
            urls = itertools.islice(itertools.cycle(reps.urls), first, None)
            n = first
            while time.monotonic() < give_up:
                body = {
                    "model": reps.model,
                    "messages": [{"role": "user", "content": "one at a time"}],
                    "max_tokens": 4,
                    "stream": n % 2 == 0,
                }
                n += 1
                async with session.post(
                    next(urls) + "/v1/chat/completions", data=orjson.dumps(body), headers=headers
                ) as r:
                    await r.read()
                    statuses[r.status] += 1
                    if r.status == 429 and time.monotonic() < began + 1.0:
                        early += 1

        async def stalled(at: float, length: float) -> None:
            await asyncio.sleep(at)
            redis.pause()
            try:
                await asyncio.sleep(length)
            finally:
                redis.resume()

        async with aiohttp.ClientSession() as session:
            began = time.monotonic()
            give_up = began + seconds
            runs = [client(c, session, give_up) for c in range(clients)]
            if stall is not None:
                runs.append(stalled(*stall))
            await asyncio.gather(*runs)
    return statuses, early


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3, help="gateways on one Redis (default 3)")
    p.add_argument("--clients", type=int, default=1, help="clients = max_concurrency (1)")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds of requests (20)")
    p.add_argument(
        "--stall",
        type=float,
        nargs=2,
        metavar=("AT", "FOR"),
        help="stop Redis (SIGSTOP) AT seconds into the run, FOR seconds",
    )
    args = p.parse_args(argv)
    from tests.store.redis_servers import start_redis

    logdir = Path(tempfile.mkdtemp(prefix="sequential-"))
    with start_redis(logdir / "redis") as redis:
        stall = (args.stall[0], args.stall[1]) if args.stall else None
        statuses, early = asyncio.run(
            measure(redis, args.replicas, args.clients, args.seconds, stall)
        )
    total = sum(statuses.values())
    refused = statuses.get(429, 0)
    print(
        f"{args.replicas} replicas, {args.clients} clients, {total} requests: "
        + ", ".join(f"{code}: {n}" for code, n in sorted(statuses.items()))
        + f"; refused per thousand: {1000 * refused / max(1, total):.1f}"
        + f" ({early} of them in the first second)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
