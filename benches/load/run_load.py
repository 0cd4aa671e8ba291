"""Gateway load benchmark: kvgate side by side with bare aiohttp baselines and
LiteLLM's proxy, in one run, on one machine.

Targets (all servers pinned to one core with ``taskset``, the ``wrk`` load generator to another):

- ``direct``: the fast upstream (``fast_upstream.py``) itself;
- ``bare-429``: an aiohttp handler that only answers 429 (``bare_429.py``);
- ``bare-proxy``: a bare aiohttp pass-through proxy with one pooled session (``bare_proxy.py``);
- ``kvgate-refuse-{1,2}w``: ``kvgate serve`` whose backend TPM bucket (60 tokens/minute) is
  empty, so every request is refused by the admission core (503, reason ``backend-tpm``, computed
  ``Retry-After``) after body read, tenant lookup and request analysis;
- ``kvgate-{1,2}w``: ``kvgate serve`` with limits far above the load (every request admitted,
  reserved, forwarded and settled);
- ``litellm``: LiteLLM's proxy with a per-deployment parallel-request limit and TPM/RPM limits,
  installed into ``benches/.out/litellm-venv`` (skipped with a message if it cannot be).

For each target: requests/s (closed loop, ``--connections`` connections), CPU time per request of
the server's process tree (utime+stime from ``/proc``, before/after), p50 latency; then p50
latency with one connection, and the latency added versus ``direct``. The section
``## Gateway load`` of ``benches/RESULTS.md`` is rewritten with the figures.

Usage: ``.venv/bin/python benches/load/run_load.py [--rounds 2] [--duration 6] [--no-litellm]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = ROOT / "benches" / ".out"
RESULTS = ROOT / "benches" / "RESULTS.md"
SECTION = "## Gateway load"
sys.path.insert(0, str(HERE.parent))
import core_results  # noqa: E402

LITELLM_VENV = OUT / "litellm-venv"
CLK_TCK = os.sysconf("SC_CLK_TCK")

BODY = {
    "model": "fast",
    "messages": [{"role": "user", "content": "Hello there, how are you today?"}],
    "max_tokens": 16,
}
STREAM_BODY = {**BODY, "stream": True, "stream_options": {"include_usage": True}}


# ---- processes ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A server process (tree) pinned to the server core."""

    name: str
    argv: list[str]
    port: int
    ready_path: str = "/v1/models"
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, cpu: str, logdir: Path) -> None:
        self.log = logdir / f"{self.name}.log"
        env = {**os.environ, **self.env}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["taskset", "-c", cpu, *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # it answers HTTP: up
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s: {self.tail()}")

    def tail(self) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")[-1500:]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # the server runs in its own session: signal its process group (its workers)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=5)


def fast_upstream() -> Server:
    """The fast fixed-answer upstream (``fast_upstream.py``) on a free port, not yet started."""
    port = free_port()
    return Server("upstream", [sys.executable, str(HERE / "fast_upstream.py"), str(port)], port)


def tree_cpu_seconds(root: int) -> float:
    """utime+stime (seconds) of ``root`` and all its descendants, from ``/proc/<pid>/stat``."""
    parents: dict[int, int] = {}
    times: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        rest = raw[raw.rindex(b")") + 2 :].split()
        pid = int(entry)
        parents[pid] = int(rest[1])
        times[pid] = int(rest[11]) + int(rest[12])
    tree = {root}
    grew = True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return sum(times.get(pid, 0) for pid in tree) / CLK_TCK


def settle(servers: list[Server], *, quiet: float = 0.03, limit: float = 45.0) -> float:
    """Wait until the idle servers (all pinned to the server core) use less than ``quiet`` of a
    core together over one second — a server still starting up (LiteLLM keeps working for a
    while after it answers its health check) would otherwise take CPU from whatever is measured
    next. Returns the seconds waited (``limit`` at most)."""
    started = time.monotonic()
    pids = [s.proc.pid for s in servers if s.proc is not None and s.proc.poll() is None]
    before = sum(tree_cpu_seconds(pid) for pid in pids)
    while time.monotonic() - started < limit:
        time.sleep(1.0)
        now = sum(tree_cpu_seconds(pid) for pid in pids)
        used, before = now - before, now
        if used < quiet:
            break
    return time.monotonic() - started


# ---- load generation ------------------------------------------------------------------------
@dataclass
class Measure:
    target: str
    path: str
    connections: int
    requests: int
    seconds: float
    rps: float
    cpu_us_per_req: float | None
    p50_ms: float
    p99_ms: float
    status_errors: int
    socket_errors: int

    @property
    def ok_rps(self) -> float:
        """2xx answers per second (what "admitted req/s" compares)."""
        return (self.requests - self.status_errors) / self.seconds if self.seconds else 0.0


def run_wrk(
    url: str,
    body_file: Path,
    *,
    connections: int,
    seconds: float,
    cpu: str,
    headers: dict[str, str] | None = None,
) -> dict[str, float]:
    env = {**os.environ, "KVB_BODY": str(body_file)}
    argv = [
        "taskset",
        "-c",
        cpu,
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "10s",
        "-s",
        str(HERE / "post.lua"),
    ]
    for k, v in (headers or {}).items():
        argv += ["-H", f"{k}: {v}"]
    argv.append(url + "/v1/chat/completions")
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=seconds + 60)
    for line in out.stdout.splitlines():
        if line.startswith("KVB "):
            return json.loads(line[4:])
    raise RuntimeError(f"wrk gave no summary: {out.stdout[-800:]} {out.stderr[-800:]}")


@dataclass
class Target:
    """One measured thing: a server, the request body, the expected outcome."""

    name: str
    path: str  # "refuse", "admit", "admit-stream"
    server: Server
    body: Path
    refuse: bool = False
    headers: dict[str, str] = field(default_factory=dict)


def measure(t: Target, *, connections: int, seconds: float, warmup: float, cpu: str) -> Measure:
    if warmup > 0:
        warm = run_wrk(
            t.server.url, t.body, connections=connections, seconds=warmup, cpu=cpu,
            headers=t.headers,
        )  # fmt: skip
        # the requests wrk abandoned when the warm-up ended are still being served: let them
        # finish (about their p99 latency) before the window opens, or their CPU would be
        # counted against the window's requests (LiteLLM: ~0.35 s of work)
        time.sleep(min(2.0, 1.5 * warm["p99_us"] / 1e6))
    assert t.server.proc is not None
    before = tree_cpu_seconds(t.server.proc.pid)
    r = run_wrk(
        t.server.url, t.body, connections=connections, seconds=seconds, cpu=cpu, headers=t.headers
    )
    after = tree_cpu_seconds(t.server.proc.pid)
    n = int(r["requests"])
    secs = r["duration_us"] / 1e6
    return Measure(
        target=t.name,
        path=t.path,
        connections=connections,
        requests=n,
        seconds=secs,
        rps=n / secs if secs else 0.0,
        cpu_us_per_req=(after - before) / n * 1e6 if n else None,
        p50_ms=r["p50_us"] / 1000,
        p99_ms=r["p99_us"] / 1000,
        status_errors=int(r["status_errors"]),
        socket_errors=int(r["connect"] + r["read"] + r["write"] + r["timeout"]),
    )


# ---- checks before measuring ----------------------------------------------------------------
def probe(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def check_target(t: Target) -> str:
    # a refusal target admits its first request(s) until its TPM bucket is empty
    for _ in range(5 if t.refuse else 1):
        status, headers, raw = probe(t.server.url, t.body.read_bytes(), t.headers)
        if status != 200:
            break
    lower = {k.lower(): v for k, v in headers.items()}
    if t.refuse:
        if status not in (429, 503):
            raise RuntimeError(f"{t.name}: expected a refusal, got {status}: {raw[:300]!r}")
        reason = lower.get("x-kvgate-reject-reason", "-")
        return f"{status} reason={reason} retry-after={lower.get('retry-after', '-')}"
    if status != 200:
        raise RuntimeError(f"{t.name}: expected 200, got {status}: {raw[:300]!r}")
    if t.path == "admit-stream":
        if b"data: [DONE]" not in raw:
            raise RuntimeError(f"{t.name}: stream without [DONE]: {raw[:300]!r}")
        return f"200 stream {raw.count(b'data: ')} events"
    if b'"usage"' not in raw:
        raise RuntimeError(f"{t.name}: no usage in {raw[:300]!r}")
    return "200"


# ---- LiteLLM --------------------------------------------------------------------------------
def litellm_ready(log: list[str]) -> Path | None:
    """The LiteLLM CLI in its own venv, installing it if needed; ``None`` if it cannot be."""
    exe = LITELLM_VENV / "bin" / "litellm"
    if exe.exists():
        return exe
    log.append("installing litellm[proxy] into benches/.out/litellm-venv")
    print("  installing litellm[proxy] into benches/.out/litellm-venv ...", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True, timeout=120)
        subprocess.run(
            [str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"],
            check=True,
            timeout=600,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        log.append(f"LiteLLM install failed ({exc}); LiteLLM skipped")
        return None
    return exe if exe.exists() else None


LITELLM_KEY = "sk-kvgate-bench"


def litellm_config(upstream: str, path: Path) -> None:
    """LiteLLM proxy config: the fast upstream as an OpenAI-compatible deployment with LiteLLM's
    own limits, all far above the load (every request admitted, as on kvgate's admit path):
    the deployment's ``tpm``/``rpm`` with ``usage-based-routing-v2`` (its TPM/RPM-aware router,
    which answers 429 when a deployment's TPM would be exceeded), the deployment's
    ``max_parallel_requests`` (router semaphore) and ``global_max_parallel_requests`` (the
    proxy's parallel-request limiter). A master key, no database."""
    path.write_text(
        f"""model_list:
  - model_name: fast
    litellm_params:
      model: openai/fast
      api_base: {upstream}/v1
      api_key: sk-none
      max_parallel_requests: 1000
      tpm: 1000000000
      rpm: 10000000
router_settings:
  routing_strategy: usage-based-routing-v2
litellm_settings:
  telemetry: false
general_settings:
  master_key: {LITELLM_KEY}
  global_max_parallel_requests: 1000
"""
    )


# ---- report ---------------------------------------------------------------------------------
def fmt(v: float | None, spec: str = ",.0f") -> str:
    return "–" if v is None else format(v, spec)


def ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or b is None or b == 0 else f"{a / b:.2f}×"


def verdict(value: float | None, target: str) -> str:
    """``met`` / ``not met`` of an unrounded ``value`` against a target written ``≤ X×``,
    ``≥ X×`` or ``< X ms`` (value in the same unit); ``""`` when there is none or no value."""
    if value is None or not target or target[0] not in "≤≥<":
        return ""
    bound = float(target[1:].strip().split()[0].rstrip("×"))
    ok = {"≤": value <= bound, "≥": value >= bound, "<": value < bound}[target[0]]
    return "met" if ok else "not met"


def machine_notes(server_cpu: str, client_cpu: str, load_start: tuple, load_end: tuple) -> str:
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import aiohttp

    wrk_v = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.split(" [")[0]
    return (
        f"Machine: {os.cpu_count()} vCPUs ({model}), shared with other jobs (load average "
        f"{load_start[0]:.2f} at start, {load_end[0]:.2f} at end). Servers pinned with "
        f"`taskset -c {server_cpu}` (the fast upstream, the baselines, every kvgate instance and "
        f"its workers, LiteLLM), the load generator with `taskset -c {client_cpu}` "
        f"(`{wrk_v.strip()}`, 1 thread). Python {platform.python_version()}, aiohttp "
        f"{aiohttp.__version__}, uvloop in every Python server."
    )


def write_section(text: str) -> None:
    """Replaces (or appends) :data:`SECTION` in ``benches/RESULTS.md``."""
    core_results.write_section(RESULTS, SECTION, text)


def target_rows(
    res: dict[str, Measure], lat: dict[str, Measure]
) -> list[tuple[str, str, str, str]]:
    """``(what, measured, target, verdict)`` rows of one round: the ratios the issues set
    targets on; the verdict compares the unrounded value (``verdict``)."""

    def cpu(key: str) -> float | None:
        m = res.get(key)
        return m.cpu_us_per_req if m else None

    def rps(key: str) -> float | None:
        m = res.get(key)
        return m.ok_rps if m else None

    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    def row(what: str, value: float | None, target: str) -> tuple[str, str, str, str]:
        return (what, "–" if value is None else f"{value:.2f}×", target, verdict(value, target))

    def added(what: str, key: str, base: str, target: str) -> tuple[str, str, str, str]:
        a, b = lat.get(key), lat.get(base)
        if a is None or b is None:
            return (what, "–", target, "")
        us = (a.p50_ms - b.p50_ms) * 1000
        return (what, f"{us:,.0f} µs", target, verdict(us / 1000, target))

    rows = []
    for w in (1, 2):
        rows.append(
            row(
                f"refusal CPU/request, kvgate {w}w ÷ bare-429",
                div(cpu(f"kvgate-refuse-{w}w/refuse"), cpu("bare-429/refuse")),
                "≤ 1.2×",
            )
        )
    refuse_cpu = cpu("kvgate-refuse-1w/refuse")
    rows.append(
        (
            "refusals/s one fully used core could make, kvgate 1w (1 s ÷ CPU per refusal)",
            fmt(1e6 / refuse_cpu if refuse_cpu else None),
            "–",
            "",
        )
    )
    for w in (1, 2):
        for path in ("admit", "admit-stream"):
            rows.append(
                row(
                    f"{path} CPU/request, kvgate {w}w ÷ bare-proxy",
                    div(cpu(f"kvgate-{w}w/{path}"), cpu(f"bare-proxy/{path}")),
                    "≤ 1.15×",
                )
            )
    for path in ("admit", "admit-stream"):
        for w in (1, 2):
            rows.append(
                added(
                    f"{path} p50 added latency (c=1), kvgate {w}w vs direct",
                    f"kvgate-{w}w/{path}",
                    f"direct/{path}",
                    "< 1 ms",
                )
            )
        rows.append(
            added(
                f"{path} p50 added latency (c=1), bare-proxy vs direct",
                f"bare-proxy/{path}",
                f"direct/{path}",
                "(baseline)",
            )
        )
    rows.append(
        added(
            "refuse p50 added latency (c=1), kvgate-refuse 1w vs bare-429",
            "kvgate-refuse-1w/refuse",
            "bare-429/refuse",
            "–",
        )
    )
    if "litellm/admit" in res:
        for path in ("admit", "admit-stream"):
            for w in (1, 2):
                rows.append(
                    row(
                        f"{path} admitted (2xx) req/s, kvgate {w}w ÷ LiteLLM",
                        div(rps(f"kvgate-{w}w/{path}"), rps(f"litellm/{path}")),
                        "≥ 30×",
                    )
                )
            rows.append(
                row(
                    f"{path} CPU/request, LiteLLM ÷ kvgate 1w",
                    div(cpu(f"litellm/{path}"), cpu(f"kvgate-1w/{path}")),
                    "–",
                )
            )
    return rows


def round_table(
    args: argparse.Namespace, res: dict[str, Measure], lat: dict[str, Measure]
) -> list[str]:
    c = args.connections
    lines = [
        f"| target | path | req/s (c={c}) | CPU µs/request | p50 ms (c={c}) | p50 µs (c=1) "
        "| non-2xx | socket errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, m in res.items():
        lm = lat.get(key)
        lines.append(
            f"| {m.target} | {m.path} | {fmt(m.rps)} | {fmt(m.cpu_us_per_req)} | "
            f"{m.p50_ms:.2f} | {fmt(lm.p50_ms * 1000 if lm else None)} | "
            f"{m.status_errors:,} | {m.socket_errors:,} |"
        )
    return lines


def render(
    args: argparse.Namespace,
    rounds: list[dict[str, Measure]],
    lat_rounds: list[dict[str, Measure]],
    checks: list[str],
    notes: list[str],
    machine: str,
    elapsed: float,
) -> str:
    cmd = args.cmdline or "make bench-load   # = .venv/bin/python benches/load/run_load.py"
    lines = [
        SECTION,
        "",
        f"Command (one run, every target side by side, {len(rounds)} rounds; {elapsed:.0f} s "
        "wall, written by the command itself):",
        "",
        "```",
        cmd,
        "```",
        "",
        machine,
        "",
        f"Closed loop: `wrk -t1 -c{args.connections}` for {args.duration:g} s per target and "
        f"round after a {args.warmup:g} s warm-up (and a pause of 1.5 × the warm-up's p99 "
        "latency, so the requests it abandoned are finished); CPU per request = utime+stime of "
        "the server's whole process tree (kvgate: master + workers; not the upstream) over the "
        "measured window ÷ requests completed (a slow server also spends part of the window "
        f"on the up to {args.connections} requests still in flight when wrk stops: about "
        "0.1% for kvgate, a few % for LiteLLM). Admitted req/s counts 2xx answers only. "
        "Raw measurements: `benches/.out/load.json`. Added latency: `wrk -t1 -c1` for "
        f"{args.latency_duration:g} s, p50 minus the p50 of `direct` on the same path. Body: a "
        "one-message chat completion with `max_tokens: 16` (streaming: `stream: true`, "
        "`stream_options.include_usage: true`); the upstream answers a fixed completion with "
        "usage, or 4 SSE chunks + a usage chunk + `[DONE]`.",
        "",
        "kvgate refusal path: `kvgate serve --upstream U --model fast --no-adaptive --tpm 60 --max-wait 0` "
        "(the backend TPM bucket is empty after the first request: every request is read, its "
        "tenant identified, analysed by the Rust analyser and refused by the admission core, "
        "503 `backend-tpm` with a computed `Retry-After` and `x-ratelimit-*` headers). Admit "
        "path: `--max-concurrency 100000 --tpm 1000000000000` (every request reserved, "
        "forwarded, settled with the upstream's usage, counted in the metrics). The bare 429 "
        "handler does not read the body or look at anything.",
        "",
        "How the baselines and kvgate write their answers: the baselines are plain aiohttp "
        "applications (`web.Response` / `web.StreamResponse`, whose headers aiohttp builds and "
        "serializes per response); kvgate runs on aiohttp's low-level server and writes each "
        "answer it makes (refusals, relayed non-streamed bodies) as one HTTP/1.1 message "
        "serialized in Rust with its headers, and a relayed stream's head the same way "
        "(`python/kvgate/proxy/prepared.py`), which offsets part of what it does more per "
        "request (analysis, admission, settlement, metrics, SSE inspection, the access log "
        "line, and by default a non-streamed request forwarded as a stream and its answer "
        "assembled).",
        "",
        "LiteLLM: its proxy CLI (`litellm --config`, one process, master key, no database) in "
        "front of the same upstream, with its own limits far above the load: per-deployment "
        "`tpm: 1000000000`, `rpm: 10000000` under `routing_strategy: usage-based-routing-v2` "
        "(TPM/RPM-aware routing, 429 when the deployment's TPM would be exceeded), per-deployment "
        "`max_parallel_requests: 1000` and `general_settings.global_max_parallel_requests: "
        "1000` (the proxy's parallel-request limiter); requests carry the master key.",
        "",
        "Checks before measuring (one request each):",
        "",
    ]
    lines += [f"- {c}" for c in checks]
    lines += [""] + [f"Note: {n}" for n in notes] + ([""] if notes else [])
    per_round = [target_rows(res, lat) for res, lat in zip(rounds, lat_rounds, strict=True)]
    if per_round:
        head = " | ".join(f"round {i}" for i in range(1, len(per_round) + 1))
        lines += [
            "Against the targets:",
            "",
            f"| ratio | {head} | target |",
            "|---|" + "---|" * len(per_round) + "---|",
        ]
        for j, (what, _, target, _) in enumerate(per_round[0]):
            vals = " | ".join(
                f"**{rows[j][1]}**" + (f" {rows[j][3]}" if rows[j][3] else "") for rows in per_round
            )
            lines.append(f"| {what} | {vals} | {target} |")
        lines.append("")
    for i, (res, lat) in enumerate(zip(rounds, lat_rounds, strict=True), 1):
        lines += [f"Round {i}:", "", *round_table(args, res, lat), ""]
    return "\n".join(lines)


# ---- main -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="measurement rounds (default 2)")
    p.add_argument("--duration", type=float, default=6, help="seconds per target and round")
    p.add_argument("--warmup", type=float, default=1, help="warm-up seconds before each")
    p.add_argument("--latency-duration", type=float, default=3, help="seconds per c=1 run")
    p.add_argument("--connections", type=int, default=32, help="wrk connections (default 32)")
    p.add_argument("--server-cpu", default="1", help="taskset CPU list for servers")
    p.add_argument("--client-cpu", default="0", help="taskset CPU list for wrk")
    p.add_argument("--no-litellm", action="store_true", help="skip LiteLLM")
    p.add_argument("--no-write", action="store_true", help="do not touch benches/RESULTS.md")
    p.add_argument(
        "--only", default=None, help="comma-separated target names to measure (implies --no-write)"
    )
    p.add_argument(
        "--compare-src",
        metavar="DIR",
        default=None,
        help="also run kvgate (1 worker) from another source tree DIR (a directory holding a "
        "`kvgate` package with its built `_core`), as `kvgate-alt-1w`: before/after a change",
    )
    p.add_argument("--cmdline", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    for tool in ("wrk", "taskset"):
        if shutil.which(tool) is None:
            print(f"run_load: `{tool}` not found (apt-get install -y {tool})", file=sys.stderr)
            return 2
    t0 = time.monotonic()
    load_start = os.getloadavg()
    OUT.mkdir(parents=True, exist_ok=True)
    logdir = Path(tempfile.mkdtemp(prefix="load-", dir=OUT))
    body = logdir / "body.json"
    sbody = logdir / "stream_body.json"
    body.write_text(json.dumps(BODY))
    sbody.write_text(json.dumps(STREAM_BODY))
    py = sys.executable
    notes: list[str] = []

    up = Server("upstream", [py, str(HERE / "fast_upstream.py"), "0"], 0)
    up.port = free_port()
    up.argv[-1] = str(up.port)

    def kvgate(name: str, workers: int, extra: list[str], src: str | None = None) -> Server:
        port = free_port()
        argv = [py, "-m", "kvgate", "serve", "--upstream", up.url, "--port", str(port)]
        argv += ["--model", "fast", "--no-adaptive", "--log-level", "WARNING"]
        argv += ["--workers", str(workers), *extra]
        return Server(name, argv, port, env={"PYTHONPATH": src} if src else {})

    port429, portproxy = free_port(), free_port()
    servers = [
        up,
        Server("bare-429", [py, str(HERE / "bare_429.py"), str(port429)], port429, "/"),
        Server(
            "bare-proxy", [py, str(HERE / "bare_proxy.py"), str(portproxy), up.url], portproxy, "/"
        ),
        kvgate("kvgate-refuse-1w", 1, ["--tpm", "60", "--max-wait", "0"]),
        kvgate("kvgate-refuse-2w", 2, ["--tpm", "60", "--max-wait", "0"]),
        kvgate("kvgate-1w", 1, ["--max-concurrency", "100000", "--tpm", str(10**12)]),
        kvgate("kvgate-2w", 2, ["--max-concurrency", "100000", "--tpm", str(10**12)]),
    ]
    if args.compare_src:
        src = str(Path(args.compare_src).resolve())
        servers += [
            kvgate("kvgate-alt-refuse-1w", 1, ["--tpm", "60", "--max-wait", "0"], src),
            kvgate("kvgate-alt-1w", 1, ["--max-concurrency", "100000", "--tpm", str(10**12)], src),
        ]
    by = {s.name: s for s in servers}
    litellm: Server | None = None
    if not args.no_litellm:
        exe = litellm_ready(notes)
        if exe is not None:
            cfg = logdir / "litellm.yaml"
            litellm_config(up.url, cfg)
            port = free_port()
            litellm = Server(
                "litellm",
                [str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)],
                port,
                "/health/liveliness",
                env={
                    "LITELLM_LOG": "ERROR",
                    "LITELLM_TELEMETRY": "False",
                    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                },
            )
        else:
            print("  LiteLLM cannot be installed: skipped", flush=True)
    else:
        notes.append("LiteLLM skipped (--no-litellm)")

    targets = [
        Target("direct", "admit", up, body),
        Target("direct", "admit-stream", up, sbody),
        Target("bare-429", "refuse", by["bare-429"], body, refuse=True),
        Target("kvgate-refuse-1w", "refuse", by["kvgate-refuse-1w"], body, refuse=True),
        Target("kvgate-refuse-2w", "refuse", by["kvgate-refuse-2w"], body, refuse=True),
        Target("bare-proxy", "admit", by["bare-proxy"], body),
        Target("bare-proxy", "admit-stream", by["bare-proxy"], sbody),
        Target("kvgate-1w", "admit", by["kvgate-1w"], body),
        Target("kvgate-1w", "admit-stream", by["kvgate-1w"], sbody),
        Target("kvgate-2w", "admit", by["kvgate-2w"], body),
        Target("kvgate-2w", "admit-stream", by["kvgate-2w"], sbody),
    ]
    if args.compare_src:
        targets[5:5] = [
            Target("kvgate-alt-refuse-1w", "refuse", by["kvgate-alt-refuse-1w"], body, True),
        ]
        targets += [
            Target("kvgate-alt-1w", "admit", by["kvgate-alt-1w"], body),
            Target("kvgate-alt-1w", "admit-stream", by["kvgate-alt-1w"], sbody),
        ]
    lat_keys = {
        "direct/admit",
        "direct/admit-stream",
        "bare-proxy/admit",
        "bare-proxy/admit-stream",
        "kvgate-1w/admit",
        "kvgate-1w/admit-stream",
        "kvgate-2w/admit",
        "kvgate-2w/admit-stream",
        "bare-429/refuse",
        "kvgate-refuse-1w/refuse",
    }
    checks: list[str] = []
    rounds: list[dict[str, Measure]] = []
    lat_rounds: list[dict[str, Measure]] = []
    started: list[Server] = []
    try:
        up.start(args.server_cpu, logdir)
        started.append(up)
        up.wait_ready(30)
        for s in servers[1:]:
            s.start(args.server_cpu, logdir)
            started.append(s)
        for s in servers[1:]:
            s.wait_ready(60)
        if litellm is not None:
            litellm.start(args.server_cpu, logdir)
            started.append(litellm)
            try:
                litellm.wait_ready(180)
                auth = {"Authorization": f"Bearer {LITELLM_KEY}"}
                targets += [
                    Target("litellm", "admit", litellm, body, headers=auth),
                    Target("litellm", "admit-stream", litellm, sbody, headers=auth),
                ]
                lat_keys |= {"litellm/admit", "litellm/admit-stream"}
            except RuntimeError as exc:
                notes.append(f"LiteLLM did not start; skipped ({str(exc)[:300]})")
                litellm.stop()
        for t in targets:
            checks.append(f"`{t.name}` {t.path}: {check_target(t)}")
            print(f"  check {t.name} {t.path}: {checks[-1].split(': ', 1)[1]}", flush=True)
        if args.only:
            keep = set(args.only.split(","))
            targets = [t for t in targets if t.name in keep]
            args.no_write = True
        lat_targets = [t for t in targets if f"{t.name}/{t.path}" in lat_keys]
        total = args.rounds * (len(targets) + len(lat_targets))
        est = args.rounds * (
            len(targets) * (args.duration + args.warmup + 0.5)
            + len(lat_targets) * (args.latency_duration + 0.5)
        )
        print(
            f"load bench: {len(targets)} targets + {len(lat_targets)} latency runs × "
            f"{args.rounds} rounds, about {est:.0f} s; servers on CPU {args.server_cpu}, "
            f"wrk on CPU {args.client_cpu}",
            flush=True,
        )
        waited = settle(started)
        print(f"  servers idle after {waited:.0f} s", flush=True)
        notes.append(
            f"Before the first round the bench waited {waited:.0f} s for the idle servers to use "
            "under 3% of the server core together (LiteLLM keeps working for a while after its "
            "health check answers)."
        )
        step = 0
        for r in range(args.rounds):
            res: dict[str, Measure] = {}
            lat: dict[str, Measure] = {}
            for t in targets:
                step += 1
                m = measure(
                    t,
                    connections=args.connections,
                    seconds=args.duration,
                    warmup=args.warmup,
                    cpu=args.client_cpu,
                )
                res[f"{t.name}/{t.path}"] = m
                print(
                    f"[{step:>2}/{total}] {time.monotonic() - t0:5.0f}s round {r + 1} "
                    f"{t.name:<17} {t.path:<13} {m.rps:8,.0f} req/s  "
                    f"{fmt(m.cpu_us_per_req):>6} µs CPU/req  p50 {m.p50_ms:6.2f} ms",
                    flush=True,
                )
            for t in lat_targets:
                step += 1
                m = measure(
                    t, connections=1, seconds=args.latency_duration, warmup=0.0,
                    cpu=args.client_cpu,
                )  # fmt: skip
                lat[f"{t.name}/{t.path}"] = m
                print(
                    f"[{step:>2}/{total}] {time.monotonic() - t0:5.0f}s round {r + 1} "
                    f"{t.name:<17} {t.path:<13} c=1 p50 {m.p50_ms * 1000:7.0f} µs",
                    flush=True,
                )
            rounds.append(res)
            lat_rounds.append(lat)
    finally:
        for s in reversed(started):
            s.stop()
    machine = machine_notes(args.server_cpu, args.client_cpu, load_start, os.getloadavg())
    if litellm is not None and LITELLM_VENV.exists():
        v = subprocess.run(
            [str(LITELLM_VENV / "bin" / "python"), "-c",
             "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        machine += f" LiteLLM {v} (its proxy CLI, one process, in `benches/.out/litellm-venv`)."
    text = render(args, rounds, lat_rounds, checks, notes, machine, time.monotonic() - t0)
    if not args.no_write:
        OUT.mkdir(parents=True, exist_ok=True)
        raw = {
            "args": {k: v for k, v in vars(args).items() if k != "cmdline"},
            "machine": machine,
            "rounds": [[asdict(m) for m in res.values()] for res in rounds],
            "latency_rounds": [[asdict(m) for m in lat.values()] for lat in lat_rounds],
        }
        (OUT / "load.json").write_text(json.dumps(raw, indent=1))
    if args.no_write:
        print(text)
    else:
        write_section(text)
        print(f"wrote {SECTION!r} in {RESULTS.relative_to(ROOT)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
