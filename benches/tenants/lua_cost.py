"""Redis's own time per message of a tenant seen rarely (``INFO commandstats``, µs per
``FCALL``; network and client excluded), on a ``redis-server`` of its own: the two messages such
a request costs — its decision (a scope Redis has not seen: the scope is made, the replica joins
it, one slot and 30 tokens admitted, a background grant asked) and its give-back at the next
heartbeat (one call per scope, and 32 scopes in one ``kvg_sync_many``) — beside two floors: a
function that only returns its argument, and one that decodes the message and encodes it again
with ``cjson`` (what any JSON message costs before it does anything). The messages are those
``RedisStore`` sends for ``benches/tenants/store_calls.py``'s tenants.

Usage: ``.venv/bin/python benches/tenants/lua_cost.py [SCOPES] [REPEATS]`` (default 5,000 and 3)
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.store.redis_servers import start_redis  # noqa: E402

from kvgate.store.server import LIBRARY  # noqa: E402

DECISION = {
    "pod": "p1",
    "seq": 1,
    "ttl": 3_000_000,
    "epoch": "e.1",
    "pools": {"conc": {"l": 1000, "k": "p", "q": 0}},
    "buckets": {"tpm": {"r": 10**12, "b": 10**12}},
    "grants": {"conc": 100, "tpm": 60},
    "admits": [{"p": [[1, "conc"]], "b": {"tpm": 30}}],
}
GIVE_BACK = {
    "pod": "p1",
    "seq": 2,
    "ttl": 3_000_000,
    "epoch": "e.2",
    "pools": {"conc": {"l": 1000, "k": "p", "q": 0}},
    "buckets": {"tpm": {"r": 10**12, "b": 10**12, "ret": 65}},
    "known": "e.1",
}
ECHO = "#!lua name=kvgate\nredis.register_function('kvg_sync', function(keys, args) return args[1] end)"
CJSON = (
    "#!lua name=kvgate\nredis.register_function('kvg_sync', function(keys, args) "
    "return cjson.encode(cjson.decode(args[1])) end)"
)


def keys(i: int, seq: int) -> list[str]:
    k = f"{{kvg:t:t{i}}}"
    return [k, k + ":live", f"{k}:op:p1:{seq}"]


def per_call(r: Any, calls: list[tuple[Any, ...]]) -> float:
    """µs of Redis's own time per call of ``calls`` (each ``(function, numkeys, ...)``),
    sent pipelined."""
    r.config_resetstat()
    pipe = r.pipeline(transaction=False)
    for call in calls:
        pipe.fcall(*call)
    pipe.execute()
    return float(r.info("commandstats")["cmdstat_fcall"]["usec_per_call"])


def one_round(r: Any, n: int) -> dict[str, float]:
    dec, back = json.dumps(DECISION), json.dumps(GIVE_BACK)
    out: dict[str, float] = {}
    for name, lib in (("echo", ECHO), ("cjson", CJSON)):
        r.function_load(lib, replace=True)
        r.flushdb()
        out[name] = per_call(r, [("kvg_sync", 3, *keys(i, 1), dec) for i in range(n)])
    r.function_load(LIBRARY, replace=True)
    r.flushdb()
    out["decision"] = per_call(r, [("kvg_sync", 3, *keys(i, 1), dec) for i in range(n)])
    out["give-back"] = per_call(r, [("kvg_sync", 3, *keys(i, 2), back) for i in range(n)])
    r.flushdb()
    per_call(r, [("kvg_sync", 3, *keys(i, 1), dec) for i in range(n)])
    many = []
    for g in range(0, n - 31, 32):
        ks = [k for i in range(g, g + 32) for k in keys(i, 2)]
        many.append(("kvg_sync_many", len(ks), *ks, *([back] * 32)))
    out["give-back, 32 a call"] = per_call(r, many) / 32
    return out


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    with start_redis(Path(tempfile.mkdtemp()) / "redis") as server:
        r = server.client()
        version = r.info("server")["redis_version"]
        rounds = [one_round(r, n) for _ in range(repeats)]
    print(f"redis-server {version}, {n:,} scopes, {repeats} rounds: µs of Redis's own time per "
          "message (median; each round)")  # fmt: skip
    for name in rounds[0]:
        values = [x[name] for x in rounds]
        each = ", ".join(f"{v:.1f}" for v in values)
        print(f"  {name:<22} {statistics.median(values):6.1f}   ({each})")


if __name__ == "__main__":
    main()
