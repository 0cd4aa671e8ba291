"""The store's calls on its own connection (:mod:`kvgate.store.wire`) against the same calls on
redis-py's asyncio client, side by side in one run: the store alone (two ``RedisStore``
objects in this process, no HTTP) take turns admitting and releasing one request of a tenant
whose concurrency limit is 1, 3 ms apart, so each admission is decided in Redis; the two
kinds of connection take turns in blocks of 50 decisions, with a third kind: the store's
connection with a timeout context around each call (its calls awaited through a coroutine, as
redis-py's are, so that the store bounds them with ``asyncio.timeout`` rather than the
connection's one deadline timer). Prints the p50 / p90 / p99 of a decision on each, and of a
``PING`` on each at the same pace (on the third, inside ``asyncio.timeout``).

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
KINDS = ("wire", "redis-py", "wire, timeout context")


class _Awaited:
    """A connection whose calls are coroutines (the store then bounds each with a timeout
    context, as it does redis-py's)."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire

    async def fcall(self, *args: object) -> object:
        return await self.wire.fcall(*args)  # type: ignore[arg-type]


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
    out: dict[str, dict[str, list[float]]] = {k: {"decision": [], "ping": []} for k in KINDS}
    awaited = [_Awaited(w) for w in wires]
    try:
        for i in range(decisions):
            kind = KINDS[(i // BLOCK) % len(KINDS)]
            st = stores[i % 2]
            st._wire = {"wire": wires, "redis-py": [s._client for s in stores]}.get(kind, awaited)[
                i % 2
            ]
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
            elif kind == "redis-py":
                await stores[0]._client.ping()
            else:
                async with asyncio.timeout(0.025):
                    await wires[0].command("PING")
            out[kind]["ping"].append(time.perf_counter() - t0)
            await asyncio.sleep(0.003)
    finally:
        for st, w in zip(stores, wires, strict=True):
            st._wire = w
            await st.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decisions", type=int, default=3000)
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
