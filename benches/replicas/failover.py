"""How long a primary's failover leaves the shared limits to their fallback: two replicas' stores
(``RedisStore``, in this process) take turns deciding requests of one tenant at its limit
(``max_concurrency`` 1, so every decision is taken in Redis), one every 10 ms, while the
primary fails over:

* ``sentinel``: the stores find the primary through a Redis Sentinel (``store.sentinel``;
  ``down-after-milliseconds`` 500, quorum 1), and the primary is killed (SIGKILL);
* ``switchover``: the stores reach the primary through a name that moves (a TCP forwarder
  whose new connections go to the replica, the old ones staying with the old primary), and the
  replica is promoted while the old primary becomes its replica (a managed service's failover:
  the old connections are answered ``READONLY``).

For each trial: when the sentinel named the new primary (``sentinel``), when each store's first
decision after the fault was taken in Redis again, and the decisions meanwhile (taken by the
fallback policy, or refused). Every request is released 5 ms after it was admitted; the held
column is the most requests the two stores held at once (the limit is 1).

Usage: ``.venv/bin/python benches/replicas/failover.py [--trials N]`` (default 3).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.store.redis_servers import (  # noqa: E402
    SENTINEL_MASTER,
    Forwarder,
    promote,
    start_replica_pair,
    start_sentinel,
)

from kvgate import AdmissionController  # noqa: E402
from kvgate.config import StoreConfig  # noqa: E402
from kvgate.store import StoreRefusal  # noqa: E402
from kvgate.store.redis_store import RedisStore  # noqa: E402


class Named:
    def __init__(self, id: int, name: str) -> None:
        self.id, self.name = id, name


def replica(url: str, sentinel: dict[str, Any] | None) -> tuple[RedisStore, Named, Named]:
    ctl = AdmissionController(backends=1, tenants=1)
    b = Named(ctl.add_backend("b", max_concurrency=64, tokens_per_minute=2**40), "b")
    t = Named(ctl.add_tenant("t", priority="standard", max_concurrency=1), "t")
    cfg = StoreConfig(url=url, heartbeat_s=0.25, deadline_ms=25, sentinel=sentinel)
    return RedisStore(cfg, ctl), b, t


async def trial(kind: str, root: Path) -> dict[str, Any]:
    with start_replica_pair(root / "pair") as (primary, second):
        fwd = None
        if kind == "sentinel":
            ctx: Any = start_sentinel(root / "sentinel", primary, second)
        else:
            ctx = None
        sentinel_srv = ctx.__enter__() if ctx is not None else None
        try:
            if sentinel_srv is not None:
                url = f"redis://{SENTINEL_MASTER}/0"
                sentinel = {"master": SENTINEL_MASTER, "nodes": [f"127.0.0.1:{sentinel_srv.port}"]}
            else:
                fwd = Forwarder(primary.port)
                await fwd.start()
                url, sentinel = f"redis://127.0.0.1:{fwd.port}/0", None
            stores = [replica(url, sentinel) for _ in range(2)]
            for st, _, _ in stores:
                await st.start(["b"])
            held = 0
            most = 0
            log: list[tuple[float, int, str]] = []  # (time, store, redis | fallback | refused)
            fault_at = 0.0

            async def drive(i: int, until: float) -> None:
                nonlocal held, most
                st, b, t = stores[i]
                while time.monotonic() < until:
                    degraded = st.degraded_admissions
                    failed = sum(st.failures.values())
                    hold = st.try_admit(b, t, "standard", 10)
                    local = hold is not None
                    if hold is None:
                        hold = await st.admit(b, t, "standard", 10)
                    now = time.monotonic()
                    # decided by the fallback: a call failed (or was late), or the breaker is
                    # open, while it was decided
                    fell = (
                        st.degraded_admissions > degraded
                        or sum(st.failures.values()) > failed
                        or st._breaker.opened_at is not None
                    )
                    if isinstance(hold, StoreRefusal):
                        log.append((now, i, "fallback-refused" if fell else "refused"))
                    else:
                        how = "fallback" if fell else "redis"
                        log.append((now, i, "local" if local and how == "redis" else how))
                        held += 1
                        most = max(most, held) if now > fault_at > 0 else most
                        await asyncio.sleep(0.005)
                        held -= 1
                        st.release(hold, 10, 10)
                    await asyncio.sleep(0.01)

            end = time.monotonic() + 12.0
            tasks = [asyncio.create_task(drive(i, end)) for i in range(2)]
            await asyncio.sleep(2.0)
            switch_s = None
            if sentinel_srv is not None:
                fault_at = time.monotonic()
                primary.kill()
                with sentinel_srv.client() as c:
                    while time.monotonic() < end:
                        state = c.sentinel_masters().get(SENTINEL_MASTER) or {}
                        if int(state.get("port", 0)) == second.port and "failover" not in state.get(
                            "flags", ""
                        ):
                            switch_s = time.monotonic() - fault_at
                            break
                        await asyncio.sleep(0.01)
            else:
                assert fwd is not None
                fault_at = time.monotonic()
                promote(second)
                primary.cli("REPLICAOF", "127.0.0.1", str(second.port))
                fwd.switch(second.port, keep=True)
            await asyncio.gather(*tasks)
            back = []
            for i in range(2):
                after = [t for t, j, how in log if j == i and t > fault_at and how == "redis"]
                back.append(after[0] - fault_at if after else None)
            during = [
                how for t, _, how in log if fault_at < t < fault_at + max(x or 0 for x in back)
            ]
            for st, _, _ in stores:
                await st.close()
            return {
                "switch_s": switch_s,
                "back_s": back,
                "fallback": during.count("fallback"),
                "fallback_refused": during.count("fallback-refused"),
                "refused": during.count("refused"),
                "most_held": most,
                "decisions": len([1 for t, _, _ in log if t > fault_at]),
            }
        finally:
            if fwd is not None:
                await fwd.close()
            if ctx is not None:
                ctx.__exit__(None, None, None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    args = p.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.trials} trials each")
    print(
        "| failover | trial | sentinel named the replica after | each store's first decision in Redis after | meanwhile: admitted / refused by the fallback, refused by Redis | most held at once after the fault (limit 1) |"
    )
    print("|---|---|---|---|---|---|")
    for kind in ("sentinel", "switchover"):
        backs = []
        for n in range(args.trials):
            r = asyncio.run(trial(kind, Path(tempfile.mkdtemp())))
            backs += [b for b in r["back_s"] if b is not None]
            sw = f"{r['switch_s']:.2f} s" if r["switch_s"] is not None else "–"
            bk = " / ".join(f"{b:.2f} s" if b is not None else "never" for b in r["back_s"])
            print(
                f"| {kind} | {n + 1} | {sw} | {bk} | {r['fallback']} / {r['fallback_refused']}, {r['refused']} | {r['most_held']} |",
                flush=True,
            )
        if backs:
            print(
                f"<!-- {kind}: median first decision in Redis after {statistics.median(backs):.2f} s -->"
            )


if __name__ == "__main__":
    main()
