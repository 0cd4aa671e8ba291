"""The cost of adding a tenant when the admission core must give it a removed tenant's id.

A core sized for 100,000 tenants (room for 200,000 ids and 200,000 guarantee entries) on 20
backends holds 100,000 tenants with a guaranteed slot on backend 0 and on one other backend
(which fills the guarantee table) and 100,000 plain ones; the guaranteed ones are removed.
Every id is then taken or removed and no entry is free, so each add takes a removed id (the
id comes with its guarantee entries). Times, in this process (``time.perf_counter``):

- 1,000 adds of tenants guaranteed on backend 0 only (every removed id's entries cover them);
- 1,000 adds of plain tenants (no guarantee);
- one add of a tenant guaranteed on backend 19, which no removed id has an entry on: refused
  (the table is full), after the core has compared the removed ids it looks at.

Usage: ``.venv/bin/python benches/tenants/reuse_scan.py``
"""

from __future__ import annotations

import time

from kvgate import AdmissionController, InvalidConfigError

BACKENDS, TENANTS = 20, 100_000


def main() -> None:
    ctl = AdmissionController(backends=BACKENDS, tenants=TENANTS, guarantees=TENANTS)
    for i in range(BACKENDS):
        ctl.add_backend(f"b{i}", max_concurrency=10**9, tokens_per_minute=10**12)
    guaranteed = [
        ctl.add_tenant(
            f"g{i}",
            priority="standard",
            max_concurrency=10,
            guaranteed_slots=1,
            guaranteed_backends=[0, 1 + i % (BACKENDS - 2)],
        )
        for i in range(TENANTS)
    ]
    while ctl.tenant_count < ctl.capacity["tenants"]:
        ctl.add_tenant(f"p{ctl.tenant_count}", priority="standard", max_concurrency=10)
    for tid in guaranteed:
        ctl.remove_tenant(tid)
    cap = ctl.capacity
    print(
        f"core: {cap['tenants']:,} ids ({ctl.tenant_count:,} used, {ctl.free_tenant_ids:,} "
        f"reusable), {cap['guarantees']:,} guarantee entries ({ctl.guarantee_entries_free} free)"
    )
    t0 = time.perf_counter()
    for i in range(1000):
        ctl.add_tenant(f"n{i}", priority="standard", guaranteed_slots=1, guaranteed_backends=[0])
    covered = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(1000):
        ctl.add_tenant(f"q{i}", priority="standard", max_concurrency=10)
    plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        ctl.add_tenant(
            "x", priority="standard", guaranteed_slots=1, guaranteed_backends=[BACKENDS - 1]
        )
        refused = "added (unexpected)"
    except InvalidConfigError:
        refused = "refused"
    uncovered = time.perf_counter() - t0
    print(f"1,000 adds covered by removed ids' entries: {covered * 1e3:.1f} ms")
    print(f"1,000 adds of plain tenants: {plain * 1e3:.1f} ms")
    print(f"one add no removed id covers: {uncovered * 1e3:.2f} ms ({refused})")


if __name__ == "__main__":
    main()
