"""Server-sent events relay bookkeeping: split, inspect, optionally strip, never re-frame.

The gateway writes upstream bytes to the client event by event, exactly as the engine framed
them (``data: <json>\\n\\n``, docs/engines.md §4). While doing so it reads what it needs to settle
the token account: the ``usage`` object (on a ``choices: []`` chunk for OpenAI/vLLM, on the
``finish_reason`` chunk for llama.cpp), the text delivered so far (for a stream that breaks or
whose engine sends no usage), and ``error`` events. The work is done per streamed chunk, so it
lives in the Rust core (``rust/src/sse.rs``); see :class:`kvgate._core.SSEInspector`.
"""

from __future__ import annotations

from kvgate._core import SSEInspector

__all__ = ["SSEInspector"]
