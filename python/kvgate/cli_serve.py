"""``kvgate serve``: run the admission gateway (one process, or N workers on one port).

With ``--workers N`` (N > 1) the master process creates the admission state in a named shared
memory region, then starts N worker processes that attach to it and listen on the same port with
``SO_REUSEPORT``; the limits hold for the whole gateway, not per process. The master restarts a
worker that dies and reclaims the slots and in-flight tokens it held (``reclaim_dead``).
SIGTERM / SIGINT: stop accepting, let streams finish for ``--grace`` seconds, then close them
(every path releases its reservation).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

__all__ = ["add_arguments", "run"]

logger = logging.getLogger("kvgate.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvgate serve``."""
    a = parser.add_argument
    a("--config", metavar="FILE", help="YAML configuration file (see examples/kvgate.yaml)")
    a("--upstream", metavar="URL", help="quick start without a file: one backend at URL")
    a("--host", default=None, help="listen address (default 127.0.0.1)")
    a("--port", type=int, default=None, help="listen port (default 8080)")
    a("--workers", type=int, default=None, help="worker processes sharing the limits (default 1)")
    a(
        "--model",
        action="append",
        default=None,
        help="model name served by --upstream (repeatable; default: ask GET /v1/models)",
    )
    a("--max-concurrency", type=int, default=64, help="backend concurrency limit (slots)")
    a("--tpm", type=int, default=1_000_000, help="backend tokens-per-minute limit")
    a(
        "--inflight-tokens",
        type=int,
        default=None,
        help="backend in-flight token budget (default: from the engine's KV capacity, else none)",
    )
    a("--tokenizer", metavar="PATH", help="tokenizer.json for exact prompt counts")
    a(
        "--context-window",
        type=int,
        default=None,
        help="model context window in tokens (default: max_model_len from GET /v1/models, else 8192)",
    )
    a("--max-body-bytes", type=int, default=None, help="request body cap in bytes")
    a("--no-adaptive", action="store_true", help="quick start: do not adapt limits from /metrics")
    a("--grace", type=float, default=30.0, help="seconds streams may finish after SIGTERM")
    a("--log-level", default="INFO", help="logging level")


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
    from kvgate.config import ConfigError, load_config

    logging.getLogger("aiohttp.server").addFilter(_BadHttpToDebug())
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.config:
            config = load_config(args.config)
        elif args.upstream:
            config = _config_from_flags(args)
        else:
            print("kvgate serve: give --config FILE or --upstream URL", file=sys.stderr)
            return 2
    except ConfigError as exc:
        print(f"kvgate serve: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    config = _apply_overrides(config, args)

    def overrides(reloaded: Any) -> Any:  # the flags win over a reloaded file too
        return _apply_overrides(reloaded, args)

    if config.workers <= 1:
        return _serve_single(config, args.grace, config_path=args.config, overrides=overrides)
    return _serve_workers(config, args.grace, config_path=args.config, overrides=overrides)


def _apply_overrides(config: Any, args: argparse.Namespace) -> Any:
    """Command-line flags win over the file: listen address, workers, body cap."""
    update: dict[str, Any] = {}
    listen = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if listen:
        update["listen"] = config.listen.model_copy(update=listen)
    if args.workers is not None:
        update["workers"] = args.workers
    if args.max_body_bytes is not None:
        update["max_body_bytes"] = args.max_body_bytes
    return config.model_copy(update=update) if update else config


def _config_from_flags(args: argparse.Namespace) -> Any:
    """A one-backend configuration from quick-start flags; models discovered from the
    upstream's ``GET /v1/models`` unless ``--model`` is given."""
    from kvgate.config import ConfigError, parse_config

    url = args.upstream.rstrip("/")
    discovered = {} if args.model else _discover_models(url)
    names = args.model or list(discovered)
    if not names:
        raise ConfigError([("", f"upstream {url} lists no models (GET /v1/models); pass --model")])
    models = [
        {
            "name": name,
            "tokenizer": args.tokenizer,
            "context_window": args.context_window or discovered.get(name) or 8192,
        }
        for name in names
    ]
    backend: dict[str, Any] = {
        "name": "default",
        "url": url,
        "models": models,
        "max_concurrency": args.max_concurrency,
        "tokens_per_minute": args.tpm,
        "adaptive": {"enabled": not args.no_adaptive},
    }
    if args.inflight_tokens is not None:
        backend["inflight_token_limit"] = args.inflight_tokens
    # no tenants declared: every request runs as one implicit `anonymous` standard tenant
    return parse_config({"backends": [backend]}, base_dir=os.getcwd(), source="command line")


def _discover_models(url: str) -> dict[str, int | None]:
    """``{model id: max_model_len or None}`` from ``GET {url}/v1/models`` (5 s timeout)."""
    import urllib.request

    import orjson

    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
            data = orjson.loads(resp.read())
    except (OSError, ValueError) as exc:
        from kvgate.config import ConfigError

        raise ConfigError([("", f"cannot list models at {url}/v1/models: {exc}")]) from None
    out: dict[str, int | None] = {}
    for item in data.get("data", []):
        if isinstance(item, dict) and isinstance(item.get("id"), str):
            mml = item.get("max_model_len")
            out[item["id"]] = mml if isinstance(mml, int) and mml > 0 else None
    return out


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
) -> int:
    from kvgate import CoreError
    from kvgate.gateway_build import build_gateway
    from kvgate.server import serve_forever

    _install_uvloop()
    # every worker polls the engines itself: its routing (health) is local, while the scale and
    # shedding it derives land in the shared region (the same readings give the same law output)
    try:
        gateway = build_gateway(config, shm_name=shm_name, config_path=config_path, poll=True)
        gateway.config_overrides = overrides
    except (CoreError, ValueError, OSError) as exc:
        print(f"kvgate serve: cannot start: {exc}", file=sys.stderr)
        return 2

    # what start-up built (config, tokenizers, metrics, imported modules) lives as long as the
    # process: out of the collector's reach, so collections only scan per-request objects
    gc.freeze()

    def announce(_url: str) -> None:
        if not worker:
            print(
                f"kvgate: serving on http://{config.listen.host}:{config.listen.port}", flush=True
            )

    try:
        asyncio.run(
            serve_forever(
                gateway,
                host=config.listen.host,
                port=config.listen.port,
                reuse_port=shm_name is not None,
                shutdown_timeout=grace,
                on_ready=announce,
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
) -> int:
    # prometheus_client picks its multiprocess value class when first imported: set the
    # directory before anything imports it, so every worker's counters land in shared files
    shm_name = f"kvgate-{os.getpid()}-{int(time.time())}"
    prom_dir = tempfile.mkdtemp(prefix="kvgate-prom-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = prom_dir
    from prometheus_client import multiprocess

    from kvgate import CoreError
    from kvgate.gateway_build import build_controller

    try:
        controller = build_controller(config, shm_name=shm_name, create=True)
    except (CoreError, ValueError, OSError) as exc:
        print(f"kvgate serve: cannot start: {exc}", file=sys.stderr)
        shutil.rmtree(prom_dir, ignore_errors=True)
        return 2
    children: dict[int, int] = {}
    stopping = False

    def spawn(index: int) -> None:
        pid = os.fork()
        if pid == 0:  # worker
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            try:
                code = _serve_single(
                    config,
                    grace,
                    config_path=config_path,
                    overrides=overrides,
                    shm_name=shm_name,
                    worker=index,
                )
            except BaseException:
                logger.exception("worker %d crashed", index)
                code = 1
            os._exit(code)
        children[pid] = index

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
    for i in range(config.workers):
        spawn(i)
    print(
        f"kvgate: {config.workers} workers serving on http://{config.listen.host}:{config.listen.port}",
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
        if not stopping:
            logger.warning(
                "worker %d (pid %d) died with status %d; reclaimed %d held units; restarting",
                index,
                pid,
                status,
                reclaimed,
            )
            spawn(index)
        elif os.waitstatus_to_exitcode(status) not in (0, -signal.SIGTERM, -signal.SIGINT):
            code = 1
    del controller
    shutil.rmtree(prom_dir, ignore_errors=True)
    return code
