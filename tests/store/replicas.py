"""Several ``kvgate serve`` replicas on loopback in front of one ``kvgate sim``, and a load
driver, for the shared-store tests.

:func:`run_replicas` starts the simulator (``python -m kvgate sim``) and ``n`` gateways
(``python -m kvgate serve --config FILE``) as child processes, each in its own session (process
group), so a signal reaches a gateway's workers too. Every gateway gets the same configuration
(the caller's dict, written as YAML under a temporary directory) except ``listen.port``; a
backend without ``url`` is pointed at the simulator, and a configuration without ``backends``
gets one backend ``sim`` serving the simulator's model. The harness knows nothing of a shared
store: a ``store:`` key in the dict is written out like any other.

The simulator is the oracle: ``sim_state()["by_user"][tenant]`` is what the engine really ran
for the requests whose body ``user`` was ``tenant`` (running and in-flight peaks, requests,
tokens; see :mod:`kvgate.sim.server`), which :func:`drive` sets to the tenant's name.

Every wait is bounded; a gateway that exits while starting fails with its stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from tests.gateway.helpers import free_port

HOST = "127.0.0.1"
DEFAULT_SIM_ARGS: tuple[str, ...] = ("--profile", "tiny", "--speed", "20", "--seed", "1")


@dataclass(eq=False)
class Child:
    """A child process started in its own session, its stderr read as it comes.

    Attributes:
        proc: the process (its pid is also its process group id).
        stderr: what it wrote to stderr so far.
    """

    proc: asyncio.subprocess.Process
    stderr: bytearray = field(default_factory=bytearray)
    _drain: asyncio.Task[None] | None = None

    @classmethod
    async def spawn(cls, *args: str) -> Child:
        """``python -m kvgate ARGS`` (stdout discarded, ``PYTHONUNBUFFERED=1``)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvgate",
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        child = cls(proc)
        stream = proc.stderr
        proc.stderr = None  # wait() only waits for the exit

        async def drain() -> None:
            assert stream is not None
            while chunk := await stream.read(65536):
                child.stderr.extend(chunk)

        child._drain = asyncio.create_task(drain())
        return child

    @property
    def alive(self) -> bool:
        """True until the process has exited (a stopped one is alive)."""
        return self.proc.returncode is None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group (its workers included)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    async def end(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> bytes:
        """SIGKILL goes to the whole group; another ``sig`` to the process alone (a gateway's
        master forwards it to its workers), followed by SIGCONT to the group in case it is
        stopped. Waits up to ``timeout`` seconds for the exit, then SIGKILLs the group;
        returns the whole stderr."""
        if self.alive:
            if sig == signal.SIGKILL:
                self.signal_group(sig)
            else:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(sig)
                self.signal_group(signal.SIGCONT)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                self.signal_group(signal.SIGKILL)
                await asyncio.wait_for(self.proc.wait(), timeout)
        self.signal_group(signal.SIGKILL)  # workers left behind, if any
        if self._drain is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drain, timeout)
        return bytes(self.stderr)


async def wait_ready(child: Child, url: str, timeout: float = 30.0) -> None:
    """Poll ``GET url`` until it answers 200.

    Raises:
        RuntimeError: the child exited meanwhile (the message carries its stderr).
        TimeoutError: no 200 within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as s:
        while True:
            if not child.alive:
                raise RuntimeError(
                    f"{url}: the process exited with {child.proc.returncode}: "
                    f"{bytes(child.stderr[-4000:]).decode(errors='replace')}"
                )
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}: no 200 within {timeout} s")
            await asyncio.sleep(0.05)


@dataclass(eq=False)
class Replicas:
    """A simulator and ``n`` gateways started by :func:`run_replicas`.

    Attributes:
        root: the temporary directory with ``gateway-I.yaml``.
        sim_port: the simulator's port.
        model: the simulator's model name (``GET /v1/models``).
        context_window: its context window, tokens.
        ports: each gateway's port, by index (kept across :meth:`restart`).
        admin_key: sent as ``Authorization: Bearer`` by :meth:`admin_state` when set.
    """

    root: Path
    sim: Child
    sim_port: int
    model: str
    context_window: int
    config: dict[str, Any]
    ports: list[int] = field(default_factory=list)
    gateways: list[Child | None] = field(default_factory=list)
    admin_key: str | None = None
    ready_timeout: float = 30.0

    # ---- addresses ---------------------------------------------------------------------

    @property
    def sim_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the simulator."""
        return f"http://{HOST}:{self.sim_port}"

    def url(self, i: int) -> str:
        """``http://127.0.0.1:PORT`` of gateway ``i`` (no ``/v1``)."""
        return f"http://{HOST}:{self.ports[i]}"

    def base_url(self, i: int) -> str:
        """``url(i) + "/v1"``, what an OpenAI client's ``base_url`` wants."""
        return self.url(i) + "/v1"

    @property
    def urls(self) -> list[str]:
        """Every gateway's URL, by index."""
        return [self.url(i) for i in range(len(self.ports))]

    def config_path(self, i: int) -> Path:
        """The YAML file gateway ``i`` runs with."""
        return self.root / f"gateway-{i}.yaml"

    def stderr(self, i: int) -> bytes:
        """What gateway ``i`` (its current process) wrote to stderr so far."""
        child = self.gateways[i]
        return bytes(child.stderr) if child is not None else b""

    # ---- gateway life cycle --------------------------------------------------------------

    async def start(self, i: int) -> None:
        """Start gateway ``i`` with its configuration and wait for ``/healthz`` 200.

        Raises:
            RuntimeError: it exited while starting (with its stderr); already running.
            TimeoutError: not up within ``ready_timeout`` seconds.
        """
        old = self.gateways[i]
        if old is not None and old.alive:
            raise RuntimeError(f"gateway {i} is already running")
        for attempt in range(3):
            child = await Child.spawn("serve", "--config", str(self.config_path(i)))
            self.gateways[i] = child
            try:
                await wait_ready(child, self.url(i) + "/healthz", self.ready_timeout)
                return
            except RuntimeError as exc:
                # its port, free when drawn, was taken before the gateway bound it (another
                # test's server): a fresh one
                if "address already in use" not in str(exc) or attempt == 2:
                    raise
            self._new_port(i)

    def _new_port(self, i: int) -> None:
        """Gives gateway ``i`` a port no other gateway of these has, in its configuration."""
        port = free_port()
        while port in self.ports:
            port = free_port()
        self.ports[i] = port
        data = yaml.safe_load(self.config_path(i).read_text())
        data["listen"]["port"] = port
        self.config_path(i).write_text(yaml.safe_dump(data, sort_keys=False))

    async def kill9(self, i: int, timeout: float = 10.0) -> None:
        """SIGKILL gateway ``i`` (its workers too) and wait for the exit: nothing it held is
        released by it."""
        child = self._child(i)
        await child.end(signal.SIGKILL, timeout)

    def stop(self, i: int) -> None:
        """SIGSTOP gateway ``i``'s process group: it stays up, its connections hang, until
        :meth:`cont`."""
        self._child(i).signal_group(signal.SIGSTOP)

    def cont(self, i: int) -> None:
        """SIGCONT gateway ``i``'s process group after :meth:`stop`."""
        self._child(i).signal_group(signal.SIGCONT)

    async def terminate(self, i: int, timeout: float = 20.0) -> bytes:
        """Graceful stop of gateway ``i`` (SIGTERM, then SIGKILL after ``timeout`` seconds);
        returns its stderr."""
        return await self._child(i).end(signal.SIGTERM, timeout)

    async def restart(self, i: int) -> None:
        """Start gateway ``i`` again on the same port with the same file; one still running
        is stopped gracefully first (SIGTERM)."""
        child = self.gateways[i]
        if child is not None and child.alive:
            await child.end(signal.SIGTERM)
        await self.start(i)

    def _child(self, i: int) -> Child:
        child = self.gateways[i]
        if child is None:
            raise RuntimeError(f"gateway {i} was never started")
        return child

    # ---- what they say ---------------------------------------------------------------------

    async def metrics(self, i: int, timeout: float = 10.0) -> str:
        """Gateway ``i``'s ``GET /metrics`` text.

        Raises:
            AssertionError: not a 200.
        """
        return await _get_text(self.url(i) + "/metrics", timeout=timeout)

    async def admin_state(self, i: int, timeout: float = 10.0) -> dict[str, Any]:
        """Gateway ``i``'s ``GET /admin/state`` JSON (with the admin key when set).

        Raises:
            AssertionError: not a 200.
        """
        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else None
        text = await _get_text(self.url(i) + "/admin/state", headers=headers, timeout=timeout)
        return orjson.loads(text)  # type: ignore[no-any-return]

    async def sim_state(self, timeout: float = 10.0) -> dict[str, Any]:
        """The simulator's ``GET /sim/state`` (``by_user``: what the engine ran per tenant)."""
        return orjson.loads(await _get_text(self.sim_url + "/sim/state", timeout=timeout))  # type: ignore[no-any-return]

    async def reset_peaks(self, timeout: float = 10.0) -> dict[str, Any]:
        """``POST /sim/reset-peaks`` (every peak := its current value); the new state."""
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
            s.post(self.sim_url + "/sim/reset-peaks") as r,
        ):
            assert r.status == 200, f"/sim/reset-peaks answered {r.status}"
            return await r.json()  # type: ignore[no-any-return]


async def _get_text(url: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> str:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
        s.get(url, headers=headers) as r,
    ):
        text = await r.text()
        assert r.status == 200, f"GET {url} answered {r.status}: {text[:500]}"
        return text


def gateway_config(config: Mapping[str, Any], *, port: int, sim_url: str, model: str,
                   context_window: int) -> dict[str, Any]:  # fmt: skip
    """The caller's configuration for one gateway: ``listen`` on 127.0.0.1:``port``, every
    backend without ``url`` pointed at ``sim_url``, and without ``backends`` one backend
    ``sim`` serving ``model`` (64 slots, no token limits)."""
    data = copy.deepcopy(dict(config))
    data["listen"] = {**data.get("listen", {}), "host": HOST, "port": port}
    if "backends" not in data:
        data["backends"] = [
            {
                "name": "sim",
                "models": [{"name": model, "context_window": context_window}],
                "max_concurrency": 64,
            }
        ]
    for backend in data["backends"]:
        backend.setdefault("url", sim_url)
    return data


@contextlib.asynccontextmanager
async def run_replicas(
    config: Mapping[str, Any],
    n: int = 3,
    sim_args: Sequence[str] = DEFAULT_SIM_ARGS,
    *,
    root: Path | None = None,
    admin_key: str | None = None,
    ready_timeout: float = 30.0,
) -> AsyncIterator[Replicas]:
    """A simulator (``kvgate sim SIM_ARGS``) and ``n`` gateways on loopback for a block.

    Args:
        config: the gateway configuration (the YAML file's content as a dict); see the module
            docstring for what the harness fills in.
        n: gateways to start (≥ 1).
        sim_args: ``kvgate sim`` flags (``--port`` is added).
        root: where the YAML files go (default: a fresh temporary directory, removed after).
        admin_key: the admin key :meth:`Replicas.admin_state` sends.
        ready_timeout: seconds each process may take to answer 200.

    Every process still running at the end gets SIGCONT + SIGTERM, then SIGKILL after 20 s.

    Raises:
        RuntimeError: a process exited while starting (message with its stderr).
        TimeoutError: a process was not up within ``ready_timeout`` seconds.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    with contextlib.ExitStack() as files:
        if root is None:
            root = Path(files.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-replicas-")))
        sim_port = free_port()
        sim = await Child.spawn("sim", *sim_args, "--host", HOST, "--port", str(sim_port))
        replicas: Replicas | None = None
        try:
            sim_url = f"http://{HOST}:{sim_port}"
            await wait_ready(sim, sim_url + "/health", ready_timeout)
            models = orjson.loads(await _get_text(sim_url + "/v1/models"))["data"][0]
            replicas = Replicas(
                root=root,
                sim=sim,
                sim_port=sim_port,
                model=models["id"],
                context_window=int(models["max_model_len"]),
                config=dict(config),
                admin_key=admin_key,
                ready_timeout=ready_timeout,
            )
            for i in range(n):
                port = free_port()
                while port in replicas.ports:  # (two draws of one port: the second fails)
                    port = free_port()
                replicas.ports.append(port)
                replicas.gateways.append(None)
                data = gateway_config(
                    config,
                    port=port,
                    sim_url=sim_url,
                    model=replicas.model,
                    context_window=replicas.context_window,
                )
                replicas.config_path(i).write_text(yaml.safe_dump(data, sort_keys=False))
            await asyncio.gather(*(replicas.start(i) for i in range(n)))
            yield replicas
        finally:
            ends = [g.end() for g in (replicas.gateways if replicas else []) if g is not None]
            await asyncio.gather(*ends, return_exceptions=True)
            await sim.end()


# ---- load driver ---------------------------------------------------------------------------


@dataclass
class TenantLoad:
    """What :func:`drive` saw for one tenant.

    Attributes:
        counts: answers by kind: ``"200"`` (a stream that ended with ``data: [DONE]``),
            ``"429"``, ``"503"``, ``"other"`` (any other status, a stream cut before
            ``[DONE]`` or carrying an error event, or no HTTP answer at all).
        other: why each ``"other"`` happened (``"status 500"``, ``"stream cut"``,
            ``"ClientConnectorError"``, ...), counted.
        latencies: seconds from sending to the end of the stream, of each ``"200"``.
        ttfts: seconds from sending to the first body bytes, of each ``"200"``.
        prompt_tokens / completion_tokens: the ``usage`` the streams reported, summed.
        retry_after: the ``Retry-After`` values (seconds) of the 429 and 503 answers.
    """

    counts: Counter[str] = field(default_factory=Counter)
    other: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    retry_after: list[float] = field(default_factory=list)

    @property
    def sent(self) -> int:
        """Requests sent."""
        return sum(self.counts.values())


async def drive(
    urls: Sequence[str],
    tenants: Mapping[str, str | None],
    duration_s: float,
    concurrency: int | Mapping[str, int],
    *,
    model: str = "kvgate-sim-tiny",
    max_tokens: int = 16,
    prompt: str = "Tell me about admission control.",
    extra_body: Mapping[str, Any] | None = None,
    request_timeout_s: float = 60.0,
    refusal_pause_s: float = 0.05,
) -> dict[str, TenantLoad]:
    """Streaming chat load over several gateways for ``duration_s`` seconds.

    Each tenant runs ``concurrency`` workers (an int: the same for every tenant; a mapping:
    per tenant). A worker sends one request at a time, back to back, each to the next gateway
    of ``urls`` (one round-robin shared by all workers), until ``duration_s`` has passed; the
    requests under way then finish (each bounded by ``request_timeout_s``). A request is
    ``POST {url}/v1/chat/completions`` with ``stream: true``,
    ``stream_options.include_usage``, ``max_tokens``, body ``user`` = the tenant's name (the
    simulator's per-user key) and ``Authorization: Bearer KEY`` when the tenant's key is not
    ``None``; ``extra_body`` is merged into the body. After an answer other than 200 the worker
    pauses ``refusal_pause_s`` seconds (a refusal is fast; without it a worker would spin).

    Args:
        urls: gateway URLs (``http://host:port``, no ``/v1``).
        tenants: ``{tenant name: API key or None}``.

    Returns:
        ``{tenant name: TenantLoad}``.

    Raises:
        ValueError: no URL, no tenant, or a concurrency below 1.
    """
    if not urls or not tenants:
        raise ValueError("drive needs at least one URL and one tenant")
    per = {t: concurrency if isinstance(concurrency, int) else concurrency[t] for t in tenants}
    if min(per.values()) < 1:
        raise ValueError(f"concurrency must be at least 1 per tenant, got {per}")
    results = {t: TenantLoad() for t in tenants}
    next_url = itertools.cycle(urls)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + duration_s
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)

    async def one(session: aiohttp.ClientSession, tenant: str, key: str | None) -> bool:
        """One request; True when it was a 200."""
        out = results[tenant]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": tenant,
            **(extra_body or {}),
        }
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        started = loop.time()
        try:
            async with session.post(
                next(next_url) + "/v1/chat/completions", data=orjson.dumps(body), headers=headers
            ) as r:
                if r.status != 200:
                    await r.read()
                    kind = str(r.status) if r.status in (429, 503) else "other"
                    out.counts[kind] += 1
                    if kind == "other":
                        out.other[f"status {r.status}"] += 1
                    elif "Retry-After" in r.headers:
                        with contextlib.suppress(ValueError):
                            out.retry_after.append(float(r.headers["Retry-After"]))
                    return False
                ttft: float | None = None
                done = False
                failed = False
                usage: dict[str, Any] | None = None
                async for line in r.content:
                    if ttft is None:
                        ttft = loop.time() - started
                    if line.startswith(b"data: [DONE]"):
                        done = True
                    elif line.startswith(b"data: {"):
                        if b'"error"' in line[:20]:
                            failed = True
                        elif b'"usage"' in line and b'"usage":null' not in line:
                            usage = orjson.loads(line[6:]).get("usage") or usage
                if not done or failed:
                    out.counts["other"] += 1
                    out.other["error event" if failed else "stream cut"] += 1
                    return False
                out.counts["200"] += 1
                out.latencies.append(loop.time() - started)
                out.ttfts.append(ttft if ttft is not None else loop.time() - started)
                if usage:
                    out.prompt_tokens += int(usage.get("prompt_tokens") or 0)
                    out.completion_tokens += int(usage.get("completion_tokens") or 0)
                return True
        except (aiohttp.ClientError, TimeoutError) as exc:
            out.counts["other"] += 1
            out.other[type(exc).__name__] += 1
            return False

    async def worker(session: aiohttp.ClientSession, tenant: str, key: str | None) -> None:
        while loop.time() < deadline:
            if not await one(session, tenant, key):
                await asyncio.sleep(refusal_pause_s)

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(
            *(
                worker(session, tenant, key)
                for tenant, key in tenants.items()
                for _ in range(per[tenant])
            )
        )
    return results
