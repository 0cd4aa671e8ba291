"""Where a request goes: path normalisation and the route table, decided once, up front.

Every request's path is normalised before it is routed — runs of ``/`` become one
(``//v1//chat/completions``) and a trailing ``/`` is dropped (``/v1/chat/completions/``, which
engines answer with a redirect) — so an inference route reached another way is still an
inference request: analysed, admitted, counted. A path with a ``.`` or ``..`` segment (also
percent-encoded) is refused (400 ``invalid_path``): the upstream client would resolve it into any
engine URL.

The table (:func:`route_of`):

* ``POST`` on an inference route (:data:`INFERENCE_ROUTES`: chat, completions, embeddings,
  OpenAI's Responses API; chat also as llama.cpp spells it, :data:`INFERENCE_ALIASES`) →
  analysed in Rust, admitted, relayed to the ``/v1`` route; any other method → 405.
* ``GET`` / ``HEAD`` on the gateway's own endpoints (:data:`GATEWAY_ROUTES`) and on
  ``/v1/models/{id}`` (one model, what the ``openai`` client's ``models.retrieve`` asks) →
  answered by kvgate; any other method → 405.
* anything else → the gateway's ``other_routes`` policy: ``refuse`` (404) or ``forward``
  (admitted against the tenant's and a backend's limits, relayed as it arrives, charged the
  usage the engine reports), except an engine's administration and native generation routes
  (:func:`not_forwarded`: 403).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "GATEWAY_ROUTES",
    "INFERENCE_ALIASES",
    "INFERENCE_ROUTES",
    "MODEL_PREFIX",
    "NOT_FORWARDED",
    "Route",
    "RouteKind",
    "normalize_path",
    "not_forwarded",
    "route_of",
]

#: Paths whose ``POST`` is an inference request (analysed, admitted, counted).
INFERENCE_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"}
)
#: Other spellings of an inference route that engines answer alike: llama.cpp's server serves
#: OpenAI's chat at ``/chat/completions`` too (its ``/completions`` and ``/embeddings`` are its
#: native formats, not OpenAI's). Inference requests like the route they name, sent upstream
#: to it.
INFERENCE_ALIASES = {"/chat/completions": "/v1/chat/completions"}
#: The engines' own routes that ``other_routes: forward`` does not forward, whatever the
#: method: their administration (llama.cpp's ``/slots`` also shows every slot's prompt —
#: other tenants' —; caches reset, sleep, pause, LoRA adapters or new weights loaded) and their
#: generation routes outside OpenAI's API (llama.cpp's ``/completion``, TGI's and SGLang's
#: ``/generate``, Anthropic's ``/v1/messages`` on llama.cpp, vLLM's SageMaker ``/invocations``),
#: whose tokens come without OpenAI's ``usage`` and would not be charged, nor their prompts
#: checked against the context window. The routes of vLLM, SGLang, TGI and llama.cpp's server
#: known to this version; an engine's route not listed here is forwarded.
NOT_FORWARDED = frozenset(
    {
        # llama.cpp's server (and its router mode)
        "/completion",
        "/completions",  # its native completion, not OpenAI's
        "/infill",
        "/slots",
        "/api/chat",  # Ollama's chat
        "/api/generate",
        "/v1/messages",  # Anthropic's Messages API
        "/models/load",
        "/models/unload",
        # TGI
        "/generate",
        "/generate_stream",
        "/vertex",
        # vLLM
        "/invocations",
        "/inference/v1/generate",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/sleep",
        "/wake_up",
        "/pause",
        "/resume",
        "/abort_requests",
        "/collective_rpc",
        "/start_profile",
        "/stop_profile",
        "/scale_elastic_ep",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        # SGLang
        "/vertex_generate",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/flush_cache",
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/update_weights_from_ipc",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/get_weights_by_name",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/pause_generation",
        "/continue_generation",
        "/slow_down",
        "/abort_request",
        "/open_session",
        "/close_session",
        "/freeze_gc",
        "/configure_logging",
        "/set_internal_state",
        "/start_expert_distribution_record",
        "/stop_expert_distribution_record",
        "/dump_expert_distribution_record",
    }
)
#: Path prefixes of :data:`NOT_FORWARDED` routes (llama.cpp's ``/slots/{id}?action=erase``).
NOT_FORWARDED_PREFIXES = ("/slots/",)
#: Engine routes forwarded for reading only (``GET``, ``HEAD``): llama.cpp's ``/props`` and
#: ``/lora-adapters`` change the server's settings on ``POST``; TGI generates on ``POST /``.
READ_ONLY_FORWARDED = frozenset({"/", "/props", "/lora-adapters"})


def not_forwarded(method: str, path: str) -> bool:
    """Whether ``other_routes: forward`` refuses ``method`` on the (normalised) ``path``: one
    of :data:`NOT_FORWARDED` (or under :data:`NOT_FORWARDED_PREFIXES`), or a write to one of
    :data:`READ_ONLY_FORWARDED`."""
    if path in NOT_FORWARDED or path.startswith(NOT_FORWARDED_PREFIXES):
        return True
    return path in READ_ONLY_FORWARDED and method not in ("GET", "HEAD")


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
    alias = INFERENCE_ALIASES.get(path)
    if alias is not None:
        return (_INFERENCE if method == "POST" else _INFERENCE_405)[alias]
    if path in GATEWAY_ROUTES:
        return (_GATEWAY if method in _READ else _GATEWAY_405)[path]
    if path.startswith(MODEL_PREFIX):
        if method in _READ:
            return Route(RouteKind.MODEL, path)
        return Route(RouteKind.WRONG_METHOD, path, "GET")
    return Route(RouteKind.OTHER, path)
