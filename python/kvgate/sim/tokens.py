"""Prompt token counting for the simulator: the model's tokenizer file, or a cheap estimate."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


class TokenCounter:
    """Counts prompt tokens.

    With ``tokenizer_path`` (a HuggingFace ``tokenizer.json``, loaded with the ``tokenizers``
    package) the count is exact for that tokenizer (special tokens included, as the engine's
    ``add_special_tokens`` default does); without it, ``ceil(UTF-8 bytes / 4)`` (the usual
    "about four characters per token" rule for English), at least 1 for non-empty text.

    Raises:
        ValueError: the tokenizer file cannot be loaded (or ``tokenizers`` is not installed).
    """

    def __init__(self, tokenizer_path: str | None = None) -> None:
        """Load ``tokenizer_path`` if given."""
        self._tok: Any = None
        if tokenizer_path is not None:
            try:
                from tokenizers import Tokenizer
            except ImportError as exc:  # pragma: no cover - depends on the environment
                raise ValueError("--tokenizer needs the 'tokenizers' package") from exc
            try:
                self._tok = Tokenizer.from_file(tokenizer_path)
            except Exception as exc:
                raise ValueError(f"cannot load tokenizer {tokenizer_path!r}: {exc}") from exc

    @property
    def exact(self) -> bool:
        """True when a tokenizer file is in use."""
        return self._tok is not None

    def count(self, text: str) -> int:
        """Tokens in ``text`` (0 for the empty string)."""
        if not text:
            return 0
        if self._tok is not None:
            return len(self._tok.encode(text).ids)
        return math.ceil(len(text.encode("utf-8")) / 4)


def render_chat(messages: Sequence[dict[str, Any]]) -> str:
    """Flatten chat messages into the text the simulator counts as the prompt.

    The template is a fixed, model-neutral one: ``<|role|>\\ncontent\\n`` per message and a
    trailing ``<|assistant|>\\n`` generation prompt. ``content`` may be a string, ``None``, or a
    list of parts whose ``text`` fields are joined (image and audio parts add nothing). Tool-call
    arguments of assistant messages are included as text.
    """
    out: list[str] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            text = "".join(
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            )
        elif isinstance(content, str):
            text = content
        else:
            text = ""
        for call in m.get("tool_calls") or ():
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            text += f"{fn.get('name', '')}({fn.get('arguments', '')})"
        out.append(f"<|{m.get('role', '')}|>\n{text}\n")
    out.append("<|assistant|>\n")
    return "".join(out)
