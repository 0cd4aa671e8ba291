"""Build a non-streamed answer from the stream the engine sent instead (no I/O here).

kvgate forwards a request whose client did not ask for streaming to the engine as a stream
(``"stream": true``, and ``stream_options.include_usage`` on chat and completions) so that the
engine notices at its next token write when the request is abandoned: llama.cpp's server checks a
non-streaming client only when no other result arrived for a second, and every ``/metrics`` or
``/slots`` answer resets that wait, so a non-streamed request whose client left keeps generating
to ``max_tokens``. The client still gets the one JSON body the engine would have sent:
:class:`StreamAssembler` (Rust, ``rust/src/assemble.rs``) cuts the engine's SSE bytes into
their events and merges them into that body — chat completions and legacy completions from
their chunks, OpenAI's Responses API from its terminal event.

Only the answer being built is kept (its text, logprobs and tool-call pieces, each once), never
the events themselves. The merge was first written in Python; that version is kept as the
tests' reference (``tests/gateway/assemble_reference.py``), which the Rust one must match on any
stream. In Rust it costs a few µs a request instead of about 40. Where the two JSON readers
differ, an event is read as serde_json reads it: an integer written ``-0`` is the float ``-0.0``
(so a choice ``"index": -0`` is not a choice), and an event nested deeper than 128 levels is
skipped like one that is not JSON (orjson allows 1,024); no engine sends either.
"""

from __future__ import annotations

from kvgate._core import EVENT_LIMIT, StreamAssembler

__all__ = ["EVENT_LIMIT", "StreamAssembler", "stream_kind"]


def stream_kind(route: str) -> str:
    """The :class:`StreamAssembler` kind of an inference route's stream: ``responses`` for
    ``/v1/responses``, ``chat`` for ``/v1/chat/completions``, else ``completions``."""
    if route.endswith("/responses"):
        return "responses"
    return "chat" if route.endswith("/chat/completions") else "completions"
