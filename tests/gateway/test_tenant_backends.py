"""A tenant's ``backends`` (config): it is routed only there, and its ``guaranteed_slots`` are
carved out of those backends only, in the admission core as in the config validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from kvgate.config import Config, load_config
from kvgate.gateway_build import apply_config, build_gateway

from .conftest import sha
from .fake_upstream import run_upstream
from .helpers import free_port, start_kvgate, stop_process, wait_http_up

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "kvgate.yaml"


def test_example_config_builds_with_per_backend_guarantees() -> None:
    config = load_config(EXAMPLE, env={})  # every ${VAR} of the example has a default
    gateway = build_gateway(config, poll=False)
    ctl = gateway.controller
    gpu, cpu = ctl.backend_id("gpu-a"), ctl.backend_id("cpu-llama")
    # support-chat 16 + code-completion 8, both limited to gpu-a; cpu-llama (4 slots) keeps all
    assert ctl.backend_state(gpu)["guaranteed_slots"] == 24
    assert ctl.backend_state(gpu)["burst_pool"] == 64 - 24
    assert ctl.backend_state(cpu)["guaranteed_slots"] == 0
    assert ctl.backend_state(cpu)["burst_pool"] == 4
    chat = ctl.tenant_state(ctl.tenant_id("support-chat"))
    assert (chat["guaranteed_slots"], chat["guaranteed_backends"]) == (16, [gpu])
    batch = ctl.tenant_state(ctl.tenant_id("batch-summaries"))
    assert batch["guaranteed_backends"] == [gpu, cpu]
    tenants = {t.name: t for t in gateway.tenants}
    assert tenants["support-chat"].backends == frozenset({"gpu-a"})
    assert tenants["batch-summaries"].backends is None


async def test_kvgate_serve_starts_with_the_example_config() -> None:
    port = free_port()
    proc = await start_kvgate(
        "serve", "--config", str(EXAMPLE), "--host", "127.0.0.1", "--port", str(port)
    )
    try:
        await wait_http_up(f"http://127.0.0.1:{port}/healthz")
    finally:
        err = await stop_process(proc)
    assert b"Traceback" not in err, err.decode(errors="replace")


def two_backends(url0: str, url1: str, tenants: list[dict[str, Any]]) -> dict[str, Any]:
    def backend(name: str, url: str, models: list[str]) -> dict[str, Any]:
        return {
            "name": name,
            "url": url,
            "models": [{"name": m, "context_window": 1024} for m in models],
            "max_concurrency": 4,
            "tokens_per_minute": 1_000_000,
            "adaptive": {"enabled": False},
            "stream_upstream": False,  # the engine's own non-streamed answers
        }

    return {
        "backends": [backend("b0", url0, ["replay", "only-b0"]), backend("b1", url1, ["replay"])],
        "tenants": tenants,
    }


async def test_tenant_is_routed_only_to_its_backends(gateway_for) -> None:
    tenants = [
        {"name": "pinned", "api_key_sha256": [sha("sk-pinned")], "priority": "critical",
         "guaranteed_slots": 3, "backends": ["b1"]},
        {"name": "free", "api_key_sha256": [sha("sk-free")]},
    ]  # fmt: skip
    async with run_upstream() as up0, run_upstream() as up1:
        config = Config.model_validate(two_backends(up0.url, up1.url, tenants))
        async with gateway_for(config) as gw:
            ctl = gw.gateway.controller
            assert ctl.backend_state(0)["guaranteed_slots"] == 0
            assert ctl.backend_state(1)["guaranteed_slots"] == 3
            pinned = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-pinned", max_retries=0)
            free = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-free", max_retries=0)
            msgs: Any = [{"role": "user", "content": "hi"}]
            for _ in range(4):
                out = await pinned.chat.completions.create(model="replay", messages=msgs)
                assert out.choices[0].message.content == "hi"
            # equal headroom: without the tenant's list, b0 (first) would win every time
            assert (len(up0.requests), len(up1.requests)) == (0, 4)
            await free.chat.completions.create(model="replay", messages=msgs)
            assert (len(up0.requests), len(up1.requests)) == (1, 4)
            # a model served only where the tenant may not go: 404 for it, 200 for others
            with pytest.raises(openai.NotFoundError) as info:
                await pinned.chat.completions.create(model="only-b0", messages=msgs)
            assert info.value.code == "model_not_found"
            assert info.value.param == "model"
            assert (len(up0.requests), len(up1.requests)) == (1, 4)
            await free.chat.completions.create(model="only-b0", messages=msgs)
            assert len(up0.requests) == 2
            await pinned.close()
            await free.close()
            assert ctl.backend_state(0)["in_use"] == ctl.backend_state(1)["in_use"] == 0

            # hot reload: the pinned tenant moves to b0 (its guarantee with it), then to all
            tenants[0]["backends"] = ["b0"]
            apply_config(gw.gateway, Config.model_validate(two_backends(up0.url, up1.url, tenants)))
            assert ctl.backend_state(0)["guaranteed_slots"] == 3
            assert ctl.backend_state(1)["guaranteed_slots"] == 0
            async with aiohttp.ClientSession() as s:
                body = {"model": "only-b0", "messages": msgs, "max_tokens": 4}
                headers = {"Authorization": "Bearer sk-pinned"}
                async with s.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status == 200
            del tenants[0]["backends"]
            apply_config(gw.gateway, Config.model_validate(two_backends(up0.url, up1.url, tenants)))
            assert ctl.backend_state(0)["guaranteed_slots"] == 3
            assert ctl.backend_state(1)["guaranteed_slots"] == 3
            assert ctl.tenant_state(ctl.tenant_id("pinned"))["guaranteed_backends"] == [0, 1]


def test_a_reload_the_core_refuses_changes_nothing() -> None:
    """Every limit of a reloaded file is tried on a scratch core first: a refusal (here a
    tenant burst that would take ~190 years to refill at 1 token per minute) leaves the
    running backends and tenants as they were, and the listen address stays the started one."""
    base = two_backends(
        "http://127.0.0.1:9", "http://127.0.0.1:10", [{"name": "t", "api_key_sha256": [sha("k")]}]
    )
    gateway = build_gateway(Config.model_validate(base), poll=False)
    ctl = gateway.controller
    b0 = ctl.backend_id("b0")
    changed = two_backends(
        "http://127.0.0.1:9",
        "http://127.0.0.1:10",
        [
            {
                "name": "t",
                "api_key_sha256": [sha("k")],
                "tokens_per_minute": 1,
                "burst_tokens": 10**8,
            }
        ],
    )
    changed["backends"][0]["max_concurrency"] = 3
    with pytest.raises(ValueError, match="refill"):
        apply_config(gateway, Config.model_validate(changed))
    assert ctl.backend_state(b0)["max_concurrency"] == 4
    assert ctl.tenant_state(ctl.tenant_id("t"))["tokens_per_minute"] is None
    # a valid reload that moves the listen port applies the limits, not the port
    moved = {**base, "listen": {"host": "127.0.0.1", "port": 18099}}
    moved["backends"][0]["max_concurrency"] = 3
    apply_config(gateway, Config.model_validate(moved))
    assert ctl.backend_state(b0)["max_concurrency"] == 3
    assert gateway.config.listen.port == Config.model_validate(base).listen.port
