"""``kvgate demo``: the gateway in front of the built-in engine simulator, with a short traffic mix.

It starts ``kvgate sim`` (profile ``l4-llama3-8b``: one 24 GB GPU, ~33k KV tokens) and
``kvgate serve`` in front of it as child processes on free loopback ports, then drives about 30 s
of mixed traffic through the gateway:

* ``chat`` — tenant ``support`` (critical, guaranteed slots): short streamed chat turns;
* ``docs`` — tenant ``analytics`` (standard): ~4k-token document analysis, and at t=10 s a burst
  of ten ~6k-token prompts arriving together;
* ``batch`` — tenant ``offline`` (sheddable): summaries of ~2k-token texts.

A live line shows progress each second (done, refused, the engine's KV-cache usage, the
gateway's adaptive scale); at the end a table gives per class: sent, done, refused by reason,
p50/p99 time to first token, and for the engine: peak KV usage, preemptions, OOMs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "free_port", "run", "stop_all", "wait_http"]

KEYS = {
    "support": "sk-demo-support",
    "analytics": "sk-demo-analytics",
    "offline": "sk-demo-offline",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvgate demo``."""
    parser.add_argument("--seconds", type=float, default=30.0, help="traffic duration (s)")
    parser.add_argument("--speed", type=float, default=4.0, help="simulator speed factor")
    parser.add_argument("--profile", default="l4-llama3-8b", help="simulator profile")
    parser.add_argument("--workers", type=int, default=1, help="gateway worker processes")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound and released; for child servers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(sim_url: str, model: str, context: int, port: int, workers: int) -> dict[str, Any]:
    def sha(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "workers": workers,
        "backends": [
            {
                "name": "sim",
                "url": sim_url,
                "engine": "vllm",
                "models": [{"name": model, "context_window": context}],
                "max_concurrency": 48,
                "tokens_per_minute": 3_000_000,
                "adaptive": {"enabled": True, "poll_interval": 0.5},
            }
        ],
        "tenants": [
            {
                "name": "support",
                "api_key_sha256": [sha(KEYS["support"])],
                "priority": "critical",
                "guaranteed_slots": 8,
                "max_wait_ms": 2000,
            },
            {
                "name": "analytics",
                "api_key_sha256": [sha(KEYS["analytics"])],
                "priority": "standard",
                "max_wait_ms": 5000,
            },
            {
                "name": "offline",
                "api_key_sha256": [sha(KEYS["offline"])],
                "priority": "sheddable",
                "max_wait_ms": 0,
            },
        ],
    }


def _mix(model: str, seconds: float) -> Any:
    from kvgate.loadgen import Burst, Stream, TrafficMix

    return TrafficMix(
        model=model,
        duration=seconds,
        seed=7,
        streams=(
            Stream("chat", KEYS["support"], rate=4.0, prompt_tokens=100, max_tokens=128),
            Stream("docs", KEYS["analytics"], rate=0.5, prompt_tokens=4000, max_tokens=512),
            Stream(
                "batch", KEYS["offline"], rate=2.0, prompt_tokens=2000, max_tokens=512, stream=False
            ),
        ),
        bursts=(
            Burst(
                "docs",
                KEYS["analytics"],
                at=min(10.0, seconds / 3),
                count=10,
                prompt_tokens=6000,
                max_tokens=1024,
            ),
        ),
    )


async def _scrape(session: Any, url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        async with session.get(url) as resp:
            text = await resp.text()
    except Exception:
        return out
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out[s.name] = out.get(s.name, 0.0) + s.value if "total" in s.name else s.value
    return out


def stop_all(procs: list[subprocess.Popen[bytes]], grace: float = 15.0) -> None:
    """Terminate child servers (newest first), wait up to ``grace`` seconds each, then kill."""
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=grace)
        if p.poll() is None:
            p.kill()


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Poll ``url`` until it answers (or ``proc`` exits / ``timeout`` seconds pass: RuntimeError)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was up")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up within {timeout:.0f} s")


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns 0 when it completed (whatever the traffic outcome)."""
    import yaml

    from kvgate.sim.profiles import get_profile

    profile = get_profile(args.profile)
    sim_port, gw_port = free_port(), free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    gw_url = f"http://127.0.0.1:{gw_port}"
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-demo-"))
    cfg_path = tmp / "kvgate.yaml"
    cfg_path.write_text(
        yaml.safe_dump(
            _config(sim_url, profile.model, profile.context_window, gw_port, args.workers)
        )
    )
    exe = [sys.executable, "-m", "kvgate"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    logs = contextlib.ExitStack()
    print(f"kvgate demo: simulator `{args.profile}` ({profile.summary})")
    try:
        sim = subprocess.Popen(
            [
                *exe,
                "sim",
                "--profile",
                args.profile,
                "--port",
                str(sim_port),
                "--speed",
                str(args.speed),
                "--seed",
                "7",
            ],
            env=env,
            stdout=(sim_log := logs.enter_context((tmp / "sim.log").open("wb"))),
            stderr=sim_log,
        )
        procs.append(sim)
        wait_http(sim_url + "/health", sim)
        gw = subprocess.Popen(
            [*exe, "serve", "--config", str(cfg_path), "--log-level", "INFO"],
            env=env,
            stdout=(gw_log := logs.enter_context((tmp / "gateway.log").open("wb"))),
            stderr=gw_log,
        )
        procs.append(gw)
        wait_http(gw_url + "/healthz", gw)
        print(
            f"kvgate demo: gateway {gw_url} → engine {sim_url}; "
            f"{args.seconds:.0f} s of traffic (logs in {tmp})"
        )
        stats, peak = asyncio.run(_drive(gw_url, sim_url, profile.model, args.seconds))
        engine = asyncio.run(_final_engine(sim_url))
        _report(stats, engine, peak)
        return 0
    finally:
        stop_all(procs)
        logs.close()


async def _drive(gw_url: str, sim_url: str, model: str, seconds: float) -> tuple[Any, float]:
    import aiohttp

    from kvgate.loadgen import drive

    peak = 0.0
    async with aiohttp.ClientSession() as session:

        async def tick(elapsed: float, stats: dict[str, Any]) -> None:
            nonlocal peak
            m = await _scrape(session, sim_url + "/metrics")
            g = await _scrape(session, gw_url + "/metrics")
            kv = m.get("vllm:kv_cache_usage_perc", 0.0)
            peak = max(peak, m.get("kvgate_sim_kv_cache_usage_peak", kv))
            ok = sum(s.ok for s in stats.values())
            refused = sum(sum(s.statuses.values()) for s in stats.values())
            line = (
                f"  t={elapsed:4.0f}s  done={ok:4d}  refused={refused:4d}  "
                f"engine kv={kv:5.2f} running={m.get('vllm:num_requests_running', 0):3.0f} "
                f"waiting={m.get('vllm:num_requests_waiting', 0):3.0f}  "
                f"gateway scale={g.get('kvgate_scale', 1.0):4.2f} "
                f"slots={g.get('kvgate_slots_in_use', 0):3.0f}"
            )
            # on a terminal the line is redrawn in place; in a log, one line per tick
            if tty:
                print("\r" + line, end="", flush=True)
            else:
                print(line, flush=True)

        tty = sys.stdout.isatty()
        mix = _mix(model, seconds)
        start = asyncio.get_running_loop().time()
        stats = await drive(gw_url, mix, on_tick=tick, drain=60.0)
        # a last line once everything ended, so it agrees with the table below
        await tick(asyncio.get_running_loop().time() - start, stats)
    if tty:
        print()  # end the line redrawn in place
    return stats, peak


async def _final_engine(sim_url: str) -> dict[str, float]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        return await _scrape(session, sim_url + "/metrics")


def _report(stats: dict[str, Any], engine: dict[str, float], peak: float) -> None:
    from kvgate.loadgen import percentile

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    print()
    print(
        f"{'class':<8} {'sent':>5} {'done':>5} {'refused':>8} {'errors':>6} "
        f"{'p50 TTFT':>10} {'p99 TTFT':>10}  refusals by reason"
    )
    for name, s in stats.items():
        refused = sum(s.statuses.values())
        reasons = ", ".join(f"{r}={n}" for r, n in sorted(s.reasons.items())) or "-"
        print(
            f"{name:<8} {s.sent:>5} {s.ok:>5} {refused:>8} {s.errors:>6} "
            f"{ms(percentile(s.ttft, 0.5)):>10} {ms(percentile(s.ttft, 0.99)):>10}  {reasons}"
        )
    print()
    print(
        f"engine: peak KV usage {peak:.2f}, "
        f"preemptions {engine.get('vllm:num_preemptions_total', 0):.0f}, "
        f"OOMs {engine.get('kvgate_sim_oom_total', 0):.0f}, "
        f"generated tokens {engine.get('vllm:generation_tokens_total', 0):.0f}"
    )
