"""Latency targets through a real gateway: a critical class missing its TTFT target caps the
standard class's concurrency (503 ``slo-limit``), visible in /admin/state and the metrics."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from tests.gateway.test_prefill_gate import chat
from tests.store.replicas import run_replicas

SIM = ("--profile", "tiny", "--speed", "1")


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


CONFIG: dict[str, Any] = {
    "backends": [
        {
            "name": "sim",
            "models": [{"name": "kvgate-sim-tiny", "context_window": 1024}],
            "max_concurrency": 16,
            "adaptive": {"enabled": False},
        }
    ],
    "tenants": [
        {"name": "std", "api_key_sha256": [sha("k-std")], "priority": "standard"},
        {"name": "crit", "api_key_sha256": [sha("k-crit")], "priority": "critical"},
    ],
    # a target no engine meets: every critical request misses it
    "slo": {"critical": {"ttft_p99_s": 0.0001}, "interval_s": 0.1, "min_samples": 3},
    "access_log": {"enabled": False},
}


async def test_a_missed_critical_target_caps_the_standard_class() -> None:
    async with run_replicas(CONFIG, n=1, sim_args=SIM) as reps:
        url = reps.url(0)
        long = [asyncio.create_task(chat(url, "k-std", 10, max_tokens=300)) for _ in range(3)]
        for _ in range(3):  # three critical requests, each over the target
            status, reason, _ = await chat(url, "k-crit", 5)
            assert status == 200, reason

        async def capped() -> bool:
            state = (await reps.admin_state(0))["slo"]["sim"]["standard"]
            return state["cap"] is not None

        for _ in range(300):
            if await capped():
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("standard never capped")
        state = (await reps.admin_state(0))["slo"]["sim"]
        assert state["standard"]["bound_by"] == "critical-ttft"
        assert state["standard"]["cap"] <= 2  # from 3 running, × 0.8
        assert state["critical"]["cap"] is None
        assert state["critical"]["ttft_p99_s"] > 0.0001
        status, reason, _ = await chat(url, "k-std", 10)
        assert (status, reason) == (503, "slo-limit")
        status, reason, _ = await chat(url, "k-crit", 5)  # critical is never capped
        assert status == 200, reason
        text = await reps.metrics(0)
        assert 'kvgate_slo_class_limit{backend="sim",class="standard"}' in text
        for t in long:
            t.cancel()
