"""Redis calls per request of tenants seen rarely: one ``RedisStore`` (one replica, in this
process, on a ``redis-server`` of its own) holding N tenants far from their limits
(``max_concurrency`` 1,000, TPM 10^12) admits K requests of tenants drawn at random, 32 at a
time, each released 10 ms after it was admitted; then 3.5 s of heartbeats. Prints the calls
per admission (after the requests, and after the heartbeats), this process's CPU per request,
the messages by what they carried (``*``: several scopes' messages in one ``kvg_sync_many``
call), and Redis's own time per ``FCALL``.

Usage: ``.venv/bin/python benches/tenants/store_calls.py [N] [K]`` (default 100,000 and 6,000)
"""

from __future__ import annotations

import asyncio
import collections
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.store.redis_servers import start_redis  # noqa: E402

from kvgate import AdmissionController  # noqa: E402
from kvgate.config import StoreConfig  # noqa: E402
from kvgate.store.redis_store import RedisStore  # noqa: E402


class Named:
    def __init__(self, id: int, name: str) -> None:
        self.id, self.name = id, name


async def run(url: str, n: int, k: int) -> None:
    ctl = AdmissionController(backends=1, tenants=n)
    b = Named(ctl.add_backend("b", max_concurrency=100_000, tokens_per_minute=10**12), "b")
    tenants = [
        Named(
            ctl.add_tenant(
                f"t{i}", priority="standard", max_concurrency=1000, tokens_per_minute=10**12
            ),
            f"t{i}",
        )
        for i in range(n)
    ]
    st = RedisStore(StoreConfig(url=url), ctl)
    await st.start(["b"])
    kinds: collections.Counter[tuple[str, tuple[str, ...]]] = collections.Counter()
    send = st._send

    async def counted(sc: Any, msg: Any, *args: Any, **kwargs: Any) -> Any:
        said = ("admits", "pools", "buckets", "grants")
        kinds[(sc.kind, tuple(x for x in said if isinstance(msg, dict) and msg.get(x)))] += 1
        return await send(sc, msg, *args, **kwargs)

    st._send = counted  # type: ignore[method-assign]
    send_many = st._send_many

    async def counted_many(batch: Any) -> Any:
        for sc, (msg, _, _), _ in batch:
            said = ("admits", "pools", "buckets", "grants")
            kinds[(sc.kind + "*", tuple(x for x in said if msg.get(x)))] += 1
        return await send_many(batch)

    st._send_many = counted_many  # type: ignore[method-assign]
    gate = asyncio.Semaphore(32)

    async def one(t: Named) -> None:
        async with gate:
            hold = st.try_admit(b, t, "standard", 30)
            if hold is None:
                hold = await st.admit(b, t, "standard", 30)
            await asyncio.sleep(0.01)
            st.release(hold, 30, 25)

    order = random.Random(1).choices(tenants, k=k)
    t0, cpu0, calls0 = time.monotonic(), time.process_time(), st.calls
    await asyncio.gather(*(one(t) for t in order))
    cpu = time.process_time() - cpu0
    calls = st.calls - calls0
    print(f"{k:,} requests of {n:,} tenants in {time.monotonic() - t0:.2f} s: "
          f"{calls / k:.3f} Redis calls per request, {cpu / k * 1e6:.0f} µs of this "
          "process's CPU per request")  # fmt: skip
    await asyncio.sleep(3.5)
    print(f"after 3.5 s of heartbeats: {(st.calls - calls0) / k:.3f} calls per request")
    print("messages (* : several scopes' messages in one call):")
    for (kind, said), count in kinds.most_common():
        name = ("tenant" if kind[0] == "t" else "backend") + kind[1:]
        print(f"  {count:7,}  {name} scope: {', '.join(said)}")
    import redis

    stats = redis.Redis.from_url(url).info("commandstats").get("cmdstat_fcall", {})
    print(f"Redis's own time per FCALL: {stats.get('usec_per_call')} µs "
          f"({stats.get('calls')} calls, {stats.get('usec')} µs in all)")  # fmt: skip
    state = st.state()
    print(f"store failures by kind: {state.get('failures')}; "
          f"{state.get('admissions')} admissions in Redis")  # fmt: skip
    await st.close()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 6_000
    with start_redis(Path(tempfile.mkdtemp()) / "redis") as server:
        asyncio.run(run(server.url, n, k))


if __name__ == "__main__":
    main()
