"""``kvgate demo``: the same seeded traffic straight to the built-in engine simulator and
through kvgate, side by side.

It starts ``kvgate sim`` (profile ``l4-llama3-8b``: one 24 GB GPU, ~33k KV tokens) as a child
process on a free loopback port and drives about 30 s of mixed traffic at it; then a fresh
simulator (same seed) with ``kvgate serve`` in front, and the same traffic through the gateway:

* ``chat`` — tenant ``support`` (critical, guaranteed slots): short streamed chat turns;
* ``docs`` — tenant ``analytics`` (standard): ~4k-token document analysis, and at t=10 s a burst
  of ten ~6k-token prompts arriving together;
* ``batch`` — tenant ``offline`` (sheddable): summaries of ~2k-token texts.

A live line shows progress each second (done, refused, errors, the engine's KV-cache usage,
preemptions and OOM crashes, the gateway's adaptive scale); while the traffic goes through
kvgate, the address of its live view (``/dashboard?key=...``, the demo's admin key) is printed.
At the end: the limits and tenants kvgate used, a table with both passes side by side (the
engine's OOM crashes, preemptions, failed requests, peak KV usage, tokens generated; per class:
done / sent, refused (with kvgate's reasons) or failed, errors, p50 / p99 time to first
token) and one sentence of what kvgate prevented, built from those numbers (:func:`summary`).
``--report FILE`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RunResult", "add_arguments", "free_port", "run", "stop_all", "summary", "wait_http"]

KEYS = {
    "support": "sk-demo-support",
    "analytics": "sk-demo-analytics",
    "offline": "sk-demo-offline",
    "admin": "sk-demo-admin",  # the gateway's admin key: /admin/state and the live view
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvgate demo``."""
    parser.add_argument("--seconds", type=float, default=30.0, help="traffic duration (s)")
    parser.add_argument("--speed", type=float, default=4.0, help="simulator speed factor")
    parser.add_argument("--profile", default="l4-llama3-8b", help="simulator profile")
    parser.add_argument("--workers", type=int, default=1, help="gateway worker processes")
    parser.add_argument(
        "--on-overflow",
        choices=["preempt", "oom"],
        default="preempt",
        help="the simulator when its KV cache is full: preempt (vLLM) or crash (default: %(default)s)",
    )
    parser.add_argument("--report", metavar="FILE", help="write the measured numbers as JSON")


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
        "admin_key_sha256": sha(KEYS["admin"]),
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


@dataclass
class RunResult:
    """What one pass of the traffic saw.

    Attributes:
        label: ``direct`` (straight to the engine) or ``kvgate`` (through the gateway).
        stats: per traffic class, :class:`kvgate.loadgen.ClassStats`.
        engine: the engine's counters at the end (``vllm:num_preemptions_total``,
            ``kvgate_sim_oom_total``, ``kvgate_sim_failed_requests_total``,
            ``vllm:generation_tokens_total``, ...).
        peak_kv: the engine's highest KV-cache usage during the pass (ratio 0..1).
        lowest_scale: the lowest adaptive scale the gateway applied (``None``: direct).
        state: the gateway's ``/admin/state`` at the end (``None``: direct).
    """

    label: str
    stats: dict[str, Any]
    engine: dict[str, float]
    peak_kv: float
    lowest_scale: float | None = None
    state: dict[str, Any] | None = None

    @property
    def ooms(self) -> int:
        """Engine crashes on a full KV cache."""
        return int(self.engine.get("kvgate_sim_oom_total", 0))

    @property
    def preemptions(self) -> int:
        """Sequences the engine evicted to recompute later."""
        return int(self.engine.get("vllm:num_preemptions_total", 0))

    @property
    def failed(self) -> int:
        """Requests the engine failed (an OOM crash fails every request it was running)."""
        return int(self.engine.get("kvgate_sim_failed_requests_total", 0))

    def ttft_p99(self, name: str) -> float | None:
        """p99 time to first token of one class (seconds; ``None``: no request completed)."""
        from kvgate.loadgen import percentile

        s = self.stats.get(name)
        return percentile(s.ttft, 0.99) if s is not None else None

    def as_dict(self) -> dict[str, Any]:
        """The measured numbers as plain JSON (``--report``)."""
        from kvgate.loadgen import percentile

        return {
            "label": self.label,
            "ooms": self.ooms,
            "preemptions": self.preemptions,
            "failed": self.failed,
            "peak_kv": self.peak_kv,
            "generated_tokens": int(self.engine.get("vllm:generation_tokens_total", 0)),
            "lowest_scale": self.lowest_scale,
            "limits": {
                b["name"]: {
                    "max_concurrency": b["max_concurrency"],
                    "tokens_per_minute": b["tokens_per_minute"],
                    "inflight_token_limit": b["inflight_token_limit"],
                }
                for b in (self.state or {}).get("backends", [])
            },
            "classes": {
                name: {
                    "sent": s.sent,
                    "done": s.ok,
                    "refused": sum(s.statuses.values()),
                    "statuses": {str(k): v for k, v in sorted(s.statuses.items())},
                    "reasons": dict(sorted(s.reasons.items())),
                    "errors": s.errors,
                    "ttft_p50_s": percentile(s.ttft, 0.5),
                    "ttft_p99_s": percentile(s.ttft, 0.99),
                }
                for name, s in self.stats.items()
            },
        }


def run(args: argparse.Namespace) -> int:
    """Run the demo: the same seeded traffic straight to a fresh simulator, then through kvgate
    in front of another fresh one; print the side-by-side table and the one-sentence summary
    (and write the numbers as JSON to ``args.report`` when given). Returns 0 when both passes
    completed, whatever the traffic outcome."""
    import json

    from kvgate.sim.profiles import get_profile

    profile = get_profile(args.profile)
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-demo-"))
    print(
        f"kvgate demo: simulator `{args.profile}` ({profile.summary}), on overflow: "
        f"{args.on_overflow}; the same {args.seconds:.0f} s of seeded traffic twice "
        f"(logs in {tmp}, kept only if a pass fails)"
    )
    direct = _one_pass(args, profile, tmp, gated=False)
    gated = _one_pass(args, profile, tmp, gated=True)
    shutil.rmtree(tmp, ignore_errors=True)  # both passes completed: nothing to look into
    _print_limits(gated, profile.kv_blocks * profile.block_size)
    _report(direct, gated)
    print()
    print(summary(direct, gated))
    if args.report:
        Path(args.report).write_text(
            json.dumps({"direct": direct.as_dict(), "kvgate": gated.as_dict()}, indent=2)
        )
    return 0


def _one_pass(args: argparse.Namespace, profile: Any, tmp: Path, *, gated: bool) -> RunResult:
    """One pass: a fresh simulator (same seed), kvgate in front of it when ``gated``, the
    traffic, the engine's final counters."""
    import yaml

    label = "kvgate" if gated else "direct"
    sim_port, gw_port = free_port(), free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    gw_url = f"http://127.0.0.1:{gw_port}"
    exe = [sys.executable, "-m", "kvgate"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    logs = contextlib.ExitStack()
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
                "--on-overflow",
                args.on_overflow,
            ],
            env=env,
            stdout=(sim_log := logs.enter_context((tmp / f"sim-{label}.log").open("wb"))),
            stderr=sim_log,
        )
        procs.append(sim)
        wait_http(sim_url + "/health", sim)
        target = sim_url
        if gated:
            cfg_path = tmp / "kvgate.yaml"
            cfg_path.write_text(
                yaml.safe_dump(
                    _config(sim_url, profile.model, profile.context_window, gw_port, args.workers)
                )
            )
            gw = subprocess.Popen(
                [*exe, "serve", "--config", str(cfg_path), "--log-level", "INFO"],
                env=env,
                stdout=(gw_log := logs.enter_context((tmp / "gateway.log").open("wb"))),
                stderr=gw_log,
            )
            procs.append(gw)
            wait_http(gw_url + "/healthz", gw)
            target = gw_url
            print(f"\n[2/2] through kvgate: {gw_url} → engine {sim_url}")
            print(f"      live view: {gw_url}/dashboard?key={KEYS['admin']}")
        else:
            print(f"\n[1/2] straight to the engine: {sim_url}")
        stats, peak, lowest = asyncio.run(
            _drive(target, sim_url, gw_url if gated else None, profile.model, args.seconds)
        )
        engine, state = asyncio.run(_final(sim_url, gw_url if gated else None))
        return RunResult(label, stats, engine, peak, lowest if gated else None, state)
    finally:
        stop_all(procs)
        logs.close()


async def _drive(
    target: str, sim_url: str, gw_url: str | None, model: str, seconds: float
) -> tuple[Any, float, float]:
    """Play the mix against ``target`` with a live line each second; returns (stats per
    class, the engine's peak KV usage, the gateway's lowest scale)."""
    import aiohttp

    from kvgate.loadgen import drive

    peak = 0.0
    lowest = 1.0
    async with aiohttp.ClientSession() as session:

        async def tick(elapsed: float, stats: dict[str, Any]) -> None:
            nonlocal peak, lowest
            m = await _scrape(session, sim_url + "/metrics")
            kv = m.get("vllm:kv_cache_usage_perc", 0.0)
            peak = max(peak, m.get("kvgate_sim_kv_cache_usage_peak", kv))
            ok = sum(s.ok for s in stats.values())
            refused = sum(sum(s.statuses.values()) for s in stats.values())
            errors = sum(s.errors for s in stats.values())
            line = (
                f"  t={elapsed:4.0f}s  done={ok:4d}  refused={refused:4d}  errors={errors:3d}  "
                f"engine kv={kv:5.2f} running={m.get('vllm:num_requests_running', 0):3.0f} "
                f"waiting={m.get('vllm:num_requests_waiting', 0):3.0f} "
                f"preempted={m.get('vllm:num_preemptions_total', 0):4.0f} "
                f"ooms={m.get('kvgate_sim_oom_total', 0):.0f}"
            )
            if gw_url is not None:
                g = await _scrape(session, gw_url + "/metrics")
                scale = g.get("kvgate_scale", 1.0)
                lowest = min(lowest, scale)
                line += f"  kvgate scale={scale:4.2f} slots={g.get('kvgate_slots_in_use', 0):3.0f}"
            # on a terminal the line is redrawn in place; in a log, one line per tick
            if tty:
                print("\r" + line, end="", flush=True)
            else:
                print(line, flush=True)

        tty = sys.stdout.isatty()
        mix = _mix(model, seconds)
        start = asyncio.get_running_loop().time()
        stats = await drive(target, mix, on_tick=tick, drain=60.0)
        # a last line once everything ended, so it agrees with the table below
        await tick(asyncio.get_running_loop().time() - start, stats)
    if tty:
        print()  # end the line redrawn in place
    return stats, peak, lowest


async def _final(sim_url: str, gw_url: str | None) -> tuple[dict[str, float], Any]:
    """The engine's counters and (through kvgate) the gateway's ``/admin/state``."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        engine = await _scrape(session, sim_url + "/metrics")
        state = None
        if gw_url is not None:
            headers = {"Authorization": f"Bearer {KEYS['admin']}"}
            async with session.get(gw_url + "/admin/state", headers=headers) as resp:
                state = await resp.json()
        return engine, state


def _n(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _print_limits(gated: RunResult, kv_tokens: int) -> None:
    """The limits and tenants kvgate ran with (from its ``/admin/state``; ``kv_tokens``: the
    engine's KV-cache capacity, tokens)."""
    print()
    if gated.state:
        for b in gated.state["backends"]:
            budget = b.get("inflight_token_limit") or 0
            print(
                f"kvgate limits (backend {b['name']}): {b['max_concurrency']} slots, "
                f"{_n(b['tokens_per_minute'])} tokens/min, in-flight budget {_n(budget)} tokens "
                f"({budget / kv_tokens:.0%} of the engine's {kv_tokens:,} KV tokens), "
                "adaptive scale from the engine's KV usage "
                f"(lowest applied {gated.lowest_scale if gated.lowest_scale is not None else 1:.2f})"
            )
    tenants = []
    for t in _config("", "", 0, 0, 1)["tenants"]:
        wait = t["max_wait_ms"]
        extra = f", {t['guaranteed_slots']} guaranteed slots" if "guaranteed_slots" in t else ""
        waits = f"waits ≤ {wait / 1000:g} s" if wait else "never waits"
        tenants.append(f"{t['name']} ({t['priority']}{extra}, {waits})")
    print("tenants: " + "; ".join(tenants))


#: traffic class → (tenant, priority class), as :func:`_mix` and :func:`_config` set them
CLASSES = {
    "chat": ("support", "critical"),
    "docs": ("analytics", "standard"),
    "batch": ("offline", "sheddable"),
}


def _report(direct: RunResult, gated: RunResult) -> None:
    """The side-by-side table: the engine's counters, then each class's outcome."""

    def ttft(r: RunResult, name: str) -> str:
        from kvgate.loadgen import percentile

        s = r.stats[name]
        p50, p99 = percentile(s.ttft, 0.5), percentile(s.ttft, 0.99)
        if p50 is None or p99 is None:
            return "-"
        return f"{p50:.2f} / {p99:.2f} s"

    def refused(r: RunResult, name: str) -> str:
        s = r.stats[name]
        n = sum(s.statuses.values())
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(s.reasons.items()))
        if not reasons and n:
            reasons = ", ".join(f"HTTP {k} ×{v}" for k, v in sorted(s.statuses.items()))
        return f"{n}" + (f" ({reasons})" if reasons else "")

    rows: list[tuple[str, str, str]] = [
        ("engine OOM crashes", str(direct.ooms), str(gated.ooms)),
        ("engine preemptions", str(direct.preemptions), str(gated.preemptions)),
        ("requests failed by the engine", str(direct.failed), str(gated.failed)),
        ("peak KV-cache usage", f"{direct.peak_kv:.2f}", f"{gated.peak_kv:.2f}"),
        (
            "tokens generated",
            _n(direct.engine.get("vllm:generation_tokens_total", 0)),
            _n(gated.engine.get("vllm:generation_tokens_total", 0)),
        ),
    ]
    for name in direct.stats:
        d, g = direct.stats[name], gated.stats[name]
        cls = CLASSES.get(name, (name, "?"))[1]
        head = f"{name} ({cls})"
        rows.append((f"{head}: done / sent", f"{d.ok} / {d.sent}", f"{g.ok} / {g.sent}"))
        rows.append(
            (f"{head}: refused or failed (non-2xx)", refused(direct, name), refused(gated, name))
        )
        rows.append((f"{head}: errors", str(d.errors), str(g.errors)))
        rows.append((f"{head}: TTFT p50 / p99", ttft(direct, name), ttft(gated, name)))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len("straight to the engine"), *(len(r[1]) for r in rows))
    print()
    print(f"{'':<{w0}}  {'straight to the engine':<{w1}}  through kvgate")
    for a, b, c in rows:
        print(f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip())


def summary(direct: RunResult, gated: RunResult, critical: str = "chat") -> str:
    """One sentence of what kvgate prevented, from the measured numbers only: OOM crashes,
    preemptions and requests the engine failed where kvgate's pass had fewer, the critical
    class's p99 time to first token where it was at least 10 % lower, and what kvgate refused
    (or, when none was better, that it prevented nothing measurable)."""
    better: list[str] = []
    if gated.ooms < direct.ooms:
        better.append(f"engine OOM crashes ({direct.ooms} → {gated.ooms})")
    if gated.preemptions < direct.preemptions:
        better.append(f"preemptions ({direct.preemptions} → {gated.preemptions})")
    if gated.failed < direct.failed:
        better.append(f"requests failed by the engine ({direct.failed} → {gated.failed})")
    d99, g99 = direct.ttft_p99(critical), gated.ttft_p99(critical)
    if d99 is not None and g99 is not None and g99 < 0.9 * d99:  # a clear gain only
        better.append(f"slow critical first tokens (p99 TTFT {d99:.2f} s → {g99:.2f} s)")
    refused = [
        f"{n} {CLASSES.get(name, (name, name))[1]}"
        for name, s in gated.stats.items()
        if (n := sum(s.statuses.values()))
    ]
    cost = _and(refused)
    if not better:
        return (
            "kvgate prevented nothing measurable in this run: OOM crashes "
            f"{direct.ooms} → {gated.ooms}, preemptions {direct.preemptions} → "
            f"{gated.preemptions}, critical p99 TTFT {_s(d99)} → {_s(g99)}"
            + (f", and it refused {cost} requests." if cost else ".")
        )
    return f"kvgate prevented {_and(better)}" + (
        f", at the cost of refusing {cost} requests." if cost else ", refusing none."
    )


def _and(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c`` (``""`` for none)."""
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"
