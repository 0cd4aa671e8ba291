"""Limits shared by several gateway replicas through Redis (or Valkey), version 7.0 or later.

How it works (docs/replicas.md):

- Every limit is a *scope* in Redis: a tenant (its concurrency pool and TPM bucket) or a
  backend (its burst slot pool, one pool per tenant guarantee, its in-flight token budget, its
  TPM bucket), all of a scope's keys under one hash tag (one Redis Cluster slot). The Redis
  Function ``kvg_sync`` (``kvgate.lua``, loaded at start and again whenever Redis lost it) is
  the only writer.
- Each replica (one gateway process) holds *quotas*: units of each pool and pre-debited tokens
  of each bucket. An admission that fits in what the replica holds is decided here, without
  Redis (:meth:`RedisStore.try_admit`, in the Rust core: :class:`kvgate._core.QuotaLedger`
  holds the quotas, the leases and what the requests took; the objects of
  :mod:`kvgate.store.scopes` are views of it); below a low-water mark the replica asks for
  more in the background. Near a limit (less than ``near_fraction`` of it free) the replica
  gives back what it holds beyond its use and every admission is decided in Redis,
  atomically, coalesced with the other requests of the same scope waiting at that moment: the
  decision at the boundary is exact.
- Every message re-asserts the replica's quotas (``q := what I hold``) with a sequence number:
  lowering a quota is how units go back; a lost write, a call that timed out, or a Redis
  restart without persistence is healed by the next message. A message older than one already
  applied changes nothing, so a late delivery of a timed-out call cannot undo a newer one; every
  message carries an operation id (Redis keeps the reply of each replica's last one, so a
  repeated delivery gets it again and changes nothing), and the client never retries blindly:
  only a message whose connection was closed goes once more, on a new connection.
- Unknown outcomes are counted the safe way: a grant is used only once its reply arrived;
  tokens given back are dropped before the reply; an overrun is forgotten only once charged.
- Heartbeats every ``heartbeat_s`` renew the replica's lease in each scope where it holds
  anything; a replica silent for ``lease_ttl_s`` is reaped by the others (its quotas return, its
  unused tokens count as spent). A replica whose own lease has run out (frozen, then woken)
  admits nothing locally until Redis heard from it again; it re-asserts only what it still runs.
- Adaptive scale: each replica proposes its backend's scale and shedding in its messages; the
  effective scale is the lowest live proposal, shedding is on when any live replica sheds.
- Redis slow or down: no request waits past ``deadline_ms``; after ``breaker_failures``
  consecutive failures the breaker opens and each limit falls back by its policy (``share``,
  ``strict``, ``open``, ``closed``); a probe closes it again (the first soon after it opened,
  then every heartbeat), and every active scope then re-asserts what the replica holds.
- Standing slices (``standing_share``, off by default): each of up to ``standing_replicas``
  replicas holding a claim (``kvg_stand``, renewed every heartbeat) admits a small slice of each
  large tenant limit without any message, and Redis keeps those slices out of what it grants:
  a tenant seen rarely costs no call (docs/replicas.md, "Standing slices").
- The messages go on a connection of the store's own (:mod:`kvgate.store.wire`: written in
  the sender's step, replies matched in order) to a single server, and on redis-py's client on
  a Redis Cluster; loading the library and the admin reads use redis-py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import replace
from typing import Any

import orjson

from kvgate._core import UNLIMITED_TPM, QuotaLedger
from kvgate.store import StoreRefusal
from kvgate.store.scopes import (
    BURST,
    GUARANTEE,
    PLAIN,
    Admit,
    Bucket,
    Part,
    Pool,
    Scope,
    StoreHold,
    plan_key,
    scope_key,
)
from kvgate.store.server import (
    connection_lost,
    left_replica,
    library_missing,
    load_library,
    sentinel_for,
    short_error,
    store_client,
    store_wire,
)
from kvgate.store.wire import Wire

__all__ = ["RedisStore", "StoreHold", "load_library", "scope_key"]

logger = logging.getLogger("kvgate.store")

#: the longest an answer's end waits for :meth:`RedisStore.flushed` (seconds; ``deadline_ms``
#: when shorter): a scope's message in flight is answered within a few milliseconds when Redis
#: is healthy, and a client is not kept waiting longer for the order of two messages
FLUSH_WAIT_S = 0.1

#: the first probe after the breaker opens (seconds); each next one comes twice as late, until
#: the heartbeat's own probes (every ``heartbeat_s``) take over
FIRST_PROBE_S = 0.1

#: heartbeats after its start during which a replica keeps no headroom floor
#: (:attr:`kvgate._core.QuotaLedger.warming`): replicas that start together learn of each other
#: from their backends' replies within a heartbeat
WARM_HEARTBEATS = 2

#: heartbeat messages sent at once: with more active scopes, the rest go out in groups of
#: this many spread over the first half of the heartbeat period, so that a decision near a
#: limit waits in Redis behind at most about this many of them (50 µs each), not behind
#: thousands (a replica serving a few thousand tenants a second: 80 ms and more, past every
#: ``deadline_ms``, and the breaker opened with Redis healthy)
BEAT_GROUP = 32

#: ``kvg_leave`` calls in flight at once while a replica closes (:meth:`RedisStore.close`)
LEAVE_AT_ONCE = 64

#: seconds a replica sends its heartbeats one call per scope after Redis answered that it has
#: no ``kvg_sync_many`` (a library loaded by an earlier kvgate, during a rolling upgrade)
BATCH_OFF_S = 60.0

#: seconds a scope's state surely outlives its last reply (``kvgate.lua`` keeps it 180 s + 4
#: leases after each message): a state missing sooner was lost by Redis, not expired
STATE_KEPT_S = 170.0

#: the bit of a request plan's ledger key that marks its standing variant (the tenant's part
#: taken from this replica's standing slices: :meth:`RedisStore._plan`)
STANDING = 1 << 62


class _Breaker:
    """The circuit breaker: open after ``limit`` consecutive failed calls; closed by the first
    success."""

    __slots__ = ("failures", "limit", "opened_at")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.failures = 0
        self.opened_at: float | None = None

    def failed(self, now: float) -> bool:
        """Counts a failure; whether it opened the breaker."""
        self.failures += 1
        if self.failures >= self.limit and self.opened_at is None:
            self.opened_at = now
            return True
        return False

    def succeeded(self) -> bool:
        """Counts a success; whether it closed the breaker."""
        was_open = self.opened_at is not None
        self.failures = 0
        self.opened_at = None
        return was_open


class RedisStore:
    """The limits of every replica sharing one Redis (see the module docstring).

    Args:
        config: the ``store`` section (:class:`kvgate.config.StoreConfig`).
        controller: the admission core (its base limits: ``backend_state``, ``tenant_state``).
        client: a ready ``redis.asyncio`` client (tests); ``None``: made from ``config.url``.
        metrics: the gateway's metrics (:class:`kvgate.metrics.GatewayMetrics`) or ``None``.
        on_effective: called with ``(backend name, scale, shedding)`` when the scale or
            shedding in force across the replicas changes.
    """

    mode = "redis"

    def __init__(
        self,
        config: Any,
        controller: Any,
        *,
        client: Any = None,
        metrics: Any = None,
        on_effective: Callable[[str, float, bool], None] | None = None,
    ) -> None:
        self.config = config
        self.controller = controller
        self.prefix = config.key_prefix
        self.pod = f"{socket.gethostname()[:24]}-{os.getpid()}-{secrets.token_hex(3)}"
        #: the random part of the epochs this replica proposes (a scope's epoch is the one of
        #: the message that found no state in Redis: this nonce and the message's sequence)
        self._nonce = secrets.token_hex(6)
        self._client = client
        #: what the Functions calls go on: a :class:`~kvgate.store.wire.Wire` to a single
        #: server, else the redis-py client (a cluster, a TLS setting it does not apply, or
        #: ``client`` given)
        self._wire: Any = None
        #: redis-py's ``Sentinel`` that names the primary (``config.sentinel``), or ``None``
        self._sentinel: Any = None
        #: the heartbeat's question to the sentinels (:meth:`_check_primary`) while it runs
        self._check_task: asyncio.Task[None] | None = None
        self._metrics = metrics
        self._on_effective = on_effective
        self.scopes: dict[str, Scope] = {}
        self._active: set[Scope] = set()
        # the scopes active at the last heartbeat (a scope not among them is a newcomer)
        self._active_before: set[Scope] = set()
        self._parts: dict[tuple[int, int, bool], list[Part]] = {}
        #: each backend's part of the plans of tenants without a guarantee on it (by id)
        self._backend_parts: dict[int, Part] = {}
        #: the ledger keys of standing plans made alone (:meth:`_plan_standing`): whether the
        #: tenant has slices
        self._standing_plans: dict[int, bool] = {}
        # the quotas, leases and holds of the local fast path (Rust); scopes by ledger index
        self._ledger = QuotaLedger(
            config.chunk_fraction, on_kick=self._kick_at, on_active=self._active_at
        )
        self._scope_at: list[Scope] = []
        self._pool_at: list[Pool] = []
        self._bucket_at: list[Bucket] = []
        self._breaker = _Breaker(config.breaker_failures)
        self._ttl = config.ttl_s
        self._deadline = config.deadline_ms / 1000.0
        self._bg_deadline = config.background_deadline_ms / 1000.0
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        #: scopes a release kicked since the last :meth:`flushed` (emptied every heartbeat
        #: when nobody waits), and whether a release runs now
        self._kicked: list[Scope] = []
        self._releasing = False
        #: the most live replicas a backend's scope named (a tenant scope counts at least as
        #: many: see :meth:`_apply`)
        self._backend_live = 1
        self._warm_until = 0.0
        self._props: dict[str, tuple[float, bool]] = {}
        self._closed = False
        self._loaded = False
        self.calls = 0
        #: calls that failed by kind, and ``late``: admissions that fell back because no reply
        #: came before their deadline (counted per admission; the call may fail as well)
        self.failures: dict[str, int] = {"timeout": 0, "error": 0, "stale": 0, "late": 0}
        if metrics is not None:
            for kind in self.failures:  # every series from the start, at 0
                metrics.store_failures.labels(kind)
        self.amnesia = 0
        #: messages sent a second time after their connection was closed
        self.resent = 0
        self.reaped = 0
        self.degraded_admissions = 0
        self._last_failure = ""
        #: the share policy turned into after_degraded in this outage (logged once)
        self._share_ended = False
        #: until when heartbeats go one call per scope (:data:`BATCH_OFF_S`; monotonic s)
        self._batch_off_until = 0.0
        #: standing slices: the ledger scope that holds this replica's slice of every tenant
        #: with slices (its lease is the claim's), the claim (-1: none), until when it may be
        #: used (monotonic s), the heartbeat's renewal in flight, and each tenant's slice
        #: bucket by tenant id (refilled as it is used)
        self._standing: Scope | None = None
        self._stand_claim = -1
        self._stand_until = 0.0
        self._stand_task: asyncio.Task[None] | None = None
        self._stand_buckets: dict[int, Bucket] = {}
        #: the tenants this replica holds a slice of, and the tenant pools with a spill
        #: (:meth:`_standing_overflow`)
        self._stand_tenants: set[str] = set()
        self._spilling: set[Pool] = set()
        #: admissions from this replica's standing slices (no message to Redis)
        self.standing_admissions = 0
        #: the claim taken last (a count) and since when its buckets count as refilling
        #: (monotonic s): a slice's bucket from before it starts again (:meth:`_try_standing`)
        self._stand_gen = 0
        self._stand_since = 0.0
        if config.standing_share > 0:
            self._standing = Scope(self.prefix, "s", "standing", self._ledger)
            self._scope_at.append(self._standing)

    @property
    def admissions(self) -> int:
        """Admissions this store granted (local or in Redis, fallbacks included)."""
        return int(self._ledger.admissions)

    @admissions.setter
    def admissions(self, value: int) -> None:
        self._ledger.admissions = int(value)

    def _kick_at(self, i: int) -> None:
        sc = self._scope_at[i]
        if sc is not self._standing:  # standing slices are never told to Redis
            self._kick(sc)

    def _active_at(self, i: int) -> None:
        sc = self._scope_at[i]
        if sc is not self._standing:
            self._active.add(sc)

    # ---- set-up -----------------------------------------------------------------------------
    def _make_client(self) -> Any:
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        opts: dict[str, Any] = {
            # no blind retries: a timed-out call may still run on the server (a call whose
            # connection was closed goes again with its operation id: RedisStore._send)
            "retry": Retry(NoBackoff(), 0),
            "socket_connect_timeout": max(self._bg_deadline, 0.5),
        }
        if not self.config.cluster:
            opts["health_check_interval"] = 0
        return store_client(self.config, self._sentinel, **opts)

    async def start(self, backends: Sequence[str] = ()) -> None:
        """Connects, loads the Functions library, joins the scopes of ``backends`` (names) and
        starts the heartbeat. Joining tells Redis this replica is live there and tells the
        replica how many are, before its first request: the ``share`` a limit falls back to
        when a first reply comes late (within the background deadline; a slow Redis leaves it
        to the first requests). Redis unreachable at start is not fatal: the replica starts
        degraded (its fallback policy; a replica that never reached Redis holds no share) and
        keeps trying every heartbeat."""
        if self._client is None:
            self._sentinel = sentinel_for(self.config, max(self._bg_deadline, 0.5))
            self._client = self._make_client()
            self._wire = store_wire(
                self.config,
                self._sentinel,
                connect_timeout_s=max(self._bg_deadline, 0.5),
                stall_s=max(1.0, 2 * self._bg_deadline),
            )
        if self._wire is None:
            self._wire = self._client
        # until its backends have answered a heartbeat or two, the replica may not know of the
        # replicas that started with it: no headroom floor meanwhile (QuotaLedger.warming)
        self._ledger.warming = True
        self._warm_until = time.monotonic() + WARM_HEARTBEATS * self.config.heartbeat_s
        try:
            async with asyncio.timeout(max(2.0, self._bg_deadline)):
                await load_library(self._client, self.config.cluster)
            self._loaded = True
        except Exception as exc:
            self._last_failure = f"{type(exc).__name__}: {short_error(exc)}"
            if left_replica(exc):
                logger.error(
                    "store: the Redis server reached at start is a read-only replica (%s): "
                    "point store.url at the primary (or use store.sentinel); limits use their "
                    "fallback policies until a primary answers",
                    short_error(exc),
                )
            else:
                logger.error(
                    "store: cannot reach Redis at start (%s); limits use their fallback "
                    "policies until it answers",
                    short_error(exc),
                )
            self._breaker.opened_at = time.monotonic()
            self._breaker.failures = self._breaker.limit
            if self._metrics is not None:
                self._metrics.store_breaker.set(1)
        if self._loaded:
            await self._join(backends)
        self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat())

    async def _join(self, backends: Sequence[str]) -> None:
        """One message in each backend's scope (16 at a time), all within the background
        deadline (at least a second); those without a reply by then are left to the first
        requests."""
        gate = asyncio.Semaphore(16)

        async def join(name: str) -> None:
            sc = self._scope("b", name)
            async with gate:
                if sc.busy or sc.epoch is not None:
                    return
                sc.hb_due = True
                sc.busy = True
                await self._lane(sc, once=True)

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(1.0, self._bg_deadline)):
                await asyncio.gather(*(join(name) for name in backends))

    async def close(self) -> None:
        """Stops the heartbeat, leaves every scope where Redis may still count this replica
        live — it holds something there, or its lease there has not run out — so that what
        it held goes back at once (one ``kvg_leave`` per scope, up to :data:`LEAVE_AT_ONCE`
        in flight; best effort within the background deadline, at least a second), and
        disconnects. Scopes whose lease ran out are left alone: the others reap them, and a
        replica that served 100,000 tenants once each would otherwise spend its shutdown on
        them, one round trip each."""
        self._closed = True
        for task in (self._heartbeat_task, self._check_task, self._stand_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._client is None:
            return
        now = time.monotonic()
        # (lease_until is this replica's cautious view: Redis's lease runs a tenth longer)
        margin = 0.2 * self._ttl
        leaving = [
            sc
            for sc in self.scopes.values()
            if sc.epoch is not None and (sc.lease_until + margin > now or sc.holds())
        ]
        with contextlib.suppress(Exception):
            async with asyncio.timeout(max(1.0, self._bg_deadline)):
                for i in range(0, len(leaving), LEAVE_AT_ONCE):
                    await asyncio.gather(
                        *(
                            self._wire.fcall("kvg_leave", 2, sc.key, sc.key + ":live", self.pod)
                            for sc in leaving[i : i + LEAVE_AT_ONCE]
                        )
                    )
        if self._stand_claim >= 0:  # best effort: unclaimed, it frees itself in two leases
            self._stand_until = 0.0
            with contextlib.suppress(Exception):
                await self._claim_standing(leave=True)
        with contextlib.suppress(Exception):
            if self._wire is not self._client:
                await self._wire.aclose()
            await self._client.aclose()
        if self._sentinel is not None:
            with contextlib.suppress(Exception):
                await self._sentinel.aclose()

    # ---- request plans ----------------------------------------------------------------------
    def _scope(self, kind: str, name: str) -> Scope:
        key = kind + name
        sc = self.scopes.get(key)
        if sc is None:
            sc = self.scopes[key] = Scope(self.prefix, kind, name, self._ledger)
            self._scope_at.append(sc)
            if kind == "t":
                sc.live = self._backend_live
        return sc

    def _plan(self, backend: Any, tenant: Any, priority: str) -> list[Part]:
        """The scopes, pools and buckets a request of ``tenant`` on ``backend`` takes from, from
        the core's base limits (cached until :meth:`reload`)."""
        sheddable = priority == "sheddable"
        key = (backend.id, tenant.id, sheddable)
        parts = self._parts.get(key)
        if parts is not None:
            return parts
        parts = []
        ctl = self.controller
        t = ctl.tenant_state(tenant.id)
        standing: Part | None = None
        if t["max_concurrency"] is not None or t["tokens_per_minute"] is not None:
            sc = self._scope("t", tenant.name)
            alts: list[tuple[bool, list[Pool]]] = []
            buckets: list[Bucket] = []
            conc: Pool | None = None
            tpm: Bucket | None = None
            if t["max_concurrency"] is not None:
                conc = self._pool(sc, "conc", "tenant-concurrency", PLAIN, t["max_concurrency"])
                alts.append((False, [conc]))
            if t["tokens_per_minute"] is not None:
                tpm = self._bucket(
                    sc,
                    "tpm",
                    "tenant-tpm",
                    t["tokens_per_minute"],
                    t["burst_tokens"] or t["tokens_per_minute"],
                    False,
                )
                buckets.append(tpm)
            parts.append(Part(sc, alts, buckets))
            if self._standing is not None:
                sliced = self._slices(t)
                n = self.config.standing_replicas
                if conc is not None:
                    conc.st = sliced[0] * n if sliced else 0
                if tpm is not None:
                    tpm.sr, tpm.sb = (sliced[1] * n, sliced[2] * n) if sliced else (0, 0)
                standing = self._standing_part(tenant, t, sliced)
        bpart = self._backend_part_of(backend, tenant, t, sheddable)
        parts.append(bpart)
        self._parts[key] = parts
        self._add_plan(parts, plan_key(backend.id, tenant.id, sheddable))
        if standing is not None:
            self._add_plan([standing, bpart], plan_key(backend.id, tenant.id, sheddable) | STANDING)
        return parts

    def _backend_part_of(self, backend: Any, tenant: Any, t: Any, sheddable: bool) -> Part:
        """The backend's part of ``tenant``'s plan (``t``: its ``tenant_state``): the shared
        one, or one with the tenant's guarantee pool (never for a sheddable request)."""
        mine = t["guaranteed_slots"] if backend.id in t["guaranteed_backends"] else 0
        mine = 0 if sheddable else mine
        bpart = None if mine else self._backend_parts.get(backend.id)
        return bpart if bpart is not None else self._backend_part(backend, tenant, mine)

    def _plan_standing(self, backend: Any, tenant: Any, priority: str, key: int) -> bool:
        """The standing variant of a request plan alone (``key``: its ledger key), for a
        tenant's first request while this replica may use its slices: the plan that goes to
        Redis (:meth:`_plan`) is made only if the slice cannot admit it. Returns whether the
        tenant has slices (remembered until :meth:`reload`)."""
        known = self._standing_plans.get(key)
        if known is not None:
            return known
        t = self.controller.tenant_state(tenant.id)
        sliced = None
        if t["max_concurrency"] is not None or t["tokens_per_minute"] is not None:
            sliced = self._slices(t)
        part = self._standing_part(tenant, t, sliced)
        if part is not None:
            sheddable = priority == "sheddable"
            self._add_plan([part, self._backend_part_of(backend, tenant, t, sheddable)], key)
        self._standing_plans[key] = part is not None
        return part is not None

    def _slices(self, t: Any) -> tuple[int, int, int] | None:
        """A tenant's standing slice (``t``: the core's ``tenant_state``): slots, tokens per
        minute and burst tokens, each ``store.standing_share`` ÷ ``standing_replicas`` of its
        limit, rounded down; ``None`` when one of its limits is too small for a slice of at
        least one (then every unit of the tenant comes from Redis)."""
        share, n = self.config.standing_share, self.config.standing_replicas
        conc, rate = t["max_concurrency"], t["tokens_per_minute"]
        slots = int(conc * share / n + 1e-9) if conc is not None else 0
        srate = int(rate * share / n + 1e-9) if rate is not None else 0
        sburst = int((t["burst_tokens"] or rate) * share / n + 1e-9) if rate is not None else 0
        if (conc is not None and slots < 1) or (rate is not None and min(srate, sburst) < 1):
            return None
        return slots, srate, sburst

    def _backend_part(self, backend: Any, tenant: Any, mine: int) -> Part:
        """The backend's part of a request plan: ``tenant``'s guarantee pool (``mine`` slots;
        0: none) then the burst pool, the in-flight token budget and the TPM bucket. Without a
        guarantee the part is the same for every tenant: kept (until :meth:`reload`) for the
        next tenant's plan."""
        b = self.controller.backend_state(backend.id)
        sc = self._scope("b", backend.name)
        base, gsum = b["max_concurrency"], b["guaranteed_slots"]
        slot_pools: list[Pool] = []
        if mine:
            slot_pools.append(
                self._pool(
                    sc, "g:" + tenant.name, "backend-slots", GUARANTEE, base, g=mine, gs=gsum
                )
            )
        slot_pools.append(self._pool(sc, "burst", "backend-slots", BURST, base, gs=gsum))
        alts = [(False, slot_pools)]
        if b["inflight_token_limit"] is not None:
            # the budget is not scaled by KV pressure (it is KV capacity already); each
            # replica's core lowers it by the engine's external occupancy
            pool = self._pool(sc, "inflight", "inflight-tokens", PLAIN, b["inflight_token_limit"])
            alts.append((True, [pool]))
        buckets = []
        if b["tokens_per_minute"] < UNLIMITED_TPM:
            buckets.append(
                self._bucket(
                    sc, "tpm", "backend-tpm", b["tokens_per_minute"], b["burst_tokens"], True
                )
            )
        part = Part(sc, alts, buckets)
        if not mine:
            self._backend_parts[backend.id] = part
        return part

    def _add_plan(self, parts: list[Part], key: int) -> None:
        """Gives the ledger the plan of ``parts`` under ``key`` (each part's ledger ids are
        worked out once)."""
        for part in parts:
            if part.code is None:
                part.code = (
                    part.scope._i,
                    [(t, [p._i for p in pools]) for t, pools in part.alts],
                    [b._i for b in part.buckets],
                )
        self._ledger.add_plan([part.code for part in parts], key)

    def _standing_part(
        self, tenant: Any, t: Any, sliced: tuple[int, int, int] | None
    ) -> Part | None:
        """The part of a request plan that takes from this replica's own standing slice of
        ``tenant`` (``sliced``: :meth:`_slices`), its pool and bucket in the standing scope made
        or resized; ``None`` without a slice."""
        stand = self._standing
        if stand is None or sliced is None:
            self._stand_buckets.pop(tenant.id, None)
            return None
        slots, rate, burst = sliced
        self._stand_tenants.add(tenant.name)
        alts: list[tuple[bool, list[Pool]]] = []
        buckets: list[Bucket] = []
        if t["max_concurrency"] is not None:
            pool = self._pool(stand, tenant.name, "tenant-concurrency", PLAIN, slots)
            pool.q = pool.limit = slots
            alts.append((False, [pool]))
        if t["tokens_per_minute"] is not None:
            b = stand.buckets.get(tenant.name)
            if b is None:  # filled at its first use under a claim (_try_standing)
                b = self._bucket(stand, tenant.name, "tenant-tpm", rate, burst, False)
                b.avail = 0
            else:
                b.rate, b.burst = rate, burst
                b.avail = min(b.avail, burst)
            self._stand_buckets[tenant.id] = b
            buckets.append(b)
        return Part(stand, alts, buckets)

    def _pool(
        self, sc: Scope, name: str, limit_name: str, kind: str, base: int, g: int = 0, gs: int = 0
    ) -> Pool:
        pool = sc.pools.get(name)
        if pool is None:
            pool = sc.pools[name] = Pool(sc, name, limit_name, kind, base, g, gs)
            self._pool_at.append(pool)
        else:  # a reload changed the limit: keep what is held
            pool.base, pool.g, pool.gs = base, g, gs
        return pool

    def _bucket(
        self, sc: Scope, name: str, limit_name: str, rate: int, burst: int, scaled: bool
    ) -> Bucket:
        b = sc.buckets.get(name)
        if b is None:
            b = sc.buckets[name] = Bucket(sc, name, limit_name, rate, burst, scaled)
            self._bucket_at.append(b)
        else:
            b.rate, b.burst, b.scaled = rate, burst, scaled
        return b

    def reload(self) -> None:
        """Forgets the request plans (a reload or a discovered engine limit changed the base
        limits); what is held is kept and re-asserted with the new limits. The guarantee pools
        take their tenants' guarantees now at once (a tenant that lost its guarantee, or was
        removed, may send no request again to re-plan it; its units still running are counted
        against the burst pool in Redis by what the guarantee is now)."""
        self._parts.clear()
        self._backend_parts.clear()
        self._standing_plans.clear()
        self._ledger.clear_plans()
        ctl = self.controller
        self._standing_overflow()
        for bid in range(ctl.backend_count):
            b = ctl.backend_state(bid)
            sc = self.scopes.get("b" + str(b["name"]))
            if sc is None:
                continue
            for name, pool in sc.pools.items():
                # (only those holding units: one that holds none is set again when next
                # planned, and 100,000 guaranteed tenants would make this a long loop)
                if not name.startswith("g:") or not (pool.q or pool.in_use or pool.rq):
                    continue
                tid = ctl.tenant_id(name[2:])
                g = 0
                if tid is not None:
                    t = ctl.tenant_state(tid)
                    if bid in t["guaranteed_backends"]:
                        g = int(t["guaranteed_slots"])
                pool.base, pool.g, pool.gs = b["max_concurrency"], g, b["guaranteed_slots"]

    def _standing_overflow(self) -> None:
        """After a reload: the slots this replica's requests hold in its standing slice of a
        tenant beyond the tenant's slice now (smaller, or none) are no longer kept out of
        Redis by ``st``. They are the ``spill`` of the tenant's pool: counted in its
        ``in_use``, re-asserted to Redis at once and given back as those requests end
        (:meth:`_spill_ended`), so that the other replicas count them. Worked out again at
        every reload: a limit raised again takes them back into the slice."""
        stand = self._standing
        if stand is None:
            return
        ctl, n = self.controller, self.config.standing_replicas
        # the slices whose requests hold slots, and those that spilt at an earlier reload (read
        # in one pass in Rust: a replica holds a slice of each of 100,000 tenants)
        slices = {self._pool_at[i] for i, _ in self._ledger.pools_in_use(stand._i)}
        slices.update(p.spill_of for p in self._spilling if p.spill_of is not None)
        for sp in slices:
            name = sp.name
            tid = ctl.tenant_id(name)
            t = ctl.tenant_state(tid) if tid is not None else None
            if t is None or t["max_concurrency"] is None:
                continue  # no limit to count them against any more
            sliced = self._slices(t)
            slots = sliced[0] if sliced else 0
            over = max(0, sp.in_use - slots)
            sp.q = slots
            sc = self._scope("t", name)
            conc = self._pool(sc, "conc", "tenant-concurrency", PLAIN, int(t["max_concurrency"]))
            conc.st = slots * n
            conc.in_use += over - conc.spill
            conc.spill, conc.spill_of = over, sp
            if over:
                self._spilling.add(conc)
            else:
                self._spilling.discard(conc)
            self._active.add(sc)
            self._ledger.set_active(sc._i, True)
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop()
                self._kick(sc)

    def _spill_ended(self, pool: Pool) -> None:
        """Gives back the spill of ``pool`` (:meth:`_standing_overflow`) whose requests have
        ended: it keeps what its slice's requests still hold beyond the slice."""
        sp = pool.spill_of
        keep = 0 if sp is None else min(pool.spill, max(0, sp.in_use - sp.q))
        if keep < pool.spill:
            pool.in_use -= pool.spill - keep
            pool.spill = keep
        if not keep:
            self._spilling.discard(pool)

    def adopt_running(self, tenant: str, running: Callable[[], int]) -> None:
        """A reload gave ``tenant`` a concurrency limit it did not have: its requests running
        here since before were admitted without one, so no hold of this store's pool counts
        them. The pool takes them in (``adopted`` units of its ``in_use``, re-asserted to
        Redis at once), so that the other replicas count them against the new limit, as one
        gateway's core does; each heartbeat gives back those that have ended
        (:meth:`_adopted_ended`).

        Args:
            tenant: the tenant's name.
            running: how many of the tenant's requests that started before the reload still
                run on this replica (its admitted requests, not those still waiting).
        """
        tid = self.controller.tenant_id(tenant)
        if tid is None:
            return
        limit = self.controller.tenant_state(tid)["max_concurrency"]
        if limit is None:
            return
        sc = self._scope("t", tenant)
        pool = self._pool(sc, "conc", "tenant-concurrency", PLAIN, int(limit))
        if self._standing is not None:  # the slices kept out of Redis, as _plan says them
            sliced = self._slices(self.controller.tenant_state(tid))
            pool.st = sliced[0] * self.config.standing_replicas if sliced else 0
        untracked = running() - (pool.in_use - pool.adopted)
        if untracked > pool.adopted:
            pool.in_use += untracked - pool.adopted
            pool.adopted = untracked
            pool.adopted_from = running
            self._active.add(sc)
            self._ledger.set_active(sc._i, True)
            with contextlib.suppress(RuntimeError):  # no event loop: the next heartbeat says it
                asyncio.get_running_loop()
                self._kick(sc)

    def _adopted_ended(self, pool: Pool) -> None:
        """Gives back the adopted units of ``pool`` whose requests have ended: it keeps at most
        as many as the tenant's requests from before the reload still run (those of them that
        a hold of the pool counts end too, so it may keep some a little longer than needed:
        never fewer)."""
        keep = 0 if pool.adopted_from is None else min(pool.adopted, pool.adopted_from())
        if keep < pool.adopted:
            pool.in_use -= pool.adopted - keep
            pool.adopted = keep
        if not keep:
            pool.adopted_from = None

    # ---- the local fast path ----------------------------------------------------------------
    def try_admit(self, backend: Any, tenant: Any, priority: str, tokens: int) -> Any | None:
        """A hold taken from this replica's quotas, without Redis (an ``int``: its id in the
        ledger, given back by :meth:`release`), or ``None`` when one of them is short (then
        :meth:`admit`), the lease ran out, or Redis is away. The decision is the Rust ledger's
        (:class:`kvgate._core.QuotaLedger`), by the rules of :meth:`_local_picks` and
        :meth:`_take`.

        Args:
            tokens: prompt + reserved completion (tokens).
        """
        if self._breaker.opened_at is not None:
            return None
        key = plan_key(backend.id, tenant.id, priority == "sheddable")
        now = time.monotonic()
        try:
            hold = self._ledger.try_admit_key(key, tokens, now)
        except KeyError:  # the first request of its kind since the start or a reload
            if now < self._stand_until and self._plan_standing(
                backend, tenant, priority, key | STANDING
            ):
                # a tenant seen rarely: its slice, and no plan for Redis unless it is short
                hold = self._try_standing(key | STANDING, tenant.id, tokens, now)
                if hold is not None:
                    return hold
            self._plan(backend, tenant, priority)
            return self._ledger.try_admit_key(key, tokens, now)
        if hold is None and now < self._stand_until:
            return self._try_standing(key | STANDING, tenant.id, tokens, now)
        return hold

    def _try_standing(self, key: int, tenant_id: int, tokens: int, now: float) -> Any | None:
        """:meth:`try_admit` from this replica's standing slices of the tenant (no message):
        its slice bucket first gains the tokens of the time since it was last refilled (at
        the slice's rate, up to its burst)."""
        b = self._stand_buckets.get(tenant_id)
        if b is not None and b.rate > 0:
            if b.gen != self._stand_gen:
                # first use under this claim: what the claim's bucket refilled since it was
                # last used (a bucket that served an earlier claim keeps no more than that)
                fresh = min(b.burst, int((now - self._stand_since) * b.rate / 60.0))
                b.avail = fresh if b.gen == 0 else min(b.avail, fresh)
                b.gen, b.stamp = self._stand_gen, now
            gained = max(0, int((now - b.stamp) * b.rate / 60.0))
            avail, burst = b.avail, b.burst
            if avail + gained >= burst:
                # full: refunds beyond the burst are dropped, as Redis's GCRA drops them
                b.avail, b.stamp = burst, now
            elif gained > 0:
                b.avail = avail + gained
                b.stamp += gained * 60.0 / b.rate
        try:
            hold = self._ledger.try_admit_key(key, tokens, now)
        except KeyError:  # the tenant's limits are too small for a slice
            return None
        if hold is not None:
            self.standing_admissions += 1
        return hold

    def hold_view(self, hold: Any) -> StoreHold | None:
        """The pools (with units) and buckets of a hold :meth:`try_admit` gave (an ``int``) as
        a :class:`StoreHold`, or ``None`` once it was given back; any other hold as it is."""
        if type(hold) is not int:
            return hold  # type: ignore[no-any-return]
        got = self._ledger.hold_parts(hold)
        if got is None:
            return None
        return StoreHold(
            [(self._pool_at[i], n) for i, n in got[0]], [self._bucket_at[i] for i in got[1]]
        )

    @staticmethod
    def _local_picks(part: Part, tokens: int, now: float) -> list[tuple[Pool, int]] | None:
        if now >= part.scope.lease_until:
            return None
        picks: list[tuple[Pool, int]] = []
        for counts_tokens, pools in part.alts:
            n = tokens if counts_tokens else 1
            for pool in pools:
                if pool.q - pool.in_use >= n:
                    picks.append((pool, n))
                    break
            else:
                return None
        for b in part.buckets:
            if b.avail < tokens:
                return None
        return picks

    def _take(self, parts: list[Part], picks: list[tuple[Pool, int]], tokens: int) -> StoreHold:
        """Takes ``picks`` and ``tokens`` from every bucket of ``parts``; asks for more in the
        background where what is left falls under the low-water mark."""
        self.admissions += 1
        buckets: list[Bucket] = []
        take = self._ledger.pool_take
        for pool, n in picks:
            if take(pool._i, n):  # under the low-water mark: more is asked for
                self._kick(pool.scope)
        for part in parts:
            self._active.add(part.scope)
            for b in part.buckets:
                b.avail -= tokens
                b.taken += tokens
                if b.chunk == 0:
                    b.chunk = self._first_chunk(b, tokens)
                buckets.append(b)
                if b.avail <= b.chunk // 3 and not b.near:
                    self._kick(part.scope)
        return StoreHold(picks, buckets)

    def _headroom(self, pool: Pool) -> int:
        """Units this replica keeps beyond its use (the ledger's rule, the same for the local
        fast path): ``chunk_fraction`` of the limit ÷ live replicas, within room for two
        requests of the last size and half of its even share; none near the limit or when half
        of its even share is under one unit."""
        return int(self._ledger.pool_headroom(pool._i))

    def release(self, hold: Any, reserved: int, actual: int) -> None:
        """Gives back a :class:`StoreHold`: its slots and in-flight tokens at once (to this
        replica's quota; what it holds beyond its use goes back to Redis with its next message,
        at once near a limit) and ``reserved - actual`` tokens to each bucket (an overrun goes
        below zero and is charged to the global bucket with the next message).

        Args:
            reserved: the tokens reserved at admission; ``actual``: the tokens charged.
        """
        self._releasing = True  # the scopes this kicks are the ones flushed() waits for
        try:
            if type(hold) is int:  # taken by try_admit, in the ledger
                self._ledger.release(hold, reserved, actual)
            elif type(hold) is StoreHold:
                self._release_hold(hold, reserved, actual)
        finally:
            self._releasing = False

    def _release_hold(self, hold: StoreHold, reserved: int, actual: int) -> None:
        """:meth:`release` of a hold decided in Redis or by the fallback policy."""
        for pool, n in hold.pools:
            pool.in_use = max(0, pool.in_use - n)
            if self._ledger.pool_gives_back(pool._i):  # the ledger's rule, as for its holds
                self._kick(pool.scope)
        diff = reserved - actual
        for b in hold.buckets:
            if diff > 0 and any(b is s for s in hold.shared):
                # taken from this replica's own share, never from the shared bucket: the
                # unused tokens go back to the share (if Redis is still away), not to Redis
                if b.fallback is not None:
                    b.fallback.reconcile(reserved, actual)
                continue
            b.avail += diff
            if diff < 0 or b.near:
                self._kick(b.scope)

    # ---- decisions in Redis -----------------------------------------------------------------
    async def admit(self, backend: Any, tenant: Any, priority: str, tokens: int) -> Any:
        """Admission when this replica's quotas are short: each short scope's part is decided
        in Redis (coalesced with the scope's other waiting requests) within ``deadline_ms``; a
        part that fits in what this replica holds is taken here. Redis away (breaker open,
        deadline passed, error): the fallback policy decides.

        Returns:
            A :class:`StoreHold`, or a :class:`kvgate.store.StoreRefusal`.
        """
        parts = self._plan(backend, tenant, priority)
        if self._breaker.opened_at is not None:
            return self._fallback(parts, tokens)
        now = time.monotonic()
        local_parts: list[Part] = []
        local_picks: list[tuple[Pool, int]] = []
        waits: list[Admit] = []
        loop = asyncio.get_running_loop()
        for part in parts:
            got = self._local_picks(part, tokens, now)
            if got is not None:
                local_parts.append(part)
                local_picks.extend(got)
                continue
            alts = [(tokens if t else 1, pools) for t, pools in part.alts]
            adm = Admit(part.scope, alts, [(b, tokens) for b in part.buckets], loop.create_future())
            part.scope.admits.append(adm)
            self._active.add(part.scope)
            waits.append(adm)
        local = self._take(local_parts, local_picks, tokens)
        try:
            return await self._decide(parts, tokens, waits, local)
        finally:
            for adm in waits:
                adm.gone = True
                if adm.falling:  # decided by the fallback: its scope's next message may go
                    adm.falling = False
                    sc = adm.scope
                    sc.falling -= 1
                    if not sc.falling and sc.settled is not None and not sc.settled.done():
                        sc.settled.set_result(None)

    async def _decide(
        self, parts: list[Part], tokens: int, waits: list[Admit], local: StoreHold
    ) -> Any:
        """:meth:`admit` once the parts to decide in Redis are queued (``waits``) and the
        others taken here (``local``)."""
        answers: list[Any] = []
        try:
            sc = waits[0].scope if len(waits) == 1 else None
            if sc is not None and not sc.busy and not sc.contended:
                # the usual case: one scope near its limit, no message of it in flight, none
                # queued behind the last one: this coroutine sends the message itself (no task
                # to start, no future to wake: a decision costs one round trip and little else)
                sc.busy = True
                await self._lane(sc, once=True)
                fut = waits[0].future
                answers = [fut.result() if fut.done() and not fut.cancelled() else None]
            else:
                for adm in waits:
                    self._kick(adm.scope)
                try:
                    async with asyncio.timeout(self._deadline):
                        if len(waits) == 1:
                            answers = [await waits[0].future]
                        else:
                            answers = list(await asyncio.gather(*(a.future for a in waits)))
                except TimeoutError:
                    # no reply before its deadline (its message waited behind another of
                    # its scope, or the call is slow): an admission that fell back, counted
                    # apart from failed calls (the breaker counts only those)
                    self.failures["late"] += 1
                    if self._metrics is not None:
                        self._metrics.store_failures.labels("late").inc()
        except asyncio.CancelledError:
            # the caller went away (its client disconnected) while Redis decided: what was
            # taken here goes back now, what Redis admits later becomes quota (_apply)
            self._give_back(waits, local, tokens)
            raise
        if len(answers) != len(waits) or any(a is None for a in answers):
            # no answer in time, or an unknown outcome: the fallback decides
            self._give_back(waits, local, tokens)
            return self._fallback(parts, tokens)
        for a in answers:
            if isinstance(a, StoreRefusal):
                self._give_back(waits, local, tokens)
                return a
        for adm in waits:
            local.pools.extend(adm.taken)
            for b, _ in adm.buckets:
                b.taken += tokens
                if b.chunk == 0:
                    b.chunk = self._first_chunk(b, tokens)
                local.buckets.append(b)
        return local

    def _chunk_cap(self, b: Bucket) -> int:
        """The largest grant of ``b`` (tokens; the ledger's rule): ``chunk_fraction`` of the
        burst ÷ live replicas, at least one."""
        return int(self._ledger.bucket_chunk_cap(b._i))

    def _first_chunk(self, b: Bucket, tokens: int) -> int:
        """The grant size before a heartbeat measured the demand (the ledger's rule): eight
        requests of this size, within ``chunk_fraction`` of the burst ÷ live replicas."""
        return int(self._ledger.bucket_first_chunk(b._i, tokens))

    def _give_back(self, waits: list[Admit], local: StoreHold, tokens: int) -> None:
        """A request that will not run: what it took goes back to this replica's quotas (and to
        Redis with their next messages); parts still waiting leave their scopes' queues."""
        self.admissions -= 1  # counted by _take, refused after all
        self.release(local, tokens, 0)
        for adm in waits:
            with contextlib.suppress(ValueError):
                adm.scope.admits.remove(adm)
            if not adm.future.done():
                adm.future.cancel()
            if adm.admitted:  # admitted in Redis after all: the units become quota
                self.release(StoreHold(adm.taken, [b for b, _ in adm.buckets]), tokens, 0)
                adm.admitted = False

    # ---- the fallback ------------------------------------------------------------------------
    def _policy(self, limit_name: str) -> str:
        policy = str(self.config.policy(limit_name))
        if policy == "share" and self._share_over():
            if not self._share_ended:
                self._share_ended = True
                logger.warning(
                    "store: Redis unreachable for over %g s (max_degraded_s); limits with the "
                    "share policy now use %s",
                    self.config.max_degraded_s,
                    self.config.after_degraded,
                )
            return str(self.config.after_degraded)
        return policy

    def _uses_share(self) -> bool:
        """Whether any limit falls back by ``share``."""
        cfg = self.config
        return cfg.on_failure == "share" or "share" in cfg.policies.values()

    def _share_over(self) -> bool:
        """Whether Redis has been away for over ``max_degraded_s``: ``share`` then turns into
        ``after_degraded`` (:meth:`_policy` logs it once per outage)."""
        opened = self._breaker.opened_at
        return opened is not None and time.monotonic() - opened > self.config.max_degraded_s

    def _fallback(self, parts: list[Part], tokens: int) -> Any:
        """The decision without Redis, by each limit's policy: ``open`` admits, ``closed``
        refuses (``store-unavailable``), ``strict`` uses only what this replica holds,
        ``share`` its share of the limit (limit ÷ N, N the most live replicas Redis last named
        for the request's scopes, its backend's included, also for a tenant Redis has not
        answered for yet; nothing when it answered for none of them; what it already runs
        above that continues); tokens: what it holds, then (``share``) its own bucket of the
        rate and burst ÷ N."""
        picks: list[tuple[Pool, int]] = []
        shares: list[tuple[Part, Bucket]] = []
        # N, the same for every limit of the request and on every replica: the most live
        # replicas Redis named for the request's scopes; the backend's counts every replica
        # serving it (each heartbeats there), a tenant's only those that served the tenant
        # lately: a replica that alone served a tenant would otherwise take the tenant's whole
        # limit while the others take their shares of it; 0 when Redis answered for none
        live = max((max(1, p.scope.live) for p in parts if p.scope.epoch is not None), default=0)
        for part in parts:
            sc = part.scope
            for counts_tokens, pools in part.alts:
                n = tokens if counts_tokens else 1
                chosen = None
                for pool in pools:
                    policy = self._policy(pool.limit_name)
                    if policy == "closed":
                        return self._unavailable()
                    if policy == "open":
                        chosen = pool
                        break
                    ceiling = pool.q
                    if policy == "share":
                        # its share, known once Redis named the live replicas (here or in
                        # another scope)
                        ceiling = (pool.limit or pool.base) // live if live else 0
                    if pool.in_use + n <= ceiling:
                        chosen = pool
                        break
                if chosen is None:
                    if not live and pool.q == 0:  # Redis never answered: no share known
                        return self._unavailable()
                    return StoreRefusal(
                        pools[-1].limit_name,
                        scope=_scope_of(sc),
                        retry_after=self.config.heartbeat_s,
                        remaining=0,
                        note=self._alone_note(pools[-1].limit_name),
                    )
                picks.append((chosen, n))
            for b in part.buckets:
                policy = self._policy(b.limit_name)
                if policy == "closed":
                    return self._unavailable()
                if policy == "open" or b.avail >= tokens:
                    continue
                if policy == "strict" or not live:
                    return StoreRefusal(
                        b.limit_name,
                        scope=_scope_of(sc),
                        retry_after=self.config.heartbeat_s,
                        remaining=max(0, b.avail),
                        note=self._alone_note(b.limit_name),
                    )
                if b.fallback is None:
                    from kvgate import TokenBucket

                    b.fallback = TokenBucket(max(1, b.rate // live), max(1, b.burst // live))
                shares.append((part, b))
        for part, b in shares:
            fb = b.fallback
            if tokens > fb.burst_tokens or not fb.try_reserve(tokens):
                retry = fb.retry_after(tokens) if tokens <= fb.burst_tokens else None
                for _, b2 in shares:  # give back the shares already taken
                    if b2 is b:
                        break
                    b2.fallback.reconcile(tokens, 0)
                return StoreRefusal(
                    b.limit_name,
                    scope=_scope_of(part.scope),
                    retry_after=retry if retry else self.config.heartbeat_s,
                    remaining=max(0, fb.available),
                    note=self._alone_note(b.limit_name),
                )
        for _, b in shares:
            b.avail += tokens  # the share's tokens, taken below like a grant
        self.degraded_admissions += 1
        if self._metrics is not None:
            self._metrics.store_degraded.inc()
        hold = self._take(parts, picks, tokens)
        hold.shared = tuple(b for _, b in shares)
        return hold

    def _alone_note(self, limit_name: str) -> str:
        """The refusal message's note for a decision of the fallback policy."""
        return f"decided by this replica alone, Redis not answering: {self._policy(limit_name)}"

    def _unavailable(self) -> StoreRefusal:
        return StoreRefusal(
            "store-unavailable", scope="backend", retry_after=self.config.heartbeat_s
        )

    def _opened(self) -> None:
        logger.warning(
            "store: Redis unreachable (%d failed calls in a row, the last: %s); limits fall "
            "back to their policies (default %s)",
            self._breaker.failures,
            self._last_failure,
            self.config.on_failure,
        )
        if self._metrics is not None:
            self._metrics.store_breaker.set(1)
        if not self._closed:
            self._spawn(self._probe_soon())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Runs ``coro`` as a task of this store, kept referenced until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _probe_soon(self) -> None:
        """Probes Redis sooner than the next heartbeat once the breaker opened: one active
        scope's heartbeat :data:`FIRST_PROBE_S` later, then twice as late each time, until
        the heartbeat's own probes take over. A stall of a few hundred milliseconds then ends
        the fallback about that long after Redis answers again, not up to a heartbeat later."""
        delay = FIRST_PROBE_S
        while delay < self.config.heartbeat_s and not self._closed:
            await asyncio.sleep(delay)
            if self._breaker.opened_at is None:
                return
            sc = next((s for s in self._active if not s.busy), None)
            if sc is not None:
                self._beat(sc)
            delay *= 2

    def _closed_again(self) -> None:
        """Redis answered again: every active scope re-asserts what this replica holds now
        (what the fallback admitted; not what admissions that ran in Redis after their
        deadline left there) with a message at once, not at its next heartbeat."""
        logger.warning("store: Redis reachable again; limits are shared again")
        self._share_ended = False
        if self._metrics is not None:
            self._metrics.store_breaker.set(0)
        for sc in self.scopes.values():
            for b in sc.buckets.values():
                b.fallback = None
        for sc in list(self._active):
            self._beat(sc)

    # ---- the lanes: one message in flight per scope -------------------------------------------
    def _beat(self, sc: Scope) -> None:
        """A heartbeat of ``sc`` now: a message that renews this replica's lease and re-asserts
        what it holds there, sent even while the breaker is open (it is then the probe)."""
        sc.hb_due = True
        self._kick(sc)

    def _kick(self, sc: Scope) -> None:
        """Something to tell Redis about ``sc``: send now, or right after the message in
        flight (whatever accumulated meanwhile goes in one message: coalescing)."""
        sc.unsent = True
        if self._releasing:
            self._kicked.append(sc)
        if sc.busy:
            sc.wake = True
            return
        if self._breaker.opened_at is not None and not sc.hb_due:
            return
        sc.busy = True
        self._spawn(self._lane(sc))

    async def _lane(self, sc: Scope, once: bool = False) -> None:
        """Sends ``sc``'s messages, one in flight, while there is something to say (``sc.busy``
        is set by the caller). ``once``: one message, from the caller's own coroutine; what
        queued meanwhile goes on in a lane task (:meth:`_kick`). Each message's own deadline
        bounds the wait."""
        try:
            while True:
                spent = 0.0
                if sc.falling:
                    began = time.monotonic()
                    await self._fallbacks_decided(sc)
                    # the caller's own request waits at most deadline_ms in all
                    spent = time.monotonic() - began if once else 0.0
                sc.wake = False
                built = self._compose(sc)
                riding = self._composed(sc)
                if built is None:
                    _wake_all(riding)
                    break
                try:
                    await self._send(sc, *built, spent=spent)
                finally:
                    _wake_all(riding)  # applied in Redis (or its outcome unknown)
                sc.contended = len(built[1]) > 1 or bool(sc.admits)
                if once or not (sc.wake or sc.admits) or self._breaker.opened_at is not None:
                    break
        except Exception:  # a lane must never die with ``busy`` set
            logger.exception("store: lane %s failed", sc.key)
        finally:
            self._lane_ended(sc, go_on=once)

    def _lane_ended(self, sc: Scope, go_on: bool) -> None:
        """``sc`` has no message in flight any more: with the breaker open, those waiting on it
        are answered (nothing goes to Redis now); else, with ``go_on``, what queued meanwhile
        goes in a lane of its own."""
        sc.busy = False
        if self._breaker.opened_at is not None:
            _wake_all(self._composed(sc))  # nothing goes to Redis now: nobody waits
            for adm in sc.admits:
                if not adm.future.done():
                    adm.future.set_result(None)
            sc.admits.clear()
        elif go_on and (sc.wake or sc.admits):
            self._kick(sc)

    async def _fallbacks_decided(self, sc: Scope) -> None:
        """Waits until the callers of a message with an unknown outcome decided by the
        fallback (at most ``deadline_ms``: they may wait for another scope's reply as well)
        before ``sc``'s next message is composed, so that it re-asserts what they took.
        Without it, a request that the fallback admits while the next message asks Redis for
        the requests queued behind it would be counted by neither decision, and the replica
        could run one request more than either allows."""
        sc.settled = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(self._deadline):
                await sc.settled
        except TimeoutError:
            pass
        finally:
            sc.settled = None

    def _composed(self, sc: Scope) -> list[asyncio.Future[None]]:
        """The message just composed for ``sc`` carries everything kicked so far: returns the
        futures of those waiting in :meth:`flushed` for it, to be woken once its reply is in
        (:func:`_wake_all`)."""
        sc.unsent = False
        riding, sc.flush = sc.flush, []
        return riding

    async def flushed(self) -> None:
        """Waits until what was given back since the last call is back in Redis: every scope
        a :meth:`release` kicked meanwhile has had its next message answered (or failed; at
        most ``deadline_ms`` or :data:`FLUSH_WAIT_S`, the shorter; at once while Redis is
        away). A request that ends near a limit calls it before its last bytes reach the
        client, so that the client's next request, on any replica, finds the slot back in
        Redis. (Waiting for the reply, not for the write: a message written is not yet a
        message applied, and redis-py, used on a cluster, writes a command only after the
        event loop's next turn.)"""
        kicked, self._kicked = self._kicked, []
        if self._breaker.opened_at is not None:
            return
        loop = asyncio.get_running_loop()
        waits = []
        for sc in kicked:
            if sc.unsent:
                fut = loop.create_future()
                sc.flush.append(fut)
                waits.append(fut)
        if waits:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(self._deadline, FLUSH_WAIT_S)):
                    await asyncio.gather(*waits)

    @property
    def unsent(self) -> bool:
        """Whether something given back since the last :meth:`flushed` may not be on its way to
        Redis yet (no await: the request path asks before awaiting :meth:`flushed`)."""
        return bool(self._kicked)

    def _compose(self, sc: Scope) -> tuple[dict[str, Any], list[Admit], dict[str, int]] | None:
        """The next message of ``sc``: re-asserted quotas (lowered where this replica holds
        more than its headroom), returned and overrun tokens, background grants, the waiting
        admissions, the heartbeat; ``None`` when there is nothing to say."""
        now = time.monotonic()
        expired = sc.epoch is not None and now >= sc.lease_until
        if sc.admits and not expired:
            # quota that arrived since they queued (a grant, a release) serves them here
            sc.admits = [adm for adm in sc.admits if not self._serve_locally(adm)]
        admits = sc.admits
        say = sc.hb_due or bool(admits) or expired
        pools: dict[str, Any] = {}
        grants: dict[str, int] = {}
        # near its limit a pool keeps no headroom (:meth:`_headroom`): what this replica holds
        # beyond its use goes back first, so that a waiting request is decided against
        # everything no one uses; far from it the headroom stays (Redis has room to spare, and
        # the next requests are decided here)
        for name, pool in sc.pools.items():
            # (the ledger's fields read once and written once: each access is a call)
            q = before = pool.q
            in_use = pool.in_use
            if expired:  # our lease ran out (frozen?): re-assert only what runs
                q = in_use
            q = max(q, in_use)  # degraded admissions are re-asserted
            busy = in_use or admits or pool.taken
            h = self._headroom(pool) if busy else 0
            free = q - in_use
            grant = 0
            if h == 0:
                q = in_use
            elif free > 2 * h:
                q = in_use + h
            elif free < (h + 1) // 2:
                grant = grants[name] = h - free
            if q != before:
                pool.q = q
            rq = pool.rq
            if q != before or q != rq or grant:
                say = True
            if q or in_use or rq or grant:
                pools[name] = pool.spec()
                # what Redis records if this message runs and its reply is lost (a timeout)
                pool.rq = max(rq, q + grant)
        buckets: dict[str, Any] = {}
        debts: dict[str, int] = {}
        wanted: dict[str, int] = {}  # tokens the waiting requests ask of each bucket
        for adm in admits:
            for b, n in adm.buckets:
                wanted[b.name] = wanted.get(b.name, 0) + n
        for name, b in sc.buckets.items():
            if expired and b.avail > 0:
                b.avail = 0  # counted as spent by the replicas that reaped us
            ret = debt = 0
            want = wanted.get(name, 0)
            if want and not b.near:
                # requests waited for tokens this replica did not hold (a burst, or the first
                # ones after a quiet spell, before a heartbeat measured the demand): the grant
                # covers twice what they asked for, so that the next ones are decided here
                b.chunk = max(b.chunk, min(self._chunk_cap(b), 2 * want))
            c = b.chunk
            if b.avail < 0:
                debt = debts[name] = -b.avail
            elif b.near or c == 0:
                ret = b.avail
            elif b.avail > 2 * c:
                ret = b.avail - c
            elif b.avail <= c // 3:
                grants[name] = c - b.avail
            if ret:
                b.avail -= ret  # given back before the reply: an unknown outcome loses them
            if ret or debt or name in grants:
                say = True
            buckets[name] = b.spec(ret, debt)
        if not say:
            return None
        sc.admits = []
        sc.hb_due = False
        sc.seq += 1
        msg: dict[str, Any] = {
            "pod": self.pod,
            "seq": sc.seq,
            "ttl": int(self._ttl * 1e6),
            "epoch": f"{self._nonce}.{sc.seq}",
            "pools": pools,
            "buckets": buckets,
        }
        if grants:
            msg["grants"] = grants
        if sc.epoch is not None and now - (sc.lease_until - self._ttl * 0.9) < STATE_KEPT_S:
            # Redis keeps a scope's state at least STATE_KEPT_S after a reply: finding none
            # for a scope this replica heard from more recently means Redis lost it; it then
            # grants nothing until the holders re-asserted their quotas
            msg["known"] = sc.epoch
        if sc.kind == "b":
            scale, shed = self._props.get(sc.name, (1.0, False))
            msg["scale"] = scale
            msg["shed"] = shed
        if admits:
            batch = []
            for adm in admits:
                for n, ps in adm.alts:
                    for p in ps:
                        if p.name not in pools:
                            pools[p.name] = p.spec()
                        # an admit that runs after its deadline still adds to the quota Redis
                        # records: re-asserted (given back) by the next message
                        p.rq = max(p.rq, p.q + grants.get(p.name, 0)) + n
                entry: dict[str, Any] = {"p": [[n, *(p.name for p in ps)] for n, ps in adm.alts]}
                if adm.buckets:
                    entry["b"] = {b.name: n for b, n in adm.buckets}
                batch.append(entry)
            msg["admits"] = batch
        return msg, admits, debts

    def _serve_locally(self, adm: Admit) -> bool:
        """Admits a waiting request from this replica's own quota when it has room now;
        whether it did (then its waiter is answered)."""
        if adm.future.done():
            return True  # its caller gave up: nothing to decide
        picks: list[tuple[Pool, int]] = []
        for n, pools in adm.alts:
            for pool in pools:
                if pool.q - pool.in_use >= n:
                    picks.append((pool, n))
                    break
            else:
                return False
        if any(b.avail < n for b, n in adm.buckets):
            return False
        for pool, n in picks:
            self._ledger.pool_take(pool._i, n)
        for b, n in adm.buckets:
            b.avail -= n  # from the tokens this replica holds, not from the global bucket
        adm.taken = picks
        adm.admitted = True
        adm.local = True
        adm.future.set_result(True)
        return True

    async def _send(
        self,
        sc: Scope,
        msg: dict[str, Any],
        admits: list[Admit],
        debts: dict[str, int],
        spent: float = 0.0,
    ) -> None:
        """Sends one message of ``sc`` and applies the reply (or, without one, its unknown
        outcome); ``spent``: seconds its waiting requests already waited, taken from the
        deadline."""
        client = self._wire
        sent = time.monotonic()
        deadline = max(0.0, (self._deadline if admits else self._bg_deadline) - spent)
        key = sc.key
        # the operation id, named as a third key in the scope's hash slot: the library of this
        # version keeps the last one's reply in the scope's hash (the key is never written),
        # the library of an earlier kvgate (loaded by an earlier replica during a rolling
        # upgrade or a rollback) under that key, so replicas of either version work with either
        op = f"{key}:op:{self.pod}:{msg['seq']}"
        self.calls += 1
        kind = None
        raw: Any = None
        payload = orjson.dumps(msg)
        try:
            call = client.fcall("kvg_sync", 3, key, key + ":live", op, payload)
            if isinstance(call, asyncio.Future):
                # the usual case: written already on the store's own open connection (a
                # Wire), whose one timer bounds the wait (a timeout context per call cost a
                # decision 0.015-0.02 ms more at p50: benches/replicas/wire_ab.py)
                client.expire(call, deadline)
                try:
                    raw = await call
                except TimeoutError:
                    raise
                except Exception as exc:
                    if not (library_missing(exc) or connection_lost(exc)):
                        raise
                    left = max(0.0, deadline - (time.monotonic() - sent))
                    async with asyncio.timeout(left):
                        raw = await self._call_again(client, key, op, payload, exc)
            else:
                async with asyncio.timeout(deadline):
                    try:
                        raw = await call
                    except Exception as exc:
                        raw = await self._call_again(client, key, op, payload, exc)
        except asyncio.CancelledError:
            # the sender went away (its client disconnected, the replica closes): the call may
            # still run on the server and give this replica units no request uses; the next
            # message, right behind it on the connection, re-asserts what the replica holds
            # (near a limit those units would otherwise be refused to every replica until the
            # next heartbeat)
            self._unknown_outcome(sc, msg, admits)
            sc.wake = True
            raise
        except TimeoutError:
            kind = "timeout"
            self._last_failure = f"no answer within {deadline * 1000:g} ms"
        except Exception as exc:
            kind = "error"
            # e.g. OutOfMemoryError when Redis refuses writes (maxmemory, noeviction)
            self._last_failure = f"{type(exc).__name__}: {short_error(exc)}"
            logger.debug("store: call to %s failed: %s", key, short_error(exc))
        if self._metrics is not None:
            self._metrics.store_call_seconds.observe(time.monotonic() - sent)
        if kind is None:
            reply, kind = self._decoded(raw)
        if kind is None:
            kind = self._applied(sc, reply, sent, admits, debts)
        if kind is not None:
            self._count_failure(kind)
            self._unknown_outcome(sc, msg, admits)
            if self._breaker.failed(time.monotonic()):
                self._opened()
            return
        # (after the reply is applied, as for the replies of kvg_sync_many: the waiting
        # requests' futures are set either way, and run once this returns)
        if self._breaker.succeeded():
            self._closed_again()

    def _applied(
        self,
        sc: Scope,
        reply: dict[str, Any],
        sent: float,
        admits: list[Admit],
        debts: dict[str, int],
    ) -> str | None:
        """:meth:`_apply`; ``None`` once applied, ``error`` for a reply it cannot read (a field
        of the wrong type: not kvgate's library answering), which the caller counts as a
        failed call whose outcome is unknown."""
        try:
            self._apply(sc, reply, sent, admits, debts)
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            self._last_failure = f"an answer that is not kvgate's ({type(exc).__name__}: {exc})"
            return "error"
        return None

    def _decoded(self, raw: Any) -> tuple[Any, str | None]:
        """One ``kvg_sync`` reply, decoded, and the kind of failure it is (``None``: none):
        ``stale`` (a late delivery, applied nothing) or ``error`` (an error reply in the
        place of one scope's within a ``kvg_sync_many`` answer)."""
        if isinstance(raw, Exception):
            self._last_failure = short_error(raw)
            return None, "error"
        try:
            reply = orjson.loads(raw)
        except (TypeError, orjson.JSONDecodeError):
            reply = None
        if not isinstance(reply, dict) or "epoch" not in reply:
            # a server that is not Redis with kvgate's library (every reply names the epoch)
            self._last_failure = f"an answer that is not kvgate's: {str(raw)[:80]!r}"
            return None, "error"
        if reply.get("stale"):
            self._last_failure = "a stale reply"
            return reply, "stale"
        return reply, None

    def _count_failure(self, kind: str) -> None:
        """One failed call (``timeout``, ``error`` or ``stale``), counted and exported."""
        self.failures[kind] += 1
        if self._metrics is not None:
            self._metrics.store_failures.labels(kind).inc()

    async def _call_again(
        self, client: Any, key: str, op: str, payload: bytes, exc: Exception
    ) -> Any:
        """The reply of a ``kvg_sync`` call whose first delivery failed with ``exc``, sent once
        more where that is safe (within the caller's deadline); else ``exc`` is raised."""
        loaded = resent = False
        while True:
            if not loaded and library_missing(exc):
                # Redis lost the library (restarted empty, FUNCTION FLUSH): the call did not
                # run, so the same message goes again once it is loaded
                loaded = True
                await load_library(self._client, self.config.cluster)
            elif not resent and connection_lost(exc):
                # the connection was closed (Redis restarted or failed over, or it dropped the
                # connection), or its server is a read-only replica now: the same message goes
                # once more, on a new connection, within the same deadline; had the first
                # delivery run, its operation id makes Redis answer with that delivery's reply
                # and change nothing. A timed-out call is never sent again.
                resent = True
                self.resent += 1
                if left_replica(exc):
                    await self._leave_replica(client)
            else:
                raise exc
            try:
                return await client.fcall("kvg_sync", 3, key, key + ":live", op, payload)
            except Exception as again:
                exc = again

    async def _leave_replica(self, client: Any) -> None:
        """redis-py's connections to a server that is a read-only replica now are closed, so
        that the next call opens a new one (to an address that follows the primary: the new
        primary). The store's own connection (:class:`Wire`) leaves such a server itself; a
        Redis Cluster client follows the slots' new owners itself."""
        pool = getattr(client, "connection_pool", None)
        if pool is not None:
            with contextlib.suppress(Exception):
                await pool.disconnect()

    def _unknown_outcome(self, sc: Scope, msg: dict[str, Any], admits: list[Admit]) -> None:
        """A message without a usable reply (failed, timed out, stale, or its sender
        cancelled): its admissions fall back, and its pools are re-asserted until a reply tells
        what Redis records."""
        for adm in admits:
            if not adm.future.done():
                adm.future.set_result(None)  # unknown outcome: the caller falls back
            if not adm.gone and not adm.falling:
                # the scope's next message waits until the caller decided: it then re-asserts
                # what the fallback took, so that Redis counts it before it decides the
                # requests queued behind
                adm.falling = True
                sc.falling += 1
        for name in msg["pools"]:
            pool = sc.pools.get(name)
            if pool is not None:
                # the call may still run (a grant, an admission): Redis may then record more
                # than this replica holds, so the pool is re-asserted with the next messages
                pool.rq = max(pool.rq, pool.q + 1)
        # a scope whose call failed stays active: while the breaker is open, its heartbeat is
        # the probe that closes it (see :meth:`tick`)
        self._active.add(sc)

    def _apply(
        self,
        sc: Scope,
        reply: dict[str, Any],
        sent: float,
        admits: list[Admit],
        debts: dict[str, int],
    ) -> None:
        """A reply: the quotas and limits as Redis holds them, grants, the decisions."""
        epoch = reply.get("epoch")
        if sc.epoch is not None and epoch != sc.epoch:
            self.amnesia += 1
            logger.warning(
                "store: Redis lost scope %s (restart or flush); this replica's "
                "holdings were re-asserted",
                sc.key,
            )
            if self._metrics is not None:
                self._metrics.store_amnesia.inc()
        sc.epoch = epoch
        live = max(1, int(reply.get("live") or 1))
        if sc.kind == "b":
            self._backend_live = max(self._backend_live, live)
        else:
            # a tenant's requests may come through any replica of its backends: its scope
            # counts at least as many (a replica that never served the tenant is not live in
            # its scope yet, but its first request may come at any moment)
            live = max(live, self._backend_live)
        sc.live = live
        reaped = int(reply.get("reaped") or 0)
        if reaped:
            self.reaped += reaped
            if self._metrics is not None:
                self._metrics.store_reaped.inc(reaped)
        sc.lease_until = sent + self._ttl * 0.9
        if sc.kind == "b":
            scale, shed = float(reply.get("scale") or 1.0), bool(reply.get("shed"))
            if (scale, shed) != (sc.scale, sc.shed):
                sc.scale, sc.shed = scale, shed
                if self._on_effective is not None:
                    self._on_effective(sc.name, *self.effective(sc.name))
        near_f = self.config.near_fraction
        granted = reply.get("grants") or {}
        near_pools: list[Pool] = []
        for name, (q, alloc, limit) in (reply.get("pools") or {}).items():
            pool = sc.pools.get(name)
            if pool is None:
                continue
            q, alloc, limit = int(q), int(alloc), int(limit)
            pool.q = pool.rq = q
            pool.alloc, pool.limit = alloc, limit
            # near: less free than near_fraction of the limit, or than one request of this
            # replica's last size per live replica (an in-flight token budget)
            near = limit - alloc < max(near_f * limit, live * pool.unit)
            pool.near = near
            if near and not granted.get(name):
                # (not a grant this very reply made: with two pools near their limits, each
                # message would grant one and give the other back, back to back without end)
                near_pools.append(pool)
        for name, (avail, burst) in (reply.get("buckets") or {}).items():
            b = sc.buckets.get(name)
            if b is not None:
                b.global_avail = int(avail)
                b.near = b.global_avail < max(near_f * burst, sc.live * b.chunk)
        for name, debt in debts.items():
            b = sc.buckets.get(name)
            if b is not None:
                b.avail += debt  # charged now
        for name, n in (reply.get("grants") or {}).items():
            b = sc.buckets.get(name)
            if b is not None:
                b.avail += int(n)
        results = reply.get("admits") or []
        if isinstance(results, dict):  # cjson writes an empty list as {}
            results = []
        for adm, res in zip(admits, results, strict=False):
            ok, why, retry_us, chosen = res[0], res[1], res[2], res[3] or []
            if ok:
                by_name = {p.name: p for _, ps in adm.alts for p in ps}
                for (n, _), pname in zip(adm.alts, chosen, strict=False):
                    pool = by_name[pname]
                    # taken for this request here: no one can take it first
                    self._ledger.pool_take(pool._i, n)
                    adm.taken.append((pool, n))
                adm.admitted = True
                if adm.future.done():  # its caller gave up: the units become quota
                    self.release(
                        StoreHold(adm.taken, [b for b, _ in adm.buckets]),
                        adm.buckets[0][1] if adm.buckets else 0,
                        0,
                    )
                    adm.admitted = False
                else:
                    adm.future.set_result(True)
            elif not adm.future.done():
                refusal = self._refusal(sc, adm, why, retry_us)
                if reply.get("settling"):
                    # not the limit: Redis lost the scope, and grants nothing for half a lease
                    refusal = replace(
                        refusal,
                        remaining=None,
                        reset_after=None,
                        note="Redis restarted without this limit's state; it settles for "
                        "half a lease while the replicas re-assert what they hold",
                    )
                adm.future.set_result(refusal)
        for adm in admits[len(results) :]:
            if not adm.future.done():
                adm.future.set_result(None)
        for pool in near_pools:
            if pool.q > pool.in_use:
                # near the limit: give the headroom back now, not at a heartbeat (checked once
                # this reply's admissions are counted in use: the units Redis admitted for a
                # waiting request are its, not headroom)
                sc.wake = True
                break

    def _refusal(self, sc: Scope, adm: Admit, why: str, retry_us: float) -> StoreRefusal:
        """Redis's refusal of ``adm`` by its pool or bucket ``why`` (retry in µs, -1: never),
        with what is left under that limit across the replicas as this reply said."""
        pool = next((p for _, ps in adm.alts for p in ps if p.name == why), None)
        bucket = next((b for b, _ in adm.buckets if b.name == why), None)
        remaining: int | None = None
        reset_after: float | None = None
        if bucket is not None:
            remaining = max(0, bucket.global_avail)
            rate, burst = bucket.rate, bucket.burst
            if bucket.scaled and sc.scale < 1:  # as kvg_sync scales them
                rate = max(1, int(rate * sc.scale + 1e-9))
                burst = max(1, int(burst * sc.scale + 1e-9))
            if rate < UNLIMITED_TPM:
                reset_after = max(0, burst - remaining) * 60.0 / rate
        elif pool is not None:
            remaining = max(0, pool.limit - pool.alloc)
        limit = bucket or pool
        never = retry_us == -1
        retry = retry_us / 1e6 if retry_us > 0 else self.config.heartbeat_s / 2
        return StoreRefusal(
            limit.limit_name if limit is not None else why,
            scope=_scope_of(sc),
            retry_after=None if never else max(0.001, retry),
            never=never,
            remaining=remaining,
            reset_after=reset_after,
        )

    def inflight_allocated(self, backend: str) -> int | None:
        """Tokens of ``backend``'s in-flight budget allocated to all replicas together (as
        Redis last said; at least what they run), or ``None`` when unknown."""
        sc = self.scopes.get("b" + backend)
        pool = sc.pools.get("inflight") if sc is not None else None
        if pool is None or sc is None or sc.epoch is None:
            return None
        return pool.alloc

    # ---- adaptive scale ------------------------------------------------------------------------
    def propose(self, backend: str, scale: float, shedding: bool) -> tuple[float, bool]:
        """Records this replica's adaptive scale (0 < scale <= 1) and shedding flag for
        ``backend`` (sent with its next message) and returns the ones in force
        (:meth:`effective`)."""
        self._props[backend] = (scale, shedding)
        return self.effective(backend)

    def effective(self, backend: str) -> tuple[float, bool]:
        """The scale and shedding in force for ``backend``: the lowest scale and any shedding
        among the live replicas' proposals (as Redis last said) and this replica's own."""
        own = self._props.get(backend, (1.0, False))
        sc = self.scopes.get("b" + backend)
        if sc is None or sc.epoch is None:
            return own
        return min(own[0], sc.scale), own[1] or sc.shed

    # ---- heartbeat ------------------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        period = self.config.heartbeat_s
        while not self._closed:
            await asyncio.sleep(period)
            try:
                self.tick()
            except Exception:
                logger.exception("store: heartbeat failed")

    def tick(self) -> None:
        """One heartbeat: each active scope's demand measured, grant sizes set, and a message
        sent where this replica holds anything (its lease renewed) or proposes a scale."""
        period = self.config.heartbeat_s
        # while the breaker is open every active scope stays active: its heartbeat is the probe
        # that closes the breaker (a replica that held nothing when Redis went away would
        # otherwise never call Redis again)
        probing = self._breaker.opened_at is not None
        self._kicked.clear()  # releases nobody waited for (error answers)
        if self._ledger.warming and time.monotonic() >= self._warm_until:
            self._ledger.warming = False
        # the most live replicas a backend's scope counts now (replicas that left lower it)
        self._backend_live = max(
            (sc.live for sc in self._active if sc.kind == "b"), default=self._backend_live
        )
        before = self._active_before
        beats: list[Scope] = []
        for sc in list(self._active):
            # a scope that became active since the last heartbeat and runs nothing now (the
            # one request of a tenant seen rarely: one of 100,000 API keys) keeps no tokens:
            # they go back with this heartbeat, with its headroom, not with the next one, so
            # its scope goes quiet a heartbeat sooner (a message less per such request). One
            # that keeps sending is active at the next heartbeat and sized from its rate then.
            idle_newcomer = sc not in before and not any(p.in_use for p in sc.pools.values())
            for b in sc.buckets.values():
                rate = b.taken / period
                b.taken = 0
                b.chunk = (
                    0
                    if rate == 0 or idle_newcomer
                    else max(1, min(int(rate * period * 2), self._chunk_cap(b)))
                )
            used = False
            for p in sc.pools.values():
                used = used or p.taken > 0
                p.taken = 0
                if p.adopted:
                    self._adopted_ended(p)
                if p.spill:
                    self._spill_ended(p)
            if not (
                used
                or probing
                or sc.holds()
                or sc.admits
                or (sc.kind == "b" and sc.name in self._props)
            ):
                self._active.discard(sc)
                self._ledger.set_active(sc._i, False)  # the next admission re-activates it
                continue
            beats.append(sc)
        for name in self._props:  # backends this replica proposes a scale for
            sc = self._scope("b", name)
            if sc not in self._active:
                self._active.add(sc)
                beats.append(sc)
        self._active_before = set(self._active)
        self._beat_group(beats[:BEAT_GROUP])
        if len(beats) > BEAT_GROUP:
            self._spawn(self._beat_spread(beats[BEAT_GROUP:], period / 2))
        if not self._loaded and self._client is not None:
            self._spawn(self._load_again())
        if self._sentinel is not None and self._check_task is None:
            self._check_task = asyncio.get_running_loop().create_task(self._check_primary())
        if self._standing is not None and self._stand_task is None and self._loaded:
            self._stand_task = asyncio.get_running_loop().create_task(self._claim_standing())

    async def _claim_standing(self, leave: bool = False) -> None:
        """Renews this replica's claim to standing slices (``kvg_stand``, once a heartbeat),
        or gives it up (``leave``). The slices may be used until the claim's expiry as this
        replica counts it: from when the call was sent, a tenth short of Redis's; a call that
        fails leaves that expiry as it was, so a replica cut off from Redis, or frozen, stops
        using its slices when the claim runs out, before Redis may give it to another."""
        sent = time.monotonic()
        try:
            async with asyncio.timeout(max(self._bg_deadline, 0.5)):
                got = await self._wire.fcall(
                    "kvg_stand",
                    1,
                    "{" + self.prefix + ":stand}",
                    self.pod,
                    int(self._ttl * 1e6),
                    self.config.standing_replicas,
                    self._stand_claim,
                    "1" if leave else "0",
                    repr(float(self.config.standing_share)),
                )
            claim, ttl_us, unused_us = int(got[0]), int(got[1]), int(got[2])
            if claim == -2:
                if self._stand_claim != -2:
                    logger.error(
                        "store: standing slices: other replicas use another standing_share or "
                        "standing_replicas than %s and %d; this one takes no claim until they "
                        "agree",
                        self.config.standing_share,
                        self.config.standing_replicas,
                    )
            elif claim != self._stand_claim and not leave:
                logger.info(
                    "store: standing slices: %s",
                    f"claim {claim} of {self.config.standing_replicas}"
                    if claim >= 0
                    else "no claim (every one is held, or Redis is settling after a loss)",
                )
            if unused_us < 0 and claim >= 0 and claim != self._stand_claim:
                # a claim this replica did not know it held: taken by a call whose reply was
                # lost (applied in Redis after the call timed out here), which said how long
                # it had gone unused: count it as used just now (its buckets start empty)
                unused_us = 0
            if unused_us >= 0:
                # a claim another replica held (or one Redis has no record of): its buckets
                # hold what they would have refilled since it was last used, no more
                self._stand_gen += 1
                self._stand_since = time.monotonic() - unused_us / 1e6
            self._stand_claim = claim
            self._stand_until = sent + 0.9 * ttl_us / 1e6 if claim >= 0 else 0.0
            assert self._standing is not None
            self._standing.lease_until = self._stand_until
        except Exception as exc:
            logger.debug("store: renewing the standing claim failed: %s", short_error(exc))
        finally:
            self._stand_task = None

    async def _check_primary(self) -> None:
        """Under Redis Sentinel, once a heartbeat: asks the sentinels which server is the
        primary, and leaves a connection to another one. A failover that keeps the old primary
        running (``SENTINEL FAILOVER``, or an old primary cut off from the sentinels but not
        from the gateways) leaves it a primary for seconds after the sentinels name the new
        one (until they turn it into a replica): without this, a replica connected before
        would go on deciding there while one connected since decides on the new primary, and
        the new primary would reap the first one's leases and grant its slots again. No
        sentinel answering: the connection stays."""
        try:
            async with asyncio.timeout(max(self._bg_deadline, 0.5)):
                host, port = await self._sentinel.discover_master(self.config.sentinel.master)
                named = (str(host), int(port))
                wire = self._wire
                if isinstance(wire, Wire) and wire.located is not None and wire.located != named:
                    logger.warning(
                        "store: the sentinels name %s:%d as the primary of %r; leaving %s:%d",
                        *named,
                        self.config.sentinel.master,
                        *wire.located,
                    )
                    wire.leave(f"the sentinels name {named[0]}:{named[1]} as the primary now")
                pool = getattr(self._client, "connection_pool", None)
                if getattr(pool, "master_address", named) != named:
                    # redis-py's Sentinel pool (what its get_master_address does when the
                    # address changed): its idle connections reconnect to the new primary
                    pool.master_address = named  # type: ignore[union-attr]
                    await pool.disconnect(inuse_connections=False)  # type: ignore[union-attr]
        except Exception as exc:
            logger.debug("store: asking the sentinels failed: %s", short_error(exc))
        finally:
            self._check_task = None

    async def _beat_spread(self, scopes: list[Scope], within_s: float) -> None:
        """Heartbeats of ``scopes``, :data:`BEAT_GROUP` at a time, the groups spread evenly
        over ``within_s`` seconds (a lease is 2 or more heartbeat periods: half a period later
        is well within it)."""
        groups = [scopes[i : i + BEAT_GROUP] for i in range(0, len(scopes), BEAT_GROUP)]
        pause = within_s / len(groups)
        for group in groups:
            await asyncio.sleep(pause)
            if self._closed:
                return
            self._beat_group(group)

    def _beat_group(self, scopes: list[Scope]) -> None:
        """Heartbeats of ``scopes`` (at most :data:`BEAT_GROUP`). On a single server, those
        with no message in flight and no request waiting go in one call (``kvg_sync_many``:
        a replica that served thousands of tenants each once, every one of them giving its
        units back at the next heartbeat, makes a call per 32 of them, not one each); the
        others, all of them on a Redis Cluster (several scopes' keys are in different slots)
        or while the breaker is open (each heartbeat is then a probe), on their own lanes.
        Each message is composed here, at once: a request that comes while the call is in
        flight waits for the next message, as behind a lane's."""
        rest = scopes
        batched: list[tuple[Scope, Any, list[asyncio.Future[None]]]] = []
        if (
            not self.config.cluster
            and self._breaker.opened_at is None
            and time.monotonic() >= self._batch_off_until
        ):
            free: list[Scope] = []
            busy: list[Scope] = []
            for sc in scopes:
                (busy if sc.busy or sc.admits or sc.falling else free).append(sc)
            if len(free) > 1:
                rest = busy
                for sc in free:
                    sc.hb_due = True
                    built = self._compose(sc)  # (a heartbeat always has something to say)
                    riding = self._composed(sc)
                    if built is None:
                        _wake_all(riding)
                        continue
                    sc.busy = True
                    batched.append((sc, built, riding))
        if batched:
            self._spawn(self._send_many(batched))
        for sc in rest:
            self._beat(sc)

    async def _send_many(self, batch: list[tuple[Scope, Any, list[asyncio.Future[None]]]]) -> None:
        """Sends the messages of several scopes (composed by :meth:`_beat_group`, none with a
        waiting request) in one ``kvg_sync_many`` call and applies each reply as :meth:`_send`
        does; a failed or late call is an unknown outcome for each. A server without that
        function (an earlier kvgate's library) ran nothing: each message counts as an unknown
        outcome (re-asserted by the next), and heartbeats go one call per scope for
        :data:`BATCH_OFF_S`."""
        client = self._wire
        sent = time.monotonic()
        keys: list[str] = []
        payloads: list[bytes] = []
        for sc, (msg, _, _), _ in batch:
            key = sc.key
            keys += (key, key + ":live", f"{key}:op:{self.pod}:{msg['seq']}")
            payloads.append(orjson.dumps(msg))
        self.calls += 1
        kind = None
        raw: Any = None
        try:
            call = client.fcall("kvg_sync_many", len(keys), *keys, *payloads)
            if isinstance(call, asyncio.Future):
                client.expire(call, self._bg_deadline)
                raw = await call
            else:
                async with asyncio.timeout(self._bg_deadline):
                    raw = await call
        except asyncio.CancelledError:
            for sc, (msg, admits, _), riding in batch:
                self._unknown_outcome(sc, msg, admits)
                _wake_all(riding)
                sc.busy = False
            raise
        except TimeoutError:
            kind = "timeout"
            self._last_failure = f"no answer within {self._bg_deadline * 1000:g} ms"
        except Exception as exc:
            if library_missing(exc):
                # nothing ran: the next messages, one per scope, re-assert what these carried
                # (their lanes load the library when there is none)
                self._batch_off_until = time.monotonic() + BATCH_OFF_S
                for sc, (msg, admits, _), riding in batch:
                    self._unknown_outcome(sc, msg, admits)
                    _wake_all(riding)
                    sc.hb_due = True
                    sc.wake = True
                    self._lane_ended(sc, go_on=True)
                return
            kind = "error"
            self._last_failure = f"{type(exc).__name__}: {short_error(exc)}"
            if left_replica(exc):  # nothing ran: the next messages go on a new connection
                await self._leave_replica(client)
        if self._metrics is not None:
            self._metrics.store_call_seconds.observe(time.monotonic() - sent)
        replies = raw if kind is None and isinstance(raw, list) else []
        if kind is None and len(replies) != len(batch):
            kind = "error"
            self._last_failure = f"kvg_sync_many answered {type(raw).__name__}"
        if kind is not None:  # the call failed: one failure, an unknown outcome for each
            self._count_failure(kind)
        failed = kind is not None
        for i, (sc, (msg, admits, debts), riding) in enumerate(batch):
            try:
                if kind is not None:
                    self._unknown_outcome(sc, msg, admits)
                    continue
                reply, one = self._decoded(replies[i])
                if one is None:
                    one = self._applied(sc, reply, sent, admits, debts)
                if one is not None:
                    failed = True
                    self._count_failure(one)
                    self._unknown_outcome(sc, msg, admits)
                sc.contended = bool(sc.admits)
            except Exception:
                logger.exception("store: reply of %s failed", sc.key)
            finally:
                _wake_all(riding)
        if failed:
            if self._breaker.failed(time.monotonic()):
                self._opened()
        elif self._breaker.succeeded():
            self._closed_again()
        for sc, _, _ in batch:
            self._lane_ended(sc, go_on=True)

    async def _load_again(self) -> None:
        """Loads the library once more, when the store could not at start (the reason of a
        failure becomes the store's last failure, shown in ``/admin/state``)."""
        try:
            async with asyncio.timeout(self._bg_deadline):
                await load_library(self._client, self.config.cluster)
        except TimeoutError:
            self._last_failure = (
                f"loading the library: no answer within {self._bg_deadline * 1000:g} ms"
            )
            return
        except Exception as exc:
            self._last_failure = f"loading the library: {type(exc).__name__}: {short_error(exc)}"
            return
        self._loaded = True
        if self._breaker.succeeded():
            self._closed_again()

    # ---- state ---------------------------------------------------------------------------------
    def stranded(self) -> tuple[int, int]:
        """(slots, tokens) this replica holds beyond its use: capacity other replicas cannot
        take until it goes back."""
        slots = tokens = 0
        for sc in self._active:
            for p in sc.pools.values():
                if p.limit_name == "inflight-tokens":
                    tokens += max(0, p.q - p.in_use)
                else:
                    slots += max(0, p.q - p.in_use)
            for b in sc.buckets.values():
                tokens += max(0, b.avail)
        return slots, tokens

    def scope_mode(self, sc: Scope) -> str:
        """``local`` (decided from held quotas), ``near-limit`` (decided in Redis),
        ``degraded`` (Redis away: the fallback policy) or ``learning`` (no reply yet)."""
        if self._breaker.opened_at is not None:
            return "degraded"
        if sc.epoch is None:
            return "learning"
        if any(p.near for p in sc.pools.values()) or any(b.near for b in sc.buckets.values()):
            return "near-limit"
        return "local"

    def modes(self) -> dict[tuple[str, str], int]:
        """``{(scope kind, mode): scopes}`` over the active scopes (a metric)."""
        out: dict[tuple[str, str], int] = {}
        for sc in self._active:
            key = ("tenant" if sc.kind == "t" else "backend", self.scope_mode(sc))
            out[key] = out.get(key, 0) + 1
        return out

    def state(self, tenants: Iterable[str] | None = None) -> dict[str, Any]:
        """``/admin/state``'s ``store`` entry: this replica's id, the breaker, counters, and
        each active scope's mode, live replicas, scale and what is held — every backend's, and
        the tenants' named in ``tenants`` (``None``: every tenant's; the endpoint names the
        page it lists: a replica that served 100,000 tenants lately has as many active
        scopes). ``active_tenant_scopes`` counts them all."""
        now = time.monotonic()
        named = None if tenants is None else set(tenants)
        scopes = {}
        active_tenants = 0
        for sc in self._active:
            if sc.kind == "t":
                active_tenants += 1
                if named is not None and sc.name not in named:
                    continue
            scopes[sc.key] = {
                "mode": self.scope_mode(sc),
                "live_replicas": sc.live,
                "scale": sc.scale,
                "shedding": sc.shed,
                "lease_left_s": round(max(0.0, sc.lease_until - now), 3),
                "pools": {
                    n: {
                        "quota": p.q,
                        "in_use": p.in_use,
                        "limit": p.limit,
                        "allocated": p.alloc,
                        "near": p.near,
                    }
                    for n, p in sc.pools.items()
                },
                "buckets": {
                    n: {
                        "held_tokens": b.avail,
                        "global_available": b.global_avail,
                        "grant": b.chunk,
                        "near": b.near,
                    }
                    for n, b in sc.buckets.items()
                },
            }
        slots, tokens = self.stranded()
        return {
            "mode": "redis",
            "replica": self.pod,
            # its first heartbeats: no headroom floor while it learns how many replicas share
            # its limits
            "warming": bool(self._ledger.warming),
            "breaker": "open" if self._breaker.opened_at is not None else "closed",
            # what the share policy does now: share, or after_degraded once Redis has been
            # away for over max_degraded_s
            "share_policy_now": (str(self.config.after_degraded) if self._share_over() else "share")
            if self._uses_share()
            else None,
            "calls": self.calls,
            "admissions": self.admissions,
            "failures": dict(self.failures),
            "reaped_replicas": self.reaped,
            "amnesia": self.amnesia,
            "resent": self.resent,
            # why the last failed call (or loading the library) failed; None: none failed
            "last_failure": self._last_failure or None,
            # what the messages go on: the store's own connection (with the connections it
            # opened so far: more than one means Redis closed it, or it stalled) or redis-py's
            "connection": self._connection_state(),
            "degraded_admissions": self.degraded_admissions,
            "stranded_slots": slots,
            "stranded_tokens": tokens,
            "active_tenant_scopes": active_tenants,
            "standing": self._standing_state(now),
            "scopes": scopes,
        }

    def _standing_state(self, now: float) -> dict[str, Any] | None:
        """The standing slices: this replica's claim (-1: none) of ``standing_replicas``, how
        long it may still use them (seconds), the admissions they made, the tenants it holds
        a slice of and the slots its requests hold in them; ``None`` when ``standing_share``
        is 0."""
        stand = self._standing
        if stand is None:
            return None
        return {
            "share": self.config.standing_share,
            "claim": self._stand_claim,
            "of": self.config.standing_replicas,
            "usable_s": round(max(0.0, self._stand_until - now), 3),
            "admissions": self.standing_admissions,
            "tenants": len(self._stand_tenants),
            "slots_in_use": sum(n for _, n in self._ledger.pools_in_use(stand._i)),
        }

    def _connection_state(self) -> dict[str, Any]:
        """``/admin/state``'s ``store.connection``: the client, the connections it opened
        (the store's own), and with Redis Sentinel the primary's name and the address the
        current connection reached."""
        if isinstance(self._wire, Wire):
            out: dict[str, Any] = {"client": "kvgate", "opened": self._wire.connects}
        else:
            out = {"client": "redis-py", "opened": None}
        if self.config.sentinel is not None:
            out["sentinel_master"] = self.config.sentinel.master
            # (the primary the open connection reached; none while there is no connection)
            wire = self._wire
            located = wire.located if isinstance(wire, Wire) and wire.connected else None
            out["primary"] = f"{located[0]}:{located[1]}" if located else None
        return out


def _wake_all(futures: list[asyncio.Future[None]]) -> None:
    """Wakes the callers of :meth:`RedisStore.flushed` waiting for one message."""
    for fut in futures:
        if not fut.done():
            fut.set_result(None)


def _scope_of(sc: Scope) -> str:
    """The refusal scope of a limit of ``sc``: ``tenant`` (429) or ``backend`` (503)."""
    return "tenant" if sc.kind == "t" else "backend"
