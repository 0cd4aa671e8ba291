"""Engine adapters: one engine's Prometheus text (and llama.cpp's ``/slots`` JSON) → one reading.

What: :func:`read_engine_metrics` turns the body of an engine's ``/metrics`` endpoint into an
:class:`EngineReading` — KV-cache usage as a ratio 0..1 (when the engine has one), requests
running, requests waiting, the cumulative preemption counter and the KV capacity in tokens (when
the engine states it) — together with the metric names each value came from.

Inputs: Prometheus text exposition (``str`` or ``bytes``), an engine name (or ``"auto"`` to
detect it from the metric names), optionally the served model name (to pick that model's series)
and, for llama.cpp, a parsed ``GET /slots`` body (:func:`parse_llamacpp_slots`).

Rules (all from docs/engines.md §1, §2, which cites each engine's source):

- Every KV gauge is a **ratio** even when its name says "perc". A value outside [0, 1] (beyond
  :data:`KV_EPSILON`) or NaN raises :class:`BadValueError`; the unit is never guessed (§3.1).
- Several series (data-parallel ranks, several models): usage is the **max**, running / waiting
  the **sum**; SGLang ``tp_rank`` / ``pp_rank`` / ``moe_ep_rank`` are replicas of one scheduler
  (max, not sum), ``dp_rank`` values are independent schedulers (sum), and ``priority=""`` is the
  total (§2.3, §3.2).
- The text is parsed with ``prometheus_client.parser.text_string_to_metric_families`` sample by
  sample: only the sample lines whose metric name an adapter needs are parsed (HELP/TYPE lines
  are not needed and are skipped, which also keeps the cost per scrape small); when that text
  fails to parse, each line is parsed on its own and bad lines are logged and skipped (§2.5, the
  llama.cpp b7010 exposition regression). ``*_created`` series are never read (§3.3).
- A required signal that is missing raises :class:`MissingMetricError` (``strict=True``, the
  poller's mode): for engines with a KV gauge that is the gauge; for engines without one (TGI
  before v2.3.1, llama.cpp after PR #13660) the queue gauge — they adapt on their queue alone.

Errors: every failure is a :class:`MetricsError` (a ``ValueError``) whose ``reason`` is a short,
low-cardinality label a caller can count as a scrape error.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "ENGINES",
    "KV_EPSILON",
    "MAX_KV_CAPACITY_TOKENS",
    "BadValueError",
    "EngineName",
    "EngineReading",
    "MetricsError",
    "MissingMetricError",
    "SlotsSnapshot",
    "UnknownEngineError",
    "counter_delta",
    "detect_engine",
    "parse_llamacpp_slots",
    "parse_samples",
    "read_engine_metrics",
]

logger = logging.getLogger("kvgate.telemetry")

EngineName = Literal[
    "vllm", "vllm-v0", "sglang", "tgi", "llamacpp", "triton-trtllm", "trtllm-serve", "lmdeploy"
]
#: Engine names an adapter exists for (the ``engine:`` values of the config besides ``"auto"``).
ENGINES: Final[tuple[str, ...]] = (
    "vllm",
    "vllm-v0",
    "sglang",
    "tgi",
    "llamacpp",
    "triton-trtllm",
    "trtllm-serve",
    "lmdeploy",
)

#: Tolerance (ratio) allowed outside [0, 1] for float rounding in an engine's own arithmetic.
KV_EPSILON: Final[float] = 1e-6

# Labels that name the served model: vLLM / SGLang / LMDeploy / trtllm-serve use ``model_name``,
# Triton ``model``, the oldest SGLang builds ``name`` (docs/engines.md §1).
_MODEL_LABELS: Final[tuple[str, ...]] = ("model_name", "model", "name")

Series = list[tuple[dict[str, str], float]]


# ---------------------------------------------------------------------------------------------
# errors


class MetricsError(ValueError):
    """A scrape that yields no usable reading. ``reason`` is a short label for a metric."""

    reason: str = "bad_metrics"


class UnknownEngineError(MetricsError):
    """``engine="auto"`` found no (or several engines') known metric names in the text."""

    reason = "unknown_engine"


class MissingMetricError(MetricsError):
    """A required metric is absent (or has no series for the configured model).

    ``metric`` is the name that was looked for first (for example ``vllm:kv_cache_usage_perc``).
    """

    reason = "missing_metric"

    def __init__(self, message: str, metric: str) -> None:
        super().__init__(message)
        self.metric = metric


class BadValueError(MetricsError):
    """A value that cannot be right: NaN or ±Inf anywhere, a KV ratio outside [0, 1], a negative
    request count or one above ``MAX_REQUEST_COUNT``, a KV capacity above
    ``MAX_KV_CAPACITY_TOKENS``. ``metric`` and ``value`` say which one."""

    reason = "bad_value"

    def __init__(self, message: str, metric: str, value: float) -> None:
        super().__init__(message)
        self.metric = metric
        self.value = value


# ---------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True, slots=True)
class EngineReading:
    """One engine's load at one scrape.

    Attributes:
        engine: the adapter that produced it (one of :data:`ENGINES`).
        kv_usage: KV-cache usage, ratio 0..1, or ``None`` when the engine exposes none.
        running: requests in the engine's running batch (sum over data-parallel ranks).
        waiting: requests queued in the engine (sum over ranks; vLLM V0 adds swapped requests).
        preemptions_total: the engine's cumulative preemption counter (vLLM
            ``vllm:num_preemptions_total``, SGLang ``sglang:num_retracted_requests_total``);
            use :func:`counter_delta` between scrapes.
        kv_capacity_tokens: KV capacity in tokens when the engine states it (vLLM
            ``num_gpu_blocks × block_size``, SGLang ``max_total_num_tokens``, TGI
            ``tgi_batch_max_total_tokens``, Triton ``max × tokens_per`` blocks, llama.cpp
            ``GET /slots``: the sum of the slots' ``n_ctx``, or one slot's with a unified KV
            pool).
        slots: the engine's own concurrency limit when a scrape states it (llama.cpp: the
            entries of ``GET /slots``).
        sources: field name → the metric name(s) it was read from, e.g.
            ``{"kv_usage": "vllm:kv_cache_usage_perc"}``.
        skipped_lines: exposition lines that could not be parsed and were skipped.
    """

    engine: str
    kv_usage: float | None = None
    running: int | None = None
    waiting: int | None = None
    preemptions_total: float | None = None
    kv_capacity_tokens: int | None = None
    slots: int | None = None
    sources: Mapping[str, str] = field(default_factory=dict, hash=False)
    skipped_lines: int = 0


@dataclass(frozen=True, slots=True)
class SlotsSnapshot:
    """llama.cpp ``GET /slots``: one entry per server slot (``tools/server/server-context.cpp``,
    ``server_slot::to_json``: ``id``, ``n_ctx``, ``is_processing``, ...).

    Attributes:
        total: number of slots (``--parallel``).
        busy: slots with ``is_processing`` true.
        n_ctx_total: sum of the slots' ``n_ctx`` (tokens).
        tokens_in_use: tokens held in the KV cache by the busy slots (see
            :func:`parse_llamacpp_slots`); ``None`` when the build reports no token count.
        n_ctx_max: the largest slot ``n_ctx`` (tokens).
        unified: the slots share one KV pool (llama-server ``--kv-unified``): each slot's
            ``n_ctx`` is then the whole pool, not a share of it.
    """

    total: int
    busy: int
    n_ctx_total: int
    tokens_in_use: int | None = None
    n_ctx_max: int = 0
    unified: bool = False

    @property
    def occupancy(self) -> float:
        """Busy slots ÷ total slots (ratio 0..1). Not a KV reading: four slots busy with short
        prompts hold a small part of the cache (see :attr:`kv_usage`)."""
        return self.busy / self.total if self.total else 0.0

    @property
    def kv_capacity_tokens(self) -> int:
        """KV capacity in tokens: one slot's ``n_ctx`` with a unified pool, else the sum."""
        return self.n_ctx_max if self.unified else self.n_ctx_total

    @property
    def kv_usage(self) -> float | None:
        """Tokens held by busy slots ÷ :attr:`kv_capacity_tokens` (ratio 0..1, capped at 1), or
        ``None`` when the build reports no token count or the capacity is 0."""
        cap = self.kv_capacity_tokens
        if self.tokens_in_use is None or cap <= 0:
            return None
        return min(1.0, self.tokens_in_use / cap)


# ---------------------------------------------------------------------------------------------
# parsing

_NAME_RE: Final = re.compile(r"\s*([A-Za-z_:][A-Za-z0-9_:]*)")


def _sample_lines(text: str) -> Iterable[tuple[str, str]]:
    """(metric name, line) for every sample line; comments, blanks and garbage yield nothing
    here except as their leading token (which no adapter asks for)."""
    for line in text.splitlines():
        m = _NAME_RE.match(line)
        if m is None:
            continue
        yield m.group(1), line


def _parse_lines(lines: Sequence[str]) -> tuple[dict[str, Series], int]:
    """Parse sample lines with prometheus_client; on failure, one line at a time."""
    out: dict[str, Series] = {}

    def add(families: Iterable[Any]) -> None:
        for family in families:
            for s in family.samples:
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))

    if not lines:
        return out, 0
    try:
        # Materialise first so a failure half-way adds nothing twice.
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on bad text
        logger.debug("metrics text failed to parse as a whole (%s); parsing line by line", exc)
    else:
        add(families)
        return out, 0
    skipped = 0
    for line in lines:
        try:
            one = list(text_string_to_metric_families(line + "\n"))
        except Exception as exc:
            skipped += 1
            logger.debug("skipped unparsable metrics line %.200r: %s", line, exc)
            continue
        add(one)
    return out, skipped


def parse_samples(
    text: str | bytes, names: Iterable[str] | None = None
) -> tuple[dict[str, Series], int]:
    """Parse Prometheus text into ``{sample name: [(labels, value), ...]}``.

    Args:
        text: the exposition (bytes are decoded as UTF-8, bad bytes replaced).
        names: sample names to keep (exact, e.g. ``vllm:num_preemptions_total``); ``None`` keeps
            every sample.

    Returns:
        The samples by name and the number of lines that could not be parsed (skipped).
        Never raises on bad text: unparsable lines are logged at DEBUG and skipped.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    wanted = None if names is None else frozenset(names)
    lines = [ln for name, ln in _sample_lines(text) if wanted is None or name in wanted]
    return _parse_lines(lines)


# Metric-name prefixes that identify an engine (docs/engines.md §1).
_DETECT: Final[tuple[tuple[str, str], ...]] = (
    ("vllm:", "vllm"),
    ("sglang:", "sglang"),
    ("sglang_", "sglang"),  # sgl-router /engine_metrics rewrites ':' to '_' (sglang PR #12970)
    ("llamacpp:", "llamacpp"),
    ("tgi_", "tgi"),
    ("nv_trt_llm_", "triton-trtllm"),
    ("trtllm_", "trtllm-serve"),
    ("lmdeploy:", "lmdeploy"),
)


def detect_engine(names: Iterable[str]) -> str:
    """Name the engine from the metric names of one scrape.

    ``vllm:`` names with ``vllm:num_requests_swapped`` or ``vllm:cpu_cache_usage_perc`` (V0 only,
    docs/engines.md §1) and no ``vllm:kv_cache_usage_perc`` → ``"vllm-v0"``; other ``vllm:`` →
    ``"vllm"``; ``sglang:``/``sglang_`` → ``"sglang"``; ``llamacpp:``; ``tgi_``; ``nv_trt_llm_``
    → ``"triton-trtllm"``; ``trtllm_`` → ``"trtllm-serve"``; ``lmdeploy:``.

    Raises:
        UnknownEngineError: no known prefix, or prefixes of several engines.
    """
    names = set(names)
    found: set[str] = set()
    for name in names:
        for prefix, engine in _DETECT:
            if name.startswith(prefix):
                found.add(engine)
                break
    if not found:
        raise UnknownEngineError(
            "cannot detect the engine: no vllm:, sglang:, llamacpp:, tgi_, nv_trt_llm_, "
            "trtllm_ or lmdeploy: metric in the text; set `engine:` for this backend"
        )
    if len(found) > 1:
        raise UnknownEngineError(
            f"metrics of several engines in one scrape ({', '.join(sorted(found))}); "
            "set `engine:` for this backend"
        )
    engine = found.pop()
    if (
        engine == "vllm"
        and "vllm:kv_cache_usage_perc" not in names
        and ({"vllm:num_requests_swapped", "vllm:cpu_cache_usage_perc"} & names)
    ):
        return "vllm-v0"
    return engine


# ---------------------------------------------------------------------------------------------
# aggregation helpers


class _View:
    """Samples of one scrape, filtered to one model when a model is given."""

    def __init__(self, samples: dict[str, Series], model: str | None) -> None:
        self._samples = samples
        self._model = model
        self.models_seen: set[str] = set()

    def _keep(self, labels: Mapping[str, str]) -> bool:
        if self._model is None:
            return True
        for key in _MODEL_LABELS:
            if key in labels:
                self.models_seen.add(labels[key])
                return labels[key] == self._model
        return True  # a series without a model label (e.g. vllm:cache_config_info) applies

    def first(self, *names: str) -> tuple[str, Series] | None:
        """The first of ``names`` that has series for the model, with those series."""
        for name in names:
            series = [(lb, v) for lb, v in self._samples.get(name, ()) if self._keep(lb)]
            if series:
                return name, series
        return None

    def missing(self, what: str, names: Sequence[str]) -> MissingMetricError:
        """The error for a required metric that is absent (mentions the model filter)."""
        listed = " / ".join(names)
        if self._model is not None and any(self._samples.get(n) for n in names):
            seen = ", ".join(sorted(self.models_seen)) or "none"
            return MissingMetricError(
                f"no {listed} series for model {self._model!r} (models seen: {seen})", names[0]
            )
        return MissingMetricError(f"{what} metric {listed} is missing from the scrape", names[0])


def _check_finite(name: str, value: float) -> None:
    if math.isnan(value) or math.isinf(value):
        raise BadValueError(f"{name} is {value}, not a number", name, value)


def _group(series: Series, partition: Sequence[str]) -> dict[tuple[str, ...], float]:
    """One value per partition key; series sharing a key are replicas (max)."""
    groups: dict[tuple[str, ...], float] = {}
    for labels, value in series:
        key = tuple(labels.get(k, "") for k in partition)
        prev = groups.get(key)
        groups[key] = value if prev is None else max(prev, value)
    return groups


def _usage(name: str, series: Series, partition: Sequence[str]) -> float:
    """KV ratio: validated per series, max over partitions (docs/engines.md §2)."""
    for _, value in series:
        _check_finite(name, value)
        if value < -KV_EPSILON or value > 1.0 + KV_EPSILON:
            raise BadValueError(
                f"{name} = {value!r} is outside 0..1; every engine's KV gauge is a ratio "
                "(docs/engines.md §2), so this reading is refused rather than rescaled",
                name,
                value,
            )
    return min(1.0, max(0.0, max(_group(series, partition).values())))


#: More requests than any engine can hold (running or waiting): a broken exporter, not a load.
MAX_REQUEST_COUNT = 10**9
#: The largest KV capacity an engine may state, in tokens (2**40: a thousand times the largest
#: KV caches of 2026); more is a broken exposition (:class:`BadValueError`).
MAX_KV_CAPACITY_TOKENS = 2**40


def _count(name: str, series: Series, partition: Sequence[str]) -> int:
    """Request count: validated per series (finite, 0..``MAX_REQUEST_COUNT``), sum over
    partitions."""
    for _, value in series:
        _check_finite(name, value)
        if value < 0:
            raise BadValueError(f"{name} = {value!r} is negative", name, value)
        if value > MAX_REQUEST_COUNT:
            raise BadValueError(
                f"{name} = {value!r} is more requests than an engine can hold", name, value
            )
    total = round(sum(_group(series, partition).values()))
    if total > MAX_REQUEST_COUNT:
        raise BadValueError(
            f"{name} sums to {total} requests, more than an engine can hold", name, total
        )
    return total


def _total(name: str, series: Series, partition: Sequence[str]) -> float:
    """Counter: validated per series, sum over partitions."""
    for _, value in series:
        _check_finite(name, value)
        if value < 0:
            raise BadValueError(f"{name} = {value!r} is negative", name, value)
    return float(sum(_group(series, partition).values()))


def _label_int(labels: Mapping[str, str], key: str) -> int | None:
    try:
        value = int(labels.get(key, ""))
    except ValueError:  # e.g. num_gpu_blocks="None" before the engine is initialised
        return None
    return value if value >= 0 else None


@dataclass(slots=True)
class _Fields:
    kv_usage: float | None = None
    running: int | None = None
    waiting: int | None = None
    preemptions_total: float | None = None
    kv_capacity_tokens: int | None = None
    slots: int | None = None
    sources: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# adapters


def _simple(
    view: _View,
    out: _Fields,
    partition: Sequence[str],
    *,
    kv: Sequence[str] = (),
    running: Sequence[str] = (),
    waiting: Sequence[str] = (),
    preemptions: Sequence[str] = (),
) -> None:
    if kv and (hit := view.first(*kv)):
        out.kv_usage = _usage(hit[0], hit[1], partition)
        out.sources["kv_usage"] = hit[0]
    if running and (hit := view.first(*running)):
        out.running = _count(hit[0], hit[1], partition)
        out.sources["running"] = hit[0]
    if waiting and (hit := view.first(*waiting)):
        out.waiting = _count(hit[0], hit[1], partition)
        out.sources["waiting"] = hit[0]
    if preemptions and (hit := view.first(*preemptions)):
        out.preemptions_total = _total(hit[0], hit[1], partition)
        out.sources["preemptions_total"] = hit[0]


_VLLM_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def _read_vllm(view: _View, out: _Fields, slots: SlotsSnapshot | None) -> None:
    """vLLM V1 and V0 (docs/engines.md §1): ``engine`` label = DP engine-core index."""
    part = ("engine", *_MODEL_LABELS)
    _simple(
        view,
        out,
        part,
        kv=_VLLM_KV,
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        preemptions=("vllm:num_preemptions_total",),
    )
    swapped = view.first("vllm:num_requests_swapped")
    if swapped and out.waiting is not None:
        out.waiting += _count(swapped[0], swapped[1], part)
        out.sources["waiting"] += " + vllm:num_requests_swapped"
    if info := view.first("vllm:cache_config_info"):
        caps: Series = []
        for labels, _ in info[1]:
            blocks, size = _label_int(labels, "num_gpu_blocks"), _label_int(labels, "block_size")
            if blocks is not None and size is not None:
                caps.append((labels, float(blocks * size)))
        if caps:
            out.kv_capacity_tokens = round(sum(_group(caps, ("engine",)).values()))
            out.sources["kv_capacity_tokens"] = (
                "vllm:cache_config_info{num_gpu_blocks} × {block_size}"
            )


def _sg(name: str) -> tuple[str, str]:
    return f"sglang:{name}", f"sglang_{name}"


def _read_sglang(view: _View, out: _Fields, slots: SlotsSnapshot | None) -> None:
    """SGLang (docs/engines.md §1): one value per ``dp_rank`` (tp/pp/moe_ep ranks are replicas:
    max), ``priority=""`` is the total, then sum over ranks (usage: max)."""
    base = ("dp_rank", "engine_type", *_MODEL_LABELS)

    def pick(*names: str) -> tuple[str, Series, tuple[str, ...]] | None:
        hit = view.first(*names)
        if hit is None:
            return None
        name, series = hit
        if any("priority" in lb for lb, _ in series):
            totals = [(lb, v) for lb, v in series if lb.get("priority", "") == ""]
            if totals:
                return name, totals, base
            return name, series, (*base, "priority")  # per-priority only: add them up
        return name, series, base

    if hit := pick(*_sg("token_usage")):
        out.kv_usage = _usage(*hit)
        out.sources["kv_usage"] = hit[0]
    if hit := pick(*_sg("num_running_reqs")):
        out.running = _count(*hit)
        out.sources["running"] = hit[0]
    if hit := pick(*_sg("num_queue_reqs")):
        out.waiting = _count(*hit)
        out.sources["waiting"] = hit[0]
    if hit := pick(*_sg("num_retracted_requests_total")):
        out.preemptions_total = _total(*hit)
        out.sources["preemptions_total"] = hit[0]
    if hit := pick(*_sg("max_total_num_tokens")):
        out.kv_capacity_tokens = round(_total(*hit))
        out.sources["kv_capacity_tokens"] = hit[0]


def _read_tgi(view: _View, out: _Fields, slots: SlotsSnapshot | None) -> None:
    """TGI (docs/engines.md §1): no KV gauge; the ratio is derived from the batch token gauges."""
    _simple(view, out, (), running=("tgi_batch_current_size",), waiting=("tgi_queue_size",))
    cur = view.first("tgi_batch_current_max_tokens")
    cap = view.first("tgi_batch_max_total_tokens")
    if cap is not None:
        capacity = _total(cap[0], cap[1], ())
        if capacity > 0:
            out.kv_capacity_tokens = round(capacity)
            out.sources["kv_capacity_tokens"] = cap[0]
            if cur is not None:
                reserved = _total(cur[0], cur[1], ())
                name = "tgi_batch_current_max_tokens/tgi_batch_max_total_tokens"
                out.kv_usage = _usage(name, [({}, reserved / capacity)], ())
                out.sources["kv_usage"] = name


def _read_llamacpp(view: _View, out: _Fields, slots: SlotsSnapshot | None) -> None:
    """llama.cpp ``llama-server`` (docs/engines.md §1): KV ratio on old builds, else ``/slots``."""
    _simple(
        view,
        out,
        (),
        kv=("llamacpp:kv_cache_usage_ratio",),
        running=("llamacpp:requests_processing",),
        waiting=("llamacpp:requests_deferred",),
    )
    if slots is not None:
        usage = slots.kv_usage
        if out.kv_usage is None and usage is not None:
            out.kv_usage = usage
            out.sources["kv_usage"] = "GET /slots (tokens of busy slots ÷ KV capacity)"
        if out.running is None:
            out.running = slots.busy
            out.sources["running"] = "GET /slots (is_processing)"
        if slots.total:
            out.slots = slots.total
            out.sources["slots"] = "GET /slots (entries)"
        if slots.kv_capacity_tokens:
            out.kv_capacity_tokens = slots.kv_capacity_tokens
            out.sources["kv_capacity_tokens"] = (
                "GET /slots (n_ctx of one slot: unified KV)"
                if slots.unified
                else "GET /slots (sum of n_ctx)"
            )


def _read_triton(view: _View, out: _Fields, slots: SlotsSnapshot | None) -> None:
    """Triton + TensorRT-LLM backend (docs/engines.md §1): typed by ``request_type`` /
    ``kv_cache_block_type`` labels; one partition per (``model``, ``version``)."""
    part = ("model", "version")

    def typed(name: str, label: str, value: str) -> Series:
        hit = view.first(name)
        return [(lb, v) for lb, v in (hit[1] if hit else ()) if lb.get(label) == value]

    req = "nv_trt_llm_request_metrics"
    kvm = "nv_trt_llm_kv_cache_block_metrics"
    for rtype, attr in (("active", "running"), ("scheduled", "running"), ("waiting", "waiting")):
        series = typed(req, "request_type", rtype)
        if series and getattr(out, attr) is None:
            setattr(out, attr, _count(req, series, part))
            out.sources[attr] = f'{req}{{request_type="{rtype}"}}'
    if out.waiting is None and (hit := view.first("nv_inference_pending_request_count")):
        out.waiting = _count(hit[0], hit[1], part)
        out.sources["waiting"] = hit[0]
    fraction = typed(kvm, "kv_cache_block_type", "fraction")
    used = _group(typed(kvm, "kv_cache_block_type", "used"), part)
    total = _group(typed(kvm, "kv_cache_block_type", "max"), part)
    tokens_per = _group(typed(kvm, "kv_cache_block_type", "tokens_per"), part)
    if fraction:
        out.kv_usage = _usage(f'{kvm}{{kv_cache_block_type="fraction"}}', fraction, part)
        out.sources["kv_usage"] = f'{kvm}{{kv_cache_block_type="fraction"}}'
    elif used and total:
        name = f'{kvm}{{kv_cache_block_type="used"}} / {{kv_cache_block_type="max"}}'
        ratios: list[tuple[dict[str, str], float]] = [
            ({}, used[k] / total[k]) for k in used if total.get(k)
        ]
        if ratios:
            out.kv_usage = _usage(name, ratios, ())
            out.sources["kv_usage"] = name
    caps: list[tuple[dict[str, str], float]] = [
        ({}, total[k] * tokens_per[k]) for k in total if k in tokens_per
    ]
    if caps:
        out.kv_capacity_tokens = round(_total(kvm, caps, ()))
        out.sources["kv_capacity_tokens"] = (
            f'{kvm}{{kv_cache_block_type="max"}} × {{kv_cache_block_type="tokens_per"}}'
        )


def _read_trtllm_serve(view: _View, out: _Fields, slots: SlotsSnapshot | None) -> None:
    """``trtllm-serve`` ``/prometheus/metrics`` (docs/engines.md §1), ``trtllm_`` names."""
    _simple(
        view,
        out,
        ("engine_type", *_MODEL_LABELS),
        kv=("trtllm_kv_cache_utilization",),
        running=("trtllm_num_requests_running",),
        waiting=("trtllm_num_requests_waiting",),
    )


def _read_lmdeploy(view: _View, out: _Fields, slots: SlotsSnapshot | None) -> None:
    """LMDeploy (docs/engines.md §1): vLLM-like names under ``lmdeploy:``."""
    _simple(
        view,
        out,
        ("engine", *_MODEL_LABELS),
        kv=("lmdeploy:gpu_cache_usage_perc",),
        running=("lmdeploy:num_requests_running",),
        waiting=("lmdeploy:num_requests_waiting",),
    )


@dataclass(frozen=True, slots=True)
class _Adapter:
    read: Callable[[_View, _Fields, SlotsSnapshot | None], None]
    names: frozenset[str]
    required: str  # "kv_usage" or "waiting"
    required_names: tuple[str, ...]


_TRITON = frozenset(
    {
        "nv_trt_llm_request_metrics",
        "nv_trt_llm_kv_cache_block_metrics",
        "nv_inference_pending_request_count",
    }
)
_VLLM_NAMES = frozenset(
    {
        *_VLLM_KV,
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_requests_swapped",
        "vllm:num_preemptions_total",
        "vllm:cache_config_info",
    }
)
_SGLANG_NAMES = frozenset(
    n
    for base in (
        "token_usage",
        "num_running_reqs",
        "num_queue_reqs",
        "num_retracted_requests_total",
        "max_total_num_tokens",
    )
    for n in _sg(base)
)
_ADAPTERS: Final[dict[str, _Adapter]] = {
    "vllm": _Adapter(_read_vllm, _VLLM_NAMES, "kv_usage", _VLLM_KV),
    "vllm-v0": _Adapter(
        _read_vllm, _VLLM_NAMES, "kv_usage", ("vllm:gpu_cache_usage_perc", _VLLM_KV[0])
    ),
    "sglang": _Adapter(_read_sglang, _SGLANG_NAMES, "kv_usage", _sg("token_usage")),
    "tgi": _Adapter(
        _read_tgi,
        frozenset(
            {
                "tgi_queue_size",
                "tgi_batch_current_size",
                "tgi_batch_current_max_tokens",
                "tgi_batch_max_total_tokens",
            }
        ),
        "waiting",
        ("tgi_queue_size",),
    ),
    "llamacpp": _Adapter(
        _read_llamacpp,
        frozenset(
            {
                "llamacpp:kv_cache_usage_ratio",
                "llamacpp:requests_processing",
                "llamacpp:requests_deferred",
            }
        ),
        "waiting",
        ("llamacpp:requests_deferred",),
    ),
    "triton-trtllm": _Adapter(
        _read_triton, _TRITON, "kv_usage", ("nv_trt_llm_kv_cache_block_metrics",)
    ),
    "trtllm-serve": _Adapter(
        _read_trtllm_serve,
        frozenset(
            {
                "trtllm_kv_cache_utilization",
                "trtllm_num_requests_running",
                "trtllm_num_requests_waiting",
            }
        ),
        "kv_usage",
        ("trtllm_kv_cache_utilization",),
    ),
    "lmdeploy": _Adapter(
        _read_lmdeploy,
        frozenset(
            {
                "lmdeploy:gpu_cache_usage_perc",
                "lmdeploy:num_requests_running",
                "lmdeploy:num_requests_waiting",
            }
        ),
        "kv_usage",
        ("lmdeploy:gpu_cache_usage_perc",),
    ),
}


def read_engine_metrics(
    text: str | bytes,
    engine: str = "auto",
    *,
    model: str | None = None,
    strict: bool = True,
    slots: SlotsSnapshot | None = None,
) -> EngineReading:
    """Turn one ``/metrics`` body into an :class:`EngineReading`.

    Args:
        text: Prometheus text exposition (``str``, or ``bytes`` decoded as UTF-8).
        engine: one of :data:`ENGINES`, or ``"auto"`` to detect it (:func:`detect_engine`).
        model: served model name; when given, only series whose ``model_name`` / ``model`` /
            ``name`` label equals it (or that carry no model label) are read.
        strict: when true (the poller's mode) a missing required signal raises; when false the
            reading just has ``None`` there. Required: the KV gauge for vLLM, SGLang, Triton,
            trtllm-serve and LMDeploy; the queue gauge for TGI and llama.cpp (no KV gauge).
        slots: llama.cpp only: a :class:`SlotsSnapshot` from ``GET /slots``, used for KV
            occupancy and capacity when the metrics have no KV ratio.

    Raises:
        UnknownEngineError: ``engine="auto"`` and no single engine's names are present, or an
            unknown ``engine`` name.
        MissingMetricError: ``strict`` and the required signal is absent (for the model).
        BadValueError: NaN / ±Inf, a KV ratio outside [0, 1] (± :data:`KV_EPSILON`), or a
            negative count: never a unit guess.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    lines = list(_sample_lines(text))
    if engine == "auto":
        engine = detect_engine(name for name, _ in lines)
    adapter = _ADAPTERS.get(engine)
    if adapter is None:
        raise UnknownEngineError(
            f"unknown engine {engine!r}; expected 'auto' or one of {', '.join(ENGINES)}"
        )
    samples, skipped = _parse_lines([ln for name, ln in lines if name in adapter.names])
    view = _View(samples, model)
    out = _Fields()
    adapter.read(view, out, slots)
    if strict and getattr(out, adapter.required) is None:
        what = "KV-cache usage" if adapter.required == "kv_usage" else "queue (waiting)"
        raise view.missing(what, adapter.required_names)
    cap = out.kv_capacity_tokens
    if cap is not None and cap > MAX_KV_CAPACITY_TOKENS:
        name = out.sources.get("kv_capacity_tokens", "kv_capacity_tokens")
        raise BadValueError(
            f"{name} states a KV capacity of {cap} tokens, more than an engine can hold",
            name,
            cap,
        )
    if cap is not None and cap <= 0:
        out.kv_capacity_tokens = None  # nothing stated (an engine still starting)
        out.sources.pop("kv_capacity_tokens", None)
    return EngineReading(
        engine=engine,
        kv_usage=out.kv_usage,
        running=out.running,
        waiting=out.waiting,
        preemptions_total=out.preemptions_total,
        kv_capacity_tokens=out.kv_capacity_tokens,
        slots=out.slots,
        sources=dict(out.sources),
        skipped_lines=skipped,
    )


def parse_llamacpp_slots(
    body: str | bytes | Sequence[Any], *, unified: bool = False
) -> SlotsSnapshot:
    """Parse llama.cpp's ``GET /slots`` JSON (a list with one object per slot).

    Tokens held by a busy slot: ``n_past`` where the build reports it; else ``n_prompt_tokens``
    when the build also reports ``n_prompt_tokens_processed`` (there ``n_prompt_tokens`` is the
    size of the slot's token cache, which grows by each generated token); else (older builds)
    ``n_prompt_tokens + next_token.n_decoded``.

    Args:
        body: the response body, or the already-decoded list.
        unified: the server runs one KV pool shared by all slots (see
            :attr:`SlotsSnapshot.unified`).

    Returns:
        A :class:`SlotsSnapshot` (slot count, busy slots, context tokens, tokens in use).

    Raises:
        MetricsError: not JSON, not a list of slot objects, or a slot without an integer
            ``n_ctx`` ≥ 0 / boolean ``is_processing`` (``reason="bad_slots"``).
    """
    data: Any = body
    if isinstance(body, str | bytes):
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise _slots_error(f"/slots body is not JSON: {exc}") from None
    if not isinstance(data, list):
        raise _slots_error(f"/slots body is a {type(data).__name__}, expected a list of slots")
    busy = n_ctx_total = n_ctx_max = 0
    tokens = 0
    tokens_known = True
    for i, slot in enumerate(data):
        if not isinstance(slot, dict):
            raise _slots_error(f"/slots[{i}] is a {type(slot).__name__}, expected an object")
        n_ctx, processing = slot.get("n_ctx"), slot.get("is_processing")
        if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 0:
            raise _slots_error(f"/slots[{i}].n_ctx is {n_ctx!r}, expected an integer ≥ 0")
        if not isinstance(processing, bool):
            raise _slots_error(f"/slots[{i}].is_processing is {processing!r}, expected a bool")
        n_ctx_total += n_ctx
        n_ctx_max = max(n_ctx_max, n_ctx)
        if processing:
            busy += 1
            used = _slot_tokens(slot)
            if used is None:
                tokens_known = False
            else:
                tokens += used
    return SlotsSnapshot(
        total=len(data),
        busy=busy,
        n_ctx_total=n_ctx_total,
        tokens_in_use=tokens if tokens_known else None,
        n_ctx_max=n_ctx_max,
        unified=unified,
    )


def _slot_tokens(slot: Mapping[str, Any]) -> int | None:
    n_past = slot.get("n_past")
    if isinstance(n_past, int) and not isinstance(n_past, bool) and n_past >= 0:
        return n_past
    prompt = slot.get("n_prompt_tokens")
    if "n_prompt_tokens_processed" in slot:  # prompt = the slot's cache, generated tokens included
        ok = isinstance(prompt, int) and not isinstance(prompt, bool) and prompt >= 0
        return prompt if ok else None
    nxt = slot.get("next_token")
    if isinstance(nxt, list):  # newer builds: a one-element list; older: an object
        nxt = nxt[0] if nxt else None
    decoded = nxt.get("n_decoded") if isinstance(nxt, dict) else None
    if isinstance(prompt, int) and isinstance(decoded, int) and prompt >= 0 and decoded >= 0:
        return prompt + decoded
    return None


def _slots_error(message: str) -> MetricsError:
    err = MetricsError(message)
    err.reason = "bad_slots"
    return err


def counter_delta(previous: float | None, current: float) -> float:
    """Increase of a cumulative counter between two scrapes (e.g. ``preemptions_total``).

    A counter that went down was reset by an engine restart: the new value is the delta, as
    Prometheus ``rate()`` treats it (docs/engines.md §2). ``previous=None`` (first scrape) → 0.
    """
    if previous is None:
        return 0.0
    return current - previous if current >= previous else current
