"""A thousand backends serving one model: a request goes to the replica with room (the only
one, among a thousand), never to an unhealthy one, and for a tenant limited to some backends
only to those."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from kvgate.config import Config

from .conftest import sha
from .fake_upstream import run_upstream
from .helpers import get_text, metric

N = 1_000


def config(url: str) -> dict[str, Any]:
    backends = [
        {
            "name": f"b{i}",
            "url": url,
            "models": [{"name": "replay", "context_window": 1024}],
            "max_concurrency": 1,
            "adaptive": {"enabled": False},
            "stream_upstream": False,
        }
        for i in range(N)
    ]
    tenants = [
        {"name": "free", "api_key_sha256": [sha("sk-free")]},
        {"name": "pinned", "api_key_sha256": [sha("sk-pinned")], "backends": ["b10", "b20"]},
    ]
    return {"backends": backends, "tenants": tenants, "queue": {"max_size": 0}}


async def test_a_thousand_replicas_of_one_model_route_to_the_one_with_room(gateway_for) -> None:
    msgs: Any = [{"role": "user", "content": "hi"}]
    async with run_upstream() as up:
        async with gateway_for(Config.model_validate(config(up.url))) as gw:
            g = gw.gateway
            ctl = g.controller
            t = ctl.tenant_id("free")
            # every replica's one slot held, but b637's; b500 free too, but unhealthy
            held = {b.name: ctl.admit(b.id, t, "standard", 0) for b in g.backends}
            held.pop("b637").release()
            held.pop("b500").release()
            g.backend_named("b500").healthy = False
            g.backend_named("b637").kv_usage = 0.9  # (the only free one: KV usage is second)
            free = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-free", max_retries=0)
            pinned = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-pinned", max_retries=0)
            try:
                out = await free.chat.completions.create(model="replay", messages=msgs)
                assert out.choices[0].message.content == "hi"
                text = await get_text(gw.url + "/metrics")
                ok = metric(text, "kvgate_requests_total", backend="b637", tenant="free",
                            outcome="ok")  # fmt: skip
                assert ok == 1
                assert len(up.requests) == 1

                # the pinned tenant: its two backends are full; b20 frees
                held.pop("b20").release()
                await pinned.chat.completions.create(model="replay", messages=msgs)
                text = await get_text(gw.url + "/metrics")
                ok = metric(text, "kvgate_requests_total", backend="b20", tenant="pinned",
                            outcome="ok")  # fmt: skip
                assert ok == 1
                # b20 unhealthy: none of its backends is (b10 full, but healthy, would queue)
                g.backend_named("b20").healthy = False
                g.backend_named("b10").healthy = False
                with pytest.raises(openai.InternalServerError) as info:
                    await pinned.chat.completions.create(model="replay", messages=msgs)
                assert info.value.status_code == 503
                assert info.value.code == "backend_unavailable"
                # every replica unhealthy: 503 for everyone, and the service is not ready
                for b in g.backends:
                    b.healthy = False
                with pytest.raises(openai.InternalServerError) as info:
                    await free.chat.completions.create(model="replay", messages=msgs)
                assert info.value.status_code == 503
                assert len(up.requests) == 2
            finally:
                await free.close()
                await pinned.close()
                for r in held.values():
                    r.release()
            assert all(ctl.backend_state(b.id)["in_use"] == 0 for b in g.backends)
