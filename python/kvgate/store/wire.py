"""The connection a replica's store messages travel on: one TCP (or Unix) connection to one
Redis server, commands encoded and replies parsed by ``hiredis`` (the parser redis-py itself
uses), driven by an :class:`asyncio.Protocol`.

Why not redis-py's client for these calls: a near-limit admission waits for its ``FCALL``, so
every microsecond between the request and the reply is added to that request's latency.
redis-py's asyncio client turns the event loop once before it writes a command and once
after the reply is read, and runs a long path of pool, retry and observability code around
each call; at the pace of near-limit decisions (a few ms apart, CPUs idle in between) a
``PING`` took it 343-447 µs at p50 here against 104-139 µs on this connection (2,000 of each,
taking turns, on the same event loop: see ``docs/replicas.md``). Here a command is written to
the socket in the caller's own step, and its reply wakes the caller from the protocol's
``data_received``.

What stays with redis-py: everything else (loading the Functions library, ``check-config``,
the admin reads), and the Functions calls themselves on a Redis Cluster (its slot map and
redirections) or with a TLS setting this connection does not apply: :func:`wire_for` says
which.

Replies are matched to calls in order (Redis answers a connection's commands in the order
they were sent), so a call whose caller gave up (its deadline passed, its client went away)
keeps its place: its reply, when it comes, is dropped, and the connection stays in use. A
connection whose oldest unanswered call is older than ``stall_s`` is closed before the next
call and a new one opened (a server that stopped answering on it, a half-open connection). A
connection whose server answers ``READONLY`` (a primary a failover demoted to a replica while
the connection stayed open) is left at once: that call and those behind it fail as on a closed
connection (none of them ran), and the next call opens a new connection, which an address that
follows the primary takes to the new one.
Errors are redis-py's exception classes, so that callers handle both connections alike: a
reply error as redis-py maps it (``ResponseError``, ``OutOfMemoryError``, ...), a closed or
refused connection as ``redis.exceptions.ConnectionError``, a refused password as
``AuthenticationError``.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast
from urllib.parse import urlsplit

import hiredis
from redis._parsers.base import BaseParser
from redis.asyncio.connection import parse_url
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

__all__ = ["TLS_OPTIONS", "Wire", "tls_context", "wire_for"]


#: the TLS settings a ``rediss://`` URL may carry (query arguments, as redis-py reads them)
#: that the store's connection applies; a URL with any other ``ssl_*`` argument keeps redis-py
TLS_OPTIONS = frozenset(
    {"ssl_cert_reqs", "ssl_ca_certs", "ssl_check_hostname", "ssl_certfile", "ssl_keyfile"}
)


def wire_for(url: str, cluster: bool) -> bool:
    """Whether the store's Functions calls to ``url`` go on a :class:`Wire`: a single server
    reached by ``redis://``, ``unix://``, or ``rediss://`` (TLS) with no TLS setting beyond
    :data:`TLS_OPTIONS`. A Redis Cluster (``cluster: true``) keeps redis-py's client."""
    if cluster:
        return False
    scheme = urlsplit(url).scheme
    if scheme in ("redis", "unix"):
        return True
    if scheme == "rediss":
        try:
            options = parse_url(url)
            if {k for k in options if k.startswith("ssl_")} - TLS_OPTIONS:
                return False
            tls_context(dict(options))
        except (ValueError, OSError):  # a setting or file that is wrong: redis-py says so
            return False
        return True
    return False


def tls_context(options: dict[str, Any]) -> ssl.SSLContext:
    """The client TLS context of a ``rediss://`` URL's settings (as :func:`parse_url` gives
    them), with redis-py's meanings and defaults: ``ssl_cert_reqs`` ``required`` (default),
    ``optional`` or ``none``; ``ssl_ca_certs`` a CA file (default: the system's);
    ``ssl_check_hostname`` (default true; never with ``none``); ``ssl_certfile`` and
    ``ssl_keyfile`` a client certificate.

    Raises:
        ValueError: an unknown ``ssl_cert_reqs``.
        OSError, ssl.SSLError: a file that cannot be read or loaded.
    """
    reqs = options.get("ssl_cert_reqs", "required")
    modes = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
    mode = reqs if isinstance(reqs, ssl.VerifyMode) else modes.get(str(reqs).lower())
    if mode is None:
        raise ValueError(f"ssl_cert_reqs must be none, optional or required (got {reqs!r})")
    ctx = ssl.create_default_context(cafile=options.get("ssl_ca_certs"))
    ctx.check_hostname = bool(options.get("ssl_check_hostname", True)) and mode != ssl.CERT_NONE
    ctx.verify_mode = mode
    if options.get("ssl_certfile"):
        ctx.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile"))
    return ctx


def _failed(exc: Exception) -> asyncio.Future[Any]:
    """A future that fails with ``exc`` when awaited."""
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    fut.set_exception(exc)
    return fut


def _pack(*parts: Any) -> bytes:
    """One command in RESP (hiredis's encoder: a bulk string per part)."""
    return hiredis.pack_command(parts)


class _Protocol(asyncio.Protocol):
    """One connection: writes encoded commands, parses replies, wakes each call's future in
    the order the calls were written."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader()
        #: (monotonic time written, future) of each call not yet answered, oldest first
        self.pending: collections.deque[tuple[float, asyncio.Future[Any]]] = collections.deque()
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not registered as asyncio.Transport subclasses)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:  # not RESP: nothing more on it can be trusted
                self.close(RedisConnectionError(f"Protocol error from Redis: {exc}"))
                return
            if reply is False:
                return
            if not self.pending:  # a reply to no call (a misbehaving server or proxy)
                self.close(RedisConnectionError("Redis answered a command never sent"))
                return
            _, fut = self.pending.popleft()
            if isinstance(reply, hiredis.ReplyError) and str(reply).startswith("READONLY"):
                # the server is a replica now (a failover demoted it while this connection
                # stayed open, or the address names a replica): it refuses every write before
                # running it, so this call and the ones behind it did not run. They fail as on
                # a closed connection (sent again once, on a new connection, which may reach
                # the new primary), and the connection is left
                error = RedisConnectionError(
                    f"Redis is a read-only replica on this connection ({reply}); connection left"
                )
                if not fut.done():
                    fut.set_exception(error)
                self.close(error)
                return
            if fut.done():  # its caller gave up: the reply is dropped
                continue
            if isinstance(reply, hiredis.ReplyError):
                fut.set_exception(BaseParser.parse_error(str(reply)))
            else:
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        error = RedisConnectionError(
            f"Connection closed by server: {exc}" if exc else "Connection closed by server."
        )
        while self.pending:
            _, fut = self.pending.popleft()
            if not fut.done():
                fut.set_exception(error)

    def call(self, packed: bytes) -> asyncio.Future[Any]:
        """Writes one encoded command now; the future gets its reply."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise RedisConnectionError("Connection closed.")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending.append((time.monotonic(), fut))
        self.transport.write(packed)
        return fut

    def close(self, error: Exception | None = None) -> None:
        """Closes the connection now (unsent bytes are dropped); unanswered calls fail at once
        with ``error`` (a closed connection by default)."""
        error = error or RedisConnectionError("Connection closed.")
        while self.pending:
            _, fut = self.pending.popleft()
            if not fut.done():
                fut.set_exception(error)
        self.closed = True
        if self.transport is not None:
            # at once: no waiting for unsent bytes or a TLS close_notify on a server that hangs
            self.transport.abort()


class Wire:
    """A lazily (re)connected connection to one Redis server for the store's ``FCALL`` s.

    Args:
        url: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` (the same, over
            TLS: :func:`tls_context`) or ``unix://path[?db=n]`` (the forms redis-py parses; see
            :func:`wire_for`).
        connect_timeout_s: the most a connection (with ``AUTH`` and ``SELECT``) may take,
            seconds; a call that needs a new connection waits at most that long for it.
        stall_s: a connection whose oldest unanswered call was written longer ago than this
            (seconds) is replaced before the next call.
        locate: where each new connection goes, asked anew for each (the address of the
            primary Redis Sentinel names: ``Sentinel.discover_master``); ``url`` then gives
            only the credentials and the database. A server reached that way must answer
            ``ROLE`` as a primary, else the connection fails as a lost one.
        primary_of: the name ``locate`` looks the primary up by (for error messages).
    """

    def __init__(
        self,
        url: str,
        connect_timeout_s: float,
        stall_s: float,
        locate: Callable[[], Awaitable[tuple[str, int]]] | None = None,
        primary_of: str = "",
    ) -> None:
        self.url = url
        self._opts: dict[str, Any] = dict(parse_url(url))
        self._connect_timeout = connect_timeout_s
        self._stall = stall_s
        self._locate = locate
        self._primary_of = primary_of
        #: ``(host, port)`` of the server the current connection reached through ``locate``
        self.located: tuple[str, int] | None = None
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Task[_Protocol] | None = None
        #: (loop time, future) of each call given a deadline (:meth:`expire`), and the one
        #: timer that serves them, armed for the earliest
        self._deadlines: list[tuple[float, asyncio.Future[Any]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        #: connections opened so far (the first included)
        self.connects = 0

    def fcall(self, function: str, numkeys: int, *keys_and_args: Any) -> Awaitable[Any]:
        """``FCALL function numkeys key... arg...``: the function's reply (``bytes`` for a
        bulk string, as redis-py without ``decode_responses``). Raises as :meth:`command`."""
        return self.command("FCALL", function, numkeys, *keys_and_args)

    def command(self, *parts: Any) -> Awaitable[Any]:
        """Any command (``str``, ``bytes``, ``int`` or ``float`` parts), to be awaited for its
        reply. On an open connection it is written at once (the awaitable is the reply's
        future: a decision near a limit pays no coroutine frames around its call); else it
        is written once a connection is made.

        Raises:
            redis.exceptions.ResponseError: Redis answered with an error (a subclass as
                redis-py maps it: e.g. ``OutOfMemoryError``).
            redis.exceptions.ConnectionError: no connection could be made, or it closed
                before the reply (the command may or may not have run), or the server
                answered ``READONLY`` (a replica now: the command did not run, and the
                connection is left); its subclasses as
                redis-py maps an error reply: ``AuthenticationError`` (``NOAUTH``, a refused
                password), ``BusyLoadingError`` (``LOADING``).
        """
        packed = _pack(*parts)
        proto = self._proto
        if proto is None or proto.closed or self._stalled(proto):
            return self._call_connected(packed)
        try:
            return proto.call(packed)
        except RedisConnectionError as exc:  # its transport is closing: raised when awaited
            return _failed(exc)

    async def _call_connected(self, packed: bytes) -> Any:
        return await (await self._connected()).call(packed)

    def expire(self, reply: Awaitable[Any], timeout_s: float) -> None:
        """Bounds the wait for a reply :meth:`command` returned as a future (the connection
        was open): unless it is in within ``timeout_s`` seconds, the future fails with
        ``TimeoutError`` (the reply, should it come later, is dropped, as for a caller that
        gave up). One timer serves every call of the connection, armed for the earliest
        deadline; a timeout context around each call (a timer, a context object, the task's
        cancellation) cost a decision near a limit 0.015-0.02 ms more at p50, 3 ms apart
        (``benches/replicas/wire_ab.py``). Another awaitable (a coroutine: the connection was being made) is left as it is:
        bound its caller's wait with a timeout context."""
        if not isinstance(reply, asyncio.Future) or reply.done():
            return
        loop = reply.get_loop()
        when = loop.time() + timeout_s
        self._deadlines.append((when, reply))
        if self._timer is None or when < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = when
            self._timer = loop.call_at(when, self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """The deadline timer: fails the calls whose deadline passed, re-arms for the next."""
        self._timer = None
        # (a timer may run up to the loop's clock resolution early: such a deadline counts)
        now = loop.time() + 0.001
        left = []
        for when, fut in self._deadlines:
            if fut.done():
                continue
            if when <= now:
                fut.set_exception(TimeoutError("no reply within the call's deadline"))
            else:
                left.append((when, fut))
        self._deadlines = left
        if left:
            self._timer_at = min(when for when, _ in left)
            self._timer = loop.call_at(self._timer_at, self._sweep, loop)

    def _stalled(self, proto: _Protocol) -> bool:
        if proto.pending and time.monotonic() - proto.pending[0][0] > self._stall:
            proto.close(RedisConnectionError("Redis did not answer on this connection"))
            return True
        return False

    async def _connected(self) -> _Protocol:
        """The current connection, or a new one (one attempt shared by concurrent callers)."""
        task = self._connecting
        if task is None or task.done():
            task = self._connecting = asyncio.get_running_loop().create_task(self._connect())
            # its error is the awaiting callers' (none left when all gave up: not logged)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            # shielded: one caller's deadline must not cancel the others' connection
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task.cancelled() and me is not None and not me.cancelling():
                # the attempt was called off (aclose), not this caller
                raise RedisConnectionError("Connection closed.") from None
            raise
        finally:
            if task.done() and self._connecting is task:
                self._connecting = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        o = self._opts
        try:
            async with asyncio.timeout(self._connect_timeout):
                located = None
                if self._locate is not None:
                    located = await self._locate()
                    _, proto = await loop.create_connection(_Protocol, *located)
                elif "path" in o:
                    _, proto = await loop.create_unix_connection(_Protocol, o["path"])
                else:
                    host = o.get("host", "localhost")
                    tls = None
                    if urlsplit(self.url).scheme == "rediss":
                        try:
                            tls = tls_context(o)
                        except ValueError as exc:
                            raise RedisConnectionError(f"TLS settings of the URL: {exc}") from exc
                    _, proto = await loop.create_connection(
                        _Protocol,
                        host,
                        int(o.get("port", 6379)),
                        ssl=tls,
                        server_hostname=host if tls is not None else None,
                    )
                try:
                    if o.get("password") is not None:
                        user = (o["username"],) if o.get("username") else ()
                        try:
                            await proto.call(_pack("AUTH", *user, o["password"]))
                        except ResponseError as exc:
                            raise AuthenticationError(str(exc)) from exc
                    if o.get("db"):
                        await proto.call(_pack("SELECT", int(o["db"])))
                    if located is not None:
                        try:
                            role = await proto.call(_pack("ROLE"))
                        except ResponseError:
                            # ROLE is an @admin command (NOPERM for a user without it), and
                            # may be renamed away: then the sentinels' word is trusted (a
                            # replica would answer the writes READONLY)
                            role = [b"master"]
                        if not role or role[0] != b"master":
                            # the sentinels' view lags a failover under way: asked again on
                            # the next call
                            what = role[0].decode() if role else "?"
                            raise RedisConnectionError(
                                f"{located[0]}:{located[1]}, which the sentinels named as the "
                                f"primary of {self._primary_of!r}, is a {what}"
                            )
                except BaseException:
                    proto.close()
                    raise
        except TimeoutError:
            raise RedisConnectionError(
                f"Timeout connecting to {self._where()} ({self._connect_timeout:g} s)"
            ) from None
        except OSError as exc:
            raise RedisConnectionError(f"Error connecting to {self._where()}: {exc}") from exc
        old, self._proto = self._proto, proto
        if old is not None and not old.closed:
            old.close()
        self.connects += 1
        self.located = located
        return proto

    @property
    def connected(self) -> bool:
        """Whether a connection is open now."""
        return self._proto is not None and not self._proto.closed

    def leave(self, reason: str) -> None:
        """Closes the current connection (its unanswered calls fail as on a lost connection,
        with ``reason``); the next call opens a new one (through ``locate``: where the
        sentinels say the primary is now)."""
        proto = self._proto
        if proto is not None and not proto.closed:
            proto.close(RedisConnectionError(reason))

    def _where(self) -> str:
        o = self._opts
        if self._locate is not None:
            return f"the primary of {self._primary_of!r} (Redis Sentinel)"
        return o["path"] if "path" in o else f"{o.get('host', 'localhost')}:{o.get('port', 6379)}"

    async def aclose(self) -> None:
        """Closes the connection (unanswered calls fail with a closed connection)."""
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._proto is not None:
            self._proto.close()
            self._proto = None
        self._deadlines.clear()
