"""kvgate's configuration file: a pydantic v2 model, YAML loading with ``${VAR}`` substitution.

What: :func:`load_config` reads one YAML file into a validated, frozen :class:`Config`. A bad
file raises :class:`ConfigError`, whose message lists every bad field as a path and a reason
(``tenants[2].guaranteed_slots: must be ≥ 0``) — never a traceback. ``kvgate check-config FILE``
(:mod:`kvgate.cli_check`) runs the same validation without starting anything.

Environment variables: in any string value, ``${VAR}`` is replaced by the variable's value
(``${VAR:-default}`` when unset uses ``default``; ``$${`` is a literal ``${``). A variable that is
not set and has no default is an error naming the field. Substitution happens after YAML parsing,
so a value can never change the structure of the file. Numbers may come from variables too
(``port: ${PORT}``): pydantic converts the string. A backend's engine API key is only ever read
from the environment, by name (``api_key_env: VLLM_KEY``), so it never appears in the file.

Units: seconds for timeouts and intervals, bytes for ``max_body_bytes``, tokens for token limits,
ratios 0..1 for the adaptive watermarks and floor, milliseconds for ``max_wait_ms``.

Cross-field rules (checked once the fields themselves are valid), each with its message:

- names (backends, tenants, models in a backend) are unique;
- adaptive ``low < high``; ``stale_after ≥ poll_interval``; ``scrape_timeout < poll_interval``;
- ``default_max_tokens < context_window``; ``burst_tokens`` needs ``tokens_per_minute``;
- a tenant's ``guaranteed_slots ≤ max_concurrency`` (its own cap), and on each backend that
  sets ``max_concurrency`` the guaranteed slots of the tenants that may use it sum to at most
  that (a backend without one gets a slot limit of at least that sum at start-up);
- backends a tenant names, and ``anonymous_tenant``, exist;
- an API-key hash belongs to one tenant only and is not the admin key;
- ``timeouts.first_byte`` and ``timeouts.idle`` are ≤ ``timeouts.total``;
- ``listen.tls``: the certificate and key files load together into a server ``ssl.SSLContext``
  (the message names the file: not PEM, an encrypted key, a key that does not match).
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvgate._core import MAX_AMOUNT, MAX_PROCS
from kvgate.tls import server_context

__all__ = [
    "DEFAULT_SLOTS",
    "AdaptiveConfig",
    "BackendConfig",
    "Config",
    "ConfigError",
    "ListenConfig",
    "MetricsConfig",
    "ModelConfig",
    "QueueConfig",
    "TLSConfig",
    "TenantConfig",
    "TimeoutsConfig",
    "guarantees_by_backend",
    "issues_from",
    "load_config",
    "parse_config",
]

#: A backend's slot limit (concurrent requests) when neither the configuration
#: (``max_concurrency``) nor the engine states one: vLLM states no batch limit over HTTP.
#: Shared by the quick start (``kvgate serve --upstream``) and file configurations.
DEFAULT_SLOTS = 64

Mode = Literal["enforce", "shadow"]
Priority = Literal["critical", "standard", "sheddable"]
# The adapters of kvgate.telemetry.engine_metrics.ENGINES, plus "auto" (kept equal by a test).
EngineOption = Literal[
    "auto",
    "vllm",
    "vllm-v0",
    "sglang",
    "tgi",
    "llamacpp",
    "triton-trtllm",
    "trtllm-serve",
    "lmdeploy",
]

#: Most worker processes: the shared region holds ``MAX_PROCS`` process entries, one of them
#: the master's. (``MAX_AMOUNT``, the largest amount the core accepts, bounds the limits.)
MAX_WORKERS = MAX_PROCS - 1


def _not_bool(value: Any) -> Any:
    # pydantic's lax mode reads true/false as 1/0; a limit written as a boolean is a mistake
    if isinstance(value, bool):
        raise ValueError("must be a number, not true/false")
    return value


#: An integer field: YAML ints or numeric strings (``${VAR}``), never a boolean.
Int = Annotated[int, BeforeValidator(_not_bool)]
#: A number field: finite (the models refuse NaN and infinities), never a boolean.
Float = Annotated[float, BeforeValidator(_not_bool)]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: what an API key sent as ``Authorization: Bearer <key>`` may hold: visible ASCII only
#: (RFC 9110 field values; a space, control character or non-ASCII byte would corrupt the
#: header or be read differently by the engine)
_KEY_RE = re.compile(r"^[\x21-\x7e]+$")
_HEX64_RE = re.compile(r"^[0-9a-fA-F]{64}$")
_NAME_RULE = "must start with a letter or digit and hold only letters, digits, '.', '_', '-'"


class ConfigError(ValueError):
    """An invalid configuration file.

    Attributes:
        issues: ``(path, message)`` per problem, e.g. ``("tenants[2].guaranteed_slots",
            "must be ≥ 0")``; the path is ``""`` for a problem with the file as a whole.
        source: the file name, when loaded from a file.

    ``str(err)`` is one line per issue, ``path: message``, after a header naming the file.
    """

    def __init__(self, issues: list[tuple[str, str]], source: str | None = None) -> None:
        self.issues = issues
        self.source = source
        header = f"invalid configuration {source}" if source else "invalid configuration"
        lines = [f"{p}: {m}" if p else m for p, m in issues]
        super().__init__(header + ":\n" + "\n".join(f"  {ln}" for ln in lines))


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _name(value: str) -> str:
    if not _NAME_RE.match(value):
        raise ValueError(_NAME_RULE)
    return value


Name = Annotated[str, Field(min_length=1, max_length=64)]


def _sha256_hex(value: str) -> str:
    if not _HEX64_RE.match(value):
        raise ValueError(
            "must be a SHA-256 hex digest (64 hex characters; store the hash of the key, "
            "never the key)"
        )
    return value.lower()


#: A SHA-256 digest as 64 hex characters (normalised to lower case).
Sha256Hex = Annotated[str, AfterValidator(_sha256_hex)]


class TLSConfig(_Model):
    """HTTPS on the listener: ``certificate`` is the PEM certificate chain file (the server's
    certificate first), ``key`` its unencrypted PEM private key; relative paths are relative to
    the config file. Checked at load: both files exist and load together into a server
    ``ssl.SSLContext`` (a key that does not match the certificate is refused). TLS 1.2 and 1.3
    only (:func:`kvgate.tls.server_context`)."""

    certificate: str
    key: str

    @field_validator("certificate", "key")
    @classmethod
    def _file_exists(cls, value: str, info: ValidationInfo) -> str:
        return _existing_file(value, info)

    @model_validator(mode="after")
    def _loads(self) -> TLSConfig:
        server_context(self.certificate, self.key)  # ValueError names the file
        return self


class ListenConfig(_Model):
    """Where the gateway listens. ``port`` 0 picks a free port (tests). ``tls``: serve HTTPS
    with this certificate and key (:class:`TLSConfig`); ``None`` = plain HTTP."""

    host: str = "127.0.0.1"
    port: Int = Field(8080, ge=0, le=65535)
    tls: TLSConfig | None = None


class TimeoutsConfig(_Model):
    """Timeouts, seconds. Upstream: TCP connect, first response byte (covers the engine's queue
    and prefill), gap between two streamed chunks, whole request. Client: ``client_header`` —
    a connection that has not sent a complete request head in this time is closed (also the
    keep-alive idle time); ``client_body`` — a body that has not fully arrived in this time gets
    408 (slow clients are cut off instead of holding a connection)."""

    connect: Float = Field(5.0, gt=0)
    first_byte: Float = Field(120.0, gt=0)
    idle: Float = Field(60.0, gt=0)
    total: Float = Field(600.0, gt=0)
    client_header: Float = Field(15.0, gt=0)
    client_body: Float = Field(30.0, gt=0)


class ModelConfig(_Model):
    """A model a backend serves.

    ``tokenizer``: path to a HuggingFace ``tokenizer.json`` (relative paths are relative to the
    config file), used to count prompt tokens exactly; ``None`` = the analyser's estimate.
    ``chat_template``: a path to a Jinja template file (relative paths are relative to the config
    file; its text is the template), or an inline template (see :func:`template_is_inline`);
    ``None`` = the tokenizer's own (the ``chat_template`` of the ``tokenizer_config.json`` beside
    ``tokenizer``, if any; else each message costs its text plus a fixed overhead).
    ``context_window`` and
    ``default_max_tokens`` (reserved when a request sends no ``max_tokens``) are in tokens.
    """

    name: Name
    tokenizer: str | None = None
    chat_template: str | None = None
    context_window: Int = Field(ge=1, le=MAX_AMOUNT)
    default_max_tokens: Int | None = Field(None, ge=1, le=MAX_AMOUNT)

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_exists(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _existing_file(value, info)

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None or template_is_inline(value):
            return value
        try:
            return _existing_file(value, info)
        except ValueError as exc:
            raise ValueError(
                f"{exc} (a chat_template without '{{{{', '{{%', '{{#' or a line break is the "
                "path of a template file)"
            ) from None

    @property
    def chat_template_file(self) -> str | None:
        """The template file's absolute path when ``chat_template`` names a file, else
        ``None`` (no template, or an inline one)."""
        t = self.chat_template
        return None if t is None or template_is_inline(t) else t


def template_is_inline(value: str) -> bool:
    """Whether a ``chat_template`` value is the template's text rather than a file path: it
    holds Jinja markup (``{{``, ``{%`` or ``{#``) or a line break, which no sensible path has."""
    return any(mark in value for mark in ("{{", "{%", "{#", "\n"))


def _existing_file(value: str, info: ValidationInfo) -> str:
    base = (info.context or {}).get("base_dir")
    path = Path(value).expanduser()
    if not path.is_absolute() and base is not None:
        path = Path(base) / path
    if not path.is_file():
        raise ValueError(f"file not found: {path}")
    return str(path.resolve())


class AdaptiveConfig(_Model):
    """Adaptive feedback from the engine's metrics (docs/adaptive.md).

    ``high`` / ``low``: KV-usage watermarks (ratio 0..1): at or above ``high`` the concurrency
    and TPM limits are at ``floor`` × base and sheddable traffic is shed; below ``low`` they grow
    back to base at ``recovery_per_second`` (fraction of base per second). The scaled limits
    bind the sheddable class always, critical and standard only at or above ``high`` and only
    when the engine states no KV capacity or its queue is over ``waiting_threshold`` (else the
    in-flight budget guards their memory): low-priority work gives way first. The in-flight token
    budget is never scaled: the engine's KV occupancy beyond kvgate's in-flight tokens is taken
    from it instead (:mod:`kvgate.adaptive`). ``waiting_threshold``: engine queue depth above
    which the backend counts as under pressure. ``poll_interval``, ``stale_after`` and
    ``scrape_timeout`` are seconds (``scrape_timeout`` default 0.8 × ``poll_interval``).
    """

    enabled: bool = True
    high: Float = Field(0.85, gt=0, le=1)
    low: Float = Field(0.70, ge=0, lt=1)
    floor: Float = Field(0.6, gt=0, le=1)
    recovery_per_second: Float = Field(0.1, gt=0, le=1)
    waiting_threshold: Int = Field(8, ge=0, le=10**9)
    poll_interval: Float = Field(1.0, gt=0)
    stale_after: Float = Field(5.0, gt=0)
    scrape_timeout: Float | None = Field(None, gt=0)


class BackendConfig(_Model):
    """One upstream engine.

    ``url``: the engine's base URL (``http://host:port``, no ``/v1``). ``metrics_url`` defaults to
    ``url + "/metrics"`` (trtllm-serve: set ``/prometheus/metrics``), ``health_url`` to
    ``url + "/health"``. ``max_concurrency``: base concurrency limit (slots); ``None`` (left
    out) = the engine's own batch limit, asked when kvgate starts (llama.cpp ``/props``
    ``total_slots``, SGLang ``max_running_requests``, TGI ``max_concurrent_requests``) and
    followed when later polls report another (llama.cpp ``/slots``); 64 where the engine
    states none (vLLM) or cannot be reached at start, until it states one; never below the
    guaranteed slots of the tenants that use the backend.
    ``tokens_per_minute`` / ``burst_tokens``: base TPM token bucket (``None`` = no TPM limit;
    burst defaults to one minute's worth). ``inflight_token_limit``: tokens (prompt + reserved
    completion) in flight; ``None`` = the engine's stated KV capacity ×
    ``capacity_safety_factor`` where the engine states one (vLLM, SGLang, TGI, Triton,
    llama.cpp ``/slots``), else no such limit. ``mode: shadow`` counts this backend's refusals
    without enforcing them. ``api_key_env``: the name of an environment variable holding the
    engine's API key (engines started with ``--api-key`` refuse requests without it, their
    ``/metrics`` included); it must be set and non-empty when the file is loaded, and the key
    itself never appears in the file (:attr:`api_key`). ``stream_upstream`` (default on): a
    chat, completions or Responses request whose client did not ask for a stream goes to the
    engine as one (``"stream": true``, ``stream_options.include_usage``) and kvgate assembles
    the JSON answer, so that the engine sees at its next token write that a client went away
    (llama.cpp's server checks a non-streaming client only after a second without any other
    result, which metrics polling keeps resetting); turn it off only for an engine that cannot
    stream. ``prefill_token_budget``: prompt tokens this backend may be prefilling at once
    (:mod:`kvgate.admission.prefill`); ``None`` = derived from the engine (twice its prefill
    chunk where stated, else 3 % of its KV capacity, at least 4,096 tokens), ``0`` = no budget.
    """

    name: Name
    url: str
    engine: EngineOption = "auto"
    metrics_url: str | None = None
    health_url: str | None = None
    models: list[ModelConfig] = Field(min_length=1)
    max_concurrency: Int | None = Field(None, ge=1, le=MAX_AMOUNT)
    tokens_per_minute: Int | None = Field(None, ge=1, le=MAX_AMOUNT)
    burst_tokens: Int | None = Field(None, ge=1, le=MAX_AMOUNT)
    inflight_token_limit: Int | None = Field(None, ge=1, le=MAX_AMOUNT)
    capacity_safety_factor: Float = Field(0.9, gt=0, le=1)
    adaptive: AdaptiveConfig = AdaptiveConfig()
    mode: Mode = "enforce"
    api_key_env: str | None = None
    stream_upstream: bool = True
    prefill_token_budget: Int | None = Field(None, ge=0, le=MAX_AMOUNT)
    _api_key: str | None = PrivateAttr(default=None)

    @field_validator("name")
    @classmethod
    def _name_ok(cls, value: str) -> str:
        return _name(value)

    @field_validator("api_key_env")
    @classmethod
    def _api_key_env_ok(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        if not _ENV_NAME_RE.match(value):
            raise ValueError(
                "must name an environment variable (letters, digits and '_', not starting "
                f"with a digit), got {value!r}; the key itself never goes in the file"
            )
        key = _env_of(info.context).get(value)
        if key is None:
            raise ValueError(f"environment variable {value} is not set")
        if not key:
            raise ValueError(f"environment variable {value} is empty")
        if not _KEY_RE.match(key):
            raise ValueError(
                f"environment variable {value} holds a space, control or non-ASCII character "
                "(an API key is sent as 'Authorization: Bearer <key>')"
            )
        return value

    def model_post_init(self, context: Any, /) -> None:
        """Read the engine's API key from ``api_key_env`` (validated above) once, at load."""
        if self.api_key_env is not None:
            self._api_key = _env_of(context).get(self.api_key_env)

    @property
    def api_key(self) -> str | None:
        """The engine's API key (read from the ``api_key_env`` variable when the file was
        loaded), or ``None``. kvgate sends it to the engine as ``Authorization: Bearer <key>``
        on every request (inference, other ``/v1/`` routes, metrics, health, llama.cpp
        ``/slots``); the client's own key is never forwarded."""
        return self._api_key

    @field_validator("url", "metrics_url", "health_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if any(c.isspace() or not c.isprintable() for c in value):
            raise ValueError("must not contain spaces or control characters")
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"must be an http:// or https:// URL, got {value!r}")
        return value.rstrip("/")

    @property
    def effective_metrics_url(self) -> str:
        """``metrics_url`` or ``url + "/metrics"``."""
        return self.metrics_url or f"{self.url}/metrics"

    @property
    def effective_health_url(self) -> str:
        """``health_url`` or ``url + "/health"``."""
        return self.health_url or f"{self.url}/health"


def _env_of(context: Any) -> Mapping[str, str]:
    """The environment a file is read with: ``parse_config``'s ``env`` (in the validation
    context), else ``os.environ``."""
    env = context.get("env") if isinstance(context, dict) else None
    return env if env is not None else os.environ


class TenantConfig(_Model):
    """A tenant: who a request belongs to, and its class and quotas.

    ``api_key_sha256``: SHA-256 hex digests (64 hex characters) of the tenant's API keys (keys
    themselves never appear in the config; compare in constant time). ``priority``: its class.
    ``guaranteed_slots``: slots carved out of each backend it may use (``backends``; ``None`` =
    all) that only it can take. ``tokens_per_minute`` / ``max_concurrency``: its own quota and
    cap (``None`` = none); ``burst_tokens``: the capacity of its token bucket (default: one
    minute's worth; needs ``tokens_per_minute``). ``max_wait_ms``: how long a refused request
    may wait in the queue
    (0 = refuse at once). ``mode: shadow`` counts its refusals without enforcing them.
    """

    name: Name
    api_key_sha256: list[Sha256Hex] = Field(default_factory=list)
    priority: Priority = "standard"
    guaranteed_slots: Int = Field(0, ge=0, le=MAX_AMOUNT)
    tokens_per_minute: Int | None = Field(None, ge=1, le=MAX_AMOUNT)
    burst_tokens: Int | None = Field(None, ge=1, le=MAX_AMOUNT)
    max_concurrency: Int | None = Field(None, ge=1, le=MAX_AMOUNT)
    max_wait_ms: Int = Field(0, ge=0, le=MAX_AMOUNT)
    backends: list[str] | None = Field(None, min_length=1)
    mode: Mode = "enforce"

    @field_validator("name")
    @classmethod
    def _name_ok(cls, value: str) -> str:
        return _name(value)


class QueueConfig(_Model):
    """The priority wait queue: at most ``max_size`` waiting requests (over it → 503). Each
    worker process keeps its own queue (the limits the queue waits on are shared), so with
    ``--workers N`` up to N × ``max_size`` requests wait."""

    max_size: Int = Field(1024, ge=0, le=MAX_AMOUNT)


class AccessLogConfig(_Model):
    """The access log: one JSON line per request (docs/operations.md, "Logs and request ids"), on by
    default, to stderr (``path`` null) or appended to the file ``path`` (relative to the
    configuration file's directory; its directory must exist), written in batches (64 KiB, or
    half a second after a batch's first line, and when the server stops). Read at start-up (a
    reload does not change it)."""

    enabled: bool = True
    path: str | None = None

    @field_validator("path")
    @classmethod
    def _path_ok(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        if not value.strip() or "\x00" in value:
            raise ValueError("must be a file path (or null for stderr)")
        base = (info.context or {}).get("base_dir")
        path = Path(value).expanduser()
        if not path.is_absolute() and base is not None:
            path = Path(base) / path
        if path.is_dir():
            raise ValueError(f"is a directory: {path}")
        if not path.parent.is_dir():
            raise ValueError(f"directory not found: {path.parent}")
        return str(path.resolve())


class MetricsConfig(_Model):
    """The Prometheus metrics of ``GET /metrics``.

    ``tenant_labels``: the most tenants whose names label the per-tenant series
    (``kvgate_requests_total``, ``kvgate_tenant_requests_total``, ``kvgate_tenant_tokens_total``,
    ``kvgate_tenant_usage_tokens_total``). With more tenants configured than that, those series
    carry ``tenant="*"`` (every tenant summed) and each tenant's requests and tokens are in
    ``GET /admin/usage``: every tenant label value is a series a scrape writes out and Prometheus
    stores, and 100,000 of them (several series each) make a scrape take seconds. 0: never by
    tenant. Applied again on reload."""

    tenant_labels: Int = Field(1000, ge=0, le=MAX_AMOUNT)


class ClassTargetConfig(_Model):
    """A priority class's latency targets (seconds; ``None``: no target): the 99th percentile
    of its time to first token and of its time per output token."""

    ttft_p99_s: Float | None = Field(None, gt=0)
    tpot_p99_s: Float | None = Field(None, gt=0)


class SloConfig(_Model):
    """Latency targets per priority class (docs/admission.md, "Latency targets"): while a class misses
    one, the lower classes' concurrency on that backend is capped, and raised back once every
    target is met with a margin.

    Attributes:
        critical, standard, sheddable: each class's targets (``None``: none).
        interval_s: seconds between two control steps.
        window_s: seconds of finished requests a percentile is taken over.
        min_samples: the fewest requests a percentile is taken from.
    """

    critical: ClassTargetConfig | None = None
    standard: ClassTargetConfig | None = None
    sheddable: ClassTargetConfig | None = None
    interval_s: Float = Field(1.0, gt=0, le=60)
    window_s: Float = Field(10.0, gt=0, le=3600)
    min_samples: Int = Field(10, ge=1, le=10**6)


class TracingConfig(_Model):
    """OpenTelemetry traces of the requests (docs/operations.md, "Traces"), exported over OTLP/HTTP; needs
    the optional extra ``otel`` (``pip install 'kvgate[otel]'``). Read at start-up (a reload
    does not change it).

    Attributes:
        otlp_endpoint: the collector's OTLP/HTTP base URL (``http://host:4318``; spans are
            posted to its ``/v1/traces``).
        service_name: the ``service.name`` resource attribute of every span.
        sample_ratio: the fraction (0..1) of new traces recorded (by trace id); a request with
            a ``traceparent`` follows its parent's sampling flag.
    """

    otlp_endpoint: str = Field(min_length=1)
    service_name: str = Field("kvgate", min_length=1, max_length=256)
    sample_ratio: Float = Field(1.0, ge=0, le=1)

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint_ok(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http:// or https:// URL with a host (got {value!r})")
        return value


#: What a replica does with a limit while Redis cannot be reached (``store.on_failure``).
StorePolicy = Literal["share", "strict", "open", "closed"]
#: The limits a fallback policy can be set for (the refusal reasons of the admission core).
STORE_LIMITS = (
    "tenant-concurrency",
    "tenant-tpm",
    "backend-slots",
    "inflight-tokens",
    "backend-tpm",
)


@functools.cache
def _redis_url_options() -> frozenset[str]:
    """The arguments a store URL's query may carry: those of redis-py's connections (which a
    URL's query is handed to) and of its URL parser (``max_connections``, ``timeout``)."""
    import inspect

    from redis.asyncio import connection as conn
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS

    names = set(URL_QUERY_ARGUMENT_PARSERS)
    for cls in (conn.AbstractConnection, conn.Connection, conn.SSLConnection,
                conn.UnixDomainSocketConnection):  # fmt: skip
        names.update(inspect.signature(cls.__init__).parameters)
    # (the parser itself names the connection class of a rediss:// or unix:// URL)
    return frozenset((names - {"self", "kwargs"}) | {"connection_class"})


#: the port a sentinel listens on when its address names none (Redis Sentinel's own default)
SENTINEL_PORT = 26379


class SentinelConfig(_Model):
    """Redis Sentinel in front of a primary and its replicas: the store asks the sentinels
    which server is the primary (``SENTINEL MASTERS``; a primary they see as down is not
    taken), connects there, checks that it is one (``ROLE``; taken on the sentinels' word
    where ``ROLE`` is not permitted or renamed away), and asks again whenever its connection
    is lost or refused (``READONLY``), and once a heartbeat, leaving a server they no longer
    name: after a failover its messages go to the promoted replica, where what each gateway
    holds is re-asserted (docs/replicas.md).

    Attributes:
        master: the name the sentinels monitor the primary by (``sentinel monitor <master>
            ...`` in their configuration).
        nodes: the sentinels' addresses, ``host:port`` (``host`` alone: port 26379); asked in
            turn until one answers, the last to answer first next time.
        username, password: the sentinels' own credentials (their ``requirepass`` or ACL
            user), when they have any; the primary's come from ``url``.
    """

    master: Name
    nodes: list[str] = Field(min_length=1, max_length=64)
    username: str | None = None
    password: str | None = None

    @field_validator("nodes")
    @classmethod
    def _nodes_ok(cls, value: list[str]) -> list[str]:
        seen: set[tuple[str, int]] = set()
        for node in value:
            address = sentinel_address(node)
            if address in seen:
                raise ValueError(f"{node!r} is listed twice")
            seen.add(address)
        return value

    def addresses(self) -> list[tuple[str, int]]:
        """``nodes`` as ``(host, port)`` pairs."""
        return [sentinel_address(node) for node in self.nodes]


def sentinel_address(node: str) -> tuple[str, int]:
    """``host:port`` (or ``host``, ``[v6]:port``) as ``(host, port)``; port 26379 when absent.

    Raises:
        ValueError: no host, a port that is not a number 1..65535, or anything else than a
            host and a port (a user or password, a path, spaces or control characters, a
            percent sign); the message never quotes what comes before an ``@``.
    """
    text = node.strip()
    shown = text.rsplit("@", 1)[-1]  # never a password written before the host
    # (a percent sign only in an IPv6 address's zone: [fe80::1%eth0])
    zone = text.startswith("[") and "%" in text.partition("]")[0]
    odd = any(c in text for c in " #?/@") or ("%" in text and not zone)
    odd = odd or any(ord(c) < 32 or ord(c) == 127 for c in text)
    try:
        parts = urlsplit("//" + text)
        hostname = parts.hostname
    except ValueError:  # e.g. an IPv4 address in brackets
        hostname = None
    try:
        port = parts.port if hostname else 0
    except ValueError:
        port = -1
    if odd or not hostname or text.endswith(":") or port == 0:
        raise ValueError(f"a sentinel is host:port, e.g. 10.0.0.5:26379 (got {shown!r})")
    if port == -1:
        raise ValueError(f"a sentinel's port must be a number 1..65535 (got {shown!r})")
    return hostname, port or SENTINEL_PORT


class StoreConfig(_Model):
    """Where the limits live when several gateway replicas share them (docs/replicas.md): a Redis (or Valkey) server, version 7.0 or later (Redis Functions).

    Without a ``store`` section the limits are this host's (one process, or ``--workers N``
    sharing memory). With one, every gateway process is a replica to Redis: it holds leased
    quotas of each limit and goes to Redis only to grow or give back a quota, to heartbeat, and
    — near a limit — for each decision.

    Attributes:
        url: ``redis://[[user]:password@]host:port/db``, ``rediss://`` (TLS: the server's
            certificate is verified against the system's CAs, or ``?ssl_ca_certs=/path/ca.pem``;
            ``ssl_cert_reqs=none`` turns that off) or ``unix:///path/to.sock`` (Valkey speaks
            the same protocol).
        cluster: the URL names one node of a Redis Cluster.
        key_prefix: the prefix of every key kvgate writes (inside the hash tag).
        deadline_ms: the longest a request waits on Redis (milliseconds): a decision taken in
            Redis near a limit; past it the request is decided by ``on_failure``.
        background_deadline_ms: the deadline of heartbeats, grants and returns (milliseconds).
        heartbeat_s: how often a replica renews its lease (seconds, 0.05..5).
        lease_ttl_s: how long a silent replica keeps its quotas before the others reap them
            (seconds; default 3 × ``heartbeat_s``, at least 2 × ``heartbeat_s``). A replica admits nothing on a lease older
            than this (a frozen process that wakes up) until Redis has heard from it again.
        chunk_fraction: the largest quota a replica holds beyond what it uses, as a fraction
            (0..1) of a limit divided among the live replicas.
        near_fraction: below this fraction (0..1) of a limit left free, every admission is
            decided in Redis (exact at the boundary) and replicas give back what they hold
            beyond their use.
        on_failure: the fallback while Redis cannot be reached: ``share`` (each replica keeps
            at most its share, limit ÷ live replicas, or what it held), ``strict`` (only what
            it held), ``open`` (no limit), ``closed`` (refuse, 503).
        policies: a different fallback for some limits: ``{limit: policy}`` with a limit among
            ``tenant-concurrency``, ``tenant-tpm``, ``backend-slots``, ``inflight-tokens``,
            ``backend-tpm``.
        max_degraded_s: after this long without Redis (seconds), ``share`` becomes
            ``after_degraded``.
        after_degraded: ``closed`` (default) or ``open``.
        breaker_failures: consecutive failed calls that open the circuit breaker.
        standing_share: the share (ratio 0..0.1) of each tenant's concurrency limit and TPM
            held as *standing slices*: each of up to ``standing_replicas`` replicas admits
            that share ÷ ``standing_replicas`` of the tenant's limits without any message to
            Redis, and Redis keeps that share out of what it grants, so the limits stay exact
            and at most this share of each limit is stranded. A request of a tenant seen
            rarely (one of 100,000 API keys) then costs no Redis call, when each of the
            tenant's limits gives a slice of at least one (slot, token a minute, token of
            burst) and the request's tokens fit in the slice's. Every replica must have the
            same setting. 0 (default): no slices.
        standing_replicas: how many replicas hold standing slices at once (1..64); the others
            take every unit from Redis. A replica whose setting (or ``standing_share``)
            differs from the one the first replica recorded in Redis takes no slice.
        sentinel: find the primary through Redis Sentinel (:class:`SentinelConfig`); ``url``
            then gives the primary's credentials and database, its host and port are not used
            (name the master there, e.g. ``redis://:password@mymaster/0``). Not with
            ``cluster``, ``rediss://`` or ``unix://``.
    """

    url: str = Field(min_length=1)
    cluster: bool = False
    key_prefix: Name = "kvg"
    deadline_ms: Float = Field(25.0, gt=0, le=10_000)
    background_deadline_ms: Float = Field(250.0, gt=0, le=60_000)
    heartbeat_s: Float = Field(1.0, ge=0.05, le=5)
    lease_ttl_s: Float | None = Field(None, gt=0, le=60)
    chunk_fraction: Float = Field(0.1, gt=0, le=1)
    near_fraction: Float = Field(0.1, ge=0, lt=1)
    on_failure: StorePolicy = "share"
    policies: dict[str, StorePolicy] = Field(default_factory=dict)
    max_degraded_s: Float = Field(60.0, gt=0)
    after_degraded: Literal["closed", "open"] = "closed"
    breaker_failures: Int = Field(3, ge=1, le=1000)
    standing_share: Float = Field(0.0, ge=0, le=0.1)
    standing_replicas: Int = Field(8, ge=1, le=64)
    sentinel: SentinelConfig | None = None

    @model_validator(mode="after")
    def _sentinel_ok(self) -> StoreConfig:
        if self.sentinel is not None:
            if self.cluster:
                raise ValueError(
                    "store.sentinel: a Redis Cluster has no sentinels; set one of them"
                )
            scheme = self.url.split("://", 1)[0]
            if scheme != "redis":
                raise ValueError(
                    f"store.sentinel: the primary is reached by redis:// only (got {scheme}://)"
                )
        return self

    @field_validator("url")
    @classmethod
    def _url_ok(cls, value: str) -> str:
        scheme = value.split("://", 1)[0] if "://" in value else ""
        shown = value.split("@")[-1]  # never the password
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"must be a redis://host:port/db, rediss://… or unix:///path URL (got {shown!r})"
            )
        if scheme != "unix":
            parts = urlsplit(value)
            try:
                parts.port  # noqa: B018 (parsing it is the check)
            except ValueError:
                raise ValueError(f"the port must be a number 0..65535 (got {shown!r})") from None
            db = parts.path.strip("/")
            if db and not db.isdigit():
                raise ValueError(f"the database after the port must be a number (got {shown!r})")
        from redis.connection import parse_url

        try:  # the query's arguments, as the client will read them (?db=, ?socket_timeout=, …)
            options = parse_url(value)
        except ValueError as exc:
            raise ValueError(f"{exc} (got {shown!r})") from None
        unknown = sorted(set(options) - _redis_url_options())
        if unknown:
            raise ValueError(
                f"unknown connection argument(s) {', '.join(unknown)} in the URL's query "
                f"(got {shown!r})"
            )
        return value

    @field_validator("lease_ttl_s")
    @classmethod
    def _lease_ok(cls, value: float | None, info: ValidationInfo) -> float | None:
        # the others reap a replica once its lease runs out: a lease shorter than two
        # heartbeats would reap live replicas between their heartbeats, and their quotas
        # would be granted again while their requests still run
        heartbeat = info.data.get("heartbeat_s")
        if value is not None and heartbeat is not None and value < 2 * heartbeat:
            raise ValueError(
                f"must be at least 2 × heartbeat_s ({2 * heartbeat:g} s): a shorter lease "
                "lets the other replicas reap a live one between its heartbeats"
            )
        return value

    @field_validator("policies")
    @classmethod
    def _limits_ok(cls, value: dict[str, str]) -> dict[str, str]:
        for limit in value:
            if limit not in STORE_LIMITS:
                raise ValueError(f"unknown limit {limit!r}; one of {', '.join(STORE_LIMITS)}")
        return value

    @property
    def ttl_s(self) -> float:
        """The lease TTL in force (seconds): ``lease_ttl_s`` or 3 × ``heartbeat_s``."""
        return self.lease_ttl_s if self.lease_ttl_s is not None else 3 * self.heartbeat_s

    def policy(self, limit: str) -> str:
        """The fallback policy of ``limit`` (a name of :data:`STORE_LIMITS`)."""
        return self.policies.get(limit, self.on_failure)


class Config(_Model):
    """The whole file. See the module docstring for the cross-field rules.

    ``other_routes`` is what happens to a request on a path that is neither an inference route
    (``POST /v1/chat/completions``, ``/chat/completions``, ``/v1/completions``,
    ``/v1/embeddings``, ``/v1/responses``) nor one of the gateway's own (``/v1/models``,
    ``/v1/models/{id}``, ``/metrics``, ...): ``refuse`` (404 ``unknown_url``, the default) or
    ``forward`` (admitted against the tenant's and a backend's limits with one token reserved,
    relayed as it arrives, charged the usage the engine reports). ``forward`` opens the
    engine's other routes to every tenant, except the administration and non-OpenAI
    generation routes of vLLM, SGLang, TGI and llama.cpp's server that kvgate knows (403
    ``route_not_forwarded``: llama.cpp's ``/slots``, ``/completion``, ``/v1/messages``; TGI's
    and SGLang's ``/generate``; vLLM's ``/invocations``, cache resets, sleep, LoRA loading,
    weight updates; ... — ``kvgate.proxy.routes.NOT_FORWARDED``); a route not on that list is
    forwarded.
    """

    listen: ListenConfig = ListenConfig()
    workers: Int = Field(1, ge=1, le=MAX_WORKERS)
    max_body_bytes: Int = Field(10 * 1024 * 1024, ge=1, le=MAX_AMOUNT)
    timeouts: TimeoutsConfig = TimeoutsConfig()
    backends: list[BackendConfig] = Field(min_length=1)
    tenants: list[TenantConfig] = Field(default_factory=list)
    anonymous_tenant: str | None = None
    admin_key_sha256: Sha256Hex | None = None
    queue: QueueConfig = QueueConfig()
    mode: Mode = "enforce"
    other_routes: Literal["refuse", "forward"] = "refuse"
    access_log: AccessLogConfig = AccessLogConfig()
    metrics: MetricsConfig = MetricsConfig()
    store: StoreConfig | None = None
    slo: SloConfig | None = None
    tracing: TracingConfig | None = None

    @model_validator(mode="after")
    def _cross_field(self) -> Config:
        issues = list(_cross_field_issues(self))
        if issues:
            # One ValueError carrying every issue, one per line, each with its full path;
            # issues_from() splits it again.
            raise ValueError("\n".join(f"{_CROSS}{p}\t{m}" for p, m in issues))
        return self

    def backend(self, name: str) -> BackendConfig:
        """The backend called ``name`` (``KeyError`` if none)."""
        for b in self.backends:
            if b.name == name:
                return b
        raise KeyError(name)

    def tenant(self, name: str) -> TenantConfig:
        """The tenant called ``name`` (``KeyError`` if none)."""
        for t in self.tenants:
            if t.name == name:
                return t
        raise KeyError(name)


_CROSS = "\x00cross:"


def _dupes(names: list[str]) -> Iterator[tuple[int, str, int]]:
    seen: dict[str, int] = {}
    for i, n in enumerate(names):
        if n in seen:
            yield i, n, seen[n]
        else:
            seen[n] = i


def guarantees_by_backend(cfg: Config) -> dict[str, list[tuple[str, int]]]:
    """Backend name → ``[(tenant name, guaranteed slots)]`` of the tenants with guaranteed
    slots that may use that backend (its ``backends``, or every backend without them), in file
    order. Their sum is the least slot limit the backend can have. One pass over the tenants
    (not backends × tenants: a file may have thousands of tenants)."""
    users_of: dict[str, list[tuple[str, int]]] = {b.name: [] for b in cfg.backends}
    for tn in cfg.tenants:
        if tn.guaranteed_slots:
            names = users_of if tn.backends is None else dict.fromkeys(tn.backends)
            for name in names:
                if name in users_of:
                    users_of[name].append((tn.name, tn.guaranteed_slots))
    return users_of


def _cross_field_issues(cfg: Config) -> Iterator[tuple[str, str]]:
    t = cfg.timeouts
    for field_name in ("first_byte", "idle"):
        if getattr(t, field_name) > t.total:
            yield f"timeouts.{field_name}", f"must be ≤ timeouts.total ({t.total:g})"

    for i, name, first in _dupes([b.name for b in cfg.backends]):
        yield f"backends[{i}].name", f"duplicate backend name {name!r} (also backends[{first}])"
    for bi, b in enumerate(cfg.backends):
        p = f"backends[{bi}]"
        for i, name, first in _dupes([m.name for m in b.models]):
            yield f"{p}.models[{i}].name", f"duplicate model {name!r} (also models[{first}])"
        for mi, m in enumerate(b.models):
            if m.default_max_tokens is not None and m.default_max_tokens >= m.context_window:
                yield (
                    f"{p}.models[{mi}].default_max_tokens",
                    f"must be < context_window ({m.context_window})",
                )
        if b.burst_tokens is not None and b.tokens_per_minute is None:
            yield f"{p}.burst_tokens", "needs tokens_per_minute"
        a = b.adaptive
        if a.low >= a.high:
            yield f"{p}.adaptive.low", f"must be < adaptive.high ({a.high:g})"
        if a.stale_after < a.poll_interval:
            yield f"{p}.adaptive.stale_after", f"must be ≥ poll_interval ({a.poll_interval:g})"
        if a.scrape_timeout is not None and a.scrape_timeout >= a.poll_interval:
            yield (
                f"{p}.adaptive.scrape_timeout",
                f"must be < poll_interval ({a.poll_interval:g})",
            )

    backend_names = {b.name for b in cfg.backends}
    for i, name, first in _dupes([tn.name for tn in cfg.tenants]):
        yield f"tenants[{i}].name", f"duplicate tenant name {name!r} (also tenants[{first}])"
    key_owner: dict[str, int] = {}
    for ti, tn in enumerate(cfg.tenants):
        p = f"tenants[{ti}]"
        if tn.burst_tokens is not None and tn.tokens_per_minute is None:
            yield f"{p}.burst_tokens", "needs tokens_per_minute"
        if tn.max_concurrency is not None and tn.guaranteed_slots > tn.max_concurrency:
            yield (
                f"{p}.guaranteed_slots",
                f"must be ≤ the tenant's max_concurrency ({tn.max_concurrency})",
            )
        for name in tn.backends or ():
            if name not in backend_names:
                yield f"{p}.backends", f"no backend named {name!r}"
        for ki, key in enumerate(tn.api_key_sha256):
            if key in key_owner:
                yield (
                    f"{p}.api_key_sha256[{ki}]",
                    f"the same key hash is already used by tenants[{key_owner[key]}]",
                )
            else:
                key_owner[key] = ti
            if key == cfg.admin_key_sha256:
                yield f"{p}.api_key_sha256[{ki}]", "the same key hash is the admin key"

    users_of = guarantees_by_backend(cfg)
    for bi, b in enumerate(cfg.backends):
        if b.max_concurrency is None:  # its slot limit is raised to the sum at start-up
            continue
        users = users_of[b.name]
        total = sum(n for _, n in users)
        if total > b.max_concurrency:
            listed = ", ".join(f"{name} {n}" for name, n in users)
            yield (
                f"backends[{bi}].max_concurrency",
                f"{b.max_concurrency} is less than the guaranteed slots of the tenants "
                f"that use it ({total}: {listed})",
            )

    if cfg.anonymous_tenant is not None and cfg.anonymous_tenant not in {
        tn.name for tn in cfg.tenants
    }:
        yield "anonymous_tenant", f"no tenant named {cfg.anonymous_tenant!r}"


# ---------------------------------------------------------------------------------------------
# error formatting


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside a field's annotation (``X``, ``X | None``, ``list[X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _unknown_field(loc: tuple[int | str, ...]) -> str:
    """The message for an unknown key at ``loc``: "unknown field", and the closest field name
    of the model at that level when one is close enough (``difflib.get_close_matches``, its
    default similarity cutoff 0.6), e.g. ``unknown field; did you mean `max_concurrency`?``."""
    model: type[BaseModel] | None = Config
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue  # a list index: the element is the list's model
        field = model.model_fields.get(part)
        model = _model_of(field.annotation) if field is not None else None
    key = loc[-1] if loc else None
    if model is None or not isinstance(key, str):
        return "unknown field"
    close = difflib.get_close_matches(key, list(model.model_fields), n=1)
    return f"unknown field; did you mean `{close[0]}`?" if close else "unknown field"


def _message(err: Any) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        return _unknown_field(tuple(err["loc"]))
    simple = {
        "missing": "is required",
        "int_type": "must be an integer",
        "int_parsing": "must be an integer",
        "int_from_float": "must be an integer",
        "float_type": "must be a number",
        "float_parsing": "must be a number",
        "finite_number": "must be a finite number",
        "bool_type": "must be true or false",
        "bool_parsing": "must be true or false",
        "string_type": "must be a string",
        "list_type": "must be a list",
        "model_type": "must be a mapping",
        "model_attributes_type": "must be a mapping",
        "dict_type": "must be a mapping",
        "string_too_short": "must not be empty",
    }
    if kind in simple:
        return simple[kind]
    bounds = {
        "greater_than_equal": ("≥", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("≤", "le"),
        "less_than": ("<", "lt"),
    }
    if kind in bounds:
        sign, key = bounds[kind]
        bound = ctx[key]
        return (
            f"must be {sign} {bound:g}" if isinstance(bound, float) else f"must be {sign} {bound}"
        )
    if kind == "literal_error":
        return f"must be {ctx['expected']}"
    if kind == "too_short":
        return f"must have at least {ctx['min_length']} entry"
    if kind == "string_too_long":
        return f"must be at most {ctx['max_length']} characters"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    return str(err["msg"])


def issues_from(exc: ValidationError) -> list[tuple[str, str]]:
    """``(path, message)`` per problem of a pydantic validation error of :class:`Config`, in
    :class:`ConfigError`'s wording (``("workers", "must be ≥ 1")``)."""
    issues: list[tuple[str, str]] = []
    for err in exc.errors(include_url=False):
        message = _message(err)
        if message.startswith(_CROSS):
            for line in message.split("\n"):
                path, _, text = line.removeprefix(_CROSS).partition("\t")
                issues.append((path, text))
        else:
            issues.append((_path(tuple(err["loc"])), message))
    return issues


# ---------------------------------------------------------------------------------------------
# loading

_VAR_RE = re.compile(r"\$\$\{|\$\{([^}]*)\}")
_VAR_NAME_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?$", re.S)


def _substitute(node: Any, path: str, env: Mapping[str, str], issues: list[tuple[str, str]]) -> Any:
    if isinstance(node, dict):
        return {
            k: _substitute(v, f"{path}.{k}" if path else str(k), env, issues)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_substitute(v, f"{path}[{i}]", env, issues) for i, v in enumerate(node)]
    if not isinstance(node, str) or "${" not in node:
        return node

    def repl(m: re.Match[str]) -> str:
        if m.group(0) == "$${":
            return "${"
        ref = _VAR_NAME_RE.match(m.group(1))
        if ref is None:
            issues.append((path, f"bad environment reference ${{{m.group(1)}}}"))
            return ""
        name, default = ref.group(1), ref.group(2)
        value = env.get(name)
        if value is None:
            if default is None:
                issues.append((path, f"environment variable {name} is not set"))
                return ""
            return default
        return value

    return _VAR_RE.sub(repl, node)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML keeps the last one silently)."""


# libyaml's parser when PyYAML was built with it: the pure-Python one takes seconds on a file with
# thousands of tenants and keys. Its error messages differ, so a file it refuses is parsed again
# by the pure-Python loader for the message.
_FastSafeLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _FastUniqueKeyLoader(_FastSafeLoader):  # type: ignore[valid-type,misc]
    """:class:`_UniqueKeyLoader` on libyaml's parser."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    out: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", mark)
        out[key] = loader.construct_object(value_node, deep=True)
    return out


for _loader in (_UniqueKeyLoader, _FastUniqueKeyLoader):
    _loader.add_constructor(
        yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
        _construct_mapping,  # type: ignore[arg-type]
    )


_NOT_JSON = object()


class _DuplicateKey(ValueError):
    pass


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _DuplicateKey
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


#: a float as YAML 1.1 (PyYAML's resolver) reads one: a dot, and an exponent only with its
#: sign; JSON's other numbers (``1e3``) are strings to YAML, so they are here too
_YAML_FLOAT = re.compile(r"[-+]?[0-9]*\.[0-9]*(?:[eE][-+][0-9]+)?")
#: characters YAML reads differently from JSON: line breaks to YAML (NEL, LS, PS) and those it
#: refuses in a document (DEL, C1 controls, U+FFFE, U+FFFF)
_NOT_AS_YAML = re.compile("[\x7f-\x9f\u2028\u2029\ufffe\uffff]")


def _float_as_yaml(literal: str) -> float | str:
    return float(literal) if _YAML_FLOAT.fullmatch(literal) else literal


def _json_object(text: str) -> Any:
    """``text`` parsed as a JSON object with unique keys, else :data:`_NOT_JSON` (YAML then
    parses it, and words any error with its line and column: a duplicate key included). The
    values are those YAML reads: a number YAML reads as a string (``1e3``) is one here, and a
    text holding a character YAML reads differently goes to YAML."""
    if not text.lstrip().startswith("{") or _NOT_AS_YAML.search(text):
        return _NOT_JSON
    try:
        return json.loads(
            text,
            object_pairs_hook=_unique_pairs,
            parse_constant=_no_constant,
            parse_float=_float_as_yaml,
        )
    except (ValueError, RecursionError):  # not JSON (YAML's flow style), a duplicate key, NaN
        return _NOT_JSON


def parse_config(
    data: Any,
    *,
    env: Mapping[str, str] | None = None,
    base_dir: str | Path | None = None,
    source: str | None = None,
) -> Config:
    """Validate already-parsed YAML/JSON data (``${VAR}`` substitution included).

    Args:
        data: the parsed document (a mapping).
        env: the variables for ``${VAR}`` (default ``os.environ``).
        base_dir: directory that relative tokenizer / template paths are relative to.
        source: a name for error messages (the file name).

    Raises:
        ConfigError: every problem found, as ``(path, message)`` issues.
    """
    if data is None:
        raise ConfigError([("", "the file is empty")], source)
    if not isinstance(data, dict):
        raise ConfigError([("", "the top level must be a mapping of settings")], source)
    issues: list[tuple[str, str]] = []
    data = _substitute(data, "", os.environ if env is None else env, issues)
    if issues:
        raise ConfigError(issues, source)
    context = {"base_dir": str(base_dir) if base_dir is not None else None, "env": env}
    try:
        return Config.model_validate(data, context=context)
    except ValidationError as exc:
        raise ConfigError(issues_from(exc), source) from None


def load_config(path: str | Path, *, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a kvgate YAML configuration file.

    Args:
        path: the file. Relative tokenizer / chat-template paths inside it are resolved against
            its directory.
        env: the variables for ``${VAR}`` substitution (default ``os.environ``).

    Returns:
        The validated, frozen :class:`Config`.

    Raises:
        ConfigError: the file cannot be read, is not YAML (with line and column), or any field
            is invalid (every bad field listed with its path).

    A file that is a JSON object (JSON is YAML too) is read by the standard library's JSON
    parser: the same document, several times faster and in a third of the memory (100,000
    tenants: 1.4 s against 12.7 s and 185 MB against 530 MB at the peak, validation included;
    ``benches/tenants/run.py``).
    """
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError([("", f"cannot read the file: {reason}")], source) from None
    deep = ConfigError([("", "not a configuration: nested too deeply")], source)
    try:
        data = _json_object(text)
        if data is _NOT_JSON:
            try:
                data = yaml.load(text, Loader=_FastUniqueKeyLoader)  # SafeLoader kin: no objects
            except yaml.YAMLError:
                data = yaml.load(text, Loader=_UniqueKeyLoader)  # for the pure-Python message
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([("", f"not valid YAML: {where}{problem}")], source) from None
    except RecursionError:
        raise deep from None
    except ValueError as exc:  # a number Python will not read (an integer of 4,300+ digits)
        raise ConfigError([("", f"not valid YAML: {exc}")], source) from None
    try:
        return parse_config(data, env=env, base_dir=path.parent.resolve(), source=source)
    except RecursionError:
        raise deep from None
