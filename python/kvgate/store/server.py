"""The Redis (or Valkey) server behind the shared store: kvgate's Functions library
(``kvgate.lua``) and loading it, the redis-py clients that reach it (one server, a Cluster, or
the primary Redis Sentinel names), what a failed call's error says (a closed connection, a
library the server lost, a primary demoted to a replica), and the checks ``kvgate
check-config`` runs on the server."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from pathlib import Path
from typing import Any

__all__ = [
    "LIBRARY",
    "LIBRARY_NAME",
    "check_server",
    "connection_lost",
    "left_replica",
    "library_missing",
    "load_library",
    "sentinel_for",
    "short_error",
    "store_client",
    "store_wire",
]

#: the Functions library every replica loads (``FUNCTION LOAD REPLACE``): ``kvg_sync`` (the one
#: writer of a scope's state), ``kvg_leave``, ``kvg_peek``
LIBRARY = Path(__file__).with_name("kvgate.lua").read_text()
LIBRARY_NAME = "kvgate"


def sentinel_for(config: Any, timeout_s: float) -> Any | None:
    """redis-py's asyncio ``Sentinel`` for ``config.sentinel`` (a
    :class:`kvgate.config.StoreConfig`), or ``None`` without one, with the sentinels' own
    credentials. redis-py asks the sentinels one after the other (the last one that answered
    first), so each gets ``timeout_s`` seconds divided by their number (at least 0.05 s) to
    connect and to answer: a sentinel that hangs (stopped, or behind a dropped route) does
    not use up the whole lookup before the next one is asked."""
    s = config.sentinel
    if s is None:
        return None
    each = max(0.05, timeout_s / len(s.nodes))
    kwargs: dict[str, Any] = {"socket_connect_timeout": each, "socket_timeout": each}
    if s.username:
        kwargs["username"] = s.username
    if s.password is not None:
        kwargs["password"] = s.password
    return _sentinel_class()(s.addresses(), sentinel_kwargs=kwargs)


@functools.cache
def _sentinel_class() -> type:
    """redis-py's asyncio ``Sentinel`` whose lookup of a primary (``discover_master``, which
    the store's connection and redis-py's ``master_for`` clients both use) moves on to the
    next sentinel whatever the failure of one: redis-py's own moves on only for a connection
    error, a timeout or an error reply, so one address that answers something else than RESP
    (an HTTP server, a proxy's banner: ``InvalidResponse``) stopped every lookup, though a
    good sentinel was listed after it."""
    from redis.asyncio.sentinel import MasterNotFoundError, Sentinel
    from redis.exceptions import RedisError

    class _Sentinel(Sentinel):  # type: ignore[misc]
        async def discover_master(self, service_name: str) -> tuple[str, int]:
            errors = []
            # (a copy: lookups run at once — the connection's, the heartbeat's check, redis-py's
            # pool — and each may reorder the list while another awaits a sentinel)
            for sentinel in list(self.sentinels):
                kw = sentinel.connection_pool.connection_kwargs
                where = f"sentinel {kw.get('host')}:{kw.get('port')}"
                try:
                    masters: Any = await sentinel.sentinel_masters()
                except (RedisError, OSError) as exc:
                    errors.append(f"{where}: {short_error(exc)}")
                    continue
                state = masters.get(service_name)
                if state and self.check_master_state(state, service_name):
                    # the one that answered is asked first next time (as redis-py does), found
                    # where it is now
                    at = self.sentinels.index(sentinel)
                    self.sentinels[0], self.sentinels[at] = sentinel, self.sentinels[0]
                    return state["ip"], state["port"]
                errors.append(
                    f"{where}: " + ("its primary is down" if state else "no master of that name")
                )
            raise MasterNotFoundError(
                f"No master found for {service_name!r}: {'; '.join(errors) or 'no sentinel'}"
            )

    return _Sentinel


def store_client(config: Any, sentinel: Any | None, **opts: Any) -> Any:
    """The redis-py asyncio client of the store's server: a ``RedisCluster`` (``cluster``),
    the primary ``sentinel`` names (``Sentinel.master_for``: each new connection asks the
    sentinels, and one refused ``READONLY`` is dropped for the new primary), or the server of
    ``url``. ``opts`` go to each connection (``retry``, timeouts)."""
    if config.cluster:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(config.url, **opts)
    if sentinel is not None:
        from redis.asyncio.connection import parse_url

        # the URL's credentials and database (its host and port name no server here)
        primary = {k: v for k, v in parse_url(config.url).items() if k not in ("host", "port")}
        return sentinel.master_for(config.sentinel.master, **{**primary, **opts})
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(config.url, **opts)


def store_wire(config: Any, sentinel: Any | None, connect_timeout_s: float, stall_s: float) -> Any:
    """The store's own connection (:class:`kvgate.store.wire.Wire`) where its messages go on
    one (:func:`~kvgate.store.wire.wire_for`), through ``sentinel`` when there is one; else
    ``None`` (they go on :func:`store_client`'s client)."""
    from kvgate.store.wire import Wire, wire_for

    if not wire_for(config.url, config.cluster):
        return None
    if sentinel is None:
        return Wire(config.url, connect_timeout_s=connect_timeout_s, stall_s=stall_s)
    name = config.sentinel.master
    last: tuple[str, int] | None = None

    async def locate() -> tuple[str, int]:
        nonlocal last
        try:
            host, port = await sentinel.discover_master(name)
        except Exception:
            # no sentinel answers (all restarting, or cut off): the primary they last named,
            # if any (the connection checks that it is still one)
            if last is None:
                raise
            return last
        last = (str(host), int(port))
        return last

    return Wire(config.url, connect_timeout_s=connect_timeout_s, stall_s=stall_s,
                locate=locate, primary_of=name)  # fmt: skip


async def load_library(client: Any, cluster: bool = False) -> None:
    """Loads (or replaces) the ``kvgate`` Functions library on the server (every primary of a
    cluster). Raises ``redis.exceptions.RedisError`` when it cannot."""
    if cluster:
        from redis.asyncio.cluster import RedisCluster

        # "FUNCTION LOAD" as one word: redis-py's cluster client then sends it to the nodes
        # named, whatever it learnt of the command's keys
        await client.execute_command(
            "FUNCTION LOAD", "REPLACE", LIBRARY, target_nodes=RedisCluster.PRIMARIES
        )
    else:
        await client.function_load(LIBRARY, replace=True)


def short_error(exc: BaseException) -> str:
    """An error's first line, at most 200 characters (a redis-py error may quote a whole
    command)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def connection_lost(exc: BaseException) -> bool:
    """Whether a call failed because its connection was closed or could not be made (redis-py's
    ``ConnectionError``, or the OS's), not because it took too long: sending it again on a new
    connection is safe (its operation id) and quick."""
    from redis.exceptions import AuthenticationError, MaxConnectionsError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if left_replica(exc):
        return True
    # redis-py's ConnectionError also covers a refused password and a full pool: a new
    # connection would meet the same answer
    return isinstance(exc, RedisConnectionError | ConnectionError) and not isinstance(
        exc, RedisTimeoutError | AuthenticationError | MaxConnectionsError
    )


def left_replica(exc: BaseException) -> bool:
    """Whether Redis refused a call because the server is a read-only replica now (redis-py's
    ``ReadOnlyError``, Redis's ``READONLY`` answer: a failover demoted the server while the
    connection stayed open). Redis refuses a write before running it, so the call did not run;
    a new connection, to an address that follows the primary, reaches the new one."""
    from redis.exceptions import ReadOnlyError

    return isinstance(exc, ReadOnlyError)


def library_missing(exc: BaseException) -> bool:
    """Whether Redis answered that the ``kvgate`` Functions library is not loaded (``ERR
    Function not found``): the call did not run."""
    text = str(exc).lower()
    return "function" in text and ("not found" in text or "no such" in text)


async def check_server(config: Any, wait_s: float = 5.0) -> tuple[list[str], list[str]]:
    """What ``kvgate check-config`` says of the ``store`` server: ``(problems, notes)``.

    Problems (the gateway would not share its limits): no sentinel names a primary (with
    ``sentinel``), the server cannot be reached within ``wait_s`` seconds, is older than Redis
    7.0 (no Functions), is a Cluster node while ``cluster`` is off, is a read-only replica
    (``INFO replication``'s ``role:slave``), refuses to load the ``kvgate`` Functions library,
    or fails a replica's message sent as a replica sends it (:func:`_trial_message`: credentials, ``FCALL`` and key
    permissions, a kvgate reply). Notes: the server's version, and a warning when its
    ``maxmemory-policy`` is not ``noeviction`` (an evicted key forgets what replicas hold: limits
    would be exceeded) or cannot be read (managed services often disable ``CONFIG``).
    """
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    problems: list[str] = []
    notes: list[str] = []
    opts: dict[str, Any] = {"retry": Retry(NoBackoff(), 0), "socket_connect_timeout": wait_s}
    sentinel = sentinel_for(config, wait_s)
    client = store_client(config, sentinel, **opts)
    where = config.url.rsplit("@", 1)[-1]
    try:
        async with asyncio.timeout(wait_s):
            if sentinel is not None:
                name = config.sentinel.master
                try:
                    host, port = await sentinel.discover_master(name)
                except Exception as exc:
                    problems.append(
                        f"store.sentinel: no sentinel names a primary for {name!r}: "
                        f"{short_error(exc)}"
                    )
                    return problems, notes
                where = f"{host}:{port}"
                notes.append(f"store: the sentinels name {where} as the primary of {name!r}")
            info = await client.info("server")
            if config.cluster:  # one answer per node: any node's is representative
                info = (
                    next(iter(info.values()))
                    if isinstance(info, dict)
                    and info
                    and all(isinstance(v, dict) for v in info.values())
                    else info
                )
            version = str(info.get("redis_version", "?"))
            notes.append(f"store: Redis {version} at {where}")
            major = int(version.split(".")[0]) if version[:1].isdigit() else 0
            if major < 7:
                problems.append(
                    f"store.url: Redis {version} has no Functions; kvgate needs 7.0 or later"
                )
                return problems, notes
            if not config.cluster:
                with contextlib.suppress(Exception):  # (INFO cluster may be renamed away)
                    if int((await client.info("cluster")).get("cluster_enabled", 0)) == 1:
                        problems.append(
                            "store.url: the server is a node of a Redis Cluster: set "
                            "store.cluster: true (each tenant's keys live on the node that "
                            "owns their slot)"
                        )
                        return problems, notes
                with contextlib.suppress(Exception):  # (INFO replication may be renamed away)
                    repl = await client.info("replication")
                    if repl.get("role") == "slave":
                        problems.append(
                            "store.url: the server is a read-only replica (of "
                            f"{repl.get('master_host', '?')}:{repl.get('master_port', '?')}): "
                            "point store.url at the primary, or at an address that follows "
                            "the primary through a failover"
                        )
                        return problems, notes
            try:
                await load_library(client, config.cluster)
            except Exception as exc:
                problems.append(
                    f"store.url: cannot load kvgate's Functions library: {short_error(exc)}"
                )
            else:
                problem = await _trial_message(config, client, sentinel, wait_s)
                if problem is not None:
                    problems.append(problem)
            try:
                policy = await client.config_get("maxmemory-policy")
                if config.cluster and policy and all(isinstance(v, dict) for v in policy.values()):
                    policy = next(iter(policy.values()))
                value = policy.get("maxmemory-policy")
                if value != "noeviction":
                    notes.append(
                        f"warning: store: maxmemory-policy is {value!r}: set it to 'noeviction' "
                        "(an evicted key forgets what the replicas hold and limits are exceeded)"
                    )
            except Exception:
                notes.append(
                    "warning: store: cannot read maxmemory-policy (CONFIG disabled?); make sure "
                    "it is 'noeviction'"
                )
    except Exception as exc:
        problems.append(f"store.url: cannot reach Redis at {where}: {short_error(exc)}")
    finally:
        with contextlib.suppress(Exception):
            await client.aclose()
        if sentinel is not None:
            with contextlib.suppress(Exception):
                await sentinel.aclose()
    return problems, notes


async def _trial_message(config: Any, client: Any, sentinel: Any, wait_s: float) -> str | None:
    """Sends one message to a scope of its own (``{<key_prefix>:check}``) the way a replica
    sends its messages — on the store's own connection (:class:`~kvgate.store.wire.Wire`) where
    a replica uses one, else on ``client`` — and leaves it again; returns the problem, or
    ``None``. It catches what loading the library alone does not: a password the store's
    connection is refused (redis-py, which loads the library, carries on where a server has
    none), a user that may not ``FCALL`` or write the prefix's keys, a server whose answer is
    not kvgate's. The scope's hash expires on its own (within about 200 s)."""
    import os
    import secrets

    import orjson

    from kvgate.store.scopes import scope_key

    key = scope_key(config.key_prefix, "check", "config")
    pod = f"check-config-{os.getpid()}-{secrets.token_hex(3)}"
    msg = {"pod": pod, "seq": 1, "ttl": 1_000_000, "epoch": "check." + secrets.token_hex(6)}
    wire = store_wire(config, sentinel, connect_timeout_s=wait_s, stall_s=wait_s)
    own = wire is not None
    conn: Any = wire if own else client
    try:
        async with asyncio.timeout(wait_s):
            raw = await conn.fcall(
                "kvg_sync", 3, key, key + ":live", f"{key}:op:{pod}:1", orjson.dumps(msg)
            )
            try:
                reply = orjson.loads(raw)
            except (TypeError, orjson.JSONDecodeError):
                reply = None
            if not isinstance(reply, dict) or "epoch" not in reply:
                return f"store.url: the server's answer to kvgate's Function is not kvgate's ({str(raw)[:80]!r})"
            await conn.fcall("kvg_leave", 2, key, key + ":live", pod)
    except TimeoutError:
        return f"store.url: a replica's message got no answer within {wait_s:g} s"
    except Exception as exc:
        return (
            f"store.url: a replica's message (FCALL kvg_sync on the key prefix "
            f"{config.key_prefix!r}, on the connection replicas use) failed: "
            f"{type(exc).__name__}: {short_error(exc)}"
        )
    finally:
        if own:
            with contextlib.suppress(Exception):
                await conn.aclose()
    return None
