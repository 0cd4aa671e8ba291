"""The Redis Function ``kvg_sync`` (``python/kvgate/store/kvgate.lua``) called directly on a real
``redis-server``: ``FCALL kvg_sync 2 <state> <live> <json message> <operation id>``, the way the store
agent calls it, with hand-written messages.

Every test checks after each call that the scope's ``alloc|<pool>`` equals the sum of its
``q|<pool>|<replica>`` fields (:func:`assert_alloc_is_sum_of_quotas`).
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import pytest
import redis
from tests.store.redis_servers import RedisServer, wait_until

from kvgate.store.server import LIBRARY, LIBRARY_NAME

STATE = "{kvg:b:gpu}"
LIVE = STATE + ":live"
LONG_TTL_US = 60_000_000

_ops = itertools.count(1)


@pytest.fixture
def r(redis_server: RedisServer) -> redis.Redis:
    """A sync client with the ``kvgate`` library loaded."""
    c = redis_server.client()
    assert c.function_load(LIBRARY, replace=True) == LIBRARY_NAME
    return c


class Pod:
    """One replica as the Function sees it: an id, its own increasing sequence numbers, a
    lease TTL (µs)."""

    def __init__(self, r: redis.Redis, name: str, ttl_us: int = LONG_TTL_US) -> None:
        self.r, self.name, self.ttl_us = r, name, ttl_us
        self.seq = 0

    def msg(self, seq: int | None = None, **fields: Any) -> dict[str, Any]:
        if seq is None:
            self.seq += 1
            seq = self.seq
        return {"pod": self.name, "seq": seq, "ttl": self.ttl_us, "epoch": "e0", **fields}

    def sync(self, op: str | None = None, seq: int | None = None, **fields: Any) -> dict[str, Any]:
        """One ``kvg_sync`` call; returns the decoded reply."""
        return call(self.r, self.msg(seq, **fields), op)

    def leave(self) -> int:
        return int(self.r.fcall("kvg_leave", 2, STATE, LIVE, self.name))


def call(r: redis.Redis, msg: dict[str, Any], op: str | None = None) -> dict[str, Any]:
    op = op or f"{msg['pod']}:{next(_ops)}"
    raw = r.fcall("kvg_sync", 2, STATE, LIVE, json.dumps(msg), op)
    reply = json.loads(raw)
    assert_alloc_is_sum_of_quotas(r)
    return reply


def fields(r: redis.Redis) -> dict[str, str]:
    return r.hgetall(STATE)


def assert_alloc_is_sum_of_quotas(r: redis.Redis) -> None:
    """``alloc|<pool>`` == Σ ``q|<pool>|*`` for every pool of the scope (0 when absent), and
    ``alloc|*g`` == Σ ``alloc|g:*`` where it is kept."""
    f = fields(r)
    sums: dict[str, int] = {}
    for k, v in f.items():
        if k.startswith("q|"):
            _, pool, _pod = k.split("|")
            sums[pool] = sums.get(pool, 0) + int(v)
    allocs = {k.split("|")[1]: int(v) for k, v in f.items() if k.startswith("alloc|")}
    # alloc|*g: the sum over the guarantee pools
    guarantees = allocs.pop("*g", None)
    if guarantees is not None:
        assert guarantees == sum(v for p, v in allocs.items() if p.startswith("g:")), f
    for pool in set(sums) | set(allocs):
        assert allocs.get(pool, 0) == sums.get(pool, 0), (pool, f)


def holdings(r: redis.Redis) -> dict[str, str]:
    """The scope's fields but sequence numbers, the last operation and reply of each replica,
    the times it last heard a message and pushed its expiry back, and zero allocations (what a
    refused admit must leave as it was)."""
    return {
        k: v
        for k, v in fields(r).items()
        if not k.startswith(("seq|", "op|", "rep|"))
        and k not in ("heard", "kept")
        and not (k.startswith("alloc|") and v == "0")
    }


def quota(r: redis.Redis, pool: str, pod: str) -> int:
    return int(r.hget(STATE, f"q|{pool}|{pod}") or 0)


def alloc(r: redis.Redis, pool: str) -> int:
    return int(r.hget(STATE, f"alloc|{pool}") or 0)


def server_us(r: redis.Redis) -> int:
    s, us = r.time()
    return int(s) * 1_000_000 + int(us)


def plain(limit: int, q: int) -> dict[str, Any]:
    return {"l": limit, "k": "p", "q": q}


# --- quotas re-asserted ----------------------------------------------------------------------


def test_every_message_re_asserts_the_quota_and_lowering_it_gives_units_back(
    r: redis.Redis,
) -> None:
    a, b = Pod(r, "a"), Pod(r, "b")
    rep = a.sync(pools={"conc": plain(10, 5)})
    assert rep["pools"]["conc"] == [5, 5, 10]
    rep = b.sync(pools={"conc": plain(10, 3)})
    assert rep["pools"]["conc"] == [3, 8, 10]
    rep = a.sync(pools={"conc": plain(10, 2)})  # a gives 3 back
    assert rep["pools"]["conc"] == [2, 5, 10]
    assert (quota(r, "conc", "a"), quota(r, "conc", "b"), alloc(r, "conc")) == (2, 3, 5)
    rep = a.sync(pools={"conc": plain(10, 0)})  # everything back: the field goes
    assert rep["pools"]["conc"] == [0, 3, 10]
    assert "q|conc|a" not in fields(r)
    assert alloc(r, "conc") == 3
    # a lost write is healed by the next message: Redis recorded 9 for b, b says 3
    r.hset(STATE, mapping={"q|conc|b": 9, "alloc|conc": 9})
    assert b.sync(pools={"conc": plain(10, 3)})["pools"]["conc"] == [3, 3, 10]


def test_re_assertion_may_go_above_the_limit_then_nothing_grows(r: redis.Redis) -> None:
    a, b = Pod(r, "a"), Pod(r, "b")
    assert a.sync(pools={"conc": plain(4, 3)}, grants={"conc": 1})["grants"]["conc"] == 1
    # b comes back holding 3 (it was reaped while frozen): alloc 7 > 4
    rep = b.sync(pools={"conc": plain(4, 3)}, grants={"conc": 2})
    assert rep["grants"]["conc"] == 0
    assert rep["pools"]["conc"] == [3, 7, 4]
    rep = a.sync(pools={"conc": plain(4, 4)}, grants={"conc": 1}, admits=[{"p": [[1, "conc"]]}])
    assert rep["grants"]["conc"] == 0
    assert rep["admits"][0][:2] == [0, "conc"]
    assert alloc(r, "conc") == 7


# --- grants and admits -----------------------------------------------------------------------


def test_grants_never_above_the_effective_limit(r: redis.Redis) -> None:
    a, b = Pod(r, "a"), Pod(r, "b")
    rep = a.sync(pools={"conc": plain(10, 0)}, grants={"conc": 7})
    assert rep["grants"]["conc"] == 7
    rep = b.sync(pools={"conc": plain(10, 0)}, grants={"conc": 7})
    assert rep["grants"]["conc"] == 3  # partial: what is left
    assert rep["pools"]["conc"] == [3, 10, 10]
    assert b.sync(pools={"conc": plain(10, 3)}, grants={"conc": 1})["grants"]["conc"] == 0
    # a scaled pool: its limit follows the lowest live proposal
    rep = a.sync(
        pools={"inflight": {"l": 1000, "k": "s", "q": 0}},
        grants={"inflight": 5000},
        scale=0.25,
        shed=False,
    )
    assert rep["grants"]["inflight"] == 250
    assert rep["pools"]["inflight"] == [250, 250, 250]
    assert alloc(r, "conc") == 10


def test_admits_are_all_or_nothing_and_in_order(r: redis.Redis) -> None:
    a, b = Pod(r, "a"), Pod(r, "b")
    pools = {"burst": {"l": 3, "k": "b", "q": 0, "gs": 0}, "inflight": {"l": 100, "k": "s", "q": 0}}
    b.sync(pools={"inflight": {"l": 100, "k": "s", "q": 70}})
    before = holdings(r)
    # the slot fits, the tokens do not: nothing is taken, the refusal names the in-flight pool
    rep = a.sync(pools=pools, admits=[{"p": [[1, "burst"], [40, "inflight"]]}])
    ok, why, retry, chosen = rep["admits"][0]
    assert (ok, why, retry) == (0, "inflight", 0)
    assert not chosen  # cjson writes an empty list as {}
    assert holdings(r) == before
    assert quota(r, "burst", "a") == 0
    # in order: three admits of one slot against a limit of 3 with one slot left by the first
    rep = a.sync(
        pools=pools,
        admits=[
            {"p": [[1, "burst"], [20, "inflight"]]},
            {"p": [[1, "burst"], [20, "inflight"]]},  # tokens: 70 + 20 + 20 > 100
            {"p": [[1, "burst"], [5, "inflight"]]},
        ],
    )
    assert [x[0] for x in rep["admits"]] == [1, 0, 1]
    assert rep["admits"][1][1] == "inflight"
    assert rep["admits"][0][3] == ["burst", "inflight"]
    assert (quota(r, "burst", "a"), quota(r, "inflight", "a")) == (2, 25)
    assert alloc(r, "inflight") == 95


def test_an_admit_refused_by_its_bucket_takes_no_slot(r: redis.Redis) -> None:
    a = Pod(r, "a")
    bucket = {"r": 60, "b": 10}  # one token a second
    rep = a.sync(
        pools={"conc": plain(5, 0)},
        buckets={"tpm": bucket},
        admits=[{"p": [[1, "conc"]], "b": {"tpm": 8}}, {"p": [[1, "conc"]], "b": {"tpm": 8}}],
    )
    assert [x[0] for x in rep["admits"]] == [1, 0]
    assert rep["admits"][1][1] == "tpm"
    assert quota(r, "conc", "a") == 1
    assert rep["buckets"]["tpm"][0] in (2, 3)  # 10 - 8 (+1 if a second went by)


def test_guarantee_pool_first_then_the_burst_pool(r: redis.Redis) -> None:
    a = Pod(r, "a")
    # backend of 10 slots; guarantees 3 (tenant x) + 1 (tenant y) = 4: burst pool 6
    pools = {
        "g:x": {"l": 10, "k": "g", "q": 0, "g": 3, "gs": 4},
        "g:y": {"l": 10, "k": "g", "q": 0, "g": 1, "gs": 4},
        "burst": {"l": 10, "k": "b", "q": 0, "gs": 4},
    }
    one = {"p": [[1, "g:x", "burst"]]}
    rep = a.sync(pools=pools, admits=[one] * 10)
    chosen = [x[3][0] if x[0] else None for x in rep["admits"]]
    assert chosen == ["g:x"] * 3 + ["burst"] * 6 + [None]
    assert rep["admits"][9][1] == "burst"  # a refusal names the last pool tried
    assert rep["pools"]["g:x"] == [3, 3, 3]
    assert rep["pools"]["burst"] == [6, 6, 6]
    # y's guarantee is still there for y (the message re-asserts what a holds now)
    pools["g:x"]["q"], pools["burst"]["q"] = 3, 6
    rep = a.sync(pools=pools, admits=[{"p": [[1, "g:y", "burst"]]}] * 2)
    assert [x[0] for x in rep["admits"]] == [1, 0]
    assert rep["admits"][0][3] == ["g:y"]


def test_burst_pool_is_the_scaled_total_minus_the_guarantees(r: redis.Redis) -> None:
    a = Pod(r, "a")
    pools = {
        "g:x": {"l": 10, "k": "g", "q": 0, "g": 3, "gs": 4},
        "g:y": {"l": 10, "k": "g", "q": 0, "g": 1, "gs": 4},
        "burst": {"l": 10, "k": "b", "q": 0, "gs": 4},
        "total": {"l": 10, "k": "t", "q": 0},
    }
    lim = a.sync(pools=pools, scale=1.0, shed=False)["pools"]
    assert {k: v[2] for k, v in lim.items()} == {"g:x": 3, "g:y": 1, "burst": 6, "total": 10}
    lim = a.sync(pools=pools, scale=0.5, shed=False)["pools"]  # total 5
    assert {k: v[2] for k, v in lim.items()} == {"g:x": 3, "g:y": 1, "burst": 1, "total": 5}
    # below the sum of the guarantees: no burst, each guarantee shrinks in proportion (floor)
    lim = a.sync(pools=pools, scale=0.3, shed=False)["pools"]  # total 3 < 4
    assert {k: v[2] for k, v in lim.items()} == {"g:x": 2, "g:y": 0, "burst": 0, "total": 3}
    lim = a.sync(pools=pools, scale=0.01, shed=False)["pools"]  # total at least 1
    assert {k: v[2] for k, v in lim.items()} == {"g:x": 0, "g:y": 0, "burst": 0, "total": 1}
    # grants follow the shrunk limits
    rep = a.sync(pools=pools, scale=0.3, shed=False, grants={"g:x": 5, "burst": 5})
    assert rep["grants"] == {"g:x": 2, "burst": 0}


def test_units_a_guarantee_holds_beyond_what_it_is_now_leave_the_burst_pool_less(
    r: redis.Redis,
) -> None:
    """A backend of 6 slots; tenant x's guarantee of 4 is held whole (2 units by each of two
    replicas). A reload drops it (the replicas re-assert their units of ``g:x`` with a
    guarantee of 0): the burst pool, now 6 - 0 by the guarantees, lends only the 2 slots x's
    units leave, as one gateway's core does; once x's units are given back, all 6."""
    a, b = Pod(r, "a"), Pod(r, "b")

    def pools(g: int, qx: int, qb: int = 0) -> dict[str, Any]:
        return {
            "g:x": {"l": 6, "k": "g", "q": qx, "g": g, "gs": g},
            "burst": {"l": 6, "k": "b", "q": qb, "gs": g},
        }

    for pod in (a, b):
        rep = pod.sync(pools=pools(4, 0), admits=[{"p": [[1, "g:x", "burst"]]}] * 2)
        assert [x[3] for x in rep["admits"]] == [["g:x"], ["g:x"]]
    assert int(r.hget(STATE, "alloc|*g")) == 4
    # the guarantee is dropped: each replica still runs its 2 units of g:x
    a.sync(pools=pools(0, 2))
    rep = b.sync(pools=pools(0, 2), admits=[{"p": [[1, "burst"]]}] * 4)
    assert [x[0] for x in rep["admits"]] == [1, 1, 0, 0]
    assert rep["pools"]["burst"] == [2, 2, 2]  # the limit reported: what the total leaves
    assert rep["grants"] == {}
    assert b.sync(pools=pools(0, 2, 2), grants={"burst": 3})["grants"] == {"burst": 0}
    # x's requests end: its units go back, and the burst pool lends the whole total
    a.sync(pools=pools(0, 0))
    rep = b.sync(pools=pools(0, 0, 2), grants={"burst": 5})
    assert rep["grants"] == {"burst": 4}
    assert rep["pools"]["burst"] == [6, 6, 6]
    assert int(r.hget(STATE, "alloc|*g")) == 0


def test_the_guarantees_sum_follows_reaping_and_is_made_again_when_missing(
    r: redis.Redis,
) -> None:
    """``alloc|*g`` loses the units of a reaped replica; a scope without it (written by an
    earlier version of the library) gets it from the quotas Redis records."""
    short, keeps = Pod(r, "short", 200_000), Pod(r, "keeps")
    spec = {"l": 10, "k": "g", "g": 5, "gs": 5}
    short.sync(pools={"g:x": {**spec, "q": 3}})
    keeps.sync(pools={"g:x": {**spec, "q": 1}, "g:y": {**spec, "q": 1}})
    assert int(r.hget(STATE, "alloc|*g")) == 5
    wait_until(
        lambda: keeps.sync(pools={"g:x": {**spec, "q": 1}})["reaped"] > 0,
        timeout=10.0,
        what="the silent replica reaped",
    )
    assert int(r.hget(STATE, "alloc|*g")) == 2
    r.hdel(STATE, "alloc|*g")
    # the guarantees dropped (a burst pool of the whole 10): they still hold 2 units, and 1
    # more that this message re-asserts; 10 - 3 left
    rep = keeps.sync(
        pools={"g:x": {**spec, "q": 2}, "burst": {"l": 10, "k": "b", "q": 0, "gs": 0}},
        grants={"burst": 9},
    )
    assert int(r.hget(STATE, "alloc|*g")) == 3
    assert rep["grants"] == {"burst": 7}


def test_effective_scale_is_the_lowest_live_proposal_and_shedding_any(r: redis.Redis) -> None:
    a, b, c = Pod(r, "a"), Pod(r, "b"), Pod(r, "c")
    rep = a.sync(scale=0.8, shed=False)
    assert (rep["scale"], rep["shed"]) == (0.8, False)
    rep = b.sync(scale=0.5, shed=True)
    assert (rep["scale"], rep["shed"]) == (0.5, True)
    rep = a.sync(scale=0.9, shed=False)  # a's own proposal does not hide b's
    assert (rep["scale"], rep["shed"]) == (0.5, True)
    rep = c.sync(scale=1.0, shed=False)
    assert (rep["scale"], rep["shed"], rep["live"]) == (0.5, True, 3)
    assert b.leave() == 1  # b gone: its proposal no longer counts
    rep = a.sync(scale=0.9, shed=False)
    assert (rep["scale"], rep["shed"], rep["live"]) == (0.9, False, 2)
    # a tenant scope (no scale in the message) reports the full scale
    rep = c.sync()
    assert rep["scale"] == 1


# --- stale and duplicate messages ------------------------------------------------------------


def test_a_stale_sequence_number_changes_nothing(r: redis.Redis) -> None:
    a = Pod(r, "a")
    a.sync(seq=5, pools={"conc": plain(10, 4)}, buckets={"tpm": {"r": 60, "b": 100}})
    before = fields(r)
    live_before = r.zrange(LIVE, 0, -1, withscores=True)
    for seq in (5, 4, 1):  # a late delivery of a call that already timed out
        rep = a.sync(
            seq=seq,
            pools={"conc": plain(10, 9)},
            grants={"conc": 5, "tpm": 50},
            buckets={"tpm": {"r": 60, "b": 100, "ret": 30}},
            admits=[{"p": [[1, "conc"]]}],
        )
        assert rep["stale"] is True
        assert "grants" not in rep
        assert "admits" not in rep
    assert fields(r) == before
    assert r.zrange(LIVE, 0, -1, withscores=True) == live_before
    rep = a.sync(seq=6, pools={"conc": plain(10, 9)})  # a newer one applies
    assert "stale" not in rep
    assert quota(r, "conc", "a") == 9


def test_a_duplicate_operation_id_returns_the_first_reply(r: redis.Redis) -> None:
    a = Pod(r, "a")
    op = "a:dup"
    first = a.sync(op=op, pools={"conc": plain(10, 0)}, grants={"conc": 4})
    assert first["grants"]["conc"] == 4
    before = fields(r)
    again = a.sync(op=op, pools={"conc": plain(10, 0)}, grants={"conc": 6})  # a newer seq
    assert again == first
    assert fields(r) == before
    # kept in the scope's own hash (no key of its own), for the replica's last operation only
    assert set(r.keys("*")) <= {STATE, LIVE}
    later = a.sync(pools={"conc": plain(10, 4)}, grants={"conc": 2})
    assert later != first
    assert later["grants"]["conc"] == 2
    assert fields(r)["op|a"] != op


def test_an_operation_named_by_a_third_key_as_replicas_send_it_is_applied_once(
    r: redis.Redis,
) -> None:
    a = Pod(r, "a")
    msg = a.msg(None, pools={"conc": plain(10, 0)}, grants={"conc": 3})
    op_key = STATE + ":op:a:7"
    first = json.loads(r.fcall("kvg_sync", 3, STATE, LIVE, op_key, json.dumps(msg)))
    assert first["grants"]["conc"] == 3
    again = json.loads(r.fcall("kvg_sync", 3, STATE, LIVE, op_key, json.dumps(msg)))
    assert again == first
    assert quota(r, "conc", "a") == 3
    assert not r.exists(op_key)  # the reply lives in the scope's hash, not under that key


def test_a_call_without_an_operation_id_is_refused(r: redis.Redis) -> None:
    msg = Pod(r, "a").msg(None, pools={"conc": plain(10, 0)}, grants={"conc": 3})
    with pytest.raises(redis.ResponseError, match="no operation id"):
        r.fcall("kvg_sync", 2, STATE, LIVE, json.dumps(msg))
    assert not r.exists(STATE)


# --- reaping and leaving ---------------------------------------------------------------------


def test_a_replica_silent_past_its_ttl_is_reaped_and_its_quotas_go_back(r: redis.Redis) -> None:
    short, keeps, watcher = Pod(r, "short", 200_000), Pod(r, "keeps"), Pod(r, "watcher")
    short.sync(pools={"conc": plain(10, 4), "inflight": {"l": 100, "k": "s", "q": 30}})
    keeps.sync(pools={"conc": plain(10, 3)})
    assert alloc(r, "conc") == 7
    lease_end = r.zscore(LIVE, "short")
    assert lease_end is not None

    reaped: list[int] = []

    def reaped_by_watcher() -> bool:
        rep = watcher.sync(pools={"conc": plain(10, 0)})
        reaped.append(rep["reaped"])
        return rep["reaped"] > 0

    wait_until(reaped_by_watcher, timeout=10.0, what="the silent replica reaped")
    assert server_us(r) >= lease_end  # never before its lease ran out
    assert sum(reaped) == 1
    f = fields(r)
    assert not [k for k in f if k.endswith("|short")]
    assert (alloc(r, "conc"), alloc(r, "inflight")) == (3, 0)
    assert quota(r, "conc", "keeps") == 3  # a live replica keeps its quota
    assert r.zscore(LIVE, "short") is None
    assert int(f["reaped"]) == 1
    # the reaped replica comes back: its seq starts again and it re-asserts what it runs
    rep = short.sync(seq=1, pools={"conc": plain(10, 2)})
    assert "stale" not in rep
    assert alloc(r, "conc") == 5


def moves(r: redis.Redis) -> dict[str, int]:
    """The scope's ``moved`` field: replica -> silences that moved its lease since it spoke."""
    raw = r.hget(STATE, "moved")
    return json.loads(raw) if raw else {}


def test_silences_move_a_running_lease_on_until_its_replica_speaks(r: redis.Redis) -> None:
    """Nothing heard for over half a lease (Redis away, say): the next message moves the
    leases that ran on by the silence, so the first replica back reaps no one whose requests
    still run — also when Redis flaps (two silences back to back, only one replica got through
    in between). Its sender's own lease moves too (it does not reap itself). The moves are
    counted per replica until it speaks again."""
    ttl = 1_000_000
    a, b = Pod(r, "a", ttl), Pod(r, "b", ttl)
    a.sync(pools={"conc": plain(4, 2)})
    b.sync(pools={"conc": plain(4, 2)})
    before = r.zscore(LIVE, "a")
    time.sleep(0.6)  # a silence: more than half a lease
    rep = b.sync(pools={"conc": plain(4, 2)})
    assert rep["reaped"] == 0
    moved = r.zscore(LIVE, "a")
    assert moved is not None
    assert before is not None
    assert moved - before >= 500_000  # moved on by the silence (≥ 0.6 s, server µs)
    assert moves(r) == {"a": 1}  # the sender's own lease is renewed, not counted
    time.sleep(0.6)  # Redis flaps: a second silence before a spoke
    rep = b.sync(pools={"conc": plain(4, 2)}, grants={"conc": 2})
    assert rep["reaped"] == 0
    assert moves(r) == {"a": 2}
    assert rep["grants"].get("conc", 0) == 0  # a's two slots are still a's
    assert alloc(r, "conc") == 4
    a.sync(pools={"conc": plain(4, 2)})  # a speaks: its moves are forgotten
    assert "moved" not in fields(r)
    # one replica alone, silent for longer than its whole lease, does not reap itself
    time.sleep(1.2)
    rep = b.sync(pools={"conc": plain(4, 2)})
    assert rep["reaped"] == 0
    assert quota(r, "conc", "b") == 2


def test_a_dead_replica_is_reaped_though_every_message_comes_after_half_a_lease(
    r: redis.Redis,
) -> None:
    """A replica dies holding a tenant's only slot; the survivor, refused, speaks only every
    0.75 lease (a client retrying slowly): every one of its messages follows a silence of the
    scope. The dead replica's lease is moved on a few times (MAX_MOVES), not by every message:
    it is reaped and its slot goes back (it was held for as long as the messages kept coming
    that slowly)."""
    ttl = 200_000
    dead, survivor = Pod(r, "dead", ttl), Pod(r, "survivor", ttl)
    dead.sync(pools={"conc": plain(1, 1)})
    reaped = 0
    for _ in range(40):  # 40 messages 0.15 s apart: 6 s, 30 leases
        time.sleep(0.15)
        rep = survivor.sync(pools={"conc": plain(1, 0)}, grants={"conc": 1})
        reaped += rep["reaped"]
        if reaped:
            break
    assert reaped == 1
    assert r.zscore(LIVE, "dead") is None
    assert not [k for k in fields(r) if k.endswith("|dead")]
    assert "dead" not in moves(r)
    rep = survivor.sync(pools={"conc": plain(1, 0)}, grants={"conc": 1})
    assert quota(r, "conc", "survivor") == 1  # the slot is the survivor's now


def test_kvg_leave_gives_the_quotas_back_at_once(r: redis.Redis) -> None:
    a, b = Pod(r, "a"), Pod(r, "b")
    a.sync(pools={"conc": plain(10, 5), "inflight": {"l": 100, "k": "s", "q": 40}})
    b.sync(pools={"conc": plain(10, 3)})
    assert a.leave() == 1
    assert (alloc(r, "conc"), alloc(r, "inflight")) == (3, 0)
    assert not [k for k in fields(r) if k.endswith("|a")]
    assert r.zscore(LIVE, "a") is None
    a.leave()  # twice: nothing more goes back
    assert (alloc(r, "conc"), alloc(r, "inflight")) == (3, 0)
    assert_alloc_is_sum_of_quotas(r)


def test_kvg_leave_in_a_scope_that_expired_leaves_no_key_behind(r: redis.Redis) -> None:
    # a replica closing leaves every scope it ever knew, also those long expired: nothing may
    # be made again then (a hash of its `reaped` counter alone would never expire)
    a = Pod(r, "a")
    a.sync(pools={"conc": plain(10, 1)})
    r.delete(STATE, LIVE)  # expired
    a.leave()
    assert r.exists(STATE, LIVE) == 0
    # the state lost but not the live set: the replica still leaves it
    a.sync(pools={"conc": plain(10, 1)})
    b = Pod(r, "b")
    b.sync()
    r.delete(STATE)
    a.leave()
    assert r.exists(STATE) == 0
    assert r.zrange(LIVE, 0, -1) == ["b"]


def test_the_scope_expires_after_its_last_message(r: redis.Redis) -> None:
    # kept at least 180 s after each message: pushed back to 4 leases + 190 s at most every 10 s
    a = Pod(r, "a", ttl_us=3_000_000)
    a.sync(pools={"conc": plain(10, 1)})
    keep_ms = 3_000 * 4 + 190_000
    for key in (STATE, LIVE):
        assert keep_ms - 5_000 < r.pttl(key) <= keep_ms
    for key in (STATE, LIVE):
        r.pexpire(key, 185_000)  # as if the last push was 5 s ago: not pushed again yet
    a.sync(pools={"conc": plain(10, 1)})
    assert 180_000 < r.pttl(STATE) <= 185_000
    r.hset(STATE, "kept", "0")  # as if the last push was long ago: this message pushes it
    a.sync(pools={"conc": plain(10, 1)})
    for key in (STATE, LIVE):
        assert keep_ms - 5_000 < r.pttl(key) <= keep_ms
    r.pexpire(STATE, 1)  # lost: the next message makes it again, with its expiry
    wait_until(lambda: r.pttl(STATE) < 0 or r.exists(STATE) == 0, 5.0, "the state expired")
    a.sync(pools={"conc": plain(10, 1)})
    assert keep_ms - 5_000 < r.pttl(STATE) <= keep_ms


def test_a_live_set_made_again_within_10_s_of_the_last_push_gets_its_expiry(
    r: redis.Redis,
) -> None:
    # the only replica leaves (its live set is emptied, so Redis deletes it) and another one
    # speaks before the next push is due: the set it makes again must expire like the state
    a, b = Pod(r, "a", ttl_us=3_000_000), Pod(r, "b", ttl_us=3_000_000)
    a.sync(pools={"conc": plain(10, 1)})
    assert a.leave() == 1
    assert not r.exists(LIVE)
    b.sync(pools={"conc": plain(10, 1)})
    keep_ms = 3_000 * 4 + 190_000
    for key in (STATE, LIVE):
        assert keep_ms - 5_000 < r.pttl(key) <= keep_ms


def test_the_expiry_is_pushed_back_when_the_server_clock_went_back(r: redis.Redis) -> None:
    # `kept` later than the server's time (a failover to a server whose clock is behind, a
    # clock stepped back): the push must not wait until the clock catches up
    a = Pod(r, "a", ttl_us=3_000_000)
    a.sync(pools={"conc": plain(10, 1)})
    r.hset(STATE, "kept", str(server_us(r) + 3_600_000_000))  # an hour ahead
    for key in (STATE, LIVE):
        r.pexpire(key, 60_000)
    a.sync(pools={"conc": plain(10, 1)})
    keep_ms = 3_000 * 4 + 190_000
    for key in (STATE, LIVE):
        assert keep_ms - 5_000 < r.pttl(key) <= keep_ms


# --- token buckets (GCRA) --------------------------------------------------------------------


def test_a_bucket_grant_takes_at_most_what_is_available(r: redis.Redis) -> None:
    a, b = Pod(r, "a"), Pod(r, "b")
    bucket = {"tpm": {"r": 60, "b": 100}}  # one token a second, a burst of 100
    rep = a.sync(buckets=bucket, grants={"tpm": 40})
    assert rep["grants"]["tpm"] == 40
    assert rep["buckets"]["tpm"] == [60, 100]
    rep = b.sync(buckets=bucket, grants={"tpm": 500})
    assert 60 <= rep["grants"]["tpm"] <= 62  # the rest (one more per second gone by)
    assert rep["buckets"]["tpm"][0] == 0
    rep = a.sync(buckets=bucket, grants={"tpm": 500})
    assert rep["grants"]["tpm"] <= 2


def test_a_refund_never_fills_the_bucket_above_its_burst(r: redis.Redis) -> None:
    a = Pod(r, "a")
    rep = a.sync(buckets={"tpm": {"r": 60, "b": 100}}, grants={"tpm": 30})
    assert rep["buckets"]["tpm"][0] == 70
    rep = a.sync(buckets={"tpm": {"r": 60, "b": 100, "ret": 10}})
    assert rep["buckets"]["tpm"][0] in (80, 81)
    rep = a.sync(buckets={"tpm": {"r": 60, "b": 100, "ret": 1000}})
    assert rep["buckets"]["tpm"][0] == 100
    assert a.sync(buckets={"tpm": {"r": 60, "b": 100}}, grants={"tpm": 500})["grants"]["tpm"] <= 101


def test_an_overrun_debt_is_capped_at_one_burst(r: redis.Redis) -> None:
    a = Pod(r, "a")
    bucket = {"r": 60, "b": 100}
    assert a.sync(buckets={"tpm": bucket}, grants={"tpm": 100})["grants"]["tpm"] == 100
    rep = a.sync(buckets={"tpm": {**bucket, "debt": 1000}})
    assert -100 <= rep["buckets"]["tpm"][0] <= -98  # the debt stops at one burst
    tat = float(r.hget(STATE, "tat|tpm"))
    assert tat - server_us(r) <= 100 * 1_000_000  # at most one burst ahead of now
    rep = a.sync(buckets={"tpm": bucket}, grants={"tpm": 5}, admits=[{"b": {"tpm": 1}}])
    assert rep["grants"]["tpm"] == 0
    ok, why, retry_us, _ = rep["admits"][0]
    assert (ok, why) == (0, "tpm")
    assert 98e6 <= retry_us <= 101e6  # back out of the debt, then one token


def test_retry_after_of_a_refused_admit_is_when_the_tokens_are_there(r: redis.Redis) -> None:
    a = Pod(r, "a")
    bucket = {"tpm": {"r": 600, "b": 20}}  # ten tokens a second, 100 ms a token
    assert a.sync(buckets=bucket, grants={"tpm": 20})["grants"]["tpm"] == 20
    before = server_us(r)
    rep = a.sync(buckets=bucket, admits=[{"b": {"tpm": 20}}])
    after = server_us(r)
    ok, why, retry_us, _ = rep["admits"][0]
    assert (ok, why) == (0, "tpm")
    assert 1.5e6 <= retry_us <= 2.0e6 + 1  # 20 tokens at 100 ms, less the time gone by
    # a request larger than the burst can never be admitted
    never = a.sync(buckets=bucket, admits=[{"b": {"tpm": 21}}])["admits"][0]
    assert never[:3] == [0, "tpm", -1]
    # refused until the hint, admitted at the first try after it
    refused_early = 0
    while server_us(r) < before + retry_us - 200_000:
        rep = a.sync(buckets=bucket, admits=[{"b": {"tpm": 20}}])
        assert rep["admits"][0][0] == 0
        refused_early += 1
        time.sleep(0.05)
    assert refused_early > 0
    deadline = time.monotonic() + 10.0
    while server_us(r) < after + retry_us:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    rep = a.sync(buckets=bucket, admits=[{"b": {"tpm": 20}}])
    assert rep["admits"][0][0] == 1
    assert rep["buckets"]["tpm"][0] <= 1


def test_a_scaled_bucket_follows_the_effective_scale(r: redis.Redis) -> None:
    a = Pod(r, "a")
    rep = a.sync(buckets={"tpm": {"r": 600, "b": 100, "sc": 1}}, scale=0.5, shed=False)
    assert rep["buckets"]["tpm"] == [50, 50]
    rep = a.sync(buckets={"tpm": {"r": 600, "b": 100}}, scale=0.5, shed=False)  # not scaled
    assert rep["buckets"]["tpm"][1] == 100


def test_at_most_eight_replicas_are_reaped_per_call(r: redis.Redis) -> None:
    dead = [Pod(r, f"dead{i}", 100_000) for i in range(10)]
    for pod in dead:
        pod.sync(pools={"conc": plain(100, 2)})
    assert alloc(r, "conc") == 20
    last_lease = max(float(r.zscore(LIVE, p.name) or 0) for p in dead)
    watcher = Pod(r, "watcher")
    wait_until(lambda: server_us(r) > last_lease, 10.0, "every lease ran out")
    first = watcher.sync(pools={"conc": plain(100, 0)})
    assert (first["reaped"], alloc(r, "conc")) == (8, 4)
    second = watcher.sync(pools={"conc": plain(100, 0)})
    assert (second["reaped"], second["live"], alloc(r, "conc")) == (2, 1, 0)
    assert int(r.hget(STATE, "reaped")) == 10


def test_kvg_peek_reads_the_scope_without_writing(r: redis.Redis) -> None:
    a = Pod(r, "a")
    a.sync(pools={"conc": plain(10, 3)})
    before = fields(r)
    out = json.loads(r.fcall_ro("kvg_peek", 2, STATE, LIVE))
    assert dict(zip(out["fields"][::2], out["fields"][1::2], strict=True)) == before
    assert out["live"][0] == "a"
    assert float(out["live"][1]) > out["now"]  # the lease runs ahead of now
    assert fields(r) == before
