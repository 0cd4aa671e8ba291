"""MetricsPoller against a scripted aiohttp metrics server on 127.0.0.1 (short intervals)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import types
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from kvgate import AdmissionController
from kvgate._core import BOARD_PAYLOAD_BYTES
from kvgate.telemetry.engine_metrics import EngineReading
from kvgate.telemetry.poller import BackendStatus, MetricsPoller, PollTarget, _decode_record
from kvgate.telemetry.share import BoardShare

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "metrics"
INTERVAL = 0.05
TIMEOUT = 0.03
STALE_AFTER = 0.25
# for a backend whose scrapes must all succeed (the timing is not what the test checks): a
# scrape of a loaded machine can outlast 30 ms, a real timeout that such a test must not see
CALM = {"poll_interval": 0.2, "scrape_timeout": 0.19, "stale_after": 5.0}
# ... and a process frozen for longer than that (a CI VM losing its CPU) times out any scrape:
# such tests leave real timeouts out and check every other failure (see failure_reasons)
NOISE = "timeout"


def vllm_text(kv: str, waiting: int = 2) -> str:
    return (
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}\n'
        f'vllm:num_requests_running{{engine="0",model_name="m"}} 3\n'
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
    )


@dataclass
class Script:
    """What the fake engine answers; tests change it while the poller runs."""

    mode: str = "ok"
    kv: str = "0.5"
    health: int = 200
    slots: int = 200
    hits: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)


SCRIPT = web.AppKey("script", Script)


async def metrics_handler(request: web.Request) -> web.StreamResponse:
    s = request.app[SCRIPT]
    s.hits += 1
    if s.mode == "hang":
        await s.release.wait()
    if s.mode == "500":
        return web.Response(status=500, text="internal error")
    if s.mode == "garbage":
        return web.Response(text="<html><body>not metrics</body></html>\n")
    if s.mode == "drop_kv":
        return web.Response(text='vllm:num_requests_waiting{model_name="m"} 1\n')
    if s.mode == "huge":
        return web.Response(text="#" * 5000 + "\n" + vllm_text(s.kv))
    if s.mode == "llamacpp":
        return web.Response(text=(FIXTURES / "llamacpp-mainline-no-kv-metrics.prom").read_text())
    return web.Response(text=vllm_text(s.kv))


async def health_handler(request: web.Request) -> web.Response:
    return web.Response(status=request.app[SCRIPT].health, text="ok")


async def slots_handler(request: web.Request) -> web.Response:
    s = request.app[SCRIPT]
    if s.slots != 200:
        return web.Response(status=s.slots, text="slots disabled")
    body = [
        {"id": 0, "n_ctx": 2048, "is_processing": True, "n_past": 100},
        {"id": 1, "n_ctx": 2048, "is_processing": False},
        {"id": 2, "n_ctx": 2048, "is_processing": False},
        {"id": 3, "n_ctx": 2048, "is_processing": False},
    ]
    return web.json_response(body, dumps=json.dumps)


class Engine:
    """A scripted engine that can also stop listening (connection refused) and come back."""

    def __init__(self) -> None:
        self.script = Script()
        app = web.Application()
        app[SCRIPT] = self.script
        app.router.add_get("/metrics", metrics_handler)
        app.router.add_get("/health", health_handler)
        app.router.add_get("/slots", slots_handler)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        self.site: web.TCPSite | None = None
        self.port = 0

    async def start(self) -> None:
        await self.runner.setup()
        await self.listen()

    async def listen(self) -> None:
        self.site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await self.site.start()
        server = self.site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]

    async def refuse(self) -> None:
        assert self.site is not None
        await self.site.stop()
        self.site = None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def close(self) -> None:
        self.script.release.set()
        await self.runner.cleanup()


class Recorder:
    """A ReadingSink that records every call."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.changed = asyncio.Event()

    def on_reading(self, backend: str, reading: EngineReading, now: float) -> None:
        self.events.append(("reading", backend, reading))
        self.changed.set()

    def on_failure(self, backend: str, reason: str, message: str, now: float) -> None:
        self.events.append(("failure", backend, reason))
        self.changed.set()

    def on_stale(self, backend: str, stale: bool, now: float) -> None:
        self.events.append(("stale", backend, stale))
        self.changed.set()

    def on_health(self, backend: str, healthy: bool, now: float) -> None:
        self.events.append(("health", backend, healthy))
        self.changed.set()

    def of(self, kind: str) -> list[tuple]:
        return [e for e in self.events if e[0] == kind]


async def wait_until(sink: Recorder, predicate: Callable[[], bool]) -> None:
    """Bounded wait (5 s) for a condition the poller should reach, re-checked on each sink call."""
    async with asyncio.timeout(5.0):
        while not predicate():
            sink.changed.clear()
            await sink.changed.wait()


def failure_reasons(sink: Recorder) -> list[str]:
    """The reasons of the recorded failures, real timeouts (load noise) left out."""
    return [e[2] for e in sink.of("failure") if e[2] != NOISE]


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    e = Engine()
    await e.start()
    yield e
    await e.close()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    # force_close: each scrape opens a new connection, so "refusing" is seen at once
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        yield s


def target(server: Engine, **kw) -> PollTarget:
    base = {
        "name": "b1",
        "metrics_url": server.url("/metrics"),
        "engine": "auto",
        "poll_interval": INTERVAL,
        "scrape_timeout": TIMEOUT,
        "stale_after": STALE_AFTER,
    }
    return PollTarget(**(base | kw))


async def test_good_readings_flow(engine: Engine, session: aiohttp.ClientSession) -> None:
    sink = Recorder()
    async with MetricsPoller(session, sink, [target(engine, model="m", **CALM)]) as poller:
        await wait_until(sink, lambda: len(sink.of("reading")) >= 3)
        st = poller.status("b1")
        assert st.stale is False
        assert st.scrape_errors == st.errors_by_reason.get(NOISE, 0)
        assert st.age(asyncio.get_running_loop().time()) is not None
        reading = sink.of("reading")[-1][2]
        assert (reading.engine, reading.kv_usage, reading.running, reading.waiting) == (
            "vllm",
            0.5,
            3,
            2,
        )
        engine.script.kv = "0.9"
        await wait_until(sink, lambda: sink.of("reading")[-1][2].kv_usage == 0.9)
    assert not failure_reasons(sink)
    assert not sink.of("stale")


FAILURES = {
    "refuse": "connect",
    "hang": "timeout",
    "500": "http_status",
    "garbage": "unknown_engine",
    "drop_kv": "missing_metric",
    "nan": "bad_value",
    "1.3": "bad_value",
}


@pytest.mark.parametrize("mode", sorted(FAILURES))
async def test_failure_goes_stale_once_then_recovers(
    mode: str, engine: Engine, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.telemetry")
    sink = Recorder()
    async with MetricsPoller(session, sink, [target(engine)]) as poller:
        await wait_until(sink, lambda: len(sink.of("reading")) >= 1)
        # a loaded machine can time out the first scrapes and mark the backend stale before the
        # first reading (which marks it fresh again): the transitions that count come after the
        # endpoint breaks
        before = len(sink.of("stale"))
        assert poller.status("b1").stale is False
        # break the metrics endpoint
        if mode == "refuse":
            await engine.refuse()
        elif mode in ("nan", "1.3"):
            engine.script.kv = "NaN" if mode == "nan" else "1.3"
        else:
            engine.script.mode = mode
        await wait_until(sink, lambda: len(sink.of("stale")) > before)
        st = poller.status("b1")
        assert st.stale is True
        assert sink.of("stale")[before:] == [("stale", "b1", True)]
        assert st.last_good_at is not None
        age = st.age(asyncio.get_running_loop().time())
        assert age is not None
        assert age >= STALE_AFTER  # never stale before stale_after
        reasons = {e[2] for e in sink.of("failure")}
        # a scrape of a loaded machine can outlast the 30 ms timeout: that is a real timeout,
        # counted as one, not a misfiled failure (seen once in a full `make test` run)
        noise = {"timeout"} - {FAILURES[mode]}
        assert reasons - noise == {FAILURES[mode]}
        # usually several failures before stale_after; one can be enough: a process frozen for
        # longer than stale_after (a loaded CI machine) finds it stale at its first failure
        assert st.errors_by_reason[FAILURES[mode]] >= 1
        assert sum(st.errors_by_reason.values()) == st.scrape_errors
        # more failing scrapes, each counted under its reason: still one transition, one log line
        errors_at_stale = st.errors_by_reason[FAILURES[mode]]
        await wait_until(sink, lambda: st.errors_by_reason[FAILURES[mode]] >= errors_at_stale + 3)
        assert sum(st.errors_by_reason.values()) == st.scrape_errors
        assert sink.of("stale")[before:] == [("stale", "b1", True)]
        # the endpoint comes back
        if mode == "refuse":
            await engine.listen()
        engine.script.mode, engine.script.kv = "ok", "0.4"
        engine.script.release.set()
        await wait_until(sink, lambda: len(sink.of("stale")) == before + 2)
        assert sink.of("stale")[before:] == [("stale", "b1", True), ("stale", "b1", False)]
        await wait_until(sink, lambda: sink.of("reading")[-1][2].kv_usage == 0.4)
        assert st.stale is False
        assert st.last_error is None
    # each "fresh again" transition comes before the reading that ends it
    for i, event in enumerate(sink.events):
        if event == ("stale", "b1", False):
            assert sink.events[i + 1][0] == "reading"
    # one log line per transition (the break's, and any early one of a loaded machine)
    stale_logs = [r for r in caplog.records if "stale" in r.getMessage()]
    fresh_logs = [r for r in caplog.records if "fresh again" in r.getMessage()]
    assert len(stale_logs) == sink.of("stale").count(("stale", "b1", True))
    assert all(r.levelno == logging.WARNING for r in stale_logs)
    assert len(fresh_logs) == sink.of("stale").count(("stale", "b1", False))


async def test_never_answering_goes_stale_from_start(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    engine.script.mode = "500"
    sink = Recorder()
    async with MetricsPoller(session, sink, [target(engine)]) as poller:
        await wait_until(sink, lambda: bool(sink.of("stale")))
        assert poller.status("b1").last_good_at is None
        assert poller.status("b1").age(0.0) is None
    assert not sink.of("reading")


async def test_stale_without_adaptation_is_logged_at_info(
    engine: Engine, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend whose limits do not adapt (``serve --no-adaptive``, ``adaptive.enabled:
    false``) still goes stale (gauge, sink), but an engine without metrics is no warning."""
    caplog.set_level(logging.INFO, logger="kvgate.telemetry")
    engine.script.mode = "500"
    sink = Recorder()
    async with MetricsPoller(session, sink, [target(engine, adaptive=False)]) as poller:
        await wait_until(sink, lambda: bool(sink.of("stale")))
        assert poller.status("b1").stale is True
    stale_logs = [r for r in caplog.records if "stale" in r.getMessage()]
    assert len(stale_logs) == 1
    assert stale_logs[0].levelno == logging.INFO
    assert "adaptive limits are off for it, nothing changes" in stale_logs[0].getMessage()


async def test_body_too_large(engine: Engine, session: aiohttp.ClientSession) -> None:
    engine.script.mode = "huge"
    sink = Recorder()
    async with MetricsPoller(session, sink, [target(engine, max_body_bytes=1000, **CALM)]):
        await wait_until(sink, lambda: bool(failure_reasons(sink)))
    assert failure_reasons(sink)[0] == "too_large"


async def test_health_out_and_back(engine: Engine, session: aiohttp.ClientSession) -> None:
    sink = Recorder()
    t = target(engine, health_url=engine.url("/health"), unhealthy_after=3, **CALM)
    async with MetricsPoller(session, sink, [t]) as poller:
        await wait_until(sink, lambda: len(sink.of("reading")) >= 2)
        assert not sink.of("health")
        engine.script.health = 503
        await wait_until(sink, lambda: bool(sink.of("health")))
        assert sink.of("health") == [("health", "b1", False)]
        assert poller.status("b1").healthy is False
        assert poller.status("b1").health_failures >= 3
        # metrics still fine: the two signals are independent
        assert poller.status("b1").stale is False
        engine.script.health = 200
        await wait_until(sink, lambda: len(sink.of("health")) == 2)
        assert sink.of("health")[-1] == ("health", "b1", True)
        assert poller.status("b1").healthy is True


async def test_health_refused_takes_backend_out(
    engine: Engine, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvgate.telemetry")
    sink = Recorder()
    t = target(engine, health_url=engine.url("/health"), unhealthy_after=2)
    async with MetricsPoller(session, sink, [t]):
        await wait_until(sink, lambda: len(sink.of("reading")) >= 1)
        await engine.refuse()
        await wait_until(sink, lambda: bool(sink.of("health")))
        assert sink.of("health") == [("health", "b1", False)]
    [line] = [r.getMessage() for r in caplog.records if "health check failed" in r.getMessage()]
    # the error's class and text, not its repr (aiohttp's repr dumps the whole connection key)
    assert "(ClientConnectorError: Cannot connect to host" in line
    assert "ConnectionKey(" not in line


async def test_llamacpp_slots(engine: Engine, session: aiohttp.ClientSession) -> None:
    engine.script.mode = "llamacpp"
    sink = Recorder()
    t = target(engine, engine="llamacpp", slots_url=engine.url("/slots"), **CALM)
    async with MetricsPoller(session, sink, [t]):
        await wait_until(sink, lambda: len(sink.of("reading")) >= 1)
        r = sink.of("reading")[0][2]
        # 100 tokens held of 4 × 2,048 (not 1 busy slot of 4)
        assert (r.kv_usage, r.kv_capacity_tokens, r.waiting) == (100 / (4 * 2048), 4 * 2048, 0)
        # --no-slots: the queue alone still gives a good reading, no failure
        engine.script.slots = 501
        n = len(sink.of("reading"))
        await wait_until(sink, lambda: len(sink.of("reading")) >= n + 2)
        r = sink.of("reading")[-1][2]
        assert (r.kv_usage, r.waiting) == (None, 0)
    assert not failure_reasons(sink)


async def test_two_backends_independent(engine: Engine, session: aiohttp.ClientSession) -> None:
    other = Engine()
    await other.start()
    try:
        other.script.mode = "500"
        sink = Recorder()
        targets = [target(engine, **CALM), target(other, name="b2")]
        async with MetricsPoller(session, sink, targets) as poller:
            # b1's first scrape, too: on a frozen machine it can time out and come later
            await wait_until(sink, lambda: bool(sink.of("stale")) and bool(sink.of("reading")))
            assert sink.of("stale") == [("stale", "b2", True)]
            assert poller.status("b1").stale is False
            assert {e[1] for e in sink.of("reading")} == {"b1"}
            assert poller.backends == ["b1", "b2"]
    finally:
        await other.close()


async def test_stop_ends_polling(engine: Engine, session: aiohttp.ClientSession) -> None:
    sink = Recorder()
    poller = MetricsPoller(session, sink, [target(engine)])
    await poller.start()
    await poller.start()  # idempotent
    await wait_until(sink, lambda: len(sink.of("reading")) >= 2)
    await poller.stop()
    hits = engine.script.hits
    await asyncio.sleep(INTERVAL * 4)
    assert engine.script.hits == hits


async def test_sink_exception_does_not_stop_polling(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    class Exploding(Recorder):
        def on_reading(self, backend: str, reading: EngineReading, now: float) -> None:
            super().on_reading(backend, reading, now)
            raise RuntimeError("sink bug")

    sink = Exploding()
    async with MetricsPoller(session, sink, [target(engine)]):
        await wait_until(sink, lambda: len(sink.of("reading")) >= 3)


async def test_poll_once_with_injected_clock(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    now = [100.0]
    sink = Recorder()
    poller = MetricsPoller(session, sink, [target(engine, stale_after=5.0)], clock=lambda: now[0])
    await poller.poll_once("b1")
    assert poller.status("b1").last_good_at == 100.0
    engine.script.mode = "500"
    now[0] = 104.9
    await poller.poll_once("b1")
    assert poller.status("b1").stale is False
    now[0] = 105.0
    await poller.poll_once("b1")
    assert poller.status("b1").stale is True
    assert poller.status("b1").age(now[0]) == 5.0
    assert sink.of("stale") == [("stale", "b1", True)]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"scrape_timeout": INTERVAL}, "scrape_timeout"),
        ({"scrape_timeout": 0.0}, "scrape_timeout"),
        ({"poll_interval": 0.0, "scrape_timeout": None}, "poll_interval"),
        ({"stale_after": INTERVAL / 2}, "stale_after"),
        ({"unhealthy_after": 0}, "unhealthy_after"),
        ({"engine": "ollama"}, "unknown engine"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
    ],
)
def test_target_validation(kw: dict, message: str) -> None:
    base = {
        "name": "b",
        "metrics_url": "http://127.0.0.1:1/metrics",
        "poll_interval": INTERVAL,
        "scrape_timeout": TIMEOUT,
    }
    with pytest.raises(ValueError, match=message):
        PollTarget(**(base | kw))


def test_default_timeout_is_shorter_than_interval() -> None:
    t = PollTarget(name="b", metrics_url="http://127.0.0.1:1/metrics")
    assert t.poll_interval == 1.0
    assert t.stale_after == 5.0
    assert 0 < t.timeout < t.poll_interval


async def test_duplicate_backend_names(session: aiohttp.ClientSession) -> None:
    t = PollTarget(name="b", metrics_url="http://127.0.0.1:1/metrics")
    with pytest.raises(ValueError, match="duplicate"):
        MetricsPoller(session, Recorder(), [t, t])


async def test_targets_are_polled_at_phases_spread_over_the_interval(
    engine: Engine, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four targets, a poll every 0.4 s: after the first polls (all at once) the ``i``-th is
    polled ``i / 4`` of an interval after the first, round after round, rather than all four
    in the same moment (a thousand backends would send a thousand scrapes at once)."""
    loop = asyncio.get_running_loop()
    called: dict[str, list[float]] = {}
    poll_once = MetricsPoller.poll_once

    polled = asyncio.Event()

    async def timed(self: MetricsPoller, backend: str) -> None:
        called.setdefault(backend, []).append(loop.time())
        polled.set()
        await poll_once(self, backend)

    monkeypatch.setattr(MetricsPoller, "poll_once", timed)
    sink = Recorder()
    slow = {"poll_interval": 0.4, "scrape_timeout": 0.35, "stale_after": 5.0}
    names = ["b1", "b2", "b3", "b4"]
    async with MetricsPoller(session, sink, [target(engine, name=n, **slow) for n in names]):
        async with asyncio.timeout(10):
            while min(len(called.get(n, [])) for n in names) < 5:
                polled.clear()
                await polled.wait()
    # rounds 2 to 5: b4 comes 0.3 s after b1, modulo the interval (0 without phases; the
    # phases count on the monotonic clock, so b1's round may have begun before b4's; a stalled
    # loop delays a poll but keeps the phases, so the median round shows them)
    gaps = sorted((called["b4"][k] - called["b1"][k]) % 0.4 for k in range(1, 5))
    assert 0.15 < (gaps[1] + gaps[2]) / 2 < 0.4, gaps
    # each target is still polled once an interval (the first two polls a phase apart)
    for n in names:
        steps = [b - a for a, b in zip(called[n][1:], called[n][2:], strict=False)]
        assert 0.3 < sorted(steps)[len(steps) // 2] < 0.5, (n, steps)


# ---- several processes sharing the polls (the workers of --workers N) ----------------------

# an interval long enough that a loaded machine's stalls never reach takeover_after (1.5 s)
SHARED = {"poll_interval": 0.5, "scrape_timeout": 0.4, "stale_after": 5.0}


def board(backends: list[str]) -> AdmissionController:
    """A core with ``backends`` (ids in order) whose poll board the shares use."""
    ctl = AdmissionController()
    for name in backends:
        ctl.add_backend(name, max_concurrency=4, tokens_per_minute=10**6)
    return ctl


def shares(ctl: AdmissionController, backends: list[str], n: int) -> list[BoardShare]:
    ids = {name: ctl.backend_id(name) for name in backends}
    return [BoardShare(ctl, ids, i, n) for i in range(n)]


def test_board_share_splits_the_backends_between_workers() -> None:
    names = [f"b{i}" for i in range(7)]
    ctl = board(names)
    three = shares(ctl, names, 3)
    for name in names:
        assert [s.polls(name) for s in three].count(True) == 1, name
    assert three[0].polls("not-in-the-core")  # a backend it does not know: polled
    assert three[1].read("not-in-the-core") is None
    with pytest.raises(ValueError, match="worker 3"):
        BoardShare(ctl, {}, 3, 3)


async def test_one_scrape_per_interval_and_the_follower_gets_every_reading(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    """Two pollers (two workers' worth) share one backend: only its poller scrapes the engine;
    the other hands the same readings and health to its sink, and scrapes nothing."""
    ctl = board(["b1"])
    owner_share, follower_share = shares(ctl, ["b1"], 2)
    assert owner_share.polls("b1")
    assert not follower_share.polls("b1")
    t = target(engine, model="m", health_url=engine.url("/health"), unhealthy_after=1, **SHARED)
    owner_sink, follower_sink = Recorder(), Recorder()
    async with (
        MetricsPoller(session, owner_sink, [t], share=owner_share),
        MetricsPoller(session, follower_sink, [t], share=follower_share) as follower,
    ):
        await wait_until(follower_sink, lambda: len(follower_sink.of("reading")) >= 1)
        reading = follower_sink.of("reading")[-1][2]
        assert (reading.engine, reading.kv_usage, reading.running, reading.waiting) == (
            "vllm",
            0.5,
            3,
            2,
        )
        scrapes, readings = engine.script.hits, len(owner_sink.of("reading"))
        engine.script.kv = "0.9"
        await wait_until(follower_sink, lambda: follower_sink.of("reading")[-1][2].kv_usage == 0.9)
        # every scrape since was the owner's: one per reading it got (or failure it counted)
        owner_polls = len(owner_sink.of("reading")) - readings + len(owner_sink.of("failure"))
        assert engine.script.hits - scrapes <= owner_polls + 1
        # the health check fails once (unhealthy_after 1): the follower takes it out too
        engine.script.health = 503
        await wait_until(follower_sink, lambda: bool(follower_sink.of("health")))
        assert follower_sink.of("health") == [("health", "b1", False)]
        assert follower.status("b1").healthy is False
        engine.script.health = 200
        await wait_until(follower_sink, lambda: len(follower_sink.of("health")) == 2)
        assert follower_sink.of("health")[-1] == ("health", "b1", True)
        st = follower.status("b1")
        assert st.last_good_at is not None
        assert st.age(asyncio.get_running_loop().time()) < SHARED["stale_after"]
    assert follower_sink.of("failure") == []  # failures are counted by the poller only
    assert owner_sink.of("health") == [("health", "b1", False), ("health", "b1", True)]


async def test_the_follower_polls_itself_while_no_record_comes(
    engine: Engine, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """The publisher stops (a worker killed or frozen): after ``takeover_after`` the follower
    scrapes the engine itself; a new publisher comes back and the follower follows it again."""
    caplog.set_level(logging.INFO, logger="kvgate.telemetry")
    ctl = board(["b1"])
    owner_share, follower_share = shares(ctl, ["b1"], 2)
    t = target(engine, model="m", **SHARED)
    owner_sink, follower_sink = Recorder(), Recorder()
    owner = MetricsPoller(session, owner_sink, [t], share=owner_share)
    async with MetricsPoller(session, follower_sink, [t], share=follower_share) as follower:
        await owner.start()
        await wait_until(follower_sink, lambda: len(follower_sink.of("reading")) >= 1)
        await owner.stop()
        stopped = asyncio.get_running_loop().time()
        scrapes = engine.script.hits
        engine.script.kv = "0.7"
        await wait_until(follower_sink, lambda: follower_sink.of("reading")[-1][2].kv_usage == 0.7)
        assert asyncio.get_running_loop().time() - stopped >= t.takeover_after - t.poll_interval
        assert engine.script.hits > scrapes  # the follower's own scrapes
        assert follower.status("b1").stale is False
        # a publisher again (a restarted worker)
        owner = MetricsPoller(session, owner_sink, [t], share=owner_share)
        await owner.start()
        engine.script.kv = "0.3"
        await wait_until(follower_sink, lambda: follower_sink.of("reading")[-1][2].kv_usage == 0.3)
        await wait_until(follower_sink, lambda: follower.status("b1").record_seq > 0)
        await owner.stop()
    logs = [r.getMessage() for r in caplog.records]
    assert any("polling it here until its records come back" in m for m in logs), logs
    assert any("following its poller's records again" in m for m in logs), logs


async def test_a_garbage_record_is_not_followed(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    """Whatever sits on the board that is not a record (a torn write, another version): the
    follower scrapes the engine itself rather than trust it."""
    ctl = board(["b1"])
    _, follower_share = shares(ctl, ["b1"], 2)
    fast = {"poll_interval": 0.1, "scrape_timeout": 0.09, "stale_after": 5.0}
    sink = Recorder()
    for garbage in (b"", b"not json", b'{"t": 1.0}', b'{"t": "x", "g": null, "r": null}'):
        ctl.publish_board(ctl.backend_id("b1"), garbage)
        async with MetricsPoller(
            session, sink, [target(engine, model="m", **fast)], share=follower_share
        ):
            before = engine.script.hits
            await wait_until(sink, lambda before=before: engine.script.hits > before)


def publisher() -> tuple[BoardShare, MetricsPoller, BackendStatus]:
    """The share, poller and a blank status of the worker that polls ``b1`` (of two)."""
    share = shares(board(["b1"]), ["b1"], 2)[0]
    t = PollTarget(name="b1", metrics_url="http://127.0.0.1:1/metrics")
    return share, MetricsPoller(None, Recorder(), [t], share=share), BackendStatus(t, 0.0)


def test_a_record_fits_the_board_whatever_its_error() -> None:
    share, poller, st = publisher()
    st.last_reading = EngineReading(
        engine="vllm",
        kv_usage=0.25,
        running=7,
        waiting=1,
        kv_capacity_tokens=123_456,
        sources={"kv_usage": "vllm:kv_cache_usage_perc"},
    )
    st.good_mono, st.healthy, st.scrape_errors = 12.5, False, 3
    st.last_error = "connect: " + "é" * 2_000
    raw = poller._record(st)
    assert len(raw) <= BOARD_PAYLOAD_BYTES
    assert share.publish("b1", raw) is None
    assert share.read("b1") is not None
    rec = _decode_record(share.read("b1")[1])
    assert rec is not None
    assert rec["r"] == dataclasses.replace(st.last_reading, sources={})
    assert (rec["g"], rec["h"], rec["n"], rec["s"], rec["i"]) == (12.5, False, 3, False, 1.0)
    assert rec["e"].startswith("connect: éé")
    assert rec["e"].endswith("…")


def test_a_reading_json_cannot_hold_is_published_without_that_field() -> None:
    _, poller, st = publisher()
    st.last_reading = EngineReading(engine="vllm", kv_usage=0.5, kv_capacity_tokens=2**70)
    st.good_mono = 1.0
    rec = _decode_record(poller._record(st))
    assert rec is not None
    assert rec["r"].kv_capacity_tokens is None
    assert rec["r"].kv_usage == 0.5


def good_record(**change: object) -> dict:
    rec = {
        "t": time.monotonic(),
        "i": 1.0,
        "g": time.monotonic() - 0.1,
        "r": {
            "engine": "vllm",
            "kv_usage": 0.5,
            "running": 3,
            "waiting": 0,
            "preemptions_total": 2.0,
            "kv_capacity_tokens": 1000,
            "slots": None,
            "skipped_lines": 0,
        },
        "n": 0,
        "h": True,
        "s": False,
        "e": None,
    }
    for key, value in change.items():
        if key.startswith("r."):
            rec["r"][key[2:]] = value
        else:
            rec[key] = value
    return rec


@pytest.mark.parametrize(
    "change",
    [
        {"r.kv_usage": 7.5},
        {"r.kv_usage": "0.5"},
        {"r.kv_usage": float("nan")},
        {"r.waiting": -4},
        {"r.running": 10**12},
        {"r.slots": 0.5},
        {"r.kv_capacity_tokens": True},
        {"r.kv_capacity_tokens": 0},
        {"r.preemptions_total": -1.0},
        {"r.skipped_lines": None},
        {"r.engine": "ollama"},
        {"n": True},
        {"n": -5},
        {"t": time.monotonic() + 3600},
        {"t": "now"},
        {"g": float("inf")},
        {"i": 0},
        {"h": 1},
        {"s": None},
        {"e": 3},
    ],
)
def test_a_record_out_of_what_a_scrape_allows_is_not_followed(change: dict) -> None:
    assert _decode_record(orjson.dumps(good_record())) is not None
    raw = json.dumps(good_record(**change)).encode()  # json: NaN and inf pass through
    assert _decode_record(raw) is None


async def test_a_follower_takes_the_publishers_staleness_and_never_its_own_before_takeover(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    """stale_after barely above the interval: the publisher going stale (its scrapes fail)
    makes the follower stale too, once; the publisher stopping does not — the follower takes
    the backend over before that (its own scrapes keep it fresh)."""
    ctl = board(["b1"])
    owner_share, follower_share = shares(ctl, ["b1"], 2)
    t = target(engine, model="m", poll_interval=0.4, scrape_timeout=0.35, stale_after=0.8)
    owner_sink, follower_sink = Recorder(), Recorder()
    owner = MetricsPoller(session, owner_sink, [t], share=owner_share)
    async with MetricsPoller(session, follower_sink, [t], share=follower_share) as follower:
        await owner.start()
        await wait_until(follower_sink, lambda: len(follower_sink.of("reading")) >= 2)
        engine.script.mode = "500"
        await wait_until(follower_sink, lambda: bool(follower_sink.of("stale")))
        assert follower_sink.of("stale") == [("stale", "b1", True)]
        assert follower.status("b1").stale is True
        engine.script.mode = "ok"
        await wait_until(follower_sink, lambda: len(follower_sink.of("stale")) == 2)
        assert follower_sink.of("stale")[-1] == ("stale", "b1", False)
        # each "fresh again" comes before the reading that ends it
        i = follower_sink.events.index(("stale", "b1", False))
        assert follower_sink.events[i + 1][0] == "reading"
        readings = len(follower_sink.of("reading"))
        await owner.stop()
        # the follower polls the engine itself: more readings, and never stale meanwhile
        await wait_until(follower_sink, lambda: len(follower_sink.of("reading")) >= readings + 3)
        assert len(follower_sink.of("stale")) == 2
        assert follower.status("b1").record_seq == -1


class FakeShare:
    """A PollShare whose board is one slot the test writes (``None``: unreadable)."""

    max_record = BOARD_PAYLOAD_BYTES

    def __init__(self) -> None:
        self.slot: tuple[int, bytes] | None = None
        self.seq = 0

    def polls(self, backend: str) -> bool:
        return False

    def publish(self, backend: str, record: bytes) -> None:
        raise AssertionError("a follower publishes nothing")

    def read(self, backend: str) -> tuple[int, bytes] | None:
        return self.slot

    def put(self, rec: dict) -> None:
        self.seq += 2
        self.slot = (self.seq, orjson.dumps(rec))


async def test_following_by_the_publishers_clock_and_never_backwards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A publisher with a longer interval (2.5 s) than the follower's (0.5 s): an unreadable
    read 2 s after its last record is no takeover. A record whose good scrape is older than
    one already taken (a publisher waking from a freeze) is not fed to the sink again."""
    import kvgate.telemetry.poller as poller_module

    mono = [1000.0]
    monkeypatch.setattr(poller_module, "time", types.SimpleNamespace(monotonic=lambda: mono[0]))
    share, sink = FakeShare(), Recorder()
    t = PollTarget(
        name="b1",
        metrics_url="http://127.0.0.1:1/metrics",
        poll_interval=0.5,
        scrape_timeout=0.4,
        stale_after=5.0,
    )
    poller = MetricsPoller(None, sink, [t], clock=lambda: mono[0], share=share)
    share.put(good_record(t=1000.0, g=999.9, i=2.5))
    await poller.poll_once("b1")
    assert len(sink.of("reading")) == 1
    mono[0] += 2.0
    share.slot = None  # a write in progress
    await poller.poll_once("b1")  # would scrape 127.0.0.1:1 (refused) if it took over
    assert poller.status("b1").record_seq > 0
    assert sink.of("failure") == []
    share.put(good_record(t=mono[0], g=999.5, i=2.5))  # an older good scrape
    await poller.poll_once("b1")
    assert len(sink.of("reading")) == 1
    assert poller.status("b1").good_mono == 999.9
    share.put(good_record(t=mono[0], g=mono[0] - 0.1, i=2.5))
    await poller.poll_once("b1")
    assert len(sink.of("reading")) == 2
