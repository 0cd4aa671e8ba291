"""This replica's view of the limits it shares through Redis (:mod:`kvgate.store.redis_store`):
each tenant's and backend's *scope*, its pools (slots, in-flight tokens) and token buckets, and
what a request takes or waits for in them. The numbers live in the Rust core's ledger
(:class:`kvgate._core.QuotaLedger`, where the local fast path decides); these objects are views
of its entries with the names and settings the Redis messages need."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvgate._core import QuotaLedger

__all__ = [
    "BURST",
    "GUARANTEE",
    "PLAIN",
    "SCALED",
    "Admit",
    "Bucket",
    "Part",
    "Pool",
    "Scope",
    "StoreHold",
    "plan_key",
    "scope_key",
]

#: the pool kinds of ``kvgate.lua``: plain, scaled, burst pool, a tenant's guarantee
PLAIN, SCALED, BURST, GUARANTEE = "p", "s", "b", "g"
#: field numbers of a pool and of a bucket in :class:`kvgate._core.QuotaLedger`
_Q, _IN_USE, _P_TAKEN, _UNIT, _P_NEAR, _LIMIT, _BASE = range(7)
_AVAIL, _B_TAKEN, _CHUNK, _B_NEAR, _BURST = range(5)


def _ledger_field(kind: str, n: int, doc: str, flag: bool = False) -> Any:
    """A property reading and writing field ``n`` of this object's entry in the ledger
    (``kind``: ``pool`` or ``bucket``); a ``flag`` reads as a bool. (The ledger's methods are
    looked up once, here: a decision in Redis reads and writes some forty fields.)"""
    ledger_get = getattr(QuotaLedger, kind + "_get")
    ledger_set = getattr(QuotaLedger, kind + "_set")
    if flag:

        def get(self: Any) -> Any:
            return bool(ledger_get(self._l, self._i, n))

        def put(self: Any, value: Any) -> None:
            ledger_set(self._l, self._i, n, 1 if value else 0)
    else:

        def get(self: Any) -> Any:
            return ledger_get(self._l, self._i, n)

        def put(self: Any, value: Any) -> None:
            ledger_set(self._l, self._i, n, int(value))

    return property(get, put, doc=doc)


def plan_key(backend: int, tenant: int, sheddable: bool) -> int:
    """The ledger's key of the request plan of ``tenant`` on ``backend`` (core ids)."""
    return backend << 33 | tenant << 1 | sheddable


def scope_key(prefix: str, kind: str, name: str) -> str:
    """The hash-tagged key of a scope: ``{<prefix>:<t|b>:<name>}`` (every key of a scope hashes
    to the same Redis Cluster slot)."""
    return "{" + f"{prefix}:{kind}:{name}" + "}"


class Pool:
    """This replica's view of one pool of a scope (slots, or in-flight tokens).

    Attributes:
        scope: the scope it belongs to.
        name: the pool's name in its scope (``conc``, ``burst``, ``g:<tenant>``, ``inflight``).
        limit_name: the limit it enforces (a refusal reason).
        kind: ``p`` plain, ``s`` scaled, ``b`` burst pool, ``g`` a tenant's guarantee.
        base: the configured limit (slots or tokens); ``g``, ``gs``: a guarantee and the sum of
            the guarantees on the backend (slots).
        q: units this replica holds (its quota); ``in_use``: units its requests hold; ``rq``:
            the quota Redis may record for it (re-asserted until a reply says 0).
        limit, alloc: the effective limit and the sum of every replica's quota, as Redis last
            said; ``near``: less than ``near_fraction`` of the limit is free.
        taken: units taken since the last heartbeat (demand).
        adopted: units of ``in_use`` that no hold of this store took: requests of the tenant
            that ran before a reload gave it this limit (:meth:`RedisStore.adopt_running`),
            given back as they end; ``adopted_from``: how many of those still run.
        st: units of the limit kept out of Redis as standing slices; ``spill``: units of
            ``in_use`` held in a standing slice beyond its size after a reload.
    """

    __slots__ = (
        "_i",
        "_l",
        "adopted",
        "adopted_from",
        "alloc",
        "g",
        "gs",
        "kind",
        "limit_name",
        "name",
        "rq",
        "scope",
        "spill",
        "spill_of",
        "st",
    )

    q = _ledger_field("pool", _Q, "units this replica holds (its quota)")
    in_use = _ledger_field("pool", _IN_USE, "units its requests hold")
    taken = _ledger_field("pool", _P_TAKEN, "units taken since the last heartbeat (demand)")
    unit = _ledger_field(
        "pool", _UNIT, "units of the last request (tokens for an in-flight token budget)"
    )
    near = _ledger_field(
        "pool", _P_NEAR, flag=True, doc="less than near_fraction of the limit is free"
    )
    limit = _ledger_field("pool", _LIMIT, "the effective limit as Redis last said")
    base = _ledger_field("pool", _BASE, "the configured limit")

    def __init__(
        self,
        scope: Scope,
        name: str,
        limit_name: str,
        kind: str,
        base: int,
        g: int = 0,
        gs: int = 0,
    ) -> None:
        self.scope = scope
        self._l = scope._l
        self._i = self._l.add_pool(scope._i, base)
        self.name, self.limit_name, self.kind = name, limit_name, kind
        self.g, self.gs = g, gs
        self.alloc = self.rq = self.adopted = 0
        #: units of the limit held as standing slices by the replicas that may hold one
        #: (``store.standing_share``): Redis keeps them out of what it grants
        self.st = 0
        #: units of ``in_use`` that this replica's requests hold in its standing slice of the
        #: tenant beyond the slice's size after a reload shrank it (``spill_of``: that slice's
        #: pool), re-asserted to Redis until they end
        self.spill = 0
        self.spill_of: Pool | None = None
        self.adopted_from: Callable[[], int] | None = None
        self.limit = base if kind != GUARANTEE else g

    def spec(self) -> dict[str, Any]:
        """The pool as ``kvg_sync`` reads it."""
        d: dict[str, Any] = {"l": self.base, "k": self.kind, "q": self.q}
        if self.st:
            d["st"] = self.st
        if self.kind in (BURST, GUARANTEE):
            d["gs"] = self.gs
        if self.kind == GUARANTEE:
            d["g"] = self.g
        return d


class Bucket:
    """This replica's view of one token bucket of a scope.

    Attributes:
        scope: the scope it belongs to.
        avail: pre-debited tokens this replica holds (negative: an overrun not yet charged).
        rate, burst: tokens per minute and bucket size (tokens); ``scaled``: follows the
            backend's adaptive scale.
        global_avail: tokens the global bucket held at the last reply; ``near``: below
            ``near_fraction`` of the burst.
        taken: tokens taken since the last heartbeat (demand); ``chunk``: the grant size.
        fallback: the replica's own bucket (its share) while Redis is away.
    """

    __slots__ = (
        "_i",
        "_l",
        "fallback",
        "gen",
        "global_avail",
        "limit_name",
        "name",
        "rate",
        "sb",
        "scaled",
        "scope",
        "sr",
        "stamp",
    )

    avail = _ledger_field(
        "bucket", _AVAIL, "pre-debited tokens this replica holds (negative: an overrun)"
    )
    taken = _ledger_field("bucket", _B_TAKEN, "tokens taken since the last heartbeat (demand)")
    chunk = _ledger_field("bucket", _CHUNK, "the grant size (tokens; 0 = not sized yet)")
    near = _ledger_field(
        "bucket",
        _B_NEAR,
        flag=True,
        doc="the global bucket holds less than near_fraction of its burst",
    )
    burst = _ledger_field("bucket", _BURST, "the bucket's size (tokens)")

    def __init__(
        self, scope: Scope, name: str, limit_name: str, rate: int, burst: int, scaled: bool
    ) -> None:
        self.scope = scope
        self._l = scope._l
        self._i = self._l.add_bucket(scope._i, burst)
        self.name, self.limit_name = name, limit_name
        self.rate, self.scaled = rate, scaled
        self.global_avail = burst
        self.fallback: Any = None
        #: the rate (tokens/min) and burst (tokens) of the standing slices of every replica
        #: that may hold one, kept out of the shared bucket; ``stamp``: a standing slice's
        #: bucket, when its tokens were last refilled (``time.monotonic()`` seconds)
        self.sr = self.sb = 0
        self.stamp = 0.0
        #: a standing slice's bucket: the claim it was last refilled under (0: none yet)
        self.gen = 0

    def spec(self, ret: int, debt: int) -> dict[str, Any]:
        """The bucket as ``kvg_sync`` reads it."""
        d: dict[str, Any] = {"r": self.rate, "b": self.burst}
        if self.scaled:
            d["sc"] = 1
        if self.sr or self.sb:
            d["sr"], d["sb"] = self.sr, self.sb
        if ret:
            d["ret"] = ret
        if debt:
            d["debt"] = debt
        return d


@dataclass(slots=True)
class Admit:
    """A request waiting for a decision in Redis (one scope's part of it)."""

    scope: Scope
    alts: list[tuple[int, list[Pool]]]
    buckets: list[tuple[Bucket, int]]
    future: asyncio.Future[Any]
    taken: list[tuple[Pool, int]] = field(default_factory=list)
    admitted: bool = False
    #: admitted from this replica's own quota and tokens, not in Redis
    local: bool = False
    #: its message's outcome is unknown and its caller has yet to decide by the fallback
    #: (counted in ``Scope.falling``)
    falling: bool = False
    #: its caller decided and went on
    gone: bool = False


class Scope:
    """One tenant's or one backend's limits, as this replica holds them."""

    __slots__ = (
        "_i",
        "_l",
        "admits",
        "buckets",
        "busy",
        "contended",
        "epoch",
        "falling",
        "flush",
        "hb_due",
        "key",
        "kind",
        "name",
        "pools",
        "scale",
        "seq",
        "settled",
        "shed",
        "unsent",
        "wake",
    )

    def __init__(self, prefix: str, kind: str, name: str, ledger: Any) -> None:
        self._l = ledger
        self._i = ledger.add_scope()
        self.kind, self.name = kind, name
        self.key = scope_key(prefix, kind, name)
        self.pools: dict[str, Pool] = {}
        self.buckets: dict[str, Bucket] = {}
        self.seq = 0
        self.epoch: str | None = None
        self.scale = 1.0
        self.shed = False
        self.busy = False
        #: requests queued behind this scope's last message: the next decision goes through
        #: the lane task, which sends the following message as soon as a reply is in
        self.contended = False
        self.wake = False
        self.hb_due = False
        self.admits: list[Admit] = []
        #: something to tell Redis that no message composed yet carries (see
        #: :meth:`RedisStore.flushed`), and the futures of those waiting until one does
        self.unsent = False
        self.flush: list[asyncio.Future[None]] = []
        #: requests whose message had an unknown outcome, not yet decided by the fallback:
        #: the next message waits for them (:meth:`RedisStore._fallbacks_decided`)
        self.falling = 0
        self.settled: asyncio.Future[None] | None = None

    @property
    def lease_until(self) -> float:
        """Until when (``time.monotonic()`` seconds) this replica may admit from its quotas."""
        return float(self._l.scope_lease(self._i))

    @lease_until.setter
    def lease_until(self, value: float) -> None:
        self._l.set_scope_lease(self._i, float(value))

    @property
    def live(self) -> int:
        """Live replicas in the scope as Redis last said."""
        return int(self._l.scope_live(self._i))

    @live.setter
    def live(self, value: int) -> None:
        self._l.set_scope_live(self._i, int(value))

    def holds(self) -> bool:
        """Whether this replica holds anything in the scope (then it heartbeats there)."""
        return any(p.q or p.in_use or p.rq for p in self.pools.values()) or any(
            b.avail for b in self.buckets.values()
        )


@dataclass(slots=True)
class Part:
    """One scope's share of a request: pool alternatives (units, pools tried in order) and
    buckets (tokens)."""

    scope: Scope
    alts: list[tuple[bool, list[Pool]]]  # (counts tokens rather than one slot, pools)
    buckets: list[Bucket]
    #: the part as :meth:`kvgate._core.QuotaLedger.add_plan` takes it (set with the first plan)
    code: Any = None


class StoreHold:
    """What an admitted request holds in the store: units of pools and tokens of buckets
    (``shared``: the buckets whose tokens came from this replica's own share while Redis was
    away, not from the shared bucket)."""

    __slots__ = ("buckets", "pools", "shared")

    def __init__(
        self, pools: list[tuple[Pool, int]], buckets: list[Bucket], shared: tuple[Bucket, ...] = ()
    ) -> None:
        self.pools = pools
        self.buckets = buckets
        self.shared = shared
