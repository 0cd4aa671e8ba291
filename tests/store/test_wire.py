"""The store's own connection to Redis (:mod:`kvgate.store.wire`), against a real
``redis-server``: replies stay matched to their calls after a caller gave up, a stalled or
closed connection is replaced, errors come as redis-py's classes, ``AUTH`` and ``SELECT``
from the URL, TLS (``rediss://``, the server's certificate verified), and a server that
speaks no RESP."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from tests.gateway.tls_certs import self_signed
from tests.store.redis_servers import (
    RedisServer,
    free_port,
    require_redis,
    wait_for,
    wait_until,
)

from kvgate.store.server import connection_lost, library_missing
from kvgate.store.wire import Wire, wire_for

#: a test library: echo its first argument; write it under the key given (to see the db)
LIBRARY = """#!lua name=kvgwiretest
redis.register_function('wt_echo', function(keys, args) return args[1] end)
redis.register_function('wt_set', function(keys, args) redis.call('SET', keys[1], args[1]); return 1 end)
"""


@contextlib.asynccontextmanager
async def wire_to(
    url: str, connect_timeout_s: float = 2.0, stall_s: float = 30.0, **kwargs: Any
) -> AsyncIterator[Wire]:
    """A :class:`Wire` to ``url`` (``kwargs``: its other arguments), closed on the way out."""
    wire = Wire(url, connect_timeout_s=connect_timeout_s, stall_s=stall_s, **kwargs)
    try:
        yield wire
    finally:
        await wire.aclose()


@pytest.fixture
def server(redis_server: RedisServer) -> RedisServer:
    redis_server.client().function_load(LIBRARY, replace=True)
    return redis_server


async def test_a_reply_that_comes_after_its_caller_gave_up_is_not_given_to_the_next_call(
    server: RedisServer,
) -> None:
    """Redis hangs (SIGSTOP) while a call waits; its caller gives up; the next call, written on
    the same connection, gets its own reply once Redis answers, not the first one's."""
    async with wire_to(server.url, connect_timeout_s=2.0, stall_s=30.0) as wire:
        assert await wire.fcall("wt_echo", 0, "warm") == b"warm"
        server.pause()
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await wire.fcall("wt_echo", 0, "first")
            second = asyncio.ensure_future(wire.fcall("wt_echo", 0, "second"))
            await asyncio.sleep(0)
        finally:
            server.resume()
        async with asyncio.timeout(10):
            assert await second == b"second"
        assert await wire.fcall("wt_echo", 0, "third") == b"third"
        assert wire.connects == 1  # the connection stayed in use


async def test_deadlines_fail_each_call_at_its_own_time_and_late_replies_are_dropped(
    server: RedisServer,
) -> None:
    """Calls given deadlines (:meth:`Wire.expire`) on a Redis that hangs (SIGSTOP): each fails
    with ``TimeoutError`` at its own deadline (a later one is not failed early, an earlier one
    given after it is not failed late), a call answered in time is left alone, and once Redis
    answers the late replies are dropped: the next call gets its own."""
    async with wire_to(server.url, connect_timeout_s=2.0, stall_s=30.0) as wire:
        assert await wire.fcall("wt_echo", 0, "warm") == b"warm"
        answered = wire.fcall("wt_echo", 0, "in time")
        wire.expire(answered, 5.0)
        assert await answered == b"in time"
        loop = asyncio.get_running_loop()
        server.pause()
        try:
            t0 = loop.time()
            late = wire.fcall("wt_echo", 0, "late")
            wire.expire(late, 1.0)
            early = wire.fcall("wt_echo", 0, "early")
            wire.expire(early, 0.1)  # given after the later deadline: re-arms the timer
            with pytest.raises(TimeoutError):
                await early
            took_early = loop.time() - t0
            assert not late.done()  # type: ignore[attr-defined]
            with pytest.raises(TimeoutError):
                await late
            took_late = loop.time() - t0
        finally:
            server.resume()
        assert 0.09 <= took_early < 0.9, took_early
        assert 0.99 <= took_late < 10, took_late
        async with asyncio.timeout(10):
            assert await wire.fcall("wt_echo", 0, "next") == b"next"
        assert wire.connects == 1  # the connection stayed in use


async def test_pipelined_calls_each_get_their_own_reply(server: RedisServer) -> None:
    async with wire_to(server.url, connect_timeout_s=2.0, stall_s=30.0) as wire:
        words = [f"w{i}" for i in range(200)]
        got = await asyncio.gather(*(wire.fcall("wt_echo", 0, w) for w in words))
        assert got == [w.encode() for w in words]
        assert wire.connects == 1


async def test_a_stalled_connection_is_replaced_and_its_waiting_call_fails_as_a_lost_one(
    server: RedisServer,
) -> None:
    """A call unanswered for longer than ``stall_s``: the next call closes that connection
    (the waiting call fails with a closed connection, which the store sends again with its
    operation id) and goes on a new one."""
    stall = 0.2
    async with wire_to(server.url, connect_timeout_s=5.0, stall_s=stall) as wire:
        assert await wire.fcall("wt_echo", 0, "warm") == b"warm"
        server.pause()
        try:
            first = asyncio.ensure_future(wire.fcall("wt_echo", 0, "first"))
            began = time.monotonic()
            await wait_for(lambda: time.monotonic() - began > stall * 1.5, 10, "the stall")
            second = asyncio.ensure_future(wire.fcall("wt_echo", 0, "second"))
            with pytest.raises(RedisConnectionError) as caught:
                async with asyncio.timeout(10):
                    await first
            assert connection_lost(caught.value)
        finally:
            server.resume()
        async with asyncio.timeout(10):
            assert await second == b"second"
        assert wire.connects == 2


async def test_a_connection_closed_by_the_server_is_opened_again_on_the_next_call(
    server: RedisServer,
) -> None:
    client = server.client()
    async with wire_to(server.url, connect_timeout_s=2.0, stall_s=30.0) as wire:
        assert await wire.fcall("wt_echo", 0, "a") == b"a"
        assert client.client_kill_filter(_type="normal", skipme=True) >= 1
        proto = wire._proto
        assert proto is not None
        await wait_for(lambda: proto.closed, 10, "the close seen")
        assert await wire.fcall("wt_echo", 0, "b") == b"b"
        assert wire.connects == 2


async def test_a_store_reports_its_connection_and_opens_it_again_once_redis_closed_it(
    server: RedisServer,
) -> None:
    """``/admin/state``'s ``store.connection``: the store's own, opened once; Redis drops it
    (``CLIENT KILL``): the next message goes on a new one, and the count says so."""
    from kvgate import AdmissionController
    from kvgate.config import StoreConfig
    from kvgate.store.redis_store import RedisStore

    ctl = AdmissionController(backends=1, tenants=1)
    ctl.add_backend("b", max_concurrency=64, tokens_per_minute=2**40)
    store = RedisStore(StoreConfig(url=server.url, heartbeat_s=5.0), ctl)
    await store.start(["b"])
    at_start = sum(store.failures.values())  # a join answered late on a loaded machine counts
    try:
        assert store.state()["connection"] == {"client": "kvgate", "opened": 1}
        assert server.client().client_kill_filter(_type="normal", skipme=True) >= 1
        wire = store._wire
        proto = wire._proto
        await wait_for(lambda: proto.closed, 10, "the close seen")
        calls = store.calls
        store._beat(store._scope("b", "b"))
        await wait_for(lambda: store.calls > calls and not store._scope("b", "b").busy, 10,
                       "the next message answered")  # fmt: skip
        assert store.state()["connection"] == {"client": "kvgate", "opened": 2}
        # the message went on the new connection
        assert sum(store.failures.values()) == at_start
    finally:
        await store.close()


async def test_errors_are_redis_py_errors(server: RedisServer) -> None:
    """An error reply as redis-py maps it (the call did not run: the library is missing), and
    a server that cannot be reached as a lost connection."""
    async with wire_to(server.url, connect_timeout_s=2.0, stall_s=30.0) as wire:
        with pytest.raises(ResponseError) as caught:
            await wire.fcall("no_such_function", 0)
        assert library_missing(caught.value)
        assert await wire.fcall("wt_echo", 0, "still") == b"still"  # the connection is fine
    url = f"redis://127.0.0.1:{free_port()}/0"
    async with wire_to(url, connect_timeout_s=2.0, stall_s=30.0) as nobody:
        with pytest.raises(RedisConnectionError) as refused:
            await nobody.fcall("wt_echo", 0, "x")
    assert connection_lost(refused.value)


async def test_a_server_turned_replica_fails_calls_as_lost_and_is_left(server: RedisServer) -> None:
    """The server became a replica while the connection stayed open (a failover that demoted
    it): it refuses every write (``READONLY``) before running it. The refused call and the
    ones pipelined behind it fail as on a lost connection (safe to send again), and the next
    call opens a new connection, which a moved address would take to the new primary."""
    client = server.client()
    async with wire_to(server.url, connect_timeout_s=2.0, stall_s=30.0) as wire:
        assert await wire.fcall("wt_set", 1, "wt:k", "before") == 1
        client.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
        try:
            calls = [wire.fcall("wt_set", 1, "wt:k", f"refused {i}") for i in range(3)]
            for call in calls:
                with pytest.raises(RedisConnectionError, match="read-only replica") as caught:
                    await call
                assert connection_lost(caught.value)
            proto = wire._proto
            assert proto is not None
            assert proto.closed
        finally:
            client.execute_command("REPLICAOF", "NO", "ONE")
        assert await wire.fcall("wt_set", 1, "wt:k", "after") == 1
        assert wire.connects == 2
    assert client.get("wt:k") == "after"


async def test_a_located_server_must_be_a_primary(
    redis_replica_pair: tuple[RedisServer, RedisServer],
) -> None:
    """A connection made where ``locate`` says (the primary Redis Sentinel names) is checked
    with ``ROLE``: a replica there (the sentinels' view lags a failover) fails the call as a
    lost connection, and each call asks ``locate`` again."""
    primary, replica = redis_replica_pair
    where = [replica.port]

    async def locate() -> tuple[str, int]:
        return "127.0.0.1", where[0]

    url = "redis://mymaster/0"
    async with wire_to(url, locate=locate, primary_of="m") as wire:
        with pytest.raises(RedisConnectionError, match="primary of 'm', is a slave") as caught:
            await wire.command("PING")
        assert connection_lost(caught.value)
        where[0] = primary.port
        assert await wire.command("PING") == b"PONG"
        assert wire.located == ("127.0.0.1", primary.port)
    # a user that may not run ROLE (an @admin command) is trusted to the sentinels' word
    acl = ("ACL", "SETUSER", "kvg", "on", ">kvg-pass", "~*", "+@all", "-@admin")
    primary.cli(*acl)
    async with wire_to("redis://kvg:kvg-pass@mymaster/0", locate=locate, primary_of="m") as wire:
        assert await wire.command("PING") == b"PONG"
        with pytest.raises(NoPermissionError):
            await wire.command("ROLE")


@contextlib.asynccontextmanager
async def resp_server(answers: dict[bytes, bytes]) -> AsyncIterator[int]:
    """A TCP server on 127.0.0.1 that answers each packet it reads (one command, as a Wire
    sends them) with ``answers[name]``: the command's name in upper case, ``b"*"`` for any
    other (or for bytes that are no command); its port. Its connections are closed on the way
    out."""
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(4096):
                parts = data.split(b"\r\n")
                name = parts[2].upper() if len(parts) > 2 else b""
                writer.write(answers.get(name, answers[b"*"]))
                await writer.drain()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield srv.sockets[0].getsockname()[1]
    finally:
        srv.close()
        for w in writers:
            w.close()
            with contextlib.suppress(ConnectionError):
                await w.wait_closed()
        await srv.wait_closed()


async def test_a_located_server_whose_role_is_renamed_away_is_trusted() -> None:
    """``ROLE`` renamed away (``rename-command ROLE ""``): the server the sentinels named is
    taken at their word, as for a user without ``ROLE``."""
    answers = {b"ROLE": b"-ERR unknown command 'ROLE'\r\n", b"*": b"+PONG\r\n"}
    async with resp_server(answers) as port:

        async def locate() -> tuple[str, int]:
            return "127.0.0.1", port

        async with wire_to("redis://mymaster/0", locate=locate, primary_of="m") as wire:
            assert await wire.command("PING") == b"PONG"
            assert wire.located == ("127.0.0.1", port)


async def test_a_sentinel_that_does_not_speak_resp_is_passed_over(
    redis_replica_pair: tuple[RedisServer, RedisServer], tmp_path: Path
) -> None:
    """The first address listed answers something else than RESP (an HTTP server): the
    lookup moves on to the next sentinel (redis-py's own stopped at the first such answer)."""
    from tests.store.redis_servers import SENTINEL_MASTER, start_sentinel

    from kvgate.config import StoreConfig
    from kvgate.store.server import sentinel_for

    primary, replica = redis_replica_pair
    http = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n"
    async with fake_server(http) as bad:
        with start_sentinel(tmp_path / "sentinel", primary, replica) as sentinel:
            config = StoreConfig(
                url=f"redis://{SENTINEL_MASTER}/0",
                sentinel={
                    "master": SENTINEL_MASTER,
                    "nodes": [f"127.0.0.1:{bad}", f"127.0.0.1:{sentinel.port}"],
                },
            )
            finder = sentinel_for(config, 1.0)
            try:
                assert await finder.discover_master(SENTINEL_MASTER) == (
                    "127.0.0.1",
                    primary.port,
                )
            finally:
                await finder.aclose()


async def test_auth_and_db_from_the_url(server: RedisServer) -> None:
    client = server.client()
    client.config_set("requirepass", "s3cret")
    try:
        base = f"127.0.0.1:{server.port}"
        async with wire_to(f"redis://:nope@{base}/0", connect_timeout_s=2.0, stall_s=30.0) as w:
            with pytest.raises(AuthenticationError):
                await w.fcall("wt_echo", 0, "x")
        async with wire_to(f"redis://{base}/0", connect_timeout_s=2.0, stall_s=30.0) as w:
            with pytest.raises(AuthenticationError):  # NOAUTH, as redis-py maps it
                await w.fcall("wt_echo", 0, "x")
        async with wire_to(
            f"redis://:s3cret@{base}/3", connect_timeout_s=2.0, stall_s=30.0
        ) as wire:
            assert await wire.fcall("wt_set", 1, "wt:key", "in-db-3") == 1
        authed = server.client(password="s3cret", db=3)
        assert authed.get("wt:key") == "in-db-3"
        authed.config_set("requirepass", "")
    finally:
        with contextlib.suppress(Exception):
            server.client(password="s3cret").config_set("requirepass", "")


@contextlib.asynccontextmanager
async def fake_server(answer: bytes) -> AsyncIterator[int]:
    """A TCP server on 127.0.0.1 that answers whatever it reads with ``answer``; its port
    (:func:`resp_server` with one answer for every command)."""
    async with resp_server({b"*": answer}) as port:
        yield port


async def test_closing_fails_a_waiting_call_at_once(server: RedisServer) -> None:
    """``aclose`` while a call waits on a server that hangs (SIGSTOP): the call fails with a
    closed connection at once, not when its own deadline passes."""
    wire = Wire(server.url, connect_timeout_s=2.0, stall_s=30.0)
    assert await wire.fcall("wt_echo", 0, "warm") == b"warm"
    server.pause()
    try:
        # more than the socket buffers hold: unsent bytes stay in the transport
        waiting = asyncio.ensure_future(wire.fcall("wt_echo", 0, "x" * 16_000_000))
        await asyncio.sleep(0)
        began = time.monotonic()
        await wire.aclose()
        with pytest.raises(RedisConnectionError):
            async with asyncio.timeout(10):
                await waiting
        assert time.monotonic() - began < 2.0
    finally:
        server.resume()


async def test_closing_during_a_shared_connect_fails_its_callers_as_a_lost_connection() -> None:
    """Two calls wait for one connection whose ``AUTH`` gets no answer; ``aclose`` calls the
    attempt off: each call fails with a closed connection (which the store handles), not with
    a cancellation nobody asked for."""
    async with fake_server(b"") as port:
        wire = Wire(f"redis://:pw@127.0.0.1:{port}/0", connect_timeout_s=30.0, stall_s=30.0)
        calls = [asyncio.ensure_future(wire.fcall("wt_echo", 0, str(i))) for i in range(2)]
        # (the calls' tasks run in order before the first check can see the attempt)
        await wait_for(lambda: wire._connecting is not None, 5, "the connect attempt")
        assert not any(call.done() for call in calls)
        await wire.aclose()
        for call in calls:
            with pytest.raises(RedisConnectionError):
                async with asyncio.timeout(5):
                    await call
            assert not call.cancelled()


async def test_a_tls_setting_that_is_wrong_fails_as_a_connection_error() -> None:
    url = "rediss://127.0.0.1:1/0?ssl_cert_reqs=bogus"
    assert not wire_for(url, cluster=False)  # redis-py's client would say so
    async with wire_to(url, connect_timeout_s=2.0, stall_s=30.0) as wire:
        with pytest.raises(RedisConnectionError, match="ssl_cert_reqs"):
            await wire.fcall("wt_echo", 0, "x")


@pytest.mark.parametrize(
    "answer", [b"HTTP/1.1 400 Bad Request\r\n\r\n", b"+OK\r\n+OK\r\n"], ids=["http", "two-replies"]
)
async def test_a_server_that_does_not_speak_resp_fails_the_call(answer: bytes) -> None:
    """Something else on the port (an HTTP server), or a reply to no call: the call fails as a
    lost connection, within its deadline, and nothing hangs."""
    async with fake_server(answer) as port:
        async with wire_to(
            f"redis://127.0.0.1:{port}/0", connect_timeout_s=2.0, stall_s=30.0
        ) as wire:
            async with asyncio.timeout(5):
                if answer.startswith(b"+OK"):
                    # the first +OK answers the call; the second answers nothing: closed
                    assert await wire.fcall("wt_echo", 0, "x") == b"OK"
                    proto = wire._proto
                    assert proto is not None
                    await wait_for(lambda: proto.closed, 5, "the connection closed")
                else:
                    with pytest.raises(RedisConnectionError):
                        await wire.fcall("wt_echo", 0, "x")


def test_which_urls_use_the_wire(tmp_path: Path) -> None:
    assert wire_for("redis://127.0.0.1:6379/0", cluster=False)
    assert wire_for("unix:///run/redis.sock", cluster=False)
    assert not wire_for("redis://127.0.0.1:7000", cluster=True)  # redis-py's cluster client
    ca = self_signed(tmp_path).certificate
    assert wire_for(f"rediss://redis.example:6380?ssl_ca_certs={ca}", cluster=False)
    # a CA file that cannot be read: redis-py's client (which says so)
    assert not wire_for(f"rediss://redis.example:6380?ssl_ca_certs={tmp_path}/no.pem", False)
    # a TLS setting the wire does not apply: redis-py
    assert not wire_for("rediss://redis.example:6380?ssl_ciphers=HIGH", cluster=False)


@dataclass
class TlsRedis:
    port: int
    ca: Path  # the server's self-signed certificate, the clients' CA file

    def url(self, query: str = "") -> str:
        return f"rediss://127.0.0.1:{self.port}/0" + (f"?{query}" if query else "")


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[TlsRedis]:
    """A ``redis-server`` that listens only on a TLS port (a self-signed certificate for
    127.0.0.1; clients not asked for one), with the test library loaded."""
    require_redis()
    cert = self_signed(tmp_path)
    port = free_port()
    argv = ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(cert.certificate), "--tls-key-file", str(cert.key),
            "--tls-ca-cert-file", str(cert.certificate), "--tls-auth-clients", "no",
            "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]  # fmt: skip
    log = (tmp_path / "redis.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    client = redis.Redis(
        host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(cert.certificate),
        socket_timeout=5.0, socket_connect_timeout=5.0,
    )  # fmt: skip

    def answers() -> bool:
        assert proc.poll() is None, (tmp_path / "redis.log").read_text()
        try:
            return bool(client.ping())
        except redis.exceptions.ConnectionError:
            return False

    try:
        wait_until(answers, 15, "the TLS redis-server")
        client.function_load(LIBRARY, replace=True)
        yield TlsRedis(port, cert.certificate)
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


async def test_tls_urls_use_the_wire_and_verify_the_server(tls_redis: TlsRedis) -> None:
    """``rediss://`` with the server's CA: calls go over TLS on the store's connection; without
    it the certificate is refused (verified by default, as redis-py does); ``ssl_cert_reqs=none``
    turns verification off."""
    url = tls_redis.url(f"ssl_ca_certs={tls_redis.ca}")
    assert wire_for(url, cluster=False)
    async with wire_to(url, connect_timeout_s=5.0, stall_s=30.0) as wire:
        assert await wire.fcall("wt_echo", 0, "over tls") == b"over tls"
    async with wire_to(tls_redis.url(), connect_timeout_s=5.0, stall_s=30.0) as unknown_ca:
        with pytest.raises(RedisConnectionError, match=r"(?i)certificate"):
            await unknown_ca.fcall("wt_echo", 0, "x")
    async with wire_to(
        tls_redis.url("ssl_cert_reqs=none"), connect_timeout_s=5.0, stall_s=30.0
    ) as unverified:
        assert await unverified.fcall("wt_echo", 0, "y") == b"y"
    # a TLS setting the store's connection does not apply: redis-py's client carries the calls
    assert not wire_for(tls_redis.url("ssl_ciphers=HIGH"), cluster=False)


async def test_a_store_on_a_tls_url_decides_in_redis(tls_redis: TlsRedis) -> None:
    """Two replicas of a tenant whose limit is 1 over ``rediss://``: the second admission,
    decided in Redis on the store's TLS connection, is refused while the first holds the slot
    and admitted once it was given back."""
    from kvgate import AdmissionController
    from kvgate.config import StoreConfig
    from kvgate.store import StoreRefusal
    from kvgate.store.redis_store import RedisStore

    cfg = StoreConfig(url=tls_redis.url(f"ssl_ca_certs={tls_redis.ca}"), heartbeat_s=5.0,
                      deadline_ms=2000, background_deadline_ms=2000)  # fmt: skip
    stores = []
    for _ in range(2):
        ctl = AdmissionController(backends=1, tenants=1)
        b = ctl.add_backend("b", max_concurrency=64, tokens_per_minute=2**40)
        t = ctl.add_tenant("t", priority="standard", max_concurrency=1)
        stores.append((RedisStore(cfg, ctl), SimpleNamespace(id=b, name="b"),
                       SimpleNamespace(id=t, name="t")))  # fmt: skip
    for st, _, _ in stores:
        await st.start(["b"])
    at_start = [sum(st.failures.values()) for st, _, _ in stores]
    try:
        assert all(isinstance(st._wire, Wire) for st, _, _ in stores)
        (one, b1, t1), (two, b2, t2) = stores
        first = await one.admit(b1, t1, "standard", 1)
        assert not isinstance(first, StoreRefusal), first
        refused = await two.admit(b2, t2, "standard", 1)
        assert isinstance(refused, StoreRefusal), refused
        one.release(first, 1, 1)
        await one.flushed()
        again = await two.admit(b2, t2, "standard", 1)
        assert not isinstance(again, StoreRefusal), again
        two.release(again, 1, 1)
        # every decision was Redis's: no failure since the start, no fallback
        for (st, _, _), failed in zip(stores, at_start, strict=True):
            assert (sum(st.failures.values()) - failed, st.degraded_admissions) == (0, 0)
    finally:
        for st, _, _ in stores:
            await st.close()
