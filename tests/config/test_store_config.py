"""The ``store`` section: validation, the example, and check-config against an unreachable
server (tests/store/ checks it against a real redis-server)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from kvgate.__main__ import main
from kvgate.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "replicas.yaml"


def cfg_with(store: dict[str, Any]) -> dict[str, Any]:
    return {
        "backends": [
            {
                "name": "a",
                "url": "http://127.0.0.1:8000",
                "models": [{"name": "m", "context_window": 4096}],
                "max_concurrency": 10,
            }
        ],
        "store": store,
    }


def test_example_loads_with_its_defaults() -> None:
    cfg = load_config(EXAMPLE, env={})
    assert cfg.store is not None
    assert cfg.store.url == "redis://127.0.0.1:6379/0"
    assert cfg.store.ttl_s == 3.0  # three heartbeats
    assert cfg.store.policy("tenant-tpm") == "strict"
    assert cfg.store.policy("backend-slots") == "share"


def test_defaults_are_those_the_readme_states() -> None:
    st = parse_config(cfg_with({"url": "redis://h:1/0"})).store
    assert st is not None
    assert (st.deadline_ms, st.heartbeat_s, st.ttl_s, st.on_failure) == (25.0, 1.0, 3.0, "share")
    assert (st.max_degraded_s, st.after_degraded, st.breaker_failures) == (60.0, "closed", 3)
    assert st.cluster is False


@pytest.mark.parametrize(
    ("store", "where", "words"),
    [
        ({"url": "http://h:1"}, "store.url", "redis://"),
        ({"url": "h:6379"}, "store.url", "redis://"),
        (
            {"url": "redis://h/0", "policies": {"tenant-rpm": "strict"}},
            "store.policies",
            "unknown limit",
        ),
        ({"url": "redis://h/0", "on_failure": "sometimes"}, "store.on_failure", "share"),
        ({"url": "redis://h/0", "heartbeat_s": 0}, "store.heartbeat_s", "0.05"),
        ({"url": "redis://h/0", "deadline_ms": -1}, "store.deadline_ms", "0"),
        ({"url": "redis://h/0", "near_fraction": 1}, "store.near_fraction", "1"),
        ({"url": "redis://h/0", "pool": 3}, "store.pool", "unknown field"),
        (
            {"url": "redis://m/0", "sentinel": {"master": "m", "nodes": ["h:x"]}},
            "store.sentinel.nodes",
            "port must be a number",
        ),
        (
            {"url": "redis://m/0", "sentinel": {"master": "m", "nodes": ["h:1/0"]}},
            "store.sentinel.nodes",
            "host:port",
        ),
        (
            {"url": "redis://m/0", "sentinel": {"master": "m", "nodes": []}},
            "store.sentinel.nodes",
            "at least 1",
        ),
        *(
            (
                {"url": "redis://m/0", "sentinel": {"master": "m", "nodes": [node]}},
                "store.sentinel.nodes",
                "host:port",
            )
            for node in (
                "ho st:26379",
                "host#frag",
                "@host",
                "host:",
                "h?x",
                "host\n:1",
                "host%20:1",
                "[10.0.0.5]:26379",
            )
        ),
        (
            {"url": "redis://m/0", "sentinel": {"master": "m", "nodes": ["h", "h:26379"]}},
            "store.sentinel.nodes",
            "listed twice",
        ),
        (
            {"url": "redis://m/0", "sentinel": {"nodes": ["h"]}},
            "store.sentinel.master",
            "is required",
        ),
        (
            {"url": "redis://m/0", "cluster": True, "sentinel": {"master": "m", "nodes": ["h"]}},
            "store",
            "a Redis Cluster has no sentinels",
        ),
        (
            {"url": "rediss://m/0", "sentinel": {"master": "m", "nodes": ["h"]}},
            "store",
            "redis:// only",
        ),
    ],
)
def test_bad_store_settings_are_named(store: dict[str, Any], where: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(cfg_with(store))
    text = str(err.value)
    assert where in text, text
    assert words in text, text


def test_a_password_in_a_sentinel_address_is_never_shown() -> None:
    sentinel = {"master": "m", "nodes": ["admin:S3CRET@10.0.0.5:26379"]}
    with pytest.raises(ConfigError) as err:
        parse_config(cfg_with({"url": "redis://m/0", "sentinel": sentinel}))
    assert "store.sentinel.nodes" in str(err.value)
    assert "10.0.0.5:26379" in str(err.value)
    assert "S3CRET" not in str(err.value)


def test_sentinel_addresses_and_their_default_port() -> None:
    sentinel = {
        "master": "mymaster",
        "nodes": ["10.0.0.5:26380", "sentinel-b", "[::1]:5000", "[fe80::1%eth0]"],
    }
    st = parse_config(cfg_with({"url": "redis://:pw@mymaster/0", "sentinel": sentinel})).store
    assert st is not None
    assert st.sentinel is not None
    assert st.sentinel.addresses() == [
        ("10.0.0.5", 26380),
        ("sentinel-b", 26379),
        ("::1", 5000),
        ("fe80::1%eth0", 26379),
    ]


def test_the_password_never_shows_in_the_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(cfg_with({"url": "http://user:s3cret@h:1"}))
    assert "s3cret" not in str(err.value)


def test_check_config_refuses_an_unreachable_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "c.yaml"
    path.write_text(
        EXAMPLE.read_text().replace(
            "${KVGATE_REDIS_URL:-redis://127.0.0.1:6379/0}", f"redis://127.0.0.1:{port}/0"
        )
    )
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"store.url: cannot reach Redis at redis://127.0.0.1:{port}/0" in err


def test_prefill_budget_and_latency_targets_are_validated() -> None:
    cfg = cfg_with({"url": "redis://h/0"})
    del cfg["store"]
    cfg["backends"][0]["prefill_token_budget"] = 0
    cfg["slo"] = {"critical": {"ttft_p99_s": 1.5}, "standard": {"tpot_p99_s": 0.2}}
    parsed = parse_config(cfg)
    assert parsed.backends[0].prefill_token_budget == 0
    assert parsed.slo is not None
    assert parsed.slo.critical is not None
    assert parsed.slo.critical.ttft_p99_s == 1.5
    assert parsed.slo.window_s == 10.0
    for bad, where in (
        ({"critical": {"ttft_p99_s": 0}}, "slo.critical.ttft_p99_s"),
        ({"gold": {"ttft_p99_s": 1}}, "slo.gold"),
        ({"critical": {"ttft_p99": 1}}, "slo.critical.ttft_p99"),
    ):
        cfg["slo"] = bad
        with pytest.raises(ConfigError) as err:
            parse_config(cfg)
        assert where in str(err.value)
    cfg["slo"] = None
    cfg["backends"][0]["prefill_token_budget"] = -1
    with pytest.raises(ConfigError) as err:
        parse_config(cfg)
    assert "backends[0].prefill_token_budget" in str(err.value)
