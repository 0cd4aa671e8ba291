"""The store agent against a real ``redis-server``: scale proposals shared across replicas, and
``kvgate check-config`` checking the server."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from tests.store.redis_servers import RedisServer

from kvgate import AdmissionController
from kvgate.__main__ import main
from kvgate.config import StoreConfig
from kvgate.store.redis_store import RedisStore

ROOT = Path(__file__).resolve().parents[2]


class Named:
    def __init__(self, id: int, name: str) -> None:
        self.id, self.name = id, name


def core() -> tuple[Any, Named, Named]:
    ctl = AdmissionController(backends=1, tenants=1)
    b = ctl.add_backend("b", max_concurrency=8, tokens_per_minute=2**40)
    t = ctl.add_tenant("t", priority="standard", max_concurrency=4)
    return ctl, Named(b, "b"), Named(t, "t")


async def synced(store: RedisStore, backend: str, timeout: float = 10.0) -> None:
    """Heartbeats until Redis answered for the backend's scope since this call."""
    sc = store._scope("b", backend)
    seq = sc.seq
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while sc.seq <= seq or sc.busy or sc.epoch is None:
        store.tick()
        await asyncio.sleep(0.02)
        assert loop.time() < give_up, "no reply from Redis"


async def test_the_lowest_live_proposal_is_in_force_and_shedding_is_shared(
    redis_server: RedisServer,
) -> None:
    ctl, _backend, _tenant = core()
    cfg = StoreConfig(url=redis_server.url, heartbeat_s=0.1, background_deadline_ms=2000)
    seen: list[tuple[str, float, bool]] = []
    one = RedisStore(cfg, ctl)
    two = RedisStore(cfg, ctl, on_effective=lambda *a: seen.append(a))
    await one.start()
    await two.start()
    try:
        assert one.propose("b", 0.5, True) == (0.5, True)  # its own, before Redis answered
        await synced(one, "b")
        assert two.propose("b", 1.0, False) == (1.0, False)
        await synced(two, "b")
        # two sees one's proposal: the lowest scale, and shedding because one sheds
        assert two.effective("b") == (0.5, True)
        assert seen[-1] == ("b", 0.5, True)
        # one leaves cleanly: its proposal goes with it
        await one.close()
        await synced(two, "b")
        assert two.effective("b") == (1.0, False)
    finally:
        await two.close()


def test_check_config_reports_the_server_and_warns_on_eviction(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        (ROOT / "examples" / "replicas.yaml")
        .read_text()
        .replace("${KVGATE_REDIS_URL:-redis://127.0.0.1:6379/0}", redis_server.url)
    )
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr()
    assert "store: Redis 7." in out.out
    assert "maxmemory-policy" not in out.err
    redis_server.cli("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
    assert main(["check-config", str(path)]) == 0
    err = capsys.readouterr().err
    assert "warning: store: maxmemory-policy is 'allkeys-lru'" in err


def test_check_config_against_a_cluster(
    redis_cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    text = (ROOT / "examples" / "replicas.yaml").read_text()
    text = text.replace("${KVGATE_REDIS_URL:-redis://127.0.0.1:6379/0}", redis_cluster.url)
    path.write_text(text.replace("  deadline_ms: 25", "  cluster: true\n  deadline_ms: 25"))
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr()
    assert "store: Redis 7." in out.out, out
    assert "Redis Cluster" in out.out
