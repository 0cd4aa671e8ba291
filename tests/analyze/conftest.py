"""Fixtures for the request-analysis tests: a small byte-level BPE trained here (nothing is
downloaded) and a ChatML-style chat template, plus reference counters built on the Python
``tokenizers`` package that implement the documented counting rules independently."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

import kvgate

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "requests"

# ChatML as many HF repos ship it (content guarded so a null content renders as nothing, the
# same in Jinja2 and minijinja).
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message.tool_calls %}{{ message.tool_calls | tojson }}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if tools %}{{ '<|im_start|>tools\\n' + (tools | tojson) + '<|im_end|>\\n' }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus(seed: int = 7) -> Iterator[str]:
    """English, CJK, emoji and code lines, deterministic."""
    rng = random.Random(seed)
    english = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "the",
        "lazy",
        "dog",
        "while",
        "admission",
        "control",
        "keeps",
        "the",
        "engine",
        "busy",
        "and",
        "the",
        "KV",
        "cache",
        "below",
        "its",
        "high",
        "watermark",
        "for",
        "every",
        "tenant",
    ]
    cjk = "请求分析在网关中完成令牌桶并发槽位预留上下文窗口模型推理服务日本語のテキストも少し含む"
    emoji = "😀🚀🔥✨👍🏽🇯🇵👩‍💻"
    code = [
        "def f(x):\n    return x * 2\n",
        "for (int i = 0; i < n; ++i) { sum += a[i]; }",
        'fn main() { println!("{}", 42); }',
        "SELECT id, name FROM users WHERE age > 30;",
        '{"key": [1, 2, 3], "nested": {"a": null}}',
    ]
    for _ in range(3000):
        kind = rng.randrange(4)
        if kind == 0:
            yield " ".join(rng.choice(english) for _ in range(rng.randint(5, 20)))
        elif kind == 1:
            yield "".join(rng.choice(cjk) for _ in range(rng.randint(5, 30)))
        elif kind == 2:
            yield " ".join(rng.choice(english) + rng.choice(emoji) for _ in range(5))
        else:
            yield rng.choice(code)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with ``tokenizer.json`` (byte-level BPE, vocab 1000, BOS post-processor,
    truncation set to 16 to prove it is switched off) and ``tokenizer_config.json``."""
    d = tmp_path_factory.mktemp("model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.enable_truncation(16)
    tok.save(str(d / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHATML}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="session")
def ref_tok(model_dir: Path) -> Tokenizer:
    """The same tokenizer through the Python package, truncation off."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_truncation()
    return tok


@pytest.fixture(scope="session")
def overhead_analyzer(model_dir: Path) -> kvgate.RequestAnalyzer:
    return kvgate.RequestAnalyzer(
        model="m", context_window=100_000, tokenizer_path=str(model_dir / "tokenizer.json")
    )


@pytest.fixture(scope="session")
def template_analyzer(model_dir: Path) -> kvgate.RequestAnalyzer:
    return kvgate.RequestAnalyzer(
        model="m",
        context_window=100_000,
        tokenizer_path=str(model_dir / "tokenizer.json"),
        tokenizer_config_path=str(model_dir / "tokenizer_config.json"),
    )


def content_text(content: Any) -> tuple[str | None, int]:
    """(text, media parts): text parts joined by newline, images/audio counted."""
    if content is None or isinstance(content, str):
        return content, 0
    texts, media = [], 0
    for part in content:
        if part["type"] in ("text", "input_text"):
            texts.append(part["text"])
        elif part["type"] == "refusal":
            texts.append(part["refusal"])
        elif part["type"] in ("image_url", "input_image", "image"):
            media += 765
        else:
            media += 200
    return "\n".join(texts), media


def ref_overhead_count(tok: Tokenizer, body: dict[str, Any], overhead: int = 4) -> int:
    """The documented no-template rule, computed with the Python tokenizers package."""
    pieces: list[str] = []
    media = 0
    for m in body["messages"]:
        text, cost = content_text(m.get("content"))
        media += cost
        if text is not None:
            pieces.append(text)
        if m.get("name") is not None:
            pieces.append(m["name"])
        for key in ("tool_calls", "function_call"):
            if m.get(key) is not None:
                pieces.append(orjson.dumps(m[key]).decode())
    for key in ("tools", "functions"):
        if body.get(key):
            pieces.append(orjson.dumps(body[key]).decode())
    encs = tok.encode_batch(pieces, add_special_tokens=False) if pieces else []
    return sum(len(e) for e in encs) + media + overhead * len(body["messages"])


def ref_chatml_text(body: dict[str, Any]) -> tuple[str, int]:
    """The ChatML template rendered by hand, like Jinja2 would (tojson = json.dumps)."""
    out, media = [], 0
    for m in body["messages"]:
        text, cost = content_text(m.get("content"))
        media += cost
        out.append(f"<|im_start|>{m['role']}\n{text or ''}")
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                c = dict(c)
                fn = dict(c["function"])
                try:
                    parsed = json.loads(fn["arguments"])
                    if isinstance(parsed, dict):
                        fn["arguments"] = parsed
                except (ValueError, TypeError):
                    pass
                c["function"] = fn
                calls.append(c)
            out.append(json.dumps(calls, ensure_ascii=False))
        out.append("<|im_end|>\n")
    if body.get("tools"):
        out.append(
            f"<|im_start|>tools\n{json.dumps(body['tools'], ensure_ascii=False)}<|im_end|>\n"
        )
    out.append("<|im_start|>assistant\n")
    return "".join(out), media


def ref_template_count(tok: Tokenizer, body: dict[str, Any]) -> int:
    text, media = ref_chatml_text(body)
    return len(tok.encode(text, add_special_tokens=False)) + media


def fixture_bodies(prefix: str) -> list[Path]:
    return sorted(FIXTURES.glob(f"*{prefix}*.json"))
