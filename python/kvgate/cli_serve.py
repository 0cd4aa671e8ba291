"""``kvgate serve``: run the admission gateway (one process, or N workers on one port).

With ``--workers N`` (N > 1) the master process creates the admission state in a named shared
memory region, then starts N worker processes that attach to it and listen on the same port with
``SO_REUSEPORT``; the limits hold for the whole gateway, not per process. The master restarts a
worker that dies and reclaims the slots and in-flight tokens it held (``reclaim_dead``); the
workers get SIGTERM when the master dies (``PR_SET_PDEATHSIG``), and a master removes the
regions and metric folders that dead masters left (:func:`remove_stale_state`).
SIGTERM / SIGINT: stop accepting, let streams finish for ``--grace`` seconds, then close them
(every path releases its reservation).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvgate.config import DEFAULT_SLOTS

__all__ = ["add_arguments", "discover_unset_slots", "remove_stale_state", "run"]

logger = logging.getLogger("kvgate.serve")


#: The quick-start flags: they describe the one backend of ``--upstream`` and mean nothing with
#: ``--config`` (the file describes the backends), so using them there is refused.
QUICK_START = (
    "model",
    "max_concurrency",
    "tpm",
    "inflight_tokens",
    "tokenizer",
    "context_window",
    "no_adaptive",
    "max_wait",
)
#: Fallbacks when the engine does not state its own batch limit / for the TPM bucket; the quick
#: start's queue wait (seconds) for a request the limits refuse.
QUICK_DEFAULTS = {"max_concurrency": DEFAULT_SLOTS, "tpm": 1_000_000, "max_wait": 30.0}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: ``serve --config`` asks the engines of backends without ``max_concurrency`` for their batch
#: limit for at most this long in all (seconds), with at most this many requests at once.
DISCOVERY_SECONDS = 5.0
DISCOVERY_THREADS = 32
#: The quick start asks its one engine for at most this long in all (seconds; 5 s a request).
QUICK_DISCOVERY_SECONDS = 15.0


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``lo..=hi`` (argparse reports the flag and the value)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}, got {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds ≥ 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number ≥ 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvgate serve``."""
    from kvgate._core import MAX_AMOUNT
    from kvgate.config import MAX_WORKERS

    parser.description = (
        "Run the admission gateway from a configuration file (--config) or, for a quick start, "
        "in front of one engine (--upstream with the quick-start flags). SIGTERM / SIGINT: "
        "stop accepting, let streams finish for --grace seconds. SIGHUP: reload --config "
        "(limits, tenants, keys; an invalid file is refused and the running one stays)."
    )
    amount = _int_in(1, MAX_AMOUNT)
    a = parser.add_argument
    a("--config", metavar="FILE", help="YAML configuration file (see examples/kvgate.yaml)")
    a("--upstream", metavar="URL", help="quick start without a file: one backend at URL")
    a("--host", default=None, help="listen address (overrides the file; default 127.0.0.1)")
    a(
        "--port",
        type=_int_in(0, 65535),
        default=None,
        help="listen port (overrides the file; default 8080; 0 = any free port, one worker only)",
    )
    a(
        "--workers",
        type=_int_in(1, MAX_WORKERS),
        default=None,
        help=f"worker processes sharing the limits and the engine polls, 1..{MAX_WORKERS} "
        "(overrides the file; default 1)",
    )
    quick = parser.add_argument_group("quick start (with --upstream only)")
    q = quick.add_argument
    q(
        "--model",
        action="append",
        default=None,
        help="model name served by --upstream (repeatable; default: ask GET /v1/models)",
    )
    q(
        "--max-concurrency",
        type=amount,
        default=None,
        help="backend concurrency limit in slots (default: the engine's own batch limit, e.g. "
        f"llama.cpp total_slots; else {QUICK_DEFAULTS['max_concurrency']})",
    )
    q(
        "--tpm",
        type=amount,
        default=None,
        help=f"backend tokens-per-minute limit (default {QUICK_DEFAULTS['tpm']:,})",
    )
    q(
        "--inflight-tokens",
        type=amount,
        default=None,
        help="backend in-flight token budget (default: from the engine's KV capacity, else none)",
    )
    q("--tokenizer", metavar="PATH", help="tokenizer.json for exact prompt counts")
    q(
        "--context-window",
        type=amount,
        default=None,
        help="model context window in tokens (default: what the engine states, e.g. "
        "max_model_len of GET /v1/models; else 8192)",
    )
    q(
        "--max-wait",
        type=_seconds,
        default=None,
        help="seconds a request the limits refuse may wait in the priority queue "
        f"(default {QUICK_DEFAULTS['max_wait']:g}; 0 = refuse at once)",
    )
    q("--no-adaptive", action="store_true", default=None, help="do not adapt limits from /metrics")
    a(
        "--tls-certificate",
        metavar="PATH",
        help="serve HTTPS with this PEM certificate chain (with --tls-key; overrides the file's "
        "listen.tls)",
    )
    a(
        "--tls-key",
        metavar="PATH",
        help="the certificate's unencrypted PEM private key (with --tls-certificate; overrides "
        "the file's listen.tls)",
    )
    a(
        "--max-body-bytes",
        type=amount,
        default=None,
        help="request body cap in bytes (overrides the file; default 10 MiB)",
    )
    a(
        "--grace",
        type=_seconds,
        default=30.0,
        help="seconds streams may finish after SIGTERM (default 30)",
    )
    a(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="INFO",
        help="logging level (default INFO)",
    )
    a(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="log lines as text for humans (default) or one JSON object per line (time, level, "
        "logger, message); the access log is JSON either way",
    )
    a(
        "--no-access-log",
        action="store_true",
        help="no access log line per request (overrides the file's access_log)",
    )


class _BadHttpToDebug(logging.Filter):
    """aiohttp logs every malformed request (bad Content-Length, CR/LF in a header, too many
    headers: all refused with 400) at ERROR with a traceback, so anyone can flood the log. They
    are client errors, not ours: demote them to DEBUG, as aiohttp already does for a bad method."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError
        from aiohttp.web_protocol import RequestPayloadError

        exc = record.exc_info[1] if record.exc_info else None
        # RequestPayloadError: an undecodable Content-Encoding or broken chunking, already
        # answered 400 by the handler, raised again when aiohttp drains the body afterwards
        if isinstance(exc, (HttpProcessingError, RequestPayloadError)):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def run(args: argparse.Namespace) -> int:
    """Load or build the configuration and serve until SIGTERM/SIGINT. Returns the exit code."""
    from kvgate.accesslog import configure_access_log, configure_logging
    from kvgate.app import collector_paused
    from kvgate.config import ConfigError, load_config

    logging.getLogger("aiohttp.server").addFilter(_BadHttpToDebug())
    configure_logging(args.log_level, args.log_format)
    if args.config and args.upstream:
        print("kvgate serve: give --config FILE or --upstream URL, not both", file=sys.stderr)
        return 2
    if args.config:
        given = [f"--{n.replace('_', '-')}" for n in QUICK_START if getattr(args, n) is not None]
        if given:
            print(
                f"kvgate serve: {', '.join(given)} only apply with --upstream (the file "
                "describes the backends)",
                file=sys.stderr,
            )
            return 2
    discovery: dict[str, Any] = {}
    try:
        if args.config:
            with collector_paused():
                config = load_config(args.config)
        elif args.upstream:
            config, discovery = _config_from_flags(args)
        else:
            print("kvgate serve: give --config FILE or --upstream URL", file=sys.stderr)
            return 2
        config = _apply_overrides(config, args)
    except ConfigError as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 2
    try:
        enabled = config.access_log.enabled and not args.no_access_log
        configure_access_log(enabled, config.access_log.path)
    except OSError as exc:
        print(f"kvgate serve: cannot open the access log: {exc}", file=sys.stderr)
        return 2
    if config.workers > 1 and config.listen.port == 0:
        print(
            f"kvgate serve: {config.workers} workers need a fixed port (port 0 would give each "
            "worker its own)",
            file=sys.stderr,
        )
        return 2

    def overrides(reloaded: Any) -> Any:  # the flags win over a reloaded file too
        return _apply_overrides(reloaded, args)

    if config.workers <= 1:
        # (with workers, the master asks once its metrics folder is set: see _serve_workers)
        discovery.update(discover_unset_slots(config))
        return _serve_single(
            config, args.grace, config_path=args.config, overrides=overrides, discovery=discovery
        )
    return _serve_workers(
        config, args.grace, config_path=args.config, overrides=overrides, discovery=discovery
    )


def _apply_overrides(config: Any, args: argparse.Namespace) -> Any:
    """Command-line flags win over the file: listen address and TLS files (relative to the
    working directory), workers, body cap. The result is validated again like a file.

    Raises:
        kvgate.config.ConfigError: an override the configuration's rules refuse.
    """
    from pydantic import ValidationError

    from kvgate.config import Config, ConfigError, issues_from

    update: dict[str, Any] = {}
    listen: dict[str, Any] = {
        k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None
    }
    tls = {
        k: v
        for k, v in (("certificate", args.tls_certificate), ("key", args.tls_key))
        if v is not None
    }
    if tls:  # relative paths are relative to the working directory
        current = config.listen.tls.model_dump() if config.listen.tls is not None else {}
        listen["tls"] = {**current, **tls}
    if listen:
        update["listen"] = {**config.listen.model_dump(), **listen}
    if args.workers is not None:
        update["workers"] = args.workers
    if args.max_body_bytes is not None:
        update["max_body_bytes"] = args.max_body_bytes
    if not update:
        return config
    try:
        return Config.model_validate({**config.model_dump(), **update})
    except ValidationError as exc:
        raise ConfigError(issues_from(exc), "from the command line") from None


def discover_unset_slots(config: Any) -> dict[str, Any]:
    """What the engines of the backends without ``max_concurrency`` say about themselves:
    backend name → :class:`~kvgate.telemetry.discovery.EngineInfo`, whose ``slots`` (the
    engine's own batch limit) becomes the backend's slot limit
    (:func:`kvgate.gateway_build.slot_limit`). Backends with a configured ``max_concurrency``
    are not asked. The engines are asked at once (up to :data:`DISCOVERY_THREADS` at a time),
    2 s per request and :data:`DISCOVERY_SECONDS` for all of them together, so engines that
    hang or answer slowly delay the start by that much at most, however many. One that cannot
    be asked in that time (``GET /v1/models`` fails: unreachable, an error status, a redirect,
    no answer) is left out with one warning line: its slot limit is
    :data:`~kvgate.config.DEFAULT_SLOTS` until a poll reports the engine's slots. Raises
    nothing."""
    unset = [b for b in config.backends if b.max_concurrency is None]
    if not unset:
        return {}
    from concurrent.futures import ThreadPoolExecutor

    from kvgate.telemetry.discovery import DiscoveryError, discover_engine

    deadline = time.monotonic() + DISCOVERY_SECONDS

    def ask(b: Any) -> tuple[str, Any]:
        try:
            info = discover_engine(
                b.url,
                metrics_url=b.effective_metrics_url,
                timeout=2.0,
                api_key=b.api_key,
                deadline=deadline,
            )
        except (DiscoveryError, OSError) as exc:
            logger.warning(
                "backend %s: cannot ask the engine for its batch limit (%s); slot limit %d "
                "until it states one",
                b.name,
                exc,
                DEFAULT_SLOTS,
            )
            return b.name, None
        if info.slots:
            logger.info(
                "backend %s: slot limit from the engine's batch limit, %d (%s)",
                b.name,
                info.slots,
                info.sources.get("slots", "stated"),
            )
        else:
            logger.info(
                "backend %s: the engine (%s) states no batch limit; slot limit %d",
                b.name,
                info.engine or "unknown",
                DEFAULT_SLOTS,
            )
        return b.name, info

    with ThreadPoolExecutor(max_workers=min(DISCOVERY_THREADS, len(unset))) as pool:
        answers = list(pool.map(ask, unset))
    return {name: info for name, info in answers if info is not None}


def _config_from_flags(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """A one-backend configuration from quick-start flags, and what the engine said about
    itself (``{"default": EngineInfo}``, :func:`kvgate.telemetry.discovery.discover_engine`).

    Every value a flag does not give comes from the engine: models (``GET /v1/models``), each
    model's context window, the concurrency limit (the engine's own batch limit), the engine
    type, and, with ``--tokenizer``, the chat template the engine renders (llama.cpp), asked
    for :data:`QUICK_DISCOVERY_SECONDS` at most (an engine that never finishes its answers
    counts as unreachable). The implicit ``anonymous`` tenant may wait ``--max-wait`` seconds
    (default 30) in the priority queue, so a burst larger than the engine's slots waits
    instead of being refused. What was discovered is printed, one line per fact with its
    source.

    Raises:
        kvgate.config.ConfigError: the engine lists no models (or cannot be reached and no
            ``--model`` is given).
    """
    from kvgate.config import ConfigError, parse_config
    from kvgate.telemetry.discovery import DiscoveryError, EngineInfo, discover_engine

    url = args.upstream.rstrip("/")
    try:
        info = discover_engine(url, deadline=time.monotonic() + QUICK_DISCOVERY_SECONDS)
    except DiscoveryError as exc:
        if not args.model:
            raise ConfigError([("", str(exc))]) from None
        logger.warning("%s; serving --model %s as given", exc, ", ".join(args.model))
        info = EngineInfo(url=url)
    found = {m.name: m for m in info.models}
    names = args.model or list(found)
    if not names:
        raise ConfigError([("", f"upstream {url} lists no models (GET /v1/models); pass --model")])
    models = []
    for name in names:
        m = found.get(name)
        model: dict[str, Any] = {
            "name": name,
            "tokenizer": args.tokenizer,
            "context_window": args.context_window
            or (m.context_window if m is not None else None)
            or 8192,
        }
        if args.tokenizer and info.chat_template:
            model["chat_template"] = info.chat_template
        models.append(model)
    backend: dict[str, Any] = {
        "name": "default",
        "url": url,
        "engine": info.engine or "auto",
        "models": models,
        "max_concurrency": args.max_concurrency or info.slots or QUICK_DEFAULTS["max_concurrency"],
        "tokens_per_minute": args.tpm or QUICK_DEFAULTS["tpm"],
        "adaptive": {"enabled": not args.no_adaptive},
    }
    if args.inflight_tokens is not None:
        backend["inflight_token_limit"] = args.inflight_tokens
    max_wait = QUICK_DEFAULTS["max_wait"] if args.max_wait is None else args.max_wait
    data: dict[str, Any] = {"backends": [backend]}
    if max_wait > 0:
        # one implicit tenant, as without tenants, but allowed to wait in the queue
        data["tenants"] = [{"name": "anonymous", "max_wait_ms": round(max_wait * 1000)}]
        data["anonymous_tenant"] = "anonymous"
    config = parse_config(data, base_dir=os.getcwd(), source="from the command line")
    _print_discovery(info, config.backends[0], args)
    return config, {"default": info}


def _print_discovery(info: Any, backend: Any, args: argparse.Namespace) -> None:
    """What the quick start found out and the limits it derived (stdout, one fact a line)."""
    lines = [f"kvgate: backend {backend.name} at {info.url}"]
    lines += ["  " + line for line in info.describe().splitlines()]
    slots_from = (
        "--max-concurrency"
        if args.max_concurrency
        else ("the engine's slots" if info.slots else "default")
    )
    lines.append(f"  -> max_concurrency {backend.max_concurrency} ({slots_from})")
    if backend.inflight_token_limit is not None:
        lines.append(f"  -> in-flight tokens {backend.inflight_token_limit} (--inflight-tokens)")
    elif info.kv_capacity_tokens:
        budget = max(1, int(info.kv_capacity_tokens * backend.capacity_safety_factor))
        lines.append(
            f"  -> in-flight tokens {budget} (KV capacity × {backend.capacity_safety_factor:g})"
        )
    for m in backend.models:
        lines.append(f"  -> model {m.name}: context window {m.context_window} tokens")
    print("\n".join(lines), flush=True)


_STALE_SHM = re.compile(r"^kvgate-(\d+)-\d+$")
_STALE_PROM = re.compile(r"^kvgate-prom-(\d+)-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_state(shm_dir: str = "/dev/shm", tmp_dir: str | None = None) -> list[str]:
    """Removes what masters of ``--workers N`` that died without cleaning up (SIGKILL, the OOM
    killer) left behind: their shared-memory regions (``/dev/shm/kvgate-<pid>-<time>``, sized
    from the configuration: under 1 MB for a few tenants, 45 MB for 100,000) and metric folders (``<tmp>/kvgate-prom-<pid>-*``), chosen by name and only when that
    pid is not alive. Returns the paths removed; errors (a race with another master, no
    permission) are skipped."""
    removed = []
    tmp_dir = tmp_dir if tmp_dir is not None else tempfile.gettempdir()
    for folder, pattern in ((shm_dir, _STALE_SHM), (tmp_dir, _STALE_PROM)):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            m = pattern.match(name)
            if m is None or _alive(int(m[1])):
                continue
            path = os.path.join(folder, name)
            try:
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except OSError:
                continue
            removed.append(path)
    return removed


def _die_with(master: int) -> None:
    """In a worker: have the kernel send it SIGTERM when the master dies (Linux
    ``PR_SET_PDEATHSIG``), so a master killed with SIGKILL leaves no orphan workers holding the
    port; they drain like on a SIGTERM. Elsewhere, or if the call fails, nothing."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != master:  # the master died before the call
        os.kill(os.getpid(), signal.SIGTERM)


def _port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (in use, no permission, no such address), by a
    trial bind without ``SO_REUSEPORT``, so that a port held by any other socket (another
    gateway's workers included) is seen; ``None`` when it is free."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        return f"cannot listen on {host}:{port}: {exc}"
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(addr)
            except OSError as exc:
                return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


#: the cyclic collector's thresholds while serving (``gc.set_threshold``): a young collection
#: every 10,000 net allocations of container objects instead of Python's 700. A request's objects
#: live as long as it waits on the engine or on Redis (milliseconds); at 700, collections come so
#: often that those of the requests in flight survive two of them and reach the oldest
#: generation, where they set off full collections that walk every object still there — with a
#: Redis store, the state of every tenant seen so far. Measured with 100,000 tenants on Redis
#: (``make bench-gc``), the collector's time per request fell from 143 to 15 µs and the p99
#: latency from 181 to 32 ms; garbage in reference cycles waits at most 10,000 allocations.
YOUNG_COLLECTION = (10_000, 10, 10)


def _install_uvloop() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover - uvloop is a dependency
        pass


def _serve_single(
    config: Any,
    grace: float,
    *,
    config_path: str | None,
    overrides: Callable[[Any], Any] | None = None,
    shm_name: str | None = None,
    worker: int = 0,
    workers: int = 1,
    discovery: dict[str, Any] | None = None,
) -> int:
    from kvgate import CoreError
    from kvgate.app import collector_paused
    from kvgate.gateway_build import build_gateway
    from kvgate.server import serve_forever
    from kvgate.tls import server_context

    _install_uvloop()
    # each worker polls its share of the engines and follows the others' polls through the
    # shared region; its routing (health) is its own, while the scale and shedding it derives
    # land in the shared region (the same readings give the same law output)
    try:
        with collector_paused():
            gateway = build_gateway(
                config, shm_name=shm_name, config_path=config_path, poll=True, discovery=discovery
            )
        gateway.config_overrides = overrides
        gateway.worker, gateway.workers = worker, workers
        tls = config.listen.tls
        ssl_context = None if tls is None else server_context(tls.certificate, tls.key)
    except (CoreError, ValueError, OSError) as exc:
        print(f"kvgate serve: cannot start: {exc}", file=sys.stderr)
        return 2

    # what start-up built (config, tokenizers, metrics, imported modules) lives as long as the
    # process: out of the collector's reach, so collections only scan per-request objects
    gc.freeze()
    gc.set_threshold(*YOUNG_COLLECTION)

    def announce(url: str) -> None:
        if shm_name is None:  # one process; with workers the master announces
            print(f"kvgate: serving on {url}", flush=True)

    try:
        asyncio.run(
            serve_forever(
                gateway,
                host=config.listen.host,
                port=config.listen.port,
                reuse_port=shm_name is not None,
                shutdown_timeout=grace,
                on_ready=announce,
                ssl_context=ssl_context,
            )
        )
    except OSError as exc:  # the listening socket: address in use, no permission
        print(
            f"kvgate serve: cannot listen on {config.listen.host}:{config.listen.port}: {exc}",
            file=sys.stderr,
        )
        return 2
    return 0


def _serve_workers(
    config: Any,
    grace: float,
    *,
    config_path: str | None,
    overrides: Callable[[Any], Any] | None = None,
    discovery: dict[str, Any] | None = None,
) -> int:
    # prometheus_client picks its multiprocess value class when first imported: set the
    # directory before anything imports it, so every worker's counters land in shared files
    for stale in remove_stale_state():
        logger.warning("removed %s, left by a kvgate master that died without cleaning up", stale)
    master = os.getpid()
    shm_name = f"kvgate-{master}-{int(time.time())}"
    prom_dir = tempfile.mkdtemp(prefix=f"kvgate-prom-{master}-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = prom_dir
    import prometheus_client.values
    from prometheus_client import multiprocess

    # and if something imported it already (the quick start's discovery reads the engine's
    # metrics with its parser), choose again: metrics made from now on take this class
    prometheus_client.values.ValueClass = prometheus_client.values.get_value_class()

    from kvgate import CoreError
    from kvgate.gateway_build import build_controller, check_startup

    # asked here, not before: discovery imports prometheus_client (its metrics parser), which
    # must first see the metrics folder set above
    discovery = {**discover_unset_slots(config), **(discovery or {})}

    # what each worker would refuse (limits, tokenizers, templates), found once here instead of
    # by every worker; and the port: the workers share it with SO_REUSEPORT, which would also
    # let them join another gateway's workers on it, so it must be free first
    problem = check_startup(config) or _port_in_use(config.listen.host, config.listen.port)
    if problem is not None:
        print(f"kvgate serve: cannot start: {problem}", file=sys.stderr)
        shutil.rmtree(prom_dir, ignore_errors=True)
        return 2
    try:
        controller = build_controller(config, shm_name=shm_name, create=True, discovery=discovery)
    except (CoreError, ValueError, OSError) as exc:
        print(f"kvgate serve: cannot start: {exc}", file=sys.stderr)
        shutil.rmtree(prom_dir, ignore_errors=True)
        return 2
    children: dict[int, int] = {}
    started: dict[int, float] = {}  # worker index -> when it was last spawned (monotonic)
    # how many run: a reload that changes `workers` applies at the next start, so a worker
    # restarted after it (given the reloaded file) must not take that number for the count
    count = config.workers
    stopping = False

    def spawn(index: int) -> None:
        pid = os.fork()
        if pid == 0:  # worker
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            _die_with(master)
            try:
                code = _serve_single(
                    config,
                    grace,
                    config_path=config_path,
                    overrides=overrides,
                    shm_name=shm_name,
                    worker=index,
                    workers=count,
                    discovery=discovery,
                )
            except BaseException:
                logger.exception("worker %d crashed", index)
                code = 1
            from kvgate.accesslog import flush_access_log

            flush_access_log()  # os._exit runs no exit handlers
            os._exit(code)
        children[pid] = index
        started[index] = time.monotonic()

    forwarded: set[int] = set()

    def forward(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        if signum in forwarded:
            # a repeated SIGTERM would raise GracefulExit inside the workers' drain and cut
            # the streams it is letting finish; SIGKILL is the way to force a stop
            return
        forwarded.add(signum)
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def forward_reload(signum: int, _frame: Any) -> None:
        # the master re-reads the file too, so a worker it restarts later starts from the
        # configuration the others reloaded, not the one read at start-up
        nonlocal config
        if config_path is not None:
            from kvgate.config import load_config

            try:
                reloaded = load_config(config_path)
                config = overrides(reloaded) if overrides is not None else reloaded
            except Exception as exc:
                logger.error(
                    "reload of %s refused; restarted workers keep the previous configuration: %s",
                    config_path,
                    exc,
                )
        for pid in list(children):  # each worker reloads its configuration
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGHUP, forward_reload)
    for i in range(count):
        spawn(i)
    scheme = "http" if config.listen.tls is None else "https"
    print(
        f"kvgate: {config.workers} workers serving on "
        f"{scheme}://{config.listen.host}:{config.listen.port}",
        flush=True,
    )
    code = 0
    while children:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        index = children.pop(pid, None)
        if index is None:
            continue
        # its live-summed gauges (kvgate_queue_depth) must stop counting
        multiprocess.mark_process_dead(pid)
        reclaimed = controller.reclaim_dead()
        exit_code = os.waitstatus_to_exitcode(status)
        if not stopping and exit_code == 2:
            # 2 = could not start (its configuration, its socket): a restart would fail the
            # same way, forever; stop the whole gateway instead
            logger.error("worker %d (pid %d) could not start; stopping kvgate", index, pid)
            code = 2
            forward(signal.SIGTERM, None)
            continue
        if not stopping:
            logger.warning(
                "worker %d (pid %d) died with status %d; reclaimed %d held units; restarting",
                index,
                pid,
                status,
                reclaimed,
            )
            # a worker that dies as soon as it starts is restarted at most once a second
            time.sleep(max(0.0, started.get(index, 0.0) + 1.0 - time.monotonic()))
            if not stopping:
                spawn(index)
        elif exit_code not in (0, 2, -signal.SIGTERM, -signal.SIGINT):
            code = max(code, 1)
    del controller
    shutil.rmtree(prom_dir, ignore_errors=True)
    return code
