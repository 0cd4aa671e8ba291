"""The reference pages generated from the code: ``docs/configuration.md`` from the pydantic
configuration model and ``docs/metrics.md`` from the gateway's Prometheus registry.

``python -m kvgate.reference`` rewrites both; ``tests/docs/test_reference.py`` fails when a
page differs from what the code would generate, so the pages cannot drift from the code.
"""

from __future__ import annotations

import inspect
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

__all__ = ["configuration_page", "main", "metrics_page"]

ROOT = Path(__file__).resolve().parents[2]


def _type_name(annotation: Any) -> str:
    """A short, readable name of a field's type."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " or ".join(f"`{a}`" for a in args)
    if origin in (list, tuple, set, frozenset):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"map {_type_name(args[0])} → {_type_name(args[1])}" if args else "map"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
        return {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}.get(
            annotation.__name__, annotation.__name__
        )
    return str(annotation)


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The models a field's type refers to (nested sections)."""
    found: list[type[BaseModel]] = []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        found.append(annotation)
    for arg in typing.get_args(annotation):
        found.extend(_models(arg))
    return found


def _constraints(info: Any) -> str:
    parts = []
    for meta in info.metadata:
        for attr, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sign} {value:,}" if isinstance(value, int) else f"{sign} {value}")
        for attr in ("min_length", "max_length"):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{attr.replace('_', ' ')} {value}")
    return ", ".join(parts)


def _default(info: Any) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        value = info.default_factory()
        return "(empty)" if value in ({}, [], ()) else f"`{value}`"
    value = info.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(section defaults)"
    return "`null`" if value is None else f"`{value!r}`".replace("'", "")


def configuration_page() -> str:
    """``docs/configuration.md``: every section of the configuration file with its fields'
    types, defaults and bounds, and the section's own description (its docstring)."""
    from kvgate.config import Config

    out = [
        "# Configuration reference",
        "",
        "Generated from the configuration model (`python/kvgate/config.py`) by",
        "`python -m kvgate.reference`; a test fails when this page and the model differ.",
        "A worked example: [`examples/kvgate.yaml`](../examples/kvgate.yaml); several replicas:",
        "[`examples/replicas.yaml`](../examples/replicas.yaml). Any string may use `${VAR}` or",
        "`${VAR:-default}` (environment variables). Unknown keys are refused, with the nearest",
        "known name suggested (`kvgate check-config`).",
        "",
    ]
    seen: set[type[BaseModel]] = set()
    queue: list[type[BaseModel]] = [Config]
    while queue:
        model = queue.pop(0)
        if model in seen:
            continue
        seen.add(model)
        title = "Config (the file's top level)" if model is Config else model.__name__
        out += [f"## {title}", "", f'<a id="{model.__name__.lower()}"></a>', ""]
        doc = inspect.cleandoc(model.__doc__ or "")
        if doc:
            out += [doc, ""]
        out += ["| field | type | default | bounds |", "|---|---|---|---|"]
        for name, info in model.model_fields.items():
            ann = info.annotation
            out.append(
                f"| `{name}` | {_type_name(ann)} | {_default(info)} | {_constraints(info)} |"
            )
            queue.extend(m for m in _models(ann) if m not in seen)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def metrics_page() -> str:
    """``docs/metrics.md``: every series ``/metrics`` can show, with its type, labels and help
    text, from a gateway built with every optional part (store, latency targets, prefill)."""
    from prometheus_client.metrics import MetricWrapperBase

    from kvgate.config import parse_config
    from kvgate.gateway_build import build_gateway

    cfg = parse_config(
        {
            "backends": [
                {
                    "name": "b",
                    "url": "http://127.0.0.1:9",
                    "models": [{"name": "m", "context_window": 4096}],
                    "max_concurrency": 4,
                    "inflight_token_limit": 100_000,
                }
            ],
            "store": {"url": "redis://127.0.0.1:9/0"},
            "slo": {"critical": {"ttft_p99_s": 1.0}},
        }
    )
    gw = build_gateway(cfg, poll=False)
    reg = gw.metrics.registry
    rows: dict[str, tuple[str, str, str]] = {}
    collectors = set(reg._collector_to_names)  # the registry lists its collectors (private)
    for collector in collectors:
        if isinstance(collector, MetricWrapperBase):
            name = collector._name
            kind = collector._type
            if kind == "counter":
                name += "_total"
            labels = ", ".join(f"`{x}`" for x in collector._labelnames)
            rows[name] = (str(kind), labels, collector._documentation)
            continue
        for family in collector.collect():
            labels_seen: list[str] = []
            for sample in family.samples:
                for key in sample.labels:
                    if key not in labels_seen:
                        labels_seen.append(key)
            labels_seen = labels_seen or _SCRAPE_TIME_LABELS.get(family.name, [])
            labels = ", ".join(f"`{x}`" for x in labels_seen)
            rows[family.name] = (family.type, labels, family.documentation)
    out = [
        "# Metrics reference",
        "",
        "Every series `GET /metrics` can show, generated from the gateway's Prometheus registry",
        "by `python -m kvgate.reference` (a test fails when this page and the code differ).",
        "Labels hold declared names only (backends, tenants, models, classes, reasons), never a",
        "header value. `kvgate_store_*` series exist only with a `store`, `kvgate_slo_*` only with",
        "`slo` targets, `kvgate_prefill_*` for backends with a prefill budget. Counters carry the",
        "`_total` suffix; histograms `_bucket`, `_sum`, `_count`.",
        "",
        "The `tenant` label carries each tenant's name while the configuration holds at most",
        "`metrics.tenant_labels` tenants (1,000 by default); with more, it is `*` (every tenant",
        "summed), so a scrape stays the same size whatever the tenants that sent requests, and",
        "each tenant's requests and tokens are read from `GET /admin/usage`.",
        "",
        "| series | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    for name in sorted(rows):
        kind, labels, doc = rows[name]
        out.append(f"| `{name}` | {kind} | {labels} | {doc} |")
    return "\n".join(out) + "\n"


#: labels of series computed at scrape time that a fresh gateway has no sample of yet
_SCRAPE_TIME_LABELS = {
    "kvgate_store_mode": ["scope", "mode"],
    "kvgate_slo_class_limit": ["backend", "class"],
    "kvgate_slo_ttft_p99_seconds": ["backend", "class"],
}

PAGES = {"docs/configuration.md": configuration_page, "docs/metrics.md": metrics_page}


def main(argv: list[str] | None = None) -> int:
    """Rewrites the generated pages (``--check``: exit 1 if one would change)."""
    args = sys.argv[1:] if argv is None else argv
    stale = []
    for rel, make in PAGES.items():
        path = ROOT / rel
        text = make()
        if path.exists() and path.read_text() == text:
            continue
        stale.append(rel)
        if "--check" not in args:
            path.write_text(text)
    if "--check" in args and stale:
        print(f"out of date: {', '.join(stale)} (run python -m kvgate.reference)")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
