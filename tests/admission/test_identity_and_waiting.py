"""The request-path stages that need no server: who is calling (:mod:`kvgate.admission.identity`),
how long a refused request may wait (:func:`kvgate.admission.waiting.max_wait`), shadow mode,
and the wait queue's timed wake-up. The same rules are exercised through the gateway in
``tests/gateway`` (``test_auth_rule.py``, ``test_tenants.py``, ``test_gateway.py``)."""

from __future__ import annotations

import asyncio
import hashlib
import math
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgate.admission.identity import PRIORITY_HEADER, TenantTable, api_key
from kvgate.admission.shadow import in_shadow
from kvgate.admission.wait_queue import PriorityWaitQueue
from kvgate.admission.waiting import max_wait
from kvgate.app import Tenant
from kvgate.errors import GatewayError


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


ALICE = Tenant(id=0, name="alice", priority="critical", key_hashes=(_digest("sk-alice"),))
BOB = Tenant(id=1, name="bob", priority="standard", key_hashes=(_digest("sk-bob"),))
ANON = Tenant(id=2, name="anonymous", priority="sheddable")


@pytest.mark.parametrize(
    ("headers", "who"),
    [
        ({"Authorization": "Bearer sk-alice"}, "alice"),
        ({"Authorization": "bearer   sk-bob  "}, "bob"),  # scheme case-insensitive, value trimmed
        ({"api-key": "sk-bob"}, "bob"),  # Azure OpenAI clients
        ({"Authorization": "Basic eDp5", "api-key": "sk-alice"}, "alice"),
        ({}, "anonymous"),
        ({"Authorization": "Bearer "}, "anonymous"),  # an empty key is no key
    ],
)
def test_the_tenant_is_the_keys_owner(headers: dict[str, str], who: str) -> None:
    tenant, _ = TenantTable([ALICE, BOB], ANON).identify(headers)
    assert tenant.name == who


@pytest.mark.parametrize("anonymous", [ANON, None])
def test_an_unknown_key_is_a_401_even_with_an_anonymous_tenant(anonymous: Tenant | None) -> None:
    with pytest.raises(GatewayError) as err:
        TenantTable([ALICE, BOB], anonymous).identify({"Authorization": "Bearer sk-mallory"})
    assert (err.value.status, err.value.code) == (401, "invalid_api_key")


def test_no_key_without_an_anonymous_tenant_is_a_401() -> None:
    with pytest.raises(GatewayError) as err:
        TenantTable([ALICE], None).identify({})
    assert (err.value.status, err.value.code) == (401, "invalid_api_key")


def test_without_declared_keys_every_request_is_the_anonymous_tenants() -> None:
    table = TenantTable([], ANON)
    assert table.identify({"Authorization": "Bearer anything"})[0] is ANON


@pytest.mark.parametrize(
    ("asked", "got"),
    [
        (None, "critical"),
        ("standard", "standard"),
        ("sheddable", "sheddable"),
        ("critical", "critical"),
        ("urgent", "critical"),  # not a class: ignored
    ],
)
def test_a_request_may_lower_its_class_never_raise_it(asked: str | None, got: str) -> None:
    headers = {"Authorization": "Bearer sk-alice"}
    if asked is not None:
        headers[PRIORITY_HEADER] = asked
    assert TenantTable([ALICE], None).identify(headers)[1] == got
    bob = {"Authorization": "Bearer sk-bob", PRIORITY_HEADER: "critical"}
    assert TenantTable([BOB], None).identify(bob)[1] == "standard"


def test_a_reload_replaces_every_key() -> None:
    table = TenantTable([ALICE], None)
    table.replace([BOB], None)
    with pytest.raises(GatewayError):
        table.identify({"Authorization": "Bearer sk-alice"})
    assert table.identify({"Authorization": "Bearer sk-bob"})[0] is BOB
    assert table.tenants == [BOB]


def test_api_key_reads_bearer_first() -> None:
    assert api_key({"Authorization": "Bearer a", "api-key": "b"}) == "a"
    assert api_key({"Authorization": "Token a", "api-key": "b"}) == "b"
    assert api_key({}) is None


@given(
    tenant_ms=st.integers(min_value=-10, max_value=10**7),
    asked=st.one_of(
        st.none(),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.text(max_size=8),
    ),
)
def test_the_wait_header_only_shortens_the_tenants_wait(tenant_ms: int, asked: str | None) -> None:
    tenant = Tenant(id=0, name="t", max_wait_ms=tenant_ms)
    got = max_wait(tenant, asked)
    assert 0.0 <= got <= max(0, tenant_ms) / 1000.0
    assert math.isfinite(got)
    if tenant_ms <= 0:
        assert got == 0.0


def test_the_wait_header_in_milliseconds_with_fractions() -> None:
    tenant = Tenant(id=0, name="t", max_wait_ms=2000)
    assert max_wait(tenant, "1500.5") == pytest.approx(1.5005)
    assert max_wait(tenant, "-5") == 0.0
    assert max_wait(tenant, "nan") == 2.0
    assert max_wait(tenant, "inf") == 2.0
    assert max_wait(tenant, "soon") == 2.0
    assert max_wait(tenant, "99999") == 2.0


def test_shadow_mode_on_the_tenant_the_backend_or_the_gateway() -> None:
    enforce = SimpleNamespace(mode="enforce")
    shadow = SimpleNamespace(mode="shadow")
    plain = SimpleNamespace(config=enforce)
    tenant = Tenant(id=0, name="t")
    assert not in_shadow(enforce, plain, tenant)  # type: ignore[arg-type]
    assert not in_shadow(None, SimpleNamespace(config=None), tenant)  # type: ignore[arg-type]
    assert in_shadow(shadow, plain, tenant)  # type: ignore[arg-type]
    assert in_shadow(enforce, SimpleNamespace(config=shadow), tenant)  # type: ignore[arg-type]
    assert in_shadow(None, plain, Tenant(id=0, name="s", shadow=True))  # type: ignore[arg-type]


async def test_a_timed_wake_up_keeps_the_earliest_and_admits_the_waiter() -> None:
    queue: PriorityWaitQueue[str] = PriorityWaitQueue(max_waiters=4)
    loop = asyncio.get_running_loop()
    opens_at = loop.time() + 0.05  # a token bucket that refills then: no release announces it
    tries = []
    tried = asyncio.Event()

    def try_admit() -> str | None:
        tries.append(loop.time())
        tried.set()
        return "ok" if loop.time() >= opens_at else None

    waiter = asyncio.create_task(
        queue.wait(tenant="t", priority="standard", max_wait=30, try_admit=try_admit)
    )
    await asyncio.wait_for(tried.wait(), 10)
    queue.notify_after(60.0)
    queue.notify_after(0.06)  # earlier: replaces the pending one
    queue.notify_after(30.0)  # later than the pending one: ignored
    assert await asyncio.wait_for(waiter, 10) == "ok"
    assert len(tries) == 2  # the first try, then the one wake-up
    assert queue.waiting == 0


async def test_a_waiter_sees_a_slot_another_worker_freed() -> None:
    """Two worker processes' views of one shared core (``--workers 2``): a request of worker B
    waits in B's queue while worker A holds the backend's only slot; A's release notifies only
    A's queue, yet B's waiter gets the slot (B looks again after the core's retry hint) long
    before its wait is up."""
    import uuid

    from kvgate._core import AdmissionController
    from kvgate.admission.waiting import wait_for_admission

    a = AdmissionController(shm_name=f"kvgate-test-{uuid.uuid4().hex[:12]}")
    backend_id = a.add_backend("b", max_concurrency=1, tokens_per_minute=2**40)
    tenant_id = a.add_tenant("t", priority="standard")
    b = AdmissionController.attach(a.shm_name)  # type: ignore[arg-type]
    backend = SimpleNamespace(id=backend_id, name="b", config=None)
    tenant = Tenant(id=tenant_id, name="t", max_wait_ms=30_000)
    held = a.admit(backend_id, tenant_id, "standard", 10)
    assert held.admitted
    refused = b.admit(backend_id, tenant_id, "standard", 10)
    assert not refused.admitted
    assert refused.reason == "backend-slots"
    gw_b = SimpleNamespace(
        controller=b, queue=PriorityWaitQueue(max_waiters=8), config=None, metrics=None
    )
    loop = asyncio.get_running_loop()
    waiting = asyncio.create_task(
        wait_for_admission(gw_b, backend, tenant, "standard", 10, refused)  # type: ignore[arg-type]
    )
    while gw_b.queue.waiting == 0:  # noqa: ASYNC110 (the queue has no event to wait on)
        await asyncio.sleep(0.01)
    freed = loop.time()
    held.release(10)  # worker A's release: nothing tells B's queue
    got = await asyncio.wait_for(waiting, 20)
    assert got.admitted, got
    assert loop.time() - freed < 10  # B's wait (30 s) was not what ended it
    got.release(10)
    assert a.backend_state(backend_id)["in_use"] == 0


async def test_the_store_is_asked_again_only_for_what_is_left_of_the_wait() -> None:
    """A request that already waited in the queue, then finds the store refusing with a retry
    hint, asks the store again only for what is left of its tenant's wait: its whole wait stays
    within ``max_wait_ms`` (it could reach twice that)."""
    from kvgate.admission.stage import _admit_in_store
    from kvgate.store import StoreRefusal

    asked: list[float] = []
    loop = asyncio.get_running_loop()

    class Refusing:
        async def admit(self, *_: object) -> StoreRefusal:
            asked.append(loop.time())
            return StoreRefusal("tenant-concurrency", scope="tenant", retry_after=0.01)

    gw = SimpleNamespace(store=Refusing())
    tenant = Tenant(id=0, name="t", max_wait_ms=1000)
    backend = SimpleNamespace(id=0, name="b")
    started = loop.time()
    got = await _admit_in_store(gw, backend, tenant, "standard", 1, None, 0.9)  # type: ignore[arg-type]
    assert isinstance(got, StoreRefusal)
    assert asked[-1] - started < 0.1 + 0.5  # about the 0.1 s left, not another whole second
    asked.clear()
    started = loop.time()
    await _admit_in_store(gw, backend, tenant, "standard", 1, None, 0.0)  # type: ignore[arg-type]
    assert asked[-1] - started >= 0.9  # nothing spent: the whole second
