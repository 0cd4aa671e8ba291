"""pytest-benchmark of the admission core from Python (FFI cost included), each side by side with
the pure-Python reference of the article's Go sketch (benches/reference_limiter.py).

Each benchmarked call runs ``BATCH`` operation pairs, so pairs/s = BATCH / time per call (the
section reports the min and the median round).
Run: ``make bench`` (``benches/core_results.py`` runs this file and writes the figures into
benches/RESULTS.md), or ``.venv/bin/python -m pytest benches/bench_core.py --benchmark-enable``.
"""

from __future__ import annotations

import os
import uuid

import pytest

from kvgate import AdmissionController, SlotPool, TokenBucket
from reference_limiter import RefJointLimiter, RefSlotPool, RefTokenBucket

BATCH = 1_000
BIG = 2**40


@pytest.mark.benchmark(group="slot acquire+release")
def test_slots_rust(benchmark) -> None:  # type: ignore[no-untyped-def]
    pool = SlotPool(64)
    acquire, release = pool.try_acquire, pool.release

    def run() -> None:
        for _ in range(BATCH):
            acquire(1)
            release(1)

    benchmark.extra_info["pairs_per_call"] = BATCH
    benchmark(run)
    assert pool.in_use == 0


@pytest.mark.benchmark(group="slot acquire+release")
def test_slots_python_reference(benchmark) -> None:  # type: ignore[no-untyped-def]
    pool = RefSlotPool(64)
    acquire, release = pool.try_acquire, pool.release

    def run() -> None:
        for _ in range(BATCH):
            acquire(1)
            release(1)

    benchmark.extra_info["pairs_per_call"] = BATCH
    benchmark(run)
    assert pool.in_use == 0


@pytest.mark.benchmark(group="reserve+reconcile")
def test_bucket_rust(benchmark) -> None:  # type: ignore[no-untyped-def]
    bucket = TokenBucket(BIG)
    reserve, reconcile = bucket.try_reserve, bucket.reconcile

    def run() -> None:
        for _ in range(BATCH):
            reserve(500)
            reconcile(500, 400)

    benchmark.extra_info["pairs_per_call"] = BATCH
    benchmark(run)


@pytest.mark.benchmark(group="reserve+reconcile")
def test_bucket_python_reference(benchmark) -> None:  # type: ignore[no-untyped-def]
    bucket = RefTokenBucket(BIG)
    reserve, reconcile = bucket.try_reserve, bucket.reconcile

    def run() -> None:
        for _ in range(BATCH):
            reserve(500)
            reconcile(500, 400)

    benchmark.extra_info["pairs_per_call"] = BATCH
    benchmark(run)


def _admit_release(benchmark, ctl: AdmissionController) -> None:  # type: ignore[no-untyped-def]
    """Times ``BATCH`` admit + release(actual) pairs on ``ctl`` (one backend, one tenant)."""
    b = ctl.add_backend("b", max_concurrency=64, tokens_per_minute=BIG, inflight_token_limit=BIG)
    t = ctl.add_tenant("t", priority="standard", tokens_per_minute=BIG, max_concurrency=64)
    admit = ctl.admit

    def run() -> None:
        for _ in range(BATCH):
            admit(b, t, "standard", 500).release(400)

    benchmark.extra_info["pairs_per_call"] = BATCH
    benchmark(run)
    assert ctl.backend_state(b)["in_use"] == 0


@pytest.mark.benchmark(group="admit+release")
def test_admit_rust(benchmark) -> None:  # type: ignore[no-untyped-def]
    _admit_release(benchmark, AdmissionController())


@pytest.mark.benchmark(group="admit+release")
def test_admit_rust_shm(benchmark) -> None:  # type: ignore[no-untyped-def]
    """The same pair on a shared-memory controller, as ``serve --workers N`` runs it: every
    limit is a compare-and-swap (other processes update the same counters), plus the
    per-process ledger a crashed worker's holdings are reclaimed from."""
    name = f"kvgate-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    _admit_release(benchmark, AdmissionController(shm_name=name))


@pytest.mark.benchmark(group="admit+release")
def test_admit_python_reference(benchmark) -> None:  # type: ignore[no-untyped-def]
    lim = RefJointLimiter(64, BIG)
    acquire, release = lim.acquire, lim.release

    def run() -> None:
        for _ in range(BATCH):
            if acquire(500):
                release(500, 400)

    benchmark.extra_info["pairs_per_call"] = BATCH
    benchmark(run)
    assert lim.in_use == 0


def tenant_controller(n_tenants: int) -> tuple[AdmissionController, int]:
    """A private controller holding ``n_tenants`` tenants (each with its own TPM and
    concurrency limit, ids ``0..n_tenants-1``) on one backend: (controller, backend id). The
    local store of the tenant-count part of ``benches/replicas/run.py`` too."""
    ctl = AdmissionController(tenants=n_tenants, backends=1)
    b = ctl.add_backend("b", max_concurrency=64, tokens_per_minute=BIG, inflight_token_limit=BIG)
    for i in range(n_tenants):
        ctl.add_tenant(f"t{i}", priority="standard", tokens_per_minute=BIG, max_concurrency=64)
    return ctl, b


def _admit_release_tenants(benchmark, n_tenants: int) -> None:  # type: ignore[no-untyped-def]
    """Times ``BATCH`` admit + release(actual) pairs on a private controller holding
    ``n_tenants`` tenants (each with its own TPM and concurrency limit), going round all of them
    (each round starts where the last one stopped), so a large table is not read from a few warm
    cache lines only."""
    ctl, b = tenant_controller(n_tenants)
    ids = list(range(n_tenants)) * max(1, -(-BATCH // n_tenants))
    ids += ids[:BATCH]
    admit = ctl.admit
    start = [0]

    def run() -> None:
        first = start[0]
        for t in ids[first : first + BATCH]:
            admit(b, t, "standard", 500).release(400)
        start[0] = (first + BATCH) % n_tenants

    benchmark.extra_info["pairs_per_call"] = BATCH
    benchmark.extra_info["tenants"] = n_tenants
    benchmark(run)
    assert ctl.backend_state(b)["in_use"] == 0


@pytest.mark.benchmark(group="admit+release by tenant count")
def test_admit_rust_10_tenants(benchmark) -> None:  # type: ignore[no-untyped-def]
    _admit_release_tenants(benchmark, 10)


@pytest.mark.benchmark(group="admit+release by tenant count")
def test_admit_rust_100k_tenants(benchmark) -> None:  # type: ignore[no-untyped-def]
    _admit_release_tenants(benchmark, 100_000)
