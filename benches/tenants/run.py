"""A gateway holding 10 tenants and one holding 100,000, side by side in one run, end to end.

Each ``kvgate serve`` sits in front of the fast fixed-answer upstream
(``benches/load/fast_upstream.py``); every tenant has its own API key (``sk-t<i>``), its own
concurrency limit (1,000) and TPM (10^12), far above the load. ``wrk`` sends non-streamed chat
requests, each with the key of a tenant drawn at random from all the gateway's tenants
(``random_keys.lua``), so with 100,000 tenants nearly every request is the first of its tenant
for many seconds: its tenant's state (key, limits, usage rows, and with Redis its scope) is not
in the CPU caches. Setups: 10 and 100,000 tenants on the local store, and — with
``redis-server`` on the machine — the same on a Redis store (one replica each, its own key
prefix), and on a Redis store with standing slices (``store.standing_share`` 0.01: each
tenant's first request is admitted from the replica's slice, with no Redis call). Every gateway and the Redis server are pinned to the *server CPU*, ``wrk`` and the
upstream to the *client CPU*; the setups take turns in each round (reversed the next). Per
window: 2xx answers per second and the gateway's CPU per request (utime + stime from ``/proc``,
plus Redis's ``INFO cpu`` for Redis setups), and Redis calls per admission.

Then, per gateway: its resident memory (``VmRSS``), the time and size of ``GET /metrics`` and
``GET /dashboard/data`` and ``GET /admin/state`` (its first page of tenants) after every
window (100,000 tenants have sent requests), and, in this
process, the time and memory of loading the 100,000-tenant file as JSON and as YAML.

Prints a table and rewrites the ``## Tenant count, end to end`` section of
``benches/RESULTS.md`` (``--no-write``: only print). Needs ``wrk`` and ``taskset``. About 2
minutes on 2 cores.

Usage: ``.venv/bin/python benches/tenants/run.py [--rounds 4] [--duration 3] [--no-write]``
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = ROOT / "benches" / ".out"
RESULTS = ROOT / "benches" / "RESULTS.md"
SECTION = "## Tenant count, end to end"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent / "load"))
sys.path.insert(0, str(HERE.parent))

from run_load import Server, fast_upstream, free_port, tree_cpu_seconds  # noqa: E402

import core_results  # noqa: E402
from replicas.run import metric_value, redis_cpu_seconds  # noqa: E402

BODY = {
    "model": "fast",
    "messages": [{"role": "user", "content": "Hello there, how are you today?"}],
    "max_tokens": 16,
}
COUNTS = (10, 100_000)
#: the third store: Redis with standing slices of this share of each tenant limit, over the
#: default eight claims (a slice of 1,000 at once is one slot)
STANDING, STANDING_SHARE = "redis+standing", 0.01


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def config(upstream: str, port: int, tenants: int, store: dict[str, Any] | None) -> dict[str, Any]:
    """A gateway with ``tenants`` tenants ``t<i>`` (key ``sk-t<i>``) far from their limits."""
    cfg: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "backends": [
            {
                "name": "fast",
                "url": upstream,
                "models": [{"name": "fast", "context_window": 8192}],
                "max_concurrency": 100_000,
                "adaptive": {"enabled": False},
            }
        ],
        "tenants": [
            {
                "name": f"t{i}",
                "api_key_sha256": [sha(f"sk-t{i}")],
                "max_concurrency": 1000,
                "tokens_per_minute": 10**12,
            }
            for i in range(tenants)
        ],
        "access_log": {"enabled": False},
    }
    if store is not None:
        cfg["store"] = store
    return cfg


@dataclass
class Setup:
    name: str
    tenants: int
    store: str  # "local" or "redis"
    server: Server
    windows: list[dict[str, float]] = field(default_factory=list)
    after: dict[str, float] = field(default_factory=dict)


def get(url: str, timeout: float = 120.0) -> tuple[float, bytes]:
    """Seconds to answer ``GET url`` and the body."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read()
    return time.perf_counter() - t0, body


def counter(url: str, name: str) -> float:
    """The samples ``name`` of the gateway's ``/metrics``, summed."""
    return float(metric_value(get(url + "/metrics")[1].decode(), name))


def store_calls(url: str) -> tuple[int, int]:
    """Redis calls so far and the store's failures (timeouts, errors, late replies)."""
    store = json.loads(get(url + "/admin/state")[1])["store"]
    return int(store.get("calls", 0)), sum(int(v) for v in store.get("failures", {}).values())


def rss_mb(pid: int) -> float:
    """Resident memory (MB) of ``pid`` and its descendants (``VmRSS``)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
            if int(entry) != pid and ppid != pid:
                continue
            for line in Path(f"/proc/{entry}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
    return total


def redis_cpu(url: str | None) -> float:
    """CPU seconds the Redis server at ``url`` used so far; 0 without one."""
    return 0.0 if url is None else float(redis_cpu_seconds(url))


def wrk(setup: Setup, body: Path, args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    env = {
        **os.environ,
        "KVB_BODY": str(body),
        "KVB_KEYS": str(setup.tenants),
        "KVB_KEY_PREFIX": "sk-t",
    }
    argv = ["taskset", "-c", args.client_cpu, "wrk", "-t1", f"-c{args.connections}",
            f"-d{max(1, round(seconds))}s", "--timeout", "10s", "-s",
            str(HERE / "random_keys.lua"), setup.server.url + "/v1/chat/completions"]  # fmt: skip
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=seconds + 60)
    for line in out.stdout.splitlines():
        if line.startswith("KVB "):
            return dict(json.loads(line[4:]))
    raise RuntimeError(f"wrk gave no summary: {out.stdout[-800:]} {out.stderr[-800:]}")


def window(setup: Setup, body: Path, args: argparse.Namespace, redis_url: str | None) -> None:
    url = setup.server.url
    pid = setup.server.proc.pid if setup.server.proc is not None else 0
    on_redis = setup.store != "local"
    adm0 = counter(url, "kvgate_admission_seconds_count")
    calls0, failed0 = store_calls(url) if on_redis else (0, 0)
    cpu0, rcpu0 = tree_cpu_seconds(pid), redis_cpu(redis_url if on_redis else None)
    r = wrk(setup, body, args, args.duration)
    cpu1, rcpu1 = tree_cpu_seconds(pid), redis_cpu(redis_url if on_redis else None)
    time.sleep(0.3)  # the last requests settle
    adm1 = counter(url, "kvgate_admission_seconds_count")
    calls1, failed1 = store_calls(url) if on_redis else (0, 0)
    n = r["requests"]
    ok = n - r["status_errors"]
    setup.windows.append(
        {
            "rps": ok / (r["duration_us"] / 1e6),
            "non_2xx": r["status_errors"],
            "socket_errors": r["connect"] + r["read"] + r["write"] + r["timeout"],
            "cpu_us": (cpu1 - cpu0 + rcpu1 - rcpu0) / n * 1e6 if n else float("nan"),
            "redis_us": (rcpu1 - rcpu0) / n * 1e6 if n else float("nan"),
            "calls_per_admission": (calls1 - calls0) / (adm1 - adm0) if adm1 > adm0 else 0.0,
            "store_failures": failed1 - failed0,
            "p50_ms": r["p50_us"] / 1000,
        }
    )


def standing_usable(url: str, timeout: float = 60.0) -> None:
    """Waits until the gateway at ``url`` may use its standing slices (a fresh claims hash
    settles for two leases first)."""
    deadline = time.monotonic() + timeout
    while json.loads(get(url + "/admin/state")[1])["store"]["standing"]["usable_s"] <= 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: no standing claim within {timeout:.0f} s")
        time.sleep(0.2)


def after_phase(setup: Setup) -> None:
    url = setup.server.url
    pid = setup.server.proc.pid if setup.server.proc is not None else 0
    setup.after["rss_mb"] = rss_mb(pid)
    secs, body = get(url + "/metrics")
    setup.after["metrics_s"], setup.after["metrics_kb"] = secs, len(body) / 1000
    secs, body = get(url + "/dashboard/data")
    setup.after["dashboard_s"], setup.after["dashboard_kb"] = secs, len(body) / 1000
    secs, body = get(url + "/admin/state")  # its first page of tenants
    setup.after["state_s"], setup.after["state_kb"] = secs, len(body) / 1000
    setup.after["tenants_seen"] = float(
        len({row["tenant"] for row in json.loads(get(url + "/admin/usage")[1])["data"]})
    )


def load_cost(cfg: dict[str, Any], logdir: Path) -> dict[str, tuple[float, float]]:
    """Seconds and peak memory growth (MB) of :func:`kvgate.config.load_config` on ``cfg``
    written as JSON and as YAML, each in a fresh process."""
    out = {}
    for kind, text in (
        ("json", json.dumps(cfg)),
        ("yaml", yaml.safe_dump(cfg, sort_keys=False)),
    ):
        path = logdir / f"tenants.{kind}"
        path.write_text(text)
        # VmHWM (this process's peak resident memory; ru_maxrss would carry the parent's
        # across exec) after the load, less VmRSS before it
        code = (
            "import sys, time\n"
            "from kvgate.config import load_config\n"
            "def kb(field):\n"
            "    for line in open('/proc/self/status'):\n"
            "        if line.startswith(field): return int(line.split()[1])\n"
            "m0 = kb('VmRSS:')\n"
            "t0 = time.perf_counter(); load_config(sys.argv[1])\n"
            "print(time.perf_counter() - t0, (kb('VmHWM:') - m0) / 1024)\n"
        )
        res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                             text=True, check=True, timeout=600)  # fmt: skip
        secs, mb = (float(x) for x in res.stdout.split())
        out[kind] = (secs, mb)
    return out


def start_all(up: Server, servers: list[Server], args: argparse.Namespace, logdir: Path) -> None:
    """Starts the upstream on the client CPU and ``servers`` on the server CPU, and waits for
    each to answer."""
    up.start(args.client_cpu, logdir)
    up.wait_ready(60)
    for s in servers:
        s.start(args.server_cpu, logdir)
    for s in servers:
        s.wait_ready(180)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def render(setups: list[Setup], load: dict[str, tuple[float, float]], machine: str,
           args: argparse.Namespace, secs: float) -> str:  # fmt: skip
    by = {(s.tenants, s.store): s for s in setups}
    lines = [
        SECTION,
        "",
        f"`{args.cmdline or 'make bench-tenants'}` (`benches/tenants/run.py`), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {secs:.0f} s; every figure "
        "below comes from that run.",
        "",
        machine,
        "",
        "A gateway holding 10 tenants and one holding 100,000, each request with the key of a "
        "tenant drawn at random from all of them (`wrk`, "
        f"{args.connections} connections, {args.rounds} rounds of {args.duration:g} s windows "
        "after a warm-up, the setups in turn, reversed every other round; non-streamed chat "
        "requests to the fast fixed-answer upstream; the gateways and Redis pinned to one core, "
        "`wrk` and the upstream to the other). CPU per request: the gateway's utime + stime "
        "(and Redis's: its share in the next column). Medians over the rounds:",
        "",
        "| store | tenants | 2xx/s | CPU µs/request | of which Redis | ÷ 10 tenants (CPU) | "
        "Redis calls per admission | p50 ms | non-2xx |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in setups:
        base = by[(10, s.store)]
        cpu = median([w["cpu_us"] for w in s.windows])
        ratio = cpu / median([w["cpu_us"] for w in base.windows])
        on_redis = s.store != "local"
        calls = f"{median([w['calls_per_admission'] for w in s.windows]):.4f}" if on_redis else "–"
        of_redis = (
            f"{median([w.get('redis_us', float('nan')) for w in s.windows]):.0f}"
            if on_redis
            else "–"
        )
        lines.append(
            f"| {s.store} | {s.tenants:,} | {median([w['rps'] for w in s.windows]):,.0f} | "
            f"{cpu:.0f} | {of_redis} | {ratio:.3f}× | {calls} | {median([w['p50_ms'] for w in s.windows]):.2f}"
            f" | {sum(int(w['non_2xx']) for w in s.windows)} |"
        )
    verdicts = []
    for store in dict.fromkeys(s.store for s in setups):
        ratio = median([w["cpu_us"] for w in by[(COUNTS[-1], store)].windows]) / median(
            [w["cpu_us"] for w in by[(COUNTS[0], store)].windows]
        )
        verdicts.append(
            f"{store} store {ratio:.2f}×: " + ("met" if ratio <= 1.10 else "**not met**")
        )
    lines += [
        "",
        "Target: the CPU per request with 100,000 tenants within 10 % of the CPU per request "
        "with 10 — " + "; ".join(verdicts) + ".",
    ]
    lines += [
        "",
        "After the rounds (the 100,000-tenant gateways have seen requests of the tenants in "
        "`tenants seen`):",
        "",
        "| store | tenants | tenants seen | resident memory MB | GET /metrics s / kB | "
        "GET /dashboard/data s / kB | GET /admin/state s / kB |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in setups:
        a = s.after
        lines.append(
            f"| {s.store} | {s.tenants:,} | {a['tenants_seen']:,.0f} | {a['rss_mb']:.0f} | "
            f"{a['metrics_s']:.3f} / {a['metrics_kb']:.1f} | "
            f"{a['dashboard_s']:.3f} / {a['dashboard_kb']:.1f} | "
            f"{a['state_s']:.3f} / {a['state_kb']:.1f} |"
        )
    j, y = load["json"], load["yaml"]
    lines += [
        "",
        f"Loading the 100,000-tenant configuration (`load_config`, a fresh process each): as "
        f"JSON {j[0]:.1f} s and {j[1]:.0f} MB of peak memory growth, as YAML {y[0]:.1f} s and "
        f"{y[1]:.0f} MB.",
        "",
        "Each window:",
        "",
        "| round | store | tenants | 2xx/s | CPU µs/request | Redis calls per admission | store "
        "failures (timeouts, late replies) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in range(args.rounds):
        for s in setups:
            w = s.windows[r]
            lines.append(
                f"| {r + 1} | {s.store} | {s.tenants:,} | {w['rps']:,.0f} | {w['cpu_us']:.0f} | "
                + (
                    f"{w['calls_per_admission']:.4f} | {w.get('store_failures', 0):.0f} |"
                    if s.store != "local"
                    else "– | – |"
                )
            )
    return "\n".join(lines) + "\n"


def load_arguments(doc: str, rounds: int, duration: float) -> argparse.ArgumentParser:
    """The command line of a bench driven by :func:`wrk` (rounds of windows, CPUs, connections,
    ``--no-write``), with ``doc``'s first paragraph as its description."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=rounds, help=f"rounds (default {rounds})")
    p.add_argument("--duration", type=float, default=duration,
                   help=f"seconds per window (default {duration:g})")  # fmt: skip
    p.add_argument("--warmup", type=float, default=2, help="warm-up seconds per setup")
    p.add_argument("--connections", type=int, default=32, help="wrk connections")
    p.add_argument("--server-cpu", default="1", help="taskset CPU list for gateways and Redis")
    p.add_argument("--client-cpu", default="0", help="taskset CPU list for wrk and upstream")
    p.add_argument("--no-write", action="store_true", help="do not touch benches/RESULTS.md")
    return p


def run_dir(prefix: str) -> tuple[Path, Path]:
    """A fresh directory for one run's logs under ``benches/.out`` (named ``prefix``…) and the
    request body file in it (:data:`BODY`)."""
    OUT.mkdir(parents=True, exist_ok=True)
    logdir = Path(tempfile.mkdtemp(prefix=prefix, dir=OUT))
    body = logdir / "body.json"
    body.write_text(json.dumps(BODY))
    return logdir, body


def missing(tools: tuple[str, ...], who: str) -> bool:
    """Whether one of ``tools`` is not installed (said on stderr, with its Debian package)."""
    for tool in tools:
        if shutil.which(tool) is None:
            print(f"{who}: `{tool}` not found (apt-get install -y {tool})", file=sys.stderr)
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    p = load_arguments(__doc__, rounds=4, duration=3)
    p.add_argument("--no-redis", action="store_true", help="the local store only")
    p.add_argument("--cmdline", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if missing(("wrk", "taskset"), "tenants bench"):
        return 2
    use_redis = not args.no_redis and shutil.which("redis-server") is not None
    t0 = time.monotonic()
    load_start = os.getloadavg()
    logdir, body = run_dir("tenants-")
    py = sys.executable
    up = fast_upstream()
    stack = contextlib.ExitStack()
    redis_url = None
    redis_note = "no Redis"
    if use_redis:
        from tests.store.redis_servers import start_redis

        redis = stack.enter_context(start_redis(logdir / "redis"))
        subprocess.run(["taskset", "-p", "-c", args.server_cpu, str(redis.pid)],
                       check=True, capture_output=True)  # fmt: skip
        redis_url = redis.url
        redis_note = f"redis-server {redis.client().info('server')['redis_version']}"
    setups: list[Setup] = []
    for store in ("local", "redis", STANDING) if use_redis else ("local",):
        for n in COUNTS:
            port = free_port()
            st: dict[str, Any] | None = None
            if store != "local":
                st = {"url": redis_url, "key_prefix": f"kvgten{n}{store[-1]}"}
                if store == STANDING:
                    st["standing_share"] = STANDING_SHARE
            path = logdir / f"{store}-{n}.json"
            path.write_text(json.dumps(config(up.url, port, n, st)))
            argv = [py, "-m", "kvgate", "serve", "--config", str(path), "--log-level", "WARNING"]
            setups.append(
                Setup(f"{store} {n}", n, store, Server(f"{store}-{n}", argv, port, "/healthz"))
            )
    try:
        with stack:
            start_all(up, [s.server for s in setups], args, logdir)
            for s in setups:
                if s.store == STANDING:
                    standing_usable(s.server.url)
            for s in setups:  # warm-up: the first requests of each gateway
                wrk(s, body, args, args.warmup)
            for r in range(args.rounds):
                for s in setups if r % 2 == 0 else setups[::-1]:
                    window(s, body, args, redis_url)
                    w = s.windows[-1]
                    print(
                        f"  round {r + 1} {s.name:<14} {w['rps']:8,.0f} 2xx/s  "
                        f"{w['cpu_us']:5.0f} µs/request  calls/admission "
                        f"{w['calls_per_admission']:.4f}  non-2xx {w['non_2xx']:.0f}",
                        flush=True,
                    )
            for s in setups:
                after_phase(s)
    finally:
        for s in setups:
            s.server.stop()
        up.stop()
    load = load_cost(config("http://127.0.0.1:9", 9, COUNTS[-1], None), logdir)
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    machine = (
        f"Machine: {os.cpu_count()} vCPUs ({model}), shared (load average "
        f"{load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end). {redis_note}. "
        f"Python {platform.python_version()}, aiohttp {aiohttp.__version__}, uvloop."
    )
    publish(SECTION, render(setups, load, machine, args, time.monotonic() - t0), args.no_write)
    return 0


def publish(section: str, text: str, no_write: bool) -> None:
    """Prints ``text`` and, unless ``no_write``, makes it the ``section`` of
    ``benches/RESULTS.md``."""
    print("\n" + text)
    if not no_write:
        core_results.write_section(RESULTS, section, text)
        print(f"wrote {section!r} in {RESULTS.relative_to(ROOT)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
