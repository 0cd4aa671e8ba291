"""The simulator's per-user oracle: what the engine really ran for each body ``user``, with
exact peaks, over the sans-IO engine and over loopback with the official ``openai`` client."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest

from kvgate.sim import SimConfig, run_sim
from kvgate.sim.engine import Engine
from kvgate.sim.server import RunningSim

MODEL = "kvgate-sim-tiny"


def small(**kw: object) -> SimConfig:
    base: dict[str, object] = {
        "kv_blocks": 8,
        "block_size": 4,
        "context_window": 32,
        "max_num_seqs": 8,
        "speed": 1.0,
    }
    base.update(kw)
    return SimConfig.from_profile("tiny", **base)


def drain(engine: Engine, max_steps: int = 10_000) -> None:
    now = 0.0
    for _ in range(max_steps):
        if not engine.has_work:
            return
        now += engine.step(now).duration_s
    raise AssertionError("engine still busy")


# ---- the engine -----------------------------------------------------------------------------


def test_engine_counts_running_peaks_and_tokens_per_user() -> None:
    e = Engine(small(max_num_seqs=3))
    a = [e.new_sequence(2, 3, fingerprint=b"a%d" % i, ignore_eos=True, user="a") for i in range(3)]
    b = e.new_sequence(2, 3, fingerprint=b"b", ignore_eos=True, user="b")
    for seq in [*a, b]:
        e.add(seq)
    e.begin_request("a")
    e.begin_request("b")
    e.step(0.0)  # admits three (max_num_seqs), b waits
    ua, ub = e.user_stats("a"), e.user_stats("b")
    assert (ua.running, ua.peak_running, ub.running, ub.peak_running) == (3, 3, 0, 0)
    assert e.peak_running == 3
    drain(e)
    assert (ua.running, ua.peak_running, ub.running, ub.peak_running) == (0, 3, 0, 1)
    assert ua.prompt_tokens == 6
    assert ub.prompt_tokens == 2
    assert ua.completion_tokens == 9
    assert ub.completion_tokens == 3
    assert (ua.requests, ua.in_flight, ua.peak_in_flight) == (1, 1, 1)
    e.end_request("a")
    e.end_request("b")
    assert e.in_flight == 0
    assert e.peak_in_flight == 2
    e.reset_peaks()
    assert (ua.peak_running, ub.peak_running, e.peak_running, e.peak_in_flight) == (0, 0, 0, 0)
    assert e.snapshot()["by_user"]["a"] == {  # type: ignore[index]
        "running": 0,
        "peak_running": 0,
        "requests": 1,
        "in_flight": 0,
        "peak_in_flight": 0,
        "prompt_tokens": 6,
        "completion_tokens": 9,
    }


def test_engine_choices_share_one_prompt_like_usage() -> None:
    e = Engine(small())
    for index in range(3):  # one prompt, n=3
        e.add(e.new_sequence(5, 2, fingerprint=b"p", index=index, ignore_eos=True, user="u"))
    drain(e)
    assert e.user_stats("u").prompt_tokens == 5
    assert e.user_stats("u").completion_tokens == 6
    assert e.prompt_tokens_total == 15  # the vLLM counter still prefills each sequence


def test_engine_preemption_abort_and_crash_leave_running_at_zero() -> None:
    # 8 blocks of 4: three sequences of 6 + 10 tokens overflow and preempt the newest
    e = Engine(small())
    seqs = [
        e.new_sequence(6, 10, fingerprint=b"%d" % i, ignore_eos=True, user="p") for i in range(3)
    ]
    for seq in seqs:
        e.add(seq)
    now = 0.0
    for _ in range(10_000):
        if not e.has_work:
            break
        now += e.step(now).duration_s
        assert e.user_stats("p").running == len(e.running)
    assert e.preemptions > 0
    assert e.user_stats("p").running == 0
    assert e.user_stats("p").completion_tokens == 30  # preemption does not resend tokens
    # abort of a running sequence
    live = e.new_sequence(4, 10, fingerprint=b"x", ignore_eos=True, user="q")
    e.add(live)
    e.step(0.0)
    assert e.user_stats("q").running == 1
    assert e.abort(live.seq_id)
    assert e.user_stats("q").running == 0
    # an OOM crash fails every running sequence
    oom = Engine(small(on_overflow="oom"))
    for i in range(3):
        oom.add(oom.new_sequence(6, 10, fingerprint=b"%d" % i, ignore_eos=True, user="o"))
    for _ in range(100):
        if oom.ooms:
            break
        oom.step(0.0)
    assert oom.ooms == 1
    assert oom.user_stats("o").running == 0
    assert oom.user_stats("o").peak_running >= 2


# ---- over loopback ----------------------------------------------------------------------------


def client(sim: RunningSim) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sim.base_url, api_key="unused", max_retries=0)


async def state_of(sim: RunningSim) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(sim.url + "/sim/state") as r:
        assert r.status == 200
        return await r.json()  # type: ignore[no-any-return]


async def until(pred: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await pred():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.02)


async def test_by_user_matches_usage_for_each_route() -> None:
    async with run_sim(SimConfig.from_profile("tiny", speed=50.0)) as sim, client(sim) as c:
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
            user="alice",
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage is not None
        comp = await c.completions.create(
            model=MODEL, prompt="abc def", max_tokens=4, n=2, user="bob"
        )
        assert comp.usage is not None
        resp = await c.responses.create(model=MODEL, input="hi", max_output_tokens=5, user="carol")
        assert resp.usage is not None
        plain = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3
        )
        assert plain.usage is not None
        st = await state_of(sim)
    by = st["by_user"]
    assert set(by) == {"alice", "bob", "carol", ""}
    assert by["alice"]["prompt_tokens"] == usage.prompt_tokens
    assert by["alice"]["completion_tokens"] == usage.completion_tokens
    assert by["bob"]["prompt_tokens"] == comp.usage.prompt_tokens  # n=2 shares the prompt
    assert by["bob"]["completion_tokens"] == comp.usage.completion_tokens
    assert by["carol"]["prompt_tokens"] == resp.usage.input_tokens
    assert by["carol"]["completion_tokens"] == resp.usage.output_tokens
    assert by[""]["completion_tokens"] == plain.usage.completion_tokens
    for user in by.values():
        assert user["requests"] == 1
        assert user["running"] == 0
        assert user["in_flight"] == 0
        assert user["peak_in_flight"] == 1
    assert by["alice"]["peak_running"] == 1
    assert 1 <= by["bob"]["peak_running"] <= 2
    assert st["in_flight"] == 0
    assert st["peak_running"] >= 1


async def test_peak_running_is_exact_and_reset_peaks_restarts_it() -> None:
    # slow enough that the streams overlap: 24 tokens at speed 5 each take a while
    async with run_sim(SimConfig.from_profile("tiny", speed=5.0)) as sim, client(sim) as c:

        async def one(user: str) -> None:
            stream = await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "go"}],
                max_tokens=24,
                stream=True,
                user=user,
                extra_body={"ignore_eos": True},
            )
            async for _ in stream:
                pass

        tasks = [asyncio.create_task(one("t")) for _ in range(4)]
        tasks.append(asyncio.create_task(one("u")))

        async def all_running() -> bool:
            st = await state_of(sim)
            return st["num_running"] == 5

        await until(all_running)
        async with aiohttp.ClientSession() as s, s.post(sim.url + "/sim/reset-peaks") as r:
            assert r.status == 200
            after_reset = await r.json()
        # peaks := current values, which are the values running now
        assert after_reset["by_user"]["t"]["peak_running"] == after_reset["by_user"]["t"]["running"]
        assert after_reset["peak_running"] == after_reset["num_running"]
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        st = await state_of(sim)
        assert st["by_user"]["t"]["peak_running"] == 4
        assert st["by_user"]["t"]["peak_in_flight"] == 4
        assert st["by_user"]["u"]["peak_running"] == 1
        assert st["peak_running"] == 5
        assert st["by_user"]["t"]["completion_tokens"] == 4 * 24
        assert st["by_user"]["t"]["running"] == 0
        async with aiohttp.ClientSession() as s, s.post(sim.url + "/sim/reset-peaks") as r:
            idle = await r.json()
        assert idle["peak_running"] == 0
        assert idle["peak_in_flight"] == 0
        assert idle["by_user"]["t"]["peak_running"] == 0
        assert idle["by_user"]["t"]["requests"] == 4  # counts are not peaks: kept


async def test_disconnect_ends_the_users_request() -> None:
    async with run_sim(SimConfig.from_profile("tiny", speed=5.0)) as sim:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 500,
            "ignore_eos": True,
            "stream": True,
            "user": "gone",
        }
        async with aiohttp.ClientSession() as s:
            async with s.post(sim.base_url + "/chat/completions", json=body) as r:
                assert r.status == 200
                await r.content.readline()  # the first event: it is running
                running = (await state_of(sim))["by_user"]["gone"]["running"]
                assert running == 1
                r.close()

        async def ended() -> bool:
            u = (await state_of(sim))["by_user"]["gone"]
            return u["running"] == 0 and u["in_flight"] == 0

        await until(ended)
        u = (await state_of(sim))["by_user"]["gone"]
        assert 1 <= u["completion_tokens"] < 500
        assert u["requests"] == 1
        assert u["peak_running"] == 1


@pytest.mark.parametrize("user", [123, ["a"], {"a": 1}, True])
async def test_non_string_user_is_refused_and_counts_nothing(user: object) -> None:
    async with run_sim(SimConfig.from_profile("tiny", speed=50.0)) as sim:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "user": user}
        async with aiohttp.ClientSession() as s:
            async with s.post(sim.base_url + "/chat/completions", json=body) as r:
                assert r.status == 400
                err = (await r.json())["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "'user' must be a string" in err["message"]
        st = await state_of(sim)
        assert st["by_user"] == {}
        assert st["in_flight"] == 0
        assert st["num_running"] == 0
        assert st["used_blocks"] == 0


async def test_null_user_is_the_empty_user() -> None:
    async with run_sim(SimConfig.from_profile("tiny", speed=50.0)) as sim:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "user": None}
        async with aiohttp.ClientSession() as s:
            async with s.post(sim.base_url + "/completions", json=body) as r:
                assert r.status == 200
        assert set((await state_of(sim))["by_user"]) == {""}
