"""The SSE inspector's fast paths (LF-only separator search, text parsed only when asked) give
the same bytes, usage, errors and delivered text as a plain full parse of every event."""

from __future__ import annotations

import itertools
import re
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.proxy.sse import SSEInspector


def _reference(raw: bytes) -> tuple[dict[str, Any] | None, list[str], int, bool]:
    """(last non-null usage, text pieces, chunks with text, error seen) by parsing every event."""
    usage, text, chunks, error = None, [], 0, False
    for event in re.split(rb"\r\n\r\n|\n\n|\r\r", raw):
        for line in event.splitlines():
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            obj = orjson.loads(line[5:].strip())
            if isinstance(obj.get("error"), dict):
                error = True
            if isinstance(obj.get("usage"), dict):
                usage = obj["usage"]
            found = False
            for choice in obj.get("choices") or []:
                delta = choice.get("delta") or {}
                for piece in (choice.get("text"), delta.get("content"), delta.get("reasoning")):
                    if isinstance(piece, str) and piece:
                        text.append(piece)
                        found = True
            chunks += found
    return usage, text, chunks, error


def _event(obj: dict[str, Any], sep: bytes = b"\n\n", spaced: bool = False) -> bytes:
    body = orjson.dumps(obj)
    if spaced:  # how Python's json.dumps writes it: `"usage": null`
        body = body.replace(b'":', b'": ')
    return b"data: " + body + sep


def _chunk(content: str, usage: dict[str, int] | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": content}}], "usage": usage}


def test_text_of_a_stream_without_usage_is_collected_in_order() -> None:
    """llama.cpp-style: usage rides on the last content chunk, earlier chunks carry null."""
    raw = b"".join(
        [
            _event(_chunk("Hel")),
            _event(_chunk("lo"), spaced=True),
            _event(_chunk(" there", {"prompt_tokens": 3, "completion_tokens": 3})),
            _event(_chunk("!")),
            b"data: [DONE]\n\n",
        ]
    )
    insp = SSEInspector(strip_usage_chunk=False)
    assert insp.feed(raw) == raw
    assert insp.usage == {"prompt_tokens": 3, "completion_tokens": 3}
    assert insp.delivered_text == ["Hel", "lo", " there", "!"]
    assert insp.content_chunks == 4
    assert insp.done


def test_usage_and_error_words_inside_generated_text_are_only_text() -> None:
    text = 'the key is "usage": {"x": 1} and "error": {}'
    raw = _event(_chunk(text)) + b"data: [DONE]\n\n"
    insp = SSEInspector(strip_usage_chunk=True)
    # only the chunk's own top-level `"usage":null` is cut (stripping is on); the text is intact
    assert insp.feed(raw) == raw.replace(b',"usage":null}', b"}")
    assert orjson.dumps(text)[1:-1] in raw
    assert insp.usage is None
    assert insp.error is None
    assert insp.delivered_text == [text]


def test_spaced_usage_object_is_read_and_stripped() -> None:
    usage_event = _event({"choices": [], "usage": {"prompt_tokens": 1}}, spaced=True)
    raw = _event(_chunk("a"), spaced=True) + usage_event + b"data: [DONE]\n\n"
    insp = SSEInspector(strip_usage_chunk=True)
    assert insp.feed(raw) == raw.replace(usage_event, b"").replace(b',"usage": null}', b"}")
    assert insp.usage == {"prompt_tokens": 1}
    assert insp.delivered_text == ["a"]


def test_crlf_events_after_lf_events_are_still_split() -> None:
    first = _event(_chunk("a"))
    second = _event(_chunk("b"), sep=b"\r\n\r\n")
    insp = SSEInspector(strip_usage_chunk=False)
    assert insp.feed(first) == first
    assert insp.feed(second[:10]) == b""
    assert insp.feed(second[10:]) == second
    assert insp.delivered_text == ["a", "b"]


_piece = st.text(alphabet='ab "{}:\\usagerro\n', max_size=12)
_events = st.lists(
    st.one_of(
        st.builds(lambda t: _chunk(t), _piece),
        st.builds(lambda t: _chunk(t, {"prompt_tokens": 2, "completion_tokens": 1}), _piece),
        st.just({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 5}}),
        st.just({"error": {"message": "boom", "type": "server_error"}}),
    ),
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(
    _events,
    st.sampled_from([b"\n\n", b"\r\n\r\n"]),
    st.booleans(),
    st.lists(st.integers(min_value=1, max_value=400), max_size=8),
)
def test_any_stream_any_chunking_matches_a_full_parse(
    objs: list[dict[str, Any]], sep: bytes, spaced: bool, cuts: list[int]
) -> None:
    raw = b"".join(_event(o, sep, spaced) for o in objs) + b"data: [DONE]" + sep
    bounds = [0, *sorted({c for c in cuts if c < len(raw)}), len(raw)]
    insp = SSEInspector(strip_usage_chunk=False)
    out = b"".join(insp.feed(raw[a:b]) for a, b in itertools.pairwise(bounds)) + insp.flush()
    usage, text, chunks, error = _reference(raw)
    assert out == raw
    assert insp.usage == usage
    assert (insp.error is not None) == error
    assert insp.delivered_text == text
    assert insp.content_chunks == chunks


def test_feed_takes_bytes_only_and_hands_back_the_same_object() -> None:
    insp = SSEInspector(strip_usage_chunk=True)
    whole = _event({"choices": [{"index": 0, "delta": {"content": "hi"}}]})
    assert insp.feed(whole) is whole  # nothing held, nothing stripped: no copy
    with pytest.raises(TypeError):
        insp.feed("data: {}\n\n")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        insp.feed(bytearray(whole))  # type: ignore[arg-type]
    assert insp.delivered_text == ["hi"]
