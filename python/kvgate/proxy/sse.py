"""Server-sent events relay bookkeeping: split, inspect, optionally strip, never re-frame.

The gateway writes upstream bytes to the client event by event, exactly as the engine framed
them (``data: <json>\\n\\n``, ENGINES.md §5.4). While doing so it reads what it needs to settle
the token account: the ``usage`` object (on a ``choices: []`` chunk for OpenAI/vLLM, on the
``finish_reason`` chunk for llama.cpp), the text delivered so far (for a stream that breaks or
whose engine sends no usage), and ``error`` events.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["SSEInspector"]

_SEPARATORS = (b"\n\n", b"\r\n\r\n", b"\r\r")


def _split_point(buf: bytes | bytearray, start: int) -> tuple[int, int]:
    """Earliest event end in ``buf`` from ``start``: (index of separator, its length) or (-1, 0)."""
    best, size = -1, 0
    for sep in _SEPARATORS:
        i = buf.find(sep, start)
        if i != -1 and (best == -1 or i < best):
            best, size = i, len(sep)
    return best, size


def _may_carry_usage_or_error(payload: bytes) -> bool:
    """Whether a ``data:`` payload may hold a non-null ``usage`` or an ``error`` key (a cheap
    byte test; ``True`` when unsure). Inside JSON strings a quote is escaped, so ``"usage"`` in
    the bytes is a key (or a string value), never generated text."""
    if b'"error"' in payload:
        return True
    i = payload.find(b'"usage"')
    if i == -1:
        return False
    return not payload[i + 7 : i + 24].lstrip(b" \t\r\n:").startswith(b"null")


class SSEInspector:
    """Cuts an upstream SSE byte stream into complete events and inspects each one.

    Args:
        strip_usage_chunk: drop the usage-only chunk (``"choices": []`` with a ``usage``
            object). Set when the gateway added ``stream_options.include_usage`` itself and the
            client did not ask for it, so the client sees exactly what it would have seen.

    Attributes:
        usage: the last non-null ``usage`` object seen (dict), or ``None``.
        delivered_text: list of text pieces (content, reasoning, tool-call arguments, legacy
            ``text``) in chunks already handed out for writing.
        content_chunks: number of chunks handed out that carried generated text.
        error: the ``error`` object of an error event, if one was seen.
        done: ``True`` once ``data: [DONE]`` was seen.
    """

    __slots__ = (
        "_buf",
        "_chunks",
        "_cr",
        "_pending",
        "_text",
        "done",
        "error",
        "strip",
        "usage",
    )

    def __init__(self, *, strip_usage_chunk: bool) -> None:
        self.strip = strip_usage_chunk
        self._buf = bytearray()
        self._cr = False  # a CR was seen: events may end with \r\n\r\n or \r\r too
        self.usage: dict[str, Any] | None = None
        self._text: list[str] = []
        self._chunks = 0
        # payloads with neither usage nor error, parsed for their text only when asked: the
        # text is needed only when the engine reports no usage (a broken stream, llama.cpp)
        self._pending: list[bytes] = []
        self.error: dict[str, Any] | None = None
        self.done = False

    @property
    def delivered_text(self) -> list[str]:
        """Text pieces of the events handed out so far (see the class attributes)."""
        if self._pending:
            self._parse_pending()
        return self._text

    @property
    def content_chunks(self) -> int:
        """Events handed out so far that carried generated text."""
        if self._pending:
            self._parse_pending()
        return self._chunks

    def _parse_pending(self) -> None:
        pending, self._pending = self._pending, []
        for payload in pending:
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                choices = obj.get("choices")
                if isinstance(choices, list):
                    self._collect_text(choices)

    def feed(self, data: bytes) -> bytes:
        """Take the next upstream bytes; return the complete events to write now (maybe ``b""``).

        Bytes of an event whose end has not arrived yet are held until it does; nothing is
        re-encoded, so what is returned is byte-for-byte what upstream sent (minus a stripped
        usage chunk).
        """
        buf = self._buf
        buf += data
        if not self._cr and b"\r" in data:
            self._cr = True
        if self._cr:
            end, size = _split_point(buf, 0)
        else:  # only LF line ends so far (every engine we know): one separator to look for
            end, size = buf.find(b"\n\n"), 2
        if end == -1:
            return b""
        out: bytearray | None = None  # set once an event is dropped
        pos = 0
        while end != -1:
            stop = end + size
            event = bytes(buf[pos:stop])
            if self._inspect(event):
                if out is not None:
                    out += event
            elif out is None:
                out = bytearray(buf[:pos])
            pos = stop
            if self._cr:
                end, size = _split_point(buf, pos)
            else:
                end = buf.find(b"\n\n", pos)
        kept = bytes(buf[:pos]) if out is None else bytes(out)
        del buf[:pos]
        return kept

    def flush(self) -> bytes:
        """Whatever partial event remains at end of stream (written as is)."""
        rest = bytes(self._buf)
        self._buf.clear()
        if rest.strip():
            self._inspect(rest)
        return rest

    def _inspect(self, event: bytes) -> bool:
        """Read one complete event; return False when it must not be forwarded."""
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            if not _may_carry_usage_or_error(payload):
                self._pending.append(payload)
                continue
            if self._pending:  # keep the text in stream order
                self._parse_pending()
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(obj, dict):
                continue
            err = obj.get("error")
            if isinstance(err, dict):
                self.error = err
            usage = obj.get("usage")
            choices = obj.get("choices")
            if isinstance(usage, dict):
                self.usage = usage
                if self.strip and choices == []:
                    return False
            if isinstance(choices, list):
                self._collect_text(choices)
        return True

    def _collect_text(self, choices: list[Any]) -> None:
        found = False
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            text = choice.get("text")
            if isinstance(text, str) and text:
                self._text.append(text)
                found = True
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            for key in ("content", "reasoning_content", "reasoning"):
                piece = delta.get(key)
                if isinstance(piece, str) and piece:
                    self._text.append(piece)
                    found = True
            calls = delta.get("tool_calls")
            if isinstance(calls, list):
                for call in calls:
                    fn = call.get("function") if isinstance(call, dict) else None
                    if isinstance(fn, dict):
                        for key in ("name", "arguments"):
                            piece = fn.get(key)
                            if isinstance(piece, str) and piece:
                                self._text.append(piece)
                                found = True
        if found:
            self._chunks += 1
