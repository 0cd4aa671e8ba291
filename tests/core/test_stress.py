"""Stress: many threads and several processes hammering shared limits; a worker killed with
SIGKILL while holding slots has them reclaimed."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import uuid

import pytest

from kvgate import AdmissionController, ManualClock, SlotPool

LIMIT = 4
ROUNDS = 3_000


def test_threads_hammer_slot_pool() -> None:
    pool = SlotPool(LIMIT)
    stop = threading.Event()
    sampled: list[int] = []
    held: list[int] = []

    def sample() -> None:
        while not stop.is_set():
            sampled.append(pool.in_use)

    def work() -> None:
        for _ in range(ROUNDS):
            if pool.try_acquire():
                held.append(pool.in_use)  # sampled while holding
                pool.release()

    sampler = threading.Thread(target=sample)
    sampler.start()
    workers = [threading.Thread(target=work) for _ in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    sampler.join()
    assert held
    assert min(held) >= 1
    assert max(held + sampled) <= LIMIT
    assert pool.in_use == 0


def test_threads_hammer_controller() -> None:
    ctl = AdmissionController()
    b = ctl.add_backend("b", max_concurrency=LIMIT, tokens_per_minute=2**40)
    t = ctl.add_tenant("t", priority="standard")
    seen: list[int] = []

    def work() -> None:
        for _ in range(ROUNDS):
            r = ctl.admit(b, t, "standard", 7)
            if r.admitted:
                seen.append(ctl.backend_state(b)["in_use"])
                r.release(3)

    workers = [threading.Thread(target=work) for _ in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert seen
    assert max(seen) <= LIMIT
    s = ctl.backend_state(b)
    assert (s["in_use"], s["inflight_tokens"]) == (0, 0)
    assert ctl.leaks == 0


def test_threads_hammer_private_controller_with_exact_counts() -> None:
    """A private controller updates its limits with plain loads and stores, relying on the GIL
    to serialise calls: threads switching as often as CPython allows must still never exceed a
    limit, and every token and slot must add up exactly at the end."""
    clock = ManualClock()  # time stands still: the buckets refill nothing during the run
    ctl = AdmissionController(clock=clock)
    # 60,000,000 tokens per minute = one token per 1,000 ns: refunds are exact
    b = ctl.add_backend("b", max_concurrency=LIMIT, tokens_per_minute=60_000_000)
    tenants = [
        ctl.add_tenant("g", priority="critical", guaranteed_slots=1, tokens_per_minute=60_000_000),
        ctl.add_tenant("s", priority="standard", max_concurrency=2),
    ]
    charged = [0] * 8
    admitted = [0] * 8
    peak: list[int] = []

    def work(i: int) -> None:
        t = tenants[i % 2]
        for k in range(ROUNDS):
            r = ctl.admit(b, t, "critical" if t == tenants[0] else "standard", 7)
            if r.admitted:
                peak.append(ctl.backend_state(b)["in_use"])
                actual = 3 if k % 3 else 9  # refunds and overruns
                r.release(actual)
                charged[i] += actual
                admitted[i] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(old)
    assert sum(admitted) > ROUNDS
    assert max(peak) <= LIMIT
    s = ctl.backend_state(b)
    assert (s["in_use"], s["inflight_tokens"], s["burst_in_use"]) == (0, 0, 0)
    assert s["available_tokens"] == 60_000_000 - sum(charged)
    g = ctl.tenant_state(tenants[0])
    assert g["available_tokens"] == 60_000_000 - sum(charged[0::2])
    assert all(ctl.tenant_state(t)["in_use"] == 0 for t in tenants)
    assert ctl.leaks == 0


def _hammer(name: str, rounds: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    ctl = AdmissionController.attach(name)
    b = ctl.backend_id("b")
    t = ctl.tenant_id("t")
    assert b is not None
    assert t is not None
    admitted = 0
    for _ in range(rounds):
        r = ctl.admit(b, t, "standard", 5)
        if r.admitted:
            admitted += 1
            r.release(5)
    out.put(admitted)


def _hold_and_wait(name: str, n: int, ready: mp.Event) -> None:  # type: ignore[type-arg]
    ctl = AdmissionController(shm_name=name, create=False)
    b = ctl.backend_id("b")
    t = ctl.tenant_id("t")
    assert b is not None
    assert t is not None
    held = [ctl.admit(b, t, "standard", 100) for _ in range(n)]
    assert all(h.admitted for h in held)
    ready.set()
    threading.Event().wait(60)  # killed long before


@pytest.fixture
def shared() -> tuple[AdmissionController, int, int]:
    ctl = AdmissionController(shm_name=f"kvgate-test-{uuid.uuid4().hex[:12]}")
    b = ctl.add_backend("b", max_concurrency=LIMIT, tokens_per_minute=2**40)
    t = ctl.add_tenant("t", priority="standard")
    return ctl, b, t


def test_processes_hammer_shared_limits(shared: tuple[AdmissionController, int, int]) -> None:
    ctl, b, _t = shared
    name = ctl.shm_name
    assert name is not None
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(name, ROUNDS, out)) for _ in range(3)]
    for p in procs:
        p.start()
    peak = 0
    while any(p.is_alive() for p in procs):
        peak = max(peak, ctl.backend_state(b)["in_use"])
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    admitted = [out.get(timeout=10) for _ in procs]
    assert sum(admitted) > 0
    assert peak <= LIMIT
    s = ctl.backend_state(b)
    assert (s["in_use"], s["inflight_tokens"], s["burst_in_use"]) == (0, 0, 0)


def test_sigkilled_worker_slots_are_reclaimed(
    shared: tuple[AdmissionController, int, int],
) -> None:
    ctl, b, t = shared
    name = ctl.shm_name
    assert name is not None
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    worker = ctx.Process(target=_hold_and_wait, args=(name, 3, ready))
    worker.start()
    assert ready.wait(60)
    s = ctl.backend_state(b)
    assert (s["in_use"], s["inflight_tokens"]) == (3, 300)
    assert ctl.reclaim_dead() == 0, "a live worker's slots are not touched"
    assert worker.pid is not None
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=30)
    assert worker.exitcode == -signal.SIGKILL
    assert ctl.reclaim_dead() == 3
    s = ctl.backend_state(b)
    assert (s["in_use"], s["inflight_tokens"], s["burst_in_use"]) == (0, 0, 0)
    assert ctl.tenant_state(t)["in_use"] == 0
    assert ctl.reclaim_dead() == 0
    # The freed capacity is usable again.
    held = [ctl.admit(b, t, "standard", 1) for _ in range(LIMIT)]
    assert all(h.admitted for h in held)


def test_attach_errors() -> None:
    from kvgate import SharedStateError

    with pytest.raises(SharedStateError):
        AdmissionController.attach(f"kvgate-missing-{uuid.uuid4().hex[:8]}")
    with pytest.raises(SharedStateError, match="invalid shared-memory name"):
        AdmissionController(shm_name="a/b")


class _SwitchingTokens(int):
    """A token count (an ``int`` subclass; other objects with ``__index__`` are refused) whose
    ``__index__`` / ``__int__`` run Python code that gives up the GIL (``sleep(0)``), were they
    called while ``admit`` parses its arguments."""

    def __index__(self) -> int:
        time.sleep(0)
        return 7

    def __int__(self) -> int:
        time.sleep(0)
        return 7


def test_threads_mix_admin_calls_leaks_and_gc_on_private_controller() -> None:
    """Admit / release from many threads at a 1 us switch interval, interleaved with
    ``set_scale``, ``set_shedding``, ``update_backend``, ``update_tenant``, ``reclaim_dead``,
    reservations dropped unreleased (released by their finaliser, some from the cyclic garbage
    collector, which may run in any thread at an allocation) and ``int`` subclasses whose
    ``__index__`` switches threads: the private controller (plain loads and stores under the GIL) must lose
    no update. The tenant bucket runs at one token per 1,000 ns and the clock stands still, so
    every token adds up exactly."""
    clock = ManualClock()
    ctl = AdmissionController(clock=clock)
    assert ctl.shm_name is None
    tpm = 60_000_000
    b = ctl.add_backend("b", max_concurrency=LIMIT + 1, tokens_per_minute=tpm * 10)
    g = ctl.add_tenant("g", priority="critical", guaranteed_slots=1, tokens_per_minute=tpm)
    s = ctl.add_tenant("s", priority="standard", max_concurrency=2, tokens_per_minute=tpm)
    sh = ctl.add_tenant("sh", priority="sheddable", tokens_per_minute=tpm)
    charged = {g: 0, s: 0, sh: 0}
    lock = threading.Lock()  # guards the test's own tallies, not the controller
    peak: list[int] = []
    leaked = [0]
    stop = threading.Event()

    def work(i: int) -> None:
        t, cls = [(g, "critical"), (s, "standard"), (sh, "sheddable")][i % 3]
        for k in range(ROUNDS // 2):
            tokens: int = _SwitchingTokens(7) if k % 5 == 0 else 7
            r = ctl.admit(b, t, cls, tokens)
            if not r.admitted:
                continue
            peak.append(ctl.backend_state(b)["in_use"])
            if k % 11 == 0:  # dropped unreleased: its finaliser releases it as reserved
                with lock:
                    charged[t] += 7
                    leaked[0] += 1
                if k % 2:
                    cycle: list[object] = [r]
                    cycle.append(cycle)  # freed only by the cyclic collector, in any thread
                del r
                continue
            actual = 3 if k % 3 else 9  # refunds and overruns
            r.release(actual)
            with lock:
                charged[t] += actual

    def admin() -> None:
        k = 0
        while not stop.is_set():
            k += 1
            ctl.set_scale(b, (0.25, 0.5, 1.0)[k % 3])
            ctl.set_shedding(b, k % 4 == 0)
            ctl.update_backend(b, max_concurrency=LIMIT + k % 2)
            ctl.update_tenant(s, max_concurrency=2 + k % 2)
            ctl.reclaim_dead()
            if k % 7 == 0:
                gc.collect()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        admin_thread = threading.Thread(target=admin)
        admin_thread.start()
        workers = [threading.Thread(target=work, args=(i,)) for i in range(9)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        stop.set()
        admin_thread.join()
    finally:
        sys.setswitchinterval(old)
    gc.collect()
    assert leaked[0] > 0
    assert ctl.leaks == leaked[0]
    assert max(peak) <= LIMIT + 1
    st = ctl.backend_state(b)
    assert (st["in_use"], st["inflight_tokens"], st["burst_in_use"]) == (0, 0, 0)
    for t in (g, s, sh):
        ts = ctl.tenant_state(t)
        assert ts["in_use"] == 0
        assert ts["available_tokens"] == tpm - charged[t], ts["name"]
