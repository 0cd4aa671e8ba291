"""The store's calls on its own connection (:mod:`kvgate.store.wire`) against the same calls on
redis-py's asyncio client, side by side in one run: the store alone (two ``RedisStore``
objects in this process, no HTTP) take turns admitting and releasing one request of a tenant
whose concurrency limit is 1, 3 ms apart, so each admission is decided in Redis; the two
kinds of connection take turns in blocks of 50 decisions. Prints the p50 / p90 / p99 of a
decision on each, and of a ``PING`` on each at the same pace.

Usage: ``.venv/bin/python benches/replicas/wire_ab.py [--decisions 2000]`` (starts its own
``redis-server`` on a free port; needs ``redis-server`` 7.0 or later).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import run
from tests.store.redis_servers import start_redis

from kvgate.config import StoreConfig
from kvgate.store.redis_store import RedisStore
from kvgate.store.wire import Wire

BLOCK = 50


def pct(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * q))] * 1000


async def measure(url: str, decisions: int) -> dict[str, dict[str, list[float]]]:
    limits = run._BaseLimits()
    limits.tenant = {**run._BaseLimits.tenant, "max_concurrency": 1, "tokens_per_minute": None,
                     "burst_tokens": None}  # fmt: skip
    stores = [RedisStore(StoreConfig(url=url, key_prefix="kvgab"), limits) for _ in range(2)]
    for st in stores:
        await st.start()
    wires = [st._wire for st in stores]
    assert all(isinstance(w, Wire) for w in wires)
    backend, tenant = SimpleNamespace(id=0, name="ab"), SimpleNamespace(id=0, name="one")
    out: dict[str, dict[str, list[float]]] = {
        k: {"decision": [], "ping": []} for k in ("wire", "redis-py")
    }
    try:
        for i in range(decisions):
            kind = "wire" if (i // BLOCK) % 2 == 0 else "redis-py"
            st = stores[i % 2]
            st._wire = wires[i % 2] if kind == "wire" else st._client
            t0 = time.perf_counter()
            hold = st.try_admit(backend, tenant, "standard", 100)
            if hold is None:
                hold = await st.admit(backend, tenant, "standard", 100)
                out[kind]["decision"].append(time.perf_counter() - t0)
            st.release(hold, 100, 100)
            await asyncio.sleep(0.003)
            t0 = time.perf_counter()
            if kind == "wire":
                await wires[0].command("PING")
            else:
                await stores[0]._client.ping()
            out[kind]["ping"].append(time.perf_counter() - t0)
            await asyncio.sleep(0.003)
    finally:
        for st, w in zip(stores, wires, strict=True):
            st._wire = w
            await st.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decisions", type=int, default=2000)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="wire-ab-") as tmp, start_redis(Path(tmp)) as redis:
        out = uvloop.run(measure(redis.url, args.decisions))
    print("| connection | decisions | decision p50 / p90 / p99 ms | PING p50 / p90 / p99 ms |")
    print("|---|---|---|---|")
    for kind, r in out.items():
        d, g = r["decision"], r["ping"]
        print(
            f"| {kind} | {len(d)} | {pct(d, 0.5):.3f} / {pct(d, 0.9):.3f} / {pct(d, 0.99):.3f} "
            f"| {pct(g, 0.5):.3f} / {pct(g, 0.9):.3f} / {pct(g, 0.99):.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
