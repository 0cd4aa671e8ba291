"""The reference the gateway's stream assembler is held to: the first version of
``kvgate.proxy.assemble``, in Python (kvgate now runs ``kvgate._core.StreamAssembler``, its Rust
port, which ``test_assemble.py`` checks against this one on any stream).

A non-streamed request goes upstream as a stream; the client gets the one JSON body the engine
would have sent: :class:`ChunkAssembler` (chat and legacy completions) and
:class:`ResponsesAssembler` (OpenAI's Responses API) rebuild it from the parsed events, and
:class:`SSELines` cuts the byte stream into their ``data:`` payloads. Only the answer being
built is kept, never the events themselves.
"""

from __future__ import annotations

from typing import Any

from kvgate._core import EVENT_LIMIT, RESPONSES_TEXT_EVENTS

__all__ = [
    "EVENT_LIMIT",
    "Assembler",
    "ChunkAssembler",
    "EventTooLong",
    "ResponsesAssembler",
    "SSELines",
]


class EventTooLong(ValueError):
    """An event of the stream grew past :data:`EVENT_LIMIT` bytes before its end."""


class SSELines:
    """Cuts an SSE byte stream into the ``data:`` payloads of its events (the SSE format of the
    WHATWG HTML standard: lines end with LF, CRLF or CR; an empty line ends an event; the
    ``data:`` lines of one event are joined with LF; one space after the colon is dropped).

    Only the unfinished last line and the unfinished event's ``data:`` lines are held between
    calls, at most :data:`EVENT_LIMIT` bytes of them.
    """

    __slots__ = ("_data", "_held", "_rest", "_rest_len")

    def __init__(self) -> None:
        self._rest: list[bytes] = []  # the unfinished line, in pieces
        self._rest_len = 0
        self._data: list[bytes] = []
        self._held = 0  # bytes in _data

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads of the events that ``chunk`` completes (maybe none), in order.

        Raises:
            EventTooLong: the unfinished event (its lines, and the line without its end)
                holds more than :data:`EVENT_LIMIT` bytes.
        """
        if self._rest and b"\n" not in chunk and b"\r" not in chunk:
            # more of an unfinished line: kept as a piece, not joined and split again
            self._rest.append(chunk)
            self._rest_len += len(chunk)
            self._check()
            return []
        buf = b"".join((*self._rest, chunk)) if self._rest else chunk
        lines = buf.splitlines(keepends=True)
        # a line is complete once its end arrived; a trailing CR may be the first half of CRLF
        if lines and (not lines[-1].endswith((b"\n", b"\r")) or lines[-1].endswith(b"\r")):
            last = lines.pop()
            self._rest, self._rest_len = [last], len(last)
        else:
            self._rest, self._rest_len = [], 0
        out = self._take(lines)
        self._check()
        return out

    def _check(self) -> None:
        if self._held + self._rest_len > EVENT_LIMIT:
            self._rest, self._rest_len, self._data, self._held = [], 0, [], 0
            raise EventTooLong(f"an event of over {EVENT_LIMIT} bytes")

    def flush(self) -> list[bytes]:
        """The payloads left at the end of the stream (an event without its closing empty
        line counts: the stream ended)."""
        lines = [b"".join(self._rest)] if self._rest else []
        self._rest, self._rest_len = [], 0
        out = self._take(lines)
        if self._data:
            out.append(b"\n".join(self._data))
            self._data, self._held = [], 0
        return out

    def _take(self, lines: list[bytes]) -> list[bytes]:
        out: list[bytes] = []
        for raw in lines:
            line = raw.rstrip(b"\r\n")
            if not line:
                if self._data:
                    out.append(b"\n".join(self._data))
                    self._data, self._held = [], 0
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
                self._held += len(value) + 1  # the line's end counts (empty lines held bytes)
            # `event:`, `id:`, `retry:` and comments carry nothing the answer needs
        return out


class Assembler:
    """What both assemblers share: each event goes to :meth:`add`; :attr:`error` is the
    ``error`` object of an error event (the answer then is an error); :attr:`complete` says
    whether the stream's end was seen (``data: [DONE]``, a Responses terminal event)."""

    __slots__ = ("complete", "error")

    def __init__(self) -> None:
        self.error: dict[str, Any] | None = None
        self.complete = False

    def add(self, event: Any) -> None:
        """Take one parsed event (a JSON object; anything else is ignored)."""
        raise NotImplementedError

    def done(self) -> None:
        """The stream's ``data: [DONE]`` arrived."""
        self.complete = True

    def answer(self) -> dict[str, Any]:
        """The non-streamed answer built so far."""
        raise NotImplementedError


class _Pieces(list[str]):
    """The pieces of a string member being assembled, joined once at the end (adding each
    piece to a ``str`` would copy the text so far every time)."""

    __slots__ = ()


def _joined(value: Any) -> Any:
    return "".join(value) if isinstance(value, _Pieces) else value


class _Choice:
    """One choice being assembled (chat ``message`` or legacy ``text``)."""

    __slots__ = ("extra", "finish_reason", "logprobs", "message", "text", "tool_calls")

    def __init__(self) -> None:
        self.message: dict[str, Any] = {}
        self.text: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.logprobs: dict[str, Any] | None = None
        self.finish_reason: Any = None
        self.extra: dict[str, Any] = {}


#: Keys of a chunk's choice that the assembler reads itself.
_CHOICE_KEYS = frozenset({"index", "delta", "text", "logprobs", "finish_reason"})

#: Top-level keys of a chunk that are not copied into the answer as they are.
_TOP_KEYS = frozenset({"choices", "usage", "object", "error"})


class ChunkAssembler(Assembler):
    """Rebuilds a chat completion (``object: chat.completion``) or a legacy completion
    (``text_completion``) from its stream's chunks (OpenAI's Chat Completions and Completions
    streaming format, which vLLM, SGLang, TGI and llama.cpp's server follow).

    The answer has the first chunk's ``id``, ``created`` and ``model``, every other top-level
    member the chunks carry (``system_fingerprint``, ``service_tier``, llama.cpp's ``timings``:
    the last non-null value), the last non-null ``usage`` (OpenAI and vLLM send it on a last
    ``choices: []`` chunk, llama.cpp on the ``finish_reason`` chunk), and ``choices`` in
    ``index`` order, each with ``index``, ``logprobs`` (its list members — ``content``,
    ``refusal``; legacy ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset`` —
    concatenated over the chunks) and the last non-null ``finish_reason``. A chat choice's
    ``message`` has the delta's ``role``; its string members (``content``,
    ``reasoning_content``, ``refusal``, ...) concatenated (``null`` when only ``null`` came);
    ``tool_calls`` put together by their ``index`` (the first ``id``, ``type`` and
    ``function.name``, the ``function.arguments`` concatenated). A legacy choice has ``text``.
    Other members of a choice (vLLM's ``stop_reason``) keep their last non-null value.

    Args:
        chat: ``True`` for ``/v1/chat/completions``, ``False`` for ``/v1/completions``.
    """

    __slots__ = ("_chat", "_choices", "_top", "_usage")

    def __init__(self, chat: bool) -> None:
        super().__init__()
        self._chat = chat
        self._top: dict[str, Any] = {}
        self._choices: dict[int, _Choice] = {}
        self._usage: Any = None

    def add(self, event: Any) -> None:
        """Take one parsed chunk (a JSON object; anything else is ignored). A chunk with an
        ``error`` object sets :attr:`error`."""
        if not isinstance(event, dict):
            return
        err = event.get("error")
        if isinstance(err, dict):
            self.error = err
            return
        top = self._top
        for key, value in event.items():
            if key not in _TOP_KEYS and (value is not None or key not in top):
                if key in ("id", "created", "model") and top.get(key) is not None:
                    continue
                top[key] = value
        usage = event.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        choices = event.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict):
                    self._add_choice(choice)

    def _add_choice(self, data: dict[str, Any]) -> None:
        index = data.get("index", 0)
        if type(index) is not int:
            return
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = _Choice()
        text = data.get("text")
        if isinstance(text, str):
            choice.text.append(text)
        delta = data.get("delta")
        if isinstance(delta, dict):
            self._add_delta(choice, delta)
        logprobs = data.get("logprobs")
        if isinstance(logprobs, dict):
            if choice.logprobs is None:
                choice.logprobs = {}
            _merge_logprobs(choice.logprobs, logprobs)
        reason = data.get("finish_reason")
        if reason is not None:
            choice.finish_reason = reason
        for key, value in data.items():
            if key not in _CHOICE_KEYS and (value is not None or key not in choice.extra):
                choice.extra[key] = value

    @staticmethod
    def _add_delta(choice: _Choice, delta: dict[str, Any]) -> None:
        message = choice.message
        for key, value in delta.items():
            if key == "tool_calls":
                if isinstance(value, list):
                    for call in value:
                        if isinstance(call, dict):
                            _add_tool_call(choice.tool_calls, call)
            elif key == "function_call":  # the deprecated single call: pieces like a tool call
                if isinstance(value, dict):
                    old = message.get(key)
                    fn = old if isinstance(old, dict) else {}
                    _add_function(fn, value)
                    message[key] = fn
            elif key == "role":
                if value is not None and message.get("role") is None:
                    message["role"] = value
            elif isinstance(value, str):
                old = message.get(key)
                if isinstance(old, _Pieces):
                    old.append(value)
                else:
                    message[key] = _Pieces((value,))
            elif value is not None or key not in message:
                message[key] = value

    def answer(self) -> dict[str, Any]:
        """The non-streamed answer: ``id``, ``object``, ``created``, ``model``, ``choices`` in
        ``index`` order, the other top-level members, ``usage`` (when the engine sent one)."""
        top = self._top
        out: dict[str, Any] = {
            "id": top.get("id"),
            "object": "chat.completion" if self._chat else "text_completion",
            "created": top.get("created"),
            "model": top.get("model"),
        }
        out.update((k, v) for k, v in top.items() if k not in out)
        out["choices"] = [self._choice(i, c) for i, c in sorted(self._choices.items())]
        if self._usage is not None:
            out["usage"] = self._usage
        return out

    def _choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        out: dict[str, Any] = {"index": index}
        if self._chat:
            message: dict[str, Any] = {"role": "assistant", "content": None}
            message.update((k, _joined(v)) for k, v in choice.message.items())
            fn = message.get("function_call")
            if isinstance(fn, dict):
                message["function_call"] = {k: _joined(v) for k, v in fn.items()}
            if choice.tool_calls:
                message["tool_calls"] = [
                    _finish_tool_call(c) for _, c in sorted(choice.tool_calls.items())
                ]
            out["message"] = message
        else:
            out["text"] = "".join(choice.text)
        out["logprobs"] = choice.logprobs
        out["finish_reason"] = choice.finish_reason
        out.update(choice.extra)
        return out


def _merge_logprobs(into: dict[str, Any], part: dict[str, Any]) -> None:
    """Concatenate the list members of a chunk's ``logprobs`` onto ``into`` (other members:
    the last non-null value)."""
    for key, value in part.items():
        old = into.get(key)
        if isinstance(value, list):
            if isinstance(old, list):
                old.extend(value)
            else:
                into[key] = list(value)
        elif value is not None or key not in into:
            into[key] = value


def _add_tool_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    """Add one tool-call delta (``index``, then ``id``, ``type``, ``function.name`` once and
    ``function.arguments`` in pieces) to the calls being built."""
    index = delta.get("index", 0)
    if type(index) is not int:
        return
    call = calls.get(index)
    if call is None:
        call = calls[index] = {"id": None, "type": None, "function": {}}
    for key, value in delta.items():
        if key == "index":
            continue
        if key == "function":
            if isinstance(value, dict):
                _add_function(call["function"], value)
        elif value is not None and call.get(key) is None:
            call[key] = value


def _add_function(fn: dict[str, Any], delta: dict[str, Any]) -> None:
    """``name`` taken once, ``arguments`` concatenated."""
    for key, value in delta.items():
        if key == "arguments" and isinstance(value, str):
            old = fn.get("arguments")
            if isinstance(old, _Pieces):
                old.append(value)
            else:
                fn["arguments"] = _Pieces((value,))
        elif value is not None and fn.get(key) is None:
            fn[key] = value


def _finish_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = {"name": None, "arguments": ""}
    fn.update((k, _joined(v)) for k, v in call["function"].items())
    return {**call, "type": call["type"] or "function", "function": fn}


#: The Responses events that end a stream with the whole ``response`` object.
_RESPONSES_TERMINAL = frozenset({"response.completed", "response.incomplete"})
#: the Responses events whose ``delta`` is generated text (those the stream relay counts)
_RESPONSES_DELTAS = frozenset(RESPONSES_TEXT_EVENTS)


class ResponsesAssembler(Assembler):
    """Rebuilds a non-streamed Responses answer (``object: response``, OpenAI's Responses API,
    as vLLM, SGLang and llama.cpp's server stream it): the ``response`` object of the terminal
    ``response.completed`` / ``response.incomplete`` event is the whole answer (its ``output``
    items and ``usage``). A ``response.failed`` event (its ``response.error``) or an ``error``
    event sets :attr:`error`. Until the terminal event, the text of the ``delta`` events is
    kept, so that a stream cut before it (the client gone, the engine broken) is charged the
    text generated so far (:meth:`answer`); nothing else of the other events is kept."""

    __slots__ = ("_deltas", "_response")

    def __init__(self) -> None:
        super().__init__()
        self._response: dict[str, Any] | None = None
        self._deltas: list[str] = []

    def add(self, event: Any) -> None:
        """Take one parsed event (a JSON object with a ``type``; anything else is ignored)."""
        if not isinstance(event, dict):
            return
        kind = event.get("type")
        if not isinstance(kind, str):  # (a list here raised TypeError: a 500 in the relay)
            return
        response = event.get("response")
        if kind in _RESPONSES_DELTAS and self._response is None:
            delta = event.get("delta")
            if isinstance(delta, str):
                self._deltas.append(delta)
        elif kind in _RESPONSES_TERMINAL and isinstance(response, dict):
            self._response = response
            self._deltas = []  # the response holds the text now
            self.complete = True
        elif kind == "response.failed":
            self.complete = True
            err = response.get("error") if isinstance(response, dict) else None
            self.error = err if isinstance(err, dict) else {"message": "response failed"}
        elif kind == "error":  # {"type": "error", "code", "message", "param"}
            inner = event.get("error")
            fields = inner if isinstance(inner, dict) else event
            self.error = {k: fields.get(k) for k in ("message", "param", "code")}

    def answer(self) -> dict[str, Any]:
        """The terminal event's ``response`` object; before it arrived, ``{}``, or an answer of
        one message holding the text of the ``delta`` events so far (what a cut stream is
        charged)."""
        if self._response is not None:
            return self._response
        if not self._deltas:
            return {}
        text = "".join(self._deltas)
        return {"output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}
