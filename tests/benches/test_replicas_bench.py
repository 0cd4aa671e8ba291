"""benches/replicas/run.py: its gateway configurations, the parsing of metrics and access logs,
the store micro-benchmark's set-up (every pair local, no message to Redis), the verdicts and the
RESULTS.md section, on fixed inputs (the run itself is reported, not tested)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import orjson
import pytest
from benchmod import load

from kvgate.config import parse_config

rb = load("replicas_run", "benches/replicas/run.py")


def test_throughput_configs_are_valid_and_differ_only_by_the_store() -> None:
    local = rb.throughput_config("http://127.0.0.1:9", 8081, None)
    shared = rb.throughput_config("http://127.0.0.1:9", 8081, {"url": "redis://127.0.0.1:1/0"})
    assert parse_config(local).store is None
    cfg = parse_config(shared)
    assert cfg.store is not None
    assert cfg.store.heartbeat_s == 1.0  # the defaults are what is measured
    tenant = cfg.tenants[0]
    assert tenant.max_concurrency == 100_000
    assert cfg.backends[0].adaptive.enabled is False
    assert {k: v for k, v in shared.items() if k != "store"} == local


METRICS = """# HELP kvgate_admission_seconds x
kvgate_admission_seconds_bucket{le="0.0001"} 3.0
kvgate_admission_seconds_count 12.0
kvgate_admission_seconds_count_other 99.0
kvgate_store_call_seconds_bucket{le="0.001"} 4.0
kvgate_store_call_seconds_bucket{le="0.005"} 6.0
kvgate_store_call_seconds_bucket{le="+Inf"} 8.0
kvgate_store_call_seconds_count 8.0
"""


def test_metric_value_and_call_buckets() -> None:
    assert rb.metric_value(METRICS, "kvgate_admission_seconds_count") == 12.0
    assert rb.metric_value(METRICS, "kvgate_store_call_seconds_count") == 8.0
    assert rb.metric_value(METRICS, "absent") == 0.0
    buckets = rb.call_buckets(METRICS)
    assert buckets == {"0.001": 4.0, "0.005": 6.0, "+Inf": 8.0}
    spread = rb.call_spread(buckets)
    assert spread.startswith("8 calls, 0% ≤ 0.5 ms, 50% ≤ 1 ms")
    assert "75% ≤ 5 ms" in spread
    assert rb.call_spread({}) == "no calls"


def test_access_decisions_keeps_the_named_tenants_lines() -> None:
    lines = [
        orjson.dumps({"tenant": "near", "outcome": "ok", "queue_wait_s": 0.002}),
        orjson.dumps({"tenant": "near", "outcome": "rejected", "queue_wait_s": 0.001}),
        orjson.dumps({"tenant": "other", "outcome": "ok", "queue_wait_s": 0.5}),
        orjson.dumps({"tenant": "far", "outcome": "ok", "queue_wait_s": None}),
        b"store: a warning, not JSON",
        b'{"queue_wait_s": broken',
    ]
    got = rb.access_decisions(b"\n".join(lines), {"near", "far"})
    assert got == [("near", "ok", 0.002), ("near", "rejected", 0.001)]


def test_store_micro_benchmark_decides_every_pair_locally() -> None:
    store, backend, tenants, kicks = rb.seeded_store(50)
    ns, missed = rb.pairs_ns(store, backend, tenants * 4)
    assert ns > 0
    assert missed == 0
    assert kicks == [0]  # no message to Redis was asked for
    assert len(store._parts) == 50
    assert len(store.scopes) == 51  # one per tenant and the backend's
    assert all(p.in_use == 0 for sc in store.scopes.values() for p in sc.pools.values())


def test_store_micro_benchmark_counts_a_pair_that_is_not_local() -> None:
    store, backend, tenants, kicks = rb.seeded_store(2)
    pool = store.scopes["t" + tenants[0].name].pools["conc"]
    pool.q = 0  # this tenant's quota is gone: its admissions would go to Redis
    _, missed = rb.pairs_ns(store, backend, [tenants[0], tenants[1], tenants[0]])
    assert missed == 2
    assert kicks == [0]


def test_micro_phase_reports_each_order() -> None:
    # a small run: the labels, repeats and the memory figure are there
    orders = rb.ORDERS
    rb.ORDERS = (("10 tenants", 10, 10, "random"), ("40 tenants, in turn", 40, 40, "turn"))
    try:
        m = rb.micro_phase(ops=200, repeats=2)
    finally:
        rb.ORDERS = orders
    assert set(m.ns) == {"10 tenants", "40 tenants, in turn"}
    assert all(len(v) == 2 for v in m.ns.values())
    # the local store timed on the same orders, beside each
    assert set(m.core_ns) == set(m.ns)
    assert all(len(v) == 2 and min(v) > 0 for v in m.core_ns.values())
    assert (m.missed, m.kicks) == (0, 0)
    assert m.bytes_per_tenant > 0


def window(setup: str, replicas: int, rps: float, cpu: float, calls: int | None) -> object:
    return rb.Window(
        setup=setup,
        store="redis" if calls is not None else "local",
        replicas=replicas,
        connections=48,
        requests=int(rps * 2),
        non_2xx=0,
        socket_errors=0,
        seconds=2.0,
        rps=rps,
        p50_ms=20.0,
        gateway_cpu_us=cpu,
        redis_cpu_us=1.0 if calls is not None else None,
        admissions=int(rps * 2),
        store_calls=calls,
        call_metric=calls,
    )


def args() -> argparse.Namespace:
    return argparse.Namespace(
        cmdline="make bench-replicas", connections=48, duration=2.0, warmup=1.0,
        server_cpu="1", client_cpu="0", near_speed=20.0, near_clients=12, far_clients=12,
        near_duration=8.0, near_warmup=2.0, quiet_duration=5.0,
    )  # fmt: skip


def results() -> tuple[object, object, object, object]:
    rounds = [
        [
            window("local ×1", 1, 1000.0, 400.0, None),
            window("local ×3", 3, 990.0, 405.0, None),
            window("redis ×1", 1, 960.0, 410.0, 10),
            window("redis ×3", 3, 900.0, 420.0, 20),
            window(rb.ONE_OF_3, 1, 940.0, 415.0, 8),
        ]
    ]
    near = rb.NearResult(
        decisions={
            "near": [("ok", 0.0010), ("rejected", 0.0012), ("ok", 0.0030)],
            "far": [("ok", 0.0001), ("ok", 0.0001), ("ok", 0.0002)],
        },
        ping_idle=[0.0001] * 3,
        ping_load=[0.0003] * 3,
        counts={"near": {"200": 2, "429": 1}, "far": {"200": 3}},
        engine_peak={"near": 6, "far": 3},
        modes=["`{kvgnear:t:near}` near-limit"],
        call_buckets={"0.001": 1.0, "+Inf": 2.0},
        fcall=(20, 150.0),
        timeouts=3,
        degraded=2,
        quiet={
            "one": [("ok", 0.0005), ("ok", 0.0004), ("rejected", 0.0006)],
            "far": [("ok", 0.0001), ("ok", 0.0001), ("ok", 0.0001)],
        },
        ping_quiet=[0.00015] * 3,
        quiet_gap=0.01,
        iso=([0.0004, 0.0003, 0.0002], [0.0002] * 3, [0.0001] * 3, 90.0),
    )
    kills = [rb.KillTrial(429, 2.9, 3.1, 100, 4, 2, 4, None)]
    micro = rb.MicroResult(
        ns={label: [1000.0 * (i + 1)] for i, (label, *_) in enumerate(rb.ORDERS)},
        missed=0,
        kicks=0,
        bytes_per_tenant=2000.0,
        ops=100,
        core_ns={label: [100.0 * (i + 1)] for i, (label, *_) in enumerate(rb.ORDERS)},
    )
    return rounds, near, kills, micro


def test_summary_and_verdicts() -> None:
    s = rb.summarize(*results())
    assert s["ratio_per_replica"] == pytest.approx(0.94)
    assert s["cpu_ratio_per_replica"] == pytest.approx(400.0 / 416.0)
    assert s["ratio_3_vs_1"] == pytest.approx(0.9)
    assert s["cpu_ratio_3_vs_1"] == pytest.approx(400.0 / 421.0)
    assert s["calls_per_admission"] == pytest.approx(20 / 1800)
    assert s["added_p50"] == pytest.approx(0.0012 - 0.0001)
    assert s["kill_full_s"] == 3.1
    rows = {r[0]: r for r in rb.target_rows(s)}
    # per replica: the driven one of three on Redis against the local one, each alone on a core
    thr = next(r for k, r in rows.items() if k.startswith("throughput per replica"))
    assert (thr[1], thr[3]) == ("94.0%", "**not met**")
    cpu = next(r for k, r in rows.items() if k.startswith("the same from CPU per request (µs"))
    assert (cpu[1], cpu[3]) == ("96.2%", "met")
    # per core: the three sharing one core against the local one
    core = next(r for k, r in rows.items() if k.startswith("throughput per core"))
    assert (core[1], core[3]) == ("90.0%", "**not met**")
    cpu = next(r for k, r in rows.items() if k.startswith("the same from CPU per request on"))
    assert (cpu[1], cpu[3]) == ("95.0%", "met")
    calls = next(r for k, r in rows.items() if k.startswith("Redis calls per admission"))
    assert (calls[1], calls[3]) == ("0.0111", "met")
    p50 = next(r for k, r in rows.items() if "latency p50" in k)
    # 1.1 ms added against one round trip (0.3 ms under load) + 0.2 ms
    assert (p50[1], p50[3]) == ("1.100 ms", "**not met**")
    assert p50[2].startswith("≤ 0.500 ms")
    quiet = next(r for k, r in rows.items() if "nothing else: p50" in k)
    # 0.4 ms added against one round trip at the same pace (0.15 ms, not the idle 0.1) + 0.2 ms
    assert (quiet[1], quiet[3]) == ("0.400 ms", "**not met**")
    assert quiet[2] == "≤ 0.350 ms (PING p50 at the same pace 0.150 + 0.2)"
    iso = next(r for k, r in rows.items() if k.startswith("the store alone"))
    # against the PINGs at the decisions' pace (0.2 ms), not the back-to-back ones (0.1 ms)
    assert (iso[1], iso[3]) == ("0.300 / 0.400 ms", "met")
    assert iso[2].startswith(
        "≤ 0.400 ms (PING p50 on the store's connection at the same pace 0.200 + 0.2)"
    )
    kill = next(r for k, r in rows.items() if k.startswith("kill -9"))
    assert (kill[1], kill[3]) == ("3.10 s", "met")
    micro = [r for k, r in rows.items() if k.startswith("store try_admit")]
    assert micro[0][1:] == ("2.00×", "≤ 1.10×", "**not met**")
    assert micro[1][1:] == ("3.00×", "≤ 1.10×", "**not met**")  # in turn
    assert micro[2][3] == ""  # the control (10 of them used) carries no verdict
    # the local store on the same order at random, beside the verdict, with none of its own
    core = next(r for k, r in rows.items() if k.startswith("the local store"))
    assert core[1:] == ("2.00×", "–", "")


def test_a_window_with_refusals_invalidates_the_throughput_verdict() -> None:
    rounds = results()[0]
    rounds[0][3].non_2xx = 5  # a replica refused: its answers are no throughput
    rows = rb.target_rows(rb.summarize(rounds, None, None, None))
    assert [r[3] for r in rows[:4]] == ["**invalid**: 1 windows with errors"] * 4


def test_render_and_write_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = rb.render(args(), *results(), "Machine: test.", 12.0)
    assert text.startswith(rb.SECTION + "\n\n`make bench-replicas` (`benches/replicas/run.py`)")
    assert "| local ×1 | 1,000 | 1,000 | 400 |" in text
    assert "| redis ×3 | 900 | 300 | 421 |" in text
    assert f"| {rb.ONE_OF_3} | 940 | 940 | 416 |" in text
    assert "| 1 | 429 | 2.90 s | 3.10 s | 100 | 4 | 4 / reaped | 2 |" in text
    assert "150 µs per call (20 calls)" in text
    assert "3 store calls passed `deadline_ms` (25 ms) and 2 admissions" in text
    assert "| one | 3 | 2 | 0.500 | 0.600 |" in text
    assert "3 decisions in Redis, p50 0.300 ms / p99 0.400 ms" in text
    # the reading paragraph quotes this run's spread and ratios
    assert "varied between rounds (local ×1 1,000–1,000, local ×3 990–990" in text
    assert "a pair cost 4.00× the 10-tenant pair" in text
    assert "spread over all 100,000 at random 2.00×" in text
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Benchmark results\n\n## Other\n\nkept\n\n## Later\n\nalso kept\n")
    monkeypatch.setattr(rb, "RESULTS", results_md)
    rb.write_section(text)
    rb.write_section(text.replace("150 µs", "151 µs"))
    out = results_md.read_text()
    assert out.count(rb.SECTION) == 1
    assert "151 µs per call" in out
    assert "150 µs per call" not in out
    assert out.startswith("# Benchmark results\n\n## Other\n\nkept\n")
    assert "## Later\n\nalso kept\n" in out
    # a subsection recorded by hand under the run's figures stays through the next run
    assert out.rstrip("\n").endswith("2,000 bytes.")  # the section is the last one
    results_md.write_text(out + "\n### By hand\n\nother runs\n\n## After\n\nlast\n")
    rb.write_section(text.replace("150 µs", "152 µs"))
    out = results_md.read_text()
    assert "152 µs per call" in out
    assert "151 µs per call" not in out
    assert out.endswith("2,000 bytes.\n\n### By hand\n\nother runs\n\n## After\n\nlast\n")
    assert out.count("### By hand") == 1


def test_store_alone_decides_every_admission_in_redis(tmp_path: Path) -> None:
    from tests.store.redis_servers import require_redis, start_redis

    require_redis()
    with start_redis(tmp_path / "redis") as server:
        decisions, paced, pings, fcall_us = asyncio.run(rb.store_decisions(server.url, 20))
        # every admission of the two stores went to Redis (none was local) and was answered
        assert len(decisions) == 20
        assert len(paced) == len(pings) == 20
        assert fcall_us is not None
        assert fcall_us > 0
        # each store released what it took: nothing is left allocated in Redis
        fields = server.client().hgetall("{kvgiso:t:one}")
        assert int(fields.get(b"alloc|conc", 0)) == 0, fields


def test_the_sequential_client_bench_runs_and_counts_every_answer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """benches/replicas/sequential.py end to end for two seconds (its own redis-server, the
    simulator, three gateways): it prints every answer by status and the refusal rate."""
    seq = load("replicas_sequential", "benches/replicas/sequential.py")
    assert seq.main(["--seconds", "2", "--clients", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out.startswith("3 replicas, 2 clients, "), out
    total = int(out.split(", ", 2)[2].split(" requests", 1)[0])
    ok = int(out.split("200: ", 1)[1].split(",", 1)[0].split(";", 1)[0])
    assert total >= 10, out
    assert ok >= 10, out
    assert "refused per thousand: " in out


def test_throughput_per_replica_pairs_the_windows_of_each_round() -> None:
    # the machine ran twice as fast in round 2: each round's own ratio (1.1, then 0.9) counts,
    # not the ratio of the medians (1,450 ÷ 1,500)
    rounds = results()[0]
    fast = [window(w.setup, w.replicas, w.rps * 2, w.gateway_cpu_us / 2, w.store_calls)
            for w in rounds[0]]  # fmt: skip
    by = {w.setup: w for w in rounds[0]} | {"fast " + w.setup: w for w in fast}
    by[rb.ONE_OF_3].rps, by["fast " + rb.ONE_OF_3].rps = 1100.0, 1800.0
    s = rb.summarize([rounds[0], fast], None, None, None)
    assert s["ratio_per_replica"] == pytest.approx(1.0)
    assert s["rps"][rb.ONE_OF_3] / s["rps"]["local ×1"] == pytest.approx(1450 / 1500)
