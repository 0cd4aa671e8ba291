"""Real ``redis-server`` processes on 127.0.0.1 for the shared-store tests.

Every server is a child process the test owns: never daemonized, started in its own directory,
on a loopback port that was free a moment before, and stopped by pid (SIGTERM, then SIGKILL
after a bounded wait). Readiness is a ``PING`` polled in a bounded loop. Nothing persists unless
asked: ``--save ""`` (no RDB snapshots) and ``--appendonly no`` by default, so a server killed
and restarted comes back empty, as a Redis that lost its memory does.

* :class:`RedisServer` — one server (standalone, replica or cluster node): ``url``, ``pid``,
  :meth:`~RedisServer.kill` (SIGKILL), :meth:`~RedisServer.restart` (same port),
  :meth:`~RedisServer.stop`, :meth:`~RedisServer.pause` / :meth:`~RedisServer.resume`
  (SIGSTOP / SIGCONT: a server that hangs), :meth:`~RedisServer.cli` (``redis-cli``) and
  :meth:`~RedisServer.client` (a sync ``redis.Redis``).
* :func:`start_redis` — one standalone server for a ``with`` block.
* :func:`start_replica_pair` and :func:`promote` — a primary with a replica that finished its
  first sync, and the failover step (``REPLICAOF NO ONE``).
* :func:`start_sentinel` — a Redis Sentinel (``redis-server --sentinel``) that monitors a
  primary as :data:`SENTINEL_MASTER` and fails over to its replica half a second after the
  primary stops answering.
* :class:`Forwarder` — a loopback TCP forwarder whose target can be switched (a name that
  moves to a failover's new primary).
* :func:`start_cluster` — an ``n``-node Redis Cluster (every slot served, ``cluster_state:ok``
  on every node) as :class:`RedisClusterServers`.
* :func:`require_redis` — skip when ``redis-server`` is missing, except under CI (``CI`` set),
  where ``make test`` installs it and a missing one fails the run.

The helpers are synchronous (``subprocess`` and the sync ``redis`` client): they work from sync
and async tests alike; in an async test a start or restart blocks the event loop for as long
as the server takes to answer ``PING`` (tens of milliseconds).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry
from tests.gateway.helpers import free_port

HOST = "127.0.0.1"

#: servers started and not stopped yet, by pid: stopped at interpreter exit if a test forgot
_LIVE: dict[int, subprocess.Popen[bytes]] = {}


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_LIVE.values()):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
    _LIVE.clear()


def require_redis() -> None:
    """Skip the calling test when ``redis-server`` or ``redis-cli`` is not on ``PATH``; with the
    ``CI`` environment variable set, fail it instead (CI runs ``make test``, which installs
    Debian's ``redis-server``, so a missing binary there is a broken setup, not a choice)."""
    missing = [tool for tool in ("redis-server", "redis-cli") if shutil.which(tool) is None]
    if not missing:
        return
    message = f"{' and '.join(missing)} not on PATH (Debian: apt-get install redis-server)"
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but {message}; `make test-packages` installs it", pytrace=False)
    pytest.skip(message)


def wait_until(pred: Callable[[], bool], timeout: float, what: str, interval: float = 0.02) -> None:
    """Poll ``pred`` every ``interval`` seconds until it is true.

    Raises:
        TimeoutError: still false after ``timeout`` seconds (the message names ``what``).
    """
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(interval)


async def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    """:func:`wait_until` for a test on the event loop: polls ``pred`` every 10 ms (the loop
    runs meanwhile) until true.

    Raises:
        AssertionError: still false after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        await asyncio.sleep(0.01)


def info(client: redis.Redis, section: str) -> dict[str, str]:
    """``INFO section`` as ``{field: value as text}`` (e.g. ``master_link_status`` → ``"up"``,
    ``aof_rewrite_in_progress`` → ``"0"``)."""
    return {key: str(value) for key, value in client.info(section).items()}


@dataclass(eq=False)
class RedisServer:
    """One ``redis-server`` child process on ``127.0.0.1:port``, with its files in ``root``.

    Attributes:
        root: this server's own directory (data under ``root/data``, log ``root/redis.log``,
            cluster state ``root/nodes.conf``).
        port: the TCP port it listens on (kept across :meth:`restart`).
        appendonly: ``--appendonly yes --appendfsync everysec`` (an AOF fsynced once a second,
            so a SIGKILL may lose up to the last second of writes) instead of no persistence.
        replicaof: ``(host, port)`` of the primary this server replicates, or ``None``.
        cluster: a Redis Cluster node (``--cluster-enabled yes``, node timeout 2000 ms).
        cluster_bus_port: its cluster bus port (``--cluster-port``), chosen free at start.
        sentinel_of: a Redis Sentinel (not a data server) that monitors the primary on this
            port as :data:`SENTINEL_MASTER` (quorum 1, down after 500 ms; its configuration,
            which Sentinel rewrites, in ``root/sentinel.conf``); 0: a data server.
    """

    root: Path
    port: int = 0
    appendonly: bool = False
    replicaof: tuple[str, int] | None = None
    cluster: bool = False
    cluster_bus_port: int = 0
    sentinel_of: int = 0
    proc: subprocess.Popen[bytes] | None = None
    _clients: list[Any] = field(default_factory=list)

    # ---- identity ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://{HOST}:{self.port}/0"

    @property
    def pid(self) -> int:
        """The server's process id.

        Raises:
            RuntimeError: not started.
        """
        if self.proc is None:
            raise RuntimeError("redis-server not started")
        return self.proc.pid

    @property
    def running(self) -> bool:
        """True while its process has not exited (a paused one is still running)."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def log_path(self) -> Path:
        """The server's log file."""
        return self.root / "redis.log"

    def log(self) -> str:
        """The server's log so far ("" when there is none yet)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # ---- life cycle --------------------------------------------------------------------

    def argv(self) -> list[str]:
        """The ``redis-server`` command line for the current settings (a sentinel's writes its
        configuration file)."""
        data = self.root / "data"
        if self.sentinel_of:
            conf = self.root / "sentinel.conf"
            conf.write_text(
                f"port {self.port}\nbind {HOST}\ndaemonize no\n"
                f"logfile {self.log_path}\ndir {data}\n"
                f"sentinel monitor {SENTINEL_MASTER} {HOST} {self.sentinel_of} 1\n"
                f"sentinel down-after-milliseconds {SENTINEL_MASTER} 500\n"
                f"sentinel failover-timeout {SENTINEL_MASTER} 3000\n"
            )
            return ["redis-server", str(conf), "--sentinel"]
        args = [
            "redis-server",
            "--port", str(self.port),
            "--bind", HOST,
            "--daemonize", "no",
            "--dir", str(data),
            "--logfile", str(self.log_path),
            "--save", "",
            "--enable-debug-command", "local",
            "--maxmemory-policy", "noeviction",
            # a replica's first sync starts at once (Redis waits 5 s for more replicas)
            "--repl-diskless-sync-delay", "0",
        ]  # fmt: skip
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            args += ["--appendonly", "no"]
        if self.replicaof is not None:
            args += ["--replicaof", self.replicaof[0], str(self.replicaof[1])]
        if self.cluster:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.root / "nodes.conf"),
                "--cluster-node-timeout", "2000",
                "--cluster-port", str(self.cluster_bus_port),
            ]  # fmt: skip
        return args

    def start(self, timeout: float = 15.0) -> None:
        """Start the process (port chosen when 0) and wait until it answers ``PING``.

        A first start whose port was taken meanwhile is retried on fresh ports (3 tries).

        Raises:
            RuntimeError: already running, or it exited (the message carries its log).
            TimeoutError: no ``PONG`` within ``timeout`` seconds.
        """
        if self.running:
            raise RuntimeError(f"redis-server on port {self.port} already running")
        pick = self.port == 0
        for attempt in range(3):
            if pick:
                self.port = free_port()
                if self.cluster:
                    self.cluster_bus_port = free_port()
            try:
                self._spawn(timeout)
                return
            except RuntimeError:
                if not pick or attempt == 2 or "Address already in use" not in self.log():
                    raise

    def _spawn(self, timeout: float) -> None:
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        self.log_path.unlink(missing_ok=True)
        proc = subprocess.Popen(
            self.argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self.proc = proc
        _LIVE[proc.pid] = proc

        def answers() -> bool:
            if proc.poll() is not None:
                _LIVE.pop(proc.pid, None)
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(
                    f"redis-server on port {self.port} exited with {proc.returncode}: "
                    f"{err}{self.log()[-2000:]}"
                )
            try:
                with redis.Redis(
                    host=HOST, port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5
                ) as probe:
                    return bool(probe.ping())
            except redis.exceptions.BusyLoadingError:
                return False  # still reading its AOF
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                return False

        try:
            wait_until(answers, timeout, f"redis-server on port {self.port} answering PING")
        except TimeoutError:
            self._end(signal.SIGKILL, 5.0)
            raise

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (and SIGCONT, in case it is paused), wait up to ``timeout`` seconds for the
        exit, else SIGKILL; close the clients :meth:`client` made. No-op when not running."""
        self._close_clients()
        self._end(signal.SIGTERM, timeout)

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL: the server dies at once, without saving anything; waits for the exit."""
        self._end(signal.SIGKILL, timeout)

    def restart(self, *, keep_data: bool = False, timeout: float = 15.0) -> None:
        """Start again on the same port with the same options (kills it first if running).

        With ``keep_data`` False (the default) its data directory is emptied first, so it comes
        back with no keys even when ``appendonly`` (a server that lost everything); with True an
        ``appendonly`` server reloads its AOF (what was fsynced before it died). A cluster node
        keeps its cluster identity and slots (``nodes.conf``) either way.

        Raises:
            RuntimeError / TimeoutError: as :meth:`start` (the port is not changed: if another
                process took it meanwhile, the restart fails).
        """
        if self.running:
            self.kill()
        if not keep_data:
            shutil.rmtree(self.root / "data", ignore_errors=True)
        self._spawn(timeout)

    def pause(self) -> None:
        """SIGSTOP: the server stays up but answers nothing (connections hang) until
        :meth:`resume`."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        os.kill(self.pid, signal.SIGCONT)

    def _end(self, sig: int, timeout: float) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
                if sig != signal.SIGKILL:
                    proc.send_signal(signal.SIGCONT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if proc.stderr is not None:
            proc.stderr.close()
        _LIVE.pop(proc.pid, None)

    # ---- talking to it -----------------------------------------------------------------

    def cli(self, *args: str, timeout: float = 15.0) -> str:
        """Run ``redis-cli -e -h 127.0.0.1 -p PORT ARGS`` and return its stdout, stripped.

        Raises:
            RuntimeError: redis-cli exited non-zero: the server could not be reached, or the
                command got an error reply (``-e``); the message carries its stderr.
            subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds.
        """
        done = subprocess.run(
            ["redis-cli", "-e", "-h", HOST, "-p", str(self.port), *args],
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"redis-cli {' '.join(args)} exited {done.returncode}: {done.stderr.decode()}"
            )
        return done.stdout.decode(errors="replace").strip()

    def client(self, **kwargs: Any) -> redis.Redis:
        """A sync ``redis.Redis`` for this server; closed by :meth:`stop`. Unless ``kwargs``
        say otherwise: ``decode_responses=True``, 5 s socket timeouts and no retry (redis-py
        retries a failed command 3 times with backoff by default; a test wants the failure
        at once)."""
        options: dict[str, Any] = {
            "decode_responses": True,
            "retry": Retry(NoBackoff(), 0),
            "socket_timeout": 5.0,
            "socket_connect_timeout": 5.0,
            **kwargs,
        }
        c = redis.Redis(host=HOST, port=self.port, **options)
        self._clients.append(c)
        return c

    def _close_clients(self) -> None:
        for c in self._clients:
            c.close()
        self._clients.clear()


@contextlib.contextmanager
def start_redis(
    root: Path,
    *,
    appendonly: bool = False,
    replicaof: tuple[str, int] | None = None,
    timeout: float = 15.0,
) -> Iterator[RedisServer]:
    """A standalone (or replica, with ``replicaof``) server in directory ``root`` for a
    ``with`` block; stopped when the block exits.

    Raises:
        RuntimeError / TimeoutError: it did not start (see :meth:`RedisServer.start`).
    """
    server = RedisServer(root=root, appendonly=appendonly, replicaof=replicaof)
    server.start(timeout)
    try:
        yield server
    finally:
        server.stop()


def wait_synced(replica: RedisServer, timeout: float = 20.0) -> None:
    """Wait until ``replica`` reports ``master_link_status:up`` in ``INFO replication`` (its
    first full sync with the primary is done).

    Raises:
        TimeoutError: not within ``timeout`` seconds.
    """
    with replica.client() as c:
        wait_until(
            lambda: info(c, "replication").get("master_link_status") == "up",
            timeout,
            f"replica on port {replica.port} synced",
            interval=0.05,
        )


#: the name a sentinel of :func:`start_sentinel` monitors its primary by
SENTINEL_MASTER = "kvgm"


@contextlib.contextmanager
def start_sentinel(
    root: Path, primary: RedisServer, replica: RedisServer, timeout: float = 20.0
) -> Iterator[RedisServer]:
    """A Redis Sentinel in ``root`` monitoring ``primary`` as :data:`SENTINEL_MASTER`, for a
    ``with`` block; it has found ``replica`` (so that it can fail over to it) before the block
    starts. Killing the primary makes it promote the replica within a few seconds.

    Raises:
        RuntimeError / TimeoutError: it did not start, or did not find the replica.
    """
    sentinel = RedisServer(root=root, sentinel_of=primary.port)
    sentinel.start(timeout)
    try:
        with sentinel.client() as c:

            def found() -> bool:
                # (its link to the primary seen up: else SENTINEL FAILOVER finds no replica
                # good enough to promote)
                return any(
                    int(r.get("port", 0)) == replica.port
                    and not r.get("is_sdown")
                    and r.get("master-link-status") == "ok"
                    for r in c.sentinel_slaves(SENTINEL_MASTER)
                )

            wait_until(found, timeout, f"the sentinel finding the replica on {replica.port}")
        yield sentinel
    finally:
        sentinel.stop()


def wait_primary(sentinel: RedisServer, port: int, timeout: float = 30.0) -> None:
    """Wait until ``sentinel`` names the server on ``port`` as the primary, its failover done
    (``SENTINEL MASTERS``, where clients such as redis-py look: during a failover it still
    names the old primary).

    Raises:
        TimeoutError: not within ``timeout`` seconds.
    """
    with sentinel.client() as c:

        def named() -> bool:
            state = c.sentinel_masters().get(SENTINEL_MASTER) or {}
            return int(state.get("port", 0)) == port and "failover" not in state.get("flags", "")

        wait_until(named, timeout, f"the sentinel naming port {port} the primary")


@contextlib.contextmanager
def start_replica_pair(
    root: Path, *, appendonly: bool = False, timeout: float = 20.0
) -> Iterator[tuple[RedisServer, RedisServer]]:
    """``(primary, replica)`` in ``root/primary`` and ``root/replica``, the replica past its
    first sync (:func:`wait_synced`); both stopped when the block exits.

    Raises:
        RuntimeError / TimeoutError: a server did not start or the replica did not sync.
    """
    with start_redis(root / "primary", appendonly=appendonly, timeout=timeout) as primary:
        with start_redis(
            root / "replica",
            appendonly=appendonly,
            replicaof=(HOST, primary.port),
            timeout=timeout,
        ) as replica:
            wait_synced(replica, timeout)
            yield primary, replica


def promote(replica: RedisServer, timeout: float = 10.0) -> None:
    """Fail over to ``replica``: ``REPLICAOF NO ONE`` and wait until ``INFO replication`` says
    ``role:master``. Its ``replicaof`` becomes ``None`` (a :meth:`RedisServer.restart` brings
    it back as a primary).

    Raises:
        TimeoutError: not a primary within ``timeout`` seconds.
    """
    with replica.client() as c:
        c.execute_command("REPLICAOF", "NO", "ONE")
        wait_until(
            lambda: info(c, "replication").get("role") == "master",
            timeout,
            f"replica on port {replica.port} promoted",
        )
    replica.replicaof = None


@dataclass(eq=False)
class RedisClusterServers:
    """An ``n``-node Redis Cluster on loopback (every node a primary, no replicas).

    Attributes:
        nodes: the nodes, each a :class:`RedisServer` with ``cluster=True``.
    """

    nodes: list[RedisServer]
    _clients: list[redis.cluster.RedisCluster] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The startup node's URL (``redis://127.0.0.1:PORT/0`` of the first node); a cluster
        client discovers the others from it."""
        return self.nodes[0].url

    @property
    def urls(self) -> list[str]:
        """Every node's URL."""
        return [n.url for n in self.nodes]

    def client(self, **kwargs: Any) -> redis.cluster.RedisCluster:
        """A sync ``redis.cluster.RedisCluster`` started from the first node
        (``decode_responses=True`` and 5 s socket timeouts unless ``kwargs`` say otherwise);
        closed by :meth:`stop`."""
        options: dict[str, Any] = {
            "decode_responses": True,
            "socket_timeout": 5.0,
            "socket_connect_timeout": 5.0,
            **kwargs,
        }
        c = redis.cluster.RedisCluster(host=HOST, port=self.nodes[0].port, **options)
        self._clients.append(c)
        return c

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until ``CLUSTER INFO`` says ``cluster_state:ok`` on every running node.

        Raises:
            TimeoutError: not within ``timeout`` seconds.
        """

        def ok() -> bool:
            for node in self.nodes:
                if not node.running:
                    continue
                try:
                    if "cluster_state:ok" not in node.cli("CLUSTER", "INFO", timeout=5.0):
                        return False
                except (RuntimeError, subprocess.TimeoutExpired):
                    return False
            return True

        wait_until(ok, timeout, "cluster_state:ok on every node", interval=0.1)

    def stop(self) -> None:
        """Close the clients :meth:`client` made and stop every node (SIGTERM, then SIGKILL)."""
        for c in self._clients:
            c.close()
        self._clients.clear()
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def start_cluster(
    root: Path, n: int = 3, *, timeout: float = 60.0
) -> Iterator[RedisClusterServers]:
    """An ``n``-node cluster (n ≥ 3, Redis's minimum of primaries) in ``root/node-I``:
    ``--cluster-enabled yes``, node timeout 2000 ms, slots split by ``redis-cli --cluster
    create ... --cluster-yes``, ready once every node says ``cluster_state:ok``; every node is
    stopped when the block exits.

    Raises:
        ValueError: ``n`` < 3.
        RuntimeError / TimeoutError: a node did not start, or the cluster was not ok within
            ``timeout`` seconds.
    """
    if n < 3:
        raise ValueError(f"a Redis Cluster needs at least 3 primaries, got n={n}")
    cluster = RedisClusterServers(nodes=[])
    try:
        for i in range(n):
            node = RedisServer(root=root / f"node-{i}", cluster=True)
            cluster.nodes.append(node)
            node.start()
        addresses = [f"{HOST}:{node.port}" for node in cluster.nodes]
        cluster.nodes[0].cli(
            "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes",
            timeout=timeout,
        )  # fmt: skip
        cluster.wait_ok(timeout)
        yield cluster
    finally:
        cluster.stop()


class Forwarder:
    """A loopback TCP forwarder whose target can be switched (a failover's new primary)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.server: asyncio.Server | None = None
        self.port = 0
        self.conns: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            w.close()
            return
        self.conns += [w, uw]

        async def pipe(a: asyncio.StreamReader, b: asyncio.StreamWriter) -> None:
            try:
                while data := await a.read(65536):
                    b.write(data)
                    await b.drain()
            except (OSError, ConnectionError):
                pass
            finally:
                b.close()

        # (cancelled when the loop ends with the connection open: the handler just ends; a
        # cancelled handler task makes asyncio's server print a traceback)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(pipe(r, uw), pipe(ur, w))

    def switch(self, port: int, *, keep: bool = False) -> None:
        """New connections go to ``port``; open ones are closed, or with ``keep`` stay with
        the old target (a DNS name that moved while clients kept their connections)."""
        self.target = port
        if keep:
            return
        for w in self.conns:
            w.close()
        self.conns.clear()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for w in self.conns:
            w.close()
