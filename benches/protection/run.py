"""The protection scenario: the same seeded traffic with and without kvgate.

Usage::

    .venv/bin/python benches/protection/run.py            # or: make bench-protect
    .venv/bin/python benches/protection/run.py --passes oom --no-write   # a quick look
    .venv/bin/python benches/protection/run.py --passes oom,oom-nochunk --duration 20 \
        --drain 20 --only a-direct,d-adaptive --no-write                  # a smoke test

It reads ``mix.yaml`` (next to this file), then for each pass (``passes`` in ``mix.yaml`` or
``--passes``: an engine mode, ``oom`` (``--on-overflow oom``) or ``preempt``, with vLLM V1's
chunked prefill, the simulator's default, or with ``-nochunk`` without it
(``--no-chunked-prefill``: a prompt prefilled whole, stalling every running sequence); default
``oom``, ``preempt``, ``oom-nochunk``, ``preempt-nochunk``) starts a fresh ``kvgate sim`` per
run and plays the traffic against it:

* ``a-direct`` — straight to the engine;
* ``b-count`` — kvgate with a request-count limit only (no TPM, no in-flight budget, no
  adaptation, tenants alike);
* ``c-static-F`` — kvgate with static joint limits (concurrency + TPM + in-flight token budget
  F × KV capacity), one run per F of the sweep (the first pass; the other passes rerun only
  the best F);
* ``d-adaptive`` — kvgate with adaptation and tenants (priority classes, guaranteed slots,
  per-class waits); in the first pass also ``d-adaptive-noburst`` (the same traffic without the
  burst) for the critical TTFT target, and one run per ``adaptive_variants`` entry of
  ``mix.yaml`` (the article's watermarks; the default TPM bucket).

For each run it records the engine's OOMs (``kvgate_sim_oom_total``), preemptions
(``vllm:num_preemptions_total``), peak KV usage (``kvgate_sim_kv_cache_usage_peak``), the
client-side outcome (completed requests, completion tokens that reached a client, TTFT of
streamed requests per priority class, refusals by ``x-kvgate-reject-reason``), and samples the
engine's ``vllm:kv_cache_usage_perc`` and the gateway's ``kvgate_scale``,
``kvgate_concurrency_limit``, ``kvgate_inflight_token_limit`` and ``kvgate_inflight_tokens``
over time. Times are reported in simulated seconds (wall seconds × speed).

Outputs (under ``benches/protection/``): ``results.json`` (every figure and time series),
``protection_timeline.png``, ``protection_bars.png``, ``README.md``, and the section
``## Protection scenario`` of ``benches/RESULTS.md`` (only that section is replaced).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(HERE.parent))

from core_results import replace_section  # noqa: E402
from kvgate.demo import free_port, stop_all, wait_http  # noqa: E402
from kvgate.loadgen import Burst, ClassStats, Stream, TrafficMix, drive, percentile  # noqa: E402
from kvgate.sim.profiles import get_profile  # noqa: E402

SECTION = "## Protection scenario"
CLASSES = ("critical", "standard", "sheddable")
GW_SERIES = {
    "kvgate_scale": "scale",
    "kvgate_concurrency_limit": "concurrency_limit",
    "kvgate_inflight_token_limit": "inflight_limit",
    "kvgate_inflight_tokens": "inflight_tokens",
    "kvgate_slots_in_use": "slots_in_use",
    "kvgate_prefill_tokens": "prefill_tokens",  # both lanes (critical and the others) summed
    "kvgate_prefill_token_budget": "prefill_budget",
}
SIM_SERIES = {
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "kvgate_sim_oom_total": "ooms",
    "vllm:num_preemptions_total": "preemptions",
    "kvgate_sim_kv_cache_usage_peak": "kv_peak",
}


# --------------------------------------------------------------------------- the mix

PASSES = ("oom", "preempt", "oom-nochunk", "preempt-nochunk")
"""Every pass label: the engine's ``--on-overflow`` mode, ``-nochunk`` without chunked prefill."""


def parse_pass(label: str) -> tuple[str, bool]:
    """A pass label (one of :data:`PASSES`) → (``--on-overflow`` mode, chunked prefill on).

    Raises:
        ValueError: an unknown label.
    """
    mode, _, rest = label.partition("-")
    if mode not in ("oom", "preempt") or rest not in ("", "nochunk"):
        raise ValueError(f"unknown pass {label!r}; expected one of {', '.join(PASSES)}")
    return mode, rest == ""


def sim_flags(label: str) -> list[str]:
    """The ``kvgate sim`` flags of a pass, e.g. ``["--on-overflow", "oom",
    "--no-chunked-prefill"]`` for ``oom-nochunk``."""
    mode, chunked = parse_pass(label)
    return ["--on-overflow", mode, *([] if chunked else ["--no-chunked-prefill"])]


def load_mix(path: Path) -> dict[str, Any]:
    """The parsed ``mix.yaml``."""
    with path.open() as f:
        return yaml.safe_load(f)


def build_traffic(mix: dict[str, Any], model: str, *, burst: bool = True) -> TrafficMix:
    """The :class:`TrafficMix` of ``mix`` on the wall clock (simulated times / speed).

    A stream with ``count`` becomes ``count`` single-request bursts at seeded uniform times in
    ``[start, stop)``; ``burst=False`` drops the ``bursts`` (the no-burst variant), leaving every
    other arrival unchanged.
    """
    speed = float(mix["speed"])
    tenants = mix["tenants"]
    rng = random.Random(int(mix["seed"]) + 1)
    streams: list[Stream] = []
    bursts: list[Burst] = []
    for s in mix["streams"]:
        key = tenants[s["tenant"]]["key"]
        common = {
            "prompt_tokens": int(s["prompt_tokens"]),
            "max_tokens": int(s["max_tokens"]),
            "stream": bool(s.get("stream", True)),
            "ignore_eos": bool(s.get("ignore_eos", False)),
        }
        if "count" in s:
            if s.get("route", "chat") != "chat":
                raise ValueError(f"stream {s['name']}: count is only for chat streams")
            start, stop = float(s.get("start", 0.0)), float(s.get("stop", mix["duration"]))
            for _ in range(int(s["count"])):
                at = rng.uniform(start, stop) / speed
                bursts.append(Burst(s["name"], key, at=at, count=1, **common))
        else:
            streams.append(
                Stream(
                    s["name"],
                    key,
                    rate=float(s["rate"]) * speed,
                    route=s.get("route", "chat"),
                    start=float(s.get("start", 0.0)) / speed,
                    stop=float(s.get("stop", mix["duration"])) / speed,
                    **common,
                )
            )
    if burst:
        for b in mix.get("bursts", ()):
            bursts.append(
                Burst(
                    b["name"],
                    tenants[b["tenant"]]["key"],
                    at=float(b["at"]) / speed,
                    count=int(b["count"]),
                    prompt_tokens=int(b["prompt_tokens"]),
                    max_tokens=int(b["max_tokens"]),
                    stream=bool(b.get("stream", True)),
                    ignore_eos=bool(b.get("ignore_eos", False)),
                )
            )
    return TrafficMix(
        model=model,
        duration=float(mix["duration"]) / speed,
        streams=tuple(streams),
        bursts=tuple(bursts),
        seed=int(mix["seed"]),
    )


def class_of(mix: dict[str, Any]) -> dict[str, str]:
    """Traffic name → priority class of its tenant."""
    out: dict[str, str] = {}
    for s in [*mix["streams"], *mix.get("bursts", ())]:
        out[s["name"]] = mix["tenants"][s["tenant"]]["priority"]
    return out


def streamed(mix: dict[str, Any]) -> set[str]:
    """Traffic names whose requests are streamed (the only ones in the TTFT figures)."""
    return {
        s["name"]
        for s in [*mix["streams"], *mix.get("bursts", ())]
        if s.get("stream", True) and s.get("route", "chat") == "chat"
    }


# --------------------------------------------------------------------------- gateway configs


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def gateway_config(
    mix: dict[str, Any],
    kind: str,
    *,
    sim_url: str,
    port: int,
    model: str,
    context: int,
    capacity: int,
    inflight_fraction: float | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The kvgate YAML (as a dict) for run ``kind``: ``count_limit``, ``static`` or
    ``adaptive`` (the ``runs`` section of ``mix.yaml``), with wall-clock units; ``overrides``
    (a variant of ``adaptive_variants``) replace fields of the run's settings, and its
    ``adaptive`` dict fields of the ``adaptive`` block."""
    speed = float(mix["speed"])
    spec = dict(mix["runs"][kind])
    over = {k: v for k, v in (overrides or {}).items() if k != "name"}
    if "adaptive" in over:
        over["adaptive"] = dict(spec.get("adaptive", {})) | over["adaptive"]
    spec |= over
    backend: dict[str, Any] = {
        "name": "sim",
        "url": sim_url,
        "engine": "vllm",
        "models": [{"name": model, "context_window": context}],
    }
    if spec.get("max_concurrency") is not None:  # null: the engine's own batch limit
        backend["max_concurrency"] = int(spec["max_concurrency"])
    if kind == "count_limit":
        # no in-flight budget: set one no request can reach (else capacity discovery sets one)
        backend["inflight_token_limit"] = 10**15
        backend["adaptive"] = {"enabled": False}
    else:
        backend["tokens_per_minute"] = int(spec["tokens_per_minute"] * speed)
        if spec.get("burst_tokens"):
            backend["burst_tokens"] = int(spec["burst_tokens"])  # a bucket size: no time unit
        fraction = inflight_fraction if inflight_fraction is not None else spec["inflight_fraction"]
        backend["inflight_token_limit"] = int(capacity * fraction)
        if kind == "static":
            backend["adaptive"] = {"enabled": False}
        else:
            a = dict(spec["adaptive"])
            a["enabled"] = True
            a["recovery_per_second"] = min(1.0, a["recovery_per_second"] * speed)
            for k in ("poll_interval", "stale_after"):
                a[k] = a[k] / speed
            backend["adaptive"] = a
    tenants = []
    per_tenant = spec.get("tenants", {})
    for name, t in mix["tenants"].items():
        own = per_tenant.get(name, {})
        wait_s = own.get("max_wait", spec.get("max_wait", 0))
        tenants.append(
            {
                "name": name,
                "api_key_sha256": [_sha(t["key"])],
                # tenants alike in (b) and (c); classes and guarantees only in (d)
                "priority": t["priority"] if kind == "adaptive" else "standard",
                "guaranteed_slots": int(own.get("guaranteed_slots", 0)),
                "max_wait_ms": int(wait_s * 1000 / speed),
            }
        )
    if "prefill_token_budget" in spec:
        backend["prefill_token_budget"] = spec["prefill_token_budget"]
    out: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "timeouts": {"connect": 5, "first_byte": 600, "idle": 300, "total": 900},
        "queue": {"max_size": 4096},
        "backends": [backend],
        "tenants": tenants,
    }
    if spec.get("slo"):
        # latency targets in simulated seconds → wall seconds
        slo: dict[str, Any] = {}
        for cls, t in spec["slo"].items():
            if isinstance(t, dict):
                slo[cls] = {k: v / speed for k, v in t.items()}
            else:
                slo[cls] = t / speed if cls in ("interval_s", "window_s") else t
        out["slo"] = slo
    return out


# --------------------------------------------------------------------------- processes


_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([^ ]+)")


def parse_metrics(text: str, wanted: dict[str, str]) -> dict[str, float]:
    """Values of the ``wanted`` series (Prometheus name → our key) in exposition ``text``,
    summed over label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if m and m.group(1) in wanted:
            key = wanted[m.group(1)]
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


@dataclass
class RunResult:
    """Everything measured in one run (times in simulated seconds)."""

    name: str
    mode: str
    kind: str
    settings: dict[str, Any]
    elapsed: float = 0.0
    engine: dict[str, float] = field(default_factory=dict)
    classes: dict[str, dict[str, Any]] = field(default_factory=dict)
    samples: list[dict[str, float]] = field(default_factory=list)


async def _sampler(
    sim_url: str, gw_url: str | None, t0: float, speed: float, every: float, out: list[Any]
) -> None:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            row: dict[str, float] = {"t": (time.monotonic() - t0) * speed}
            with contextlib.suppress(Exception):
                async with session.get(sim_url + "/metrics") as r:
                    row.update(parse_metrics(await r.text(), SIM_SERIES))
            if gw_url is not None:
                with contextlib.suppress(Exception):
                    async with session.get(gw_url + "/metrics") as r:
                        row.update(parse_metrics(await r.text(), GW_SERIES))
            out.append(row)
            await asyncio.sleep(every)


def _class_summary(stats: ClassStats, speed: float) -> dict[str, Any]:
    return {
        "sent": stats.sent,
        "ok": stats.ok,
        "errors": stats.errors,
        "statuses": {str(k): v for k, v in sorted(stats.statuses.items())},
        "reasons": dict(sorted(stats.reasons.items())),
        "completion_tokens": stats.completion_tokens,
        "ttft": [round(v * speed, 4) for v in stats.ttft],
        "ttft_at": [round(v * speed, 3) for v in stats.ttft_at],
    }


def run_one(
    mix: dict[str, Any],
    *,
    name: str,
    mode: str,
    kind: str,
    traffic: TrafficMix,
    settings: dict[str, Any] | None = None,
    inflight_fraction: float | None = None,
    overrides: dict[str, Any] | None = None,
) -> RunResult:
    """Start a fresh simulator (and gateway unless ``kind == "direct"``), play ``traffic``,
    return what was measured."""
    speed = float(mix["speed"])
    profile = get_profile(mix["profile"])
    capacity = profile.kv_blocks * profile.block_size
    result = RunResult(name=name, mode=mode, kind=kind, settings=dict(settings or {}))
    tmp = Path(tempfile.mkdtemp(prefix=f"kvgate-protect-{name}-"))
    exe = [sys.executable, "-m", "kvgate"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    logs = contextlib.ExitStack()
    try:
        sim_port = free_port()
        sim_url = f"http://127.0.0.1:{sim_port}"
        sim_cmd = [
            *exe,
            "sim",
            "--profile",
            mix["profile"],
            "--port",
            str(sim_port),
            "--speed",
            str(speed),
            "--seed",
            str(mix["seed"]),
            *sim_flags(mode),
            "--restart-seconds",
            str(mix["restart_seconds"]),
        ]
        result.settings["sim"] = " ".join(sim_cmd[3:])
        procs.append(
            subprocess.Popen(
                sim_cmd,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=logs.enter_context((tmp / "sim.log").open("wb")),
            )
        )
        wait_http(sim_url + "/health", procs[-1])
        target, gw_url = sim_url, None
        if kind != "direct":
            gw_port = free_port()
            gw_url = f"http://127.0.0.1:{gw_port}"
            cfg = gateway_config(
                mix,
                kind,
                sim_url=sim_url,
                port=gw_port,
                model=profile.model,
                context=profile.context_window,
                capacity=capacity,
                inflight_fraction=inflight_fraction,
                overrides=overrides,
            )
            result.settings["gateway"] = cfg["backends"][0] | {"tenants": cfg["tenants"]}
            (tmp / "kvgate.yaml").write_text(yaml.safe_dump(cfg))
            procs.append(
                subprocess.Popen(
                    [*exe, "serve", "--config", str(tmp / "kvgate.yaml"), "--log-level", "WARNING"],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=logs.enter_context((tmp / "gateway.log").open("wb")),
                )
            )
            wait_http(gw_url + "/healthz", procs[-1])
            target = gw_url
            time.sleep(0.5)  # first metrics poll: capacity and KV usage known

        async def go() -> dict[str, ClassStats]:
            t0 = time.monotonic()
            every = float(mix["sample_every"]) / speed
            sampler = asyncio.create_task(
                _sampler(sim_url, gw_url, t0, speed, every, result.samples)
            )
            last = [0.0]

            def tick(elapsed: float, stats: dict[str, ClassStats]) -> None:
                if elapsed - last[0] < 5.0:
                    return
                last[0] = elapsed
                row = result.samples[-1] if result.samples else {}
                ok = sum(s.ok for s in stats.values())
                refused = sum(sum(s.statuses.values()) for s in stats.values())
                gw = (
                    f" scale={row.get('scale', 0):.2f} slots={row.get('slots_in_use', 0):.0f}"
                    f"/{row.get('concurrency_limit', 0):.0f}"
                    f" inflight={row.get('inflight_tokens', 0) / 1000:.0f}k"
                    f"/{row.get('inflight_limit', 0) / 1000:.0f}k"
                    f" run={row.get('running', 0):.0f} wait={row.get('waiting', 0):.0f}"
                    if gw_url
                    else ""
                )
                print(
                    f"    t={elapsed * speed:5.0f}s sim  done={ok:4d} refused={refused:4d} "
                    f"kv={row.get('kv', 0):.2f} ooms={row.get('ooms', 0):.0f} "
                    f"preempt={row.get('preemptions', 0):.0f}{gw}",
                    flush=True,
                )

            try:
                stats = await drive(
                    target, traffic, on_tick=tick, tick=1.0, drain=float(mix["drain"]) / speed
                )
            finally:
                result.elapsed = (time.monotonic() - t0) * speed
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
            return stats

        stats = asyncio.run(go())
        with urllib.request.urlopen(sim_url + "/metrics", timeout=5) as r:
            result.engine = parse_metrics(r.read().decode(), SIM_SERIES)
        result.classes = {n: _class_summary(s, speed) for n, s in stats.items()}
        return result
    finally:
        stop_all(procs)
        logs.close()


# --------------------------------------------------------------------------- summaries


def summarize(run: RunResult, mix: dict[str, Any]) -> dict[str, Any]:
    """The table row of a run: OOMs, preemptions, completed, goodput, TTFT per class, refusals."""
    cls = class_of(mix)
    live = streamed(mix)
    w0, w1 = mix["burst_window"]
    ttft: dict[str, list[float]] = {c: [] for c in CLASSES}
    burst_crit: list[float] = []
    sent = ok = tokens = 0
    reasons: dict[str, int] = {}
    statuses: dict[str, int] = {}
    errors = 0
    done_by = {k: [0, 0] for k in CLASSES}
    refused_by: dict[str, dict[str, int]] = {k: {} for k in CLASSES}
    for name, c in run.classes.items():
        done_by[cls[name]][0] += c["ok"]
        done_by[cls[name]][1] += c["sent"]
        for r, n in c["reasons"].items():
            refused_by[cls[name]][r] = refused_by[cls[name]].get(r, 0) + n
        sent += c["sent"]
        ok += c["ok"]
        tokens += c["completion_tokens"]
        errors += c["errors"]
        for r, n in c["reasons"].items():
            reasons[r] = reasons.get(r, 0) + n
        for s, n in c["statuses"].items():
            statuses[s] = statuses.get(s, 0) + n
        if name in live:
            ttft[cls[name]].extend(c["ttft"])
            if cls[name] == "critical":
                burst_crit.extend(
                    v for v, at in zip(c["ttft"], c["ttft_at"], strict=True) if w0 <= at < w1
                )
    row: dict[str, Any] = {
        "run": run.name,
        "mode": run.mode,
        # the latency targets the run was made with (simulated seconds; (e) runs)
        "slo": next(
            (
                v.get("slo")
                for v in mix.get("runs", {}).get("adaptive_variants", ())
                if v.get("name") == run.name
            ),
            None,
        ),
        "ooms": int(run.engine.get("ooms", 0)),
        "preemptions": int(run.engine.get("preemptions", 0)),
        "kv_peak": run.engine.get("kv_peak", 0.0),
        "sent": sent,
        "completed": ok,
        "errors": errors,
        "tokens": tokens,
        "elapsed": run.elapsed,
        "goodput": tokens / run.elapsed if run.elapsed else 0.0,
        "statuses": statuses,
        "reasons": reasons,
        "critical_burst_p99": percentile(burst_crit, 0.99),
        "critical_burst_n": len(burst_crit),
        "done_by_class": done_by,
        # refusals per priority class, by reason (the "completed" target spares sheddable work)
        "refused_by_class": refused_by,
        # simulated seconds during which the effective in-flight budget was below the tokens
        # already in flight (nothing but a guaranteed slot can be admitted then)
        "squeezed_s": sum(
            float(mix["sample_every"])
            for smp in run.samples
            if "inflight_limit" in smp and smp["inflight_limit"] < smp.get("inflight_tokens", 0)
        ),
        "longgen_done": [run.classes.get("longgen", {}).get(k, 0) for k in ("ok", "sent")],
        "burst_done": [run.classes.get("burst", {}).get(k, 0) for k in ("ok", "sent")],
    }
    squeezed_kv = [
        smp["kv"]
        for smp in run.samples
        if "kv" in smp
        and "inflight_limit" in smp
        and smp["inflight_limit"] < smp.get("inflight_tokens", 0)
    ]
    # the engine's sampled KV usage (0..1) in those samples: mean, min, max (None when none)
    row["squeezed_kv"] = (
        [sum(squeezed_kv) / len(squeezed_kv), min(squeezed_kv), max(squeezed_kv)]
        if squeezed_kv
        else None
    )
    # simulated seconds from the harness's clock start to its first sample: the sampler starts
    # once the arrival schedule is built, so this bounds the time counted before any arrival
    row["first_sample_t"] = run.samples[0]["t"] if run.samples else None
    for c in CLASSES:
        row[f"{c}_p50"] = percentile(ttft[c], 0.5)
        row[f"{c}_p99"] = percentile(ttft[c], 0.99)
        row[f"{c}_n"] = len(ttft[c])
    # critical TTFT p99 per 10 simulated s window (by when the request was sent): the latency
    # targets' measure
    windows: dict[int, list[float]] = {}
    for name, c in run.classes.items():
        if name in live and cls.get(name) == "critical":
            for v, at in zip(c["ttft"], c["ttft_at"], strict=True):
                windows.setdefault(int(at // 10), []).append(v)
    row["critical_windows"] = [
        [k * 10, percentile(v, 0.99)] for k, v in sorted(windows.items()) if v
    ]
    return row


def best_static(rows: list[dict[str, Any]], mode: str) -> float | None:
    """The in-flight fraction F of the static run (``c-static-F``) with the highest goodput in
    the ``mode`` pass (the first in ``rows`` order on a tie), or ``None`` without static runs.

    The one rule for "best static": :func:`main` picks the fraction the later passes rerun with
    it, :func:`render` rebuilds the same choice from a ``results.json``.
    """
    statics = [r for r in rows if r["mode"] == mode and r["run"].startswith("c-static-")]
    if not statics:
        return None
    best = max(statics, key=lambda r: r["goodput"])
    return float(best["run"].removeprefix("c-static-"))


def p99_rank(n: int, q: float = 0.99) -> tuple[int, int]:
    """Where :func:`kvgate.loadgen.percentile` takes the ``q`` quantile of ``n`` values:
    ``(index in ascending order, rank from the top)``, rank 1 = the largest.

    Mirrors ``percentile``'s ``round(q * (n - 1))`` (a test holds the two together).

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"no values (n={n})")
    idx = min(n - 1, max(0, round(q * (n - 1))))
    return idx, n - idx


def _largest(rank: int) -> str:
    words = {1: "largest", 2: "second-largest", 3: "third-largest"}
    return words.get(rank, f"{rank}th-largest")


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown results table."""
    head = (
        "| run | engine | OOMs | preempt. | peak KV | completed / sent (critical) "
        "| goodput (tok/s) | critical TTFT p50 / p99 (s) | standard p50 / p99 (s) "
        "| sheddable p50 / p99 (s) | refused (by reason) | errors |\n|" + "---|" * 12
    )
    lines = [head]
    for r in rows:
        refused = sum(r["statuses"].values())
        crit = r["done_by_class"]["critical"]
        why = ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items()))
        other = refused - sum(r["reasons"].values())
        if other:
            codes = ", ".join(
                f"HTTP {k} ×{v}" for k, v in sorted(r["statuses"].items()) if not r["reasons"]
            )
            why = (why + "; " if why else "") + (codes or f"{other} without a reason")
        lines.append(
            f"| {r['run']} | {r['mode']} | {r['ooms']} | {r['preemptions']} | {r['kv_peak']:.2f} "
            f"| {r['completed']} / {r['sent']} ({crit[0]} / {crit[1]}) | {r['goodput']:,.0f} "
            f"| {_s(r['critical_p50'])} / {_s(r['critical_p99'])} "
            f"| {_s(r['standard_p50'])} / {_s(r['standard_p99'])} "
            f"| {_s(r['sheddable_p50'])} / {_s(r['sheddable_p99'])} "
            f"| {refused}{' (' + why + ')' if why else ''} | {r['errors']} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- plots


def critical_streams(mix: dict[str, Any]) -> set[str]:
    """Names of the mix's streams and bursts sent by a tenant of the critical class."""
    tenants = mix.get("tenants") or {}
    return {
        str(s["name"])
        for s in [*(mix.get("streams") or ()), *(mix.get("bursts") or ())]
        if (tenants.get(s.get("tenant")) or {}).get("priority") == "critical"
    }


def plot_timeline(a: RunResult, d: RunResult, mix: dict[str, Any], path: Path) -> None:
    """KV usage of (a) and (d), (d)'s effective limits, and (d)'s prompt tokens in prefill with
    the critical class's TTFT, over simulated time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profile = get_profile(mix["profile"])
    cap = profile.kv_blocks * profile.block_size
    burst_at = [float(b["at"]) for b in mix.get("bursts", ())]
    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    for ax, run, title in (
        (axes[0], a, "(a) straight to the engine"),
        (axes[1], d, "(d) kvgate: adaptation + tenants"),
    ):
        t = [s["t"] for s in run.samples if "kv" in s]
        ax.plot(t, [s["kv"] for s in run.samples if "kv" in s], label="engine KV usage", lw=1.6)
        ooms = 0.0
        for s in run.samples:
            if s.get("ooms", 0) > ooms:
                ax.axvline(s["t"], color="red", lw=1.2, ls="-")
                ax.text(s["t"], 1.02, " OOM", color="red", fontsize=8)
                ooms = s["ooms"]
        gw = [s for s in run.samples if "scale" in s]
        if gw:
            tg = [s["t"] for s in gw]
            ax.plot(tg, [s["scale"] for s in gw], label="kvgate_scale", lw=1.2)
            ax.plot(
                tg,
                [s.get("inflight_limit", 0) / cap for s in gw],
                label="in-flight token budget / KV capacity",
                lw=1.2,
                ls="--",
            )
            ax.plot(
                tg,
                [s.get("inflight_tokens", 0) / cap for s in gw],
                label="in-flight tokens / KV capacity",
                lw=1.0,
                ls=":",
            )
            ax2 = ax.twinx()
            ax2.plot(
                tg, [s.get("concurrency_limit", 0) for s in gw], color="grey", lw=1.0, alpha=0.7
            )
            ax2.set_ylabel("kvgate_concurrency_limit (slots)", color="grey")
            ax2.set_ylim(0, max(s.get("concurrency_limit", 0) for s in gw) * 1.15 + 1)
        for b in burst_at:
            ax.axvspan(b, b + 2, color="orange", alpha=0.3)
            ax.text(b, 0.03, " burst", color="darkorange", fontsize=8)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("ratio")
        ax.set_title(f"{title} — {run.mode} mode")
        ax.legend(loc="lower right", fontsize=8)
        ax.grid(alpha=0.3)
    # (d): prompt tokens in prefill (kvgate_prefill_tokens, both lanes) against the budget,
    # and each critical request's TTFT at the time it was sent
    ax = axes[2]
    gw = [s for s in d.samples if "prefill_tokens" in s]
    if gw:
        tg = [s["t"] for s in gw]
        ax.plot(tg, [s["prefill_tokens"] / 1000 for s in gw], label="prompt tokens in prefill (k)")
        ax.plot(
            tg,
            [s.get("prefill_budget", 0) / 1000 for s in gw],
            label="prefill budget per lane (k)",
            ls="--",
            lw=1.0,
        )
        ax.legend(loc="upper left", fontsize=8)
    ax.set_ylabel("thousand tokens")
    ax.grid(alpha=0.3)
    crit = critical_streams(mix)
    at: list[float] = []
    ttft: list[float] = []
    for name, c in d.classes.items():
        if name in crit:
            at.extend(c["ttft_at"])
            ttft.extend(c["ttft"])
    ax2 = ax.twinx()
    ax2.scatter(at, ttft, s=5, color="crimson", alpha=0.6, label="critical TTFT (s)")
    ax2.set_ylabel("critical TTFT (simulated s)", color="crimson")
    ax2.legend(loc="upper right", fontsize=8)
    for b in burst_at:
        ax.axvspan(b, b + 2, color="orange", alpha=0.3)
    ax.set_title(f"(d) prefill and critical latency — {d.mode} mode")
    axes[2].set_xlabel("simulated seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bars(rows: list[dict[str, Any]], path: Path) -> None:
    """Goodput and critical / standard p99 TTFT per run, the passes side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["run"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by = {(r["run"], r["mode"]): r for r in rows}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    width = 0.8 / max(1, len(modes))
    for ax, key, label in (
        (axes[0], "goodput", "goodput (completion tokens/s reaching clients)"),
        (axes[1], "critical_p99", "critical p99 TTFT (s, completed requests)"),
        (axes[2], "standard_p99", "standard p99 TTFT (s, completed requests)"),
    ):
        for i, mode in enumerate(modes):
            xs, ys = [], []
            for j, n in enumerate(names):
                r = by.get((n, mode))
                if r is not None and r.get(key) is not None:
                    xs.append(j + i * width)
                    ys.append(r[key])
            ax.bar(xs, ys, width, label=f"engine {' '.join(sim_flags(mode))}")
        ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(names))])
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Run the scenario; returns 0 when every run completed (whatever the targets)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mix", type=Path, default=HERE / "mix.yaml")
    ap.add_argument(
        "--passes",
        help=f"passes, comma-separated, from {', '.join(PASSES)} (-nochunk: the engine without "
        "chunked prefill); default: the mix's `passes`",
    )
    ap.add_argument("--speed", type=float, help="override the mix's simulator speed")
    ap.add_argument(
        "--duration", type=float, help="override the mix's traffic duration (simulated s)"
    )
    ap.add_argument("--drain", type=float, help="override the mix's drain (simulated s)")
    ap.add_argument(
        "--only", help="run only these runs (names, comma-separated, e.g. a-direct,d-adaptive)"
    )
    ap.add_argument("--no-write", action="store_true", help="print only; write no files")
    ap.add_argument(
        "--render",
        type=Path,
        metavar="RESULTS_JSON",
        help="run nothing: rebuild the table, plots and texts from a results.json of a run",
    )
    args = ap.parse_args(argv)
    if args.render:
        return render(args.render)
    mix = load_mix(args.mix)
    if args.speed:
        mix["speed"] = args.speed
    if args.duration:
        mix["duration"] = args.duration
    if args.drain:
        mix["drain"] = args.drain
    only = {n.strip() for n in args.only.split(",")} if args.only else None
    profile = get_profile(mix["profile"])
    model = profile.model
    full = build_traffic(mix, model)
    noburst = build_traffic(mix, model, burst=False)
    passes = args.passes.split(",") if args.passes else mix.get("passes", ["oom", "preempt"])
    modes = [m.strip() for m in passes if m.strip()]
    for m in modes:
        parse_pass(m)
    fractions = [float(f) for f in mix["runs"]["static"]["inflight_fractions"]]
    extra = 1 + len(mix["runs"].get("adaptive_variants", ()))
    plan_count = sum((3 + extra + len(fractions)) if m == modes[0] else 4 for m in modes)
    print(
        f"protection scenario: {profile.name} ({profile.kv_blocks * profile.block_size:,} KV "
        f"tokens), {mix['duration']} simulated s of traffic at speed {mix['speed']:g}, "
        f"{plan_count} runs",
        flush=True,
    )
    started = time.monotonic()
    runs: list[RunResult] = []
    best_fraction: float | None = None
    k = 0

    def do(name: str, mode: str, kind: str, traffic: TrafficMix, **kw: Any) -> RunResult | None:
        nonlocal k
        if only is not None and name not in only:
            return None
        k += 1
        print(
            f"[{k}{'' if only else f'/{plan_count}'}] {name} (engine {' '.join(sim_flags(mode))}) "
            f"at {time.monotonic() - started:.0f} s",
            flush=True,
        )
        r = run_one(mix, name=name, mode=mode, kind=kind, traffic=traffic, **kw)
        s = summarize(r, mix)
        print(
            f"    → OOMs {s['ooms']}, preemptions {s['preemptions']}, peak KV {s['kv_peak']:.2f}, "
            f"completed {s['completed']}/{s['sent']}, goodput {s['goodput']:,.0f} tok/s, "
            f"critical p99 TTFT {_s(s['critical_p99'])} s",
            flush=True,
        )
        for c in CLASSES:
            done, sent = s["done_by_class"][c]
            why = ", ".join(f"{k} {v}" for k, v in sorted(s["refused_by_class"][c].items()))
            print(f"      {c}: completed {done}/{sent}, refused: {why or 'none'}", flush=True)
        runs.append(r)
        return r

    for mode in modes:
        do("a-direct", mode, "direct", full)
        do("b-count", mode, "count_limit", full)
        if best_fraction is None:
            if not fractions:
                raise ValueError("mix.yaml: runs.static.inflight_fractions is empty")
            done = [
                do(f"c-static-{f:g}", mode, "static", full, inflight_fraction=f) for f in fractions
            ]
            best_fraction = best_static([summarize(r, mix) for r in done if r], mode)
            if best_fraction is not None:  # None: every static run left out by --only
                print(
                    f"    best static in-flight budget: {best_fraction:g} × KV capacity", flush=True
                )
        else:
            do(f"c-static-{best_fraction:g}", mode, "static", full, inflight_fraction=best_fraction)
        do("d-adaptive", mode, "adaptive", full)
        if mode == modes[0]:
            do("d-adaptive-noburst", mode, "adaptive", noburst)
            for variant in mix["runs"].get("adaptive_variants", ()):
                do(variant["name"], mode, "adaptive", full, overrides=variant)
    total = time.monotonic() - started
    rows = [summarize(r, mix) for r in runs]
    print()
    print(table(rows))
    verdict = targets(rows, modes[0], best_fraction)
    print()
    print("\n".join(verdict))
    print(f"\nwall time: {total:.0f} s")
    if not args.no_write:
        write_outputs(mix, runs, rows, verdict, total, modes, best_fraction)
    return 0


def render(path: Path) -> int:
    """Rebuild every output from a ``results.json`` (the measured data of an earlier run)."""
    data = json.loads(path.read_text())
    mix = data["mix"]
    runs = [RunResult(**r) for r in data["runs"]]
    modes = list(dict.fromkeys(r.mode for r in runs))
    rows = [summarize(r, mix) for r in runs]
    best_fraction = best_static(rows, modes[0])
    verdict = targets(rows, modes[0], best_fraction)
    print(table(rows))
    print("\n".join(verdict))
    write_outputs(
        mix,
        runs,
        rows,
        verdict,
        float(data["wall_seconds"]),
        modes,
        best_fraction,
        load_average_end=data.get("load_average_end"),
    )
    return 0


def target_checks(
    rows: list[dict[str, Any]], mode: str, best_fraction: float | None
) -> list[dict[str, Any]]:
    """The three targets of the protection scenario, judged on the ``mode`` pass: one dict per target whose
    runs are present, with ``line`` (the verdict line), ``met`` (bool) and ``margin`` (how far
    the measured value is from the bar, in words, from the same figures)."""
    by = {(r["run"], r["mode"]): r for r in rows}
    a, d = by.get(("a-direct", mode)), by.get(("d-adaptive", mode))
    nb = by.get(("d-adaptive-noburst", mode))
    c = by.get((f"c-static-{best_fraction:g}", mode)) if best_fraction is not None else None
    out: list[dict[str, Any]] = []
    if a and d:
        met = d["ooms"] == 0 and a["ooms"] >= 1
        out.append(
            {
                "line": f"- (d) 0 OOM where (a) has ≥ 1: (a) {a['ooms']} OOM, (d) {d['ooms']} OOM "
                f"— {'met' if met else 'NOT met'}",
                "met": met,
                "margin": f"OOMs: (a) {a['ooms']}, (d) {d['ooms']}",
            }
        )
    if c and d:
        ratio = d["goodput"] / c["goodput"] if c["goodput"] else 0.0
        margin = f"goodput: {ratio:.0%} of the best static against the 95% bar" + (
            f" (it could fall by {1 - 0.95 / ratio:.0%} and still meet it)"
            if ratio >= 0.95
            else f" (it would have to rise by {0.95 / ratio - 1:.0%} to meet it)"
            if ratio > 0
            else ""
        )
        out.append(
            {
                "line": f"- (d) goodput ≥ 95% of the best static (c-static-{best_fraction:g}): "
                f"{d['goodput']:,.0f} / {c['goodput']:,.0f} tok/s = {ratio:.0%} — "
                f"{'met' if ratio >= 0.95 else 'NOT met'}",
                "met": ratio >= 0.95,
                "margin": margin,
            }
        )
        # Only sheddable work may be given up under pressure: the target is judged on the
        # critical + standard requests completed; the all-classes ratio is shown beside it.
        done_d, done_c = int(d["completed"]), int(c["completed"])
        share_all = done_d / done_c if done_c else 0.0
        kept_d, kept_c = _completed_kept(d), _completed_kept(c)
        share = kept_d / kept_c if kept_c else 0.0
        out.append(
            {
                "line": "- (d) completed ≥ 95% of the best static's, critical + standard (only "
                f"sheddable work may be given up): {kept_d} / {kept_c} = {share:.0%} — "
                f"{'met' if share >= 0.95 else 'NOT met'} (all classes: {done_d} / {done_c} = "
                f"{share_all:.0%})",
                "met": share >= 0.95,
                "margin": f"completed (critical + standard): {share:.0%} of the best static "
                f"against the 95% bar (all classes: {share_all:.0%})",
            }
        )
        std_d, std_c = d["standard_p99"], c["standard_p99"]
        if std_d is not None and std_c is not None:
            ok = std_d <= std_c
            out.append(
                {
                    "line": f"- (d) standard p99 TTFT no worse than the best static's: "
                    f"{std_d:.2f} s vs {std_c:.2f} s — {'met' if ok else 'NOT met'}",
                    "met": ok,
                    "margin": f"standard p99: {std_d / std_c:.2f}× the best static's"
                    if std_c
                    else "standard p99: best static 0",
                }
            )
    if d and nb and d["critical_burst_p99"] is not None and nb["critical_burst_p99"]:
        ratio = d["critical_burst_p99"] / nb["critical_burst_p99"]
        out.append(
            {
                "line": "- critical p99 TTFT during the burst within 1.5× of no burst (chat sent in "
                "the burst window, (d) vs (d) without the burst): "
                f"{d['critical_burst_p99']:.2f} s (n={d['critical_burst_n']}) vs "
                f"{nb['critical_burst_p99']:.2f} s (n={nb['critical_burst_n']}) = {ratio:.2f}× "
                f"— {'met' if ratio <= 1.5 else 'NOT met'}",
                "met": ratio <= 1.5,
                "margin": f"burst p99: {ratio:.2f}× against the 1.5× bar"
                + (
                    f" ((d)'s burst p99 could grow {1.5 / ratio:.1f}× and still meet it)"
                    if 0 < ratio <= 1.5
                    else f" (it would have to fall to {1.5 / ratio:.0%} of itself to meet it)"
                    if ratio > 1.5
                    else ""
                ),
            }
        )
    e = by.get(("e-slo", mode))
    target = _slo_target(e)
    if e and target is not None and e.get("critical_windows"):
        wins = e["critical_windows"]
        good = sum(1 for _, p in wins if p is not None and p <= target)
        share = good / len(wins)
        out.append(
            {
                "line": f"- (e) critical TTFT p99 ≤ its {target:g} s target in ≥ 99% of 10 s "
                f"windows: {good} / {len(wins)} windows = {share:.0%} — "
                f"{'met' if share >= 0.99 else 'NOT met'}",
                "met": share >= 0.99,
                "margin": f"(e) windows meeting the target: {share:.0%} against the 99% bar",
            }
        )
    return out


def _completed_kept(row: dict[str, Any]) -> int:
    """Requests of the critical and standard classes that completed in the run ``row``."""
    by = row["done_by_class"]
    return int(by["critical"][0]) + int(by["standard"][0])


def _slo_target(row: dict[str, Any] | None) -> float | None:
    """The critical TTFT target (simulated seconds) of the run ``row`` was made with."""
    if row is None:
        return None
    t = (row.get("slo") or {}).get("critical") or {}
    value = t.get("ttft_p99_s")
    return float(value) if value is not None else None


def targets(rows: list[dict[str, Any]], mode: str, best_fraction: float | None) -> list[str]:
    """The verdict lines of :func:`target_checks`."""
    return [t["line"] for t in target_checks(rows, mode, best_fraction)]


def target_notes(rows: list[dict[str, Any]], mode: str, best_fraction: float | None) -> str:
    """The paragraph under the targets: each target's margin as measured, and which value the
    burst-window p99 is (its sorted index among how many TTFTs), all from ``rows``."""
    checks = target_checks(rows, mode, best_fraction)
    parts = []
    if checks:
        parts.append("Margins in this run: " + "; ".join(t["margin"] for t in checks) + ".")
    by = {(r["run"], r["mode"]): r for r in rows}
    ranks = []
    for name in ("d-adaptive", "d-adaptive-noburst"):
        r = by.get((name, mode))
        if r is not None and r["critical_burst_n"]:
            n = r["critical_burst_n"]
            idx, rank = p99_rank(n)
            ranks.append(f"{name}: n={n}, sorted index {idx}, the {_largest(rank)} of {n}")
    if ranks:
        parts.append(
            "The burst-window p99 is `percentile(v, 0.99)` = the value at sorted index "
            "round(0.99 × (n − 1)) of the critical TTFTs sent in the window ("
            + "; ".join(ranks)
            + "): one request's TTFT, so a single slow request moves it."
        )
    return "\n".join(parts)


def write_outputs(
    mix: dict[str, Any],
    runs: list[RunResult],
    rows: list[dict[str, Any]],
    verdict: list[str],
    total: float,
    modes: list[str],
    best_fraction: float | None,
    *,
    load_average_end: float | None = None,
) -> None:
    """results.json, the two plots, README.md and the RESULTS.md section. ``load_average_end``:
    the load average measured when the runs ended (default: now, right after a run)."""
    if load_average_end is None and hasattr(os, "getloadavg"):
        load_average_end = os.getloadavg()[0]
    first = modes[0]
    by = {(r.name, r.mode): r for r in runs}
    (HERE / "results.json").write_text(
        json.dumps(
            {
                "mix": mix,
                "rows": rows,
                "runs": [r.__dict__ for r in runs],
                "wall_seconds": total,
                "load_average_end": load_average_end,
            },
            separators=(",", ":"),
        )
    )
    if ("a-direct", first) in by and ("d-adaptive", first) in by:
        plot_timeline(
            by[("a-direct", first)],
            by[("d-adaptive", first)],
            mix,
            HERE / "protection_timeline.png",
        )
    plot_bars(rows, HERE / "protection_bars.png")
    load = json.loads((HERE / "results.json").read_text()).get("load_average_end")
    body = section_text(mix, rows, verdict, total, best_fraction, load)
    (HERE / "README.md").write_text(readme_text(mix, rows, verdict))
    results = ROOT / "benches" / "RESULTS.md"
    text = results.read_text() if results.exists() else "# Benchmark results\n"
    text = replace_section(text, SECTION, body)
    results.write_text(text)
    top = ROOT / "README.md"
    if top.exists():
        top.write_text(replace_marked(top.read_text(), readme_block(rows, verdict)))
    print(
        f"wrote {results.relative_to(ROOT)}, README.md (protection block), "
        "benches/protection/README.md, plots, results.json"
    )


README_BEGIN = "<!-- protection:begin (written by benches/protection/run.py) -->"
README_END = "<!-- protection:end -->"


def replace_marked(text: str, body: str) -> str:
    """``text`` with the block between :data:`README_BEGIN` and :data:`README_END` replaced by
    ``body`` (markers kept); unchanged when the markers are absent."""
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start == -1 or end == -1 or end < start:
        return text
    return text[: start + len(README_BEGIN)] + "\n" + body.strip("\n") + "\n" + text[end:]


def readme_block(rows: list[dict[str, Any]], verdict: list[str]) -> str:
    """The main README's protection block: the main plot, the table of the first mode, the
    targets."""
    return f"""![KV usage and kvgate's effective limits over time](benches/protection/protection_timeline.png)

{table([r for r in rows if r["mode"] == rows[0]["mode"]])}

{chr(10).join(verdict)}
"""


def section_text(
    mix: dict[str, Any],
    rows: list[dict[str, Any]],
    verdict: list[str],
    total: float,
    best_fraction: float | None,
    load: float | None,
) -> str:
    """The RESULTS.md section (also the body of the README snippet)."""
    profile = get_profile(mix["profile"])
    cap = profile.kv_blocks * profile.block_size
    load_text = "?" if load is None else f"{load:.1f}"
    mode = rows[0]["mode"] if rows else "oom"
    high, low = (mix["runs"]["adaptive"]["adaptive"][k] for k in ("high", "low"))
    firsts = [r["first_sample_t"] for r in rows if r.get("first_sample_t") is not None]
    first_t = f"{max(firsts):.1f}" if firsts else "?"
    spans = [r["elapsed"] for r in rows]
    elapsed_range = f"{min(spans):.0f}–{max(spans):.0f}" if spans else "?"
    return f"""{SECTION}

Command (regenerates this section, `benches/protection/README.md`, the plots and
`benches/protection/results.json`):

```
make bench-protect        # = .venv/bin/python benches/protection/run.py
```

Engine: `kvgate sim --profile {profile.name} --speed {mix["speed"]:g} --on-overflow oom|preempt`
({cap:,} KV tokens, 8×H800 / Llama-3.1-70B), with vLLM V1's chunked prefill ({profile.max_num_batched_tokens:,}
tokens per step, the simulator's default; passes `oom`, `preempt`) and without it
(`--no-chunked-prefill`, each prompt prefilled whole; passes `oom-nochunk`, `preempt-nochunk`). Traffic: `benches/protection/mix.yaml` (seed
{mix["seed"]}), {mix["duration"]} simulated seconds: critical chat (~300-token prompts, streamed),
standard ~16k-token document analysis, 50 long generations (~20k-token prompts, 2,048 generated
tokens each), a sheddable offline batch (summaries of ~8k tokens, embeddings), and at
t={mix["bursts"][0]["at"]} s ten ~32k-token prompts at once. Each run starts a fresh simulator.
Runs: (a) straight to the engine; (b) kvgate with a request-count limit only; (c) kvgate with
static joint limits (concurrency + TPM + an in-flight token budget of F × KV capacity, swept;
best F = {best_fraction}); (d) kvgate with adaptation and tenants (priority classes, guaranteed
slots for chat, a small TPM bucket), plus variants of (d) in the first pass: without the burst
(for the TTFT target) and each `adaptive_variants` entry of `mix.yaml`. Times are simulated
seconds (wall × {mix["speed"]:g}). Goodput = completion tokens that reached a client / the run's
elapsed simulated seconds, counted from the harness's clock start (just before the arrival
schedule is built; the sampler starts once it is built, and its first sample came at most
{first_t} s in) until the load generator returned (when the last request ended, or
{mix["drain"]} s after arrivals stopped at {mix["duration"]} s, whichever came first; elapsed
here: {elapsed_range} s). The arrivals are the same in every run, so with every request
completed, goodput mostly measures when the last request ended. TTFT over streamed requests that completed (critical: chat; standard: documents +
burst; sheddable: summaries; failed requests have none, so check "completed" next to it);
"refused" counts non-2xx answers (reasons from `x-kvgate-reject-reason`; `queued` = waited
`max_wait` in kvgate's priority queue and gave up; the direct engine answers 500 when it crashes
and 503 while it restarts); errors = streams broken by the crash.

{table(rows)}

Targets ({mode} pass):

{chr(10).join(verdict)}

{target_notes(rows, mode, best_fraction)}

{findings(mix, rows, best_fraction)}

Gateway notes (found with this benchmark):

1. Fixed — `rust/src/admission/mod.rs`, `Admission::admit`: the in-flight token check used the
   adaptively scaled budget for every request, including one that had just taken its tenant's
   guaranteed slot. While the long generations held their reservations and the scale was below
   1, the scaled budget fell under the tokens in flight and the critical tenant's ~560-token
   chat requests were refused (`inflight-tokens`) — all of the chat sent during the burst in
   the first version of this benchmark. A request on a guaranteed slot is now held to the base
   (unscaled) budget, which is still KV capacity × `capacity_safety_factor`, so the engine stays
   protected (Rust test `guaranteed_slot_keeps_the_base_inflight_budget_under_scale`).
2. Fixed — the adaptive scale used to multiply the in-flight token budget too, although that
   budget is already derived from the engine's KV capacity: KV usage was counted twice, and with
   the article's watermarks (0.85 / 0.70 against a budget of 0.9 × capacity) the law drove the
   budget under what was already held. The scale now acts on slots and TPM only; the budget is
   lowered only by what the engine holds beyond kvgate's own requests (its external KV
   occupancy), so (d) runs with the article's watermarks ({high:g} / {low:g}) and the previous
   0.95 / 0.85 is a variant.
3. Changed — the scale used to bind every class alike: between the watermarks it held the
   standard documents in kvgate's queue (and shedding, once on, kept them at the floor while
   KV usage hovered in the band) although the in-flight budget already kept the engine safe.
   Under memory pressure the sheddable class now gives way first: the scale binds it always,
   critical and standard only at or above the high watermark when the in-flight budget cannot
   guard the engine's memory (stale metrics, an engine queue, no stated KV capacity); see
   `docs/adaptive.md`.

![KV usage and effective limits](protection/protection_timeline.png)
![goodput and p99 TTFT per run](protection/protection_bars.png)

Measured on a 2-core machine (load average {load_text} at the end; the simulator's clock
stretches when the CPU is short, so figures move by some percent between runs); whole command:
{total:.0f} s wall.
"""


def findings(mix: dict[str, Any], rows: list[dict[str, Any]], best: float | None) -> str:
    """What the table says, run by run (every number from ``rows``)."""
    by = {(r["run"], r["mode"]): r for r in rows}
    out = ["What the runs show:", ""]

    def get(name: str, mode: str = "oom") -> dict[str, Any] | None:
        return by.get((name, mode))

    def frac(pair: list[int]) -> str:
        return f"{pair[0]}/{pair[1]}"

    if a := get("a-direct"):
        out.append(
            f"- (a) straight to the engine: {a['ooms']} OOM crash(es); "
            f"{sum(a['statuses'].values()) + a['errors']} requests failed (500 in the crash, 503 "
            f"while it restarted, broken streams); long generations finished "
            f"{frac(a['longgen_done'])}, burst prompts {frac(a['burst_done'])}."
        )
    if b := get("b-count"):
        conc = mix["runs"]["count_limit"]["max_concurrency"]
        out.append(
            f"- (b) a request-count limit ({conc} slots, nothing else): {b['ooms']} OOM, peak KV "
            f"{b['kv_peak']:.2f}, critical p99 TTFT {_s(b['critical_p99'])} s. "
            + (
                "Slots do not see prompt length: the long generations and the burst fit in the "
                "slots but not in the KV cache."
                if b["ooms"]
                else "No crash in this run, but the cache was full: the slots held back part of "
                "the load, and whether a decode step then finds no free block depends on timing, "
                "so a rerun can crash — the slot count does not see prompt length."
                if b["kv_peak"] >= 0.99
                else "The slot count kept the cache below full in this run."
            )
        )
    statics = [r for r in rows if r["run"].startswith("c-static-") and r["mode"] == "oom"]
    if statics:
        parts = ", ".join(
            f"{r['run'].removeprefix('c-static-')} → {r['ooms']} OOM, peak KV "
            f"{r['kv_peak']:.2f}, critical p99 {_s(r['critical_p99'])} s"
            for r in statics
        )
        p50s = [r["critical_p50"] for r in statics if r["critical_p50"] is not None]
        ooms = sum(r["ooms"] for r in statics)
        d_row = get("d-adaptive")
        out.append(
            f"- (c) static joint limits, in-flight budget sweep ({parts}): "
            + (
                "the in-flight token budget alone stops the OOM"
                if ooms == 0
                else f"{ooms} OOM(s) over the sweep"
            )
            + "; with every tenant alike the chat waits in the same queue as the long prompts"
            + (
                f": its median TTFT is {min(p50s):.2f}–{max(p50s):.2f} s across the sweep"
                if p50s
                else ""
            )
            + (
                f" (vs {d_row['critical_p50']:.2f} s in (d))."
                if p50s and d_row and d_row["critical_p50"] is not None
                else "."
            )
        )
    d = get("d-adaptive")
    if d:
        crit = d["done_by_class"]["critical"]
        shed = d["done_by_class"]["sheddable"]
        out.append(
            f"- (d) adaptation + tenants (base slots {mix['runs']['adaptive']['max_concurrency']}, "
            f"base in-flight budget "
            f"{mix['runs']['adaptive']['inflight_fraction']:g} × KV capacity, watermarks "
            f"{mix['runs']['adaptive']['adaptive']['high']:g} / "
            f"{mix['runs']['adaptive']['adaptive']['low']:g}, TPM bucket "
            f"{mix['runs']['adaptive'].get('burst_tokens') or 0:,} tokens): {d['ooms']} OOM, peak KV "
            f"{d['kv_peak']:.2f}; chat on "
            f"guaranteed slots and first in the priority queue: {frac(crit)} done, p99 TTFT "
            f"{_s(d['critical_p99'])} s; the burst finished {frac(d['burst_done'])}; the "
            f"sheddable batch gave way ({frac(shed)} done)."
        )
    if d:
        out.append(
            f"- (d) runs with the article's watermarks: the in-flight budget was below the "
            f"tokens already in flight for {d['squeezed_s']:.0f} simulated s (86 s before the "
            "in-flight budget stopped being scaled, gateway note 2)."
        )
    for name, what in (
        ("d-adaptive-0.95-0.85", "the previous watermarks, 0.95 / 0.85"),
        ("d-adaptive-no-prefill-budget", "without the prefill budget"),
        ("e-slo", "latency targets, no `max_concurrency` configured: the engine's own batch limit"),
    ):
        v = get(name)
        if v and d:
            out.append(
                f"- {name} ({what}): {v['completed']}/{v['sent']} completed (vs "
                f"{d['completed']} in (d)), goodput {v['goodput']:,.0f} tok/s, critical p99 "
                f"TTFT {_s(v['critical_p99'])} s ({_s(v['critical_burst_p99'])} s in the burst "
                f"window), standard p99 {_s(v['standard_p99'])} s."
            )
    mb, nb = get("d-adaptive-minute-bucket"), get("d-adaptive-noburst")
    if mb and d and nb and mb["critical_burst_p99"] and nb["critical_burst_p99"]:
        out.append(
            f"- d-adaptive-minute-bucket (as (d) with the default TPM bucket, one minute's worth): "
            f"goodput {mb['goodput']:,.0f} tok/s, critical p99 TTFT {_s(mb['critical_p99'])} s "
            f"overall and {_s(mb['critical_burst_p99'])} s in the burst window "
            f"({mb['critical_burst_p99'] / nb['critical_burst_p99']:.2f}× the no-burst run, vs "
            f"{(d['critical_burst_p99'] or 0) / nb['critical_burst_p99']:.2f}× for (d)). A big "
            "bucket lets several large prompts through at once (the long generations' 20k-token "
            "prompts at the start, the burst later) and the engine prefills them in one step "
            "while every running chat waits; the small bucket spaces them out."
        )
    ap, dp = get("a-direct", "preempt"), get("d-adaptive", "preempt")
    if ap and dp:
        out.append(
            f"- preempt pass (vLLM's behaviour, no crash): straight to the engine everything "
            f"completes ({ap['completed']}/{ap['sent']}, {ap['preemptions']} preemption(s)) and "
            f"goodput is {ap['goodput']:,.0f} tok/s vs {dp['goodput']:,.0f} with (d); what "
            f"kvgate buys there is the critical class's latency (p99 TTFT "
            f"{_s(ap['critical_p99'])} s direct vs {_s(dp['critical_p99'])} s with (d)), paid "
            "by the sheddable batch."
        )
    for mode in ("oom", "preempt"):
        for name in ("a-direct", "d-adaptive"):
            chunked, whole = get(name, mode), get(name, f"{mode}-nochunk")
            if chunked and whole:
                out.append(
                    f"- {name}, {mode}: with chunked prefill (vLLM V1's default) vs without "
                    f"(`{mode}-nochunk`): {chunked['ooms']} vs {whole['ooms']} OOM(s), "
                    f"{chunked['preemptions']} vs {whole['preemptions']} preemption(s), critical "
                    f"p99 TTFT {_s(chunked['critical_p99'])} vs {_s(whole['critical_p99'])} s, "
                    f"standard p99 TTFT {_s(chunked['standard_p99'])} vs "
                    f"{_s(whole['standard_p99'])} s, goodput {chunked['goodput']:,.0f} vs "
                    f"{whole['goodput']:,.0f} tok/s."
                )
    return "\n".join(out)


def readme_text(mix: dict[str, Any], rows: list[dict[str, Any]], verdict: list[str]) -> str:
    """``benches/protection/README.md``: the short version (main plot, table, targets)."""
    profile = get_profile(mix["profile"])
    cap = profile.kv_blocks * profile.block_size
    return f"""# Protection scenario: the same traffic with and without kvgate

The engine is the simulator with the 8×H800 / Llama-3.1-70B preset ({cap:,} KV tokens) in
crash-on-overflow mode (`kvgate sim --on-overflow oom`, vLLM V1's chunked prefill with
{profile.max_num_batched_tokens:,} tokens per step; the `-nochunk` passes prefill each prompt
whole); the traffic (`mix.yaml`, seeded) mixes
streamed critical chat, ~16k-token documents, 50 long generations, a sheddable batch and, at
t={mix["bursts"][0]["at"]} s, ten ~32k-token prompts at once. Straight to the engine the KV
cache fills and the engine crashes; behind kvgate (adaptation + tenants) it does not, the chat
keeps its latency, and the batch gives way.

![KV usage and kvgate's effective limits over time](protection_timeline.png)

{table([r for r in rows if r["mode"] == rows[0]["mode"]])}

{chr(10).join(verdict)}

![goodput and p99 TTFT per run](protection_bars.png)

Regenerate with `make bench-protect` (four passes: `oom`, `preempt`, `oom-nochunk`,
`preempt-nochunk`; about 10–12 minutes on 2 cores). Definitions, the other passes, what each
run shows and the gateway issues this benchmark found:
[`benches/RESULTS.md`](../RESULTS.md#protection-scenario).
"""


if __name__ == "__main__":
    raise SystemExit(main())
