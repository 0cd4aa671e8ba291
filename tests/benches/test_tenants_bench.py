"""benches/tenants/run.py: its gateway configurations and the RESULTS.md section, on fixed
inputs (the run itself is reported, not tested)."""

from __future__ import annotations

import argparse

import pytest
from benchmod import load

from kvgate.config import parse_config

tb = load("tenants_run", "benches/tenants/run.py")


@pytest.mark.parametrize("n", [10, 1_500])
def test_configs_hold_n_tenants_each_with_its_key_and_differ_only_by_the_store(n: int) -> None:
    local = tb.config("http://127.0.0.1:9", 8081, n, None)
    shared = tb.config("http://127.0.0.1:9", 8081, n, {"url": "redis://127.0.0.1:1/0"})
    cfg = parse_config(local)
    assert [t.name for t in cfg.tenants] == [f"t{i}" for i in range(n)]
    assert cfg.tenants[-1].api_key_sha256 == [tb.sha(f"sk-t{n - 1}")]
    assert cfg.store is None
    assert parse_config(shared).store is not None
    assert {k: v for k, v in shared.items() if k != "store"} == local


def _setup(store: str, n: int, cpu: list[float]) -> object:
    s = tb.Setup(f"{store} {n}", n, store, tb.Server("x", [], 1))
    s.windows = [
        {
            "rps": 1000.0,
            "non_2xx": 0,
            "socket_errors": 0,
            "cpu_us": c,
            "redis_us": c / 10,
            "calls_per_admission": 0.5,
            "p50_ms": 1.0,
        }
        for c in cpu
    ]
    s.after = {"rss_mb": 100.0, "metrics_s": 0.01, "metrics_kb": 20.0, "dashboard_s": 0.02,
               "dashboard_kb": 3.0, "state_s": 0.005, "state_kb": 250.0,
               "tenants_seen": 9_000.0}  # fmt: skip
    return s


def test_the_section_reports_each_store_against_its_own_ten_tenant_gateway() -> None:
    setups = [
        _setup("local", 10, [200, 220]),
        _setup("local", 100_000, [240, 260]),
        _setup("redis", 10, [300, 300]),
        _setup("redis", 100_000, [330, 330]),
    ]
    args = argparse.Namespace(rounds=2, duration=3, connections=32, cmdline=None)
    text = tb.render(setups, {"json": (2.0, 150.0), "yaml": (13.0, 500.0)}, "Machine: m.", args, 99)
    assert text.startswith(tb.SECTION + "\n")
    assert "| local | 100,000 | 1,000 | 250 | – | 1.190× | – | 1.00 | 0 |" in text
    assert "| redis | 100,000 | 1,000 | 330 | 33 | 1.100× | 0.5000 | 1.00 | 0 |" in text
    assert "| redis | 10 | 9,000 | 100 | 0.010 / 20.0 | 0.020 / 3.0 | 0.005 / 250.0 |" in text
    assert "as JSON 2.0 s and 150 MB of peak memory growth, as YAML 13.0 s and 500 MB" in text
    assert text.count("\n| 2 | ") == 4
    assert "| 2 | redis | 100,000 | 1,000 | 330 | 0.5000 | 0 |" in text
    assert "— local store 1.19×: **not met**; redis store 1.10×: met." in text


def test_reuse_scan_sets_up_a_full_core_and_ends_with_a_refusal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """benches/tenants/reuse_scan.py: every id taken or removed and no guarantee entry free
    before it times the adds, and the add that no removed id covers is refused."""
    load("tenants_reuse_scan", "benches/tenants/reuse_scan.py").main()
    out = capsys.readouterr().out
    assert "200,000 ids (200,000 used, 100,000 reusable)" in out
    assert "(0 free)" in out
    assert "(refused)" in out


def test_the_collector_section_sets_each_threshold_against_its_own_ten_tenant_gateway() -> None:
    """benches/tenants/gc_threshold.py: the section starts with its heading (what
    ``write_section`` needs), one row per setup, and the 100,000 ÷ 10 ratio per store and
    thresholds."""
    gc = load("tenants_gc", "benches/tenants/gc_threshold.py")
    setups = []
    for store, base in (("local", 250.0), ("redis", 280.0)):
        for n in (10, 100_000):
            for th, extra in ((gc.PYTHON_DEFAULT, 30.0), (gc.KVGATE, 0.0)):
                cpu = base + extra + (base if store == "redis" and n == 100_000 else 0)
                s = gc.Setup(f"{store}-{n}", store, n, th, tb.Server("x", [], 1), None)
                s.windows = [
                    {
                        "rps": 3000.0,
                        "cpu_us": cpu,
                        "gc_us": extra / 2,
                        "collections": 400.0,
                        "p50_ms": 8.0,
                        "p99_ms": 20.0,
                        "non_2xx": 0,
                    }
                    for _ in range(3)
                ]
                setups.append(s)
    args = argparse.Namespace(rounds=3, duration=4.0, connections=32, local=True)
    text = gc.render(setups, args, "Machine: m.", 140)
    assert text.startswith(gc.SECTION + "\n\n")
    assert "| redis | 100,000 | 700, 10, 10 | 3,000 | 590 | 15.0 | 100 | 8.00 | 20.00 | 0 |" in text
    assert (
        "| redis | 100,000 | 10,000, 10, 10 | 3,000 | 560 | 0.0 | 100 | 8.00 | 20.00 | 0 |" in text
    )
    assert "| local | 1.00× | 1.00× |" in text
    assert "| redis | 1.90× | 2.00× |" in text  # 590 ÷ 310, 560 ÷ 280
