"""What a finished request is charged when the engine's answer does not carry usage: the
completion is counted from the answer's text, never free (DESIGN.md: "an overrun is charged
(never silently free)"; README "How a request is admitted", step 5)."""

from __future__ import annotations

import math

import openai
import orjson

from .conftest import config_for
from .fake_upstream import run_upstream


async def test_non_streamed_answer_without_usage_is_charged_from_its_text(gateway_for) -> None:
    async with run_upstream() as up, gateway_for(config_for(up.url, ["nousage"])) as gw:
        messages = [{"role": "user", "content": "tell me something"}]
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            answer = await client.chat.completions.create(
                model="nousage", messages=messages, max_tokens=50, n=2
            )
        assert answer.usage is None
        assert up.requests[-1]["n"] == 2
        body = orjson.dumps({"model": "nousage", "messages": messages, "max_tokens": 50, "n": 2})
        _, analysis = gw.gateway.analyze_now("/v1/chat/completions", body)
        # both choices' text: 12 words and a tool call, 69 bytes = 18 tokens by the byte estimate
        # the gateway uses without a tokenizer
        text = "word " * 12 + "f" + '{"a": 1}'
        assert answer.choices[0].message.content + "f" + '{"a": 1}' == text
        completion = math.ceil(len(text.encode()) / 4)
        m = gw.gateway.metrics
        m.flush()
        charged = m.tenant_tokens.labels("anonymous")._value.get()
        assert charged == analysis.prompt_tokens + completion
        reserved = m.tokens_reserved.labels("b0")._value.get()
        assert reserved == analysis.prompt_tokens + 2 * 50
        assert m.tokens_refunded.labels("b0")._value.get() == reserved - charged
        state = gw.backend_state()
        assert state["in_use"] == 0
        assert state["inflight_tokens"] == 0
