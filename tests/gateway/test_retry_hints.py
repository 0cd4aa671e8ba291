"""Retry hints of refusals that wait for a slot, from the requests actually holding the slots,
and header values without floating-point noise.

The end-to-end test holds a tenant's two slots with two ~3 s streams from a ticking fake engine
and checks what the official ``openai`` client (default ``max_retries=2``) makes of the third
call's refusal: it either gets through after waiting or fails no sooner than the streams end.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.gateway.fake_upstream import serve_app

from kvgate import AdmissionController
from kvgate._core import go_duration
from kvgate.admission import retry_hint
from kvgate.admission.retry_hint import COLD_HOLD, MAX_HINT, MIN_HINT, RunningRequests
from kvgate.config import Config
from kvgate.gateway_build import build_gateway
from kvgate.server import run_gateway

from .conftest import sha
from .helpers import until

#: seconds between two streamed tokens of the ticking engine
TICK = 0.05


@dataclass
class Ticker:
    """A fake engine streaming ``max_tokens`` content chunks, one every :data:`TICK` s, then
    the usage chunk (when asked) and ``[DONE]``; non-streamed, the same wait then one answer."""

    url: str = ""
    active: int = 0
    first_chunk_at: list[float] = field(default_factory=list)


def _ticker_app(state: Ticker) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        n = int(body.get("max_tokens") or 4)
        state.active += 1
        try:
            if not body.get("stream"):
                await asyncio.sleep(n * TICK)
                answer = {
                    "id": "c",
                    "object": "chat.completion",
                    "created": 1,
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "t " * n},
                            "finish_reason": "length",
                        }
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n},
                }
                return web.json_response(answer)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(n):
                chunk = {
                    "id": "c",
                    "object": "chat.completion.chunk",
                    "created": 1,
                    "model": body["model"],
                    "choices": [{"index": 0, "delta": {"content": "t "}, "finish_reason": None}],
                }
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                if i == 0:
                    state.first_chunk_at.append(time.monotonic())
                await asyncio.sleep(TICK)
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {
                    "id": "c",
                    "object": "chat.completion.chunk",
                    "created": 1,
                    "model": body["model"],
                    "choices": [],
                    "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n},
                }
                await resp.write(b"data: " + orjson.dumps(usage) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            state.active -= 1

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


@contextlib.asynccontextmanager
async def run_ticker() -> AsyncIterator[Ticker]:
    state = Ticker()
    async with serve_app(_ticker_app(state)) as state.url:
        yield state


def _config(url: str) -> Config:
    return Config.model_validate(
        {
            "backends": [
                {
                    "name": "b0",
                    "url": url,
                    "models": [{"name": "m", "context_window": 4096}],
                    "max_concurrency": 8,
                    "tokens_per_minute": 10_000_000,
                    "adaptive": {"enabled": False},
                }
            ],
            "tenants": [
                {"name": "alice", "api_key_sha256": [sha("sk-alice")], "max_concurrency": 2},
                {"name": "bob", "api_key_sha256": [sha("sk-bob")]},
            ],
        }
    )


async def _stream(client: openai.AsyncOpenAI, max_tokens: int) -> int:
    """One streamed chat call read to its end; the number of content chunks."""
    got = 0
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=max_tokens,
        stream=True,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got += 1
    return got


async def test_openai_client_waits_for_the_streams_holding_the_tenants_slots() -> None:
    """Alice's 2 slots are held by 2 streams of 60 tokens (3 s); bob runs a short stream at the
    same time (his requests do not count for alice's tenant-concurrency refusal). The refusal's
    Retry-After is the streams' remaining time (their reserved completion at the decode rate
    observed on a warm-up request), not a few ms; the official client, with its 2 retries,
    either gets through or gives up no sooner than the streams end."""
    long_tokens = 60
    async with run_ticker() as engine:
        gateway = build_gateway(_config(engine.url), poll=False)
        async with run_gateway(gateway) as url, aiohttp.ClientSession() as s:
            alice = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-alice")
            bob = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-bob")
            assert alice.max_retries == 2  # the default
            # warm-up: the backend's decode rate is learnt from a finished stream
            assert await _stream(alice, 4) == 4
            engine.first_chunk_at.clear()
            holders = [asyncio.create_task(_stream(alice, long_tokens)) for _ in range(2)]
            short = asyncio.create_task(_stream(bob, 12))
            await until(lambda: len(engine.first_chunk_at) == 3, timeout=10)
            ends = max(engine.first_chunk_at[:3]) + long_tokens * TICK  # latest possible end
            # the refusal itself: 429 tenant-concurrency, hint = the streams' remaining time
            async with s.post(
                url + "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                headers={"Authorization": "Bearer sk-alice"},
            ) as r:
                assert r.status == 429
                assert r.headers["x-kvgate-reject-reason"] == "tenant-concurrency"
                hint = int(r.headers["retry-after-ms"]) / 1000
                remaining = ends - time.monotonic()
                reset = r.headers["x-ratelimit-reset-requests"]
            # generous bounds (2 loaded cores): within the streams' remaining time, give or take
            assert remaining - 1.0 < hint < remaining + 1.5, (hint, remaining)
            assert int(r.headers["Retry-After"]) == pytest.approx(hint, abs=1)
            assert _parse_go(reset) == pytest.approx(hint, abs=0.002)
            # the official client with its defaults
            started = time.monotonic()
            try:
                done = await alice.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2
                )
                outcome = "ok"
                assert done.choices[0].message.content
            except openai.RateLimitError:
                outcome = "refused"
            waited = time.monotonic() - started
            streams_left = ends - started
            if outcome == "refused":
                # it gave up only once the streams were (about to be) over
                assert waited >= streams_left - 0.3, (waited, streams_left)
            else:
                assert waited >= streams_left - 1.0, (waited, streams_left)
            assert [await h for h in holders] == [long_tokens, long_tokens]
            assert await short == 12
            await alice.close()
            await bob.close()
        # nothing leaked
        ctl = gateway.controller
        assert ctl.backend_state(0)["in_use"] == 0
        assert ctl.tenant_state(ctl.tenant_id("alice"))["in_use"] == 0
        assert len(gateway.running) == 0


_GO = re.compile(r"^(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+(?:\.(\d+))?)(ms|s))?$")


def _parse_go(text: str) -> float:
    """Seconds of a Go duration as kvgate writes it (``1h2m3.5s``, ``850ms``, ``0s``)."""
    m = _GO.match(text)
    assert text, text
    assert m is not None, text
    hours, minutes, number, _, unit = m.groups()
    value = float(number or 0) / (1000 if unit == "ms" else 1)
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + value


def _decimals(text: str) -> int:
    m = re.search(r"\.(\d+)", text)
    return len(m.group(1)) if m else 0


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.floats(min_value=0, max_value=1e7, allow_nan=False),
        st.integers(min_value=0, max_value=10**13).map(lambda ns: ns / 1e9),
        st.integers(min_value=0, max_value=10**7).map(lambda ms: ms / 1000 + 4e-9),
    )
)
def test_go_durations_have_no_float_noise(seconds: float) -> None:
    """``x-ratelimit-reset-*`` values: at most 3 decimals, and they read back within 1 ms."""
    text = go_duration(seconds)
    assert text.isascii()
    assert _decimals(text) <= 3, text
    back = _parse_go(text)
    if seconds > 0:
        assert abs(back - seconds) <= 0.001 + 1e-9, (seconds, text)
    else:
        assert text == "0s"


def test_go_duration_examples() -> None:
    assert go_duration(0.088000004) == "88ms"
    assert go_duration(0.0879996) == "88ms"
    assert go_duration(1.2345678) == "1.235s"
    assert go_duration(59.9999) == "1m0s"
    assert go_duration(0.0004) == "1ms"  # a wait, however short, is never "0s"


_RETRY_CTL = AdmissionController()
_RETRY_B = _RETRY_CTL.add_backend("b", max_concurrency=4, tokens_per_minute=600)
_RETRY_T = _RETRY_CTL.add_tenant("t", priority="standard")


@settings(max_examples=400, deadline=None)
@given(st.floats(min_value=1e-6, max_value=1e6, allow_nan=False))
def test_retry_after_values_are_short_and_never_early(seconds: float) -> None:
    """``retry-after-ms`` is an integer (no float noise), never below the wait and at most
    1 ms above it; ``Retry-After`` is whole seconds, rounded up."""
    h = dict(_RETRY_CTL.refusal_headers(_RETRY_B, _RETRY_T, seconds, "backend-slots"))
    ms = h["retry-after-ms"]
    assert ms.isdigit(), ms
    assert seconds * 1000 - 1e-6 <= int(ms) <= seconds * 1000 + 1 + 1e-6
    assert h["Retry-After"].isdigit()
    assert int(h["Retry-After"]) >= seconds - 1e-9


# ---- the estimator on its own ------------------------------------------------------------


@pytest.fixture
def fresh_hints(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every hint computed anew (no reuse within ``HINT_REUSE``)."""
    monkeypatch.setattr(retry_hint, "HINT_REUSE", 0.0)


def _aged(rr: RunningRequests, backend: int, tenant: int, completion: int, age: float) -> object:
    entry = rr.start(backend, tenant, completion)
    entry.started -= age  # type: ignore[attr-defined]
    return entry


def _learn(rr: RunningRequests, backend: int, hold: float, tokens: int, first_byte: float) -> None:
    entry = _aged(rr, backend, 9, tokens, hold)
    rr.finish(
        entry,  # type: ignore[arg-type]
        completed=True,
        stream=True,
        first_byte=first_byte,
        completion_tokens=tokens,
    )


@pytest.mark.usefixtures("fresh_hints")
def test_hint_is_none_without_running_requests_in_scope() -> None:
    rr = RunningRequests()
    assert rr.hint(0) is None
    _aged(rr, 1, 1, 10, 1.0)
    assert rr.hint(0) is None  # another backend's
    assert rr.hint(1, tenant=2) is None  # another tenant's


@pytest.mark.usefixtures("fresh_hints")
def test_cold_start_assumes_a_hold_then_as_long_again_as_it_ran() -> None:
    rr = RunningRequests()
    _aged(rr, 0, 0, 100, 0.2)
    assert rr.hint(0) == pytest.approx(COLD_HOLD - 0.2, abs=0.01)
    rr = RunningRequests()
    _aged(rr, 0, 0, 100, 5.0)
    assert rr.hint(0) == pytest.approx(5.0, abs=0.01)


@pytest.mark.usefixtures("fresh_hints")
def test_reserved_completion_at_the_observed_decode_rate() -> None:
    rr = RunningRequests()
    _learn(rr, 0, hold=0.3, tokens=5, first_byte=0.05)  # 0.05 s per token after a 0.05 s head
    _aged(rr, 0, 0, 60, 1.0)  # 0.05 + 60 × 0.05 = 3.05 s in all, 1 s gone
    _aged(rr, 0, 0, 100, 0.5)  # 5.05 s in all, 0.5 s gone
    assert rr.hint(0) == pytest.approx(2.05, abs=0.02)  # the next release
    # the queue: the second release, then whole holds (the median recent hold: 0.3 s)
    assert rr.hint(0, ahead=1) == pytest.approx(4.55, abs=0.02)
    assert rr.hint(0, ahead=2) == pytest.approx(2.05 + 0.3, abs=0.02)
    assert rr.hint(0, ahead=5) == pytest.approx(4.55 + 2 * 0.3, abs=0.02)


@pytest.mark.usefixtures("fresh_hints")
def test_tenant_scope_counts_only_the_tenants_requests() -> None:
    rr = RunningRequests()
    _learn(rr, 0, hold=0.3, tokens=5, first_byte=0.05)
    _aged(rr, 0, 1, 60, 0.0)  # tenant 1: 3.05 s to go
    _aged(rr, 0, 2, 4, 0.0)  # tenant 2: 0.25 s to go
    assert rr.hint(0) == pytest.approx(0.25, abs=0.02)
    assert rr.hint(0, tenant=1) == pytest.approx(3.05, abs=0.02)


@pytest.mark.usefixtures("fresh_hints")
def test_overdue_requests_use_the_hold_distribution_then_a_floor() -> None:
    rr = RunningRequests()
    for hold in (1.0, 2.0, 8.0, 9.0, 10.0):
        _learn(rr, 0, hold=hold, tokens=10, first_byte=0.1)
    entry = _aged(rr, 0, 0, 0, 3.0)  # no completion reserved: the distribution decides
    # holds longer than 3 s: 8, 9, 10 → median 9 → 6 s to go
    assert rr.hint(0) == pytest.approx(6.0, abs=0.02)
    rr.finish(entry, completed=False, stream=False, first_byte=None, completion_tokens=0)  # type: ignore[arg-type]
    _aged(rr, 0, 0, 0, 20.0)  # longer than any: overdue, a tenth of its age
    assert rr.hint(0) == pytest.approx(2.0, abs=0.02)


@pytest.mark.usefixtures("fresh_hints")
def test_hint_bounds() -> None:
    rr = RunningRequests()
    _learn(rr, 0, hold=1.0, tokens=1, first_byte=0.0)  # 1 s per token
    _aged(rr, 0, 0, 10_000, 0.0)
    assert rr.hint(0) == MAX_HINT
    rr = RunningRequests()
    _aged(rr, 0, 0, 0, 0.0)
    assert rr.hint(0) >= MIN_HINT  # type: ignore[operator]


@pytest.mark.usefixtures("fresh_hints")
def test_cut_off_requests_teach_nothing() -> None:
    rr = RunningRequests()
    entry = _aged(rr, 0, 0, 50, 0.01)
    rr.finish(entry, completed=False, stream=True, first_byte=0.001, completion_tokens=1)  # type: ignore[arg-type]
    assert len(rr) == 0
    _aged(rr, 0, 0, 50, 0.2)
    assert rr.hint(0) == pytest.approx(COLD_HOLD - 0.2, abs=0.01)  # still cold


def test_a_hint_is_reused_briefly_for_a_burst_of_refusals() -> None:
    rr = RunningRequests()
    _aged(rr, 0, 0, 0, 0.2)
    first = rr.hint(0)
    assert first == pytest.approx(COLD_HOLD - 0.2, abs=0.05)
    _aged(rr, 0, 0, 0, 0.7)  # ends sooner (0.7 s); a change within HINT_REUSE is not seen yet
    assert rr.hint(0) == first
    assert rr.hint(0, ahead=1) != first  # another queue position is its own computation
    time.sleep(retry_hint.HINT_REUSE * 2)
    assert rr.hint(0) == pytest.approx(0.7, abs=0.05)  # now it is
    assert rr.hint(0, tenant=5) is None


@pytest.mark.usefixtures("fresh_hints")
def test_a_store_refusal_keeps_its_figures_and_note_with_the_slot_hint() -> None:
    """A refusal of the shared store for a slot gets the hint from the requests this replica
    runs, and keeps what the store said of the limit across the replicas (0 slots left) and
    how it was decided: the headers then say 0 left and the hint's wait, and the message the
    note (before, the refusal was rebuilt without them: ``remaining-requests`` was this
    replica's own view and the note was lost)."""
    from kvgate.store import StoreRefusal

    ctl = AdmissionController()
    b = ctl.add_backend("b", max_concurrency=64, tokens_per_minute=10**6)
    t = ctl.add_tenant("t", priority="standard", max_concurrency=8)
    rr = RunningRequests()
    _aged(rr, b, t, 100, 0.5)  # one of the tenant's requests runs here: 0.5 s gone of 1 s
    note = "decided by this replica alone, Redis not answering: share"
    refusal = StoreRefusal(
        "tenant-concurrency", scope="tenant", retry_after=0.5, remaining=0, note=note
    )
    hinted = retry_hint.slot_hint(refusal, rr, b, t, 0)
    assert type(hinted) is StoreRefusal
    assert hinted.retry_after == pytest.approx(COLD_HOLD - 0.5, abs=0.01)
    assert (hinted.remaining, hinted.note, hinted.scope) == (0, note, "tenant")
    _, _, raw = ctl.refusal_response(b, t, hinted, "m", "t", 9)
    head, body = raw.split(b"\r\n\r\n", 1)
    h = {k.lower(): v for k, v in (ln.split(": ", 1) for ln in head.decode().split("\r\n")[1:])}
    assert h["x-ratelimit-remaining-requests"] == "0"  # its core alone would say 8
    assert h["x-ratelimit-reset-requests"] == go_duration(hinted.retry_after)
    assert f"(tenant-concurrency; {note})" in orjson.loads(body)["error"]["message"]
    # the core's own refusal still becomes a plain Refusal with the hint
    core_refusal = retry_hint.Refusal("tenant-concurrency", scope="tenant", retry_after=0.01)
    plain = retry_hint.slot_hint(core_refusal, rr, b, t, 0)
    assert type(plain) is retry_hint.Refusal
    assert plain.retry_after == pytest.approx(COLD_HOLD - 0.5, abs=0.01)
