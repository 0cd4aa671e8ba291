"""Where a request goes: path normalisation and the route table, decided once, up front.

Every request's path is normalised before it is routed — runs of ``/`` become one
(``//v1//chat/completions``) and a trailing ``/`` is dropped (``/v1/chat/completions/``, which
engines answer with a redirect) — so an inference route reached another way is still an
inference request: analysed, admitted, counted. A path with a ``.`` or ``..`` segment (also
percent-encoded) is refused (400 ``invalid_path``): the upstream client would resolve it into any
engine URL.

The table (:func:`route_of`):

* ``POST`` on an inference route (:data:`INFERENCE_ROUTES`: chat, completions, embeddings,
  OpenAI's Responses API) → analysed in Rust, admitted, relayed; any other method → 405.
* ``GET`` / ``HEAD`` on the gateway's own endpoints (:data:`GATEWAY_ROUTES`) and on
  ``/v1/models/{id}`` (one model, what the ``openai`` client's ``models.retrieve`` asks) →
  answered by kvgate; any other method → 405.
* anything else → the gateway's ``other_routes`` policy: ``refuse`` (404) or ``forward``
  (admitted against the tenant's and a backend's limits, relayed as it arrives, charged the
  usage the engine reports).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "GATEWAY_ROUTES",
    "INFERENCE_ROUTES",
    "MODEL_PREFIX",
    "Route",
    "RouteKind",
    "normalize_path",
    "route_of",
]

#: Paths whose ``POST`` is an inference request (analysed, admitted, counted).
INFERENCE_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"}
)
#: The gateway's own ``GET`` (and ``HEAD``) endpoints.
GATEWAY_ROUTES = frozenset(
    {
        "/v1/models",
        "/metrics",
        "/healthz",
        "/readyz",
        "/admin/state",
        "/admin/usage",
        "/dashboard",
        "/dashboard/data",
        "/dashboard/dashboard.css",
        "/dashboard/dashboard.js",
    }
)
#: ``GET /v1/models/{id}``: one model object (the id may hold ``/``, sent as ``%2F``).
MODEL_PREFIX = "/v1/models/"


class RouteKind(enum.Enum):
    """What kind of route a request is on (see the module docstring)."""

    INFERENCE = "inference"
    GATEWAY = "gateway"
    MODEL = "model"
    OTHER = "other"
    WRONG_METHOD = "wrong_method"
    BAD_PATH = "bad_path"


@dataclass(frozen=True, slots=True)
class Route:
    """The routing decision for one request.

    Attributes:
        kind: the kind of route.
        path: the normalised (decoded) path, e.g. ``/v1/chat/completions``.
        allow: the method the route accepts (``POST`` or ``GET``), for a 405's ``Allow``.
    """

    kind: RouteKind
    path: str
    allow: str | None = None

    @property
    def model_id(self) -> str:
        """The model id of a ``/v1/models/{id}`` route (``""`` on any other route)."""
        return self.path[len(MODEL_PREFIX) :] if self.kind is RouteKind.MODEL else ""


def normalize_path(path: str) -> str:
    """``path`` with each run of ``/`` made one and a trailing ``/`` dropped (``/`` itself
    stays). Works on a decoded path and on the raw, percent-encoded one alike."""
    if "//" in path:
        path = "/" + "/".join(seg for seg in path.split("/") if seg)
    if len(path) > 1 and path.endswith("/"):
        path = path.rstrip("/") or "/"
    return path


def dot_segment(path: str) -> bool:
    """Whether the (decoded) path has a ``.`` or ``..`` segment."""
    return "/." in path and any(seg in (".", "..") for seg in path.split("/"))


# prebuilt decisions for the known paths: no allocation on the hot path
_INFERENCE = {p: Route(RouteKind.INFERENCE, p) for p in INFERENCE_ROUTES}
_INFERENCE_405 = {p: Route(RouteKind.WRONG_METHOD, p, "POST") for p in INFERENCE_ROUTES}
_GATEWAY = {p: Route(RouteKind.GATEWAY, p) for p in GATEWAY_ROUTES}
_GATEWAY_405 = {p: Route(RouteKind.WRONG_METHOD, p, "GET") for p in GATEWAY_ROUTES}
_READ = ("GET", "HEAD")


def route_of(method: str, path: str) -> Route:
    """The route of a request: ``method`` and its decoded path (``request.path``).

    Returns:
        The :class:`Route`; its ``path`` is the normalised path (a ``BAD_PATH`` route keeps the
        path as it came, for the error message).
    """
    if method == "POST":
        hit = _INFERENCE.get(path)
        if hit is not None:  # the hot path: one dict lookup
            return hit
    if dot_segment(path):
        return Route(RouteKind.BAD_PATH, path)
    path = normalize_path(path)
    if path in INFERENCE_ROUTES:
        return (_INFERENCE if method == "POST" else _INFERENCE_405)[path]
    if path in GATEWAY_ROUTES:
        return (_GATEWAY if method in _READ else _GATEWAY_405)[path]
    if path.startswith(MODEL_PREFIX):
        if method in _READ:
            return Route(RouteKind.MODEL, path)
        return Route(RouteKind.WRONG_METHOD, path, "GET")
    return Route(RouteKind.OTHER, path)
