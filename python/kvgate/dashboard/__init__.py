"""The live view at ``GET /dashboard``: one JSON document a second, drawn by a page that ships
with the package (``index.html``, ``dashboard.css``, ``dashboard.js``: no build step, nothing
loaded from the network; the script draws SVG and keeps the last minutes of history in the
browser).

:func:`dashboard_data` builds ``GET /dashboard/data`` from what the gateway already knows: the
``/admin/state`` document (limits, scale, in-use, KV usage, prefill budget, latency targets,
store) and the Prometheus metric families (refusals by reason, TTFT histograms by class,
tokens per tenant — or, with more tenants than ``metrics.tenant_labels``, this process's own
count of tokens per tenant: the series then carry no tenant names). Only the
:data:`TOP_TENANTS` tenants are read from the core, so the poll costs the same with 100,000
tenants as with 10 (ranking them aside). Counters and histogram buckets are sent cumulative;
the page turns them into rates and windowed quantiles from one poll to the next, so a page
opened late or reloaded loses nothing the gateway counted.

Access: the page and its data need the admin key when ``admin_key_sha256`` is configured, like
``/admin/state``. A browser cannot send a Bearer header on navigation, so the key is accepted
once as ``/dashboard?key=KEY``: the answer is a 303 to ``/dashboard`` (the key leaves the
address bar and the history) setting the cookie :data:`COOKIE` — ``HttpOnly`` (no script
reads it), ``SameSite=Strict`` (no other site's page sends it), ``Path=/dashboard`` (no other
route gets it), ``Secure`` over TLS. The cookie holds the key itself, so every worker and every
replica checks it the way it checks a Bearer header, with no session state to share.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from typing import Any

__all__ = [
    "ASSETS",
    "COOKIE",
    "COOKIE_MAX_AGE_S",
    "PAGE_HEADERS",
    "TOP_TENANTS",
    "asset",
    "dashboard_data",
    "tenant_tokens",
    "top_tenants",
]

#: The cookie that carries the admin key for ``/dashboard`` and ``/dashboard/data``.
COOKIE = "kvgate_admin"
#: Its lifetime (seconds): 12 hours, then ``?key=`` once more.
COOKIE_MAX_AGE_S = 12 * 3600
#: Tenants listed by tokens charged, most first.
TOP_TENANTS = 10
#: The page's static files: path → (file in this package, Content-Type).
ASSETS = {
    "/dashboard": ("index.html", "text/html; charset=utf-8"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
}
#: Headers of every dashboard answer: only this origin's own script, style and data (a
#: Content-Security-Policy without inline code), not cached, no Referer.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}
_CLASSES = ("critical", "standard", "sheddable")
_cache: dict[str, bytes] = {}


def asset(path: str) -> tuple[bytes, str]:
    """The bytes and Content-Type of the static file served at ``path`` (a key of
    :data:`ASSETS`), read from the installed package once and kept.

    Raises:
        KeyError: ``path`` is not one of the page's files.
    """
    name, content_type = ASSETS[path]
    body = _cache.get(name)
    if body is None:
        body = _cache[name] = resources.files(__package__).joinpath(name).read_bytes()
    return body, content_type


def _samples(families: Iterable[Any]) -> Iterable[tuple[str, dict[str, str], float]]:
    for family in families:
        for s in family.samples:
            yield s.name, s.labels, s.value


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities made ``None`` (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def tenant_tokens(families: Iterable[Any]) -> dict[str, float]:
    """Tokens charged per tenant name (cumulative) from the ``kvgate_tenant_tokens_total``
    samples of ``families`` (prometheus_client ``Metric`` objects)."""
    tokens: dict[str, float] = {}
    for name, labels, value in _samples(families):
        if name == "kvgate_tenant_tokens_total":
            tokens[labels["tenant"]] = tokens.get(labels["tenant"], 0) + value
    return tokens


def top_tenants(
    tenants: Iterable[Any],
    tokens: Mapping[str, float],
    n: int = TOP_TENANTS,
    name: Callable[[Any], str] = lambda t: t.name,
) -> list[Any]:
    """The ``n`` of ``tenants`` with the most ``tokens`` (by ``name(tenant)``; none: 0), most
    first, ties by name: O(tenants × log n)."""
    return heapq.nsmallest(n, tenants, key=lambda t: (-tokens.get(name(t), 0), name(t)))


def dashboard_data(
    admin: dict[str, Any],
    families: Iterable[Any],
    queues: dict[str, dict[str, int]],
    now: float,
    tokens: Mapping[str, float],
) -> dict[str, Any]:
    """The ``GET /dashboard/data`` document.

    Args:
        admin: the ``/admin/state`` document (:func:`kvgate.app.admin_state`).
        families: metric families with at least the refusals, the time to first token and the
            tokens per tenant (:meth:`kvgate.metrics.GatewayMetrics.dashboard_families`).
        queues: requests waiting in this worker's priority queue, ``{backend: {class: n}}``.
        now: wall-clock time of the snapshot (Unix seconds).
        tokens: tokens charged per tenant name (cumulative): :func:`tenant_tokens` of
            ``families``, or this process's usage ledger's when the series carry no names.

    Returns:
        ``{"time", "backends": [...], "tenants": [...], "store": {...}}``. Each backend:
        ``name``, ``healthy``, ``stale``, ``kv_usage`` (0..1, ``None`` before a reading),
        ``waiting`` (the engine's queue), ``scale``, ``shedding``, ``base`` and ``effective``
        limits (``concurrency`` slots, ``tokens_per_minute``, ``inflight_tokens``), ``in_use``
        (slots), ``inflight_tokens``, ``available_tokens`` (backend TPM bucket), ``queue``
        (waiting in kvgate by class), ``refusals`` (cumulative count by reason), ``ttft`` (per
        class: cumulative histogram ``buckets`` ``[[upper bound s, count]]``, ``count``,
        ``sum`` s), ``prefill`` and ``slo`` (as in ``/admin/state``; ``None`` when absent).
        ``tenants``: the :data:`TOP_TENANTS` tenants with the most tokens charged (``tokens``
        cumulative, ``priority``, ``in_use``, ``queue_depth``). ``store``: ``mode``, and with
        Redis the replica id, the breaker and the active scopes per mode.
    """
    refusals: dict[str, dict[str, float]] = {}
    ttft: dict[str, dict[str, dict[str, Any]]] = {}
    for name, labels, value in _samples(families):
        if name == "kvgate_rejections_total":
            per = refusals.setdefault(labels["backend"], {})
            per[labels["reason"]] = per.get(labels["reason"], 0) + value
        elif name.startswith("kvgate_upstream_ttft_seconds_"):
            hist = ttft.setdefault(labels["backend"], {}).setdefault(
                labels["class"], {"buckets": [], "count": 0.0, "sum": 0.0}
            )
            if name.endswith("_bucket"):
                bound = float(labels["le"])
                if math.isfinite(bound):
                    hist["buckets"].append([bound, value])
            elif name.endswith("_count"):
                hist["count"] = value
            elif name.endswith("_sum"):
                hist["sum"] = value
    for per_class in ttft.values():
        for hist in per_class.values():
            hist["buckets"].sort()

    prefill = admin.get("prefill") or {}
    slo = admin.get("slo") or {}
    backends = []
    for st in admin["backends"]:
        name = st["name"]
        backends.append(
            {
                "name": name,
                "healthy": st.get("healthy"),
                "stale": st.get("stale"),
                "kv_usage": _finite(st.get("kv_usage")),
                "waiting": _finite(st.get("waiting")),
                "scale": _finite(st.get("scale")),
                "shedding": st.get("shedding"),
                "base": {
                    "concurrency": st.get("max_concurrency"),
                    "tokens_per_minute": st.get("tokens_per_minute"),
                    "inflight_tokens": st.get("inflight_token_limit"),
                },
                "effective": {
                    "concurrency": st.get("effective_concurrency"),
                    "tokens_per_minute": st.get("effective_tokens_per_minute"),
                    "inflight_tokens": st.get("effective_inflight_token_limit"),
                },
                "in_use": st.get("in_use"),
                "inflight_tokens": st.get("inflight_tokens"),
                "available_tokens": _finite(st.get("available_tokens")),
                "queue": {cls: queues.get(name, {}).get(cls, 0) for cls in _CLASSES},
                "refusals": refusals.get(name, {}),
                "ttft": ttft.get(name, {}),
                "prefill": prefill.get(name),
                "slo": slo.get(name),
            }
        )
    tenants = [
        {
            "name": t["name"],
            "priority": t.get("priority"),
            "tokens": tokens.get(t["name"], 0.0),
            "in_use": t.get("in_use"),
            "queue_depth": t.get("queue_depth", 0),
        }
        for t in admin["tenants"]
    ]
    tenants.sort(key=lambda t: (-t["tokens"], t["name"]))
    store = admin.get("store") or {"mode": "local"}
    summary: dict[str, Any] = {"mode": store.get("mode", "local")}
    if "replica" in store:
        summary["replica"] = store["replica"]
        summary["breaker"] = store.get("breaker")
        modes: dict[str, int] = {}
        for scope in (store.get("scopes") or {}).values():
            modes[scope["mode"]] = modes.get(scope["mode"], 0) + 1
        summary["scopes"] = modes
    return {
        "time": now,
        "backends": backends,
        "tenants": tenants[:TOP_TENANTS],
        "store": summary,
    }
