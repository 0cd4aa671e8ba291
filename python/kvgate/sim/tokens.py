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

    def __init__(self, tokenizer_path: str | None = None, chat_template: str | None = None) -> None:
        """Load ``tokenizer_path`` if given; ``chat_template`` (Jinja text) renders chat
        prompts (see :meth:`count_chat`)."""
        self._tok: Any = None
        self._chat: Any = None
        if chat_template is not None:
            from kvgate._core import MAX_AMOUNT, RequestAnalyzer

            try:
                # kvgate's own renderer (minijinja, HuggingFace's apply_chat_template rules)
                self._chat = RequestAnalyzer(
                    model="sim",
                    context_window=MAX_AMOUNT,
                    tokenizer_path=tokenizer_path,
                    chat_template=chat_template,
                )
            except ValueError as exc:
                raise ValueError(f"cannot use the chat template: {exc}") from exc
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

    def count_chat(self, messages: Sequence[dict[str, Any]]) -> int | None:
        """Prompt tokens of chat ``messages`` through the configured chat template: the
        rendered text counted without adding special tokens (the template writes them), as
        vLLM does; ``None`` without a template.

        Raises:
            ValueError: the template cannot render these messages (the engine's 400).
        """
        if self._chat is None:
            return None
        import orjson

        from kvgate._core import AnalysisError

        body = orjson.dumps({"model": "sim", "messages": list(messages), "max_tokens": 1})
        try:
            return int(self._chat.analyze("/v1/chat/completions", body).prompt_tokens)
        except AnalysisError as exc:
            raise ValueError(str(exc)) from exc

    def token_ids(self, text: str) -> list[int] | None:
        """The token ids of ``text`` with the tokenizer file (special tokens added, as
        :meth:`count` counts them); ``None`` without one."""
        if self._tok is None:
            return None
        return list(self._tok.encode(text).ids)

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
