"""Reloads while requests run, across replicas on one ``redis-server``: the limits a reload
changes still bind what runs from before it, as in one gateway's core."""

from __future__ import annotations

from typing import Any

import pytest
from tests.store.redis_servers import RedisServer, wait_for

from kvgate import AdmissionController
from kvgate.config import StoreConfig
from kvgate.store import StoreRefusal
from kvgate.store.redis_store import RedisStore
from kvgate.store.scopes import scope_key

from .test_store_fallback import Ref


def replica_core() -> tuple[Any, Ref, Ref, Ref]:
    """A backend of 6 slots; tenant ``a`` with 4 guaranteed, tenant ``b`` without."""
    ctl = AdmissionController()
    gpu = Ref(ctl.add_backend("gpu", max_concurrency=6, tokens_per_minute=2**40), "gpu")
    a = Ref(ctl.add_tenant("a", priority="critical", guaranteed_slots=4), "a")
    b = Ref(ctl.add_tenant("b", priority="critical"), "b")
    return ctl, gpu, a, b


async def admit(store: RedisStore, backend: Ref, tenant: Ref) -> Any:
    """The admission stage's order: the replica's quotas, else Redis."""
    hold = store.try_admit(backend, tenant, "critical", 1)
    if hold is None:
        hold = await store.admit(backend, tenant, "critical", 1)
    return hold


async def admit_until_refused(store: RedisStore, backend: Ref, tenant: Ref) -> list[Any]:
    """Holds admitted one after another until one is refused (8 at most)."""
    got = []
    for _ in range(8):
        hold = await admit(store, backend, tenant)
        if isinstance(hold, StoreRefusal):
            break
        got.append(hold)
    return got


@pytest.mark.parametrize("change", ["lowered", "removed"])
async def test_a_guarantee_a_reload_drops_still_binds_what_its_requests_hold(
    redis_server: RedisServer, change: str
) -> None:
    """Two replicas each run 2 of tenant a's requests on its guarantee of 4 (the backend's 6
    slots: 2 left in the burst pool). A reload lowers a's guarantee to 0 (or removes a) on
    both: the burst pool grows to 6 by the guarantees, but a's 4 requests still hold 4 slots,
    so tenant b gets 2, not 6 (the engine would run 10 of 6)."""
    cfg = StoreConfig(url=redis_server.url, heartbeat_s=0.05, deadline_ms=1000)
    replicas = []
    for _ in range(2):
        ctl, gpu, a, b = replica_core()
        store = RedisStore(cfg, ctl)
        await store.start(["gpu"])
        replicas.append((store, ctl, gpu, a, b))
    try:
        held = []
        for store, _, gpu, a, _ in replicas:
            for _ in range(2):
                hold = await admit(store, gpu, a)
                assert not isinstance(hold, StoreRefusal), hold
                held.append((store, hold))
        for store, ctl, _, a, _ in replicas:
            if change == "lowered":
                ctl.update_tenant(a.id, guaranteed_slots=0)
            else:
                ctl.remove_tenant(a.id)
            store.reload()
        store, _, gpu, _, b = replicas[1]
        got = await admit_until_refused(store, gpu, b)
        assert len(got) == 2
        # a's guarantee pool says what the guarantee is now (a may send no request again)
        for st, *_ in replicas:
            assert st.scopes["bgpu"].pools["g:a"].g == 0
        # a's requests end: b gets the rest
        for st, hold in held:
            st.release(hold, 1, 1)
        for st, _ in held:
            await st.flushed()
        got += await admit_until_refused(store, gpu, b)
        assert len(got) == 6
    finally:
        for store, *_ in replicas:
            await store.close()


async def test_a_concurrency_limit_a_reload_adds_counts_the_requests_running_since_before(
    redis_server: RedisServer,
) -> None:
    """Tenant a has no concurrency limit and runs 4 requests on the first replica; a reload
    gives it a limit of 2 on both. The first replica's store takes its 4 running requests in
    (no hold of the store counted them), so the second replica admits none of a's until they
    end, as one gateway's core would (before, it admitted 2: the engine ran 6 of a's against
    a limit of 2); once they have ended, the next heartbeat gives them back, though a request
    of a's that the first replica's core admitted is still waiting for the store (counting the
    core's admissions instead kept units adopted while clients waited: the tenant starved)."""
    cfg = StoreConfig(url=redis_server.url, heartbeat_s=0.05, deadline_ms=1000)
    replicas = []
    for _ in range(2):
        ctl = AdmissionController()
        gpu = Ref(ctl.add_backend("gpu", max_concurrency=100, tokens_per_minute=2**40), "gpu")
        a = Ref(ctl.add_tenant("a", priority="critical"), "a")
        store = RedisStore(cfg, ctl)
        await store.start(["gpu"])
        replicas.append((store, ctl, gpu, a))
    try:
        store0, ctl0, gpu0, a0 = replicas[0]
        running = []
        for _ in range(4):
            reservation = ctl0.admit(gpu0.id, a0.id, "critical", 1)
            assert reservation.admitted
            hold = await admit(store0, gpu0, a0)
            assert not isinstance(hold, StoreRefusal), hold
            running.append((reservation, hold))
        for i, (store, ctl, _, a) in enumerate(replicas):
            ctl.update_tenant(a.id, max_concurrency=2)
            store.reload()
            store.adopt_running("a", (lambda: len(running)) if i == 0 else (lambda: 0))
        key = scope_key(store0.prefix, "t", "a")
        client = redis_server.client()
        await wait_for(
            lambda: int(client.hget(key, "alloc|conc") or 0) == 4, timeout=10.0, what="adopted"
        )
        store1, _, gpu1, a1 = replicas[1]
        refused = await admit(store1, gpu1, a1)
        assert isinstance(refused, StoreRefusal), refused
        assert refused.reason == "tenant-concurrency"
        while running:
            reservation, hold = running.pop()
            reservation.release()
            store0.release(hold, 1, 1)
        # (before a heartbeat runs) a new request of a's, admitted by the core, waits for the
        # store
        waiting = ctl0.admit(gpu0.id, a0.id, "critical", 1)
        assert waiting.admitted
        await wait_for(
            lambda: int(client.hget(key, "alloc|conc") or 0) == 0, timeout=10.0, what="given back"
        )
        assert store0.scopes["ta"].pools["conc"].adopted == 0
        got = [await admit(store1, gpu1, a1) for _ in range(3)]
        assert [isinstance(h, StoreRefusal) for h in got] == [False, False, True]
        waiting.release()
    finally:
        for store, *_ in replicas:
            await store.close()
