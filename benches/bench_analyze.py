"""Request analysis: the Rust analyser versus the same work in Python, side by side.

- ``analyze-32k`` group: one ~32k-token chat body (64 messages of English, CJK, emoji and code).
  Rust: ``RequestAnalyzer.analyze`` (JSON parse + field checks + tokenizer count + context
  check), without and with a chat template. Python: ``orjson.loads`` + walking the messages +
  ``tokenizers.Tokenizer.encode_batch`` on the same tokenizer, the no-template counting rule.
- ``prereject`` group: a request announcing ``Content-Length: 134217728`` (128 MiB) sent to a
  real aiohttp server on loopback whose handler calls ``check_content_length`` before reading;
  the 413 comes back although not one body byte was sent.

Run: ``.venv/bin/python -m pytest benches/bench_analyze.py --benchmark-enable
--benchmark-disable-gc --benchmark-columns=min,median,ops -q``. ``make bench``
(``benches/core_results.py``) runs it and writes the figures into benches/RESULTS.md.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import kvgate

CHAT = "/v1/chat/completions"
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = [
    "admission",
    "gateway",
    "tokens",
    "engine",
    "cache",
    "memory",
    "request",
    "stream",
    "latency",
    "prefill",
    "decode",
    "batch",
    "tenant",
    "priority",
    "window",
    "context",
    "budget",
    "reservation",
    "refund",
    "bucket",
    "slots",
    "watermark",
]
CJK = "请求分析在网关中完成令牌桶并发槽位预留上下文窗口模型推理服务"
EMOJI = "😀🚀🔥✨👍🏽👩‍💻"
CODE = 'def f(x):\n    return {"k": [x, x * 2]}\n'


def text(rng: random.Random, n_words: int) -> str:
    parts = []
    for _ in range(n_words):
        k = rng.randrange(10)
        if k < 6:
            parts.append(rng.choice(WORDS))
        elif k < 8:
            parts.append("".join(rng.choice(CJK) for _ in range(4)))
        elif k < 9:
            parts.append(rng.choice(EMOJI))
        else:
            parts.append(CODE)
    return " ".join(parts)


def corpus() -> Iterator[str]:
    rng = random.Random(1)
    for _ in range(4000):
        yield text(rng, 30)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d: Path = tmp_path_factory.mktemp("bench-model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4000,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    path = d / "tokenizer.json"
    tok.save(str(path))
    rng = random.Random(2)
    messages = []
    while True:
        messages.append({"role": "user" if len(messages) % 2 == 0 else "assistant", "content": ""})
        messages[-1]["content"] = text(rng, 300)
        body = {"model": "m", "messages": messages, "max_tokens": 512}
        total = sum(len(e) for e in tok.encode_batch([m["content"] for m in messages]))
        if total >= 32_000:
            break
    raw = orjson.dumps(body)
    plain = kvgate.RequestAnalyzer(model="m", context_window=131_072, tokenizer_path=str(path))
    templated = kvgate.RequestAnalyzer(
        model="m", context_window=131_072, tokenizer_path=str(path), chat_template=CHATML
    )
    return {"tok": tok, "body": raw, "plain": plain, "templated": templated, "tokens": total}


def python_count(tok: Tokenizer, body: bytes) -> int:
    """The Python baseline: orjson + walk + encode_batch, the no-template counting rule."""
    obj = orjson.loads(body)
    texts = []
    for m in obj["messages"]:
        c = m.get("content")
        if isinstance(c, str):
            texts.append(c)
        elif isinstance(c, list):
            texts.append("\n".join(p["text"] for p in c if p.get("type") == "text"))
    encs = tok.encode_batch(texts, add_special_tokens=False)
    return sum(len(e) for e in encs) + 4 * len(obj["messages"])


def test_rust_analyze_32k(benchmark: Any, setup: dict[str, Any]) -> None:
    benchmark.group = "analyze-32k"
    r = benchmark(setup["plain"].analyze, CHAT, setup["body"])
    assert r.prompt_tokens == python_count(setup["tok"], setup["body"])
    assert r.prompt_tokens >= 32_000
    benchmark.extra_info.update(
        prompt_tokens=r.prompt_tokens,
        body_bytes=len(setup["body"]),
        messages=len(orjson.loads(setup["body"])["messages"]),
    )


def test_rust_analyze_32k_chat_template(benchmark: Any, setup: dict[str, Any]) -> None:
    benchmark.group = "analyze-32k"
    r = benchmark(setup["templated"].analyze, CHAT, setup["body"])
    assert r.counting == "chat_template"


def test_python_orjson_encode_batch_32k(benchmark: Any, setup: dict[str, Any]) -> None:
    benchmark.group = "analyze-32k"
    n = benchmark(python_count, setup["tok"], setup["body"])
    assert n >= 32_000


@pytest.fixture(scope="module")
def capped_server() -> Iterator[int]:
    """An aiohttp server whose handler pre-rejects from Content-Length before reading."""
    cap = 32 * 1024 * 1024
    started = threading.Event()
    state: dict[str, Any] = {}

    async def handler(request: web.Request) -> web.Response:
        try:
            kvgate.check_content_length(request.content_length, cap)
        except kvgate.AnalysisError as err:
            return web.Response(
                status=err.status, body=err.to_json(), content_type="application/json"
            )
        await request.read()
        return web.Response(text="read")

    async def main() -> None:
        app = web.Application()
        app.router.add_post(CHAT, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        state["port"] = runner.addresses[0][1]
        state["stop"] = asyncio.Event()
        started.set()
        await state["stop"].wait()
        await runner.cleanup()

    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    t.start()
    started.wait(10)
    yield state["port"]
    loop.call_soon_threadsafe(state["stop"].set)
    t.join(10)
    loop.close()


def prereject_once(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 134217728\r\n\r\n"
        )
        return s.recv(4096)


def test_prereject_128mb_content_length(benchmark: Any, capped_server: int) -> None:
    benchmark.group = "prereject"
    reply = benchmark(prereject_once, capped_server)
    assert reply.startswith(b"HTTP/1.1 413")
    assert b"request_too_large" in reply
    benchmark.extra_info.update(content_length=134_217_728, body_bytes_sent=0, status=413)


def test_check_content_length_call(benchmark: Any) -> None:
    benchmark.group = "prereject"

    def call() -> int:
        try:
            kvgate.check_content_length(134_217_728, 32 * 1024 * 1024)
        except kvgate.AnalysisError as err:
            return err.status
        return 200

    assert benchmark(call) == 413
