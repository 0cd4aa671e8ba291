"""The C heap's free pages go back to the operating system (:mod:`kvgate.memtrim`): a freed
heap pinned by a few live allocations shrinks only when trimmed, and a running gateway trims
on its own every ``TRIM_SECONDS`` (until it stops)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvgate import memtrim
from kvgate.config import Config
from kvgate.gateway_build import build_gateway
from kvgate.server import run_gateway

from .fake_upstream import run_upstream
from .helpers import until

needs_glibc = pytest.mark.skipif(not memtrim.AVAILABLE, reason="no malloc_trim (not glibc)")


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@needs_glibc
def test_trimming_gives_a_pinned_heaps_free_pages_back() -> None:
    # 128 MiB in 1 KiB objects (past pymalloc's 512 bytes: from the C heap), one in 64 kept:
    # freeing the rest leaves 63 KiB holes between live objects, which glibc keeps on its own
    blocks = [bytes(1024) for _ in range(128 * 1024)]
    kept = blocks[::64]
    del blocks
    held = rss_kib()
    assert memtrim.trim_heap()
    trimmed = rss_kib()
    assert held - trimmed > 64 * 1024, f"RSS {held} -> {trimmed} KiB"
    assert len(kept) == 2048  # still alive (they pinned the heap)


async def test_a_running_gateway_trims_its_heap_every_period(monkeypatch: Any) -> None:
    calls: list[float] = []
    monkeypatch.setattr(memtrim, "AVAILABLE", True)
    monkeypatch.setattr(memtrim, "TRIM_SECONDS", 0.05)
    monkeypatch.setattr(memtrim, "trim_heap", lambda: calls.append(1) or True)
    async with run_upstream() as up:
        cfg = {
            "backends": [
                {
                    "name": "b0",
                    "url": up.url,
                    "models": [{"name": "replay", "context_window": 1024}],
                    "adaptive": {"enabled": False},
                }
            ]
        }
        gateway = build_gateway(Config.model_validate(cfg), poll=False)
        async with run_gateway(gateway):
            await until(lambda: len(calls) >= 3, timeout=30)
            assert trimmers() == 1
        # the trimmer ended with the gateway
        assert trimmers() == 0


def trimmers() -> int:
    return sum("trim_forever" in repr(t.get_coro()) for t in asyncio.all_tasks() if not t.done())
