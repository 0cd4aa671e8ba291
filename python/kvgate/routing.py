"""Which model a request asks for, what it costs in tokens, and which backend serves it (the
analysis and routing stages, between authentication and admission; no HTTP here).

An inference body is analysed by its model's Rust analyser (one JSON parse: model, prompt
tokens, reserved completion tokens, stream flag); a forwarded body is only read for its
``model``. The backend is the healthy replica of the model, among those the tenant may use,
with the most headroom: free slot ratio first, then lower KV-cache usage.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from kvgate import AnalysisError
from kvgate._core import peek_model
from kvgate.errors import GatewayError

if TYPE_CHECKING:
    from kvgate.app import Backend, Gateway, ModelRoute, Tenant

__all__ = ["analyze_in_thread", "analyze_now", "model_of", "pick_any_backend", "pick_backend"]


def analyze_now(gw: Gateway, route: str, body: bytes) -> tuple[ModelRoute, Any]:
    """The model route and the analysis (``kvgate._core.Analysis``) of an inference body, on
    the event loop (one JSON parse; the registry picks the model's analyser). For small bodies
    (a few µs); large ones go through :func:`analyze_in_thread`.

    Args:
        route: the normalised inference path (``/v1/chat/completions``, ...).

    Raises:
        GatewayError: 400 invalid body / context overflow, 404 unknown model.
    """
    try:
        analysis = gw.registry.analyze(route, body)
    except AnalysisError as err:
        raise GatewayError(err.status, err.message, err.type, err.param, err.code) from None
    return gw.models[analysis.model], analysis


async def analyze_in_thread(gw: Gateway, route: str, body: bytes) -> tuple[ModelRoute, Any]:
    """:func:`analyze_now` in the default thread pool (GIL released), for large bodies, so the
    event loop never waits on a tokenizer.

    Raises:
        GatewayError: 400 invalid body / context overflow, 404 unknown model.
    """
    loop = asyncio.get_running_loop()
    try:
        analysis = await loop.run_in_executor(None, gw.registry.analyze, route, body)
    except AnalysisError as err:
        raise GatewayError(err.status, err.message, err.type, err.param, err.code) from None
    return gw.models[analysis.model], analysis


def model_of(gw: Gateway, body: bytes) -> ModelRoute | None:
    """The served model a forwarded request's JSON body names in ``model`` (read in Rust, every
    other field skipped), or ``None`` when the body is empty, not a JSON object, or names no
    model.

    Raises:
        GatewayError: 404 ``model_not_found`` for a model no backend serves.
    """
    if not body:
        return None
    try:
        name = peek_model(body)
    except AnalysisError:
        return None
    model = gw.models.get(name)
    if model is None:
        raise GatewayError(
            404,
            f"The model `{name}` does not exist or you do not have access to it.",
            "invalid_request_error",
            param="model",
            code="model_not_found",
        )
    return model


def pick_backend(gw: Gateway, model: ModelRoute, tenant: Tenant) -> Backend:
    """The healthy replica with the most headroom, among the model's backends the tenant may
    use (``Tenant.backends``): the largest free slot ratio of its effective concurrency limit
    in the admission core, then the lowest KV-cache usage (unknown counts as 0), ties to the
    backend listed first. Chosen in Rust from the model's :class:`kvgate.ReplicaSet`, so a
    model of a thousand replicas costs microseconds, not a snapshot of each.

    Raises:
        GatewayError: 404 ``model_not_found`` when none of the model's backends is open to the
            tenant (as OpenAI answers a model the key has no access to); 503
            ``backend_unavailable`` (``Retry-After: 1``) when none of those is healthy.
    """
    if tenant.backends is None:
        replicas, members = model.replicas, model.backends
    else:
        replicas, members = gw.replicas_open_to(tenant.backends, model)
        if not members:
            raise GatewayError(
                404,
                f"The model `{model.name}` does not exist or you do not have access to it.",
                "invalid_request_error",
                param="model",
                code="model_not_found",
            )
    at = replicas.most_headroom(gw.controller)
    if at is None:
        raise GatewayError(
            503,
            f"No healthy backend serves `{model.name}` right now.",
            "server_error",
            code="backend_unavailable",
            headers={"Retry-After": "1"},
        )
    return members[at]


def pick_any_backend(gw: Gateway, tenant: Tenant) -> Backend:
    """For a request that names no model: the healthy backend with the most headroom (as
    :func:`pick_backend` compares them) among those the tenant may use (``Tenant.backends``).

    Raises:
        GatewayError: 503 ``backend_unavailable`` (``Retry-After: 1``) when none of them is
            healthy.
    """
    if tenant.backends is None:
        replicas, members = gw.replicas, gw.backends
    else:
        replicas, members = gw.replicas_open_to(tenant.backends)
    at = replicas.most_headroom(gw.controller)
    if at is None:
        raise GatewayError(
            503,
            "No healthy backend is open to this tenant right now.",
            "server_error",
            code="backend_unavailable",
            headers={"Retry-After": "1"},
        )
    return members[at]
