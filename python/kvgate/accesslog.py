"""Access log, request ids and trace context, and the log formats of ``kvgate serve``.

* Every request that reaches an inference or forwarded route gets a request id
  (:func:`request_id`): the client's ``x-request-id`` when it is sane, else a new one. It goes
  to the engine as ``x-request-id``, back to the client on every answer kvgate gives
  (:func:`with_request_id`; a relayed answer's head gets it in Rust:
  ``AdmissionController.relay_http(request_id=)``) and into the access log line.
* W3C Trace Context (https://www.w3.org/TR/trace-context/): the client's ``traceparent`` and
  ``tracestate`` go to the engine unchanged when ``traceparent`` is valid
  (:func:`valid_traceparent`); an invalid one is dropped with its ``tracestate``.
* The access log (:func:`log_access`): one JSON object per request, built only when the log is
  on (:func:`configure_access_log`). It never holds an API key (the tenant's declared name
  instead) nor any text of the request. Its lines are not written one by one: they wait in a
  buffer, written out when :data:`FLUSH_BYTES` are waiting or :data:`FLUSH_SECONDS` after the
  first of them, and when the server stops (:func:`flush_access_log`) — nginx's
  ``access_log ... buffer= flush=``. Through Python's ``logging`` (a record, a handler's lock, a
  write and a flush per line) a line cost as much CPU as the rest of a refusal.

Nothing here configures logging at import; ``kvgate serve`` calls :func:`configure_logging` and
:func:`configure_access_log` once.
"""

from __future__ import annotations

import asyncio
import atexit
import datetime
import logging
import math
import os
import re
import select
import sys
import threading
import time
import uuid
from typing import Any, TextIO

import orjson

from kvgate.proxy.prepared import PreparedResponse

__all__ = [
    "FLUSH_BYTES",
    "FLUSH_SECONDS",
    "LOG_FORMATS",
    "MAX_REQUEST_ID",
    "JsonFormatter",
    "bytes_sent",
    "configure_access_log",
    "configure_logging",
    "flush_access_log",
    "log_access",
    "request_id",
    "upstream_trace_headers",
    "valid_traceparent",
    "with_request_id",
]

#: The access log's lines are written out once this many bytes of them wait (bytes) ...
FLUSH_BYTES = 64 * 1024
#: ... or this long after the first of them was logged (seconds), whichever comes first.
FLUSH_SECONDS = 0.5
#: A write of at most this many bytes to a pipe is never interleaved with another process's
#: (POSIX ``PIPE_BUF``): the workers of ``kvgate serve --workers N`` share stderr, so the lines
#: go out in pieces of at most this size, each cut at a line's end.
_ATOMIC_WRITE = select.PIPE_BUF

_warn = logging.getLogger("kvgate.serve")

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
    """Log the access log line of one request (nothing when the access log is off: the line is
    not even built). It reaches the file or stderr with the next flush of the log's buffer.

    Fields (JSON): ``time`` (UTC, ISO 8601, in milliseconds), ``request_id``,
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
    log = _ACCESS
    if log is None:
        return
    log.write(
        {
            "time": _stamp(time.time()),
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
    )


class _AccessLog:
    """The access log's buffered writer: each line (one JSON object and a newline) is appended to
    a buffer, written to ``fd`` (a file descriptor, appended to) or ``stream`` (a text stream
    without one: a test's captured stderr) when :data:`FLUSH_BYTES` wait, or
    :data:`FLUSH_SECONDS` after the first waiting line (a timer on the running event loop; with
    no loop running, at once). A write that fails (a full disk, a closed pipe) drops what was
    waiting and says so on the ``kvgate.serve`` logger, once until a write succeeds again;
    serving goes on. Safe to call from several threads (kvgate itself logs from its event loop
    only)."""

    __slots__ = ("_buf", "_fd", "_lock", "_owned", "_stream", "_timer", "_timer_loop", "_warned")

    def __init__(self, fd: int | None, stream: TextIO | None, owned: bool) -> None:
        self._fd = fd
        self._stream = stream
        self._owned = owned  # the descriptor is the log's own (a file it opened)
        self._buf = bytearray()
        self._lock = threading.Lock()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._warned = False

    def write(self, line: dict[str, Any]) -> None:
        """Append one line; write the buffer out when it is full, else make sure it will be."""
        data = orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)
        with self._lock:
            self._buf += data
            full = len(self._buf) >= FLUSH_BYTES
        if full:
            self.flush()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        # a timer left on a loop that ended before it fired would never flush: one per loop
        if self._timer is None or self._timer_loop is not loop:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_loop = loop.call_later(FLUSH_SECONDS, self.flush), loop

    def flush(self) -> None:
        """Write out every waiting line, in pieces of at most :data:`_ATOMIC_WRITE` bytes that
        each end at a line's end (a longer line: alone, whole)."""
        with self._lock:
            timer, self._timer, self._timer_loop = self._timer, None, None
            buf, self._buf = self._buf, bytearray()
        if timer is not None:
            timer.cancel()
        if not buf:
            return
        view = memoryview(buf)
        try:
            start = 0
            while start < len(buf):
                cut = start + _ATOMIC_WRITE
                if cut < len(buf):
                    end = buf.rfind(b"\n", start, cut) + 1
                    if end <= start:  # one line longer than a piece
                        end = buf.index(b"\n", cut) + 1
                else:
                    end = len(buf)
                self._put(view[start:end])
                start = end
            self._warned = False
        except (OSError, ValueError) as exc:  # ValueError: a closed stream
            if not self._warned:
                self._warned = True
                _warn.warning("access log lines lost: cannot write them (%s)", exc)
        finally:
            view.release()

    def _put(self, piece: memoryview) -> None:
        if self._stream is not None:
            self._stream.write(bytes(piece).decode())
            self._stream.flush()
            return
        if self._fd is None:
            raise OSError("the access log is closed")
        while piece:
            piece = piece[os.write(self._fd, piece) :]

    def close(self) -> None:
        """Write out what waits and close the file the log opened."""
        self.flush()
        if self._owned and self._fd is not None:
            os.close(self._fd)
            self._fd = None


_ACCESS: _AccessLog | None = None


def flush_access_log() -> None:
    """Write out the access log lines that wait in its buffer (``kvgate serve`` calls it as a
    server stops; a process that ends without it loses at most :data:`FLUSH_SECONDS` of
    lines)."""
    if _ACCESS is not None:
        _ACCESS.flush()


# what the last requests logged after the server's own flush, in a process that ends normally
# (a forked worker ends with os._exit: it flushes before); nothing to do while the log is off
atexit.register(flush_access_log)


def _time(created: float) -> str:
    """``created`` (seconds since the epoch) as UTC, ISO 8601, in milliseconds."""
    return datetime.datetime.fromtimestamp(created, datetime.UTC).isoformat(timespec="milliseconds")


_second: tuple[int, str] = (-1, "")  # the last whole second stamped, its text up to the seconds


def _stamp(created: float) -> str:
    """What :func:`_time` gives, the date and time of day made once a second: the access log
    stamps every line, and ``datetime``'s conversion cost several µs of a refusal's 50."""
    global _second
    whole = math.floor(created)
    micro = round((created - whole) * 1e6)  # datetime rounds to µs first (half to even)
    if micro >= 1_000_000:
        whole, micro = whole + 1, micro - 1_000_000
    cached, text = _second  # one tuple: a thread never sees one second's date with another's
    if whole != cached:
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
        _second = (whole, text)
    return f"{text}.{micro // 1000:03d}+00:00"


class JsonFormatter(logging.Formatter):
    """One JSON object per line (orjson), for ``kvgate serve --log-format json``: a record as
    ``time``, ``level``, ``logger``, ``message`` (and ``exception``, the traceback, when it
    carries one). ``time`` is UTC, ISO 8601, in milliseconds."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one JSON line (no newline; the handler adds it)."""
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


def configure_access_log(enabled: bool, path: str | None = None) -> None:
    """Send the access log to stderr (``path`` ``None``) or append it to the file ``path``, one
    JSON line per request, whatever the ``--log-level`` and ``--log-format``; ``enabled`` false
    turns it off (the lines are then not even built). What the previous configuration still
    held is written out first, and a file it had opened is closed.

    Raises:
        OSError: the file cannot be opened for appending.
    """
    global _ACCESS
    fresh: _AccessLog | None = None
    if enabled:
        if path is not None:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fresh = _AccessLog(fd, None, owned=True)
        else:
            fresh = _stderr_log(sys.stderr)
    old, _ACCESS = _ACCESS, fresh
    if old is not None:
        old.close()


def _stderr_log(stream: TextIO | None) -> _AccessLog | None:
    """A log to ``stream`` (stderr): through its file descriptor when it has one (what is in
    its own buffer is flushed first), else through the stream itself; ``None`` (no log) when
    there is no stderr (``kvgate serve 2>&-``)."""
    if stream is None:
        return None
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return _AccessLog(None, stream, owned=False)
    stream.flush()
    return _AccessLog(fd, None, owned=False)
