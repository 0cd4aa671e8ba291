"""A seeded, replayable traffic mix for the demo and the protection benchmark.

A :class:`TrafficMix` is a list of :class:`Stream` (steady arrivals of one kind of request, at a
rate in requests per second, Poisson-spaced from a seed) and :class:`Burst` (``count`` requests
at one instant). :func:`drive` plays it against an OpenAI-compatible base URL with aiohttp and
returns per-class :class:`ClassStats`: admitted, refused by status and by kvgate's reject reason,
errors, time to first token, completion tokens that reached the client.

Prompt sizes are in tokens of the simulator's estimate (ceil(UTF-8 bytes / 4)); the prompt text is
built from a seeded word list so every run sends the same bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

__all__ = ["Burst", "ClassStats", "Stream", "TrafficMix", "drive", "percentile"]

_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dogs",
    "while",
    "engines",
    "fill",
    "their",
    "caches",
    "with",
    "keys",
    "and",
    "values",
    "from",
    "every",
    "token",
    "of",
    "every",
    "prompt",
    "that",
    "arrives",
    "at",
    "once",
]


@dataclass(frozen=True, slots=True)
class Stream:
    """Steady traffic of one class.

    Attributes:
        name: class label in the report (e.g. ``chat``).
        api_key: sent as ``Authorization: Bearer``; selects the tenant.
        rate: mean arrivals per second (Poisson).
        prompt_tokens: approximate prompt size in tokens (estimate: 4 bytes per token).
        max_tokens: requested completion bound.
        stream: stream the answer (SSE).
        route: ``chat`` (``/v1/chat/completions``) or ``embeddings``.
        start: seconds after the run starts; ``stop``: when arrivals end.
        ignore_eos: send vLLM's ``"ignore_eos": true`` so the engine generates exactly
            ``max_tokens`` (long generations whose length the client fixes).
    """

    name: str
    api_key: str
    rate: float
    prompt_tokens: int
    max_tokens: int
    stream: bool = True
    route: str = "chat"
    start: float = 0.0
    stop: float = float("inf")
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class Burst:
    """``count`` requests of one class arriving together at ``at`` seconds (``ignore_eos`` as
    in :class:`Stream`)."""

    name: str
    api_key: str
    at: float
    count: int
    prompt_tokens: int
    max_tokens: int
    stream: bool = True
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class TrafficMix:
    """A whole scenario: streams and bursts over ``duration`` seconds, for ``model``."""

    model: str
    duration: float
    streams: tuple[Stream, ...] = ()
    bursts: tuple[Burst, ...] = ()
    seed: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrafficMix:
        """Build from a parsed data file (``model``, ``duration``, ``streams``, ``bursts``)."""
        return cls(
            model=str(data["model"]),
            duration=float(data["duration"]),
            streams=tuple(Stream(**s) for s in data.get("streams", ())),
            bursts=tuple(Burst(**b) for b in data.get("bursts", ())),
            seed=int(data.get("seed", 0)),
        )


@dataclass(slots=True)
class ClassStats:
    """What one traffic class saw.

    Attributes:
        sent: requests sent.
        ok: requests answered 2xx and completed.
        statuses: HTTP status → count (non-2xx).
        reasons: ``x-kvgate-reject-reason`` → count.
        errors: transport errors or broken streams.
        ttft: seconds from send to the first content byte, per ok request.
        ttft_at: scheduled send time of each ``ttft`` entry, seconds after the run started
            (same order), to split TTFT by phase (e.g. during a burst).
        completion_tokens: completion tokens that reached the client (from usage when given,
            else content chunks).
    """

    sent: int = 0
    ok: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    errors: int = 0
    ttft: list[float] = field(default_factory=list)
    ttft_at: list[float] = field(default_factory=list)
    completion_tokens: int = 0


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values``: the element at index ``round(q * (n - 1))`` of
    the ascending sort (``n = len(values)``; Python's ``round``, halves to even), or ``None`` for
    no values.

    No interpolation: the result is always one of the values, the one nearest the linear
    interpolation position ``q * (n - 1)``. This is not the textbook nearest-rank method
    (``ceil(q * n)``-th smallest), though both give index 98 (the second-largest) for ``q=0.99``
    over 100 values. Units are those of ``values`` (seconds for TTFT); ``q`` outside 0..1 is
    clamped to the smallest / largest value.
    """
    if not values:
        return None
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[idx]


def _prompt(rng: random.Random, tokens: int) -> str:
    words: list[str] = []
    size = 0
    while size < tokens * 4:
        w = rng.choice(_WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)


def _body(
    model: str, route: str, prompt: str, max_tokens: int, stream: bool, ignore_eos: bool = False
) -> bytes:
    if route == "embeddings":
        return orjson.dumps({"model": model, "input": prompt})
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if stream:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


async def _one(
    session: aiohttp.ClientSession,
    base_url: str,
    api_key: str,
    route: str,
    body: bytes,
    stats: ClassStats,
    at: float = 0.0,
) -> None:
    path = "/v1/embeddings" if route == "embeddings" else "/v1/chat/completions"
    stats.sent += 1
    t0 = time.perf_counter()
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    try:
        async with session.post(base_url + path, data=body, headers=headers) as resp:
            if resp.status >= 300:
                stats.statuses[resp.status] += 1
                reason = resp.headers.get("x-kvgate-reject-reason")
                if reason:
                    stats.reasons[reason] += 1
                await resp.read()
                return
            first: float | None = None
            chunks = 0
            usage_tokens: int | None = None
            broken = False
            if resp.content_type == "text/event-stream":
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        break
                    obj = orjson.loads(payload)
                    if "error" in obj:
                        broken = True
                        break
                    if obj.get("choices"):
                        chunks += 1
                        if first is None:
                            first = time.perf_counter() - t0
                    usage = obj.get("usage")
                    if usage:
                        usage_tokens = int(usage.get("completion_tokens", 0))
            else:
                data = orjson.loads(await resp.read())
                first = time.perf_counter() - t0
                usage = data.get("usage") or {}
                usage_tokens = int(usage.get("completion_tokens", 0))
            if broken:
                stats.errors += 1
                return
            stats.ok += 1
            if first is not None:
                stats.ttft.append(first)
                stats.ttft_at.append(at)
            stats.completion_tokens += usage_tokens if usage_tokens is not None else chunks
    except (TimeoutError, aiohttp.ClientError, ValueError):
        stats.errors += 1


async def drive(
    base_url: str,
    mix: TrafficMix,
    *,
    on_tick: Callable[[float, dict[str, ClassStats]], Any] | None = None,
    tick: float = 1.0,
    drain: float = 30.0,
) -> dict[str, ClassStats]:
    """Play ``mix`` against ``base_url`` and return stats per class name.

    Args:
        base_url: ``http://host:port`` of a gateway or an engine (no ``/v1``).
        mix: the scenario.
        on_tick: called every ``tick`` seconds with (elapsed seconds, stats so far); may be a
            coroutine function (awaited).
        tick: seconds between ``on_tick`` calls.
        drain: after ``mix.duration``, wait at most this long for requests in flight.
    """
    stats: dict[str, ClassStats] = {}
    for s in mix.streams:
        stats.setdefault(s.name, ClassStats())
    for b in mix.bursts:
        stats.setdefault(b.name, ClassStats())
    rng = random.Random(mix.seed)
    # the whole arrival schedule is fixed before the run: (time, class, key, route, body)
    schedule: list[tuple[float, str, str, str, bytes]] = []
    for s in mix.streams:
        t = s.start
        end = min(s.stop, mix.duration)
        while s.rate > 0:
            t += rng.expovariate(s.rate)
            if t >= end:
                break
            prompt = _prompt(rng, s.prompt_tokens)
            body = _body(mix.model, s.route, prompt, s.max_tokens, s.stream, s.ignore_eos)
            schedule.append((t, s.name, s.api_key, s.route, body))
    for b in mix.bursts:
        for _ in range(b.count):
            prompt = _prompt(rng, b.prompt_tokens)
            body = _body(mix.model, "chat", prompt, b.max_tokens, b.stream, b.ignore_eos)
            schedule.append((b.at, b.name, b.api_key, "chat", body))
    schedule.sort(key=lambda item: item[0])

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks: set[asyncio.Task[None]] = set()

        async def ticker() -> None:
            while True:
                await asyncio.sleep(tick)
                if on_tick is not None:
                    res = on_tick(loop.time() - t0, stats)
                    if asyncio.iscoroutine(res):
                        await res

        tick_task = asyncio.create_task(ticker())
        try:
            for at, name, key, route, body in schedule:
                delay = t0 + at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(
                    _one(session, base_url, key, route, body, stats[name], at)
                )
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            left = t0 + mix.duration - loop.time()
            if left > 0:
                await asyncio.sleep(left)
            if tasks:
                await asyncio.wait(set(tasks), timeout=drain)
            for task in list(tasks):
                task.cancel()
        finally:
            tick_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tick_task
    return stats
