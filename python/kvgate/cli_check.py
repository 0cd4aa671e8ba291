"""``kvgate check-config FILE``: validate a configuration file without starting anything.

Exit status 0 and a short summary (plus ``warning:`` lines on stderr for tenants no request can
reach) when ``kvgate serve`` would start with it; 2 and one ``path: message`` line per problem
(on stderr) when it would not: the file's own rules, then what start-up builds (the admission
core's limits, tokenizers, chat templates, the listen host), then, with a ``store``, the Redis
server (reachable, 7.0 or later, the Functions library loads; a warning unless its
``maxmemory-policy`` is ``noeviction``). Never a traceback for a bad file.
"""

from __future__ import annotations

import argparse
import sys

from kvgate.config import DEFAULT_SLOTS, Config, ConfigError, load_config

__all__ = ["add_arguments", "run", "summary", "warnings"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``FILE`` on the ``check-config`` sub-parser."""
    parser.add_argument("file", metavar="FILE", help="the kvgate YAML configuration file")


def summary(cfg: Config) -> str:
    """A human-readable digest of a valid configuration (no key hashes)."""
    lines = [
        f"listen {cfg.listen.host}:{cfg.listen.port}"
        f"{' over TLS' if cfg.listen.tls is not None else ''}, {cfg.workers} worker(s), "
        f"mode {cfg.mode}, body cap {cfg.max_body_bytes} bytes, queue {cfg.queue.max_size}",
    ]
    for b in cfg.backends:
        tpm = "no TPM limit" if b.tokens_per_minute is None else f"TPM {b.tokens_per_minute}"
        inflight = (
            f"in-flight tokens {b.inflight_token_limit}"
            if b.inflight_token_limit is not None
            else f"in-flight tokens from engine capacity × {b.capacity_safety_factor:g}"
        )
        adaptive = (
            f"adaptive {b.adaptive.low:g}..{b.adaptive.high:g} floor {b.adaptive.floor:g}"
            if b.adaptive.enabled
            else "adaptive off"
        )
        models = ", ".join(f"{m.name} (context {m.context_window})" for m in b.models)
        concurrency = (
            f"concurrency {b.max_concurrency}"
            if b.max_concurrency is not None
            else f"concurrency the engine's batch limit (else {DEFAULT_SLOTS})"
        )
        lines.append(
            f"backend {b.name} [{b.engine}, {b.mode}] {b.url}: {concurrency}, "
            f"{tpm}, {inflight}, {adaptive}; models: {models}"
        )
    for t in cfg.tenants:
        lines.append(
            f"tenant {t.name} [{t.priority}, {t.mode}]: {len(t.api_key_sha256)} key(s), "
            f"guaranteed slots {t.guaranteed_slots}, max wait {t.max_wait_ms} ms"
        )
    if cfg.anonymous_tenant:
        lines.append(f"requests without a key go to tenant {cfg.anonymous_tenant}")
    if cfg.store is not None:
        st = cfg.store
        at = st.url.rsplit("@", 1)[-1]
        if st.sentinel is not None:
            from urllib.parse import urlsplit

            db = urlsplit(st.url).path.strip("/") or "0"
            at = (
                f"the primary of {st.sentinel.master!r} (Redis Sentinel: "
                f"{', '.join(st.sentinel.nodes)}; database {db})"
            )
        lines.append(
            f"limits shared through Redis{' Cluster' if st.cluster else ''} at "
            f"{at}: heartbeat {st.heartbeat_s:g} s, lease {st.ttl_s:g} s, "
            f"deadline {st.deadline_ms:g} ms, fallback {st.on_failure}"
            + "".join(f", {limit}: {policy}" for limit, policy in sorted(st.policies.items()))
            + f"; share for {st.max_degraded_s:g} s at most, then {st.after_degraded}"
        )
    tracing = getattr(cfg, "tracing", None)
    if tracing is not None:
        lines.append(
            f"traces to {tracing.otlp_endpoint} (OTLP/HTTP) as {tracing.service_name}, "
            f"sampling {tracing.sample_ratio:g} of new traces"
        )
    lines.append(
        "admin key set (GET /admin/state and /admin/usage need it)"
        if cfg.admin_key_sha256
        else "admin key not set: GET /admin/state and /admin/usage are open to anyone who can reach the gateway"
    )
    return "\n".join(lines)


def warnings(cfg: Config) -> list[str]:
    """Valid but probably not meant: tenants no request can reach."""
    out = []
    for t in cfg.tenants:
        if not t.api_key_sha256 and t.name != cfg.anonymous_tenant:
            out.append(
                f"tenant {t.name} has no API key and is not the anonymous tenant: "
                "no request can reach it"
            )
    return out


def run(args: argparse.Namespace) -> int:
    """Validate ``args.file`` as ``kvgate serve`` would at start-up (the file's rules, then the
    admission core's limits, tokenizers, chat templates and the listen host; binding the port
    is not tried); print the summary and any warnings (exit 0) or the problems (exit 2)."""
    from kvgate.gateway_build import check_startup

    try:
        cfg = load_config(args.file)
    except ConfigError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    problem = check_startup(cfg)
    if problem is not None:
        print(f"kvgate: {args.file}: kvgate serve would refuse it: {problem}", file=sys.stderr)
        return 2
    notes: list[str] = []
    if cfg.store is not None:
        import asyncio

        from kvgate.store.server import check_server

        problems, notes = asyncio.run(check_server(cfg.store))
        if problems:
            for line in problems:
                print(f"kvgate: {args.file}: {line}", file=sys.stderr)
            return 2
    print(f"{args.file}: OK")
    print(summary(cfg))
    for note in notes:
        if note.startswith("warning: "):
            print(note, file=sys.stderr)
        else:
            print(note)
    for line in warnings(cfg):
        print(f"warning: {line}", file=sys.stderr)
    return 0
