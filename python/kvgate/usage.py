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

import asyncio
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

__all__ = ["BUCKET_SECONDS", "MAX_MINUTES", "UsageLedger", "parse_time", "summed", "usage_reply"]

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
#: A row's counts: requests, prompt tokens, completion tokens.
Counts = tuple[int, int, int]


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
    ) -> dict[Key, Counts]:
        """``{key: (requests, prompt_tokens, completion_tokens)}`` summed over every minute
        that overlaps ``[start, end)`` (Unix seconds); only the rows of ``tenants`` (names)
        when given."""
        return summed(self.buckets(start, end), tenants)

    def buckets(self, start: float, end: float) -> list[dict[Key, list[int]]]:
        """Copies of the minute buckets that overlap ``[start, end)`` (Unix seconds), to be
        read off the event loop (:func:`summed`): a copy is a few milliseconds for 100,000
        rows, where summing and writing them out takes hundreds. The rows' counts are shared,
        not copied: one read a moment later may include what a flush folded since."""
        first = math.floor(start / BUCKET_SECONDS)
        return [
            bucket.copy()
            for minute, bucket in self._minutes.items()
            if first <= minute and minute * BUCKET_SECONDS < end
        ]


def summed(
    buckets: Iterable[dict[Key, list[int]]], tenants: Collection[str] | None = None
) -> dict[Key, Counts]:
    """``{key: (requests, prompt_tokens, completion_tokens)}`` summed over ``buckets``
    (:meth:`UsageLedger.buckets`); only the rows of ``tenants`` (names) when given. Tuples,
    not lists: tuples of numbers leave the garbage collector's tracking, so 100,000 rows add
    nothing to the pauses of its later full collections."""
    out: dict[Key, Counts] = {}
    get = out.get
    for bucket in buckets:
        for key, (requests, prompt, completion) in bucket.items():
            if tenants is not None and key[0] not in tenants:
                continue
            row = get(key)
            out[key] = (
                (requests, prompt, completion)
                if row is None
                else (row[0] + requests, row[1] + prompt, row[2] + completion)
            )
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


async def usage_reply(ledger: UsageLedger, request: web.BaseRequest) -> Reply:
    """The answer to ``GET /admin/usage`` (the caller checked the admin key and flushed the
    batches into ``ledger``).

    Query: ``from`` (default: the start), ``to`` (default: now), each Unix seconds or RFC 3339
    (:func:`parse_time`); every minute bucket that overlaps ``[from, to)`` is counted, so the
    range is widened to whole minutes (the answer says which). ``format``: ``json`` (default)
    or ``csv`` (RFC 4180: a header line, CRLF line ends, fields quoted when they hold a comma,
    a quote or a line break; ``Content-Type: text/csv``). ``tenant`` (repeatable): only those
    tenants' rows (a name with none, such as one never charged, gives none; a tenant a reload
    removed keeps the rows it was charged).

    The rows are summed and written out in a worker thread (:func:`asyncio.to_thread`), from
    copies of the minute buckets taken on the event loop: 100,000 tenants' export takes a few
    hundred milliseconds, during which the loop goes on serving requests (it waits for the
    interpreter lock at most a switch interval at a time, 5 ms) instead of stopping.

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
    buckets = ledger.buckets(first, last)
    oldest = ledger.oldest
    head = {
        "object": "usage",
        "from": _iso(first),
        "to": _iso(last),
        "bucket_seconds": BUCKET_SECONDS,
        "started": _iso(ledger.started),
        "oldest_bucket": None if oldest is None else _iso(oldest),
        "worker_pid": os.getpid(),
    }
    if fmt == "csv":
        body = await asyncio.to_thread(_csv, buckets, tenants)
        return web.Response(body=body, headers={"Content-Type": "text/csv; charset=utf-8"})
    body = await asyncio.to_thread(_json, head, buckets, tenants)
    return web.Response(body=body, content_type="application/json")


def _json(
    head: dict[str, object], buckets: list[dict[Key, list[int]]], tenants: Collection[str] | None
) -> bytes:
    """The JSON answer: ``head``, then ``data`` (one object per row, sorted by key) and
    ``totals``. Each row is written as bytes, not built as a dict first: 100,000 dicts would
    cost a third more time and, being tracked by the garbage collector, longer pauses."""
    rows = summed(buckets, tenants)
    keys = sorted(rows)
    dumps = orjson.dumps
    data = b",".join(
        [
            _ROW % (dumps(key[0]), dumps(key[1]), dumps(key[2]), *rows[key])  # type: ignore[str-bytes-safe]
            for key in keys
        ]
    )
    totals = dict(
        zip(COLUMNS[3:], (sum(v[i] for v in rows.values()) for i in range(3)), strict=True)
    )
    start = dumps(head)[:-1]  # without its closing brace
    return b'%b,"data":[%b],"totals":%b}' % (start, data, dumps(totals))


#: One row of the JSON answer's ``data`` (the keys of :data:`COLUMNS`, in order).
_ROW = (
    b'{"tenant":%b,"model":%b,"outcome":%b,"requests":%d,"prompt_tokens":%d,"completion_tokens":%d}'
)


def _csv(buckets: list[dict[Key, list[int]]], tenants: Collection[str] | None) -> bytes:
    """The CSV answer (RFC 4180: CRLF line ends, fields quoted with ``"`` only when needed)."""
    rows = summed(buckets, tenants)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(COLUMNS)
    for key in sorted(rows):
        writer.writerow((*key, *rows[key]))
    return out.getvalue().encode()
