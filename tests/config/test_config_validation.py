"""Configuration model: every validation rule has a bad-config test with its exact message."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from kvgate.__main__ import main
from kvgate.config import Config, ConfigError, EngineOption, load_config, parse_config
from kvgate.telemetry.engine_metrics import ENGINES

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "kvgate.yaml"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


H0, H1, ADMIN = sha("key-0"), sha("key-1"), sha("admin")
HEX_RULE = (
    "must be a SHA-256 hex digest (64 hex characters; store the hash of the key, never the key)"
)
NAME_RULE = "must start with a letter or digit and hold only letters, digits, '.', '_', '-'"


def base() -> dict[str, Any]:
    return {
        "backends": [
            {
                "name": "a",
                "url": "http://127.0.0.1:8000",
                "models": [{"name": "m", "context_window": 4096}],
                "max_concurrency": 10,
            }
        ],
        "tenants": [
            {"name": "t0", "api_key_sha256": [H0], "guaranteed_slots": 2},
            {"name": "t1", "api_key_sha256": [H1]},
            {"name": "t2", "priority": "sheddable"},
        ],
        "admin_key_sha256": ADMIN,
    }


def with_value(path: str, value: Any, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of ``data`` (default: base()) with ``path`` (``a.b[1].c``) set to ``value``."""
    data = copy.deepcopy(base() if data is None else data)
    parts = [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", path)]
    node: Any = data
    for part in parts[:-1]:
        if isinstance(node, dict) and part not in node:
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value
    return data


def issues_of(data: Any, **kw: Any) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, env={}, **kw)
    return info.value.issues


def test_base_is_valid() -> None:
    cfg = parse_config(base(), env={})
    assert isinstance(cfg, Config)
    b = cfg.backend("a")
    assert b.effective_metrics_url == "http://127.0.0.1:8000/metrics"
    assert b.effective_health_url == "http://127.0.0.1:8000/health"
    assert (b.adaptive.high, b.adaptive.low, b.adaptive.floor) == (0.85, 0.70, 0.6)
    assert (b.adaptive.poll_interval, b.adaptive.stale_after) == (1.0, 5.0)
    assert cfg.tenant("t2").priority == "sheddable"
    assert cfg.tenant("t1").guaranteed_slots == 0
    assert cfg.mode == "enforce"
    with pytest.raises(KeyError):
        cfg.tenant("nobody")


# (path, value) -> the exact issues
FIELD_RULES: list[tuple[str, Any, list[tuple[str, str]]]] = [
    ("tenants[2].guaranteed_slots", -1, [("tenants[2].guaranteed_slots", "must be ≥ 0")]),
    (
        "tenants[0].priority",
        "vip",
        [("tenants[0].priority", "must be 'critical', 'standard' or 'sheddable'")],
    ),
    ("tenants[0].api_key_sha256[0]", "sk-plain-key", [("tenants[0].api_key_sha256[0]", HEX_RULE)]),
    ("tenants[0].api_key_sha256[0]", H0[:63] + "g", [("tenants[0].api_key_sha256[0]", HEX_RULE)]),
    ("admin_key_sha256", "abc", [("admin_key_sha256", HEX_RULE)]),
    ("tenants[0].name", "bad name!", [("tenants[0].name", NAME_RULE)]),
    ("tenants[0].name", "", [("tenants[0].name", "must not be empty")]),
    ("backends[0].name", "-a", [("backends[0].name", NAME_RULE)]),
    (
        "backends[0].url",
        "ftp://x",
        [("backends[0].url", "must be an http:// or https:// URL, got 'ftp://x'")],
    ),
    (
        "backends[0].url",
        "localhost:8000",
        [("backends[0].url", "must be an http:// or https:// URL, got 'localhost:8000'")],
    ),
    (
        "backends[0].metrics_url",
        "/metrics",
        [("backends[0].metrics_url", "must be an http:// or https:// URL, got '/metrics'")],
    ),
    (
        "backends[0].engine",
        "ollama",
        [
            (
                "backends[0].engine",
                "must be 'auto', 'vllm', 'vllm-v0', 'sglang', 'tgi', 'llamacpp', "
                "'triton-trtllm', 'trtllm-serve' or 'lmdeploy'",
            )
        ],
    ),
    ("backends[0].models", [], [("backends[0].models", "must have at least 1 entry")]),
    ("backends", [], [("backends", "must have at least 1 entry")]),
    (
        "backends[0].models[0].context_window",
        0,
        [("backends[0].models[0].context_window", "must be ≥ 1")],
    ),
    (
        "backends[0].models[0].default_max_tokens",
        0,
        [("backends[0].models[0].default_max_tokens", "must be ≥ 1")],
    ),
    ("backends[0].max_concurrency", 0, [("backends[0].max_concurrency", "must be ≥ 1")]),
    ("backends[0].max_concurrency", "ten", [("backends[0].max_concurrency", "must be an integer")]),
    ("backends[0].max_concurrency", 2.5, [("backends[0].max_concurrency", "must be an integer")]),
    ("backends[0].tokens_per_minute", 0, [("backends[0].tokens_per_minute", "must be ≥ 1")]),
    ("backends[0].inflight_token_limit", -5, [("backends[0].inflight_token_limit", "must be ≥ 1")]),
    (
        "backends[0].capacity_safety_factor",
        0,
        [("backends[0].capacity_safety_factor", "must be > 0")],
    ),
    (
        "backends[0].capacity_safety_factor",
        1.5,
        [("backends[0].capacity_safety_factor", "must be ≤ 1")],
    ),
    ("backends[0].adaptive.floor", 0, [("backends[0].adaptive.floor", "must be > 0")]),
    ("backends[0].adaptive.floor", 1.2, [("backends[0].adaptive.floor", "must be ≤ 1")]),
    ("backends[0].adaptive.high", 1.2, [("backends[0].adaptive.high", "must be ≤ 1")]),
    ("backends[0].adaptive.low", -0.1, [("backends[0].adaptive.low", "must be ≥ 0")]),
    (
        "backends[0].adaptive.recovery_per_second",
        0,
        [("backends[0].adaptive.recovery_per_second", "must be > 0")],
    ),
    (
        "backends[0].adaptive.waiting_threshold",
        -1,
        [("backends[0].adaptive.waiting_threshold", "must be ≥ 0")],
    ),
    (
        "backends[0].adaptive.poll_interval",
        0,
        [("backends[0].adaptive.poll_interval", "must be > 0")],
    ),
    (
        "backends[0].adaptive.enabled",
        "maybe",
        [("backends[0].adaptive.enabled", "must be true or false")],
    ),
    ("backends[0].mode", "dry-run", [("backends[0].mode", "must be 'enforce' or 'shadow'")]),
    ("tenants[1].mode", "off", [("tenants[1].mode", "must be 'enforce' or 'shadow'")]),
    ("mode", "audit", [("mode", "must be 'enforce' or 'shadow'")]),
    ("tenants[1].max_wait_ms", -1, [("tenants[1].max_wait_ms", "must be ≥ 0")]),
    ("tenants[1].tokens_per_minute", 0, [("tenants[1].tokens_per_minute", "must be ≥ 1")]),
    ("tenants[1].max_concurrency", 0, [("tenants[1].max_concurrency", "must be ≥ 1")]),
    ("tenants", {"t0": {}}, [("tenants", "must be a list")]),
    ("backends[0].models[0]", "m", [("backends[0].models[0]", "must be a mapping")]),
    (
        "backends[0].max_concurency",
        5,
        [("backends[0].max_concurency", "unknown field; did you mean `max_concurrency`?")],
    ),
    ("backends[0].zzz", 5, [("backends[0].zzz", "unknown field")]),  # nothing close
    ("workers", 0, [("workers", "must be ≥ 1")]),
    ("listen.port", 70000, [("listen.port", "must be ≤ 65535")]),
    ("max_body_bytes", 0, [("max_body_bytes", "must be ≥ 1")]),
    ("queue.max_size", -1, [("queue.max_size", "must be ≥ 0")]),
    ("timeouts.connect", 0, [("timeouts.connect", "must be > 0")]),
    ("timeouts.total", -1, [("timeouts.total", "must be > 0")]),
    # what the admission core or the process table cannot hold, refused in the file (not at
    # start-up, nor half-way through a reload)
    (
        "backends[0].max_concurrency",
        2**62 + 1,
        [("backends[0].max_concurrency", f"must be ≤ {2**62}")],
    ),
    (
        "backends[0].tokens_per_minute",
        2**63,
        [("backends[0].tokens_per_minute", f"must be ≤ {2**62}")],
    ),
    (
        "tenants[1].tokens_per_minute",
        2**64,
        [("tenants[1].tokens_per_minute", f"must be ≤ {2**62}")],
    ),
    ("max_body_bytes", 10**20, [("max_body_bytes", f"must be ≤ {2**62}")]),
    (
        "backends[0].models[0].context_window",
        10**20,
        [("backends[0].models[0].context_window", f"must be ≤ {2**62}")],
    ),
    ("workers", 64, [("workers", "must be ≤ 63")]),
    # booleans are not numbers; NaN and infinities are not finite
    (
        "backends[0].max_concurrency",
        True,
        [("backends[0].max_concurrency", "must be a number, not true/false")],
    ),
    (
        "backends[0].capacity_safety_factor",
        False,
        [("backends[0].capacity_safety_factor", "must be a number, not true/false")],
    ),
    (
        "backends[0].capacity_safety_factor",
        float("nan"),
        [("backends[0].capacity_safety_factor", "must be a finite number")],
    ),
    ("timeouts.connect", float("nan"), [("timeouts.connect", "must be a finite number")]),
    ("timeouts.total", float("inf"), [("timeouts.total", "must be a finite number")]),
    ("tenants[1].backends", [], [("tenants[1].backends", "must have at least 1 entry")]),
]


@pytest.mark.parametrize(
    ("path", "value", "expected"), FIELD_RULES, ids=[r[0] for r in FIELD_RULES]
)
def test_field_rule(path: str, value: Any, expected: list[tuple[str, str]]) -> None:
    assert issues_of(with_value(path, value)) == expected


def test_required_fields() -> None:
    data = base()
    del data["backends"][0]["max_concurrency"]  # optional: the engine's own batch limit
    del data["backends"][0]["models"][0]["context_window"]
    assert issues_of(data) == [("backends[0].models[0].context_window", "is required")]
    assert issues_of({"tenants": []}) == [("backends", "is required")]


def test_all_field_issues_reported_at_once() -> None:
    data = with_value("tenants[2].guaranteed_slots", -1)
    data = with_value("workers", 0, data)
    data = with_value("backends[0].adaptive.floor", 0, data)
    assert issues_of(data) == [
        ("workers", "must be ≥ 1"),
        ("backends[0].adaptive.floor", "must be > 0"),
        ("tenants[2].guaranteed_slots", "must be ≥ 0"),
    ]


def second_backend(data: dict[str, Any], name: str = "b") -> dict[str, Any]:
    extra = copy.deepcopy(data["backends"][0]) | {"name": name}
    data["backends"].append(extra)
    return data


CROSS_RULES: list[tuple[str, dict[str, Any], list[tuple[str, str]]]] = [
    (
        "low_below_high",
        with_value("backends[0].adaptive", {"high": 0.8, "low": 0.8}),
        [("backends[0].adaptive.low", "must be < adaptive.high (0.8)")],
    ),
    (
        "stale_after_at_least_interval",
        with_value("backends[0].adaptive", {"poll_interval": 2, "stale_after": 1}),
        [("backends[0].adaptive.stale_after", "must be ≥ poll_interval (2)")],
    ),
    (
        "scrape_timeout_below_interval",
        with_value("backends[0].adaptive.scrape_timeout", 1.0),
        [("backends[0].adaptive.scrape_timeout", "must be < poll_interval (1)")],
    ),
    (
        "default_max_tokens_below_context",
        with_value("backends[0].models[0].default_max_tokens", 4096),
        [("backends[0].models[0].default_max_tokens", "must be < context_window (4096)")],
    ),
    (
        "burst_needs_tpm",
        with_value("backends[0].burst_tokens", 1000),
        [("backends[0].burst_tokens", "needs tokens_per_minute")],
    ),
    (
        "tenant_burst_needs_tpm",
        with_value("tenants[1].burst_tokens", 1000),
        [("tenants[1].burst_tokens", "needs tokens_per_minute")],
    ),
    (
        "unique_backend_names",
        second_backend(base(), "a"),
        [("backends[1].name", "duplicate backend name 'a' (also backends[0])")],
    ),
    (
        "unique_model_names",
        with_value(
            "backends[0].models",
            [{"name": "m", "context_window": 10}, {"name": "m", "context_window": 20}],
        ),
        [("backends[0].models[1].name", "duplicate model 'm' (also models[0])")],
    ),
    (
        "unique_tenant_names",
        with_value("tenants[2].name", "t0"),
        [("tenants[2].name", "duplicate tenant name 't0' (also tenants[0])")],
    ),
    (
        "guaranteed_within_tenant_cap",
        with_value("tenants[0].max_concurrency", 1),
        [("tenants[0].guaranteed_slots", "must be ≤ the tenant's max_concurrency (1)")],
    ),
    (
        "guaranteed_sum_within_backend",
        with_value("tenants[1].guaranteed_slots", 9),
        [
            (
                "backends[0].max_concurrency",
                "10 is less than the guaranteed slots of the tenants that use it (11: t0 2, t1 9)",
            )
        ],
    ),
    (
        "tenant_backends_exist",
        with_value("tenants[1].backends", ["a", "nope"]),
        [("tenants[1].backends", "no backend named 'nope'")],
    ),
    (
        "anonymous_tenant_exists",
        with_value("anonymous_tenant", "guest"),
        [("anonymous_tenant", "no tenant named 'guest'")],
    ),
    (
        "key_hash_used_once",
        with_value("tenants[1].api_key_sha256", [H1, H0.upper()]),
        [("tenants[1].api_key_sha256[1]", "the same key hash is already used by tenants[0]")],
    ),
    (
        "key_hash_not_admin",
        with_value("tenants[1].api_key_sha256", [ADMIN]),
        [("tenants[1].api_key_sha256[0]", "the same key hash is the admin key")],
    ),
    (
        "first_byte_within_total",
        with_value("timeouts", {"first_byte": 700, "total": 600}),
        [("timeouts.first_byte", "must be ≤ timeouts.total (600)")],
    ),
    (
        "idle_within_total",
        with_value("timeouts", {"idle": 30, "total": 10, "first_byte": 5}),
        [("timeouts.idle", "must be ≤ timeouts.total (10)")],
    ),
]


@pytest.mark.parametrize(("rule", "data", "expected"), CROSS_RULES, ids=[r[0] for r in CROSS_RULES])
def test_cross_field_rule(rule: str, data: dict[str, Any], expected: list[tuple[str, str]]) -> None:
    assert issues_of(data) == expected


def test_guarantees_only_count_on_backends_the_tenant_uses() -> None:
    data = second_backend(base())
    data = with_value("tenants[1].guaranteed_slots", 8, data)
    data = with_value("tenants[1].backends", ["b"], data)
    cfg = parse_config(data, env={})  # a: t0 2; b: t0 2 + t1 8 = 10 ≤ 10
    assert cfg.tenant("t1").backends == ["b"]
    data = with_value("tenants[1].guaranteed_slots", 9, data)
    assert issues_of(data) == [
        (
            "backends[1].max_concurrency",
            "10 is less than the guaranteed slots of the tenants that use it (11: t0 2, t1 9)",
        )
    ]


def test_cross_field_issues_reported_together() -> None:
    data = with_value("anonymous_tenant", "guest")
    data = with_value("backends[0].adaptive.low", 0.9, data)
    assert issues_of(data) == [
        ("backends[0].adaptive.low", "must be < adaptive.high (0.85)"),
        ("anonymous_tenant", "no tenant named 'guest'"),
    ]


def test_key_hashes_are_normalised_to_lower_case() -> None:
    cfg = parse_config(with_value("tenants[0].api_key_sha256", [H0.upper()]), env={})
    assert cfg.tenant("t0").api_key_sha256 == [H0]


def test_engine_options_match_the_adapters() -> None:
    assert set(get_args(EngineOption)) == {"auto", *ENGINES}


def test_config_is_frozen() -> None:
    cfg = parse_config(base(), env={})
    with pytest.raises(ValueError, match="frozen"):
        cfg.workers = 3  # type: ignore[misc]


# ------------------------------------------------------------------------------ files, env


def write(tmp_path: Path, text: str, name: str = "kvgate.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


MINIMAL = """\
backends:
  - name: a
    url: ${ENGINE_URL}
    models: [{name: m, context_window: 4096}]
    max_concurrency: ${CONC:-8}
tenants:
  - name: t
    api_key_sha256: ["${T_KEY}"]
admin_key_sha256: $${NOT_A_VAR}
"""


def test_env_substitution(tmp_path: Path) -> None:
    env = {"ENGINE_URL": "http://10.0.0.5:8000", "T_KEY": H0}
    cfg = load_config(write(tmp_path, MINIMAL.replace("$${NOT_A_VAR}", ADMIN)), env=env)
    assert cfg.backends[0].url == "http://10.0.0.5:8000"
    assert cfg.backends[0].max_concurrency == 8  # the default, converted to int
    assert cfg.tenants[0].api_key_sha256 == [H0]
    cfg = load_config(
        write(tmp_path, MINIMAL.replace("$${NOT_A_VAR}", ADMIN)), env=env | {"CONC": "3"}
    )
    assert cfg.backends[0].max_concurrency == 3


def test_env_missing_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, MINIMAL), env={"T_KEY": H0})
    assert info.value.issues == [("backends[0].url", "environment variable ENGINE_URL is not set")]


def test_env_literal_dollar_brace(tmp_path: Path) -> None:
    env = {"ENGINE_URL": "http://e:1", "T_KEY": H0}
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, MINIMAL), env=env)
    # $${NOT_A_VAR} became the literal text ${NOT_A_VAR}, which is not a hash
    assert info.value.issues == [("admin_key_sha256", HEX_RULE)]


def test_env_bad_reference(tmp_path: Path) -> None:
    text = MINIMAL.replace("${ENGINE_URL}", "http://${1BAD}:80")
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), env={"T_KEY": H0})
    assert info.value.issues[0] == ("backends[0].url", "bad environment reference ${1BAD}")


def test_env_value_cannot_change_structure(tmp_path: Path) -> None:
    env = {"ENGINE_URL": "http://e:1\nworkers: 99", "T_KEY": H0}
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, MINIMAL.replace("$${NOT_A_VAR}", ADMIN)), env=env)
    assert info.value.issues == [
        ("backends[0].url", "must not contain spaces or control characters")
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "the file is empty"),
        ("- a\n- b\n", "the top level must be a mapping of settings"),
        ("backends: [\n", "not valid YAML: line 2, column 1: expected the node content"),
        ("workers: 1\nworkers: 2\n", "not valid YAML: line 2, column 1: duplicate key 'workers'"),
        ("a: b: c\n", "not valid YAML: line 1, column 5: mapping values are not allowed here"),
        # a JSON object is read by the JSON parser; one it refuses goes to YAML's, which words
        # the error with its line and column (a duplicate key, a constant JSON does not have)
        (
            '{"workers": 1,\n "workers": 2}',
            "not valid YAML: line 2, column 2: duplicate key 'workers'",
        ),
        ('{"workers": NaN}', "must be an integer"),  # YAML: the string 'NaN'
        ('{"workers": 1e0}', "must be an integer"),  # YAML: the string '1e0'
        ('{"workers": 1.0e+0, "backends": 1}', "must be a list"),  # YAML's float: workers 1
        ('{"a": ' * 3000 + "1" + "}" * 3000, "not a configuration: nested too deeply"),
        ('{"a": [' * 400 + "1" + "]}" * 400, "not a configuration: nested too deeply"),
        ('{"workers": ' + "9" * 5000 + "}", "not valid YAML: Exceeds the limit"),
    ],
)
def test_bad_files(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert info.value.issues[0][1].startswith(message), info.value.issues
    assert str(info.value).startswith(f"invalid configuration {tmp_path / 'kvgate.yaml'}:\n")


def test_a_json_file_reads_as_the_same_document_as_yaml(tmp_path: Path) -> None:
    """The JSON parser (fast with 100,000 tenants) and YAML's give the same configuration;
    YAML's flow style, which starts like JSON, still reads as YAML."""
    data = with_value("backends[0].url", "${ENGINE_URL}") | {"workers": 2}
    as_json = tmp_path / "kvgate.json"
    as_json.write_text(json.dumps(data, indent=1))
    as_yaml = tmp_path / "kvgate.yaml"
    as_yaml.write_text(yaml.safe_dump(data))
    env = {"ENGINE_URL": "http://127.0.0.1:9"}
    assert load_config(as_json, env=env) == load_config(as_yaml, env=env)
    flow = tmp_path / "flow.yaml"
    flow.write_text(
        "{backends: [{name: a, url: 'http://127.0.0.1:9', models: [{name: m, context_window: 9}]}],"
        " workers: 2}"
    )
    cfg = load_config(flow)
    assert (cfg.workers, cfg.backends[0].models[0].context_window) == (2, 9)
    # numbers and characters YAML reads differently from JSON read as YAML reads them
    for name, text in (
        ("exponent", json.dumps(data).replace('"workers": 2', '"workers": 2e0')),
        ("nel", json.dumps(data, ensure_ascii=False).replace('"m"', '"m\u0085n"')),
    ):
        as_json.write_text(text)
        as_yaml.write_text("# read by YAML's parser\n" + text)
        try:
            expected: Any = load_config(as_yaml, env=env)
        except ConfigError as exc:
            expected = exc.issues
        try:
            got: Any = load_config(as_json, env=env)
        except ConfigError as exc:
            got = exc.issues
        assert got == expected, name


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "missing.yaml")
    assert info.value.issues == [("", "cannot read the file: No such file or directory")]
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.issues[0][1].startswith("cannot read the file:")


def test_tokenizer_and_template_paths(tmp_path: Path) -> None:
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    (tmp_path / "chat.jinja").write_text("{{ messages }}")
    data = with_value(
        "backends[0].models[0]",
        {
            "name": "m",
            "context_window": 10,
            "tokenizer": "tok/tokenizer.json",
            "chat_template": "chat.jinja",
        },
    )
    cfg = parse_config(data, env={}, base_dir=tmp_path)
    model = cfg.backends[0].models[0]
    assert model.tokenizer == str((tmp_path / "tok" / "tokenizer.json").resolve())
    assert model.chat_template == str((tmp_path / "chat.jinja").resolve())
    inline = with_value(
        "backends[0].models[0].chat_template", "{% for m in messages %}{% endfor %}"
    )
    assert parse_config(inline, env={}).backends[0].models[0].chat_template.startswith("{%")
    missing = with_value("backends[0].models[0].tokenizer", "nope.json")
    assert issues_of(missing, base_dir=tmp_path) == [
        ("backends[0].models[0].tokenizer", f"file not found: {tmp_path / 'nope.json'}")
    ]
    assert parse_config(inline, env={}).backends[0].models[0].chat_template_file is None
    assert cfg.backends[0].models[0].chat_template_file == str((tmp_path / "chat.jinja").resolve())
    # a line break (or a Jinja comment) marks inline text too, even without other markup
    for text in ("<|user|>\n", "{# plain #}hello"):
        one = parse_config(with_value("backends[0].models[0].chat_template", text), env={})
        assert one.backends[0].models[0].chat_template == text
    missing = with_value("backends[0].models[0].chat_template", "nope.jinja")
    assert issues_of(missing, base_dir=tmp_path) == [
        (
            "backends[0].models[0].chat_template",
            f"file not found: {tmp_path / 'nope.jinja'} (a chat_template without '{{{{', "
            "'{%', '{#' or a line break is the path of a template file)",
        )
    ]


# ------------------------------------------------------------------------------ example + CLI


def test_example_config_loads() -> None:
    cfg = load_config(EXAMPLE, env={})
    assert [b.name for b in cfg.backends] == ["gpu-a", "cpu-llama"]
    assert [t.priority for t in cfg.tenants] == ["critical", "standard", "sheddable"]
    assert cfg.listen.port == 8080
    assert cfg.tenant("batch-summaries").mode == "shadow"
    assert cfg.tenant("support-chat").api_key_sha256 == [sha("chat-key-1")]
    assert cfg.admin_key_sha256 == sha("example-admin-key")
    cfg = load_config(EXAMPLE, env={"KVGATE_PORT": "9000", "KVGATE_ADMIN_KEY_SHA256": ADMIN})
    assert (cfg.listen.port, cfg.admin_key_sha256) == (9000, ADMIN)


def test_check_config_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{EXAMPLE}: OK\n")
    assert "backend gpu-a [vllm, enforce]" in out
    assert "tenant support-chat [critical, enforce]" in out
    assert sha("chat-key-1") not in out  # no key material in the summary


def test_check_config_bad(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "backends: []\nworkers: 0\n")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"kvgate: invalid configuration {path}:\n"
        "  workers: must be ≥ 1\n"
        "  backends: must have at least 1 entry\n"
    )


def test_check_config_suggests_the_nearest_field_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A misspelt key gets the closest field name of the model at its level (top level, a
    backend, its adaptive block, a tenant) — never a field of another level."""
    path = write(
        tmp_path,
        "max_concurency: 4\n"  # a backend field, not a top-level one: nothing to suggest
        "worker: 2\n"
        "backends:\n- name: b\n  url: http://127.0.0.1:9\n  max_concurency: 2\n"
        "  models: [{name: m, context_windows: 64}]\n"
        "  adaptive: {hihg: 0.9}\n"
        "tenants:\n- name: t\n  priorty: critical\n  api_key_sha256s: []\n",
    )
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"kvgate: invalid configuration {path}:\n"
        "  backends[0].models[0].context_window: is required\n"
        "  backends[0].models[0].context_windows: unknown field; did you mean `context_window`?\n"
        "  backends[0].adaptive.hihg: unknown field; did you mean `high`?\n"
        "  backends[0].max_concurency: unknown field; did you mean `max_concurrency`?\n"
        "  tenants[0].priorty: unknown field; did you mean `priority`?\n"
        "  tenants[0].api_key_sha256s: unknown field; did you mean `api_key_sha256`?\n"
        "  max_concurency: unknown field\n"
        "  worker: unknown field; did you mean `workers`?\n"
    )


def test_check_config_refuses_what_serve_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file whose fields are valid but that ``kvgate serve`` could not start with (a tokenizer
    that does not load, a broken chat template, a listen host that does not resolve) fails
    check-config too."""
    tok = tmp_path / "tokenizer.json"
    tok.write_text("not json")
    cases = {
        "tokenizer": f"  - {{name: m, context_window: 64, tokenizer: {tok}}}\n",
        "template": "  - {name: m, context_window: 64, chat_template: '{% for %}'}\n",
        "host": "  - {name: m, context_window: 64}\nlisten: {host: 'not a host'}\n",
    }
    for what, models in cases.items():
        path = write(
            tmp_path,
            "backends:\n- name: b\n  url: http://127.0.0.1:9\n  max_concurrency: 2\n"
            "  models:\n" + models.replace("  - ", "  - ", 1),
        )
        assert main(["check-config", str(path)]) == 2, what
        err = capsys.readouterr().err
        assert "kvgate serve would refuse it" in err, (what, err)
        assert "Traceback" not in err


def test_check_config_warns_about_unreachable_tenants(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path,
        "backends:\n- name: b\n  url: http://127.0.0.1:9\n  max_concurrency: 2\n"
        "  models: [{name: m, context_window: 64}]\n"
        "tenants:\n- name: nobody\n- name: anon\nanonymous_tenant: anon\n",
    )
    assert main(["check-config", str(path)]) == 0
    err = capsys.readouterr().err
    assert err == (
        "warning: tenant nobody has no API key and is not the anonymous tenant: "
        "no request can reach it\n"
    )


def test_check_config_subprocess_no_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, "tenants:\n  - name: t\n    guaranteed_slots: -1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvgate", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "  tenants[0].guaranteed_slots: must be ≥ 0\n" in proc.stderr
    assert "  backends: is required\n" in proc.stderr
