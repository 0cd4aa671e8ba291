"""An answer's upstream connection, closed before its request's slot goes back, is shut down
at once (:func:`kvgate.proxy.relay.close_now`): the engine has the disconnect before anything
else can happen, on asyncio's event loop and on uvloop (the gateway's)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
import uvloop

from kvgate.proxy.relay import close_now

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def has_eof(fd: int) -> bool:
    """Whether the peer's FIN is waiting on socket ``fd`` (nothing else unread), without
    reading it and without blocking."""
    with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as dup:
        try:
            return dup.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False


async def streaming_engine(
    check: Callable[[aiohttp.ClientResponse, int], Awaitable[None]], chunks: int
) -> None:
    """A raw HTTP engine on 127.0.0.1 that answers one request with ``chunks`` SSE chunks
    (then ends the body), or, for ``chunks`` 0, keeps streaming a chunk every 10 ms; ``check``
    gets the client's response once its first chunk arrived, and the engine's socket."""
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future[int] = loop.create_future()
    done: asyncio.Future[None] = loop.create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result(writer.get_extra_info("socket").fileno())
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(HEAD)
            n = 0
            while chunks == 0 or n < chunks:
                event = b"data: {}\n\n"
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                n += 1
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            await reader.read()  # until the client closes
        except ConnectionError:
            pass  # the client closed first
        finally:
            writer.close()
            done.set_result(None)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=b"{}")
            await resp.content.readuntil(b"\n\n")
            await check(resp, await accepted)
        async with asyncio.timeout(10):  # the engine saw the connection end
            await done
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_an_unfinished_answer_is_shut_down_before_anything_else_runs(loop: str) -> None:
    async def check(resp: aiohttp.ClientResponse, engine_fd: int) -> None:
        assert not has_eof(engine_fd)
        close_now(resp)
        # no await in between: the engine already has the disconnect
        assert has_eof(engine_fd)

    run = asyncio.run if loop == "asyncio" else uvloop.run
    run(streaming_engine(check, chunks=0))


def test_an_answer_read_to_its_end_is_closed_as_before() -> None:
    async def check(resp: aiohttp.ClientResponse, engine_fd: int) -> None:
        await resp.read()  # to the end: aiohttp gave the connection back to its pool
        assert resp.connection is None
        close_now(resp)
        assert resp.closed

    uvloop.run(streaming_engine(check, chunks=3))
