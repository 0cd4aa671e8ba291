"""Prompt counts and reservations checked against the Python ``tokenizers`` package, for every
body shape (chat with and without a chat template, completions, embeddings) and the real request
bodies in ``tests/fixtures/requests/``."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
from tokenizers import Tokenizer

import kvgate

from .conftest import (
    CHATML,
    corpus,
    fixture_bodies,
    ref_overhead_count,
    ref_template_count,
)

CHAT = "/v1/chat/completions"
TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog, twice.",
    "cjk": "请求分析在网关中完成。日本語のテキストも少し含む。",
    "emoji": "ship it 🚀🔥 then 👩‍💻 and 🇯🇵 👍🏽",
    "code": 'def f(x):\n    return {"k": [1, 2]}  # ok\n\tfor i in range(3): pass',
    "specials": "inline <|im_start|>user tokens</s> are split as specials",
}


def with_model(body: dict[str, Any]) -> bytes:
    return orjson.dumps({**body, "model": "m"})


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_chat_texts_both_modes(
    kind: str,
    ref_tok: Tokenizer,
    overhead_analyzer: kvgate.RequestAnalyzer,
    template_analyzer: kvgate.RequestAnalyzer,
) -> None:
    body = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": TEXTS[kind], "name": "ana"},
        ]
    }
    a = overhead_analyzer.analyze(CHAT, with_model(body))
    assert a.counting == "overhead"
    assert a.prompt_tokens == ref_overhead_count(ref_tok, body)
    t = template_analyzer.analyze(CHAT, with_model(body))
    assert t.counting == "chat_template"
    assert t.prompt_tokens == ref_template_count(ref_tok, body)
    # The template adds role markers, so it can never be cheaper than the content alone.
    assert t.prompt_tokens > len(ref_tok.encode(TEXTS[kind], add_special_tokens=False))


@pytest.mark.parametrize("path", fixture_bodies("chat"), ids=lambda p: p.stem)
def test_chat_fixtures_both_modes(
    path: Path,
    ref_tok: Tokenizer,
    overhead_analyzer: kvgate.RequestAnalyzer,
    template_analyzer: kvgate.RequestAnalyzer,
) -> None:
    body = orjson.loads(path.read_bytes())
    a = overhead_analyzer.analyze(CHAT, with_model(body))
    assert a.prompt_tokens == ref_overhead_count(ref_tok, body)
    t = template_analyzer.analyze(CHAT, with_model(body))
    assert t.prompt_tokens == ref_template_count(ref_tok, body)
    n = body.get("n") or 1
    per_choice = body.get("max_completion_tokens") or body.get("max_tokens")
    for r in (a, t):
        assert r.n == n
        assert r.stream == bool(body.get("stream"))
        assert r.include_usage == bool((body.get("stream_options") or {}).get("include_usage"))
        expected = per_choice * n if per_choice else (100_000 - r.prompt_tokens) * n
        assert r.completion_tokens == expected
        assert r.reserved_tokens == r.prompt_tokens + r.completion_tokens
        assert r.inject_max_tokens is None


def test_fixture_n2_stream_include_usage(overhead_analyzer: kvgate.RequestAnalyzer) -> None:
    [path] = fixture_bodies("n2-stream-include-usage")
    r = overhead_analyzer.analyze(CHAT, with_model(orjson.loads(path.read_bytes())))
    assert (r.n, r.stream, r.include_usage) == (2, True, True)


@pytest.mark.parametrize("path", fixture_bodies("completions"), ids=lambda p: p.stem)
def test_completions_fixtures(
    path: Path, ref_tok: Tokenizer, overhead_analyzer: kvgate.RequestAnalyzer
) -> None:
    body = orjson.loads(path.read_bytes())
    r = overhead_analyzer.analyze("/v1/completions", with_model(body))
    assert r.counting == "tokenizer"
    # Raw prompts are encoded with the tokenizer's special tokens (BOS here), as engines do.
    assert r.prompt_tokens == len(ref_tok.encode(body["prompt"]))
    assert r.completion_tokens == body["max_tokens"]


def test_completions_prompt_forms(
    ref_tok: Tokenizer, overhead_analyzer: kvgate.RequestAnalyzer
) -> None:
    texts = list(TEXTS.values())
    r = overhead_analyzer.analyze(
        "/v1/completions", with_model({"prompt": texts, "max_tokens": 7, "n": 2, "best_of": 3})
    )
    assert r.prompt_tokens == sum(len(e) for e in ref_tok.encode_batch(texts))
    assert (r.n, r.completion_tokens) == (3, 7 * 3 * len(texts))
    ids = ref_tok.encode(texts[0]).ids
    r = overhead_analyzer.analyze("/v1/completions", with_model({"prompt": ids}))
    assert r.prompt_tokens == len(ids)
    assert r.completion_tokens == 100_000 - len(ids)
    r = overhead_analyzer.analyze("/v1/completions", with_model({"prompt": [ids, ids[:3]]}))
    assert r.prompt_tokens == len(ids) + 3


def test_embeddings(ref_tok: Tokenizer, overhead_analyzer: kvgate.RequestAnalyzer) -> None:
    [path] = fixture_bodies("embeddings")
    body = orjson.loads(path.read_bytes())
    r = overhead_analyzer.analyze("/v1/embeddings", with_model(body))
    assert r.prompt_tokens == len(ref_tok.encode(body["input"]))
    assert (r.completion_tokens, r.reserved_tokens, r.n) == (0, r.prompt_tokens, 1)
    texts = list(TEXTS.values())
    r = overhead_analyzer.analyze("/v1/embeddings", with_model({"input": texts}))
    assert r.prompt_tokens == sum(len(e) for e in ref_tok.encode_batch(texts))


def test_long_corpus_chat_matches(
    ref_tok: Tokenizer,
    overhead_analyzer: kvgate.RequestAnalyzer,
    template_analyzer: kvgate.RequestAnalyzer,
) -> None:
    lines = list(corpus(seed=99))[:400]
    body = {
        "messages": [
            {"role": "user" if i % 2 == 0 else "assistant", "content": line}
            for i, line in enumerate(lines)
        ]
    }
    assert overhead_analyzer.analyze(CHAT, with_model(body)).prompt_tokens == ref_overhead_count(
        ref_tok, body
    )
    assert template_analyzer.analyze(CHAT, with_model(body)).prompt_tokens == ref_template_count(
        ref_tok, body
    )


def test_default_max_tokens_injected(model_dir: Path) -> None:
    a = kvgate.RequestAnalyzer(
        model="m",
        context_window=1000,
        tokenizer_path=str(model_dir / "tokenizer.json"),
        default_max_tokens=256,
    )
    r = a.analyze(CHAT, with_model({"messages": [{"role": "user", "content": "hi"}], "n": 2}))
    assert r.inject_max_tokens == 256
    assert r.completion_tokens == 512
    r = a.analyze(
        CHAT, with_model({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9})
    )
    assert (r.inject_max_tokens, r.completion_tokens) == (None, 9)


def test_estimate_without_tokenizer() -> None:
    a = kvgate.RequestAnalyzer(model="m", context_window=1000, chat_template=CHATML)
    assert not a.has_tokenizer
    assert a.has_chat_template
    r = a.analyze(CHAT, with_model({"messages": [{"role": "user", "content": "abcdefgh"}]}))
    rendered = "<|im_start|>user\nabcdefgh<|im_end|>\n<|im_start|>assistant\n"
    assert r.counting == "estimate"
    assert r.prompt_tokens == -(-len(rendered.encode()) // 4)


def test_tokenizer_json_text_and_config_errors(model_dir: Path) -> None:
    text = (model_dir / "tokenizer.json").read_text()
    a = kvgate.RequestAnalyzer(model="m", context_window=10, tokenizer_json=text)
    assert a.has_tokenizer
    assert a.context_window == 10
    assert a.model == "m"
    with pytest.raises(ValueError, match="not both"):
        kvgate.RequestAnalyzer(
            model="m", context_window=10, tokenizer_json=text, tokenizer_path="x"
        )
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        kvgate.RequestAnalyzer(model="m", context_window=10, tokenizer_json="{}")
    with pytest.raises(ValueError, match="context_window"):
        kvgate.RequestAnalyzer(model="m", context_window=0)
    with pytest.raises(ValueError, match="chat template"):
        kvgate.RequestAnalyzer(model="m", context_window=10, chat_template="{% for %}")
    with pytest.raises(FileNotFoundError):
        kvgate.RequestAnalyzer(model="m", context_window=10, tokenizer_path="/nonexistent/t.json")


def test_registry_routes_by_model(model_dir: Path) -> None:
    tok = str(model_dir / "tokenizer.json")
    a = kvgate.RequestAnalyzer(model="a", context_window=100, tokenizer_path=tok)
    b = kvgate.RequestAnalyzer(model="b", context_window=200, max_body_bytes=1000)
    reg = kvgate.ModelRegistry([a, b])
    assert reg.models() == ["a", "b"]
    assert len(reg) == 2
    assert "a" in reg
    assert "c" not in reg
    assert reg.get("a") is a
    assert reg.get("c") is None
    assert reg.max_body_bytes == a.max_body_bytes
    body = {"model": "b", "messages": [{"role": "user", "content": "abcd"}]}
    r = reg.analyze(CHAT, orjson.dumps(body))
    assert (r.model, r.counting, r.reserved_tokens) == ("b", "estimate", 200)
    assert kvgate.peek_model(orjson.dumps(body)) == "b"
    with pytest.raises(ValueError, match="two analysers"):
        kvgate.ModelRegistry([a, a])


def test_threads_share_one_analyzer(template_analyzer: kvgate.RequestAnalyzer) -> None:
    """Many threads analysing at once (the GIL is released for large bodies) agree."""
    body = with_model({"messages": [{"role": "user", "content": TEXTS["cjk"] * 200}]})
    expected = template_analyzer.analyze(CHAT, body)
    results: list[kvgate.Analysis] = []

    def work() -> None:
        for _ in range(20):
            results.append(template_analyzer.analyze(CHAT, body))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 80
    assert all(r == expected for r in results)
