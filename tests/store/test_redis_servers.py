"""The Redis test helpers themselves: each kind of server starts, answers, fails and stops the
way the shared-store fault tests rely on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from tests.store.redis_servers import (
    RedisClusterServers,
    RedisServer,
    info,
    promote,
    require_redis,
    start_redis,
    wait_until,
)

PROBE = """#!lua name=probe
redis.register_function('probe_incr', function(keys, args)
  return redis.call('INCRBY', keys[1], args[1])
end)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_standalone_set_get_debug_and_cli(redis_server: RedisServer) -> None:
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    c = redis_server.client()
    assert c.set("k", "v")
    assert c.get("k") == "v"
    assert c.execute_command("DEBUG", "SLEEP", "0") == "OK"  # --enable-debug-command local
    assert redis_server.cli("GET", "k") == "v"
    assert redis_server.cli("CONFIG", "GET", "maxmemory-policy").splitlines() == [
        "maxmemory-policy",
        "noeviction",
    ]
    assert c.config_get("save") == {"save": ""}
    assert c.config_get("appendonly") == {"appendonly": "no"}
    with redis.Redis.from_url(redis_server.url, decode_responses=True) as by_url:
        assert by_url.get("k") == "v"


def test_function_load_on_standalone(redis_server: RedisServer) -> None:
    c = redis_server.client()
    assert c.function_load(PROBE, replace=True) == "probe"
    assert c.fcall("probe_incr", 1, "counter", 5) == 5
    assert c.fcall("probe_incr", 1, "counter", 2) == 7


def test_kill_then_restart_comes_back_empty_on_the_same_port(redis_server: RedisServer) -> None:
    c = redis_server.client()
    c.set("k", "v")
    port, pid = redis_server.port, redis_server.pid
    redis_server.kill()
    assert not alive(pid)
    assert not redis_server.running
    with (
        redis.Redis(port=port, retry=Retry(NoBackoff(), 0)) as gone,
        pytest.raises(redis.exceptions.ConnectionError),
    ):
        gone.ping()
    redis_server.restart()
    assert redis_server.port == port
    assert redis_server.pid != pid
    assert c.get("k") is None  # the pool reconnects; nothing persisted


def test_pause_hangs_clients_until_resume(redis_server: RedisServer) -> None:
    c = redis_server.client(socket_timeout=0.3)
    redis_server.pause()
    try:
        with pytest.raises(redis.exceptions.TimeoutError):
            c.ping()
    finally:
        redis_server.resume()
    assert redis_server.client().ping()


def test_stop_ends_the_process_even_when_paused(tmp_path: Path) -> None:
    require_redis()
    with start_redis(tmp_path) as server:
        pid = server.pid
        server.pause()
        server.stop(timeout=5.0)
        assert not alive(pid)
        assert server.proc is not None
        assert server.proc.returncode is not None


def test_appendonly_keeps_fsynced_writes_across_a_restart(tmp_path: Path) -> None:
    require_redis()
    with start_redis(tmp_path, appendonly=True) as server:
        assert server.cli("CONFIG", "GET", "appendfsync").splitlines() == [
            "appendfsync",
            "everysec",
        ]
        c = server.client()
        c.set("k", "v")
        c.execute_command("BGREWRITEAOF")  # written out now, not at the next fsync
        wait_until(
            lambda: (
                info(c, "persistence").get("aof_rewrite_in_progress") == "0"
                and info(c, "persistence").get("aof_rewrite_scheduled") == "0"
            ),
            10.0,
            "AOF rewrite done",
        )
        server.restart(keep_data=True)
        assert c.get("k") == "v"
        server.restart()  # default: the data directory is emptied first
        assert c.get("k") is None


def test_replica_pair_replicates_and_promote_makes_it_writable(
    redis_replica_pair: tuple[RedisServer, RedisServer],
) -> None:
    primary, replica = redis_replica_pair
    assert info(replica.client(), "replication")["master_link_status"] == "up"
    p, r = primary.client(), replica.client()
    p.set("k", "from-primary")
    p.execute_command("WAIT", 1, 5000)  # acknowledged by the replica
    assert r.get("k") == "from-primary"
    with pytest.raises(redis.exceptions.ReadOnlyError):
        r.set("k", "no")
    primary.kill()
    promote(replica)
    assert r.set("k", "after-failover")
    assert r.get("k") == "after-failover"
    assert info(r, "replication")["role"] == "master"


def test_cluster_serves_keys_on_every_node(redis_cluster: RedisClusterServers) -> None:
    assert len(redis_cluster.nodes) == 3
    assert redis_cluster.url == redis_cluster.nodes[0].url
    c = redis_cluster.client()
    tags = [f"{{tenant-{i}}}" for i in range(30)]
    for tag in tags:
        c.set(f"{tag}:slots", tag)
    assert all(c.get(f"{tag}:slots") == tag for tag in tags)
    # the keys landed on more than one node: the hash tags are really spread
    owners = {c.get_node_from_key(f"{tag}:slots").port for tag in tags}
    assert len(owners) > 1
    for node in redis_cluster.nodes:
        assert "cluster_state:ok" in node.cli("CLUSTER", "INFO")
    # a multi-key command inside one hash tag works
    c.mset({"{same}:a": "1", "{same}:b": "2"})
    assert c.mget("{same}:a", "{same}:b") == ["1", "2"]


def test_function_load_on_cluster(redis_cluster: RedisClusterServers) -> None:
    c = redis_cluster.client()
    # FUNCTION LOAD goes to every primary, so a function runs wherever its key lives
    c.function_load(PROBE, replace=True)
    for tag in ("{a}", "{b}", "{c}", "{d}"):
        assert c.fcall("probe_incr", 1, f"{tag}:n", 3) == 3
    for node in redis_cluster.nodes:
        assert "probe" in node.cli("FUNCTION", "LIST")


def test_cli_error_reply_and_dead_server_raise(redis_server: RedisServer) -> None:
    with pytest.raises(RuntimeError, match="unknown command"):
        redis_server.cli("NOSUCHCOMMAND")
    redis_server.kill()
    with pytest.raises(RuntimeError, match="Could not connect"):
        redis_server.cli("PING")


def test_missing_redis_skips_outside_ci_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        require_redis()
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception):
        require_redis()
