"""MetricsPoller: one asyncio task per backend that scrapes the engine's ``/metrics`` and health.

What: every ``poll_interval`` seconds (default 1 s, each backend at its own phase of the interval)
each backend's metrics URL is fetched with the poller's :class:`aiohttp.ClientSession` and a
timeout shorter than the interval, turned
into an :class:`~kvgate.telemetry.engine_metrics.EngineReading` by the engine adapters, and handed
to a :class:`ReadingSink`. A failure (connection refused, timeout, HTTP error, garbage, missing
or out-of-range metric) is handed to the sink as a reason and counted. When no good reading has
arrived for ``stale_after`` seconds (default 5 s) the backend is marked stale — one log line and
one ``on_stale`` call per transition, never one per scrape — and it is marked fresh again on the
next good reading. A health URL (``GET /health`` or ``/v1/models``), when set, is checked on the
same schedule: ``unhealthy_after`` consecutive failures take the backend out (``on_health(False)``),
one success puts it back.

Inputs: :class:`PollTarget` per backend (URLs, engine, model, intervals).
Config (defaults, ranges): ``poll_interval`` 1 s (> 0); ``scrape_timeout`` 0.8 × interval
(0 < timeout < interval); ``stale_after`` 5 s (≥ interval); ``unhealthy_after`` 3 (≥ 1);
``max_body_bytes`` 8 MiB.
Trade-offs: the control law is not here (the gateway plugs the core's ``AdaptiveLaw`` in through
the sink); parsing runs on the event loop, but only the few sample lines an adapter needs are
parsed, so one scrape costs well under a millisecond for the scrapes in the fixtures. The
staleness clock starts when polling starts: a backend that never answers goes stale after
``stale_after``, like one that stopped answering.

Several processes (the workers of ``--workers N``) share the polls through a :class:`PollShare`:
each backend is polled by one of them, which publishes what it saw after every poll (the
reading, its errors, its health, its staleness) as a small JSON record; the others read that
record at their own poll times, half an interval after the publisher's, and hand it to their
sinks as if they had scraped it themselves (without counting its failures again). A backend whose record is
older than :attr:`PollTarget.takeover_after` (its publisher died, froze or is restarting) is
polled by each of the others itself, publishing nothing, until fresh records come back. Each
engine is then scraped once per interval whatever the number of workers, and a worker spends
on the backends it follows a board read and a JSON decode instead of two HTTP requests.

Lifecycle: ``await poller.start()`` / ``await poller.stop()``, or ``async with poller:``; the
gateway starts and stops it from an aiohttp ``cleanup_ctx``. Nothing here blocks: every network
wait is bounded by a timeout and a sink call must return at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import orjson

from kvgate.telemetry.engine_metrics import (
    ENGINES,
    MAX_KV_CAPACITY_TOKENS,
    MAX_REQUEST_COUNT,
    EngineReading,
    MetricsError,
    parse_llamacpp_slots,
    read_engine_metrics,
)

__all__ = ["BackendStatus", "MetricsPoller", "PollShare", "PollTarget", "ReadingSink"]

logger = logging.getLogger("kvgate.telemetry")


class ReadingSink(Protocol):
    """Receives what the poller sees. Calls are made on the event loop and must not block.

    ``now`` is the poller's clock (``loop.time()`` by default), in seconds.
    """

    def on_reading(self, backend: str, reading: EngineReading, now: float) -> None:
        """A good reading (validated: KV ratio in 0..1, counts ≥ 0)."""

    def on_failure(self, backend: str, reason: str, message: str, now: float) -> None:
        """A failed scrape; ``reason`` is a short label (``connect``, ``timeout``,
        ``http_status``, ``too_large``, ``unknown_engine``, ``missing_metric``, ``bad_value``,
        ``error``) suitable for a metric, ``message`` the detail for a log."""

    def on_stale(self, backend: str, stale: bool, now: float) -> None:
        """The backend's metrics became stale (``True``) or fresh again (``False``)."""

    def on_health(self, backend: str, healthy: bool, now: float) -> None:
        """The backend failed its health check ``unhealthy_after`` times in a row (``False``:
        take it out of routing) or passed it again (``True``: put it back)."""


class PollShare(Protocol):
    """Shares one poll of each backend between processes serving the same backends (the
    workers of ``--workers N``): which backends this process polls, and the board where each
    poller publishes its records (:class:`kvgate.telemetry.share.BoardShare`)."""

    #: Largest record :meth:`publish` takes, in bytes.
    max_record: int

    def polls(self, backend: str) -> bool:
        """Whether this process polls ``backend``'s engine (and publishes what it reads)."""

    def publish(self, backend: str, record: bytes) -> None:
        """Leaves ``record`` for the other processes (best effort: it may be dropped)."""

    def read(self, backend: str) -> tuple[int, bytes] | None:
        """The record last published for ``backend`` and its sequence number (it grows with
        every publication), or ``None`` when there is none."""


#: :class:`EngineReading` fields a published record carries (not ``sources``).
_RECORD_FIELDS = (
    "engine",
    "kv_usage",
    "running",
    "waiting",
    "preemptions_total",
    "kv_capacity_tokens",
    "slots",
    "skipped_lines",
)


@dataclass(frozen=True, slots=True)
class PollTarget:
    """What to poll for one backend.

    Attributes:
        name: backend name (used in logs and passed to the sink).
        metrics_url: Prometheus endpoint, e.g. ``http://10.0.0.5:8000/metrics``.
        engine: one of :data:`~kvgate.telemetry.engine_metrics.ENGINES` or ``"auto"``.
        model: served model name to filter series by, or ``None`` for all.
        health_url: health endpoint (2xx = healthy), or ``None`` to skip health checks.
        slots_url: llama.cpp ``GET /slots``, read when the metrics carry no KV ratio (also with
            ``engine="auto"``, once the metrics name llama.cpp).
        kv_unified: llama.cpp runs one KV pool shared by all slots (the KV capacity is then
            one slot's ``n_ctx``, not the sum).
        poll_interval: seconds between scrapes (> 0).
        scrape_timeout: seconds per request (< ``poll_interval``); default 0.8 × interval.
        stale_after: seconds without a good reading before the backend is stale (≥ interval).
        unhealthy_after: consecutive failed health checks before the backend is taken out.
        max_body_bytes: larger metrics bodies are refused (reason ``too_large``).
        adaptive: whether the backend's limits adapt from these metrics; without it, stale
            metrics change nothing and are logged at INFO instead of WARNING.
        headers: sent with every request to the backend (its ``Authorization: Bearer <key>``
            when it has an API key: engines started with ``--api-key`` protect ``/metrics``,
            ``/health`` and llama.cpp's ``/slots`` too), or ``None``.

    Raises:
        ValueError: a value outside the ranges above.
    """

    name: str
    metrics_url: str
    engine: str = "auto"
    model: str | None = None
    health_url: str | None = None
    slots_url: str | None = None
    kv_unified: bool = False
    poll_interval: float = 1.0
    scrape_timeout: float | None = None
    stale_after: float = 5.0
    unhealthy_after: int = 3
    max_body_bytes: int = 8 * 1024 * 1024
    adaptive: bool = True
    headers: Mapping[str, str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.engine != "auto" and self.engine not in ENGINES:
            raise ValueError(f"{self.name}: unknown engine {self.engine!r}")
        if not self.poll_interval > 0:
            raise ValueError(f"{self.name}: poll_interval must be > 0")
        if self.scrape_timeout is not None and not (0 < self.scrape_timeout < self.poll_interval):
            raise ValueError(f"{self.name}: scrape_timeout must be > 0 and < poll_interval")
        if self.stale_after < self.poll_interval:
            raise ValueError(f"{self.name}: stale_after must be ≥ poll_interval")
        if self.unhealthy_after < 1:
            raise ValueError(f"{self.name}: unhealthy_after must be ≥ 1")
        if self.max_body_bytes < 1:
            raise ValueError(f"{self.name}: max_body_bytes must be ≥ 1")

    @property
    def timeout(self) -> float:
        """The per-request timeout in seconds."""
        return self.scrape_timeout if self.scrape_timeout is not None else 0.8 * self.poll_interval

    @property
    def takeover_after(self) -> float:
        """Seconds after which a process following this backend's published records polls it
        itself: three intervals without a record (a publisher publishes one per interval)."""
        return 3 * self.poll_interval


@dataclass(slots=True)
class BackendStatus:
    """The poller's view of one backend (for ``/admin/state`` and metrics).

    Times are on the poller's clock, in seconds. ``errors_by_reason`` counts failed scrapes by
    reason; ``scrape_errors`` is their total.
    """

    target: PollTarget
    started_at: float
    last_reading: EngineReading | None = None
    last_good_at: float | None = None
    last_error: str | None = None
    stale: bool = False
    healthy: bool = True
    scrape_errors: int = 0
    errors_by_reason: dict[str, int] = field(default_factory=dict)
    health_failures: int = 0
    #: ``time.monotonic()`` of the last good scrape (the clock every process shares).
    good_mono: float | None = None
    #: Following another process's records: the last record's sequence word read (0: none
    #: yet, -1: polling the backend here meanwhile), its publication time
    #: (``time.monotonic()``) and its poller's interval (seconds).
    record_seq: int = 0
    record_t: float | None = None
    record_i: float = 1.0

    def age(self, now: float) -> float | None:
        """Seconds since the last good scrape, or ``None`` if there has been none."""
        return None if self.last_good_at is None else now - self.last_good_at


class _ScrapeFailed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class MetricsPoller:
    """Polls every target on its own asyncio task; see the module docstring.

    Args:
        session: a client session to poll with (not closed by the poller), or ``None``: the
            poller makes its own at :meth:`start` (no cookie jar, no trace hooks: a scrape
            costs less than on the gateway's upstream session, which carries the relay's
            connection-reuse trace) and closes it at :meth:`stop`.
        sink: receives readings, failures and stale / health transitions.
        targets: one :class:`PollTarget` per backend (names must be unique).
        clock: seconds, monotonic; default ``loop.time()`` of the running loop.
        share: poll only the backends it names and follow the other processes' records for
            the rest (see the module docstring); ``None``: poll every backend.

    Raises:
        ValueError: duplicate backend names.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession | None,
        sink: ReadingSink,
        targets: Iterable[PollTarget],
        *,
        clock: Callable[[], float] | None = None,
        share: PollShare | None = None,
    ) -> None:
        self._given = session
        self._share = share
        self._session = session
        self._sink = sink
        self._targets: dict[str, PollTarget] = {}
        for t in targets:
            if t.name in self._targets:
                raise ValueError(f"duplicate backend name {t.name!r}")
            self._targets[t.name] = t
        self._clock = clock
        self._status: dict[str, BackendStatus] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._unpublished: set[str] = set()  # backends whose record failed (logged once)

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    # ----------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start one polling task per target (idempotent). Must run on the event loop.

        Each target is polled once at once, then every ``poll_interval`` at its own phase: the
        ``i``-th of ``n`` targets ``i / n`` of an interval after the others, so that a gateway
        of a thousand backends spreads its scrapes over the second rather than sending them
        all at the same moment (a burst that would hold the event loop for the requests it
        serves). Phases are counted on the system's monotonic clock, so processes that
        started at different times keep them; a backend followed through the share is read
        half an interval after its phase, when its publisher has had time to poll it."""
        now = self._now()
        n = len(self._targets)
        for i, (name, target) in enumerate(self._targets.items()):
            if name in self._tasks:
                continue
            self._status.setdefault(name, BackendStatus(target=target, started_at=now))
            phase = i / n * target.poll_interval
            if not self._polls(name):
                phase = (phase + 0.5 * target.poll_interval) % target.poll_interval
            self._tasks[name] = asyncio.create_task(
                self._run(name, phase), name=f"kvgate-poll-{name}"
            )

    def _http(self) -> aiohttp.ClientSession:
        """The session to poll with (the poller's own is made on first use)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def stop(self) -> None:
        """Cancel every polling task and wait for them to end (and close the poller's own
        session)."""
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._given is None and self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> MetricsPoller:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ----------------------------------------------------------------------------- state

    @property
    def backends(self) -> list[str]:
        """Backend names, in configuration order."""
        return list(self._targets)

    def status(self, backend: str) -> BackendStatus:
        """The live status of ``backend`` (raises ``KeyError`` for an unknown name, or before
        :meth:`start` / :meth:`poll_once`)."""
        return self._status[backend]

    def _polls(self, backend: str) -> bool:
        """Whether this process polls ``backend`` itself (always without a share)."""
        return self._share is None or self._share.polls(backend)

    # ----------------------------------------------------------------------------- polling

    async def _run(self, name: str, phase: float) -> None:
        target = self._targets[name]
        loop = asyncio.get_running_loop()
        # the first poll now, then at the phase of each interval counted on the loop's clock
        # (the system's monotonic clock, the same in every process of the host: a worker
        # following another's records reads them half an interval after they were published,
        # whenever each started)
        now = loop.time()
        next_at = now - (now - phase) % target.poll_interval
        while True:
            try:
                await self.poll_once(name)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in a sink must not end polling
                logger.exception("backend %s: unexpected error while polling", name)
            interval = target.poll_interval
            next_at += interval
            now = loop.time()
            if next_at < now:
                # late (a slow scrape, a busy loop): poll now, the missed ones skipped, and
                # keep the phase for the next ones (taking "now" as the new phase would let
                # every stall of the loop bunch the targets up again)
                next_at += (now - next_at) // interval * interval
            await asyncio.sleep(max(0.0, next_at - now))

    async def poll_once(self, backend: str) -> None:
        """One scrape (and one health check, when configured) of ``backend``, then the staleness
        check; with a share, the record published afterwards (even when a sink call failed),
        or, for a backend another process polls, its latest record read instead
        (:meth:`_follow`). Used by the polling task; tests may call it directly."""
        target = self._targets[backend]
        st = self._status.get(backend)
        if st is None:
            st = self._status[backend] = BackendStatus(target=target, started_at=self._now())
        polls = self._polls(backend)
        if not polls and self._follow(st):
            return
        try:
            if target.health_url is not None:
                await asyncio.gather(self._scrape(st), self._check_health(st))
            else:
                await self._scrape(st)
        finally:
            if self._share is not None and polls:
                self._publish(self._share, st)

    def _publish(self, share: PollShare, st: BackendStatus) -> None:
        """Publishes ``st``'s record; a failure is logged (once per backend) and never raised
        (it may run while a cancellation unwinds :meth:`poll_once`)."""
        name = st.target.name
        try:
            share.publish(name, self._record(st))
        except Exception:
            if name not in self._unpublished:
                self._unpublished.add(name)
                logger.exception("backend %s: its poll's record could not be published", name)

    # ----------------------------------------------------------------------------- sharing

    def _record(self, st: BackendStatus) -> bytes:
        """``st`` as a published record: JSON, at most the share's ``max_record`` bytes (the
        last error is cut to fit; a reading field JSON cannot hold is left out)."""
        r = st.last_reading
        reading = None
        if r is not None:
            reading = {k: getattr(r, k) for k in _RECORD_FIELDS}
            for k, v in reading.items():
                if isinstance(v, int) and not -(2**63) <= v < 2**63:
                    reading[k] = None
        rec: dict[str, Any] = {
            "t": time.monotonic(),
            "i": st.target.poll_interval,
            "g": st.good_mono,
            "r": reading,
            "n": st.scrape_errors,
            "h": st.healthy,
            "s": st.stale,
            "e": st.last_error,
        }
        out = orjson.dumps(rec)
        limit = self._share.max_record if self._share is not None else len(out)
        if len(out) > limit and st.last_error is not None:
            error = st.last_error.encode(errors="replace")
            keep = len(error)
            while len(out) > limit and keep > 0:  # JSON escapes can make it longer than bytes
                keep = max(0, keep - (len(out) - limit) - 3)
                rec["e"] = error[:keep].decode(errors="ignore") + "…"
                out = orjson.dumps(rec)
        return out

    def _follow(self, st: BackendStatus) -> bool:
        """Takes the latest record another process published for ``st``'s backend: its
        reading (handed to the sink when new), its health and staleness transitions, its error
        count. Returns ``False`` when there is nothing to follow — no record, or one older than
        ``takeover_after`` (of this target or of the publisher's interval, the longer), beyond
        the first ``takeover_after`` after start — so that the caller polls the backend
        itself. While it follows, staleness is the publisher's, not worked out here: a
        publisher that stops is taken over before its last reading can make the backend look
        stale."""
        assert self._share is not None
        target, name = st.target, st.target.name
        now = self._now()
        mono = time.monotonic()
        got = self._share.read(name)
        # how long a record stays good: three of the longer of the two pollers' intervals
        keep = max(target.takeover_after, 3 * st.record_i)
        if got is not None and got[0] == st.record_seq and st.record_t is not None:
            # nothing new since the last read: still fresh?
            if mono - st.record_t <= keep:
                return True
            rec = None
        else:
            rec = _decode_record(got[1]) if got is not None else None
            if rec is not None and mono - rec["t"] > max(target.takeover_after, 3 * rec["i"]):
                rec = None  # an old record: its poller is gone
            elif rec is None and st.record_t is not None and mono - st.record_t < keep:
                # none readable now, a good one a moment ago: a write in progress or cut short
                # (torn); the next read will tell
                return True
        if rec is None:
            if st.record_seq == 0 and now - st.started_at < target.takeover_after:
                return True  # starting: its poller has not published yet
            if st.record_seq >= 0:
                logger.info(
                    "backend %s: no record from the process that polls it for %s; polling it "
                    "here until its records come back",
                    name,
                    "ever" if st.record_t is None else f"{mono - st.record_t:.1f} s",
                )
                st.record_seq = -1
            return False
        assert got is not None
        if st.record_seq < 0:
            logger.info("backend %s: following its poller's records again", name)
        st.record_seq, st.record_t, st.record_i = got[0], rec["t"], rec["i"]
        st.scrape_errors, st.last_error = rec["n"], rec["e"]
        st.health_failures = 0  # its poller's health checks count, not ours
        healthy = rec["h"]
        if healthy != st.healthy:
            st.healthy = healthy
            logger.info(
                "backend %s: %s (its poller's health check)",
                name,
                "healthy again; back in routing" if healthy else "taken out of routing",
            )
            self._sink.on_health(name, healthy, now)
        good, reading = rec["g"], rec["r"]
        # a newer good scrape than any this process knows (its own, while it polled the backend
        # itself, included): a publisher that wakes from a freeze may publish an older one
        new = reading is not None and good is not None and good > (st.good_mono or 0.0)
        if new:
            st.good_mono = good
            st.last_reading = reading
            st.last_good_at = now - max(0.0, mono - good)
        if rec["s"] != st.stale:
            st.stale = rec["s"]
            logger.log(
                logging.INFO if not st.stale or not target.adaptive else logging.WARNING,
                "backend %s: engine metrics %s (its poller's scrapes)",
                name,
                "stale" if st.stale else "fresh again",
            )
            self._sink.on_stale(name, st.stale, now)
        if new and not st.stale:  # (a publisher fresh again says so in the reading's record)
            self._sink.on_reading(name, reading, now)
        return True

    async def _scrape(self, st: BackendStatus) -> None:
        target = st.target
        try:
            reading = await self._read(target)
        except _ScrapeFailed as exc:
            self._failed(st, exc.reason, str(exc))
        except MetricsError as exc:
            self._failed(st, exc.reason, str(exc))
        else:
            now = self._now()
            st.last_reading, st.last_good_at, st.last_error = reading, now, None
            st.good_mono = time.monotonic()
            if st.stale:
                st.stale = False
                logger.info("backend %s: engine metrics fresh again", target.name)
                self._sink.on_stale(target.name, False, now)
            self._sink.on_reading(target.name, reading, now)
            return
        self._check_stale(st)

    def _failed(self, st: BackendStatus, reason: str, message: str) -> None:
        st.scrape_errors += 1
        st.errors_by_reason[reason] = st.errors_by_reason.get(reason, 0) + 1
        st.last_error = f"{reason}: {message}"
        logger.debug("backend %s: metrics scrape failed (%s)", st.target.name, st.last_error)
        self._sink.on_failure(st.target.name, reason, message, self._now())

    def _check_stale(self, st: BackendStatus) -> None:
        now = self._now()
        since = st.last_good_at if st.last_good_at is not None else st.started_at
        if not st.stale and now - since >= st.target.stale_after:
            st.stale = True
            logger.log(
                logging.WARNING if st.target.adaptive else logging.INFO,
                "backend %s: engine metrics stale (no good scrape for %.1f s; last error: %s)%s",
                st.target.name,
                now - since,
                st.last_error,
                "" if st.target.adaptive else "; adaptive limits are off for it, nothing changes",
            )
            self._sink.on_stale(st.target.name, True, now)

    async def _read(self, target: PollTarget) -> EngineReading:
        body = await self._get(target.metrics_url, target)
        reading = read_engine_metrics(body, target.engine, model=target.model)
        if reading.engine == "llamacpp" and reading.kv_usage is None and target.slots_url:
            try:
                body_slots = await self._get(target.slots_url, target)
                slots = parse_llamacpp_slots(body_slots, unified=target.kv_unified)
            except (_ScrapeFailed, MetricsError) as exc:
                # /slots is optional (--no-slots): the queue gauge still drives adaptation
                logger.debug("backend %s: /slots unavailable: %s", target.name, exc)
            else:
                reading = read_engine_metrics(body, "llamacpp", model=target.model, slots=slots)
        return reading

    async def _get(self, url: str, target: PollTarget) -> bytes:
        timeout = aiohttp.ClientTimeout(total=target.timeout)
        started = time.monotonic()
        try:
            async with self._http().get(url, timeout=timeout, headers=target.headers) as resp:
                if resp.status != 200:
                    raise _ScrapeFailed("http_status", f"GET {url} answered HTTP {resp.status}")
                if resp.content_length is not None and resp.content_length > target.max_body_bytes:
                    raise _ScrapeFailed("too_large", f"GET {url}: {resp.content_length} bytes")
                chunks: list[bytes] = []
                size = 0
                async for chunk in resp.content.iter_chunked(64 * 1024):
                    size += len(chunk)
                    if size > target.max_body_bytes:
                        raise _ScrapeFailed("too_large", f"GET {url}: over {size} bytes")
                    chunks.append(chunk)
                return b"".join(chunks)
        except TimeoutError:
            elapsed = time.monotonic() - started
            raise _ScrapeFailed("timeout", f"GET {url} timed out after {elapsed:.2f} s") from None
        except aiohttp.ClientConnectionError as exc:
            raise _ScrapeFailed("connect", f"GET {url}: {exc}") from None
        except aiohttp.ClientError as exc:
            raise _ScrapeFailed("error", f"GET {url}: {exc!r}") from None

    async def _check_health(self, st: BackendStatus) -> None:
        target = st.target
        assert target.health_url is not None
        timeout = aiohttp.ClientTimeout(total=target.timeout)
        try:
            async with self._http().get(
                target.health_url, timeout=timeout, headers=target.headers
            ) as resp:
                ok = 200 <= resp.status < 300
                detail = f"HTTP {resp.status}"
        except TimeoutError:
            ok, detail = False, f"no answer in {target.timeout:g} s"
        except aiohttp.ClientError as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        now = self._now()
        if ok:
            st.health_failures = 0
            if not st.healthy:
                st.healthy = True
                logger.info("backend %s: healthy again; back in routing", target.name)
                self._sink.on_health(target.name, True, now)
            return
        st.health_failures += 1
        if st.healthy and st.health_failures >= target.unhealthy_after:
            st.healthy = False
            logger.warning(
                "backend %s: health check failed %d times (%s); taken out of routing",
                target.name,
                st.health_failures,
                detail,
            )
            self._sink.on_health(target.name, False, now)


def _number(v: Any, *, lo: float, hi: float, integer: bool = False) -> bool:
    """``v`` is a JSON number in ``lo..hi`` (an integer when ``integer``; never a bool)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    if integer and not isinstance(v, int):
        return False
    return math.isfinite(v) and lo <= v <= hi


def _reading_ok(r: dict[str, Any]) -> bool:
    """The fields of a published reading hold what a scrape can produce (the bounds of
    :mod:`kvgate.telemetry.engine_metrics`)."""

    def opt(k: str, **bounds: Any) -> bool:
        return r[k] is None or _number(r[k], **bounds)

    return (
        r["engine"] in ENGINES
        and opt("kv_usage", lo=0.0, hi=1.0)
        and opt("running", lo=0, hi=MAX_REQUEST_COUNT, integer=True)
        and opt("waiting", lo=0, hi=MAX_REQUEST_COUNT, integer=True)
        and opt("preemptions_total", lo=0.0, hi=float("inf"))
        and opt("kv_capacity_tokens", lo=1, hi=MAX_KV_CAPACITY_TOKENS, integer=True)
        and opt("slots", lo=1, hi=MAX_REQUEST_COUNT, integer=True)
        and _number(r["skipped_lines"], lo=0, hi=2**62, integer=True)
    )


def _decode_record(raw: bytes) -> dict[str, Any] | None:
    """A published record (:meth:`MetricsPoller._record`) with its reading as an
    :class:`EngineReading`, or ``None`` when it is not one (garbage is never followed: a
    time in the future, a field out of the range a scrape allows)."""
    try:
        rec = orjson.loads(raw)
        t, good, r = rec["t"], rec["g"], rec["r"]
        if not _number(t, lo=0.0, hi=time.monotonic() + 1.0):
            return None
        if good is not None and not _number(good, lo=0.0, hi=t):
            return None
        if not _number(rec["i"], lo=1e-6, hi=86_400.0):
            return None
        if not isinstance(rec["h"], bool) or not isinstance(rec["s"], bool):
            return None
        if not _number(rec["n"], lo=0, hi=2**62, integer=True):
            return None
        if rec["e"] is not None and not isinstance(rec["e"], str):
            return None
        if r is not None:
            if not isinstance(r, dict) or set(r) != set(_RECORD_FIELDS) or not _reading_ok(r):
                return None
            rec["r"] = EngineReading(**r)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    return rec
