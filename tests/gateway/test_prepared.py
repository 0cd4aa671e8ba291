"""Responses kvgate serializes itself (refusals, its own errors) on the wire: one well-formed
HTTP/1.1 message each, checked with h11 (a strict HTTP/1.1 parser), over raw sockets — keep-alive,
pipelining, HTTP/1.0, ``Connection: close``, ``HEAD``."""

from __future__ import annotations

import asyncio
import email.utils
from urllib.parse import urlsplit

import h11
import orjson
import pytest

from kvgate._core import AdmissionController, http_response, relay_http

from .conftest import config_for
from .fake_upstream import EVENTS, run_upstream

# bigger than the backend's whole TPM bucket (50): refused at once, never admissible (429)
TOO_BIG = orjson.dumps(
    {"model": "replay", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
)


def _post(body: bytes = TOO_BIG, *, version: bytes = b"1.1", extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/" + version + b"\r\nHost: x\r\n"
        b"Content-Type: application/json\r\n"
        + extra
        + b"Content-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


async def _read_responses(
    reader: asyncio.StreamReader, n: int, methods: list[bytes] | None = None
) -> tuple[list[tuple[h11.Response, bytes]], h11.Connection]:
    """Parse ``n`` responses with h11 (fails on any framing error); returns them and the parser."""
    conn = h11.Connection(h11.CLIENT)
    out: list[tuple[h11.Response, bytes]] = []
    for i in range(n):
        method = (methods or [b"POST"] * n)[i]
        conn.send(h11.Request(method=method, target="/", headers=[("Host", "x")]))
        conn.send(h11.EndOfMessage())
        head: h11.Response | None = None
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await asyncio.wait_for(reader.read(65536), 5)
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                raise AssertionError(f"unexpected {event!r}")
        assert head is not None
        out.append((head, body))
        if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
            break
        conn.start_next_cycle()
    return out, conn


def _headers(resp: h11.Response) -> dict[str, str]:
    return {k.decode().lower(): v.decode() for k, v in resp.headers}


async def _closed_by_server(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(1), 5) == b""


@pytest.fixture
async def open_gw(gateway_for):
    """A gateway that admits (TPM plenty) in front of the fake upstream."""
    async with run_upstream() as up:
        # non-streamed requests get the engine's own answer (not assembled from a stream)
        cfg = config_for(up.url, ["replay"], stream_upstream=False)
        async with gateway_for(cfg) as running:
            yield running


STREAM_BODY = orjson.dumps(
    {
        "model": "replay",
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}],
    }
)


@pytest.fixture
async def gw(gateway_for):
    async with run_upstream() as up:
        cfg = config_for(up.url, ["replay"], tokens_per_minute=50)
        async with gateway_for(cfg) as running:
            yield running


async def _connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    return await asyncio.open_connection(parts.hostname, parts.port)


async def test_pipelined_refusals_and_errors_are_framed_on_one_connection(gw) -> None:
    reader, writer = await _connect(gw.url)
    try:
        bad_json = b"{not json"
        writer.write(
            _post() + b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n" + _post(bad_json) + _post()
        )
        responses, _ = await _read_responses(reader, 4, [b"POST", b"GET", b"POST", b"POST"])
        assert [r.status_code for r, _ in responses] == [429, 404, 400, 429]
        for resp, body in responses:
            h = _headers(resp)
            assert int(h["content-length"]) == len(body)
            assert h["content-type"] == "application/json"
            assert "connection" not in h  # HTTP/1.1 keeps the connection by default
            date = email.utils.parsedate_to_datetime(h["date"])
            assert date.tzinfo is not None
            err = orjson.loads(body)["error"]
            assert set(err) == {"message", "type", "param", "code"}
        refusal = _headers(responses[0][0])
        assert refusal["x-kvgate-reject-reason"] == "backend-tpm"
        assert refusal["x-should-retry"] == "false"
        assert "retry-after" not in refusal
        assert refusal["x-ratelimit-limit-tokens"] == "50"
        assert responses[0][0].reason == b"Too Many Requests"
        assert orjson.loads(responses[2][1])["error"]["code"] == "invalid_json"
        # nothing was held by any of them
        assert gw.backend_state()["in_use"] == 0
    finally:
        writer.close()


async def test_http10_closes_unless_kept_alive(gw) -> None:
    reader, writer = await _connect(gw.url)
    try:
        writer.write(_post(version=b"1.0"))
        [(resp, _)], _ = await _read_responses(reader, 1)
        assert resp.status_code == 429
        assert _headers(resp)["connection"] == "close"
        assert await _closed_by_server(reader)
    finally:
        writer.close()

    reader, writer = await _connect(gw.url)
    try:
        keep = b"Connection: keep-alive\r\n"
        writer.write(_post(version=b"1.0", extra=keep))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert b"\r\nConnection: keep-alive\r\n" in head
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(_post(version=b"1.0", extra=keep))  # the same connection answers again
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 429 ")
    finally:
        writer.close()


async def test_connection_close_is_honoured(gw) -> None:
    reader, writer = await _connect(gw.url)
    try:
        writer.write(_post(extra=b"Connection: close\r\n"))
        [(resp, body)], _ = await _read_responses(reader, 1)
        assert resp.status_code == 429
        assert _headers(resp)["connection"] == "close"
        assert orjson.loads(body)["error"]["code"] == "rate_limit_exceeded"
        assert await _closed_by_server(reader)
    finally:
        writer.close()


async def test_head_error_has_length_but_no_body(gw) -> None:
    reader, writer = await _connect(gw.url)
    try:
        writer.write(
            b"HEAD /nowhere HTTP/1.1\r\nHost: x\r\n\r\n"
            + _post()  # would be misread if the HEAD answer carried a body
        )
        responses, _ = await _read_responses(reader, 2, [b"HEAD", b"POST"])
        (head, head_body), (post, _) = responses
        assert head.status_code == 404
        assert head_body == b""
        assert int(_headers(head)["content-length"]) > 0
        assert post.status_code == 429
    finally:
        writer.close()


async def test_oversized_declared_body_is_413_with_connection_close(gw) -> None:
    reader, writer = await _connect(gw.url)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n"
        )
        [(resp, body)], _ = await _read_responses(reader, 1)
        assert resp.status_code == 413
        assert _headers(resp)["connection"] == "close"
        assert orjson.loads(body)["error"]["code"] == "request_too_large"
        # (aiohttp then lingers, discarding body bytes for a while, before it closes)
    finally:
        writer.close()


async def test_streams_are_chunked_for_http11_and_kept_alive(open_gw) -> None:
    reader, writer = await _connect(open_gw.url)
    try:
        small = orjson.dumps(
            {"model": "replay", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
        )
        writer.write(_post(STREAM_BODY) + _post(STREAM_BODY) + _post(small))
        responses, _ = await _read_responses(reader, 3)
        (first, body1), (second, body2), (plain, body3) = responses
        for head, body in ((first, body1), (second, body2)):
            assert head.status_code == 200
            h = _headers(head)
            assert h["transfer-encoding"] == "chunked"
            assert "content-length" not in h
            assert h["content-type"].startswith("text/event-stream")
            assert "x-ratelimit-remaining-tokens" in h
            assert body == b"".join(EVENTS)  # the engine's bytes, de-chunked by h11
        assert plain.status_code == 200
        assert orjson.loads(body3)["usage"]["completion_tokens"] == 7
        await _until_idle(open_gw)
    finally:
        writer.close()


async def test_streams_to_http10_end_with_the_connection(open_gw) -> None:
    reader, writer = await _connect(open_gw.url)
    try:
        writer.write(_post(STREAM_BODY, version=b"1.0", extra=b"Connection: keep-alive\r\n"))
        raw = await asyncio.wait_for(reader.read(), 5)  # until the server closes
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 200 OK"
    assert b"Connection: close" in lines
    assert not any(
        line.lower().startswith((b"transfer-encoding", b"content-length")) for line in lines
    )
    assert body == b"".join(EVENTS)
    await _until_idle(open_gw)


async def _until_idle(gw) -> None:
    for _ in range(200):
        if gw.backend_state()["in_use"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("slots still held")


def test_relayed_engine_headers_drop_hop_by_hop_and_unsafe_ones() -> None:
    upstream = [
        (b"Content-Type", b"application/json"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Content-Encoding", b"gzip"),
        (b"Date", b"yesterday"),
        (b"Keep-Alive", b"timeout=5"),
        (b"x-request-id", b"r-1"),
        (b"Set-Cookie", b"a=1"),
        (b"Set-Cookie", b"b=2"),
        (b"x-evil", b"a\x00b"),
        (b"x-ctl", b"\x01ctl"),
        (b"Bad Name", b"v"),
        (b"Connection", b"close, X-Hop"),
        (b"X-Hop", b"secret"),
        (b"Proxy-Connection", b"keep-alive"),
    ]
    raw = relay_http(200, upstream, b"{}")
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 200 OK"
    assert lines[1:5] == [
        b"Content-Type: application/json",
        b"x-request-id: r-1",
        b"Set-Cookie: a=1",
        b"Set-Cookie: b=2",
    ]
    names = [line.split(b":")[0].lower() for line in lines[1:]]
    assert names.count(b"date") == 1
    for gone in (
        b"transfer-encoding",
        b"content-encoding",
        b"keep-alive",
        b"x-evil",
        b"x-ctl",
        b"bad name",
        b"x-hop",
        b"proxy-connection",
    ):
        assert gone not in names
    assert b"Content-Length: 2" in lines
    assert body == b"{}"
    stream = relay_http(200, upstream, None, "close", False)
    assert stream.endswith(b"\r\nConnection: close\r\n\r\n")
    assert b"Transfer-Encoding" not in stream
    assert b"Content-Length" not in stream
    assert b"Transfer-Encoding: chunked" in relay_http(200, upstream)
    with pytest.raises(TypeError):
        relay_http(200, [("Content-Type", "text/plain")])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        relay_http(200, [(b"a",)])  # type: ignore[list-item]


def test_controller_relay_replaces_the_engines_rate_limit_headers() -> None:
    ctl = AdmissionController()
    b = ctl.add_backend("b", max_concurrency=4, tokens_per_minute=100)
    t = ctl.add_tenant("t", priority="standard")
    raw = ctl.relay_http(b, t, 200, [(b"X-RateLimit-Limit-Tokens", b"999")], b"{}")
    head = raw.split(b"\r\n\r\n")[0].lower()
    assert head.count(b"x-ratelimit-limit-tokens") == 1
    assert b"x-ratelimit-limit-tokens: 100" in head
    assert b"x-ratelimit-limit-requests: 4" in head


def test_controller_relay_carries_kvgates_request_id_not_the_engines() -> None:
    ctl = AdmissionController()
    b = ctl.add_backend("b", max_concurrency=4, tokens_per_minute=100)
    t = ctl.add_tenant("t", priority="standard")
    engine = [(b"X-Request-Id", b"engine-own"), (b"Content-Type", b"application/json")]
    raw = ctl.relay_http(b, t, 200, engine, b"{}", request_id="client-1")
    head = raw.split(b"\r\n\r\n")[0].lower()
    assert head.count(b"x-request-id") == 1
    assert b"x-request-id: client-1" in head
    stream = ctl.relay_http(b, t, 200, engine, None, request_id="client-2")  # a stream's head
    assert b"x-request-id: client-2" in stream.lower()
    assert b"engine-own" not in stream
    assert b"engine-own" in ctl.relay_http(b, t, 200, engine, b"{}")  # no id: the engine's
    for bad in ("", "a\r\nSet-Cookie: x=1", "\u00e9"):
        with pytest.raises(ValueError, match="request_id"):
            ctl.relay_http(b, t, 200, engine, b"{}", request_id=bad)


def test_http_response_wire_format() -> None:
    raw = http_response(429, [("Retry-After", "2"), ("x-a", "b")], b'{"x":1}', "close")
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 429 Too Many Requests"
    assert lines[1:3] == [b"Retry-After: 2", b"x-a: b"]
    assert b"Content-Length: 7" in lines
    assert b"Connection: close" in lines
    assert body == b'{"x":1}'
    # tab and non-ASCII (obs-text) are field characters
    assert b"X: a\tb \xc3\xa9" in http_response(200, [("X", "a\tb é")], b"")


@pytest.mark.parametrize(
    ("status", "headers", "connection", "error"),
    [
        (99, [], None, ValueError),
        (1000, [], None, ValueError),
        (-1, [], None, OverflowError),
        (70_000, [], None, OverflowError),
        (200, [("X", "a\r\nSet-Cookie: evil=1")], None, ValueError),
        (200, [("X", "a\nb")], None, ValueError),
        (200, [("X", "a\x00b")], None, ValueError),
        (200, [("X", "a\x01b")], None, ValueError),
        (200, [("X", "a\x7fb")], None, ValueError),
        (200, [("Bad Name", "a")], None, ValueError),
        (200, [("", "a")], None, ValueError),
        (200, [("X:", "a")], None, ValueError),
        (200, [("X", "a")], "close\r\nX: y", ValueError),
        (200, [("X", 1)], None, TypeError),
        (200, "X: a", None, TypeError),
    ],
)
def test_http_response_refuses_what_could_split_a_response(
    status: int, headers: object, connection: str | None, error: type[Exception]
) -> None:
    with pytest.raises(error):
        http_response(status, headers, b"", connection)  # type: ignore[arg-type]


def test_refusal_response_refuses_bad_reason_and_unknown_ids() -> None:
    from types import SimpleNamespace

    ctl = AdmissionController()
    b = ctl.add_backend("b", max_concurrency=1, tokens_per_minute=100)
    t = ctl.add_tenant("t", priority="standard")
    # the core's own Rejection, read natively
    held = ctl.admit(b, t, "standard", 1)
    assert held.admitted
    rejection = ctl.admit(b, t, "standard", 1)
    assert not rejection.admitted
    status, reason, raw = ctl.refusal_response(b, t, rejection, "m", "t", 1)
    assert (status, reason) == (503, "backend-slots")
    assert raw.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"\r\nx-kvgate-reject-reason: backend-slots\r\n" in raw
    assert b"\r\nretry-after-ms: " in raw

    def refusal(reason: str, scope: str, retry: float | None, never: bool) -> SimpleNamespace:
        return SimpleNamespace(reason=reason, scope=scope, retry_after=retry, never=never)

    status, reason, raw = ctl.refusal_response(
        b, t, refusal("queue-full", "backend", 1.5, False), "m", "t", 9
    )
    assert (status, reason) == (503, "queue-full")
    assert b"\r\nRetry-After: 2\r\nretry-after-ms: 1500\r\n" in raw
    err = orjson.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["message"] == "m is saturated (queue-full). Please try again in 1.5s."
    status, _, raw = ctl.refusal_response(
        b, t, refusal("tenant-tpm", "tenant", None, True), "m", "t", 9, "close"
    )
    assert status == 429
    assert b"x-should-retry: false" in raw
    assert b"Retry-After" not in raw
    assert b"\r\nConnection: close\r\n" in raw
    with pytest.raises(ValueError, match="invalid name or value"):
        ctl.refusal_response(
            b, t, refusal("x\r\nSet-Cookie: a=b", "backend", 1.0, False), None, "t", 1
        )
    with pytest.raises(AttributeError):
        ctl.refusal_response(b, t, object(), None, "t", 1)
    with pytest.raises(Exception, match="backend"):
        ctl.refusal_response(b + 5, t, rejection, None, "t", 1)
    with pytest.raises(OverflowError):
        ctl.refusal_response(b, t, rejection, None, "t", -1)
    held.release()


def test_a_store_refusal_puts_the_refusing_limit_in_the_rate_limit_headers() -> None:
    """With several replicas the store refuses for the limit across all of them, while this
    replica's core sees only its own share: the refusal's ``x-ratelimit-*`` figures for the
    refusing limit are the store's (remaining 0 and the retry wait for a slot; what the shared
    bucket holds and when it is full for tokens), and a decision of the fallback policy says so
    in the message."""
    from kvgate.store import StoreRefusal

    ctl = AdmissionController()
    b = ctl.add_backend("b", max_concurrency=64, tokens_per_minute=10**6)
    t = ctl.add_tenant("t", priority="standard", max_concurrency=8, tokens_per_minute=300_000)

    def headers(raw: bytes) -> dict[str, str]:
        head = raw.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")[1:]
        return {k.lower(): v for k, v in (line.split(": ", 1) for line in head)}

    # the core alone: 8 slots free here, its bucket full
    _, _, raw = ctl.refusal_response(b, t, StoreRefusal("backend-slots"), "m", "t", 9)
    assert headers(raw)["x-ratelimit-remaining-requests"] == "8"  # the tenant's own limit
    refusal = StoreRefusal("tenant-concurrency", scope="tenant", retry_after=2.561, remaining=0)
    status, reason, raw = ctl.refusal_response(b, t, refusal, "m", "t", 9)
    h = headers(raw)
    assert (status, reason) == (429, "tenant-concurrency")
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("8", "0")
    assert h["x-ratelimit-reset-requests"] == "2.561s"
    assert h["retry-after-ms"] == "2561"
    assert h["x-ratelimit-remaining-tokens"] == "300000"  # the tokens were not refused
    refusal = StoreRefusal(
        "tenant-tpm",
        scope="tenant",
        retry_after=1.0,
        remaining=12,
        reset_after=30.0,
        note="decided by this replica alone, Redis not answering: strict",
    )
    _, _, raw = ctl.refusal_response(b, t, refusal, "m", "t", 900)
    h = headers(raw)
    assert (h["x-ratelimit-remaining-tokens"], h["x-ratelimit-reset-tokens"]) == ("12", "30s")
    assert h["x-ratelimit-remaining-requests"] == "8"
    err = orjson.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["message"] == (
        "Rate limit reached for m for tenant t (tenant-tpm; decided by this replica alone, "
        "Redis not answering: strict). Please try again in 1s."
    )
    assert err["type"] == "tokens"
    status, _, raw = ctl.refusal_response(b, t, StoreRefusal("store-unavailable"), "m", "t", 9)
    err = orjson.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]
    assert status == 503
    assert "shared limit store did not answer" in err["message"], err


@pytest.mark.parametrize(
    "raw",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\nhello\r\n0\r\n\r\n",  # bad chunk size
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",  # both framings
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",  # header too long
        b"GET /\x01 HTTP/1.1\r\nHost: x\r\n\r\n",  # bad request line
    ],
)
async def test_unparsable_requests_get_openai_errors(gw, raw: bytes) -> None:
    reader, writer = await _connect(gw.url)
    try:
        writer.write(raw)
        data = await asyncio.wait_for(reader.read(), 5)  # the server closes after the error
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    # (aiohttp answers what it could not parse as HTTP/1.0)
    assert head.split(b"\r\n")[0] in (b"HTTP/1.0 400 Bad Request", b"HTTP/1.1 400 Bad Request")
    assert b"application/json" in head
    err = orjson.loads(body)["error"]
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "invalid_http"
    assert err["message"].startswith("Malformed HTTP request")
    assert set(err) == {"message", "type", "param", "code"}


async def test_an_unexpected_failure_is_a_500_in_openai_shape(gw, monkeypatch) -> None:
    from kvgate.admission.identity import TenantTable

    def boom(self, headers):  # type: ignore[no-untyped-def]
        raise RuntimeError("secret internals")

    monkeypatch.setattr(TenantTable, "identify", boom)
    reader, writer = await _connect(gw.url)
    try:
        writer.write(_post())
        data = await asyncio.wait_for(reader.read(), 5)  # closed after the error
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 500 ")
    err = orjson.loads(body)["error"]
    assert err["type"] == "server_error"
    assert err["code"] == "internal_error"
    assert b"secret" not in data
    assert gw.backend_state()["in_use"] == 0
