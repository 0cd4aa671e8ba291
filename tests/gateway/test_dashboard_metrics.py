"""Every metric and label the Grafana dashboard (deploy/grafana/) and the Prometheus alert rules
(deploy/prometheus/) query exists on a real gateway's ``GET /metrics``: a gateway in front of the
simulator serves some requests (one refused, so refusal series exist), then its exposition is
parsed with prometheus-client's parser and each PromQL expression's metric names and label names
are looked up in it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tests.store.redis_servers import require_redis, start_redis

from kvgate.config import StoreConfig
from kvgate.sim import SimConfig, run_sim

from .conftest import KEYS, config_for, sha
from .helpers import get_text, until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvgate-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "kvgate-alerts.yml"

_METRIC = re.compile(r"\b(kvgate_[a-z0-9_]+)\b")
# label names in `by (...)`, `without (...)`, `on (...)`, `ignoring (...)`, `group_left (...)`
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
# label names in selectors: `{name="v", other=~"..."}`
_SELECTOR = re.compile(r"\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")


def dashboard_expressions() -> list[str]:
    """Every ``expr`` of the dashboard's panels, and its template variables' queries."""
    data = json.loads(DASHBOARD.read_text())
    out = [t["expr"] for p in data["panels"] for t in p.get("targets", [])]
    for var in data["templating"]["list"]:
        if var["type"] == "query":
            out.append(var["definition"])
    return out


def rule_expressions() -> list[str]:
    data = yaml.safe_load(ALERTS.read_text())
    return [r["expr"] for g in data["groups"] for r in g["rules"]]


def used_names(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and label names a PromQL expression uses (Grafana's ``$var``s aside;
    ``label_values(m, label)`` names a label too)."""
    metrics = set(_METRIC.findall(expr))
    labels: set[str] = set()
    for group in _GROUPING.findall(expr):
        labels |= {name.strip() for name in group.split(",") if name.strip()}
    for selector in _SELECTOR.findall(expr):
        labels |= set(_MATCHER.findall(selector))
    for m in re.finditer(r"label_values\(\s*[a-z0-9_]+\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)", expr):
        labels.add(m.group(1))
    return metrics, labels


def exported(text: str) -> dict[str, set[str]]:
    """``{sample name: label names}`` of an exposition, with each histogram's and counter's
    family name too (``_bucket`` / ``_sum`` / ``_count`` / ``_total`` resolve to the family)."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            for name in (s.name, family.name):
                out.setdefault(name, set()).update(s.labels)
    return out


def test_the_expression_parser_finds_names_and_labels() -> None:
    metrics, labels = used_names(
        "sum by (backend, reason) (rate(kvgate_rejections_total[5m])) / on (backend) "
        'group_left sum by (backend) (rate(kvgate_requests_total{backend=~"$backend"}[5m]))'
        ' + histogram_quantile(0.9, kvgate_upstream_ttft_seconds_bucket{class="critical"})'
    )
    assert metrics == {
        "kvgate_rejections_total",
        "kvgate_requests_total",
        "kvgate_upstream_ttft_seconds_bucket",
    }
    assert labels == {"backend", "reason", "class"}


def _uses_store(expr: str) -> bool:
    """Whether ``expr`` reads a shared-store series (checked on a gateway with a store)."""
    return "kvgate_store_" in expr


def _missing(expressions: list[str], series: dict[str, set[str]]) -> list[str]:
    """What the expressions use that the exposition lacks (metric or label names)."""
    missing = []
    for expr in expressions:
        metrics, labels = used_names(expr)
        assert metrics, expr
        have: set[str] = set()
        for name in metrics:
            if name not in series:
                missing.append(f"metric {name} (in {expr!r})")
            else:
                have |= series[name]
        missing += [f"label {label} (in {expr!r})" for label in sorted(labels - have)]
    return missing


async def test_every_dashboard_and_alert_series_is_exported(gateway_for) -> None:
    expressions = [e for e in dashboard_expressions() + rule_expressions() if not _uses_store(e)]
    assert len(expressions) >= 15
    sim_cfg = SimConfig.from_profile("tiny", speed=50, seed=5, mean_output_tokens=4)
    async with run_sim(sim_cfg) as sim:
        model = sim.engine.config.model
        cfg = config_for(
            sim.url,
            [model],
            adaptive=True,  # KV usage, scale, shedding and staleness series
            tenants=[
                {"name": "alice", "api_key_sha256": [sha(KEYS["alice"])], "priority": "critical"},
                {
                    "name": "bob",
                    "api_key_sha256": [sha(KEYS["bob"])],
                    "tokens_per_minute": 50,
                    "burst_tokens": 50,
                },
            ],
        )
        async with gateway_for(cfg, poll=True) as gw:
            alice = openai.AsyncOpenAI(
                base_url=gw.url + "/v1", api_key=KEYS["alice"], max_retries=0
            )
            bob = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["bob"], max_retries=0)
            async with alice, bob:
                # refund and overrun series: a reservation far above the output, and small ones
                # that the engine's own prompt count overruns
                for max_tokens in (4, 4, 200):
                    answer = await alice.chat.completions.create(
                        model=model,
                        messages=[{"role": "user", "content": "hello"}],
                        max_tokens=max_tokens,
                    )
                    assert answer.usage is not None
                with pytest.raises(openai.RateLimitError):  # 100 tokens > bob's bucket (50)
                    await bob.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=100
                    )

            async def kv_read() -> bool:
                text = await get_text(gw.url + "/metrics")
                return "kvgate_backend_kv_usage{" in text

            await until(kv_read, timeout=30)
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                assert r.status == 200
                text = await r.text()
            # the controller holds nothing once the requests are done
            await until(lambda: gw.backend_state()["in_use"] == 0, timeout=10)

    series = exported(text)
    assert series["kvgate_rejections_total"] >= {"backend", "reason"}
    missing = _missing(expressions, series)
    assert not missing, "\n".join(missing)


async def test_the_store_alert_series_are_exported_by_a_gateway_with_a_store(
    gateway_for, tmp_path: Path
) -> None:
    """The rules on the shared store (the breaker) against a gateway whose ``store`` is a real
    ``redis-server`` on loopback (skipped without one, outside CI)."""
    expressions = [e for e in dashboard_expressions() + rule_expressions() if _uses_store(e)]
    assert expressions
    require_redis()
    sim_cfg = SimConfig.from_profile("tiny", speed=50, seed=5, mean_output_tokens=4)
    with start_redis(tmp_path / "redis") as redis:
        async with run_sim(sim_cfg) as sim:
            model = sim.engine.config.model
            cfg = config_for(sim.url, [model])
            cfg = cfg.model_copy(
                update={"store": StoreConfig(url=f"redis://127.0.0.1:{redis.port}/0")}
            )
            async with gateway_for(cfg) as gw:
                client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
                async with client:
                    await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
                    )
                text = await get_text(gw.url + "/metrics")
                await until(lambda: gw.backend_state()["in_use"] == 0, timeout=10)
    series = exported(text)
    assert "kvgate_store_mode" in series  # a store is configured: its scrape-time gauges exist
    missing = _missing(expressions, series)
    assert not missing, "\n".join(missing)
