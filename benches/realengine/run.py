"""Real engine: llama.cpp's ``llama-server`` alone against kvgate in front of it, in one run.

One ``llama-server`` (4 slots, ``-np 4``, each slot's context large enough for the prompt and
``--max-tokens``) serves a generated random-weight Llama model (``tests/realengine/make_model.py``);
one ``kvgate serve --upstream URL --tokenizer tokenizer.json`` (zero configuration: slots,
context and KV capacity discovered from the engine) sits in front of it. Two phases, each run
first directly against the engine, then through kvgate:

1. Burst: ``--requests`` streaming chat requests of ``--max-tokens`` tokens (``ignore_eos``,
   ``temperature: 0``, so every answer has exactly that length) sent at once. Per run: TTFT
   p50/p99 (client side, until the first non-empty ``delta.content``), completed streams, 5xx
   answers and other errors, and the queue peak: the engine's ``llamacpp:requests_deferred``
   (requests waiting for a slot) and kvgate's ``kvgate_queue_depth``, both read from their
   ``GET /metrics`` every ``--poll`` seconds during the run.
2. Disconnects: ``--disconnects`` non-streamed requests of ``--max-tokens`` tokens whose
   clients close their connections after ``--disconnect-after`` seconds. The engine's
   ``llamacpp:tokens_predicted_total`` growth (llama.cpp adds a request's tokens when the
   request ends) minus the tokens its slots had decoded at the moment of the disconnect
   (``GET /slots`` ``next_token[0].n_decoded``) is what it generated for nobody. llama.cpp
   notices a dropped non-streamed request only when no result of any task arrives for 1 s;
   anything that polls it (kvgate polls ``/metrics`` and ``/slots`` every second, this script
   polls ``/metrics`` during both runs) keeps results coming, so directly it generates every
   token; kvgate forwards the request upstream as a stream and closes it when the client leaves.

The burst uses the small model by default (a 400-token answer in about a second, so the
queued requests stay within kvgate's default 30 s wait), the disconnects the larger one (a
request still generating after a second). The whole run takes under a minute on two cores.

Reported, not timed in tests. Usage: ``python benches/realengine/run.py [--model tiny|slow]
[--disconnect-model tiny|slow] [--requests 16] [--max-tokens 400] [--no-write]``; rewrites the "Real engine (llama-server)"
section of ``benches/RESULTS.md``. ``KVGATE_LLAMA_SERVER`` names a ``llama-server`` binary;
without it ``scripts/build-llama-server.sh`` builds or reuses the cached one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from kvgate.loadgen import percentile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from realengine.make_model import SLOW, TINY, write_model  # noqa: E402

RESULTS = ROOT / "benches" / "RESULTS.md"
SECTION = "## Real engine (llama-server)"
sys.path.insert(0, str(ROOT / "benches"))
import core_results  # noqa: E402

BUILD_SCRIPT = ROOT / "scripts" / "build-llama-server.sh"
MODELS = {"tiny": TINY, "slow": SLOW}
STARTUP_S = 120.0
PROMPT = "tell me a long story about the quick brown fox"


# ---- results -------------------------------------------------------------------------------


@dataclass
class Burst:
    """One burst run: per-request TTFT (seconds; completed or not, once content arrived), answer
    statuses, completions, queue peaks (requests) and wall time (seconds)."""

    target: str
    requests: int
    ttft_s: list[float] = field(default_factory=list)
    completed: int = 0
    status_5xx: int = 0
    other_errors: int = 0
    engine_queue_peak: float = 0.0
    kvgate_queue_peak: float | None = None
    wall_s: float = 0.0


@dataclass
class Disconnect:
    """One disconnect run (tokens): the engine's generated-token counter growth, what its slots
    had decoded when the clients left, and the most the requests could have generated."""

    target: str
    requests: int
    max_tokens: int
    growth: float = 0.0
    before_disconnect: int = 0
    settle_s: float = 0.0

    @property
    def after_disconnect(self) -> float:
        """Tokens generated after the clients left (for nobody)."""
        return max(0.0, self.growth - self.before_disconnect)


def metric_sum(text: str, name: str) -> float:
    """Sum of the samples of ``name`` (any labels) in a Prometheus text exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def summarize(b: Burst) -> dict[str, str]:
    """The table cells of one burst run (TTFT in seconds, two decimals; ``–`` when none)."""

    def sec(v: float | None) -> str:
        return "–" if v is None else f"{v:.2f}"

    return {
        "target": b.target,
        "ttft_p50": sec(percentile(b.ttft_s, 0.5)),
        "ttft_p99": sec(percentile(b.ttft_s, 0.99)),
        "completed": f"{b.completed} / {b.requests}",
        "5xx": str(b.status_5xx),
        "other": str(b.other_errors),
        "engine_queue": f"{b.engine_queue_peak:.0f}",
        "kvgate_queue": "–" if b.kvgate_queue_peak is None else f"{b.kvgate_queue_peak:.0f}",
        "wall": f"{b.wall_s:.1f}",
    }


def render(
    bursts: list[Burst], disconnects: list[Disconnect], meta: dict[str, Any], when: str
) -> str:
    """The RESULTS.md section (Markdown, ends with a newline). ``meta`` holds the run's
    settings: ``model``, ``disconnect_model``, ``slots``, ``ctx``, ``requests``, ``max_tokens``, ``disconnects``,
    ``disconnect_after``, ``poll``, ``command``; ``when`` is the UTC time of the run."""
    lines = [
        SECTION,
        "",
        f"`{meta['command']}` ({when}): llama.cpp's `llama-server` with a generated random-weight "
        f"model ({meta['model']} for the burst, {meta['disconnect_model']} for the disconnects; "
        "`tests/realengine/make_model.py`), "
        f"{meta['slots']} slots (`-np {meta['slots']} -c {meta['ctx']}`), "
        "alone and behind `kvgate serve --upstream URL --tokenizer tokenizer.json` (nothing "
        "else configured), side by side in one run.",
        "",
        f"Burst: {meta['requests']} streaming chat requests × {meta['max_tokens']} tokens "
        "(`ignore_eos`, `temperature: 0`) sent at once. TTFT is client-side, until the first "
        "content delta; queue peaks are the most seen while polling each `/metrics` every "
        f"{meta['poll'] * 1000:.0f} ms (engine: `llamacpp:requests_deferred`; kvgate: "
        "`kvgate_queue_depth`).",
        "",
        "| target | TTFT p50 (s) | TTFT p99 (s) | completed | 5xx | other errors "
        "| engine queue peak | kvgate queue peak | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for b in bursts:
        s = summarize(b)
        lines.append(
            f"| {s['target']} | {s['ttft_p50']} | {s['ttft_p99']} | {s['completed']} | {s['5xx']} "
            f"| {s['other']} | {s['engine_queue']} | {s['kvgate_queue']} | {s['wall']} |"
        )
    lines += [
        "",
        f"Disconnects: {meta['disconnects']} non-streamed chat requests with `max_tokens` "
        f"{meta['max_tokens']} whose clients close the connection after "
        f"{meta['disconnect_after']:g} s. Tokens the engine generated after that = growth of "
        "`llamacpp:tokens_predicted_total` minus what its slots had decoded at the disconnect "
        "(`GET /slots`). `/metrics` is polled during the direct run too, as kvgate polls the "
        "engine: llama.cpp only notices a dropped non-streamed request when no result of any "
        "task arrives for 1 s, so while anything polls it (or other requests run) it generates "
        "to the end; kvgate forwards the request upstream as a stream and closes it when the "
        "client leaves.",
        "",
        "| target | tokens generated (growth) | decoded before the disconnect "
        "| generated after the disconnect | most possible |",
        "|---|---|---|---|---|",
    ]
    for d in disconnects:
        lines.append(
            f"| {d.target} | {d.growth:.0f} | {d.before_disconnect} | {d.after_disconnect:.0f} "
            f"| {d.requests * d.max_tokens} |"
        )
    lines += [
        "",
        f"{os.cpu_count()} CPUs (shared), Python {platform.python_version()}, aiohttp "
        f"{aiohttp.__version__}. Reported, not timed in tests.",
    ]
    return "\n".join(lines) + "\n"


def write_section(text: str) -> None:
    """Replace (or append) :data:`SECTION` in ``benches/RESULTS.md``: from its heading to the
    next ``## `` heading."""
    core_results.write_section(RESULTS, SECTION, text)


# ---- processes -----------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_server_binary() -> str:
    """``KVGATE_LLAMA_SERVER``, else the path the build script prints (it builds or reuses the
    cached binary). Raises RuntimeError when it cannot."""
    given = os.environ.get("KVGATE_LLAMA_SERVER")
    if given:
        return given
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=3600, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"cannot build llama-server: {done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


@contextlib.contextmanager
def process(cmd: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A child process (output to ``log``), stopped with SIGTERM then SIGKILL on exit."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=20)


async def wait_ok(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Poll ``GET url`` until 200; RuntimeError if the process exits or after STARTUP_S."""
    deadline = time.monotonic() + STARTUP_S
    async with aiohttp.ClientSession() as s:
        while True:
            if proc.poll() is not None:
                tail = await asyncio.to_thread(log.read_text)
                raise RuntimeError(f"{proc.args!r} exited: {tail[-2000:]}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not up within {STARTUP_S} s")
            await asyncio.sleep(0.1)


# ---- the runs ------------------------------------------------------------------------------


class Poller:
    """Polls ``/metrics`` of the engine (and of kvgate) every ``interval`` s; keeps the peaks of
    ``llamacpp:requests_deferred`` and ``kvgate_queue_depth``."""

    def __init__(self, s: aiohttp.ClientSession, engine: str, kvgate: str | None, interval: float):
        self.s, self.engine, self.kvgate, self.interval = s, engine, kvgate, interval
        self.engine_peak = 0.0
        self.kvgate_peak: float | None = None if kvgate is None else 0.0
        self._task: asyncio.Task[None] | None = None

    async def _get(self, url: str, name: str) -> float:
        async with self.s.get(url + "/metrics") as r:
            return metric_sum(await r.text(), name)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                q = await self._get(self.engine, "llamacpp:requests_deferred")
                self.engine_peak = max(self.engine_peak, q)
                if self.kvgate is not None and self.kvgate_peak is not None:
                    k = await self._get(self.kvgate, "kvgate_queue_depth")
                    self.kvgate_peak = max(self.kvgate_peak, k)
            await asyncio.sleep(self.interval)

    def __enter__(self) -> Poller:
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


def chat_body(i: int, max_tokens: int, stream: bool) -> dict[str, Any]:
    """A greedy chat request of exactly ``max_tokens`` generated tokens."""
    return {
        "model": "bench",
        "messages": [{"role": "user", "content": f"{PROMPT} {i}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def one_stream(s: aiohttp.ClientSession, url: str, body: dict[str, Any], b: Burst) -> None:
    """Send one streamed request; record its TTFT, status and completion in ``b``."""
    start = time.monotonic()
    try:
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            if r.status >= 500:
                b.status_5xx += 1
                await r.read()
                return
            if r.status != 200:
                b.other_errors += 1
                await r.read()
                return
            first = True
            finished = False
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                ev = orjson.loads(line[6:])
                for ch in ev.get("choices") or []:
                    if first and (ch.get("delta") or {}).get("content"):
                        first = False
                        b.ttft_s.append(time.monotonic() - start)
                    if ch.get("finish_reason"):
                        finished = True
            if finished:
                b.completed += 1
            else:
                b.other_errors += 1
    except (aiohttp.ClientError, OSError, ValueError):
        b.other_errors += 1


async def burst(
    target: str, url: str, engine: str, kvgate: str | None, n: int, max_tokens: int, poll: float
) -> Burst:
    """``n`` streamed requests sent at once to ``url``; queue peaks polled meanwhile."""
    b = Burst(target, n)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        with Poller(s, engine, kvgate, poll) as p:
            start = time.monotonic()
            await asyncio.gather(
                *(one_stream(s, url, chat_body(i, max_tokens, True), b) for i in range(n))
            )
            b.wall_s = time.monotonic() - start
        b.engine_queue_peak, b.kvgate_queue_peak = p.engine_peak, p.kvgate_peak
    return b


async def engine_json(s: aiohttp.ClientSession, url: str) -> Any:
    async with s.get(url) as r:
        return orjson.loads(await r.read())


async def disconnects(
    target: str, url: str, engine: str, n: int, max_tokens: int, after: float, poll: float
) -> Disconnect:
    """``n`` non-streamed requests to ``url`` whose clients leave after ``after`` s; the engine's
    generated tokens counted once its slots are idle and its counter stops moving."""
    d = Disconnect(target, n, max_tokens)
    async with aiohttp.ClientSession() as s:
        counter = "llamacpp:tokens_predicted_total"
        async with s.get(engine + "/metrics") as r:
            before = metric_sum(await r.text(), counter)
        with Poller(s, engine, None, poll):
            clients = [aiohttp.ClientSession() for _ in range(n)]
            tasks = [
                asyncio.create_task(
                    c.post(url + "/v1/chat/completions", json=chat_body(100 + i, max_tokens, False))
                )
                for i, c in enumerate(clients)
            ]
            await asyncio.sleep(after)
            slots = await engine_json(s, engine + "/slots")
            d.before_disconnect = sum(
                sl["next_token"][0]["n_decoded"] for sl in slots if sl["is_processing"]
            )
            for t in tasks:
                t.cancel()
            for c in clients:
                await c.close()
            left = time.monotonic()
            # the engine idle, then its counter settled (it counts a request when it ends)
            deadline = left + 300
            while time.monotonic() < deadline:
                slots = await engine_json(s, engine + "/slots")
                if not any(sl["is_processing"] for sl in slots):
                    break
                await asyncio.sleep(0.05)
            d.settle_s = time.monotonic() - left
            await asyncio.sleep(0.5)
            async with s.get(engine + "/metrics") as r:
                d.growth = metric_sum(await r.text(), counter) - before
        await asyncio.gather(*tasks, return_exceptions=True)
    return d


@contextlib.asynccontextmanager
async def engine_and_gateway(
    args: argparse.Namespace, model: str, tmp: Path
) -> AsyncIterator[tuple[str, str]]:
    """``(engine URL, kvgate URL)``: ``llama-server`` with the generated ``model`` and ``kvgate
    serve --upstream URL --tokenizer tokenizer.json`` in front, both up; stopped on exit."""
    out = tmp / model
    gguf, tok = write_model(out, MODELS[model], seed=0, name="bench")
    eport, gport = free_port(), free_port()
    engine, gateway = f"http://127.0.0.1:{eport}", f"http://127.0.0.1:{gport}"
    llama = [
        *(llama_server_binary(), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(eport)),
        *("-np", str(args.slots), "-c", str(args.slots * args.slot_ctx)),
        *("-t", str(args.threads), "--alias", "bench", "--metrics", "--slots", "--no-webui"),
    ]
    kvgate = [
        *(sys.executable, "-m", "kvgate", "serve", "--upstream", engine),
        *("--port", str(gport), "--tokenizer", str(tok)),
    ]
    with process(llama, out / "llama-server.log") as lp:
        await wait_ok(engine + "/health", lp, out / "llama-server.log")
        with process(kvgate, out / "kvgate.log") as kp:
            await wait_ok(gateway + "/readyz", kp, out / "kvgate.log")
            yield engine, gateway


async def run(args: argparse.Namespace, tmp: Path) -> tuple[list[Burst], list[Disconnect]]:
    """Both phases, each direct then through kvgate (one engine + kvgate pair per phase)."""
    bursts, discs = [], []
    async with engine_and_gateway(args, args.model, tmp) as (engine, gateway):
        for target, url, kv in (("direct", engine, None), ("kvgate", gateway, gateway)):
            b = await burst(target, url, engine, kv, args.requests, args.max_tokens, args.poll)
            print(summarize(b), flush=True)
            bursts.append(b)
    async with engine_and_gateway(args, args.disconnect_model, tmp) as (engine, gateway):
        for target, url in (("direct", engine), ("kvgate", gateway)):
            d = await disconnects(
                target,
                url,
                engine,
                args.disconnects,
                args.max_tokens,
                args.disconnect_after,
                args.poll,
            )
            print(d, f"after the disconnect: {d.after_disconnect:.0f}", flush=True)
            discs.append(d)
    return bursts, discs


def main() -> None:
    """Parse the arguments, run, print the section and write it into RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny", help="burst phase")
    parser.add_argument(
        "--disconnect-model", choices=sorted(MODELS), default="slow", help="disconnect phase"
    )
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--slot-ctx", type=int, default=1024, help="tokens of context per slot")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--disconnects", type=int, default=4)
    parser.add_argument("--disconnect-after", type=float, default=1.0, help="seconds")
    parser.add_argument("--poll", type=float, default=0.1, help="seconds between /metrics reads")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bursts, discs = asyncio.run(run(args, Path(tmp)))
    meta = {
        **vars(args),
        "ctx": args.slots * args.slot_ctx,
        "command": " ".join(["python benches/realengine/run.py", *sys.argv[1:]])
        if sys.argv[1:]
        else "make bench-realengine",
    }
    text = render(bursts, discs, meta, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
