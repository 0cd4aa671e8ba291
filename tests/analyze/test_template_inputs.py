"""What the chat body sets for the template (``chat_template_kwargs``, ``add_generation_prompt``,
``continue_final_message``), template files, numbers past a field's range, lone surrogate
escapes, and the memory a huge unbroken prompt costs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from tokenizers import Tokenizer

import kvgate

from .conftest import CHATML, ref_overhead_count, ref_template_count

CHAT = "/v1/chat/completions"
# Qwen3-style switch: with enable_thinking false the template writes an empty think block.
THINKING = CHATML.replace(
    "{{ '<|im_start|>assistant\\n' }}",
    "{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}",
)


def body(**extra: Any) -> bytes:
    messages = [{"role": "user", "content": "the quick brown fox"}]
    return orjson.dumps({"model": "m", "messages": messages, **extra})


@pytest.fixture(scope="module")
def thinking(model_dir: Path) -> kvgate.RequestAnalyzer:
    return kvgate.RequestAnalyzer(
        model="m",
        context_window=100_000,
        tokenizer_path=str(model_dir / "tokenizer.json"),
        chat_template=THINKING,
    )


def test_chat_template_kwargs_reach_the_template(
    thinking: kvgate.RequestAnalyzer, ref_tok: Tokenizer
) -> None:
    plain = thinking.analyze(CHAT, body()).prompt_tokens
    off = thinking.analyze(CHAT, body(chat_template_kwargs={"enable_thinking": False}))
    on = thinking.analyze(CHAT, body(chat_template_kwargs={"enable_thinking": True}))
    extra = len(ref_tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert off.prompt_tokens == plain + extra
    assert on.prompt_tokens == plain
    assert thinking.analyze(CHAT, body(chat_template_kwargs=None)).prompt_tokens == plain


def test_generation_prompt_and_continued_message(
    template_analyzer: kvgate.RequestAnalyzer, ref_tok: Tokenizer
) -> None:
    messages = [
        {"role": "user", "content": "tell a story"},
        {"role": "assistant", "content": "Once upon a time"},
    ]
    full = {"model": "m", "messages": messages}
    with_prompt = template_analyzer.analyze(CHAT, orjson.dumps(full)).prompt_tokens
    assert with_prompt == ref_template_count(ref_tok, full)
    no_prompt = template_analyzer.analyze(
        CHAT, orjson.dumps({**full, "add_generation_prompt": False})
    ).prompt_tokens
    gen = len(ref_tok.encode("<|im_start|>assistant\n", add_special_tokens=False))
    assert no_prompt == with_prompt - gen
    # continued: the prompt ends right after "Once upon a time" (no <|im_end|>\n, no new turn)
    continued = template_analyzer.analyze(
        CHAT, orjson.dumps({**full, "continue_final_message": True})
    ).prompt_tokens
    text = "<|im_start|>user\ntell a story<|im_end|>\n<|im_start|>assistant\nOnce upon a time"
    assert continued == len(ref_tok.encode(text, add_special_tokens=False))
    with pytest.raises(kvgate.AnalysisError) as info:
        template_analyzer.analyze(
            CHAT,
            orjson.dumps({**full, "continue_final_message": True, "add_generation_prompt": True}),
        )
    assert (info.value.status, info.value.param, info.value.code) == (
        400,
        "continue_final_message",
        "invalid_value",
    )
    for field, value in [("chat_template_kwargs", [1]), ("add_generation_prompt", "yes")]:
        with pytest.raises(kvgate.AnalysisError) as info:
            template_analyzer.analyze(CHAT, orjson.dumps({**full, field: value}))
        assert (info.value.param, info.value.code) == (field, "invalid_type")


def test_chat_template_path_is_read_and_errors_name_it(
    tmp_path: Path, model_dir: Path, ref_tok: Tokenizer
) -> None:
    path = tmp_path / "chat_template.jinja"
    path.write_text(CHATML)
    a = kvgate.RequestAnalyzer(
        model="m",
        context_window=100_000,
        tokenizer_path=str(model_dir / "tokenizer.json"),
        chat_template_path=str(path),
    )
    full = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    r = a.analyze(CHAT, orjson.dumps(full))
    assert (r.counting, r.prompt_tokens) == ("chat_template", ref_template_count(ref_tok, full))
    path.write_text("{% for m in messages %}\n{{ m.content | no_such_filter }}\n{% endfor %}")
    with pytest.raises(ValueError, match=rf"{path}:2"):
        kvgate.RequestAnalyzer(model="m", context_window=10, chat_template_path=str(path))
    with pytest.raises(FileNotFoundError, match=f"chat_template_path {tmp_path / 'nope'}"):
        kvgate.RequestAnalyzer(
            model="m", context_window=10, chat_template_path=str(tmp_path / "nope")
        )
    with pytest.raises(ValueError, match="not both"):
        kvgate.RequestAnalyzer(
            model="m", context_window=10, chat_template="x", chat_template_path=str(path)
        )


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n", "best_of"])
@pytest.mark.parametrize("number", [b"99999999999999999999999", b"1e30"])
def test_numbers_past_the_range_name_the_bound(
    overhead_analyzer: kvgate.RequestAnalyzer, field: str, number: bytes
) -> None:
    raw = b'{"model": "m", "prompt": "x", "%s": %s}' % (field.encode(), number)
    with pytest.raises(kvgate.AnalysisError) as info:
        overhead_analyzer.analyze("/v1/completions", raw)
    err = info.value
    assert (err.status, err.param, err.code) == (400, field, "integer_above_max_value")
    bound = 128 if field in ("n", "best_of") else 2**62
    assert f"Expected a value <= {bound}" in err.message
    assert "decimal" not in err.message


def test_lone_surrogates_are_counted_as_the_replacement_character(
    overhead_analyzer: kvgate.RequestAnalyzer, ref_tok: Tokenizer
) -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b \\udc00"}]}'
    r = overhead_analyzer.analyze(CHAT, raw)
    expected = {"model": "m", "messages": [{"role": "user", "content": "a\ufffdb \ufffd"}]}
    assert r.prompt_tokens == ref_overhead_count(ref_tok, expected)
    assert json.loads(raw)["messages"][0]["content"] == "a\ud800b \udc00"  # Python accepts it
    assert kvgate.peek_model(raw) == "m"


def test_long_text_counts_stay_exact(
    ref_tok: Tokenizer, overhead_analyzer: kvgate.RequestAnalyzer
) -> None:
    """Texts over 16 KiB are counted in segments cut before a space between words: the count
    of ordinary text is still exactly the tokenizer's."""
    words = "the quick brown fox jumps over 12 lazy dogs, and the KV cache stays below 0.9! "
    for text in (words * 2000, ("请求分析 " + words) * 1000):
        b = {"model": "m", "messages": [{"role": "user", "content": text}]}
        assert overhead_analyzer.analyze(CHAT, orjson.dumps(b)).prompt_tokens == (
            ref_overhead_count(ref_tok, b)
        )


MEASURE = """
import resource, sys, orjson, kvgate
a = kvgate.RequestAnalyzer(model="m", context_window=10**9, tokenizer_path=sys.argv[1])
body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "a" * 3_000_000}]})
a.analyze("/v1/chat/completions", b'{"model":"m","messages":[{"role":"user","content":"hi"}]}')
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
r = a.analyze("/v1/chat/completions", body)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(r.prompt_tokens, (after - before) // 1024)
"""


def test_huge_unbroken_prompt_costs_no_memory_spike(model_dir: Path, ref_tok: Tokenizer) -> None:
    """3 MB of one character in one message: counted whole, the tokenizer's working copies
    took about 370 MB; counted in segments, a few MB. Measured in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(model_dir / "tokenizer.json")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    tokens, growth_mib = map(int, done.stdout.split())
    assert growth_mib < 100, f"peak RSS grew by {growth_mib} MiB"
    exact = len(ref_tok.encode("a" * 3_000_000, add_special_tokens=False)) + 4
    # an upper bound: at most a few tokens more per 16 KiB segment
    assert exact <= tokens <= exact + 4 * (3_000_000 // 16_384 + 1)
