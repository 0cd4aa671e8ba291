"""Per-tenant usage: ``kvgate_tenant_usage_tokens_total`` / ``kvgate_tenant_requests_total`` and
``GET /admin/usage`` (JSON and CSV, time ranges, errors), judged against what the simulator
reports it served per user (``/sim/state`` ``by_user``; each request's body carries its
tenant's name as ``user``)."""

from __future__ import annotations

import asyncio
import csv
import io
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from kvgate.sim import SimConfig, run_sim
from kvgate.usage import UsageLedger, usage_reply

from .conftest import KEYS, config_for, sha
from .helpers import bearer, get_text, metric, until

ADMIN = "sk-admin"
# 2026-01-01T00:00:00Z, a whole minute
T0 = 1_767_225_600


def _config(upstream: str, model: str) -> Any:
    cfg = config_for(
        upstream,
        [model],
        tenants=[
            {"name": "alice", "api_key_sha256": [sha(KEYS["alice"])], "priority": "critical"},
            {
                "name": "bob",
                "api_key_sha256": [sha(KEYS["bob"])],
                "tokens_per_minute": 60,
                "burst_tokens": 60,
            },
        ],
    )
    return cfg.model_copy(update={"admin_key_sha256": sha(ADMIN)})


async def _usage(url: str, query: str = "", key: str | None = ADMIN) -> tuple[int, Any, str]:
    headers = bearer(key) if key is not None else {}
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{url}/admin/usage{query}", headers=headers) as r,
    ):
        text = await r.text()
        body = await r.json(content_type=None) if "json" in r.content_type else None
        return r.status, body, r.headers.get("Content-Type", "") + "\n" + text


def _rows(body: Any) -> dict[tuple[str, str], dict[str, int]]:
    return {(row["tenant"], row["outcome"]): row for row in body["data"]}


async def test_usage_matches_what_the_simulator_served(gateway_for) -> None:
    sim_cfg = SimConfig.from_profile("tiny", speed=50, seed=11, mean_output_tokens=6)
    async with run_sim(sim_cfg) as sim:
        model = sim.engine.config.model
        async with gateway_for(_config(sim.url, model)) as gw:
            alice = openai.AsyncOpenAI(
                base_url=gw.url + "/v1", api_key=KEYS["alice"], max_retries=0
            )
            bob = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["bob"], max_retries=0)
            async with alice, bob:
                for i in range(3):
                    await alice.chat.completions.create(
                        model=model,
                        messages=[{"role": "user", "content": f"hello number {i}"}],
                        max_tokens=20,
                        user="alice",
                    )
                stream = await alice.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "a streamed one"}],
                    max_tokens=12,
                    stream=True,
                    user="alice",
                )
                async for _ in stream:
                    pass
                await alice.completions.create(
                    model=model, prompt="complete this", max_tokens=9, user="alice"
                )
                await bob.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=8,
                    user="bob",
                )
                with pytest.raises(openai.RateLimitError):  # 100 tokens > bob's bucket (60)
                    await bob.chat.completions.create(
                        model=model,
                        messages=[{"role": "user", "content": "hi"}],
                        max_tokens=100,
                        user="bob",
                    )
            await until(lambda: gw.backend_state()["in_use"] == 0, timeout=10)
            async with aiohttp.ClientSession() as s, s.get(sim.url + "/sim/state") as r:
                served = (await r.json())["by_user"]

            async def settled() -> bool:
                status, body, _ = await _usage(gw.url)
                rows = _rows(body)
                return status == 200 and rows.get(("alice", "ok"), {}).get("requests") == 5

            await until(settled, timeout=10)
            status, body, _ = await _usage(gw.url)
            assert status == 200
            rows = _rows(body)
            for tenant, n in (("alice", 5), ("bob", 1)):
                row = rows[(tenant, "ok")]
                assert row["model"] == model
                assert row["requests"] == n == served[tenant]["requests"]
                assert row["prompt_tokens"] == served[tenant]["prompt_tokens"] > 0
                assert row["completion_tokens"] == served[tenant]["completion_tokens"] > 0
            refused = rows[("bob", "rejected")]
            assert (
                refused["requests"],
                refused["prompt_tokens"],
                refused["completion_tokens"],
            ) == (
                1,
                0,
                0,
            )
            assert body["totals"]["requests"] == 7
            assert body["bucket_seconds"] == 60

            # the same numbers on /metrics
            text = await get_text(gw.url + "/metrics")
            for tenant in ("alice", "bob"):
                for kind in ("prompt", "completion"):
                    got = metric(text, "kvgate_tenant_usage_tokens_total", tenant=tenant, kind=kind)
                    assert got == served[tenant][f"{kind}_tokens"], (tenant, kind)
                assert metric(text, "kvgate_tenant_tokens_total", tenant=tenant) == sum(
                    served[tenant][f"{k}_tokens"] for k in ("prompt", "completion")
                )
            assert (
                metric(
                    text,
                    "kvgate_tenant_requests_total",
                    tenant="bob",
                    model=model,
                    outcome="rejected",
                )
                == 1
            )

            # CSV: a header line, then the same rows
            status, _, raw = await _usage(gw.url, "?format=csv")
            assert status == 200
            content_type, _, payload = raw.partition("\n")
            assert content_type.startswith("text/csv")
            lines = list(csv.reader(io.StringIO(payload, newline="")))
            assert lines[0] == [
                "tenant",
                "model",
                "outcome",
                "requests",
                "prompt_tokens",
                "completion_tokens",
            ]
            assert payload.endswith("\r\n")
            as_json = sorted(
                [str(r[c]) for c in ("tenant", "model", "outcome", "requests")]
                + [str(r["prompt_tokens"]), str(r["completion_tokens"])]
                for r in body["data"]
            )
            assert sorted(lines[1:]) == as_json
            assert gw.tenant_state("alice")["in_use"] == 0


async def test_time_ranges_select_whole_minutes(gateway_for) -> None:
    sim_cfg = SimConfig.from_profile("tiny", speed=50, seed=3, mean_output_tokens=4)
    async with run_sim(sim_cfg) as sim:
        model = sim.engine.config.model
        async with gateway_for(_config(sim.url, model)) as gw:
            ledger = gw.gateway.metrics.usage
            now = [T0 + 10.0]
            ledger.clock = lambda: now[0]
            ledger.started = T0 + 10.0
            client = openai.AsyncOpenAI(
                base_url=gw.url + "/v1", api_key=KEYS["alice"], max_retries=0
            )

            async def ok_requests(query: str) -> int:
                status, body, raw = await _usage(gw.url, query)
                assert status == 200, raw
                return sum(r["requests"] for r in body["data"] if r["outcome"] == "ok")

            async with client:
                for _ in range(2):  # minute 0
                    await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4
                    )

                async def counted() -> bool:
                    return await ok_requests("") == 2

                await until(counted, timeout=10)
                now[0] = T0 + 130.0  # minute 2
                await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "y"}], max_tokens=4
                )

                async def all_counted() -> bool:
                    return await ok_requests("") == 3

                await until(all_counted, timeout=10)

            assert await ok_requests(f"?from={T0}&to={T0 + 60}") == 2
            assert await ok_requests(f"?to={T0 + 60}") == 2  # from: the start (in minute 0)
            assert await ok_requests(f"?from={T0 + 60}&to={T0 + 120}") == 0
            assert await ok_requests(f"?from={T0 + 59.5}&to={T0 + 60.5}") == 2  # minutes 0, 1
            assert await ok_requests("?from=2026-01-01T00:02:00Z") == 1
            assert await ok_requests(f"?from={T0 + 121}&to={T0 + 180}") == 1
            # the same instant in another offset, and a lower-case RFC 3339 spelling
            assert await ok_requests("?from=2026-01-01T01:00:00%2B01:00") == 3
            assert await ok_requests("?from=2026-01-01t00:00:00z&to=2026-01-01T00:01:00Z") == 2
            _, body, _ = await _usage(gw.url, f"?from={T0 + 59.5}&to={T0 + 60.5}")
            assert (body["from"], body["to"]) == ("2026-01-01T00:00:00Z", "2026-01-01T00:02:00Z")
            assert body["oldest_bucket"] == "2026-01-01T00:00:00Z"


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("?from=yesterday", "from"),
        ("?to=2026-01-01T00:00:00", "to"),  # RFC 3339 needs an offset
        ("?from=-5", "from"),
        ("?from=nan", "from"),
        ("?from=2026-01-02T00:00:00Z&to=2026-01-01T00:00:00Z", "from"),
        ("?format=xml", "format"),
        ("?since=0", "since"),
        ("?from=1&from=2", "from"),
    ],
)
async def test_bad_parameters_are_400(gateway_for, query: str, param: str) -> None:
    sim_cfg = SimConfig.from_profile("tiny", speed=50)
    async with run_sim(sim_cfg) as sim, gateway_for(_config(sim.url, "m")) as gw:
        status, body, _ = await _usage(gw.url, query)
        assert status == 400
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["type"], err["param"], err["code"]) == (
            "invalid_request_error",
            param,
            "invalid_value",
        )
        assert gw.backend_state()["in_use"] == 0


async def test_times_at_the_ends_of_the_calendar_are_clamped_not_a_500(gateway_for) -> None:
    """Valid times past what the minute rounding can spell (year 9999 rounded up is year
    10,000), Unix seconds beyond any date, dates before 1970 (one in year 1 with an offset):
    clamped to 0 .. 9999-12-31T23:58Z, answered 200 — never the 500 of a date-time overflow."""
    sim_cfg = SimConfig.from_profile("tiny", speed=50)
    async with run_sim(sim_cfg) as sim, gateway_for(_config(sim.url, "m")) as gw:
        for query in (
            "?to=9999-12-31T23:59:59Z",
            "?to=253402300800",
            "?to=1e17",
            "?to=1e300",
            "?from=9999-12-31T23:59:59Z&to=1e300",
            "?from=0001-01-01T00:00:00%2B23:59",
            "?from=0001-01-01T00:00:00-23:59&to=1969-12-31T23:59:59Z",
        ):
            status, body, raw = await _usage(gw.url, query)
            assert status == 200, (query, raw)
            assert body["data"] == []
            assert body["from"] <= body["to"] <= "9999-12-31T23:59:00Z", query
        _, body, _ = await _usage(gw.url, "?from=1969-01-01T00:00:00Z&to=1e300")
        assert (body["from"], body["to"]) == ("1970-01-01T00:00:00Z", "9999-12-31T23:58:00Z")


async def test_usage_needs_the_admin_key(gateway_for) -> None:
    sim_cfg = SimConfig.from_profile("tiny", speed=50)
    async with run_sim(sim_cfg) as sim, gateway_for(_config(sim.url, "m")) as gw:
        for key in (None, KEYS["alice"]):
            status, body, _ = await _usage(gw.url, key=key)
            assert status == 401
            assert body["error"]["code"] == "invalid_api_key"
        status, body, _ = await _usage(gw.url)
        assert status == 200
        assert body["data"] == []


def test_the_ledger_keeps_at_most_max_minutes_buckets() -> None:
    now = [float(T0)]
    ledger = UsageLedger(clock=lambda: now[0], max_minutes=3)
    for minute in range(5):
        now[0] = T0 + 60 * minute + 1
        ledger.add({("alice", "m", "ok"): (1, 10, 5)})
    assert ledger.oldest == T0 + 120  # minutes 0 and 1 were dropped, oldest first
    assert ledger.totals(0, float("inf")) == {("alice", "m", "ok"): (3, 30, 15)}
    assert ledger.totals(T0 + 180, T0 + 240) == {("alice", "m", "ok"): (1, 10, 5)}


def test_the_ledger_keeps_at_most_max_rows_dropping_the_oldest_minutes_never_the_current() -> None:
    now = [float(T0)]
    ledger = UsageLedger(clock=lambda: now[0], max_rows=5)
    for minute in range(3):  # 2 rows a minute: 6 > 5, minute 0 goes
        now[0] = T0 + 60 * minute + 1
        ledger.add({("a", "m", "ok"): [1, 10, 5], (f"t{minute}", "m", "ok"): [1, 1, 1]})
    assert ledger.rows == 4
    assert ledger.oldest == T0 + 60
    assert ledger.totals(0, float("inf"))[("a", "m", "ok")] == (2, 20, 10)
    # a minute with more rows than the whole ledger may hold keeps them all (and only them)
    now[0] = T0 + 180 + 1
    ledger.add({(f"u{i}", "m", "ok"): [1, 2, 3] for i in range(8)})
    assert ledger.rows == 8
    assert ledger.oldest == T0 + 180
    # the tokens per tenant since start are kept whatever minutes were dropped
    assert ledger.tenant_tokens["a"] == 45
    assert ledger.tenant_tokens["t0"] == 2
    assert ledger.tenant_tokens["u7"] == 5
    assert ledger.tenant_tokens.keys() == {"a", "t0", "t1", "t2", *(f"u{i}" for i in range(8))}


@pytest.mark.parametrize("max_minutes", [3, 1])
def test_a_clock_that_steps_back_keeps_the_row_count_and_the_bounds(max_minutes: int) -> None:
    """The wall clock stepping back (NTP) adds to an older minute than the newest: that bucket
    is kept (another, the oldest of the rest, goes when there are too many), the row count
    stays the real one, and ``max_rows`` still holds."""
    now = [float(T0)]
    ledger = UsageLedger(clock=lambda: now[0], max_minutes=max_minutes, max_rows=5)

    def real_rows() -> int:
        return sum(len(b) for b in ledger._minutes.values())

    for minute in (100, 101, 102, 99, 99, 101, 103, 98):
        now[0] = T0 + 60 * minute + 1
        ledger.add({(f"t{minute}", "m", "ok"): [1, 1, 1], (f"u{minute}", "m", "ok"): [1, 1, 1]})
        assert ledger.rows == real_rows()
        assert ledger.rows <= 5
        assert len(ledger._minutes) <= max_minutes
        assert T0 // 60 + minute in ledger._minutes  # the minute just added to is kept
        totals = ledger.totals(0, float("inf"))
        assert totals[(f"t{minute}", "m", "ok")][0] >= 1


async def test_csv_quotes_fields_as_rfc_4180_says() -> None:
    ledger = UsageLedger(clock=lambda: float(T0))
    ledger.started = float(T0)
    ledger.add({('team "a", west', "org/model", "ok"): [2, 30, 40]})
    request = make_mocked_request("GET", "/admin/usage?format=csv")
    reply = await usage_reply(ledger, request)
    assert isinstance(reply, web.Response)
    assert reply.headers["Content-Type"] == "text/csv; charset=utf-8"
    assert reply.body == (
        b"tenant,model,outcome,requests,prompt_tokens,completion_tokens\r\n"
        b'"team ""a"", west",org/model,ok,2,30,40\r\n'
    )


async def test_tenant_names_select_their_rows_and_totals() -> None:
    """``?tenant=`` (repeatable): only those tenants' rows and their totals (with 100,000
    tenants, one tenant's bill without the whole export); a name with no rows gives none; an
    empty name is a 400."""
    ledger = UsageLedger(clock=lambda: float(T0))
    ledger.started = float(T0)
    ledger.add(
        {
            ("alice", "m", "ok"): [2, 30, 40],
            ("alice", "m", "error"): [1, 5, 0],
            ("bob", "m", "ok"): [7, 70, 700],
            ("carol", "m", "ok"): [1, 1, 1],
        }
    )

    async def ask(query: str) -> tuple[int, Any]:
        reply = await usage_reply(ledger, make_mocked_request("GET", "/admin/usage" + query))
        if isinstance(reply, web.Response):
            assert isinstance(reply.body, bytes)
            return reply.status, orjson.loads(reply.body)
        # an error: a prepared response (status line, headers, body in one buffer)
        return reply.status, orjson.loads(reply.raw.split(b"\r\n\r\n", 1)[1])

    status, body = await ask("?tenant=alice")
    assert status == 200
    assert {(r["tenant"], r["outcome"]) for r in body["data"]} == {
        ("alice", "ok"),
        ("alice", "error"),
    }
    assert body["totals"] == {"requests": 3, "prompt_tokens": 35, "completion_tokens": 40}
    _, body = await ask("?tenant=bob&tenant=carol&format=json")
    assert sorted(r["tenant"] for r in body["data"]) == ["bob", "carol"]
    assert body["totals"]["requests"] == 8
    _, body = await ask("?tenant=nobody")
    assert body["data"] == []
    assert body["totals"]["requests"] == 0
    _, body = await ask("")  # everyone
    assert body["totals"]["requests"] == 11
    status, body = await ask("?tenant=alice&tenant=")
    assert status == 400
    assert (body["error"]["code"], body["error"]["param"]) == ("invalid_value", "tenant")
    reply = await usage_reply(
        ledger, make_mocked_request("GET", "/admin/usage?format=csv&tenant=bob")
    )
    assert isinstance(reply, web.Response)
    assert reply.body == (
        b"tenant,model,outcome,requests,prompt_tokens,completion_tokens\r\nbob,m,ok,7,70,700\r\n"
    )


async def test_an_export_of_100000_tenants_leaves_the_event_loop_serving() -> None:
    """The export of 100,000 tenants' rows (two minutes of them, JSON and CSV) is summed and
    written out off the event loop: while it is built, the loop keeps running (its longest
    stop is well under half the export's time; built on the loop, the loop stopped for all
    of it, 0.3-0.4 s on a 2-core machine)."""
    ledger = UsageLedger(clock=lambda: float(T0))
    ledger.started = float(T0)
    rows = {(f"tenant-{i:06d}", "m", "ok"): [3, 1200, 300] for i in range(100_000)}
    ledger.add(rows)
    ledger.clock = lambda: float(T0 + 60)
    ledger.add(rows)
    loop = asyncio.get_running_loop()

    async def ticker(gaps: list[float], done: asyncio.Event) -> None:
        """Wakes every millisecond until ``done``; ``gaps``: the time between wake-ups."""
        last = loop.time()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = loop.time()
            gaps.append(now - last)
            last = now

    for fmt in ("json", "csv"):
        gaps: list[float] = []
        done = asyncio.Event()
        ticking = asyncio.create_task(ticker(gaps, done))
        await asyncio.sleep(0.01)
        began = loop.time()
        reply = await usage_reply(
            ledger, make_mocked_request("GET", f"/admin/usage?from={T0}&to={T0 + 120}&format={fmt}")
        )
        took = loop.time() - began
        done.set()
        await ticking
        assert isinstance(reply, web.Response)
        assert isinstance(reply.body, bytes)
        if fmt == "json":
            body = orjson.loads(reply.body)
            assert len(body["data"]) == 100_000
            assert body["totals"]["requests"] == 600_000
        else:
            assert reply.body.count(b"\r\n") == 100_001
        print(
            f"{fmt}: export {took * 1000:.0f} ms, the loop's longest stop {max(gaps) * 1000:.1f} ms"
        )
        assert max(gaps) < took / 2, (fmt, max(gaps), took)
