"""Thousands of tenants with keys in one gateway: requests with several tenants' keys, a hot
reload that adds and removes tenants without a restart, a reload beyond the core's capacity
(refused, a restart is needed), and the same tenants in a shared-memory region."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import openai
import pytest

from kvgate.config import load_config
from kvgate.gateway_build import build_controller, build_gateway
from kvgate.server import run_gateway
from kvgate.sim import SimConfig, run_sim

from .conftest import sha
from .helpers import get_text, metric, until

TPM = 120  # about 15 tokens a request: a charge stays visible for seconds


def scale_config(url: str, model: str, names: list[str]) -> dict[str, Any]:
    """One backend; a tenant per name with key ``sk-<name>``, its own TPM and 2 at once; the
    last one critical with 2 guaranteed slots."""
    tenants: list[dict[str, Any]] = [
        {
            "name": n,
            "api_key_sha256": [sha(f"sk-{n}")],
            "tokens_per_minute": TPM,
            "max_concurrency": 2,
        }
        for n in names
    ]
    tenants[-1].update(priority="critical", guaranteed_slots=2)
    return {
        "backends": [
            {
                "name": "b0",
                "url": url,
                "models": [{"name": model, "context_window": 1024}],
                "max_concurrency": 8,
                "tokens_per_minute": 10_000_000,
                "adaptive": {"enabled": False},
            }
        ],
        "tenants": tenants,
    }


async def ask(url: str, key: str, model: str) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
    try:
        r = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert r.usage is not None
        assert r.usage.completion_tokens > 0
    finally:
        await client.close()


def charged(ctl: Any, name: str) -> bool:
    """Whether tenant ``name``'s bucket was charged (and its slot is back)."""
    st = ctl.tenant_state(ctl.tenant_id(name))
    return bool(st["in_use"] == 0 and st["available_tokens"] < TPM)


async def test_ten_thousand_tenants_and_a_reload_that_adds_and_removes_some(
    tmp_path: Path,
) -> None:
    sim_cfg = SimConfig.from_profile("tiny", speed=5, seed=4)
    model = sim_cfg.model
    names = [f"t{i}" for i in range(10_000)]
    path = tmp_path / "kvgate.json"
    async with run_sim(sim_cfg) as sim:
        path.write_text(json.dumps(scale_config(sim.url, model, names)))
        gateway = build_gateway(load_config(path), config_path=str(path), poll=False)
        ctl = gateway.controller
        assert ctl.capacity["tenants"] == 20_000  # twice the configured tenants
        assert ctl.tenant_count == 10_000
        async with run_gateway(gateway) as url:
            for n in ("t0", "t1234", "t5000", "t9999"):
                await ask(url, f"sk-{n}", model)
                await until(lambda n=n: charged(ctl, n))
            assert ctl.tenant_state(ctl.tenant_id("t42"))["available_tokens"] == TPM
            with pytest.raises(openai.AuthenticationError):
                await ask(url, "sk-nobody", model)
            await until(lambda: ctl.backend_state(0)["in_use"] == 0)

            # reload: t0..t99 removed, n0..n199 added; no restart
            old_t0 = ctl.tenant_id("t0")
            new_names = names[100:] + [f"n{i}" for i in range(200)]
            path.write_text(json.dumps(scale_config(sim.url, model, new_names)))
            assert gateway.reload() is True
            assert ctl.tenant_id("t0") is None
            assert ctl.tenant_removed(old_t0)
            assert ctl.tenant_count == 10_200  # never-used ids first; t0..t99 are tombstones
            with pytest.raises(openai.AuthenticationError):
                await ask(url, "sk-t0", model)
            await ask(url, "sk-n150", model)
            await until(lambda: charged(ctl, "n150"))
            await ask(url, "sk-t5000", model)  # kept tenants keep working
            st = ctl.tenant_state(ctl.tenant_id("t9999"))  # the guarantee moved to n199
            assert st["guaranteed_slots"] == 0
            assert ctl.tenant_state(ctl.tenant_id("n199"))["guaranteed_slots"] == 2
            assert ctl.backend_state(0)["guaranteed_slots"] == 2
            await until(lambda: ctl.backend_state(0)["in_use"] == 0)
            assert ctl.backend_state(0)["inflight_tokens"] == 0


async def test_a_reload_beyond_the_capacity_is_refused_and_says_to_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sim_cfg = SimConfig.from_profile("tiny", speed=5, seed=4)
    model = sim_cfg.model
    path = tmp_path / "kvgate.json"
    names = [f"t{i}" for i in range(400)]
    async with run_sim(sim_cfg) as sim:
        path.write_text(json.dumps(scale_config(sim.url, model, names)))
        gateway = build_gateway(load_config(path), config_path=str(path), poll=False)
        ctl = gateway.controller
        assert ctl.capacity["tenants"] == 1024  # the minimum
        # 400 + 625 tenants do not fit in 1,024
        path.write_text(
            json.dumps(scale_config(sim.url, model, names + [f"n{i}" for i in range(625)]))
        )
        assert gateway.reload() is False
        assert "restart kvgate" in caplog.text
        assert ctl.tenant_count == 400  # nothing changed
        assert ctl.tenant_id("n0") is None
        assert ctl.tenant_state(ctl.tenant_id("t399"))["guaranteed_slots"] == 2
        # what fits is applied: removing 100 tenants that hold nothing makes room for 100 more
        # (their ids are reused once the 624 never-used ones are taken)
        path.write_text(
            json.dumps(scale_config(sim.url, model, names[100:] + [f"n{i}" for i in range(724)]))
        )
        assert gateway.reload() is True
        assert ctl.tenant_count == 1024
        assert ctl.free_tenant_ids == 0
        # (the new tenant with a guarantee, n723, is added first; then the others in order)
        assert ctl.tenant_id("n722") is not None
        assert ctl.tenant_id("n722") < 100  # a removed tenant's id
        async with run_gateway(gateway) as url:
            await ask(url, "sk-n722", model)
            await until(lambda: charged(ctl, "n722"))
            with pytest.raises(openai.AuthenticationError):
                await ask(url, "sk-t0", model)


def guarantee_config(names: list[str], backends: int = 4) -> dict[str, Any]:
    """``backends`` backends; a tenant per name with one guaranteed slot on each (an entry of
    the core's guarantee table per (tenant, backend))."""
    return {
        "backends": [
            {
                "name": f"b{i}",
                "url": "http://127.0.0.1:9",
                "models": [{"name": f"m{i}", "context_window": 1024}],
                "max_concurrency": 2000,
                "adaptive": {"enabled": False},
            }
            for i in range(backends)
        ],
        "tenants": [
            {"name": n, "api_key_sha256": [sha(f"sk-{n}")], "guaranteed_slots": 1} for n in names
        ],
    }


def test_a_reload_whose_guarantees_overflow_the_table_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The core's guarantee table is sized at start-up (1,024 entries at least) and its entries
    are never freed. A reload whose guarantees need more than it has room for is refused before
    anything is changed (it used to stop part way, with some tenants set and others not); one
    that fits because new tenants take removed tenants' ids, with their entries, goes through."""
    path = tmp_path / "kvgate.json"
    names = [f"t{i}" for i in range(100)]  # 400 entries
    path.write_text(json.dumps(guarantee_config(names)))
    gateway = build_gateway(load_config(path), config_path=str(path), poll=False)
    ctl = gateway.controller
    assert ctl.capacity["guarantees"] == 1024
    assert ctl.guarantee_entries_free == 1024 - 400
    # 100 + 200 tenants on 4 backends: 1,200 entries, 1,024 at most
    path.write_text(json.dumps(guarantee_config(names + [f"n{i}" for i in range(200)])))
    with caplog.at_level(logging.ERROR):
        assert gateway.reload() is False
    assert "guarantee table" in caplog.text
    assert "restart kvgate" in caplog.text
    assert ctl.tenant_count == 100  # nothing changed, no tenant added
    assert ctl.guarantee_entries_free == 1024 - 400
    assert not gateway.partly_applied
    assert [b.config.max_concurrency for b in gateway.backends] == [2000] * 4
    # the same 200 new tenants in place of the 100 (800 entries): 624 are free, and once they
    # are taken a new tenant takes a removed tenant's id with its 4 entries
    path.write_text(json.dumps(guarantee_config([f"n{i}" for i in range(200)])))
    assert gateway.reload() is True
    assert ctl.tenant_id("n199") is not None
    assert ctl.tenant_state(ctl.tenant_id("n199"))["guaranteed_slots"] == 1
    assert ctl.backend_state(0)["guaranteed_slots"] == 200


def test_two_workers_reloading_at_once_keep_each_others_new_tenants(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers of one shared core apply the same reload (``--workers 2``: each applies the
    file), one of them wholly between the other's look-up of the tenants to remove and its
    removals, with the guarantee table full: the first's new tenants take the removed
    tenants' ids, and one of them has a request running. The second neither refuses the
    reload (it counts the new tenants as added again, against entries already taken) nor
    removes the first's new tenants by those ids (then adds them again elsewhere, the busy one
    included): every new tenant's id is its own in both workers' tables and in the core."""
    import kvgate.gateway_build as gb
    from kvgate.gateway_build import apply_config, prepare_reload

    path = tmp_path / "kvgate.json"
    base = [f"f{i}" for i in range(100)]
    path.write_text(json.dumps(guarantee_config(base)))
    a = build_gateway(load_config(path), config_path=str(path), poll=False)
    ctl = a.controller
    b = build_gateway(load_config(path), config_path=str(path), poll=False, controller=ctl)

    held: list[Any] = []

    def reload_both(names: list[str], interleave: bool) -> None:
        path.write_text(json.dumps(guarantee_config(names)))
        config = load_config(path)
        plan_a, plan_b = prepare_reload(a, config), prepare_reload(b, config)
        check = gb._check_guarantee_room

        def first_a_whole(*args: Any) -> None:
            monkeypatch.setattr(gb, "_check_guarantee_room", check)
            apply_config(a, plan_a)
            # the first worker serves a new tenant at once: its id is busy
            r0 = a.identity.named("r0")
            assert r0 is not None
            held.append(ctl.admit(0, r0.id, "standard", 10))
            check(*args)

        if interleave:
            monkeypatch.setattr(gb, "_check_guarantee_room", first_a_whole)
        apply_config(b, plan_b)
        monkeypatch.setattr(gb, "_check_guarantee_room", check)
        if not interleave:
            apply_config(a, plan_a)

    reload_both(base + [f"x{i}" for i in range(156)], interleave=False)  # 1,024 entries
    assert ctl.guarantee_entries_free == 0
    x_ids = {ctl.tenant_id(f"x{i}") for i in range(156)}
    reload_both(base + [f"r{i}" for i in range(156)], interleave=True)
    assert not a.partly_applied
    assert not b.partly_applied
    assert len(held) == 1
    r_ids = {ctl.tenant_id(f"r{i}") for i in range(156)}
    assert r_ids == x_ids  # the removed tenants' ids (and entries), taken by the new ones
    for i in range(156):
        tid = ctl.tenant_id(f"r{i}")
        assert tid is not None
        assert not ctl.tenant_removed(tid)
        for worker in (a, b):
            known = worker.identity.named(f"r{i}")
            assert known is not None
            assert known.id == tid


async def test_ten_thousand_tenants_in_a_shared_memory_region() -> None:
    sim_cfg = SimConfig.from_profile("tiny", speed=5, seed=4)
    model = sim_cfg.model
    names = [f"t{i}" for i in range(10_000)]
    shm_name = f"kvgate-test-scale-{os.getpid()}"
    async with run_sim(sim_cfg) as sim:
        from kvgate.config import Config

        config = Config.model_validate(scale_config(sim.url, model, names))
        master = build_controller(config, shm_name=shm_name, create=True)
        # a worker attaches: its gateway reads the layout from the region
        gateway = build_gateway(config, shm_name=shm_name, poll=False)
        ctl = gateway.controller
        assert ctl.capacity == master.capacity
        assert ctl.capacity["tenants"] == 20_000
        assert ctl.tenant_id("t7777") == master.tenant_id("t7777") == 7777
        async with run_gateway(gateway) as url:
            for n in ("t1", "t7777", "t9999"):
                await ask(url, f"sk-{n}", model)
                # the master sees what the worker charged
                await until(lambda n=n: charged(master, n))
        assert master.tenant_state(master.tenant_id("t2"))["available_tokens"] == TPM
        await until(lambda: master.backend_state(0)["in_use"] == 0)
        del gateway, ctl
        logging.getLogger(__name__).debug("region of %d bytes", master.region_bytes)


async def test_a_hundred_thousand_tenants_keep_scrapes_and_the_dashboard_small(
    tmp_path: Path,
) -> None:
    """With more tenants than ``metrics.tenant_labels`` (default 1,000) the per-tenant series
    carry ``tenant="*"``: a scrape's size does not grow with the tenants that sent requests
    (100,000 tenants each with its own series made one take seconds and 90 MB). Each tenant's
    usage stays in /admin/usage and the dashboard, which reads only its top tenants."""
    sim_cfg = SimConfig.from_profile("tiny", speed=5, seed=4)
    model = sim_cfg.model
    names = [f"t{i}" for i in range(100_000)]
    used = names[::2_500]  # 40 tenants
    path = tmp_path / "kvgate.json"
    async with run_sim(sim_cfg) as sim:
        path.write_text(json.dumps(scale_config(sim.url, model, names)))
        gateway = build_gateway(load_config(path), config_path=str(path), poll=False)
        ctl = gateway.controller
        assert gateway.metrics.per_tenant is False
        async with run_gateway(gateway) as url:
            for n in used:
                await ask(url, f"sk-{n}", model)
            for n in used:
                await until(lambda n=n: charged(ctl, n))
            text = await get_text(url + "/metrics")
            assert re.search(r'tenant="t\d', text) is None
            assert metric(text, "kvgate_tenant_requests_total", tenant="*") == len(used)
            assert metric(text, "kvgate_requests_total", tenant="*", outcome="ok") == len(used)
            charged_tokens = metric(text, "kvgate_tenant_tokens_total", tenant="*")
            assert charged_tokens is not None
            assert charged_tokens > 0
            assert len(text) < 64_000, len(text)

            usage = json.loads(await get_text(url + "/admin/usage"))
            by_tenant = {row["tenant"]: row for row in usage["data"]}
            assert by_tenant.keys() == set(used)
            assert all(row["requests"] == 1 for row in by_tenant.values())
            spent = {n: r["prompt_tokens"] + r["completion_tokens"] for n, r in by_tenant.items()}
            assert sum(spent.values()) == charged_tokens

            data = json.loads(await get_text(url + "/dashboard/data"))
            top = sorted(spent.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
            assert [(t["name"], t["tokens"]) for t in data["tenants"]] == top
            assert all(t["in_use"] == 0 for t in data["tenants"])

            # a reload that allows 100,000 labels: the next requests carry their tenant's name
            cfg = scale_config(sim.url, model, names)
            cfg["metrics"] = {"tenant_labels": 100_000}
            path.write_text(json.dumps(cfg))
            assert gateway.reload() is True
            assert gateway.metrics.per_tenant is True
            await ask(url, "sk-t7", model)
            await until(lambda: charged(ctl, "t7"))
            text = await get_text(url + "/metrics")
            assert metric(text, "kvgate_tenant_requests_total", tenant="t7") == 1
            assert metric(text, "kvgate_tenant_requests_total", tenant="*") == len(used)


def test_random_reloads_near_a_full_guarantee_table_apply_whole_or_are_refused_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded random reloads (tenants removed, re-configured and added, with guarantees on
    every backend or on some) near a full guarantee table, applied to two gateways: one with
    the reload's room check, one without. The check never refuses a file that applies whole
    without it; and what it lets through nearly always applies whole: an added tenant takes
    the removed id whose entries suit it best (these seeds: 1 of the 86 reloads the check lets
    through stops part way; with the first removed id it was 15 of 86)."""
    import random

    import kvgate.gateway_build as gb

    check = gb._check_guarantee_room
    backends = [f"b{i}" for i in range(4)]

    def spec(rng: random.Random) -> dict[str, Any]:
        r = rng.random()
        if r < 0.3:
            return {"guaranteed_slots": rng.randint(1, 3)}
        if r < 0.7:
            some = rng.sample(backends, rng.randint(1, len(backends)))
            return {"guaranteed_slots": rng.randint(0, 2), "backends": some}
        return {}

    def config(tenants: dict[str, dict[str, Any]]) -> dict[str, Any]:
        c = guarantee_config([], backends=len(backends))
        c["backends"] = [dict(b, max_concurrency=100_000) for b in c["backends"]]
        c["tenants"] = [
            dict(name=n, api_key_sha256=[sha(f"sk-{n}")], **s) for n, s in tenants.items()
        ]
        return c

    def reload(gateway: Any, path: Path, data: dict[str, Any], checked: bool) -> tuple[bool, bool]:
        path.write_text(json.dumps(data))
        monkeypatch.setattr(gb, "_check_guarantee_room", check if checked else lambda *a: None)
        try:
            return gateway.reload(), gateway.partly_applied
        finally:
            monkeypatch.setattr(gb, "_check_guarantee_room", check)

    outcomes: dict[str, int] = {"whole": 0, "refused": 0, "part way": 0}
    logging.disable(logging.CRITICAL)  # each refusal logs an error
    try:
        for seed in range(20):
            rng = random.Random(seed)
            tenants = {f"t{seed}_{i}": spec(rng) for i in range(rng.randint(50, 250))}
            paths = [tmp_path / f"{seed}-checked.json", tmp_path / f"{seed}-unchecked.json"]
            gateways = []
            for p in paths:
                p.write_text(json.dumps(config(tenants)))
                gateways.append(build_gateway(load_config(p), config_path=str(p), poll=False))
            for step in range(12):
                new = {n: s for n, s in tenants.items() if rng.random() >= 0.15}
                for n in new:
                    if rng.random() < 0.2:
                        new[n] = spec(rng)
                for i in range(rng.randint(0, 150)):
                    new[f"n{seed}_{step}_{i}"] = spec(rng)
                checked = reload(gateways[0], paths[0], config(new), True)
                unchecked = reload(gateways[1], paths[1], config(new), False)
                if checked == (False, False):
                    # refused whole: only a file that could not apply whole
                    assert unchecked == (False, True), (seed, step)
                    outcomes["refused"] += 1
                    break  # the two gateways' cores differ from here on
                assert checked == unchecked, (seed, step)
                if checked[1]:
                    outcomes["part way"] += 1
                    break
                outcomes["whole"] += 1
                tenants = new
    finally:
        logging.disable(logging.NOTSET)
    assert outcomes["refused"] >= 5, outcomes  # the table was nearly full often enough
    assert outcomes["part way"] * 20 <= outcomes["whole"], outcomes  # at most 5 %


def test_a_reload_gives_removed_ids_to_the_new_tenants_that_need_their_entries_most(
    tmp_path: Path,
) -> None:
    """The guarantee table is full; a reload removes ``x`` (entries on b0 and b1) and ``y``
    (b0), and adds ``a`` (guaranteed on b0), listed first, and ``b`` (b0 and b1). Only
    ``x``'s id covers ``b``: the new tenants are added most entries first, so ``b`` takes it and
    ``a`` takes ``y``'s, and the reload applies whole (in the file's order ``a`` took ``x``'s
    id, and ``b`` found the table full half way through the reload)."""
    path = tmp_path / "kvgate.json"

    def write(extra: list[dict[str, Any]], fill: int) -> None:
        cfg = guarantee_config([f"f{i}" for i in range(fill)])
        cfg["tenants"] += [
            {"name": n, "api_key_sha256": [sha(f"sk-{n}")], "guaranteed_slots": 1, "backends": b}
            for n, b in extra
        ]
        path.write_text(json.dumps(cfg))

    x, y = ("x", ["b0", "b1"]), ("y", ["b0"])
    write([x, y], 100)  # 400 + 3 entries of 1,024
    gateway = build_gateway(load_config(path), config_path=str(path), poll=False)
    ctl = gateway.controller
    write([x, y, ("w", ["b3"])], 255)  # 1,020 + 4: full
    assert gateway.reload() is True
    assert ctl.guarantee_entries_free == 0
    x_id, y_id = ctl.tenant_id("x"), ctl.tenant_id("y")
    write([("a", ["b0"]), ("b", ["b0", "b1"]), ("w", ["b3"])], 255)
    assert gateway.reload() is True
    assert not gateway.partly_applied
    assert (ctl.tenant_id("b"), ctl.tenant_id("a")) == (x_id, y_id)
    assert ctl.backend_state(0)["guaranteed_slots"] == 255 + 2
    assert ctl.backend_state(1)["guaranteed_slots"] == 255 + 1


async def test_a_sighup_reload_waits_for_the_removed_tenants_requests_to_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every id of the core is taken; a reload removes 10 tenants and adds 10, and one removed
    tenant still has a request running: its id cannot go to a new tenant yet. The SIGHUP
    reload is refused, said once in the log, and tried again every second: it applies once the
    request ends, with no second SIGHUP (each replica checks its own core, and one that had
    such a request would otherwise keep the old tenants while the others took the file). The
    file is read once: the tries apply it as read (an edit meanwhile waits for its SIGHUP)."""
    path = tmp_path / "kvgate.json"
    names = [f"t{i}" for i in range(512)]
    path.write_text(json.dumps(scale_config("http://127.0.0.1:9", "m", names)))
    gateway = build_gateway(load_config(path), config_path=str(path), poll=False)
    ctl = gateway.controller
    names += [f"n{i}" for i in range(512)]
    path.write_text(json.dumps(scale_config("http://127.0.0.1:9", "m", names)))
    assert gateway.reload() is True
    assert ctl.free_tenant_ids == 0
    running = ctl.admit(0, ctl.tenant_id("t0"), "standard", 10)
    assert running.admitted
    path.write_text(
        json.dumps(
            scale_config("http://127.0.0.1:9", "m", names[10:] + [f"m{i}" for i in range(10)])
        )
    )
    reads: list[int] = []
    read = type(gateway)._read_config

    def counted(self: Any) -> Any:
        reads.append(1)
        return read(self)

    monkeypatch.setattr(type(gateway), "_read_config", counted)
    with caplog.at_level(logging.ERROR):
        gateway.reload_soon()
        await until(lambda: gateway.last_refusal is not None, timeout=30)
        assert "still have requests running here" in caplog.text
        assert ctl.tenant_id("m9") is None
        assert ctl.tenant_id("t0") is not None
        # an edit without a SIGHUP
        path.write_text(json.dumps(scale_config("http://127.0.0.1:9", "m", ["z0"])))
        running.release()
        await until(lambda: ctl.tenant_id("m9") is not None, timeout=30)
    assert ctl.tenant_id("t0") is None
    assert ctl.tenant_id("z0") is None
    assert len(reads) == 1
    assert gateway.last_refusal is None
    assert caplog.text.count("still have requests running here") == 1


def test_two_workers_filling_the_core_at_once_both_apply_the_reload(tmp_path: Path) -> None:
    """Two workers of one shared core apply a reload that fills it (512 tenants to 1,024),
    one of them wholly while the other looks its new tenants up. The other must count the
    room before those look-ups (a tenant the first added is then no longer its to add), not
    after: read after, the free ids are already gone and it refused a file that fits, keeping
    the old tenants while the first worker served the new ones."""
    from kvgate.gateway_build import apply_config, prepare_reload

    path = tmp_path / "kvgate.json"
    names = [f"t{i}" for i in range(512)]
    path.write_text(json.dumps(scale_config("http://127.0.0.1:9", "m", names)))
    a = build_gateway(load_config(path), config_path=str(path), poll=False)
    ctl = a.controller
    b = build_gateway(load_config(path), config_path=str(path), poll=False, controller=ctl)
    path.write_text(
        json.dumps(scale_config("http://127.0.0.1:9", "m", names + [f"n{i}" for i in range(512)]))
    )
    config = load_config(path)
    plan_a, plan_b = prepare_reload(a, config), prepare_reload(b, config)

    class Interleaved:
        """The shared core as worker b sees it: worker a applies the reload wholly right
        after b first looks up one of the new tenants (not there yet)."""

        def __getattr__(self, name: str) -> Any:
            return getattr(ctl, name)

        def tenant_id(self, name: str) -> int | None:
            found = ctl.tenant_id(name)
            if name.startswith("n") and not plan_a_applied:
                plan_a_applied.append(True)
                apply_config(a, plan_a)
            return found

    plan_a_applied: list[bool] = []
    b.controller = Interleaved()
    try:
        apply_config(b, plan_b)
    finally:
        b.controller = ctl
    assert plan_a_applied
    assert ctl.free_tenant_ids == 0
    for worker in (a, b):
        assert not worker.partly_applied
        known = worker.identity.named("n511")
        assert known is not None
        assert known.id == ctl.tenant_id("n511")
