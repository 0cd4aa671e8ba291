"""The Prometheus alert rules (deploy/prometheus/kvgate-alerts.yml) pass ``promtool check
rules`` (Debian's ``prometheus`` package; .ci/run installs it), and the Grafana dashboard is
well-formed. That their metric and label names exist on a real gateway's /metrics is
tests/gateway/test_dashboard_metrics.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from .recipe import ROOT

ALERTS = ROOT / "deploy" / "prometheus" / "kvgate-alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvgate-dashboard.json"
REQUIRED_ALERTS = {
    "KvgateKVCacheNearHighWatermark",
    "KvgateEngineMetricsStale",
    "KvgateSustainedShedding",
    "KvgateReservationLeak",
    "KvgateRefusalRatioHigh",
    "KvgateCriticalTTFTHigh",
    "KvgateStoreDegraded",
}


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: apt-get install prometheus (as .ci/run does)")
    return path


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_promtool(), "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_promtool_accepts_the_alert_rules() -> None:
    done = _check(ALERTS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(REQUIRED_ALERTS)} rules found" in done.stdout


def test_promtool_refuses_a_broken_expression(tmp_path: Path) -> None:
    data = yaml.safe_load(ALERTS.read_text())
    data["groups"][0]["rules"][0]["expr"] = "max by (backend (kvgate_backend_kv_usage)"
    broken = tmp_path / "broken.yml"
    broken.write_text(yaml.safe_dump(data))
    assert _check(broken).returncode != 0


def test_every_alert_is_there_with_severity_and_summary() -> None:
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == REQUIRED_ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["description"]


def test_the_dashboard_has_a_panel_per_required_view() -> None:
    data = json.loads(DASHBOARD.read_text())
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in data["panels"]}
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids))
    for metric in (
        "kvgate_backend_kv_usage",
        "kvgate_concurrency_limit",
        "kvgate_scale",
        "kvgate_slots_in_use",
        "kvgate_inflight_tokens",
        "kvgate_queue_depth",
        "kvgate_rejections_total",
        "kvgate_upstream_ttft_seconds_bucket",
        "kvgate_tenant_usage_tokens_total",
        "kvgate_tenant_requests_total",
    ):
        assert any(metric in e for e in exprs.values()), metric
    for panel in data["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
