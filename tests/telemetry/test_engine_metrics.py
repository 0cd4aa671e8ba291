"""Engine adapters: every shared fixture, generated TGI / llama.cpp / DP texts, and bad input.

Expected numbers were written by reading each fixture file (tests/fixtures/metrics/).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvgate.telemetry.engine_metrics import (
    ENGINES,
    KV_EPSILON,
    MAX_KV_CAPACITY_TOKENS,
    BadValueError,
    EngineReading,
    MetricsError,
    MissingMetricError,
    SlotsSnapshot,
    UnknownEngineError,
    counter_delta,
    detect_engine,
    parse_llamacpp_slots,
    parse_samples,
    read_engine_metrics,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "metrics"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# file -> (engine, kv_usage, running, waiting, preemptions_total, kv_capacity_tokens) in strict mode
FULL = {
    # gpu_cache_usage_perc 0.0; running 0; waiting 0 + swapped 0; preemptions 0.0;
    # cache_config_info num_gpu_blocks=81767 × block_size=16 = 1308272
    "vllm-v0-0.7-aibrix-runtime-docs.prom": ("vllm-v0", 0.0, 0, 0, 0.0, 81767 * 16),
    # kv_cache_usage_perc{engine="0"} 9.75010481363281e-06; nothing else we read in the excerpt
    "vllm-v1-0.10.0-engine-label-issue-excerpt.prom": (
        "vllm",
        9.75010481363281e-06,
        None,
        None,
        None,
        None,
    ),
    # token_usage 0.28, num_running_reqs 162, num_queue_reqs 2826
    "sglang-docs-2024-llama3.1-8b.prom": ("sglang", 0.28, 162, 2826, None, None),
    # token_usage 0.0, num_running_reqs 1 (tp_rank 0 only), no queue gauge in the excerpt
    "sglang-0.5.1-engine-type-labels-issue-excerpt.prom": ("sglang", 0.0, 1, None, None, None),
    # token_usage 0.0, num_running_reqs 0 (scheduler gauges with engine_type), no queue gauge
    "sglang-0.4.x-mixed-label-sets-pr-excerpt.prom": ("sglang", 0.0, 0, None, None, None),
    # kv_cache_usage_ratio 0.491063, requests_processing 0, requests_deferred 0
    "llamacpp-ikfork-2025-08-with-kv-cache-ratio.prom": ("llamacpp", 0.491063, 0, 0, None, None),
    # no KV ratio (removed by PR #13660): adapts on the queue alone
    "llamacpp-mainline-no-kv-metrics.prom": ("llamacpp", None, 0, 0, None, None),
    # fraction 0.4875; active 0; waiting 1; capacity max 6239 blocks × tokens_per 64
    "triton-trtllm-backend-readme.prom": ("triton-trtllm", 0.4875, 0, 1, None, 6239 * 64),
}

# file -> (engine, missing metric in strict mode, non-strict reading fields)
PARTIAL = {
    # only num_requests_running 8 (docs example has no KV gauge and no waiting gauge)
    "vllm-v1-docs-design-metrics-example.prom": (
        "vllm",
        "vllm:kv_cache_usage_perc",
        {"running": 8, "kv_usage": None, "waiting": None},
    ),
    # only two num_queue_reqs ranks (0 + 0) and untyped gen_throughput: no token_usage
    "sglang-dp8-dp-rank-labels-issue-excerpt.prom": (
        "sglang",
        "sglang:token_usage",
        {"waiting": 0, "running": None, "kv_usage": None},
    ),
    # four counters only: no requests_deferred, no KV ratio
    "llamacpp-2025-06-pr-branch-excerpt.prom": (
        "llamacpp",
        "llamacpp:requests_deferred",
        {"waiting": None, "running": None, "kv_usage": None},
    ),
}


def test_every_fixture_is_covered() -> None:
    listed = set(FULL) | set(PARTIAL) | {"trtllm-serve-early-unprefixed-pr-excerpt.prom"}
    assert listed == {p.name for p in FIXTURES.glob("*.prom")}


@pytest.mark.parametrize("name", sorted(FULL))
def test_fixture_reading(name: str) -> None:
    engine, kv, running, waiting, preempt, capacity = FULL[name]
    r = read_engine_metrics(fixture(name))
    assert r.engine == engine
    assert r.kv_usage == kv
    assert r.running == running
    assert r.waiting == waiting
    assert r.preemptions_total == preempt
    assert r.kv_capacity_tokens == capacity
    assert r.skipped_lines == 0
    # the explicit engine name gives the same reading as detection
    assert read_engine_metrics(fixture(name), engine) == r


@pytest.mark.parametrize("name", sorted(PARTIAL))
def test_fixture_missing_required_metric(name: str) -> None:
    engine, metric, fields = PARTIAL[name]
    with pytest.raises(MissingMetricError) as info:
        read_engine_metrics(fixture(name))
    assert info.value.metric == metric
    assert info.value.reason == "missing_metric"
    r = read_engine_metrics(fixture(name), strict=False)
    assert r.engine == engine
    for key, value in fields.items():
        assert getattr(r, key) == value, key


def test_trtllm_serve_early_fixture() -> None:
    text = fixture("trtllm-serve-early-unprefixed-pr-excerpt.prom")
    # unprefixed names: nothing to detect from
    with pytest.raises(UnknownEngineError):
        read_engine_metrics(text)
    with pytest.raises(MissingMetricError, match="trtllm_kv_cache_utilization"):
        read_engine_metrics(text, "trtllm-serve")
    r = read_engine_metrics(text, "trtllm-serve", strict=False)
    assert (r.kv_usage, r.running, r.waiting) == (None, None, None)


def test_sources_name_the_metrics_used() -> None:
    r = read_engine_metrics(fixture("vllm-v0-0.7-aibrix-runtime-docs.prom"))
    assert r.sources["kv_usage"] == "vllm:gpu_cache_usage_perc"
    assert r.sources["waiting"] == "vllm:num_requests_waiting + vllm:num_requests_swapped"
    assert "cache_config_info" in r.sources["kv_capacity_tokens"]
    r = read_engine_metrics(fixture("vllm-v1-0.10.0-engine-label-issue-excerpt.prom"))
    assert r.sources == {"kv_usage": "vllm:kv_cache_usage_perc"}


def test_model_filter() -> None:
    text = fixture("sglang-docs-2024-llama3.1-8b.prom")
    r = read_engine_metrics(text, model="meta-llama/Llama-3.1-8B-Instruct")
    assert (r.kv_usage, r.waiting) == (0.28, 2826)
    with pytest.raises(MissingMetricError, match="for model 'other'") as info:
        read_engine_metrics(text, model="other")
    assert "meta-llama/Llama-3.1-8B-Instruct" in str(info.value)


# ------------------------------------------------------------------------------ vLLM, generated

VLLM_DP2 = """\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.40
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.90
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.11
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 7.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 4.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7537953269352946e+09
vllm:num_preemptions_total{engine="1",model_name="m"} 1.0
vllm:num_preemptions_created{engine="1",model_name="m"} 1.7537953269352946e+09
vllm:kv_cache_usage_perc{engine="0",model_name="other"} 0.99
vllm:num_requests_waiting{engine="0",model_name="other"} 100.0
"""


def test_vllm_dp_aggregation_and_created_ignored() -> None:
    r = read_engine_metrics(VLLM_DP2, model="m")
    assert r.engine == "vllm"
    assert r.kv_usage == 0.90  # max over engines, kv_cache_usage_perc preferred to the old name
    assert r.running == 8  # sum
    assert r.waiting == 9  # sum
    assert r.preemptions_total == 5.0  # the _created timestamps are not added
    # without a model filter, several models: usage max, waiting sum
    r = read_engine_metrics(VLLM_DP2)
    assert r.kv_usage == 0.99
    assert r.waiting == 109


def test_vllm_falls_back_to_old_kv_name() -> None:
    text = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\nvllm:num_requests_waiting 0\n'
    r = read_engine_metrics(text)
    assert r.kv_usage == 0.5
    assert r.sources["kv_usage"] == "vllm:gpu_cache_usage_perc"


def test_vllm_kv_metric_dropped_is_missing() -> None:
    text = 'vllm:num_requests_running{model_name="m"} 1\nvllm:num_requests_waiting 0\n'
    with pytest.raises(MissingMetricError, match=r"vllm:kv_cache_usage_perc"):
        read_engine_metrics(text)


def test_vllm_cache_config_not_initialised() -> None:
    text = (
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
        "vllm:kv_cache_usage_perc 0.1\n"
    )
    assert read_engine_metrics(text).kv_capacity_tokens is None


@pytest.mark.parametrize(
    "text",
    [
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="99999999999999999999"} 1.0\n'
        "vllm:kv_cache_usage_perc 0.1\n",
        'sglang:token_usage{model_name="m"} 0.2\nsglang:num_queue_reqs{model_name="m"} 0\n'
        'sglang:max_total_num_tokens{model_name="m"} 1e30\n',
    ],
    ids=["vllm", "sglang"],
)
def test_a_kv_capacity_no_engine_can_hold_is_a_bad_value(text: str) -> None:
    """More than ``MAX_KV_CAPACITY_TOKENS`` (a trillion tokens) is a broken exposition, refused
    like a NaN, rather than a budget the core cannot take or a record JSON cannot hold."""
    with pytest.raises(BadValueError, match="more than an engine can hold") as err:
        read_engine_metrics(text)
    assert err.value.value > MAX_KV_CAPACITY_TOKENS


def test_a_kv_capacity_of_zero_is_none_stated() -> None:
    text = 'sglang:token_usage{model_name="m"} 0.2\nsglang:num_queue_reqs{model_name="m"} 0\n'
    r = read_engine_metrics(text + 'sglang:max_total_num_tokens{model_name="m"} 0\n')
    assert r.kv_capacity_tokens is None
    assert "kv_capacity_tokens" not in r.sources


# ------------------------------------------------------------------------------ SGLang, generated

SGLANG_DP = """\
sglang:token_usage{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.30
sglang:token_usage{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="1"} 0.30
sglang:token_usage{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="2"} 0.75
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 4
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="1"} 4
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="2"} 6
sglang:num_queue_reqs{dp_rank="0",model_name="m",priority="",tp_rank="0"} 5
sglang:num_queue_reqs{dp_rank="0",model_name="m",priority="1",tp_rank="0"} 2
sglang:num_queue_reqs{dp_rank="0",model_name="m",priority="2",tp_rank="0"} 3
sglang:num_queue_reqs{dp_rank="1",model_name="m",priority="",tp_rank="2"} 1
sglang:max_total_num_tokens{dp_rank="0",model_name="m",tp_rank="0"} 100000
sglang:max_total_num_tokens{dp_rank="0",model_name="m",tp_rank="1"} 100000
sglang:max_total_num_tokens{dp_rank="1",model_name="m",tp_rank="2"} 100000
sglang:num_retracted_requests_total{dp_rank="0",model_name="m",tp_rank="0"} 7
sglang:num_retracted_requests_total{dp_rank="1",model_name="m",tp_rank="2"} 2
"""


def test_sglang_ranks_priority_and_capacity() -> None:
    r = read_engine_metrics(SGLANG_DP)
    assert r.engine == "sglang"
    assert r.kv_usage == 0.75  # max over dp_rank
    assert r.running == 10  # tp replicas deduplicated (4), summed over dp_rank (4 + 6)
    assert r.waiting == 6  # priority="" is the total: 5 + 1, per-priority series not added
    assert r.kv_capacity_tokens == 200_000  # one pool per dp_rank
    assert r.preemptions_total == 9.0


def test_sglang_per_priority_only_series_are_summed() -> None:
    text = (
        'sglang:token_usage{model_name="m"} 0.2\n'
        'sglang:num_queue_reqs{model_name="m",priority="1"} 2\n'
        'sglang:num_queue_reqs{model_name="m",priority="2"} 3\n'
    )
    assert read_engine_metrics(text).waiting == 5


def test_sglang_router_underscore_spelling() -> None:
    text = SGLANG_DP.replace("sglang:", "sglang_")
    r = read_engine_metrics(text)
    assert (r.engine, r.kv_usage, r.running, r.waiting) == ("sglang", 0.75, 10, 6)
    assert r.sources["kv_usage"] == "sglang_token_usage"


# ------------------------------------------------------------------------------ TGI, generated


def tgi_text(*, current: float, total: float | None, queue: float = 3, batch: float = 2) -> str:
    """TGI router exposition (metrics-exporter-prometheus: no _total, no labels)."""
    lines = [
        "# TYPE tgi_queue_size gauge",
        f"tgi_queue_size {queue}",
        "# TYPE tgi_batch_current_size gauge",
        f"tgi_batch_current_size {batch}",
        "# TYPE tgi_batch_current_max_tokens gauge",
        f"tgi_batch_current_max_tokens {current}",
        "# TYPE tgi_request_count counter",
        "tgi_request_count 12",
        'tgi_request_failure{err="overloaded"} 1',
    ]
    if total is not None:
        lines += ["# TYPE tgi_batch_max_total_tokens gauge", f"tgi_batch_max_total_tokens {total}"]
    return "\n".join(lines) + "\n"


def test_tgi_derived_ratio() -> None:
    r = read_engine_metrics(tgi_text(current=12000, total=16000))
    assert r.engine == "tgi"
    assert r.kv_usage == pytest.approx(0.75)
    assert r.running == 2
    assert r.waiting == 3
    assert r.kv_capacity_tokens == 16000
    assert r.sources["kv_usage"] == "tgi_batch_current_max_tokens/tgi_batch_max_total_tokens"


def test_tgi_without_total_adapts_on_queue() -> None:
    # v2.3.0 has neither the gauge nor the /info field: no KV ratio, the queue still counts
    r = read_engine_metrics(tgi_text(current=12000, total=None))
    assert (r.kv_usage, r.waiting, r.kv_capacity_tokens) == (None, 3, None)


def test_tgi_reservation_over_capacity_is_bad() -> None:
    with pytest.raises(BadValueError):
        read_engine_metrics(tgi_text(current=20000, total=16000))


def test_tgi_queue_missing() -> None:
    with pytest.raises(MissingMetricError, match="tgi_queue_size"):
        read_engine_metrics("tgi_batch_current_size 1\n")


# ------------------------------------------------------------------------------ llama.cpp /slots


def slot(i: int, *, busy: bool, n_ctx: int = 4096, prompt: int = 0, decoded: int = 0) -> dict:
    """One slot in the shape of server_slot::to_json (tools/server/server-context.cpp)."""
    out: dict = {"id": i, "n_ctx": n_ctx, "speculative": False, "is_processing": busy}
    if busy:
        out |= {
            "id_task": 10 + i,
            "n_prompt_tokens": prompt,
            "n_prompt_tokens_processed": prompt,
            "n_prompt_tokens_cache": 0,
            "params": {},
            "next_token": [
                {
                    "has_next_token": True,
                    "has_new_line": False,
                    "n_remain": -1,
                    "n_decoded": decoded,
                }
            ],
        }
    return out


SLOTS_JSON = json.dumps(
    [
        slot(0, busy=True, prompt=1000, decoded=24),
        slot(1, busy=False),
        slot(2, busy=True, prompt=300, decoded=0),
        slot(3, busy=False),
    ]
)


def test_slots_parse() -> None:
    s = parse_llamacpp_slots(SLOTS_JSON)
    # n_prompt_tokens is the slot's token cache (generated tokens included) in this shape
    assert s == SlotsSnapshot(
        total=4, busy=2, n_ctx_total=4 * 4096, tokens_in_use=1300, n_ctx_max=4096
    )
    assert s.occupancy == 0.5
    assert (s.kv_capacity_tokens, s.kv_usage) == (4 * 4096, 1300 / (4 * 4096))
    assert parse_llamacpp_slots(SLOTS_JSON.encode()) == s
    # one KV pool shared by the slots: each slot's n_ctx is the whole pool
    u = parse_llamacpp_slots(SLOTS_JSON, unified=True)
    assert (u.kv_capacity_tokens, u.kv_usage) == (4096, 1300 / 4096)


def test_slots_old_shape_and_n_past() -> None:
    old = [{"id": 0, "n_ctx": 512, "is_processing": True, "next_token": {"n_decoded": 5}}]
    assert parse_llamacpp_slots(old).tokens_in_use is None  # no prompt token count in that build
    assert parse_llamacpp_slots(old).kv_usage is None  # no reading rather than a slot count
    older = [{**old[0], "n_prompt_tokens": 40}]  # prompt only: add what was decoded
    assert parse_llamacpp_slots(older).tokens_in_use == 45
    with_past = [{"id": 0, "n_ctx": 512, "is_processing": True, "n_past": 77}]
    assert parse_llamacpp_slots(with_past).tokens_in_use == 77
    assert parse_llamacpp_slots([]).occupancy == 0.0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("not json", "not JSON"),
        ('{"error": "x"}', "expected a list of slots"),
        ("[1]", r"/slots\[0\] is a int"),
        ('[{"n_ctx": "4096", "is_processing": false}]', r"/slots\[0\].n_ctx"),
        ('[{"n_ctx": -1, "is_processing": false}]', r"/slots\[0\].n_ctx"),
        ('[{"n_ctx": 4096, "is_processing": 1}]', r"/slots\[0\].is_processing"),
    ],
)
def test_slots_bad(body: str, message: str) -> None:
    with pytest.raises(MetricsError, match=message) as info:
        parse_llamacpp_slots(body)
    assert info.value.reason == "bad_slots"


def test_llamacpp_mainline_with_slots() -> None:
    slots = parse_llamacpp_slots(SLOTS_JSON)
    r = read_engine_metrics(fixture("llamacpp-mainline-no-kv-metrics.prom"), slots=slots)
    # tokens held by the busy slots over the capacity, not busy slots over slots (0.5)
    assert r.kv_usage == 1300 / (4 * 4096)
    assert r.kv_capacity_tokens == 4 * 4096
    assert r.running == 0  # the metric wins over the slot count
    assert r.sources["kv_usage"].startswith("GET /slots")
    # a build that still has the ratio keeps it
    r = read_engine_metrics(
        fixture("llamacpp-ikfork-2025-08-with-kv-cache-ratio.prom"), slots=slots
    )
    assert r.kv_usage == 0.491063


# ------------------------------------------------------------------------------ other engines


def test_trtllm_serve_and_lmdeploy_generated() -> None:
    text = (
        'trtllm_kv_cache_utilization{model_name="m",engine_type="pytorch"} 0.6\n'
        'trtllm_num_requests_running{model_name="m",engine_type="pytorch"} 4\n'
        'trtllm_num_requests_waiting{model_name="m",engine_type="pytorch"} 1\n'
    )
    r = read_engine_metrics(text)
    assert (r.engine, r.kv_usage, r.running, r.waiting) == ("trtllm-serve", 0.6, 4, 1)
    text = (
        'lmdeploy:gpu_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
        'lmdeploy:num_requests_waiting{engine="0",model_name="m"} 6\n'
    )
    r = read_engine_metrics(text)
    assert (r.engine, r.kv_usage, r.waiting) == ("lmdeploy", 0.2, 6)


def test_triton_used_over_max_fallback() -> None:
    text = (
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="t",version="1"} 50\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="t",version="1"} 200\n'
        "nv_trt_llm_kv_cache_block_metrics"
        '{kv_cache_block_type="tokens_per",model="t",version="1"} 64\n'
        'nv_inference_pending_request_count{model="t",version="1"} 3\n'
    )
    r = read_engine_metrics(text)
    assert (r.kv_usage, r.waiting, r.kv_capacity_tokens) == (0.25, 3, 200 * 64)


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "text",
    [
        "<html><body>502 Bad Gateway</body></html>\n",
        "",
        "\x00\x01\x02 garbage {{{\n",
        '{"object": "list", "data": []}',
    ],
)
def test_garbage_is_unknown_engine(text: str) -> None:
    with pytest.raises(UnknownEngineError) as info:
        read_engine_metrics(text)
    assert info.value.reason == "unknown_engine"


def test_garbage_with_engine_set_is_missing_metric() -> None:
    with pytest.raises(MissingMetricError):
        read_engine_metrics("<html>oops</html>\n", "vllm")


@pytest.mark.parametrize("value", ["NaN", "+Inf", "1.3", "-0.2", "85.0", str(1 + 10 * KV_EPSILON)])
def test_bad_kv_values_are_refused_not_rescaled(value: str) -> None:
    text = f'vllm:kv_cache_usage_perc{{model_name="m"}} {value}\nvllm:num_requests_waiting 0\n'
    with pytest.raises(BadValueError) as info:
        read_engine_metrics(text)
    assert info.value.reason == "bad_value"
    assert info.value.metric == "vllm:kv_cache_usage_perc"
    assert math.isnan(info.value.value) or info.value.value == float(value)


def test_kv_within_epsilon_is_clamped() -> None:
    text = f"vllm:kv_cache_usage_perc {1 + KV_EPSILON / 2}\n"
    assert read_engine_metrics(text).kv_usage == 1.0
    assert read_engine_metrics("vllm:kv_cache_usage_perc 1.0\n").kv_usage == 1.0


@pytest.mark.parametrize("value", ["NaN", "-1", "1e30", "1000000001"])
def test_bad_counts_are_refused(value: str) -> None:
    text = f"vllm:kv_cache_usage_perc 0.2\nvllm:num_requests_waiting {value}\n"
    with pytest.raises(BadValueError, match="vllm:num_requests_waiting"):
        read_engine_metrics(text)


def test_counts_that_sum_past_any_engine_are_refused() -> None:
    text = (
        "vllm:kv_cache_usage_perc 0.2\n"
        'vllm:num_requests_waiting{model_name="a"} 600000000\n'
        'vllm:num_requests_waiting{model_name="b"} 600000000\n'
    )
    with pytest.raises(BadValueError, match="more than an engine can hold"):
        read_engine_metrics(text)
    assert read_engine_metrics(text.replace("600000000", "6")).waiting == 12


def test_bad_lines_are_skipped_not_fatal() -> None:
    text = (
        "# HELP vllm:kv_cache_usage_perc broken \\x escape\n"
        'vllm:kv_cache_usage_perc{model_name="m"} 0.42\n'
        'vllm:num_requests_waiting{model_name="m" 3\n'  # unterminated label set
        'vllm:num_requests_running{model_name="m"} 2\n'
    )
    r = read_engine_metrics(text)
    assert (r.kv_usage, r.running, r.waiting) == (0.42, 2, None)
    assert r.skipped_lines == 1


def test_bytes_input_and_timestamps() -> None:
    text = b'vllm:kv_cache_usage_perc{model_name="m"} 0.5 1700000000000\n\xff\n'
    assert read_engine_metrics(text).kv_usage == 0.5


def test_unknown_engine_name() -> None:
    with pytest.raises(UnknownEngineError, match="unknown engine 'ollama'"):
        read_engine_metrics("x 1\n", "ollama")


def test_detect_engine() -> None:
    assert detect_engine(["vllm:kv_cache_usage_perc"]) == "vllm"
    assert detect_engine(["vllm:gpu_cache_usage_perc", "vllm:num_requests_swapped"]) == "vllm-v0"
    assert detect_engine(["sglang_token_usage"]) == "sglang"
    assert detect_engine(["tgi_queue_size"]) == "tgi"
    assert detect_engine(["nv_trt_llm_request_metrics"]) == "triton-trtllm"
    with pytest.raises(UnknownEngineError, match="several engines"):
        detect_engine(["vllm:num_requests_running", "sglang:token_usage"])
    assert set(ENGINES) >= {"vllm", "sglang", "tgi", "llamacpp"}


def test_parse_samples_keeps_all_or_selected() -> None:
    samples, skipped = parse_samples(VLLM_DP2)
    assert "vllm:num_preemptions_created" in samples
    assert skipped == 0
    samples, _ = parse_samples(VLLM_DP2, ["vllm:num_requests_waiting"])
    assert list(samples) == ["vllm:num_requests_waiting"]
    assert len(samples["vllm:num_requests_waiting"]) == 3


def test_counter_delta() -> None:
    assert counter_delta(None, 5) == 0.0
    assert counter_delta(5, 8) == 3.0
    assert counter_delta(8, 2) == 2.0  # engine restarted: counter reset


def test_reading_is_frozen() -> None:
    r = EngineReading(engine="vllm", kv_usage=0.1)
    with pytest.raises(AttributeError):
        r.kv_usage = 0.2  # type: ignore[misc]
