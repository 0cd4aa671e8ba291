"""A reload made ready off the event loop (``prepare_reload``) and then applied sets only what
changed, and leaves the gateway exactly as a gateway built from the new file: the same limits in
the core (a limit dropped from the file is dropped: no limit, one minute's burst, no in-flight
budget), the same tenant table, every key to the same tenant. Random sequences of reloads
(tenants added, removed, changed, keys moved between tenants, backend limits set and dropped)
against a fresh build."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.config import Config
from kvgate.errors import GatewayError
from kvgate.gateway_build import apply_config, build_gateway, prepare_reload

from .conftest import sha

NAMES = [f"t{i}" for i in range(8)]
KEYS = [f"sk-k{i}" for i in range(20)]
#: what the core holds of a tenant's and a backend's configuration
TENANT_FIELDS = (
    "priority",
    "max_concurrency",
    "tokens_per_minute",
    "burst_tokens",
    "guaranteed_slots",
    "guaranteed_backends",
)
BACKEND_FIELDS = ("max_concurrency", "tokens_per_minute", "burst_tokens", "inflight_token_limit")


def document(tenants: list[dict[str, Any]], **backend: Any) -> dict[str, Any]:
    return {
        "backends": [
            {
                "name": "b0",
                "url": "http://127.0.0.1:9",
                "models": [{"name": "m", "context_window": 1024}],
                "max_concurrency": 100,
                "adaptive": {"enabled": False},
                **backend,
            }
        ],
        "tenants": tenants,
    }


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=len(NAMES), unique=True))
    keys = draw(st.permutations(KEYS))  # each key held by one tenant at most
    tenants = []
    for i, name in enumerate(names):
        t: dict[str, Any] = {
            "name": name,
            "api_key_sha256": [sha(k) for k in keys[2 * i : 2 * i + draw(st.integers(1, 2))]],
            "priority": draw(st.sampled_from(["critical", "standard", "sheddable"])),
            "max_wait_ms": draw(st.sampled_from([0, 500])),
            "mode": draw(st.sampled_from(["enforce", "shadow"])),
        }
        if draw(st.booleans()):
            t["max_concurrency"] = draw(st.integers(1, 50))
        if draw(st.booleans()):
            t["tokens_per_minute"] = draw(st.integers(1000, 1_000_000))
            if draw(st.booleans()):
                t["burst_tokens"] = draw(st.integers(1, 2_000_000))
        if t["priority"] != "sheddable" and draw(st.booleans()):
            t["guaranteed_slots"] = draw(st.integers(1, min(10, t.get("max_concurrency", 10))))
        tenants.append(t)
    backend: dict[str, Any] = {}
    if draw(st.booleans()):
        backend["tokens_per_minute"] = draw(st.integers(1000, 10**7))
        if draw(st.booleans()):
            backend["burst_tokens"] = draw(st.integers(1, 10**7))
    if draw(st.booleans()):
        backend["inflight_token_limit"] = draw(st.integers(2048, 10**6))
    return document(tenants, **backend)


def view(gw: Any) -> dict[str, Any]:
    """What a reload must get right, by tenant name (core ids may differ between gateways)."""
    ctl = gw.controller
    tenants = {}
    for t in gw.tenants:
        assert ctl.tenant_id(t.name) == t.id
        state = ctl.tenant_state(t.id)
        tenants[t.name] = (
            t.priority,
            sorted(t.key_hashes),
            t.max_wait_ms,
            t.shadow,
            {f: state[f] for f in TENANT_FIELDS},
        )
    owners = {}
    for key in KEYS:
        try:
            owners[key] = gw.identity.identify({"Authorization": f"Bearer {key}"})[0].name
        except GatewayError as err:
            owners[key] = err.status  # 401: no tenant has the key
    backend = ctl.backend_state(0)
    return {
        "backend": {f: backend[f] for f in BACKEND_FIELDS},
        "order": [t.name for t in gw.tenants],
        "tenants": tenants,
        "owners": owners,
        "gone": sorted(n for n in NAMES if n not in tenants and ctl.tenant_id(n) is not None),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(configs(), min_size=2, max_size=6))
def test_a_reload_leaves_the_gateway_as_a_fresh_build_of_the_new_file(
    docs: list[dict[str, Any]],
) -> None:
    gw = build_gateway(Config.model_validate(docs[0]), poll=False)
    for doc in docs[1:]:
        new = Config.model_validate(doc)
        before = {t.name: t for t in gw.tenants}
        plan = prepare_reload(gw, new)
        # only what changed is set: the new tenants and those whose configuration differs
        old = {t.name: t for t in gw.config.tenants}
        assert {t.name for t in plan.changed} == {
            t.name for t in new.tenants if old.get(t.name) != t
        }
        apply_config(gw, plan)
        fresh = build_gateway(new, poll=False)
        assert view(gw) == view(fresh)
        # every tenant with a key answers to it
        assert set(view(gw)["owners"].values()) - {401} == {
            t.name for t in new.tenants if t.api_key_sha256
        }
        # an unchanged tenant keeps its table entry; a changed one gets a new one
        for t in gw.tenants:
            if t.name in before and old[t.name] == next(c for c in new.tenants if c.name == t.name):
                assert t is before[t.name]
            else:
                assert t is not before.get(t.name)


def test_a_prepared_reload_that_the_core_refuses_changes_nothing() -> None:
    """A reload the core refuses is refused while it is made ready (a worker thread at SIGHUP),
    before anything of the running gateway changed."""
    from kvgate._core import InvalidConfigError

    doc = document([{"name": "t0", "api_key_sha256": [sha("sk-k0")], "max_concurrency": 5}])
    gw = build_gateway(Config.model_validate(doc), poll=False)
    seen = view(gw)
    bad = document(
        [{"name": "t0", "api_key_sha256": [sha("sk-k0")], "guaranteed_slots": 101}]
    )  # more guaranteed slots than the backend has
    with pytest.raises((InvalidConfigError, ValueError)):
        prepare_reload(gw, Config.model_validate(bad))
    assert view(gw) == seen


def test_a_reload_that_moves_a_guarantee_between_tenants_applies() -> None:
    """A backend of 25 slots, A guaranteed 10 and B 15; the new file gives A 20 and B 5. It fits
    as a whole; B's guarantee shrinks before A's grows (set in file order, A first, the core
    refused the step and the reload failed part way)."""
    tenants = [
        {"name": "A", "api_key_sha256": [sha("sk-k0")], "guaranteed_slots": 10},
        {"name": "B", "api_key_sha256": [sha("sk-k1")], "guaranteed_slots": 15},
    ]
    gw = build_gateway(Config.model_validate(document(tenants, max_concurrency=25)), poll=False)
    tenants[0]["guaranteed_slots"], tenants[1]["guaranteed_slots"] = 20, 5
    new = Config.model_validate(document(tenants, max_concurrency=25))
    apply_config(gw, prepare_reload(gw, new))
    assert view(gw) == view(build_gateway(new, poll=False))
    assert not gw.partly_applied


def test_a_reload_that_failed_part_way_is_repaired_by_the_next_one() -> None:
    """The core refuses a step after others were applied (here: t0's limits are set and t1 is
    added, then t2 is refused, as when the guarantee table is full): the gateway says so, and
    the next reload sets every tenant again, even those its file did not change, and removes
    what the failed one added."""
    x = {"name": "t0", "api_key_sha256": [sha("sk-k0")], "max_concurrency": 5}
    doc = document([x], max_concurrency=9)
    gw = build_gateway(Config.model_validate(doc), poll=False)
    seen = view(gw)
    more = [
        {**x, "max_concurrency": 7},
        {"name": "t1", "api_key_sha256": [sha("sk-k1")]},
        {"name": "t2", "api_key_sha256": [sha("sk-k2")]},
    ]
    plan = prepare_reload(gw, Config.model_validate(document(more, max_concurrency=9)))
    ctl = gw.controller

    class Refusing:  # the core as it is, but refusing the second tenant added
        added = 0

        def __getattr__(self, name: str) -> Any:
            return getattr(ctl, name)

        def add_tenant(self, *args: Any, **kwargs: Any) -> int:
            self.added += 1
            if self.added > 1:
                raise ValueError("refused by the test")
            return int(ctl.add_tenant(*args, **kwargs))

    gw.controller = Refusing()
    with pytest.raises(ValueError, match="refused by the test"):
        apply_config(gw, plan)
    gw.controller = ctl
    assert gw.partly_applied
    assert ctl.tenant_id("t1") is not None  # added, and in no file now
    # the old file again: t0 unchanged against the running configuration, set all the same
    plan = prepare_reload(gw, Config.model_validate(doc))
    assert [t.name for t in plan.changed] == ["t0"]
    apply_config(gw, plan)
    assert view(gw) == seen
    assert ctl.tenant_id("t1") is None
    assert not gw.partly_applied


def test_workers_reloading_one_shared_core_at_once_all_apply_the_file() -> None:
    """With ``--workers N`` every worker applies the file to the one shared core: a worker
    whose plan (made on its worker thread) adds a tenant that another worker added meanwhile
    sets that tenant's limits instead of failing, and its own table gets the tenant's key."""
    import os

    from kvgate.gateway_build import build_controller

    doc = document([{"name": "A", "api_key_sha256": [sha("sk-k0")], "max_concurrency": 2}])
    config = Config.model_validate(doc)
    shm = f"kvgtest-{os.getpid()}"
    master = build_controller(config, shm_name=shm, create=True)
    try:
        a = build_gateway(config, shm_name=shm, poll=False)
        b = build_gateway(config, shm_name=shm, poll=False)
        tenants = doc["tenants"] + [{"name": "NEW", "api_key_sha256": [sha("sk-k1")]}]
        new = Config.model_validate(document(tenants))
        plan_a, plan_b = prepare_reload(a, new), prepare_reload(b, new)
        apply_config(a, plan_a)
        apply_config(b, plan_b)  # NEW is there already
        for gw in (a, b):
            assert not gw.partly_applied
            assert view(gw)["owners"]["sk-k1"] == "NEW"
            assert view(gw) == view(a)
    finally:
        del master


def test_reading_a_file_holds_off_the_garbage_collector_and_restores_it(tmp_path: Any) -> None:
    """While a reload reads and prepares the file (a worker thread at SIGHUP) the cyclic
    collector waits (its collections would walk every object the file makes, holding the
    interpreter, 100 ms and more at 100,000 tenants); after, it runs as it did before, when the
    file is refused as well."""
    import gc
    import json

    from kvgate.config import load_config

    path = tmp_path / "kvgate.json"
    doc = document([{"name": "t0", "api_key_sha256": [sha("sk-k0")]}])
    path.write_text(json.dumps(doc))
    gw = build_gateway(load_config(path), config_path=str(path), poll=False)
    seen: list[bool] = []
    prepare = gw.prepare_config
    assert prepare is not None

    def spy(gateway: Any, new: Any) -> Any:
        seen.append(gc.isenabled())
        return prepare(gateway, new)

    gw.prepare_config = spy
    assert gc.isenabled()
    assert gw.reload()
    assert seen == [False]
    assert gc.isenabled()
    path.write_text("{not a configuration")
    assert not gw.reload()
    assert gc.isenabled()
    gc.disable()  # a process that runs without it keeps it off
    try:
        path.write_text(json.dumps(doc))
        assert gw.reload()
        assert not gc.isenabled()
    finally:
        gc.enable()
