"""OpenTelemetry traces (config ``tracing``), exported to the SDK's ``InMemorySpanExporter``: the
span tree and attributes of an admitted stream, a refusal, a client that leaves mid-stream, an
unknown key; the incoming ``traceparent`` as the parent and the upstream span's context sent
to the engine; no OpenTelemetry import without the section."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import subprocess
import sys
import time
import timeit
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kvgate.config import Config, ConfigError, TracingConfig, load_config
from kvgate.gateway_build import build_gateway
from kvgate.proxy.handler import handle_inference
from kvgate.proxy.settle import settle
from kvgate.server import run_gateway
from kvgate.tracing import Tracing

from .conftest import KEYS, config_for, sha
from .fake_upstream import serve_app
from .helpers import until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
PROMPT_TOKENS, COMPLETION_TOKENS = 9, 3


@dataclass
class Engine:
    """A scripted engine that records the trace headers it receives."""

    url: str = ""
    headers: list[dict[str, str]] = field(default_factory=list)


def _engine_app(state: Engine) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        state.headers.append(
            {k.lower(): v for k, v in request.headers.items() if k.lower() != "authorization"}
        )
        body = orjson.loads(await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if body["model"] == "slow":  # a chunk every 50 ms for 10 s
            for i in range(200):
                chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                await asyncio.sleep(0.05)
        for word in ("one ", "two ", "three"):
            chunk = {"choices": [{"index": 0, "delta": {"content": word}}], "usage": None}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS}
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def tokenize(request: web.Request) -> web.Response:  # a route kvgate forwards
        state.headers.append({k.lower(): v for k, v in request.headers.items()})
        return web.json_response({"tokens": [1, 2, 3]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/tokenize", tokenize)
    return app


@dataclass
class Traced:
    url: str
    gateway: Any
    engine: Engine
    spans: InMemorySpanExporter


@contextlib.asynccontextmanager
async def traced_gateway(sample_ratio: float = 1.0) -> AsyncIterator[Traced]:
    engine = Engine()
    async with serve_app(_engine_app(engine)) as engine.url:
        cfg = config_for(
            engine.url,
            ["m", "slow"],
            tenants=[
                {"name": "alice", "api_key_sha256": [sha(KEYS["alice"])], "priority": "critical"},
                {
                    "name": "bob",
                    "api_key_sha256": [sha(KEYS["bob"])],
                    "tokens_per_minute": 50,
                    "burst_tokens": 50,
                },
                {  # one request at a time; the others wait in the queue
                    "name": "batch",
                    "api_key_sha256": [sha(KEYS["batch"])],
                    "max_concurrency": 1,
                    "max_wait_ms": 20000,
                },
            ],
        )
        tracing = TracingConfig(otlp_endpoint="http://127.0.0.1:9", sample_ratio=sample_ratio)
        cfg = cfg.model_copy(update={"tracing": tracing, "other_routes": "forward"})
        gateway = build_gateway(cfg, poll=False)
        assert isinstance(gateway.tracing, Tracing)
        spans = InMemorySpanExporter()
        gateway.tracing = Tracing(tracing, exporter=spans)
        async with run_gateway(gateway) as url:
            yield Traced(url, gateway, engine, spans)


def _hex(n: int, width: int) -> str:
    return format(n, f"0{width}x")


def _tree(spans: InMemorySpanExporter) -> tuple[Any, dict[str, Any]]:
    """The one server span and its children by name (each child's parent checked)."""
    done = spans.get_finished_spans()
    servers = [s for s in done if s.kind == SpanKind.SERVER]
    assert len(servers) == 1, [s.name for s in done]
    server = servers[0]
    children = {s.name: s for s in done if s is not server}
    assert len(children) == len(done) - 1, [s.name for s in done]  # one span per stage
    for child in children.values():
        assert child.parent is not None
        assert child.parent.span_id == server.context.span_id, child.name
        assert child.context.trace_id == server.context.trace_id
        assert server.start_time <= child.start_time <= child.end_time <= server.end_time
    return server, children


def _in_use_is_zero(gw: Any) -> bool:
    return gw.controller.backend_state(0)["in_use"] == 0


async def test_an_admitted_stream_is_a_span_tree_under_the_incoming_traceparent() -> None:
    async with traced_gateway() as t:
        client = openai.AsyncOpenAI(base_url=t.url + "/v1", api_key=KEYS["alice"], max_retries=0)
        async with client:
            raw = await client.chat.completions.with_raw_response.create(
                model="m",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=16,
                stream=True,
                extra_headers={
                    "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01",
                    "tracestate": "vendor=1",
                },
            )
            rid = raw.headers["x-request-id"]
            text = "".join([c.choices[0].delta.content or "" async for c in raw.parse()])
        assert text == "one two three"
        await until(lambda: any(s.kind == SpanKind.SERVER for s in t.spans.get_finished_spans()))
        server, children = _tree(t.spans)
        assert set(children) == {"authenticate", "analyse", "admit", "upstream", "relay", "settle"}
        # the incoming traceparent is the parent
        assert _hex(server.context.trace_id, 32) == TRACE_ID
        assert server.parent is not None
        assert _hex(server.parent.span_id, 16) == PARENT_ID
        assert server.name == "POST /v1/chat/completions"
        a = server.attributes
        assert a["http.request.method"] == "POST"
        assert a["http.route"] == "/v1/chat/completions"
        assert a["url.path"] == "/v1/chat/completions"
        assert a["http.response.status_code"] == 200
        assert a["client.address"] == "127.0.0.1"
        assert (a["kvgate.tenant"], a["kvgate.priority"]) == ("alice", "critical")
        assert (a["kvgate.backend"], a["gen_ai.request.model"]) == ("b0", "m")
        assert (a["kvgate.outcome"], a["kvgate.request_id"]) == ("ok", rid)
        assert a["gen_ai.usage.input_tokens"] == PROMPT_TOKENS
        assert a["gen_ai.usage.output_tokens"] == COMPLETION_TOKENS
        assert a["kvgate.tokens.reserved"] > 16
        assert server.status.status_code == StatusCode.UNSET
        # the stages in order, and the engine got the upstream span's context
        order = ["authenticate", "analyse", "admit", "upstream", "relay", "settle"]
        for before, after in itertools.pairwise(order):
            assert children[before].end_time <= children[after].start_time, (before, after)
        assert children["admit"].attributes["kvgate.admission.admitted"] is True
        upstream = children["upstream"]
        assert upstream.kind == SpanKind.CLIENT
        assert upstream.attributes["url.full"] == t.engine.url + "/v1/chat/completions"
        sent = t.engine.headers[0]
        assert sent["traceparent"] == f"00-{TRACE_ID}-{_hex(upstream.context.span_id, 16)}-01"
        assert sent["tracestate"] == "vendor=1"
        assert sent["x-request-id"] == rid
        assert children["relay"].attributes["kvgate.outcome"] == "ok"
        assert _in_use_is_zero(t.gateway)


async def test_a_forwarded_request_is_traced_like_an_inference_one() -> None:
    async with traced_gateway() as t:
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                t.url + "/tokenize",
                json={"model": "m", "prompt": "hi"},
                headers={
                    "Authorization": f"Bearer {KEYS['alice']}",
                    "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01",
                },
            ) as r,
        ):
            assert r.status == 200
            assert await r.json() == {"tokens": [1, 2, 3]}
        await until(lambda: bool(_servers(t.spans)))
        server, children = _tree(t.spans)
        assert server.name == "POST /tokenize"
        assert {"authenticate", "analyse", "admit", "upstream", "settle"} <= set(children)
        assert server.attributes["kvgate.outcome"] == "ok"
        assert _hex(server.context.trace_id, 32) == TRACE_ID
        upstream = children["upstream"]
        assert upstream.attributes["url.full"] == t.engine.url + "/tokenize"
        sent = t.engine.headers[0]["traceparent"]
        assert sent == f"00-{TRACE_ID}-{_hex(upstream.context.span_id, 16)}-01"
        await until(lambda: _in_use_is_zero(t.gateway))


async def test_a_refusal_has_its_reason_and_no_upstream_span() -> None:
    async with traced_gateway() as t:
        client = openai.AsyncOpenAI(base_url=t.url + "/v1", api_key=KEYS["bob"], max_retries=0)
        async with client:
            with pytest.raises(openai.RateLimitError):  # 100 tokens > bob's bucket (50)
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=100
                )
        await until(lambda: any(s.kind == SpanKind.SERVER for s in t.spans.get_finished_spans()))
        server, children = _tree(t.spans)
        assert set(children) == {"authenticate", "analyse", "admit"}
        assert server.parent is None  # no traceparent: a new trace
        a = server.attributes
        assert a["http.response.status_code"] == 429
        assert (a["kvgate.outcome"], a["kvgate.reason"]) == ("rejected", "tenant-tpm")
        assert a["kvgate.tenant"] == "bob"
        admit = children["admit"]
        assert admit.attributes["kvgate.admission.admitted"] is False
        assert admit.attributes["kvgate.reject_reason"] == "tenant-tpm"
        assert t.engine.headers == []
        assert _in_use_is_zero(t.gateway)


async def test_an_unknown_key_ends_at_authenticate() -> None:
    async with traced_gateway() as t:
        client = openai.AsyncOpenAI(base_url=t.url + "/v1", api_key="sk-nobody", max_retries=0)
        async with client:
            with pytest.raises(openai.AuthenticationError):
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
        await until(lambda: any(s.kind == SpanKind.SERVER for s in t.spans.get_finished_spans()))
        server, children = _tree(t.spans)
        assert set(children) == {"authenticate"}
        assert children["authenticate"].status.status_code == StatusCode.ERROR
        assert server.attributes["http.response.status_code"] == 401
        assert server.attributes["kvgate.reason"] == "invalid_api_key"


async def test_a_client_that_leaves_mid_stream_ends_its_spans() -> None:
    async with traced_gateway() as t:
        body = {
            "model": "slow",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 500,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {KEYS['alice']}"}
        async with (
            aiohttp.ClientSession() as s,
            s.post(t.url + "/v1/chat/completions", json=body, headers=headers) as r,
        ):
            assert r.status == 200
            seen = b""
            while seen.count(b"data: ") < 3:
                seen += await r.content.readany()
            r.close()  # the client leaves
        await until(
            lambda: any(s.kind == SpanKind.SERVER for s in t.spans.get_finished_spans()),
            timeout=10,
        )
        server, children = _tree(t.spans)
        assert set(children) == {"authenticate", "analyse", "admit", "upstream", "relay", "settle"}
        assert server.attributes["kvgate.outcome"] == "client_disconnect"
        assert children["relay"].attributes["kvgate.outcome"] == "client_disconnect"
        assert server.attributes["gen_ai.usage.output_tokens"] >= 3
        await until(lambda: _in_use_is_zero(t.gateway), timeout=10)


def _servers(spans: InMemorySpanExporter) -> list[Any]:
    return [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER]


def _children_of(spans: InMemorySpanExporter, server: Any) -> dict[str, Any]:
    return {
        s.name: s
        for s in spans.get_finished_spans()
        if s.parent is not None and s.parent.span_id == server.context.span_id
    }


async def test_the_admit_span_covers_the_wait_in_the_queue() -> None:
    async with traced_gateway() as t:
        headers = {"Authorization": f"Bearer {KEYS['batch']}"}

        def body(model: str, n: int) -> dict[str, Any]:
            return {
                "model": model,
                "messages": [{"role": "user", "content": f"request {n}"}],
                "max_tokens": 500,
                "stream": True,
            }

        async with aiohttp.ClientSession() as s:
            holder = await s.post(
                t.url + "/v1/chat/completions", json=body("slow", 1), headers=headers
            )
            assert holder.status == 200
            waiter = asyncio.ensure_future(
                s.post(t.url + "/v1/chat/completions", json=body("m", 2), headers=headers)
            )
            leaver = asyncio.ensure_future(
                s.post(t.url + "/v1/chat/completions", json=body("m", 3), headers=headers)
            )
            await until(lambda: t.gateway.queue.waiting >= 2, timeout=10)
            leaver.cancel()  # the third client leaves while it waits
            with contextlib.suppress(asyncio.CancelledError):
                await leaver
            await until(lambda: len(_servers(t.spans)) == 1, timeout=10)
            (left,) = _servers(t.spans)
            assert left.attributes["kvgate.outcome"] == "client_disconnect"
            admit = _children_of(t.spans, left)["admit"]
            assert admit.attributes["kvgate.admission.admitted"] is False
            holder.close()  # the first one leaves: the second gets its slot
            answer = await waiter
            assert answer.status == 200
            await answer.read()
            answer.close()
        await until(lambda: len(_servers(t.spans)) == 3, timeout=10)
        others = [s for s in _servers(t.spans) if s.context.span_id != left.context.span_id]
        (first,) = [s for s in others if s.attributes["kvgate.outcome"] == "client_disconnect"]
        (second,) = [s for s in others if s.attributes["kvgate.outcome"] == "ok"]
        first_children, second_children = (
            _children_of(t.spans, first),
            _children_of(t.spans, second),
        )
        wait = second_children["admit"]
        assert wait.attributes["kvgate.admission.admitted"] is True
        # admitted only once the first request's relay ended and released its slot
        assert wait.start_time < first_children["relay"].end_time <= wait.end_time
        await until(lambda: _in_use_is_zero(t.gateway), timeout=10)


async def test_sampled_out_requests_export_nothing_but_still_propagate() -> None:
    async with traced_gateway(sample_ratio=0.0) as t:
        client = openai.AsyncOpenAI(base_url=t.url + "/v1", api_key=KEYS["alice"], max_retries=0)
        async with client:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            # a sampled parent wins over the ratio
            await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
            )
        await until(lambda: any(s.kind == SpanKind.SERVER for s in t.spans.get_finished_spans()))
        server, _ = _tree(t.spans)  # only the second request's
        assert _hex(server.context.trace_id, 32) == TRACE_ID
        first = t.engine.headers[0]["traceparent"]
        version, trace_id, span_id, flags = first.split("-")
        assert version == "00"
        assert int(flags, 16) & 1 == 0  # a new trace, not sampled
        assert trace_id != TRACE_ID
        assert int(span_id, 16) != 0
        await until(lambda: _in_use_is_zero(t.gateway))


def test_without_a_tracing_section_nothing_of_opentelemetry_is_imported(tmp_path) -> None:
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text(
        "backends:\n  - name: b0\n    url: http://127.0.0.1:9\n    max_concurrency: 4\n"
        "    models: [{name: m, context_window: 1024}]\n"
    )
    code = (
        "import sys\n"
        "from kvgate.config import load_config\n"
        "from kvgate.gateway_build import build_gateway\n"
        f"gw = build_gateway(load_config({str(cfg)!r}), poll=False)\n"
        "assert gw.tracing is None\n"
        "loaded = [m for m in sys.modules if m.startswith('opentelemetry')]\n"
        "assert not loaded, loaded\n"
        "with_tracing = open(" + repr(str(cfg)) + ").read() + "
        "'tracing: {otlp_endpoint: \"http://127.0.0.1:4318\"}\\n'\n"
        "open(" + repr(str(cfg)) + ", 'w').write(with_tracing)\n"
        f"gw = build_gateway(load_config({str(cfg)!r}), poll=False)\n"
        "assert gw.tracing.endpoint == 'http://127.0.0.1:4318/v1/traces'\n"
        "assert 'opentelemetry.sdk.trace' in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("tracing", "where"),
    [
        ({"otlp_endpoint": "collector:4318"}, "tracing.otlp_endpoint"),
        ({"otlp_endpoint": "ftp://collector:4318"}, "tracing.otlp_endpoint"),
        ({"otlp_endpoint": "http://c:4318", "sample_ratio": 1.5}, "tracing.sample_ratio"),
        ({"otlp_endpoint": "http://c:4318", "service_name": ""}, "tracing.service_name"),
        ({"otlp_endpoint": "http://c:4318", "sampling": 1}, "tracing.sampling"),
        ({}, "tracing.otlp_endpoint"),
    ],
)
def test_a_bad_tracing_section_is_a_configuration_error(
    tmp_path, tracing: dict[str, Any], where: str
) -> None:
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text(
        orjson.dumps(
            {
                "backends": [
                    {
                        "name": "b0",
                        "url": "http://127.0.0.1:9",
                        "max_concurrency": 4,
                        "models": [{"name": "m", "context_window": 1024}],
                    }
                ],
                "tracing": tracing,
            }
        ).decode()
    )
    with pytest.raises(ConfigError) as info:
        load_config(str(cfg))
    assert where in str(info.value)
    assert Config  # the model the file is checked against


def test_without_the_otel_extra_a_tracing_section_says_what_to_install(tmp_path) -> None:
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text(
        "backends:\n  - name: b0\n    url: http://127.0.0.1:9\n    max_concurrency: 4\n"
        "    models: [{name: m, context_window: 1024}]\n"
        'tracing: {otlp_endpoint: "http://127.0.0.1:4318"}\n'
    )
    code = (
        "import sys\n"
        "sys.modules['opentelemetry'] = None  # as if the extra were not installed\n"
        "from kvgate.__main__ import main\n"
        f"sys.argv = ['kvgate', 'check-config', {str(cfg)!r}]\n"
        "sys.exit(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode != 0
    assert "pip install 'kvgate[otel]'" in done.stdout + done.stderr


def test_tracing_cost_per_request() -> None:
    """What a request pays for tracing: off, the handler's `trace is not None` checks on the
    inference path (as many as in the handler); on, a whole sampled trace (its seven spans, to
    the in-memory exporter). Printed for the report."""
    source = inspect.getsource(handle_inference) + inspect.getsource(settle)
    checks = source.count("if trace is not None") + source.count(" if trace is not None else")
    assert checks >= 7  # one per stage the handler times, at least
    code = (
        "def off(gw):\n    tracing = gw.tracing\n"
        "    trace = None if tracing is None else tracing.begin()\n"
        + "    if trace is not None:\n        pass\n"
        * (checks - 1)
    )
    scope: dict[str, Any] = {}
    exec(code + "\n\ndef empty(gw):\n    pass\n", scope)
    gw = SimpleNamespace(tracing=None)
    n = 200_000
    off = min(timeit.repeat(partial(scope["off"], gw), number=n, repeat=5)) / n
    empty = min(timeit.repeat(partial(scope["empty"], gw), number=n, repeat=5)) / n

    tracing = Tracing(
        TracingConfig(otlp_endpoint="http://127.0.0.1:9"), exporter=InMemorySpanExporter()
    )
    tracing.start()
    request = SimpleNamespace(
        headers=CIMultiDict({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}),
        method="POST",
        path="/v1/chat/completions",
        scheme="http",
        version=SimpleNamespace(major=1, minor=1),
        transport=None,
    )
    who = SimpleNamespace(name="n", priority="standard")

    def traced() -> None:
        t = tracing.begin(request, "/v1/chat/completions", time.perf_counter(), "rid")  # type: ignore[arg-type]
        t.authenticated = t.analysed = t.admitting = time.perf_counter()
        t.admitted = time.perf_counter()
        t.upstream_headers({"x-request-id": "rid"}, "http://e/v1/chat/completions", "POST")
        t.data_arrived()
        t.relay_end = time.perf_counter()
        t.finish(
            status=200, outcome="ok", tenant=who, backend=who, model=who, reserved=10,
            prompt=5, completion=5, settle=(time.perf_counter(), time.perf_counter()),
        )  # fmt: skip

    m = 500
    on = min(timeit.repeat(traced, number=m, repeat=3)) / m
    tracing.shutdown()
    # the figures, in the report of a failure or with `pytest -s`
    print(
        f"\ntracing: off {(off - empty) * 1e9:.0f} ns per request ({checks} checks), "
        f"on {on * 1e6:.0f} us per sampled request (7 spans, in-memory exporter)"
    )
    assert off - empty < on


async def test_spans_reach_an_otlp_http_collector() -> None:
    """The real exporter: spans are posted as OTLP/HTTP protobuf to ``otlp_endpoint``'s
    ``/v1/traces`` (here a scripted collector on loopback), the rest flushed at shutdown."""
    posts: list[tuple[str, bytes]] = []

    async def traces(request: web.Request) -> web.Response:
        posts.append((request.headers.get("Content-Type", ""), await request.read()))
        return web.Response(body=b"", content_type="application/x-protobuf")

    collector_app = web.Application()
    collector_app.router.add_post("/v1/traces", traces)
    engine = Engine()
    async with serve_app(collector_app) as collector, serve_app(_engine_app(engine)) as engine.url:
        cfg = config_for(engine.url, ["m"]).model_copy(
            update={"tracing": TracingConfig(otlp_endpoint=collector, service_name="gw-test")}
        )
        gateway = build_gateway(cfg, poll=False)
        async with run_gateway(gateway) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            async with client:
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
        # the gateway stopped: its exporter sent what it held
        assert posts
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    names: set[str] = set()
    services: set[str] = set()
    for content_type, body in posts:
        assert content_type == "application/x-protobuf"
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        for resource_spans in export.resource_spans:
            for attr in resource_spans.resource.attributes:
                if attr.key == "service.name":
                    services.add(attr.value.string_value)
            for scope in resource_spans.scope_spans:
                names |= {s.name for s in scope.spans}
    assert services == {"gw-test"}
    assert names == {
        "POST /v1/chat/completions",
        "authenticate",
        "analyse",
        "admit",
        "upstream",
        "relay",
        "settle",
    }
