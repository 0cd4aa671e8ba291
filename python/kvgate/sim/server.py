"""The simulator's HTTP face: an OpenAI-compatible aiohttp app in front of :class:`Engine`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses`` (all
streaming and not), ``POST /v1/embeddings``, ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text, vLLM names), ``GET /props`` and ``GET /slots`` (llama.cpp's shapes: batch
places, context, chat template, tokens held per running sequence), ``GET /sim/state`` (JSON
snapshot of the engine, for tests) and ``POST /sim/reset-peaks``.

Per-user oracle, so tests judge a gateway in front by what the engine really ran: a generation
request's tenant is the body's standard OpenAI ``user`` field (a string; absent or null → ``""``;
any other type → 400), since a gateway forwards the body but not the client's headers.
``/sim/state`` gives ``by_user``: ``{user: {"running", "peak_running", "requests", "in_flight",
"peak_in_flight", "prompt_tokens", "completion_tokens"}}`` (see
:class:`kvgate.sim.engine.UserStats`) and the overall ``peak_running``, ``in_flight`` and
``peak_in_flight``; peaks are kept exactly at each admission into the running set (each
request's start for in flight). ``POST /sim/reset-peaks`` sets every peak to its current value
and answers the new snapshot.

Conventions followed (see docs/engines.md): errors use vLLM ≥ 0.10.1's nested body
``{"error": {"message", "type", "param", "code"}}`` with ``type`` an exception-class name and
``code`` the integer status; streams are SSE ``data: <json>`` events ending with
``data: [DONE]``; ``stream_options.include_usage`` adds a final ``choices: []`` chunk carrying
``usage`` and ``"usage": null`` on every other chunk (OpenAI); an error after the 200 status line
is a ``data: {"error": ...}`` event. A Responses stream (OpenAI's Responses API, as vLLM serves
it) names its events (``event: response.output_text.delta``, one per token) and ends with
``response.completed`` carrying ``usage`` (``input_tokens``, ``output_tokens``,
``total_tokens``); an error after the first event is an ``event: error``. Generation runs on one asyncio task (the step loop), which
waits on an event when there is no work, and streams one token per decode step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import random
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine, Event, FailEvent, Sequence, prefix_block_hashes
from kvgate.sim.tokens import TokenCounter, render_chat

MAX_N = 128
"""Most choices (``n``) one request may ask for."""


# --------------------------------------------------------------------------- errors


class BadRequest(Exception):
    """A request the simulator refuses; rendered as vLLM's nested error body."""

    def __init__(
        self, message: str, *, status: int = 400, err_type: str = "BadRequestError"
    ) -> None:
        """``status`` is the HTTP status (also the body's integer ``code``)."""
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type


def error_body(message: str, err_type: str, status: int, param: str | None = None) -> bytes:
    """vLLM ≥ 0.10.1 error JSON: ``{"error": {"message", "type", "param", "code": status}}``."""
    return orjson.dumps(
        {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    )


def error_response(status: int, message: str, err_type: str) -> web.Response:
    """A JSON error response with :func:`error_body`."""
    return web.Response(
        status=status, body=error_body(message, err_type, status), content_type="application/json"
    )


# --------------------------------------------------------------------------- app state


@dataclass(slots=True)
class SimState:
    """Per-app state: the engine, the step loop's wake-up event and the per-sequence sinks."""

    config: SimConfig
    engine: Engine
    counter: TokenCounter
    registry: CollectorRegistry
    clock: Any = time.monotonic
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    sinks: dict[int, asyncio.Queue[Event]] = field(default_factory=dict)
    next_id: int = 0

    def new_id(self, prefix: str) -> str:
        """A response id such as ``chatcmpl-000000000000002a`` (a counter, deterministic)."""
        self.next_id += 1
        return f"{prefix}-{self.next_id:016x}"

    def dispatch(self, events: Iterable[Event]) -> None:
        """Hand each event to its request's queue (events of aborted sequences are dropped)."""
        for ev in events:
            q = self.sinks.get(ev.seq_id)
            if q is None:
                continue
            q.put_nowait(ev)
            if isinstance(ev, FailEvent) or ev.finish_reason is not None:
                del self.sinks[ev.seq_id]


STATE: web.AppKey[SimState] = web.AppKey("kvgate_sim_state", SimState)


async def _step_loop(state: SimState) -> None:
    """The engine loop: step, sleep the step's duration, deliver its tokens; idle on an event."""
    engine = state.engine
    while True:
        if not engine.has_work:
            state.wake.clear()
            await state.wake.wait()
            continue
        result = engine.step(state.clock())
        if not result.progressed:
            state.wake.clear()
            await state.wake.wait()
            continue
        await asyncio.sleep(result.duration_s)
        state.dispatch(result.events)


# --------------------------------------------------------------------------- metrics


class _SimCollector:
    """Renders the engine's state in vLLM's metric names at scrape time (docs/engines.md §1)."""

    def __init__(self, state: SimState) -> None:
        self._state = state

    def collect(self) -> Iterable[Metric]:
        st = self._state
        cfg, e = st.config, st.engine
        e.is_healthy(st.clock())
        v0 = cfg.metric_names == "v0"
        names: list[str] = ["model_name"] if v0 else ["model_name", "engine"]
        values: list[str] = [cfg.model] if v0 else [cfg.model, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            len(e.running),
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            len(e.waiting),
        )
        usage = e.kv_cache_usage
        if cfg.metric_names in ("v1", "both"):
            yield gauge(
                "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage
            )
        if cfg.metric_names in ("v0", "both"):
            doc = "GPU KV-cache usage. 1 means 100 percent usage."
            if cfg.metric_names == "both":
                doc += " DEPRECATED: Use vllm:kv_cache_usage_perc instead."
            yield gauge("vllm:gpu_cache_usage_perc", doc, usage)
        if v0:
            yield gauge(
                "vllm:cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent usage.", 0.0
            )
            yield gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU.", 0)
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            e.preemptions,
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", e.prompt_tokens_total
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            e.generation_tokens_total,
        )
        if not v0:  # vLLM V1's prefix-cache counters, in tokens (0 without prefix caching)
            yield counter(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                e.prefix_cache_queries,
            )
            yield counter(
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                e.prefix_cache_hits,
            )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*names, "finished_reason"],
        )
        for reason, count in e.finished.items():
            success.add_metric([*values, reason], count)
        yield success
        info_labels = {
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(cfg.prefix_caching),
            "gpu_memory_utilization": "0.9",
            "num_gpu_blocks": str(cfg.kv_blocks),
        }
        if not v0:
            info_labels["engine"] = "0"
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(info_labels),
        )
        info.add_metric(list(info_labels.values()), 1.0)
        yield info
        # The simulator's own series (not vLLM names).
        yield counter(
            "kvgate_sim_oom", "Simulated CUDA out-of-memory crashes (--on-overflow oom).", e.ooms
        )
        yield counter(
            "kvgate_sim_failed_requests", "Sequences failed by a simulated OOM crash.", e.failed
        )
        yield counter(
            "kvgate_sim_aborted_requests",
            "Sequences aborted because the client went away.",
            e.aborted,
        )
        yield counter(
            "kvgate_sim_wasted_tokens",
            "Tokens generated for sequences that were then aborted (generated for nobody).",
            e.wasted_tokens,
        )
        yield gauge(
            "kvgate_sim_healthy",
            "1 when healthy, 0 while restarting after an OOM.",
            1.0 if e.down_until is None else 0.0,
        )
        yield gauge("kvgate_sim_kv_blocks_used", "KV-cache blocks in use.", e.used_blocks)
        yield gauge(
            "kvgate_sim_kv_cache_usage_peak",
            "Highest KV-cache usage since start (ratio 0..1; 1 = every block was in use).",
            e.peak_used_blocks / cfg.kv_blocks,
        )


# --------------------------------------------------------------------------- request parsing


def _get_int(body: dict[str, Any], key: str, *, minimum: int, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{key}' must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise BadRequest(f"'{key}' must be at least {minimum}, got {value}")
    return value


def _get_bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be a boolean, got {type(value).__name__}")
    return value


def _without_lone_surrogates(value: Any) -> Any:
    """``value`` (parsed JSON) with every lone UTF-16 surrogate in its strings made U+FFFD."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [_without_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_without_lone_surrogates(k): _without_lone_surrogates(v) for k, v in value.items()}
    return value


async def _read_json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        # orjson refuses a lone surrogate escape ("\ud800"), which vLLM (Python's json) accepts
        if "surrogate" not in str(exc):
            raise BadRequest(f"Invalid JSON body: {exc}") from None
        try:
            body = _without_lone_surrogates(json.loads(raw))
        except (ValueError, RecursionError):
            raise BadRequest(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object")
    return body


def _check_model(state: SimState, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and model != state.config.model:
        raise BadRequest(
            f"The model `{model}` does not exist.", status=404, err_type="NotFoundError"
        )


def _context_error(ctx: int, prompt: int, completion: int | None, what: str) -> BadRequest:
    if completion is None:
        return BadRequest(
            f"This model's maximum context length is {ctx} tokens. However, your request has "
            f"{prompt} input tokens. Please reduce the length of the input {what}."
        )
    return BadRequest(
        f"This model's maximum context length is {ctx} tokens. However, you requested "
        f"{prompt + completion} tokens ({prompt} in the {what}, {completion} in the completion). "
        f"Please reduce the length of the {what} or completion."
    )


def _parse_prompts(value: Any, key: str) -> list[str | list[int]]:
    """``prompt``/``input``: a string, a list of strings, a list of ints, or a list of lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [list(value)]
        if all(
            isinstance(v, list)
            and v
            and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
            for v in value
        ):
            return [list(v) for v in value]
    raise BadRequest(
        f"'{key}' must be a non-empty string, list of strings, list of token ids, "
        "or list of token-id lists"
    )


@dataclass(slots=True)
class _Job:
    """A parsed generation request: one entry per prompt, ``n`` sequences each."""

    kind: str  # "chat" | "completion" | "responses"
    prompts: list[tuple[int, bytes]]  # (prompt tokens, fingerprint)
    n: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool
    min_tokens: int
    user: str = ""  # the body's OpenAI ``user`` field, the key of the per-user oracle
    hashes: list[list[bytes]] = field(default_factory=list)  # per prompt, with prefix caching
    ended: bool = False  # left the in-flight count (:func:`_end`)


def _end(state: SimState, job: _Job) -> None:
    """``job`` leaves the engine's in-flight count, once: when its last sequence finished,
    before its last bytes are written (a real engine is done with a request when it produces
    the last token, and a gateway may admit the next request as soon as it reads them), or
    when it failed or was aborted."""
    if not job.ended:
        job.ended = True
        state.engine.end_request(job.user)


def _common(state: SimState, body: dict[str, Any], job: _Job, what: str) -> _Job:
    """Check every prompt against the context window (vLLM's 400); read ``user``."""
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest(f"'user' must be a string, got {type(user).__name__}")
    job.user = user or ""
    ctx = state.config.context_window
    for tokens, _ in job.prompts:
        if tokens >= ctx:
            raise _context_error(ctx, tokens, None, what)
        if job.max_tokens is not None and tokens + job.max_tokens > ctx:
            raise _context_error(ctx, tokens, job.max_tokens, what)
    return job


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _get_bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise BadRequest("'stream_options' must be an object")
        if not stream:
            raise BadRequest("Stream options can only be defined when `stream=True`.")
    include_usage = bool(opts and opts.get("include_usage"))
    return stream, include_usage


def _parse_chat(state: SimState, body: dict[str, Any]) -> _Job:
    _check_model(state, body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(f"messages[{i}].content must be a string, a list of parts, or null")
    max_tokens = _get_int(body, "max_completion_tokens", minimum=1, default=None)
    if max_tokens is None:
        max_tokens = _get_int(body, "max_tokens", minimum=1, default=None)
    stream, include_usage = _stream_flags(body)
    text = render_chat(messages)
    try:
        templated = state.counter.count_chat(messages)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    job = _Job(
        kind="chat",
        prompts=[(max(1, templated or state.counter.count(text)), text.encode())],
        n=_get_int(body, "n", minimum=1, default=1) or 1,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        ignore_eos=_get_bool(body, "ignore_eos"),
        min_tokens=_get_int(body, "min_tokens", minimum=0, default=0) or 0,
    )
    job.hashes = [_block_hashes(state, text)]
    _extra_seed(body, job)
    return _common(state, body, job, "messages")


def _responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses body as the chat messages it renders as: ``instructions`` a system message,
    ``input`` a string (one user message) or items (messages whose ``content`` is a string or
    ``input_text`` / ``output_text`` parts; ``function_call`` and ``function_call_output``)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' is required and must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{i}] must be an object")
        kind = item.get("type")
        if "role" in item:
            content = item.get("content")
            if isinstance(content, list):
                content = [
                    {"type": "text", "text": p.get("text", "")}
                    for p in content
                    if isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                ]
            elif content is not None and not isinstance(content, str):
                raise BadRequest(f"input[{i}].content must be a string or a list of parts")
            messages.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            call = {"function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "content": str(item.get("output", ""))})
        else:
            raise BadRequest(f"input[{i}]: unsupported item type {kind!r}")
    return messages


def _parse_responses(state: SimState, body: dict[str, Any]) -> _Job:
    _check_model(state, body)
    text = render_chat(_responses_messages(body))
    job = _Job(
        kind="responses",
        prompts=[(max(1, state.counter.count(text)), text.encode())],
        n=1,
        max_tokens=_get_int(body, "max_output_tokens", minimum=1, default=None),
        stream=_get_bool(body, "stream"),
        include_usage=True,  # a Responses answer always carries its usage
        ignore_eos=_get_bool(body, "ignore_eos"),
        min_tokens=_get_int(body, "min_tokens", minimum=0, default=0) or 0,
    )
    job.hashes = [_block_hashes(state, text)]
    _extra_seed(body, job)
    return _common(state, body, job, "input")


def _extra_seed(body: dict[str, Any], job: _Job) -> None:
    """Fold a per-request ``seed`` into the fingerprints (same seed, same output)."""
    seed = _get_int(body, "seed", minimum=-(2**63), default=None)
    if seed is not None:
        job.prompts = [(t, fp + b"|seed=" + str(seed).encode()) for t, fp in job.prompts]


def _block_hashes(state: SimState, prompt: str | list[int]) -> list[bytes]:
    """The prompt's full-block hashes for prefix caching (none without it): over its token ids
    (given, or from the tokenizer file), else over its UTF-8 bytes read 4 to a token."""
    cfg = state.config
    if not cfg.prefix_caching:
        return []
    if isinstance(prompt, str):
        ids = state.counter.token_ids(prompt)
        units: bytes | list[int] = prompt.encode() if ids is None else ids
    else:
        units = prompt
    return prefix_block_hashes(units, cfg.block_size)


def _prompt_tokens(state: SimState, prompt: str | list[int]) -> tuple[int, bytes]:
    if isinstance(prompt, str):
        return max(1, state.counter.count(prompt)), prompt.encode()
    return len(prompt), orjson.dumps(prompt)


def _parse_completion(state: SimState, body: dict[str, Any]) -> _Job:
    _check_model(state, body)
    if "prompt" not in body:
        raise BadRequest("'prompt' is required")
    prompts = _parse_prompts(body["prompt"], "prompt")
    stream, include_usage = _stream_flags(body)
    job = _Job(
        kind="completion",
        prompts=[_prompt_tokens(state, p) for p in prompts],
        n=_get_int(body, "n", minimum=1, default=1) or 1,
        # vLLM's CompletionRequest and OpenAI's spec: max_tokens defaults to 16.
        max_tokens=_get_int(body, "max_tokens", minimum=1, default=16),
        stream=stream,
        include_usage=include_usage,
        ignore_eos=_get_bool(body, "ignore_eos"),
        min_tokens=_get_int(body, "min_tokens", minimum=0, default=0) or 0,
    )
    job.hashes = [_block_hashes(state, p) for p in prompts]
    _extra_seed(body, job)
    return _common(state, body, job, "prompt")


# --------------------------------------------------------------------------- handlers


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def _generate(request: web.Request, job: _Job) -> web.StreamResponse:
    """Queue the job's sequences, then stream or collect their tokens; abort them on exit."""
    state = request.app[STATE]
    engine = state.engine
    if not engine.is_healthy(state.clock()):
        return error_response(
            503, "The engine is restarting after CUDA out of memory.", "ServiceUnavailableError"
        )
    if job.n > MAX_N:
        return error_response(400, f"'n' must be at most {MAX_N}, got {job.n}", "BadRequestError")
    # The engine counts this request only after the disconnects it has already seen: aiohttp
    # learns of a closed connection at once (connection_lost) but delivers it to that
    # request's handler one event-loop turn later (handler_cancellation), so without this turn
    # a request that arrived right after another's disconnect would be counted while the gone
    # one still is, an overlap no engine has (the gone one's abort is the older event).
    await asyncio.sleep(0)
    seqs: list[Sequence] = []
    index: dict[int, int] = {}
    for p_i, (tokens, fingerprint) in enumerate(job.prompts):
        for j in range(job.n):
            seq = engine.new_sequence(
                tokens,
                job.max_tokens,
                fingerprint=fingerprint,
                index=j,
                ignore_eos=job.ignore_eos,
                min_tokens=job.min_tokens,
                user=job.user,
                block_hashes=job.hashes[p_i] if job.hashes else (),
            )
            index[seq.seq_id] = p_i * job.n + j
            seqs.append(seq)
    queue: asyncio.Queue[Event] = asyncio.Queue()
    for seq in seqs:
        state.sinks[seq.seq_id] = queue
        engine.add(seq)
    engine.begin_request(job.user)
    state.wake.set()
    prompt_total = sum(t for t, _ in job.prompts)
    try:
        if job.kind == "responses":
            if job.stream:
                return await _responses_stream(request, state, job, seqs[0], queue, prompt_total)
            return await _responses_collect(state, seqs[0], queue, prompt_total)
        if job.stream:
            return await _stream(request, state, job, seqs, index, queue, prompt_total)
        return await _collect(state, job, seqs, index, queue, prompt_total)
    finally:
        _end(state, job)
        freed = False
        for seq in seqs:
            state.sinks.pop(seq.seq_id, None)
            freed |= engine.abort(seq.seq_id)
        if freed:
            state.wake.set()


async def _collect(
    state: SimState,
    job: _Job,
    seqs: list[Sequence],
    index: dict[int, int],
    queue: asyncio.Queue[Event],
    prompt_total: int,
) -> web.Response:
    texts: dict[int, list[str]] = {s.seq_id: [] for s in seqs}
    reasons: dict[int, str] = {}
    while len(reasons) < len(seqs):
        ev = await queue.get()
        if isinstance(ev, FailEvent):
            return error_response(500, ev.message, "InternalServerError")
        texts[ev.seq_id].append(ev.text)
        if ev.finish_reason is not None:
            reasons[ev.seq_id] = ev.finish_reason
    completion = sum(s.generated for s in seqs)
    choices = []
    for seq in sorted(seqs, key=lambda s: index[s.seq_id]):
        text = "".join(texts[seq.seq_id])
        choice: dict[str, Any] = {"index": index[seq.seq_id], "logprobs": None}
        if job.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["finish_reason"] = reasons[seq.seq_id]
        choices.append(choice)
    body = {
        "id": state.new_id("chatcmpl" if job.kind == "chat" else "cmpl"),
        "object": "chat.completion" if job.kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": state.config.model,
        "choices": choices,
        "usage": _usage(prompt_total, completion),
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _stream(
    request: web.Request,
    state: SimState,
    job: _Job,
    seqs: list[Sequence],
    index: dict[int, int],
    queue: asyncio.Queue[Event],
    prompt_total: int,
) -> web.StreamResponse:
    chat = job.kind == "chat"
    usage_on = job.include_usage and not state.config.no_usage
    base: dict[str, Any] = {
        "id": state.new_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": state.config.model,
    }

    def chunk(choices: list[dict[str, Any]]) -> bytes:
        obj = {**base, "choices": choices}
        if usage_on:
            obj["usage"] = None
        return _sse(obj)

    resp: web.StreamResponse | None = None
    done = 0
    while done < len(seqs):
        ev = await queue.get()
        if isinstance(ev, FailEvent):
            if resp is None:  # nothing sent yet: a real 500
                return error_response(500, ev.message, "InternalServerError")
            await resp.write(_sse(orjson.loads(error_body(ev.message, "InternalServerError", 500))))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        if resp is None:
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await resp.prepare(request)
            if chat:  # vLLM/OpenAI: a first chunk per choice with the role
                first = [
                    {
                        "index": index[s.seq_id],
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for s in sorted(seqs, key=lambda s: index[s.seq_id])
                ]
                await resp.write(chunk(first))
        i = index[ev.seq_id]
        if chat:
            choice: dict[str, Any] = {"index": i, "delta": {"content": ev.text}, "logprobs": None}
        else:
            choice = {"index": i, "text": ev.text, "logprobs": None}
        choice["finish_reason"] = ev.finish_reason
        await resp.write(chunk([choice]))
        if ev.finish_reason is not None:
            done += 1
    assert resp is not None  # every sequence produced at least one token
    _end(state, job)
    if usage_on:
        completion = sum(s.generated for s in seqs)
        await resp.write(_sse({**base, "choices": [], "usage": _usage(prompt_total, completion)}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _response_object(
    state: SimState, rid: str, status: str, output: list[Any], usage: dict[str, Any] | None
) -> dict[str, Any]:
    """A Responses API ``response`` object (the fields OpenAI's and vLLM's carry)."""
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": None,
        "metadata": {},
        "model": state.config.model,
        "output": output,
        "parallel_tool_calls": True,
        "temperature": 1.0,
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "usage": usage,
    }


def _responses_usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _message_item(mid: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status else []
    return {
        "type": "message",
        "id": mid,
        "status": status or "in_progress",
        "role": "assistant",
        "content": content,
    }


async def _responses_collect(
    state: SimState, seq: Sequence, queue: asyncio.Queue[Event], prompt_total: int
) -> web.Response:
    """A whole Responses answer: one ``message`` output item, ``usage`` at the top level."""
    texts: list[str] = []
    while True:
        ev = await queue.get()
        if isinstance(ev, FailEvent):
            return error_response(500, ev.message, "InternalServerError")
        texts.append(ev.text)
        if ev.finish_reason is not None:
            break
    status = "incomplete" if ev.finish_reason == "length" else "completed"
    item = _message_item(state.new_id("msg"), "".join(texts), "completed")
    usage = _responses_usage(prompt_total, seq.generated)
    body = _response_object(state, state.new_id("resp"), status, [item], usage)
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _responses_stream(
    request: web.Request,
    state: SimState,
    job: _Job,
    seq: Sequence,
    queue: asyncio.Queue[Event],
    prompt_total: int,
) -> web.StreamResponse:
    """A Responses stream: named events, one ``response.output_text.delta`` per token, then
    ``response.completed`` (``response.incomplete`` at ``max_output_tokens``) with the usage."""
    rid, mid = state.new_id("resp"), state.new_id("msg")
    number = 0

    def event(name: str, **data: Any) -> bytes:
        nonlocal number
        number += 1
        payload = orjson.dumps({"type": name, "sequence_number": number, **data})
        return b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n"

    resp: web.StreamResponse | None = None
    texts: list[str] = []
    where = {"item_id": mid, "output_index": 0, "content_index": 0}
    while True:
        ev = await queue.get()
        if isinstance(ev, FailEvent):
            if resp is None:  # nothing sent yet: a real 500
                return error_response(500, ev.message, "InternalServerError")
            await resp.write(event("error", code="server_error", message=ev.message, param=None))
            return resp
        if resp is None:
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await resp.prepare(request)
            pending = _response_object(state, rid, "in_progress", [], None)
            await resp.write(
                event("response.created", response=pending)
                + event("response.in_progress", response=pending)
                + event(
                    "response.output_item.added", output_index=0, item=_message_item(mid, "", "")
                )
                + event(
                    "response.content_part.added",
                    item_id=mid,
                    output_index=0,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                )
            )
        texts.append(ev.text)
        await resp.write(event("response.output_text.delta", **where, delta=ev.text, logprobs=[]))
        if ev.finish_reason is not None:
            break
    _end(state, job)
    text = "".join(texts)
    item = _message_item(mid, text, "completed")
    status = "incomplete" if ev.finish_reason == "length" else "completed"
    usage = _responses_usage(prompt_total, seq.generated)
    await resp.write(
        event("response.output_text.done", **where, text=text, logprobs=[])
        + event("response.content_part.done", **where, part=item["content"][0])
        + event("response.output_item.done", output_index=0, item=item)
        + event(f"response.{status}", response=_response_object(state, rid, status, [item], usage))
    )
    await resp.write_eof()
    return resp


def _bad_request_middleware() -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as exc:
            return error_response(exc.status, exc.message, exc.err_type)

    return middleware


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions`` (OpenAI Chat Completions; streaming and not)."""
    state = request.app[STATE]
    return await _generate(request, _parse_chat(state, await _read_json(request)))


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` (legacy Completions; ``max_tokens`` defaults to 16)."""
    state = request.app[STATE]
    return await _generate(request, _parse_completion(state, await _read_json(request)))


async def responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (OpenAI's Responses API, as vLLM serves it; streaming and not;
    ``max_output_tokens`` caps the output, absent → the rest of the context window)."""
    state = request.app[STATE]
    return await _generate(request, _parse_responses(state, await _read_json(request)))


async def embeddings(request: web.Request) -> web.Response:
    """``POST /v1/embeddings``: deterministic unit vectors; no KV blocks, only a prefill delay."""
    state = request.app[STATE]
    body = await _read_json(request)
    _check_model(state, body)
    if "input" not in body:
        raise BadRequest("'input' is required")
    inputs = [_prompt_tokens(state, p) for p in _parse_prompts(body["input"], "input")]
    ctx = state.config.context_window
    for tokens, _ in inputs:
        if tokens > ctx:
            raise _context_error(ctx, tokens, None, "input")
    if not state.engine.is_healthy(state.clock()):
        return error_response(
            503, "The engine is restarting after CUDA out of memory.", "ServiceUnavailableError"
        )
    total = sum(t for t, _ in inputs)
    cfg = state.config
    await asyncio.sleep(cfg.prefill_s_per_token * total / cfg.speed)
    data = []
    for i, (_, fp) in enumerate(inputs):
        rng = random.Random(f"{cfg.seed}:{hashlib.blake2b(fp, digest_size=16).hexdigest()}")
        vec = [rng.gauss(0.0, 1.0) for _ in range(cfg.embedding_dim)]
        norm = math.sqrt(sum(v * v for v in vec)) or 1.0
        data.append({"object": "embedding", "index": i, "embedding": [v / norm for v in vec]})
    out = {
        "object": "list",
        "data": data,
        "model": cfg.model,
        "usage": {"prompt_tokens": total, "total_tokens": total},
    }
    return web.Response(body=orjson.dumps(out), content_type="application/json")


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the served model with ``max_model_len`` (as vLLM reports it)."""
    cfg = request.app[STATE].config
    body = {
        "object": "list",
        "data": [
            {
                "id": cfg.model,
                "object": "model",
                "created": 0,
                "owned_by": "vllm",
                "root": cfg.model,
                "parent": None,
                "max_model_len": cfg.context_window,
            }
        ],
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def props(request: web.Request) -> web.Response:
    """``GET /props`` in llama.cpp's shape: ``total_slots`` (``max_num_seqs``: the most
    sequences one batch runs), ``default_generation_settings.n_ctx`` (the context window),
    ``chat_template`` (``""`` without one). The simulator adds no BOS of its own, so
    ``bos_token`` is ``""``."""
    cfg = request.app[STATE].config
    body = {
        "total_slots": cfg.max_num_seqs,
        "default_generation_settings": {"n_ctx": cfg.context_window},
        "model_alias": cfg.model,
        "chat_template": cfg.chat_template or "",
        "bos_token": "",
        "eos_token": "",
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def slots(request: web.Request) -> web.Response:
    """``GET /slots`` in llama.cpp's shape: one entry per batch place (``max_num_seqs``), the
    running sequences first with ``is_processing`` true, ``n_prompt_tokens`` (the tokens whose
    KV it holds, as llama.cpp's slot cache: the prompt so far while it is prefilled, then prompt
    + generated − 1), ``n_prompt_tokens_processed`` (prompt tokens prefilled so far) and
    ``next_token[0].n_decoded``."""
    state = request.app[STATE]
    cfg = state.config
    out: list[dict[str, Any]] = []
    for i in range(cfg.max_num_seqs):
        seq = state.engine.running[i] if i < len(state.engine.running) else None
        entry: dict[str, Any] = {"id": i, "n_ctx": cfg.context_window, "is_processing": False}
        if seq is not None:
            entry.update(
                is_processing=True,
                id_task=seq.seq_id,
                n_prompt_tokens=seq.kv_tokens,
                n_prompt_tokens_processed=min(seq.computed, seq.prompt_tokens),
                next_token=[
                    {
                        "has_next_token": True,
                        "n_remain": seq.max_tokens - seq.generated,
                        "n_decoded": seq.generated,
                    }
                ],
            )
        out.append(entry)
    return web.Response(body=orjson.dumps(out), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    """``GET /health``: 200 (empty body, as vLLM) or 503 while restarting after an OOM."""
    state = request.app[STATE]
    if state.engine.is_healthy(state.clock()):
        return web.Response(status=200)
    return error_response(
        503, "The engine is restarting after CUDA out of memory.", "ServiceUnavailableError"
    )


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text exposition with vLLM's names (see ``_SimCollector``)."""
    data = generate_latest(request.app[STATE].registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def sim_state(request: web.Request) -> web.Response:
    """``GET /sim/state``: :meth:`Engine.snapshot` as JSON (a test and debugging aid)."""
    state = request.app[STATE]
    state.engine.is_healthy(state.clock())
    return web.Response(body=orjson.dumps(state.engine.snapshot()), content_type="application/json")


async def sim_reset_peaks(request: web.Request) -> web.Response:
    """``POST /sim/reset-peaks``: every peak (running, in flight; overall and per user) becomes
    its current value (:meth:`Engine.reset_peaks`); answers the new ``/sim/state`` snapshot."""
    state = request.app[STATE]
    state.engine.reset_peaks()
    return await sim_state(request)


# --------------------------------------------------------------------------- factory


def create_app(config: SimConfig) -> web.Application:
    """Build the simulator's aiohttp application for ``config``.

    The step loop starts with the app (``cleanup_ctx``) and stops with it. Each app has its own
    :class:`~prometheus_client.CollectorRegistry`, so several simulators can run in one process.
    Run it with ``handler_cancellation=True`` (as :func:`run_sim` and the CLI do) so a client
    that disconnects while its request waits or prefills is aborted at once, not at the next
    token write.

    Raises:
        ValueError: invalid ``config`` or an unloadable tokenizer file.
    """
    config.validate()
    registry = CollectorRegistry(auto_describe=False)
    state = SimState(
        config=config,
        engine=Engine(config),
        counter=TokenCounter(config.tokenizer, config.chat_template),
        registry=registry,
    )
    registry.register(_SimCollector(state))
    app = web.Application(middlewares=[_bad_request_middleware()], client_max_size=64 << 20)
    app[STATE] = state

    async def step_loop_ctx(app: web.Application) -> AsyncIterator[None]:
        state.clock = asyncio.get_running_loop().time
        state.wake = asyncio.Event()
        task = asyncio.create_task(_step_loop(state), name="kvgate-sim-step-loop")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(step_loop_ctx)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/props", props)
    app.router.add_get("/slots", slots)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/sim/state", sim_state)
    app.router.add_post("/sim/reset-peaks", sim_reset_peaks)
    return app


@dataclass(frozen=True, slots=True)
class RunningSim:
    """A simulator started by :func:`run_sim`.

    Attributes:
        url: ``http://127.0.0.1:PORT`` (no trailing slash).
        base_url: ``url + "/v1"``, what an OpenAI client's ``base_url`` wants.
        app: the running application.
        engine: its engine, for white-box assertions.
    """

    url: str
    base_url: str
    app: web.Application
    engine: Engine


@contextlib.asynccontextmanager
async def run_sim(
    config: SimConfig | None = None, *, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[RunningSim]:
    """Serve a simulator on ``host:port`` (default 127.0.0.1, an ephemeral port) for a block.

    ``async with run_sim(SimConfig.from_profile("tiny", speed=50)) as sim:`` then point a client
    at ``sim.base_url``. The server stops (and its step loop with it) when the block exits.
    """
    app = create_app(config or SimConfig.from_profile())
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        url = f"http://{host}:{bound}"
        yield RunningSim(url=url, base_url=url + "/v1", app=app, engine=app[STATE].engine)
    finally:
        await runner.cleanup()
