"""Fixtures for the shared-store tests: real ``redis-server`` processes on 127.0.0.1 (see
:mod:`tests.store.redis_servers`). Each fixture skips when ``redis-server`` is missing, except
under CI (``CI`` set), where it fails."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.store.redis_servers import (
    RedisClusterServers,
    RedisServer,
    require_redis,
    start_cluster,
    start_redis,
    start_replica_pair,
)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A standalone server for one test (no persistence), stopped after it."""
    require_redis()
    with start_redis(tmp_path / "redis") as server:
        yield server


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    """A 3-node cluster shared by the tests of a module (keys persist between them: use
    distinct keys per test), stopped after the module."""
    require_redis()
    with start_cluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture
def redis_replica_pair(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    """``(primary, replica)`` for one test, the replica past its first sync; both stopped
    after it (:func:`tests.store.redis_servers.promote` fails over)."""
    require_redis()
    with start_replica_pair(tmp_path / "pair") as pair:
        yield pair
