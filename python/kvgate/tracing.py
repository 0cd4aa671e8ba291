"""OpenTelemetry traces of the requests (configuration ``tracing:``; optional extra ``otel``).

Imported only when the configuration has a ``tracing`` section (``kvgate.gateway_build``):
without one nothing of OpenTelemetry is imported and a request's only cost is a few
``trace is not None`` checks in :mod:`kvgate.proxy.handler`.

Each inference or forwarded request is one server span (``POST /v1/chat/completions``) with
the HTTP semantic-convention attributes (``http.request.method``, ``url.path``,
``url.scheme``, ``http.route``, ``http.response.status_code``, ``client.address``,
``user_agent.original``, ``network.protocol.version``), the GenAI ones
(``gen_ai.request.model``, ``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``) and
kvgate's (``kvgate.tenant``, ``kvgate.backend``, ``kvgate.priority``, ``kvgate.outcome``,
``kvgate.reason``, ``kvgate.request_id``, ``kvgate.tokens.reserved``). Its children:
``authenticate``, ``analyse``, ``admit`` (from the admission's start to its decision, any wait
in the queue included; ``kvgate.admission.admitted`` and, refused, ``kvgate.reject_reason``),
``upstream`` (a client span from sending to the engine until the first bytes of its answer:
the time to first token), ``relay`` (from there to the answer's end) and ``settle``. The
stages' spans are made from the times the handler took, when the request ends; the server span
and the ``upstream`` span are open while the request runs, as their ids go to the engine.

Context (W3C Trace Context): a valid incoming ``traceparent`` (and its ``tracestate``) is the
server span's parent, else a new trace starts; the engine gets ``traceparent`` naming the
``upstream`` span (same trace id, that span's id, the sampling flag) and the client's
``tracestate``. Sampling: ``sample_ratio`` of new traces (trace-id ratio), a parent's decision
otherwise. Spans go to the OTLP/HTTP collector at ``otlp_endpoint`` (``/v1/traces``) in batches
from a background thread; each worker process of ``--workers N`` exports its own.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvgate.accesslog import valid_traceparent

try:
    from opentelemetry import trace as otel_trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SimpleSpanProcessor,
        SpanExporter,
    )
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as exc:  # the optional extra is missing
    raise ImportError(
        "tracing: needs the OpenTelemetry SDK and its OTLP/HTTP exporter: "
        "pip install 'kvgate[otel]'"
    ) from exc

if TYPE_CHECKING:
    from aiohttp import web

    from kvgate.config import TracingConfig

__all__ = ["RequestTrace", "Tracing"]

#: Seconds the exporter waits for the collector per batch (the default, 10 s, would hold a
#: shutdown that long when the collector is down).
EXPORT_TIMEOUT_S = 5.0


def _ns(base_ns: int, base_perf: float, perf: float) -> int:
    """A ``time.perf_counter()`` reading as Unix nanoseconds, from one pair read together."""
    return base_ns + int((perf - base_perf) * 1e9)


class Tracing:
    """The tracer of one gateway process.

    Args:
        config: the ``tracing`` section (:class:`kvgate.config.TracingConfig`).
        exporter: where spans go instead of the OTLP collector (tests: the SDK's
            ``InMemorySpanExporter``), exported one by one as they end.

    :meth:`start` (by :func:`kvgate.server.gateway_runtime`) creates the span processor (its
    thread), :meth:`shutdown` exports what is left and stops it.
    """

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        self.config = config
        self._exporter = exporter
        self.provider: TracerProvider | None = None
        self.tracer: Any = None
        self.propagator = TraceContextTextMapPropagator()

    @property
    def endpoint(self) -> str:
        """The collector's traces URL: ``otlp_endpoint`` + ``/v1/traces`` (unless it ends so)."""
        url = self.config.otlp_endpoint.rstrip("/")
        return url if url.endswith("/v1/traces") else url + "/v1/traces"

    def start(self) -> None:
        """Create the tracer provider (``service.name`` = ``service_name``; sampler: the
        parent's decision, else ``sample_ratio`` by trace id) and its span processor."""
        if self.provider is not None:
            return
        provider = TracerProvider(
            resource=Resource.create({"service.name": self.config.service_name}),
            sampler=ParentBased(TraceIdRatioBased(self.config.sample_ratio)),
        )
        if self._exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(self._exporter))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=self.endpoint, timeout=EXPORT_TIMEOUT_S)
            provider.add_span_processor(BatchSpanProcessor(exporter))
        self.provider = provider
        self.tracer = provider.get_tracer("kvgate")

    def shutdown(self) -> None:
        """Export the spans still queued and stop the processor (blocks up to the export
        timeout when the collector does not answer)."""
        if self.provider is not None:
            self.provider.shutdown()
            self.provider = None

    def begin(self, request: web.BaseRequest, route: str, started: float, rid: str) -> RequestTrace:
        """The trace of one request (request id ``rid``), its server span open from
        ``started`` (``time.perf_counter()`` when it arrived)."""
        return RequestTrace(self, request, route, started, rid)


class RequestTrace:
    """One request's spans: the handler sets the times of its stages (``time.perf_counter()``)
    as it goes and calls :meth:`upstream_headers` before relaying and :meth:`finish` at the end.

    Attributes:
        authenticated: when authentication (from the request's head, first) ended (``None``:
            it failed).
        analysed: when analysis (the body read, analysed, routed) ended.
        admitting: when admission began.
        admitted: when admission decided.
        relay_end: when the relay ended.
    """

    __slots__ = (
        "_base_ns",
        "_base_perf",
        "_started",
        "_tracer",
        "_upstream",
        "_upstream_start",
        "admitted",
        "admitting",
        "analysed",
        "authenticated",
        "first_data",
        "relay_end",
        "span",
        "tracing",
    )

    def __init__(
        self, tracing: Tracing, request: web.BaseRequest, route: str, started: float, rid: str
    ) -> None:
        self.tracing = tracing
        self._tracer = tracing.tracer
        self._base_ns = time.time_ns()
        self._base_perf = time.perf_counter()
        headers = request.headers
        carrier: dict[str, str] = {}
        parent = headers.get("traceparent")
        if parent is not None and valid_traceparent(parent):
            carrier["traceparent"] = parent
            states = headers.getall("tracestate", ())
            if states:
                carrier["tracestate"] = ",".join(states)
        context = tracing.propagator.extract(carrier) if carrier else None
        transport = request.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        attributes: dict[str, Any] = {
            "http.request.method": request.method,
            "url.path": request.path,
            "url.scheme": request.scheme,
            "http.route": route,
            "kvgate.request_id": rid,
            "network.protocol.version": f"{request.version.major}.{request.version.minor}",
        }
        if isinstance(peer, tuple) and peer:
            attributes["client.address"] = str(peer[0])
        agent = headers.get("User-Agent")
        if agent:
            attributes["user_agent.original"] = agent
        self.span = self._tracer.start_span(
            f"{request.method} {route}",
            context=context,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=self._ns(started),
        )
        self._upstream: Any = None
        self._upstream_start = 0.0
        self._started = started
        self.authenticated: float | None = None
        self.analysed: float | None = None
        self.admitting: float | None = None
        self.admitted: float | None = None
        self.first_data: float | None = None
        self.relay_end: float | None = None

    def _ns(self, perf: float) -> int:
        return _ns(self._base_ns, self._base_perf, perf)

    def upstream_headers(self, headers: dict[str, str], url: str, method: str) -> dict[str, str]:
        """Open the ``upstream`` client span (now) and return ``headers`` (the request id and
        the client's trace context, :func:`kvgate.accesslog.upstream_trace_headers`) with
        ``traceparent`` / ``tracestate`` naming that span."""
        self._upstream_start = time.perf_counter()
        parent = otel_trace.set_span_in_context(self.span)
        self._upstream = span = self._tracer.start_span(
            "upstream",
            context=parent,
            kind=SpanKind.CLIENT,
            attributes={"http.request.method": method, "url.full": url},
            start_time=self._ns(self._upstream_start),
        )
        out = {k: v for k, v in headers.items() if k not in ("traceparent", "tracestate")}
        self.tracing.propagator.inject(out, context=otel_trace.set_span_in_context(span))
        return out

    def data_arrived(self) -> None:
        """The first bytes of the engine's answer arrived (the relay's first-data hook)."""
        if self.first_data is None:
            self.first_data = time.perf_counter()

    def _child(
        self,
        name: str,
        start: float,
        end: float,
        attributes: dict[str, Any],
        error: str | None = None,
    ) -> None:
        """A child span of the server span from ``start`` to ``end`` (``time.perf_counter()``),
        its status ``ERROR`` with ``error`` as description when given."""
        span = self._tracer.start_span(
            name,
            context=otel_trace.set_span_in_context(self.span),
            attributes=attributes,
            start_time=self._ns(start),
        )
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self._ns(max(start, end)))

    def finish(
        self,
        *,
        status: int,
        outcome: str,
        tenant: Any = None,
        backend: Any = None,
        model: Any = None,
        reason: str | None = None,
        reserved: int | None = None,
        prompt: int | None = None,
        completion: int | None = None,
        ttft: float | None = None,
        settle: tuple[float, float] | None = None,
    ) -> None:
        """End the request's spans.

        Args:
            status: the status sent to the client (0: none, the client left first).
            outcome: the access log's outcome (``ok``, ``rejected``, ``client_disconnect``...).
            reason: the refusal's reason or the error's code.
            reserved, prompt, completion: tokens reserved, and charged as prompt and
                completion.
            ttft: the engine's time to the answer's head (seconds), the upstream span's end
                when no body byte came.
            settle: ``time.perf_counter()`` when settlement began and ended.
        """
        now = time.perf_counter()
        span = self.span
        if not span.is_recording():
            if self._upstream is not None:
                self._upstream.end()
            span.end()
            return
        # a request refused before admission: the stage it failed in ends now, in error
        failed = reason if outcome == "rejected" and self.admitting is None else None
        # authentication reads only the head: its span starts with the request; reading the
        # body is analysis's (analysis needs it)
        if self.authenticated is not None or failed:
            end = self.authenticated if self.authenticated is not None else now
            error = failed if self.authenticated is None else None
            self._child("authenticate", self._started, end, {}, error)
        if self.authenticated is not None and (self.analysed is not None or failed):
            end = self.analysed if self.analysed is not None else now
            error = failed if self.analysed is None else None
            self._child("analyse", self.authenticated, end, {}, error)
        if self.admitting is not None:
            decided = self.admitted
            attrs: dict[str, Any] = {"kvgate.admission.admitted": decided is not None}
            if decided is None and reason:
                attrs["kvgate.reject_reason"] = reason
            self._child("admit", self.admitting, now if decided is None else decided, attrs)
        upstream = self._upstream
        if upstream is not None:
            up_end = self.first_data
            if up_end is None and ttft is not None:
                up_end = self._upstream_start + ttft
            relay_end = self.relay_end if self.relay_end is not None else now
            if up_end is None:  # no answer came: the upstream span is the whole wait
                up_end = relay_end
                if outcome != "ok":
                    upstream.set_status(Status(StatusCode.ERROR, outcome))
            if status:
                upstream.set_attribute("http.response.status_code", status)
            upstream.end(end_time=self._ns(up_end))
            if up_end < relay_end or self.first_data is not None:
                self._child(
                    "relay",
                    up_end,
                    relay_end,
                    {"kvgate.outcome": outcome, "gen_ai.usage.output_tokens": completion or 0},
                )
        if settle is not None:
            self._child("settle", settle[0], settle[1], {})
        attrs = {"kvgate.outcome": outcome}
        if status:
            attrs["http.response.status_code"] = status
        if tenant is not None:
            attrs["kvgate.tenant"] = tenant.name
            attrs["kvgate.priority"] = tenant.priority
        if backend is not None:
            attrs["kvgate.backend"] = backend.name
        if model is not None:
            attrs["gen_ai.request.model"] = model.name
        if reason:
            attrs["kvgate.reason"] = reason
        if reserved is not None:
            attrs["kvgate.tokens.reserved"] = reserved
        if prompt is not None:
            attrs["gen_ai.usage.input_tokens"] = prompt
        if completion is not None:
            attrs["gen_ai.usage.output_tokens"] = completion
        span.set_attributes(attrs)
        if status >= 500:
            error_type = reason or str(status)
            span.set_attribute("error.type", error_type)
            span.set_status(Status(StatusCode.ERROR, error_type))
        elif outcome != "ok" and outcome != "rejected":
            span.set_attribute("error.type", outcome)
        span.end(end_time=self._ns(max(now, settle[1] if settle else now)))
