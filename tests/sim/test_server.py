"""The simulator over loopback: the official ``openai`` client and raw aiohttp."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.sim import SimConfig, create_app, run_sim
from kvgate.sim.server import RunningSim

FAST = {"speed": 50.0}


def client(sim: RunningSim) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sim.base_url, api_key="unused", max_retries=0)


async def scrape(http: aiohttp.ClientSession, sim: RunningSim) -> dict[str, Any]:
    """``/metrics`` parsed with prometheus_client's text parser: {sample name: sample}."""
    async with http.get(sim.url + "/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    samples: dict[str, Any] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name
            if "finished_reason" in s.labels:
                key += "{" + s.labels["finished_reason"] + "}"
            samples[key] = s
    return samples


async def wait_for(predicate, *, attempts: int = 400, pause: float = 0.01) -> None:
    """Poll an async predicate (bounded); fail if it never holds."""
    for _ in range(attempts):
        if await predicate():
            return
        await asyncio.sleep(pause)
    raise AssertionError("condition never held")


async def test_chat_non_streaming_with_openai_client() -> None:
    async with run_sim(SimConfig.from_profile("tiny", **FAST)) as sim, client(sim) as c:
        r = await c.chat.completions.create(
            model="kvgate-sim-tiny",
            messages=[{"role": "user", "content": "Say hello in a few words."}],
            max_tokens=12,
        )
        assert r.object == "chat.completion"
        choice = r.choices[0]
        assert choice.message.role == "assistant"
        assert choice.message.content
        assert r.usage is not None
        assert 1 <= r.usage.completion_tokens <= 12
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert len(choice.message.content.split()) == r.usage.completion_tokens  # 1 word = 1 token
        assert choice.finish_reason == ("length" if r.usage.completion_tokens == 12 else "stop")
        models = await c.models.list()
        assert [m.id for m in models.data] == ["kvgate-sim-tiny"]
        assert models.data[0].model_extra["max_model_len"] == 1024


async def test_chat_streaming_with_usage_chunk() -> None:
    async with run_sim(SimConfig.from_profile("tiny", **FAST)) as sim, client(sim) as c:
        stream = await c.chat.completions.create(
            messages=[{"role": "user", "content": "Stream please."}],
            model="kvgate-sim-tiny",
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [ch async for ch in stream]
        *body, last = chunks
        assert last.choices == []
        assert last.usage is not None
        assert all(ch.usage is None for ch in body)
        assert body[0].choices[0].delta.role == "assistant"
        pieces = [ch.choices[0].delta.content for ch in body[1:]]
        assert len(pieces) == 9 == last.usage.completion_tokens
        assert body[-1].choices[0].finish_reason == "length"
        assert all(ch.object == "chat.completion.chunk" for ch in body)


async def test_streams_without_include_usage_or_with_no_usage_flag_carry_no_usage() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": True,
    }
    for cfg, extra in (
        (SimConfig.from_profile("tiny", **FAST), {}),
        (
            SimConfig.from_profile("tiny", no_usage=True, **FAST),
            {"stream_options": {"include_usage": True}},
        ),
    ):
        async with run_sim(cfg) as sim, aiohttp.ClientSession() as http:
            async with http.post(sim.base_url + "/chat/completions", json={**body, **extra}) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                raw = await r.read()
            events = [e for e in raw.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            for e in events[:-1]:
                obj = orjson.loads(e.removeprefix(b"data: "))
                assert "usage" not in obj
                assert obj["choices"]


async def test_legacy_completions_stream_and_defaults() -> None:
    async with run_sim(SimConfig.from_profile("tiny", **FAST)) as sim, client(sim) as c:
        r = await c.completions.create(
            model="kvgate-sim-tiny", prompt="Once upon a time", extra_body={"ignore_eos": True}
        )
        assert r.usage is not None
        assert r.usage.completion_tokens == 16
        assert r.choices[0].finish_reason == "length"
        multi = await c.completions.create(
            model="kvgate-sim-tiny", prompt=["a b c", "d e f g"], n=2, max_tokens=3
        )
        assert sorted(ch.index for ch in multi.choices) == [0, 1, 2, 3]
        stream = await c.completions.create(
            model="kvgate-sim-tiny",
            prompt=[1, 2, 3, 4, 5],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [ch async for ch in stream]
        assert chunks[-1].choices == []
        assert chunks[-1].usage.prompt_tokens == 5  # token ids count as they are
        assert chunks[-1].usage.completion_tokens == 5
        assert len("".join(ch.choices[0].text for ch in chunks[:-1]).split()) == 5
        assert chunks[-2].choices[0].finish_reason == "length"
        assert all(ch.object == "text_completion" for ch in chunks)


async def test_usage_matches_the_blocks_held_while_streaming() -> None:
    cfg = SimConfig.from_profile("tiny", speed=5.0)
    async with run_sim(cfg) as sim, aiohttp.ClientSession() as http:
        body = {
            "messages": [{"role": "user", "content": "x" * 200}],
            "max_tokens": 40,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        seen = 0
        snapshots = []
        async with http.post(sim.base_url + "/chat/completions", json=body) as r:
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                obj = orjson.loads(line[6:])
                if obj["choices"] and obj["choices"][0]["delta"].get("content"):
                    seen += 1
                if obj.get("usage"):
                    usage = obj["usage"]
                if seen in (1, 17, 33) and len(snapshots) < 3:
                    async with http.get(sim.url + "/sim/state") as s:
                        snapshots.append(await s.json())
        assert usage["completion_tokens"] == seen == 40
        for snap in snapshots:
            (run,) = snap["running"]
            assert run["prompt_tokens"] == usage["prompt_tokens"]
            assert run["blocks"] == math.ceil((run["prompt_tokens"] + run["generated"]) / 16)
            assert snap["used_blocks"] == run["blocks"]
            assert snap["kv_cache_usage"] == pytest.approx(run["blocks"] / 128)
        m = await scrape(http, sim)
        assert m["vllm:kv_cache_usage_perc"].value == 0.0
        assert m["vllm:prompt_tokens_total"].value == usage["prompt_tokens"]
        assert m["vllm:generation_tokens_total"].value == 40


def burst_config(**kw: Any) -> SimConfig:
    # 24 blocks × 16 = 384 KV tokens; each request needs up to ceil((60 + 80) / 16) = 9 blocks.
    return SimConfig.from_profile(
        "tiny", kv_blocks=24, context_window=256, max_num_seqs=16, **FAST, **kw
    )


async def test_burst_overflow_preempts_and_every_request_completes() -> None:
    async with run_sim(burst_config()) as sim, client(sim) as c, aiohttp.ClientSession() as http:
        peak = 0.0
        done = False

        async def watch() -> None:
            nonlocal peak
            while not done:
                peak = max(peak, (await scrape(http, sim))["vllm:kv_cache_usage_perc"].value)
                await asyncio.sleep(0.005)

        async def one(i: int):
            return await c.completions.create(
                model="kvgate-sim-tiny",
                prompt=f"request {i} " + "y" * 220,
                max_tokens=80,
                extra_body={"ignore_eos": True},
            )

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*(one(i) for i in range(8)))
        done = True
        await watcher
        assert all(r.usage.completion_tokens == 80 for r in results)
        assert all(len(r.choices[0].text.split()) == 80 for r in results)
        m = await scrape(http, sim)
        assert m["vllm:num_preemptions_total"].value > 0
        assert peak > 0.9
        assert m["kvgate_sim_kv_cache_usage_peak"].value == 1.0  # a preemption means a full cache
        assert m["vllm:kv_cache_usage_perc"].value == 0.0
        assert m["vllm:num_requests_running"].value == 0
        assert m["vllm:num_requests_waiting"].value == 0
        assert m["vllm:request_success_total{length}"].value == 8


async def test_burst_overflow_in_oom_mode_fails_with_500_then_recovers() -> None:
    cfg = burst_config(on_overflow="oom", restart_seconds=10.0)  # 10 s / speed 50 = 0.2 s
    async with run_sim(cfg) as sim, client(sim) as c, aiohttp.ClientSession() as http:

        async def one(i: int):
            return await c.completions.create(
                model="kvgate-sim-tiny",
                prompt=f"request {i} " + "y" * 220,
                max_tokens=80,
                extra_body={"ignore_eos": True},
            )

        results = await asyncio.gather(*(one(i) for i in range(8)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, Exception)]
        assert errors
        assert all(isinstance(e, openai.InternalServerError) for e in errors)
        assert all(e.status_code == 500 for e in errors)
        assert "CUDA out of memory" in errors[0].message
        assert errors[0].body["type"] == "InternalServerError"
        m = await scrape(http, sim)
        assert m["kvgate_sim_oom_total"].value >= 1
        assert m["kvgate_sim_failed_requests_total"].value == len(errors)
        assert m["vllm:num_preemptions_total"].value == 0

        async def healthy() -> bool:
            async with http.get(sim.url + "/health") as r:
                return r.status == 200

        await wait_for(healthy)
        m = await scrape(http, sim)
        assert m["vllm:num_requests_running"].value == 0
        assert m["vllm:num_requests_waiting"].value == 0
        assert m["vllm:kv_cache_usage_perc"].value == 0.0
        assert m["kvgate_sim_healthy"].value == 1.0
        again = await one(99)
        assert again.usage.completion_tokens == 80


async def test_unhealthy_while_restarting() -> None:
    cfg = burst_config(on_overflow="oom", restart_seconds=3600.0)
    async with run_sim(cfg) as sim, client(sim) as c, aiohttp.ClientSession() as http:
        reqs = [
            c.completions.create(
                model="kvgate-sim-tiny",
                prompt="z" * 220,
                max_tokens=80,
                extra_body={"ignore_eos": True},
            )
            for _ in range(8)
        ]
        await asyncio.gather(*reqs, return_exceptions=True)
        async with http.get(sim.url + "/health") as r:
            assert r.status == 503
        async with http.post(sim.base_url + "/completions", json={"prompt": "hi"}) as r:
            assert r.status == 503
            assert "restarting" in (await r.json())["error"]["message"]
        assert (await scrape(http, sim))["kvgate_sim_healthy"].value == 0.0


async def test_client_disconnect_mid_stream_frees_blocks() -> None:
    cfg = SimConfig.from_profile("tiny", speed=2.0)
    async with run_sim(cfg) as sim, aiohttp.ClientSession() as http:
        body = {
            "messages": [{"role": "user", "content": "x" * 400}],
            "max_tokens": 500,
            "ignore_eos": True,
            "stream": True,
        }
        r = await http.post(sim.base_url + "/chat/completions", json=body)
        got = 0
        async for line in r.content:
            if line.startswith(b"data: {"):
                got += 1
            if got == 4:
                break
        m = await scrape(http, sim)
        assert m["vllm:num_requests_running"].value == 1
        assert m["vllm:kv_cache_usage_perc"].value > 0
        r.close()  # drop the connection mid-stream

        async def freed() -> bool:
            m = await scrape(http, sim)
            return (
                m["vllm:num_requests_running"].value == 0
                and m["vllm:kv_cache_usage_perc"].value == 0.0
            )

        await wait_for(freed)
        m = await scrape(http, sim)
        assert m["kvgate_sim_aborted_requests_total"].value == 1
        assert m["kvgate_sim_wasted_tokens_total"].value >= 3
        assert m["vllm:request_success_total{abort}"].value == 1
        assert not sim.engine.running
        assert sim.engine.used_blocks == 0


async def test_client_disconnect_while_waiting_non_streaming_aborts() -> None:
    cfg = SimConfig.from_profile("tiny", speed=2.0, max_num_seqs=1)
    async with run_sim(cfg) as sim, aiohttp.ClientSession() as http:
        hog = {"prompt": "x" * 100, "max_tokens": 500, "ignore_eos": True}
        hog_task = asyncio.create_task(http.post(sim.base_url + "/completions", json=hog))
        await wait_for(lambda: _true(len(sim.engine.running) == 1))
        waiter = asyncio.create_task(http.post(sim.base_url + "/completions", json=hog))
        await wait_for(lambda: _true(len(sim.engine.waiting) == 1))
        waiter.cancel()
        hog_task.cancel()
        await asyncio.gather(waiter, hog_task, return_exceptions=True)
        await wait_for(lambda: _true(not sim.engine.has_work))
        assert sim.engine.aborted == 2
        assert sim.engine.used_blocks == 0


async def _true(value: bool) -> bool:
    return value


async def test_metrics_v1_names_parse_with_prometheus_parser() -> None:
    async with run_sim(SimConfig.from_profile("tiny", **FAST)) as sim, aiohttp.ClientSession() as h:
        async with h.get(sim.url + "/metrics") as r:
            text = await r.text()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:cache_config_info",
        ):
            assert fams[name].type == "gauge"
        for name in (
            "vllm:num_preemptions",
            "vllm:prompt_tokens",
            "vllm:generation_tokens",
            "kvgate_sim_oom",
        ):
            assert fams[name].type == "counter"
            assert fams[name].samples[0].name == name + "_total"
        assert "vllm:gpu_cache_usage_perc" not in fams
        usage = fams["vllm:kv_cache_usage_perc"].samples[0]
        assert usage.labels == {"model_name": "kvgate-sim-tiny", "engine": "0"}
        info = fams["vllm:cache_config_info"].samples[0].labels
        assert info["num_gpu_blocks"] == "128"
        assert info["block_size"] == "16"


@pytest.mark.parametrize(
    ("names", "present", "absent"),
    [
        (
            "v0",
            {"vllm:gpu_cache_usage_perc", "vllm:num_requests_swapped"},
            {"vllm:kv_cache_usage_perc"},
        ),
        ("both", {"vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"}, set()),
    ],
)
async def test_metrics_v0_and_both(names: str, present: set[str], absent: set[str]) -> None:
    cfg = SimConfig.from_profile("tiny", metric_names=names, **FAST)
    async with run_sim(cfg) as sim, aiohttp.ClientSession() as h:
        async with h.get(sim.url + "/metrics") as r:
            fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
        assert present <= set(fams)
        assert not absent & set(fams)
        if names == "v0":
            assert fams["vllm:gpu_cache_usage_perc"].samples[0].labels == {
                "model_name": "kvgate-sim-tiny"
            }


async def test_deterministic_under_a_fixed_seed() -> None:
    async def outputs(seed: int) -> list[str]:
        cfg = SimConfig.from_profile("tiny", seed=seed, **FAST)
        async with run_sim(cfg) as sim, client(sim) as c:
            out = []
            for i in range(4):
                r = await c.chat.completions.create(
                    model="kvgate-sim-tiny",
                    messages=[{"role": "user", "content": f"question {i}"}],
                    max_tokens=500,
                )
                out.append(r.choices[0].message.content)
            return out

    first = await outputs(3)
    assert first == await outputs(3)
    assert first != await outputs(4)
    assert len({len(t.split()) for t in first}) > 1  # lengths are drawn, not fixed


async def test_embeddings_and_health() -> None:
    async with run_sim(SimConfig.from_profile("tiny", **FAST)) as sim, client(sim) as c:
        r = await c.embeddings.create(model="kvgate-sim-tiny", input=["alpha", "beta gamma"])
        assert [d.index for d in r.data] == [0, 1]
        assert len(r.data[0].embedding) == 16
        assert sum(v * v for v in r.data[0].embedding) == pytest.approx(1.0)
        assert r.usage.prompt_tokens == r.usage.total_tokens > 0
        async with aiohttp.ClientSession() as http, http.get(sim.url + "/health") as h:
            assert h.status == 200


async def test_tokenizer_file_counts_prompt_tokens(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = [f"the cache block {i} holds tokens of prompt {i % 7}" for i in range(300)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    prompt = "the cache block holds many tokens of a prompt"
    expected = len(tok.encode(prompt).ids)
    cfg = SimConfig.from_profile("tiny", tokenizer=str(path), **FAST)
    async with run_sim(cfg) as sim, client(sim) as c:
        r = await c.completions.create(model="kvgate-sim-tiny", prompt=prompt, max_tokens=2)
        assert r.usage.prompt_tokens == expected
    missing = SimConfig.from_profile("tiny", tokenizer=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        create_app(missing)


async def test_chat_template_props_and_slots(tmp_path: Path) -> None:
    """With the model's chat template, a chat prompt is the rendered template counted without
    added special tokens; ``/props`` states the batch size, the window and the template;
    ``/slots`` shows each running sequence with the tokens it holds (llama.cpp's shapes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = [f"<|user|> the cache block {i} holds tokens" for i in range(300)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    template = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    messages = [{"role": "user", "content": "the cache block holds tokens"}]
    expected = len(tok.encode("<|user|> the cache block holds tokens\n").ids)
    cfg = SimConfig.from_profile(
        "tiny", tokenizer=str(path), chat_template=template, max_num_seqs=2, speed=1.0
    )
    async with run_sim(cfg) as sim, client(sim) as c, aiohttp.ClientSession() as http:
        r = await c.chat.completions.create(
            model="kvgate-sim-tiny", messages=messages, max_tokens=1
        )
        assert r.usage.prompt_tokens == expected
        async with http.get(sim.url + "/props") as resp:
            props = await resp.json()
        assert props["total_slots"] == 2
        assert props["default_generation_settings"]["n_ctx"] == 1024
        assert props["chat_template"] == template
        stream = await c.chat.completions.create(
            model="kvgate-sim-tiny",
            messages=messages,
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            break

        async def slots() -> list[dict[str, Any]]:
            async with http.get(sim.url + "/slots") as resp:
                return await resp.json()

        async def busy_and_decoding() -> bool:
            s = await slots()
            return s[0]["is_processing"] and s[0]["next_token"][0]["n_decoded"] >= 2

        await wait_for(busy_and_decoding, attempts=1000)
        first, second = await slots()
        assert second == {"id": 1, "n_ctx": 1024, "is_processing": False}
        # the tokens it holds: prompt + generated so far
        decoded = first["next_token"][0]["n_decoded"]
        assert first["n_prompt_tokens_processed"] == expected
        assert expected + decoded - 1 <= first["n_prompt_tokens"] <= expected + decoded + 1
        await stream.close()

        async def idle() -> bool:
            return not any(s["is_processing"] for s in await slots())

        await wait_for(idle, attempts=1000)


# ------------------------------------------------------------------------- bad input

CHAT = "/chat/completions"
BAD_INPUTS = [
    (CHAT, b"{not json", "Invalid JSON"),
    (CHAT, b"[1, 2]", "JSON object"),
    (CHAT, orjson.dumps({"model": "kvgate-sim-tiny"}), "'messages' is required"),
    (CHAT, orjson.dumps({"messages": []}), "'messages' is required"),
    (CHAT, orjson.dumps({"messages": [{"content": "no role"}]}), "string 'role'"),
    (CHAT, orjson.dumps({"messages": [{"role": "user", "content": 5}]}), "content"),
    (
        CHAT,
        orjson.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
        "at least 1",
    ),
    (
        CHAT,
        orjson.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}),
        "integer",
    ),
    (
        CHAT,
        orjson.dumps({"messages": [{"role": "user", "content": "x"}], "n": 0}),
        "at least 1",
    ),
    (
        CHAT,
        orjson.dumps({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
        "boolean",
    ),
    (
        CHAT,
        orjson.dumps(
            {
                "messages": [{"role": "user", "content": "x"}],
                "stream_options": {"include_usage": True},
            }
        ),
        "stream=True",
    ),
    ("/completions", orjson.dumps({"max_tokens": 3}), "'prompt' is required"),
    ("/completions", orjson.dumps({"prompt": []}), "non-empty"),
    ("/completions", orjson.dumps({"prompt": [1, "a"]}), "non-empty"),
    ("/embeddings", orjson.dumps({"model": "kvgate-sim-tiny"}), "'input' is required"),
    ("/embeddings", b"", "Invalid JSON"),
]


@pytest.mark.parametrize(("path", "raw", "fragment"), BAD_INPUTS)
async def test_bad_input_gets_a_400_in_vllm_error_shape(
    path: str, raw: bytes, fragment: str
) -> None:
    async with run_sim(SimConfig.from_profile("tiny", **FAST)) as sim, aiohttp.ClientSession() as h:
        async with h.post(
            sim.base_url + path, data=raw, headers={"Content-Type": "application/json"}
        ) as r:
            assert r.status == 400
            body = await r.json()
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "BadRequestError"
        assert err["code"] == 400
        assert fragment in err["message"]
        assert not sim.engine.has_work
        assert sim.engine.used_blocks == 0


async def test_over_context_gets_400_with_the_maximum_context_length_phrase() -> None:
    async with run_sim(SimConfig.from_profile("tiny", **FAST)) as sim, client(sim) as c:
        with pytest.raises(openai.BadRequestError) as exc:
            await c.chat.completions.create(
                model="kvgate-sim-tiny", messages=[{"role": "user", "content": "w" * 5000}]
            )
        assert exc.value.status_code == 400
        assert "maximum context length is 1024 tokens" in exc.value.message
        with pytest.raises(openai.BadRequestError) as exc:
            await c.chat.completions.create(
                model="kvgate-sim-tiny",
                messages=[{"role": "user", "content": "short"}],
                max_tokens=1020,
            )
        assert "in the completion" in exc.value.message
        with pytest.raises(openai.BadRequestError):
            await c.completions.create(model="kvgate-sim-tiny", prompt=list(range(1024)))
        with pytest.raises(openai.BadRequestError):
            await c.embeddings.create(model="kvgate-sim-tiny", input="e" * 8000)
        with pytest.raises(openai.NotFoundError):
            await c.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
            )
        assert sim.engine.prompt_tokens_total == 0


async def test_oom_mid_stream_sends_an_error_event_then_done() -> None:
    cfg = burst_config(on_overflow="oom", restart_seconds=3600.0)
    async with run_sim(cfg) as sim, aiohttp.ClientSession() as http:
        body = {"prompt": "y" * 220, "max_tokens": 80, "ignore_eos": True, "stream": True}

        async def one() -> tuple[int, list[bytes]]:
            async with http.post(sim.base_url + "/completions", json=body) as r:
                return r.status, [e for e in (await r.read()).split(b"\n\n") if e]

        results = await asyncio.gather(*(one() for _ in range(8)))
        started = [events for status, events in results if status == 200]
        assert started  # admitted sequences were streaming when the cache overflowed
        for events in started:
            assert events[-1] == b"data: [DONE]"
            err = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
            assert "CUDA out of memory" in err["message"]
            assert err["code"] == 500
        assert all(status in (200, 500) for status, _ in results)


async def test_a_lone_surrogate_escape_is_read_as_a_replacement_character() -> None:
    """A lone UTF-16 surrogate escape (``"\\ud800"``), which vLLM accepts as Python's ``json``
    does, is read as U+FFFD (the gateway reads it the same way): the request is served (it was
    a 400) and its prompt counted as the same text with U+FFFD; bad JSON is still a 400."""
    async with run_sim(SimConfig.from_profile("tiny", **FAST)) as sim, aiohttp.ClientSession() as h:
        url = sim.base_url + "/chat/completions"
        usage = []
        for text in (b"a\\ud800b \\udc00", "a\ufffdb \ufffd".encode()):
            body = (
                b'{"model":"kvgate-sim-tiny","max_tokens":3,"messages":[{"role":"user","content":"'
            )
            async with h.post(url, data=body + text + b'"}]}') as r:
                assert r.status == 200, await r.text()
                usage.append((await r.json())["usage"]["prompt_tokens"])
        assert usage[0] == usage[1]
        async with h.post(url, data=b'{"model":"kvgate-sim-tiny","messages":"\\ud800') as r:
            assert r.status == 400
            assert "Invalid JSON body" in (await r.json())["error"]["message"]
