"""Access log, request ids and trace context, and the log formats of ``kvgate serve``.

* Every request that reaches an inference or forwarded route gets a request id
  (:func:`request_id`): the client's ``x-request-id`` when it is sane, else a new one. It goes
  to the engine as ``x-request-id``, back to the client on every answer kvgate gives
  (:func:`with_request_id`, :func:`id_builder`) and into the access log line.
* W3C Trace Context (https://www.w3.org/TR/trace-context/): the client's ``traceparent`` and
  ``tracestate`` go to the engine unchanged when ``traceparent`` is valid
  (:func:`valid_traceparent`); an invalid one is dropped with its ``tracestate``.
* The access log (:func:`log_access`): one JSON object per request on the ``kvgate.access``
  logger, built only when that logger is enabled for INFO. It never holds an API key (the
  tenant's declared name instead) nor any text of the request.

Nothing here configures logging at import; ``kvgate serve`` calls :func:`configure_logging` and
:func:`configure_access_log` once.
"""

from __future__ import annotations

import datetime
import logging
import re
import sys
import uuid
from typing import Any

import orjson

from kvgate.proxy.prepared import HeadBuilder, PreparedResponse

__all__ = [
    "ACCESS_LOGGER",
    "LOG_FORMATS",
    "MAX_REQUEST_ID",
    "JsonFormatter",
    "bytes_sent",
    "configure_access_log",
    "configure_logging",
    "id_builder",
    "log_access",
    "request_id",
    "upstream_trace_headers",
    "valid_traceparent",
    "with_request_id",
]

#: The logger the access log lines go to (one INFO record per request).
ACCESS_LOGGER = logging.getLogger("kvgate.access")

#: The longest client ``x-request-id`` kept (characters); a longer one is replaced.
MAX_REQUEST_ID = 128

_SANE_ID = re.compile(r"[\x20-\x7e]{1," + str(MAX_REQUEST_ID) + "}")
# version "-" trace-id "-" parent-id "-" trace-flags, lower-case hex (W3C Trace Context §3.2)
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE = "0" * 32
_ZERO_PARENT = "0" * 16
_ID_NAME = b"x-request-id"


def request_id(given: str | None) -> str:
    """The request's id: ``given`` (the client's ``x-request-id``) when it is 1 to
    :data:`MAX_REQUEST_ID` printable ASCII characters (0x20–0x7E: nothing that could split a
    header or a log line), else a new random one (a UUID4 as 32 hex digits)."""
    if given is not None and _SANE_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex


def valid_traceparent(value: str) -> bool:
    """Whether ``value`` is a valid W3C Trace Context ``traceparent``: ``version-traceid-parentid-
    flags`` in lower-case hex (2-32-16-2 digits), version not ``ff``, trace id and parent id not
    all zeros; version ``00`` has exactly these four fields, a later version may add fields
    after a ``-`` (the specification's forward-compatibility rule)."""
    m = _TRACEPARENT.match(value)
    if m is None:
        return False
    version, trace, parent, _flags = m.groups()
    if version == "ff" or trace == _ZERO_TRACE or parent == _ZERO_PARENT:
        return False
    if len(value) == 55:
        return True
    return version != "00" and value[55] == "-"


def upstream_trace_headers(headers: Any, rid: str) -> dict[str, str]:
    """The headers kvgate adds to the engine request: ``x-request-id: rid``, and the client's
    ``traceparent`` / ``tracestate`` unchanged when ``traceparent`` is valid
    (:func:`valid_traceparent`; several ``tracestate`` headers are joined with ``,`` as the
    specification allows).

    Args:
        headers: the client's request headers (a multidict).
        rid: the request id (:func:`request_id`).
    """
    out = {"x-request-id": rid}
    parent = headers.get("traceparent")
    if parent is not None and valid_traceparent(parent):
        out["traceparent"] = parent
        states = headers.getall("tracestate", ())
        if states:
            out["tracestate"] = ",".join(states)
    return out


def with_request_id(raw: bytes, rid: str) -> bytes:
    """The HTTP/1.1 message ``raw`` with ``x-request-id: rid`` added right after its status
    line (``rid`` comes from :func:`request_id`: printable ASCII, so it cannot split the
    head)."""
    end = raw.find(b"\r\n") + 2
    return b"%s%s: %s\r\n%s" % (raw[:end], _ID_NAME, rid.encode(), raw[end:])


def id_builder(build: HeadBuilder, rid: str) -> HeadBuilder:
    """``build`` (a relayed answer's head builder) whose output carries ``x-request-id: rid``;
    an ``x-request-id`` the engine sent back is dropped (the client gets one, kvgate's)."""

    def built(
        status: int,
        upstream_headers: Any,
        body: bytes | None,
        connection: str | None,
        chunked: bool,
    ) -> bytes:
        if any(name.lower() == _ID_NAME for name, _ in upstream_headers):
            upstream_headers = tuple(h for h in upstream_headers if h[0].lower() != _ID_NAME)
        return with_request_id(build(status, upstream_headers, body, connection, chunked), rid)

    return built


def bytes_sent(request: Any, reply: Any) -> int:
    """Bytes of the answer to ``request`` (head and body, as written to the socket): a
    :class:`PreparedResponse`'s message, else what the connection's writer counted (a stream)."""
    if type(reply) is PreparedResponse:
        return len(reply.raw)
    writer = getattr(request, "writer", None)
    return int(getattr(writer, "output_size", 0) or 0) if writer is not None else 0


def log_access(
    request: Any,
    rid: str,
    started: float,
    now: float,
    *,
    route: str,
    status: int,
    outcome: str,
    tenant: Any = None,
    backend: Any = None,
    model: Any = None,
    reason: str | None = None,
    reserved: int | None = None,
    prompt: int | None = None,
    completion: int | None = None,
    queue_wait: float | None = None,
    ttft: float | None = None,
    reply: Any = None,
) -> None:
    """Write the access log line of one request (nothing when ``kvgate.access`` is not enabled
    for INFO: the dict is not even built).

    Fields (JSON): ``time`` (UTC, ISO 8601, added by :class:`JsonFormatter`), ``request_id``,
    ``method``, ``route``, ``tenant`` (declared name, never the key), ``backend``, ``model``,
    ``status`` (0: the client left before an answer), ``outcome`` (``ok``, ``rejected``,
    ``upstream_error``, ``upstream_timeout``, ``upstream_unreachable``, ``client_disconnect``,
    ...), ``reason`` (the refusal's reason or error code), ``reserved_tokens``,
    ``prompt_tokens``, ``completion_tokens`` (tokens), ``queue_wait_s`` (time spent in
    admission, seconds), ``ttft_s`` (engine's time to first byte, seconds), ``duration_s``
    (seconds), ``bytes_sent`` (bytes).

    Args:
        request: the client's request.
        rid: its id.
        started, now: ``time.perf_counter()`` at its start and end (seconds).
        reply: the answer (for ``bytes_sent``), ``None`` when there is none.
    """
    if not ACCESS_LOGGER.isEnabledFor(logging.INFO):
        return
    line = {
        "request_id": rid,
        "method": request.method,
        "route": route,
        "tenant": tenant.name if tenant is not None else None,
        "backend": backend.name if backend is not None else None,
        "model": model.name if model is not None else None,
        "status": status,
        "outcome": outcome,
        "reason": reason,
        "reserved_tokens": reserved,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "queue_wait_s": None if queue_wait is None else round(queue_wait, 6),
        "ttft_s": None if ttft is None else round(ttft, 6),
        "duration_s": round(now - started, 6),
        "bytes_sent": bytes_sent(request, reply),
    }
    # the record is made here, not by Logger.info: that one walks the stack for the caller's
    # file and line (findCaller), most of its cost, which this line does not carry
    record = logging.LogRecord(ACCESS_LOGGER.name, logging.INFO, "", 0, "access", None, None)
    record.access = line
    ACCESS_LOGGER.handle(record)


def _time(created: float) -> str:
    return datetime.datetime.fromtimestamp(created, datetime.UTC).isoformat(timespec="milliseconds")


class JsonFormatter(logging.Formatter):
    """One JSON object per line (orjson): an access record (:func:`log_access`) as its fields
    after ``time``; any other record as ``time``, ``level``, ``logger``, ``message`` (and
    ``exception``, the traceback, when it carries one). ``time`` is UTC, ISO 8601, in
    milliseconds."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one JSON line (no newline; the handler adds it)."""
        access = getattr(record, "access", None)
        if access is not None:
            return orjson.dumps({"time": _time(record.created), **access}).decode()
        out: dict[str, Any] = {
            "time": _time(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


#: The ``--log-format`` values.
LOG_FORMATS = ("text", "json")

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str, fmt: str = "text") -> None:
    """Set up the root logger once for ``kvgate serve``: ``level`` (``INFO``, ...) and ``fmt``
    ``text`` (``time LEVEL logger: message``, for humans) or ``json`` (:class:`JsonFormatter`),
    to stderr.

    Raises:
        ValueError: ``fmt`` is neither ``text`` nor ``json``.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def configure_access_log(enabled: bool, path: str | None = None) -> logging.Handler | None:
    """Send the access log (``kvgate.access``) to stderr (``path`` ``None``) or append it to the
    file ``path``, one JSON line per request, whatever the ``--log-level`` and ``--log-format``;
    ``enabled`` false turns it off (the lines are then not even built). Returns the handler
    (``None`` when off).

    Raises:
        OSError: the file cannot be opened for appending.
    """
    for old in ACCESS_LOGGER.handlers[:]:
        ACCESS_LOGGER.removeHandler(old)
        old.close()
    ACCESS_LOGGER.propagate = False
    if not enabled:
        ACCESS_LOGGER.setLevel(logging.CRITICAL + 1)
        return None
    handler: logging.Handler
    if path is None:
        handler = logging.StreamHandler(sys.stderr)
    else:
        handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(JsonFormatter())
    ACCESS_LOGGER.addHandler(handler)
    ACCESS_LOGGER.setLevel(logging.INFO)
    return handler
