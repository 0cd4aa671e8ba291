"""A store URL that points at a server speaking Redis's protocol without being Redis with
kvgate's library (a proxy that answers ``+OK``, a mock, a misrouted port): every reply is a
failed call, counted and logged as an answer that is not kvgate's — never a traceback, and the
requests are decided by the fallback policy."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest

from kvgate import AdmissionController
from kvgate.config import StoreConfig
from kvgate.store import StoreRefusal
from kvgate.store.redis_store import RedisStore


class Named:
    def __init__(self, id: int, name: str) -> None:
        self.id, self.name = id, name


@contextlib.asynccontextmanager
async def answering(reply: bytes) -> AsyncIterator[str]:
    """A server on 127.0.0.1 that answers every ``FCALL`` with ``reply`` (RESP bytes), every
    other command ``+OK`` (``HELLO``: unknown, as an old server says)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                if line.startswith(b"*"):  # an array of bulk strings: one command
                    parts = []
                    for _ in range(int(line[1:])):
                        size = int((await reader.readline())[1:])
                        parts.append((await reader.readexactly(size + 2))[:-2])
                    name = parts[0].upper()
                    if name == b"FCALL":
                        writer.write(reply)
                    elif name == b"HELLO":
                        writer.write(b"-ERR unknown command 'HELLO'\r\n")
                    else:
                        writer.write(b"+OK\r\n")
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0"
    finally:
        server.close()


@pytest.mark.parametrize(
    "reply",
    [
        b"+OK\r\n",
        b"*0\r\n",
        b'$15\r\n{"live":"many"}\r\n',
        b'$27\r\n{"epoch":"e","live":"many"}\r\n',
        b'$27\r\n{"epoch":"e","admits":"no"}\r\n',
    ],
)
async def test_answers_that_are_not_kvgates_are_failed_calls(
    reply: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    ctl = AdmissionController(backends=1, tenants=1)
    b = Named(ctl.add_backend("b", max_concurrency=8, tokens_per_minute=2**40), "b")
    t = Named(ctl.add_tenant("t", priority="standard", max_concurrency=4), "t")
    caplog.set_level(logging.DEBUG, logger="kvgate.store")
    async with answering(reply) as url:
        st = RedisStore(StoreConfig(url=url, deadline_ms=200, background_deadline_ms=500), ctl)
        await st.start(["b"])
        try:
            for _ in range(4):
                got = st.try_admit(b, t, "standard", 10)
                if got is None:
                    got = await st.admit(b, t, "standard", 10)
                if not isinstance(got, StoreRefusal):
                    st.release(got, 10, 5)
            assert st.failures["error"] >= 1, st.failures
            assert st._breaker.opened_at is not None  # every call failed: the fallback decides
        finally:
            await st.close()
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    assert "not kvgate's" in caplog.text, caplog.text
