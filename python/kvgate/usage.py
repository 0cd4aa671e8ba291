"""Per-tenant usage since start, in per-minute buckets, and ``GET /admin/usage``.

The per-request batches of :class:`kvgate.metrics.GatewayMetrics` are folded into a
:class:`UsageLedger` at every flush (once a second, and before every answer of
``/admin/usage``): per tenant × model × outcome, the requests and the prompt and completion
tokens charged (what the tenant's buckets were charged at settlement: the engine's usage, or
kvgate's own count when the engine gave none; a refusal charges nothing). A request counts in
the minute it was folded, at most :data:`kvgate.metrics.FLUSH_SECONDS` after it ended.

Memory is bounded: at most :data:`MAX_MINUTES` buckets (7 days) and :data:`MAX_ROWS` rows in
all are kept, the oldest minutes dropped first (the answer's ``oldest_bucket`` says where what
is kept starts), each bucket holding one row (about 250 bytes) per tenant × model × outcome seen
in that minute: a few tenants keep 7 days, 100,000 tenants active every minute keep the last
few minutes. Each worker process of ``--workers N`` keeps its own ledger and answers for
itself.
"""

from __future__ import annotations

import csv
import datetime
import io
import math
import os
import time
from collections.abc import Callable, Collection, Iterable

import orjson
from aiohttp import web

from kvgate.errors import GatewayError, invalid_value
from kvgate.proxy.prepared import Reply, error_response

__all__ = ["BUCKET_SECONDS", "MAX_MINUTES", "UsageLedger", "parse_time", "usage_reply"]

#: The width of one bucket (seconds).
BUCKET_SECONDS = 60
#: The most buckets kept (7 days of minutes); the oldest go first.
MAX_MINUTES = 7 * 24 * 60
#: The most rows kept over all buckets (about 250 MB); the oldest minutes go first, never the
#: current one.
MAX_ROWS = 1_000_000

#: The CSV columns (and the keys of each JSON row), in order.
COLUMNS = ("tenant", "model", "outcome", "requests", "prompt_tokens", "completion_tokens")

#: A row key: tenant name, model name ("" when none was named), outcome.
Key = tuple[str, str, str]


class UsageLedger:
    """Requests and tokens per tenant × model × outcome, in per-minute buckets since start.

    Args:
        clock: the wall clock (Unix seconds); tests move it to place requests in minutes.
        max_minutes: the most buckets kept (oldest dropped first).
        max_rows: the most rows kept over all buckets (the oldest minutes dropped first, never
            the current one).
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        max_minutes: int = MAX_MINUTES,
        max_rows: int = MAX_ROWS,
    ) -> None:
        self.clock = clock
        self.max_minutes = max_minutes
        self.max_rows = max_rows
        #: Unix seconds when the ledger started (the default ``from`` of a query)
        self.started = clock()
        #: tenant name → tokens charged since start (prompt + completion; never dropped: one
        #: entry per tenant seen)
        self.tenant_tokens: dict[str, int] = {}
        # minute index (Unix seconds // 60) → key → [requests, prompt tokens, completion tokens]
        self._minutes: dict[int, dict[Key, list[int]]] = {}
        self._rows = 0  # rows in all buckets

    @property
    def rows(self) -> int:
        """Rows kept over all buckets (≤ :attr:`max_rows`, unless the current minute alone
        holds more)."""
        return self._rows

    def add(self, rows: dict[Key, list[int]]) -> None:
        """Add a batch of ``{key: [requests, prompt_tokens, completion_tokens]}`` to the
        current minute (by :attr:`clock`)."""
        if not rows:
            return
        minute = int(self.clock() // BUCKET_SECONDS)
        bucket = self._minutes.get(minute)
        if bucket is None:
            bucket = self._minutes[minute] = {}
            while len(self._minutes) > max(1, self.max_minutes):
                self._drop_oldest(keep=minute)
        tokens = self.tenant_tokens
        for key, (requests, prompt, completion) in rows.items():
            row = bucket.get(key)
            if row is None:
                bucket[key] = [requests, prompt, completion]
                self._rows += 1
            else:
                row[0] += requests
                row[1] += prompt
                row[2] += completion
            if prompt or completion:
                tokens[key[0]] = tokens.get(key[0], 0) + prompt + completion
        while self._rows > self.max_rows and len(self._minutes) > 1:
            self._drop_oldest(keep=minute)

    def _drop_oldest(self, keep: int) -> None:
        """Drop the oldest bucket other than minute ``keep`` (the one being added to, which is
        the oldest when the clock stepped back); there must be one."""
        oldest = min(m for m in self._minutes if m != keep)
        self._rows -= len(self._minutes.pop(oldest))

    @property
    def oldest(self) -> float | None:
        """Unix seconds where the oldest bucket kept starts (``None``: nothing counted)."""
        return min(self._minutes) * BUCKET_SECONDS if self._minutes else None

    def totals(
        self, start: float, end: float, tenants: Collection[str] | None = None
    ) -> dict[Key, list[int]]:
        """``{key: [requests, prompt_tokens, completion_tokens]}`` summed over every minute
        that overlaps ``[start, end)`` (Unix seconds); only the rows of ``tenants`` (names)
        when given."""
        first = math.floor(start / BUCKET_SECONDS)
        out: dict[Key, list[int]] = {}
        for minute, bucket in self._minutes.items():
            if minute < first or minute * BUCKET_SECONDS >= end:
                continue
            for key, (requests, prompt, completion) in bucket.items():
                if tenants is not None and key[0] not in tenants:
                    continue
                row = out.get(key)
                if row is None:
                    out[key] = [requests, prompt, completion]
                else:
                    row[0] += requests
                    row[1] += prompt
                    row[2] += completion
        return out


#: the latest time a query names (Unix seconds, 9999-12-31T23:58:00Z): a later one counts as
#: this one, so that the range, widened to whole minutes, still ends in a year that a date-time
#: can spell (``?to=9999-12-31T23:59:59Z`` means "to the end")
LATEST_S = 253_402_300_680.0


def parse_time(name: str, value: str) -> float:
    """A query time: Unix seconds (``1767225600``, ``1767225600.5``) or an RFC 3339 date-time
    with its offset (``2026-01-01T00:00:00Z``, ``2026-01-01T01:00:00+01:00``), as Unix
    seconds; a date-time before 1970 counts as 0, any time after :data:`LATEST_S` as that.

    Raises:
        GatewayError: 400 ``invalid_value`` (param ``name``) for anything else, a time without
            an offset included.
    """
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if math.isfinite(seconds) and seconds >= 0:
            return min(seconds, LATEST_S)
        raise invalid_value(name, f"{value!r} is not a time (Unix seconds must be finite and ≥ 0).")
    try:
        # RFC 3339 allows a lower-case "t" / "z" and a space for "T"; fromisoformat reads them
        moment = datetime.datetime.fromisoformat(text.upper().replace("Z", "+00:00"))
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None or len(text) < 20:
        raise invalid_value(
            name,
            f"{value!r} is not a time: use Unix seconds or an RFC 3339 date-time with its "
            "offset (2026-01-01T00:00:00Z).",
        )
    return min(max(moment.timestamp(), 0.0), LATEST_S)


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat().replace("+00:00", "Z")


_PARAMS = frozenset({"from", "to", "format", "tenant"})


def usage_reply(ledger: UsageLedger, request: web.BaseRequest) -> Reply:
    """The answer to ``GET /admin/usage`` (the caller checked the admin key and flushed the
    batches into ``ledger``).

    Query: ``from`` (default: the start), ``to`` (default: now), each Unix seconds or RFC 3339
    (:func:`parse_time`); every minute bucket that overlaps ``[from, to)`` is counted, so the
    range is widened to whole minutes (the answer says which). ``format``: ``json`` (default)
    or ``csv`` (RFC 4180: a header line, CRLF line ends, fields quoted when they hold a comma,
    a quote or a line break; ``Content-Type: text/csv``). ``tenant`` (repeatable): only those
    tenants' rows (a name with none, such as one never charged, gives none; a tenant a reload
    removed keeps the rows it was charged).

    Errors (OpenAI's error shape): 400 ``invalid_value`` for an unreadable time or format,
    ``from`` after ``to``, an empty tenant name, a repeated or unknown parameter.
    """
    query = request.query
    try:
        for name in query:
            if name not in _PARAMS:
                raise invalid_value(
                    name, f"Unknown parameter {name!r}: use from, to, format and tenant."
                )
            if name != "tenant" and len(query.getall(name)) > 1:
                raise invalid_value(name, f"Parameter {name!r} is given more than once.")
        tenants = frozenset(query.getall("tenant", [])) or None
        if tenants is not None and "" in tenants:
            raise invalid_value("tenant", "A tenant name is not empty.")
        now = ledger.clock()
        start = parse_time("from", query["from"]) if "from" in query else ledger.started
        end = parse_time("to", query["to"]) if "to" in query else now
        if start > end:
            raise invalid_value("from", "`from` is after `to`.")
        fmt = query.get("format", "json")
        if fmt not in ("json", "csv"):
            raise invalid_value("format", f"Unknown format {fmt!r}: use json or csv.")
    except GatewayError as err:
        return error_response(request, err)
    first = math.floor(start / BUCKET_SECONDS) * BUCKET_SECONDS
    last = max(first + BUCKET_SECONDS, math.ceil(end / BUCKET_SECONDS) * BUCKET_SECONDS)
    rows = sorted(ledger.totals(first, last, tenants).items())
    if fmt == "csv":
        return _csv(rows)
    data = [dict(zip(COLUMNS, (*key, *vals), strict=True)) for key, vals in rows]
    totals = [sum(v[i] for _, v in rows) for i in range(3)]
    oldest = ledger.oldest
    body = {
        "object": "usage",
        "from": _iso(first),
        "to": _iso(last),
        "bucket_seconds": BUCKET_SECONDS,
        "started": _iso(ledger.started),
        "oldest_bucket": None if oldest is None else _iso(oldest),
        "worker_pid": os.getpid(),
        "data": data,
        "totals": dict(zip(COLUMNS[3:], totals, strict=True)),
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def _csv(rows: Iterable[tuple[Key, list[int]]]) -> web.Response:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")  # RFC 4180: CRLF, minimal quoting with "
    writer.writerow(COLUMNS)
    for key, vals in rows:
        writer.writerow((*key, *vals))
    return web.Response(
        body=out.getvalue().encode(), headers={"Content-Type": "text/csv; charset=utf-8"}
    )
