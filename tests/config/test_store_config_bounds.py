"""Absurd ``store`` settings get a clear configuration error from ``kvgate check-config`` and
``kvgate serve`` (never a traceback, never a gateway that starts and breaks its limits)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.__main__ import main
from kvgate.config import ConfigError, parse_config


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


@pytest.mark.parametrize(
    ("store", "where", "words"),
    [
        ({"url": "redis://127.0.0.1:abc/0"}, "store.url", "port"),
        ({"url": "redis://127.0.0.1:99999/0"}, "store.url", "port"),
        ({"url": "redis://127.0.0.1:6379/zero"}, "store.url", "database"),
        ({"url": "redis://u:s3cret@127.0.0.1:70000/0"}, "store.url", "port"),
        # the query's arguments, read as the Redis client reads them (a traceback at start)
        ({"url": "redis://u:s3cret@127.0.0.1:6379/0?db=abc"}, "store.url", "'db'"),
        ({"url": "redis://127.0.0.1:6379/0?socket_timeout=abc"}, "store.url", "socket_timeout"),
        ({"url": "unix:///run/redis.sock?db=x"}, "store.url", "'db'"),
        ({"url": "redis://127.0.0.1:6379/0?foo=1&socket_timeout=2"}, "store.url", "foo"),
        # a replica silent for less than two heartbeats would be reaped while alive: the
        # others would take its quotas while its requests still run
        ({"url": "redis://h/0", "heartbeat_s": 2, "lease_ttl_s": 0.5}, "store.lease_ttl_s", "2"),
        ({"url": "redis://h/0", "heartbeat_s": 1, "lease_ttl_s": 1.5}, "store.lease_ttl_s", "2"),
    ],
)
def test_absurd_store_settings_are_named(store: dict[str, Any], where: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(cfg_with(store))
    text = str(err.value)
    assert where in text, text
    assert words in text, text
    assert "s3cret" not in text


def test_sane_lease_and_urls_still_load() -> None:
    for store in (
        {"url": "redis://h/0", "heartbeat_s": 1, "lease_ttl_s": 2},
        {"url": "redis://h:6379"},
        {"url": "redis://h:6379/"},
        {"url": "rediss://u:p@h:6380/3"},
        {"url": "unix:///run/redis.sock"},
        {"url": "redis://h:6379/0?protocol=3&socket_timeout=2&client_name=gw&max_connections=4"},
        {
            "url": "rediss://h:6380/0?ssl_cert_reqs=none&ssl_ca_certs=/x.pem&ssl_check_hostname=false"
        },
    ):
        assert parse_config(cfg_with(store)).store is not None, store


def test_check_config_and_serve_name_a_bad_port_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg_with({"url": "redis://127.0.0.1:abc/0"})))
    assert main(["check-config", str(path)]) != 0
    err = capsys.readouterr().err
    assert "store.url" in err, err
    assert "Traceback" not in err, err
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", "serve", "--config", str(path), "--port", "0"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done
    assert b"store.url" in done.stderr, done.stderr
    assert b"Traceback" not in done.stderr, done.stderr
