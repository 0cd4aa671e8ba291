"""Zero-configuration discovery: what an engine says about itself over HTTP, for ``kvgate serve
--upstream URL``.

What: :func:`discover_engine` asks one engine, at start-up, for the engine type, the models it
serves with each model's context window, its own concurrency limit (the batch size it runs),
its KV-cache capacity in tokens, and (llama.cpp) its chat template, and records where each value
came from. The quick start builds the backend from this (:mod:`kvgate.cli_serve`); the poller
keeps the KV capacity and the KV usage current afterwards (:mod:`kvgate.telemetry.poller`).

Where each value comes from (the first that answers wins):

- engine type: the metric names of ``GET /metrics``
  (:func:`~kvgate.telemetry.engine_metrics.detect_engine`), else the ``owned_by`` field of
  ``GET /v1/models`` (llama.cpp ``llamacpp``, vLLM ``vllm``, SGLang ``sglang``), else which of
  ``GET /props`` (llama.cpp: ``total_slots``), ``GET /info`` (TGI: ``max_concurrent_requests``)
  or ``GET /get_server_info`` (SGLang: ``max_running_requests``) answers;
- context window per model: vLLM and SGLang ``GET /v1/models`` ``max_model_len``; llama.cpp
  ``GET /v1/models`` ``meta.n_ctx`` and ``GET /props`` ``default_generation_settings.n_ctx``
  (both the context of one slot); TGI ``GET /info`` ``max_total_tokens`` (prompt + completion);
  SGLang ``GET /get_server_info`` ``context_length``;
- concurrency: llama.cpp ``GET /props`` ``total_slots`` (``--parallel``); SGLang
  ``max_running_requests``; TGI ``max_concurrent_requests`` (TGI answers 429 above it). vLLM
  states none over HTTP;
- KV capacity (tokens): vLLM ``vllm:cache_config_info`` ``num_gpu_blocks × block_size``; SGLang
  ``sglang:max_total_num_tokens`` or ``max_total_num_tokens`` of ``/get_server_info``; TGI
  ``tgi_batch_max_total_tokens``; llama.cpp slots × the slot context, or one slot context when
  the KV cache is unified (see :func:`llamacpp_unified`);
- prefill chunk (tokens an engine prefills in one step, which sizes the default prefill budget,
  :mod:`kvgate.admission.prefill`): SGLang ``chunked_prefill_size`` of ``/get_server_info``
  (``-1`` or absent when chunked prefill is off: then ``max_prefill_tokens``, its token budget of
  one prefill batch). vLLM, TGI and llama.cpp state none over HTTP;
- chat template (llama.cpp ``GET /props`` ``chat_template``): prefixed with the BOS text when
  the engine adds BOS in front of the prompt (``POST /tokenize`` of an empty text with
  ``add_special`` answers one token), so the rendered template counts what the engine counts.

Errors: only ``GET /v1/models`` is required (:class:`DiscoveryError` when it cannot be read);
every other endpoint is optional and a failure there just leaves the value unknown. A redirect
is an error (the engine's API key is not sent to wherever an answer points), and so is a body
over :data:`MAX_BODY_BYTES` or one still arriving at the caller's deadline.
"""

from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from kvgate._core import MAX_AMOUNT
from kvgate.telemetry.engine_metrics import (
    MetricsError,
    SlotsSnapshot,
    detect_engine,
    parse_llamacpp_slots,
    parse_samples,
    read_engine_metrics,
)

__all__ = [
    "MAX_BODY_BYTES",
    "DiscoveryError",
    "EngineInfo",
    "ModelInfo",
    "discover_engine",
    "llamacpp_unified",
]

logger = logging.getLogger("kvgate.discovery")

#: The largest answer read from one endpoint (bytes): a larger one counts as no answer. A
#: llama.cpp ``/props`` with its chat template, or a ``/metrics`` page, is well under 1 MiB.
MAX_BODY_BYTES = 16 * 1024 * 1024


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx answer is an error, not followed (urllib would send the API key along)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)

# ``owned_by`` of GET /v1/models → engine (llama.cpp writes "llamacpp", vLLM "vllm", SGLang
# "sglang"; TGI "text-generation-inference")
_OWNED_BY = {
    "llamacpp": "llamacpp",
    "vllm": "vllm",
    "sglang": "sglang",
    "text-generation-inference": "tgi",
}


class DiscoveryError(ValueError):
    """The engine's ``GET /v1/models`` cannot be read (unreachable, not JSON, an error status)."""


@dataclass(slots=True)
class ModelInfo:
    """One served model. ``context_window`` in tokens (``None``: the engine does not say);
    ``source`` names the endpoint and field it came from; ``n_ctx_train`` (llama.cpp) is the
    model's training context."""

    name: str
    context_window: int | None = None
    source: str | None = None
    n_ctx_train: int | None = None


@dataclass(slots=True)
class EngineInfo:
    """What one engine says about itself (``None`` = not stated). ``sources`` maps each field
    (``engine``, ``slots``, ``kv_capacity_tokens``, ``kv_unified``, ``prefill_chunk_tokens``,
    ``chat_template``) to the endpoint and field it came from. ``prefill_chunk_tokens``: prompt
    tokens the engine prefills in one step (tokens)."""

    url: str
    engine: str | None = None
    models: list[ModelInfo] = field(default_factory=list)
    slots: int | None = None
    kv_capacity_tokens: int | None = None
    kv_unified: bool | None = None
    prefill_chunk_tokens: int | None = None
    chat_template: str | None = None
    sources: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (``/admin/state``); the chat template is reduced to its length."""
        out = asdict(self)
        out["chat_template"] = None if self.chat_template is None else len(self.chat_template)
        return out

    def describe(self) -> str:
        """One line per fact, with its source (what ``kvgate serve`` prints at start-up)."""
        src = self.sources
        lines = [f"engine: {self.engine or 'unknown'} ({src.get('engine', 'not detected')})"]
        for m in self.models:
            ctx = m.context_window if m.context_window is not None else "unknown"
            lines.append(f"model {m.name}: context {ctx} tokens ({m.source or 'not stated'})")
        slots = self.slots if self.slots is not None else "unknown"
        lines.append(f"slots: {slots} ({src.get('slots', 'not stated')})")
        kv = self.kv_capacity_tokens if self.kv_capacity_tokens is not None else "unknown"
        lines.append(f"KV capacity: {kv} tokens ({src.get('kv_capacity_tokens', 'not stated')})")
        if self.kv_unified is not None:
            lines.append(f"unified KV cache: {self.kv_unified} ({src.get('kv_unified', '')})")
        if self.prefill_chunk_tokens is not None:
            lines.append(
                f"prefill chunk: {self.prefill_chunk_tokens} tokens "
                f"({src.get('prefill_chunk_tokens', '')})"
            )
        if self.chat_template is not None:
            lines.append(f"chat template: {src.get('chat_template', '')}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class _Http:
    """How to ask one engine: seconds per request, the headers every request carries (the
    engine's API key, for engines started with one), and the ``time.monotonic()`` after which
    no request starts and a body still arriving is dropped (``None``: no deadline)."""

    timeout: float
    headers: dict[str, str]
    deadline: float | None = None

    def request(self, url: str, data: bytes | None = None) -> urllib.request.Request:
        headers = dict(self.headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        return urllib.request.Request(
            url, data=data, headers=headers, method="POST" if data is not None else "GET"
        )

    def fetch(self, url: str, data: bytes | None = None) -> tuple[int, bytes]:
        """The status and body of one answer (at most :data:`MAX_BODY_BYTES`).

        Raises:
            OSError: unreachable, an error status or a redirect (``HTTPError``), a timeout, or
                the deadline passed.
            ValueError: a body over :data:`MAX_BODY_BYTES`.
        """
        timeout = self.timeout
        if self.deadline is not None:
            timeout = min(timeout, self.deadline - time.monotonic())
            if timeout <= 0:
                raise TimeoutError("the discovery deadline passed")
        with _OPENER.open(self.request(url, data), timeout=timeout) as resp:
            chunks: list[bytes] = []
            size = 0
            while chunk := resp.read1(64 * 1024):
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise ValueError(f"{url}: answer over {MAX_BODY_BYTES} bytes")
                if self.deadline is not None and time.monotonic() > self.deadline:
                    raise TimeoutError(f"{url}: answer still arriving at the discovery deadline")
                chunks.append(chunk)
            return int(resp.status), b"".join(chunks)


def _get(url: str, http: _Http) -> bytes | None:
    """The body of a 200 answer, or ``None`` (any error: the endpoint is optional)."""
    try:
        status, body = http.fetch(url)
    except (OSError, ValueError):
        return None
    return body if status == 200 else None


def _json(body: bytes | None) -> Any:
    if body is None:
        return None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def _pos_int(value: Any) -> int | None:
    """A count an engine states: a positive integer the admission core can hold (at most
    ``MAX_AMOUNT``), else ``None`` (garbage, or nothing stated)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_AMOUNT:
        return value
    return None


def llamacpp_unified(slots: int, slot_n_ctx: int, n_ctx_train: int | None) -> bool:
    """Whether a llama.cpp server (this build states no flag for it) most likely runs one
    unified KV pool shared by all slots.

    llama-server turns ``--kv-unified`` on by itself when ``--parallel`` is not given (4 slots,
    each seeing the whole context, which defaults to the model's training context); with
    ``--parallel N`` each slot gets ``ctx-size / N`` of its own. So several slots that each see
    the model's whole training context are read as unified (capacity = one slot's context); any
    other shape as separate per-slot caches (capacity = slots × slot context). A server started
    with ``--kv-unified`` and a smaller ``--ctx-size`` is not recognised: give kvgate
    ``--inflight-tokens`` then.
    """
    return slots > 1 and n_ctx_train is not None and slot_n_ctx >= n_ctx_train


def _models(data: Any, info: EngineInfo) -> None:
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise DiscoveryError("GET /v1/models did not answer an OpenAI model list")
    for item in data["data"]:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            continue
        m = ModelInfo(item["id"])
        if (v := _pos_int(item.get("max_model_len"))) is not None:
            m.context_window, m.source = v, "GET /v1/models max_model_len"
        meta = item.get("meta")
        if isinstance(meta, dict):
            if m.context_window is None and (v := _pos_int(meta.get("n_ctx"))) is not None:
                m.context_window, m.source = v, "GET /v1/models meta.n_ctx"
            m.n_ctx_train = _pos_int(meta.get("n_ctx_train"))
        info.models.append(m)
        owner = item.get("owned_by")
        if info.engine is None and isinstance(owner, str) and owner in _OWNED_BY:
            info.engine = _OWNED_BY[owner]
            info.sources["engine"] = f"GET /v1/models owned_by {owner!r}"


def _props(base: str, info: EngineInfo, http: _Http, props: dict[str, Any]) -> int | None:
    """Slots, slot context and chat template from llama.cpp's ``GET /props`` (also served by
    ``kvgate sim``); returns the slot context (tokens) or ``None``."""
    if (v := _pos_int(props.get("total_slots"))) is not None:
        info.slots = v
        info.sources["slots"] = "GET /props total_slots"
    settings = props.get("default_generation_settings")
    slot_ctx = _pos_int(settings.get("n_ctx")) if isinstance(settings, dict) else None
    if slot_ctx is not None:
        for m in info.models:
            if m.context_window is None:
                m.context_window = slot_ctx
                m.source = "GET /props default_generation_settings.n_ctx"
    template = props.get("chat_template")
    if isinstance(template, str) and template.strip():
        bos = props.get("bos_token")
        if _adds_bos(base, http) and isinstance(bos, str) and bos and "{" not in bos:
            info.chat_template = bos + template
            info.sources["chat_template"] = (
                "GET /props chat_template, after the BOS the engine adds (POST /tokenize)"
            )
        else:
            info.chat_template = template
            info.sources["chat_template"] = "GET /props chat_template"
    return slot_ctx


def _llamacpp_kv(base: str, info: EngineInfo, http: _Http, slot_ctx: int | None) -> None:
    """llama.cpp KV capacity: ``GET /slots`` (slot count and contexts when ``/props`` said
    nothing), then :func:`llamacpp_unified`."""
    snapshot: SlotsSnapshot | None = None
    raw = _get(base + "/slots", http)
    if raw is not None:
        try:
            snapshot = parse_llamacpp_slots(raw)
        except MetricsError:
            snapshot = None
    if info.slots is None and snapshot is not None and snapshot.total:
        info.slots = snapshot.total
        info.sources["slots"] = "GET /slots (entries)"
    if slot_ctx is None and snapshot is not None and snapshot.total:
        slot_ctx = snapshot.n_ctx_total // snapshot.total
    if not (info.slots and slot_ctx):
        return
    train = next((m.n_ctx_train for m in info.models if m.n_ctx_train), None)
    info.kv_unified = llamacpp_unified(info.slots, slot_ctx, train)
    if info.kv_unified:
        info.kv_capacity_tokens = slot_ctx
        info.sources["kv_unified"] = (
            f"{info.slots} slots each see the model's whole training context ({train})"
        )
        info.sources["kv_capacity_tokens"] = "one slot context (unified KV pool)"
    else:
        info.kv_capacity_tokens = info.slots * slot_ctx
        info.sources["kv_unified"] = "each slot has a share of the context (per-slot KV)"
        info.sources["kv_capacity_tokens"] = "slots × slot context"


def _adds_bos(base: str, http: _Http) -> bool:
    """llama.cpp: whether tokenizing with special tokens adds BOS (``POST /tokenize`` of an
    empty text answers one token then)."""
    try:
        _, body = http.fetch(base + "/tokenize", b'{"content": "", "add_special": true}')
        data = orjson.loads(body)
    except (OSError, ValueError):
        return False
    tokens = data.get("tokens") if isinstance(data, dict) else None
    return isinstance(tokens, list) and len(tokens) == 1


def _tgi(info: EngineInfo, data: Any) -> None:
    if not isinstance(data, dict):
        return
    if (v := _pos_int(data.get("max_concurrent_requests"))) is not None:
        info.slots = v
        info.sources["slots"] = "GET /info max_concurrent_requests"
    if (v := _pos_int(data.get("max_total_tokens"))) is not None:
        for m in info.models:
            if m.context_window is None:
                m.context_window, m.source = v, "GET /info max_total_tokens"


def _sglang(info: EngineInfo, data: Any) -> None:
    if not isinstance(data, dict):
        return
    nested = data.get("server_args")  # some versions nest the arguments
    args: dict[str, Any] = nested if isinstance(nested, dict) else data
    if (v := _pos_int(args.get("max_running_requests"))) is not None:
        info.slots = v
        info.sources["slots"] = "GET /get_server_info max_running_requests"
    if (v := _pos_int(args.get("context_length"))) is not None:
        for m in info.models:
            if m.context_window is None:
                m.context_window, m.source = v, "GET /get_server_info context_length"
    # one prefill step: the chunk when chunked prefill is on (SGLang's -1 turns it off), else
    # the token budget of one prefill batch
    for name in ("chunked_prefill_size", "max_prefill_tokens"):
        if (v := _pos_int(args.get(name))) is not None:
            info.prefill_chunk_tokens = v
            info.sources["prefill_chunk_tokens"] = f"GET /get_server_info {name}"
            break
    cap = _pos_int(data.get("max_total_num_tokens"))
    if info.kv_capacity_tokens is None and cap is not None:
        info.kv_capacity_tokens = cap
        info.sources["kv_capacity_tokens"] = "GET /get_server_info max_total_num_tokens"


def discover_engine(
    url: str,
    *,
    metrics_url: str | None = None,
    timeout: float = 5.0,
    api_key: str | None = None,
    deadline: float | None = None,
) -> EngineInfo:
    """Ask the engine at ``url`` (base URL, no ``/v1``) what it serves; see the module docstring.

    Args:
        url: the engine's base URL.
        metrics_url: its Prometheus endpoint (default ``url + "/metrics"``).
        timeout: seconds per HTTP request.
        api_key: sent as ``Authorization: Bearer <key>`` with every request (an engine started
            with an API key refuses requests without it, its ``/v1/models`` included).
        deadline: a ``time.monotonic()`` value: no request starts after it, and an answer still
            arriving then counts as none (``None``: each request has ``timeout`` seconds, and
            an engine that answers every endpoint slowly takes several timeouts in all).

    Raises:
        DiscoveryError: ``GET /v1/models`` cannot be read (also when the deadline passed).
    """
    base = url.rstrip("/")
    info = EngineInfo(url=base)
    http = _Http(timeout, {"Authorization": f"Bearer {api_key}"} if api_key else {}, deadline)
    try:
        models = orjson.loads(http.fetch(base + "/v1/models")[1])
    except (OSError, ValueError) as exc:
        raise DiscoveryError(f"cannot list models at {base}/v1/models: {exc}") from None
    metrics = _get(metrics_url or base + "/metrics", http)
    if metrics is not None:
        try:
            info.engine = detect_engine(parse_samples(metrics)[0])
            info.sources["engine"] = "GET /metrics metric names"
        except MetricsError:
            pass
    _models(models, info)
    if info.engine in (None, "llamacpp", "vllm"):
        # llama.cpp's /props; kvgate sim (vLLM metrics) serves one too
        props = _json(_get(base + "/props", http))
        if isinstance(props, dict) and "total_slots" in props:
            if info.engine is None:
                info.engine, info.sources["engine"] = "llamacpp", "GET /props total_slots"
            slot_ctx = _props(base, info, http, props)
            if info.engine == "llamacpp":
                _llamacpp_kv(base, info, http, slot_ctx)
    if info.engine in (None, "tgi"):
        data = _json(_get(base + "/info", http))
        if isinstance(data, dict) and "max_concurrent_requests" in data:
            if info.engine is None:
                info.engine, info.sources["engine"] = "tgi", "GET /info max_concurrent_requests"
            _tgi(info, data)
    if info.engine in (None, "sglang"):
        data = _json(_get(base + "/get_server_info", http))
        if isinstance(data, dict):
            if info.engine is None and "max_running_requests" in data:
                info.engine, info.sources["engine"] = "sglang", "GET /get_server_info"
            if info.engine == "sglang":
                _sglang(info, data)
    if metrics is not None and info.engine not in (None, "llamacpp"):
        try:
            reading = read_engine_metrics(metrics, info.engine, strict=False)
        except MetricsError:
            reading = None
        if reading is not None and reading.kv_capacity_tokens and info.kv_capacity_tokens is None:
            info.kv_capacity_tokens = reading.kv_capacity_tokens
            where = reading.sources.get("kv_capacity_tokens", "")
            info.sources["kv_capacity_tokens"] = f"GET /metrics {where}".strip()
    logger.debug("discovered %s: %s", base, info)
    return info
