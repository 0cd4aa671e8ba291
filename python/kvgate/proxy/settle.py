"""Settlement, the last stage of an admitted request: its reservation released with the tokens it
is charged (unused ones refunded, an overrun charged: docs/admission.md, "What a request is
charged"), the next queued waiter woken, the metrics counted, its access log line written and
its trace ended. :func:`end_request` also ends the record of a refused request."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvgate._core import MAX_AMOUNT
from kvgate.accesslog import log_access

if TYPE_CHECKING:
    from aiohttp import web

    from kvgate.app import Gateway
    from kvgate.proxy.prepared import Reply
    from kvgate.proxy.relay import RelayResult

__all__ = ["actual_tokens", "end_request", "release_at_end", "settle"]


def actual_tokens(analysis: Any, result: RelayResult) -> int:
    """Tokens to charge: prompt (engine's count if it gave one, else ours) + completion delivered.

    Charged nothing: a request that never reached the engine (unreachable upstream), one whose
    engine did not answer before the ``first_byte`` timeout, and one the engine answered with
    an error before any completion token was delivered (a 4xx/5xx status, or an error event
    first in a stream). docs/admission.md, "What a request is charged" lists every outcome.
    """
    outcome = result.outcome
    if outcome == "upstream_unreachable":
        return 0
    if outcome == "upstream_timeout" and result.ttft is None:
        return 0
    if outcome == "upstream_error" and result.completion_tokens == 0:
        return 0
    prompt = result.prompt_tokens if result.prompt_tokens is not None else analysis.prompt_tokens
    # each count is at most MAX_AMOUNT (relay._take_usage); their sum must be too
    return min(int(prompt) + int(result.completion_tokens), MAX_AMOUNT)


async def release_at_end(gw: Gateway, decision: Any, actual: int) -> None:
    """Release an admitted request whose answer is complete, before its last bytes go to the
    client (:attr:`kvgate.proxy.relay.RelayResult.on_end`): its reservation with the
    ``actual`` tokens it is charged, the next queued waiter woken, and — with a shared store —
    what that gave back in the shared store, where the other replicas see it
    (:meth:`kvgate.store.Store.flushed`, at most the store's deadline). A client that sends its next request as soon as it reads
    the end of this one then finds the slot free on every replica. :func:`settle` runs later
    as for every request (its release is then a no-op)."""
    decision.release(actual)
    queue = gw.queue
    if queue is not None and queue.waiting:
        queue.notify()
    store = gw.store
    if store.unsent:
        await store.flushed()


def settle(
    gw: Gateway,
    request: web.BaseRequest,
    decision: Any,
    actual: int,
    where: tuple[str, str, float, float, float],
    who: tuple[Any, Any, Any],
    reserved: int,
    prompt: int | None,
    result: RelayResult,
    reply: Reply | None,
    error_code: str | None,
    *,
    trace: Any = None,
) -> None:
    """End an admitted request: its reservation released with the ``actual`` tokens it is
    charged (unused ones refunded, an overrun charged), the next queued waiter woken, the
    metrics counted, its access log line written and its trace ended
    (:class:`kvgate.tracing.RequestTrace`, ``None`` without tracing).

    Args:
        where: its request id, route, and ``time.perf_counter()`` when it arrived, when
            admission began and when it was admitted.
        who: its tenant, backend and model route.
        reserved: the tokens it reserved at admission.
        prompt: its prompt tokens (the engine's count when it gave one).
    """
    rid, route, started, admitting, admitted = where
    tenant, backend, model = who
    settling = time.perf_counter() if trace is not None else 0.0
    decision.release(actual)
    queue = gw.queue
    if queue is not None and queue.waiting:
        queue.notify()
    gw.metrics.settled(backend, tenant, reserved, actual, result, model, prompt)
    trace_only = None
    if trace is not None:  # the trace shows what was charged, and when settlement ran
        charged_prompt = min(int(prompt or 0), actual)
        trace_only = {
            "prompt": charged_prompt,
            "completion": actual - charged_prompt,
            "settle": (settling, time.perf_counter()),
        }
    end_request(
        request,
        rid,
        started,
        trace,
        route=route,
        queue_wait=admitted - admitting,
        reply=reply,
        status=reply.status if reply is not None else result.status,
        outcome=result.outcome,
        tenant=tenant,
        backend=backend,
        model=model,
        reason=error_code,
        reserved=reserved,
        prompt=prompt,
        completion=result.completion_tokens,
        ttft=result.ttft,
        trace_only=trace_only,
    )


def end_request(
    request: web.BaseRequest,
    rid: str,
    started: float,
    trace: Any,
    *,
    route: str,
    queue_wait: float | None = None,
    reply: Any = None,
    trace_only: dict[str, Any] | None = None,
    **fields: Any,
) -> None:
    """The end of a request's record: its access log line (:func:`log_access`, with ``route``,
    ``queue_wait`` and ``reply``) and, when traced, the end of its trace
    (:meth:`kvgate.tracing.RequestTrace.finish`) with the same ``fields`` (``status``,
    ``outcome``, ``tenant``, ``backend``, ``model``, ``reason``, ``reserved``, ``prompt``,
    ``completion``, ``ttft``), ``trace_only`` replacing or adding some for the trace."""
    log_access(
        request,
        rid,
        started,
        time.perf_counter(),
        route=route,
        queue_wait=queue_wait,
        reply=reply,
        **fields,
    )
    if trace is not None:
        trace.finish(**(fields | trace_only if trace_only else fields))
