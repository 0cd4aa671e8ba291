"""The live view in a real browser: ``kvgate sim`` and one ``kvgate serve`` (child processes,
:func:`tests.store.replicas.run_replicas` with n=1), headless Chromium driven over the DevTools
Protocol (:mod:`tests.dashboard.cdp`), traffic from the official ``openai`` client.

The page is opened the way a person opens it (``/dashboard?key=ADMIN_KEY``, then the cookie),
left running while the traffic flows, and judged by its DOM: the charts' SVG paths hold points
from the live gateway (slots in use, engine KV usage, refusals, TTFT), the numbers equal
``/admin/state`` and ``/metrics``, and the page logged no error. A screenshot is kept as
``target/artefacts/dashboard.png`` (the path is printed).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import openai
import pytest
from tests.dashboard.cdp import Page, chromium_path, open_browser
from tests.gateway.conftest import sha
from tests.gateway.helpers import metric, until
from tests.store.replicas import Replicas, run_replicas

ROOT = Path(__file__).resolve().parents[2]
ARTEFACT = ROOT / "target" / "artefacts" / "dashboard.png"
ADMIN_KEY = "sk-admin-dashboard-7f3a"
KEYS = {"chat": "sk-dash-chat", "docs": "sk-dash-docs", "batch": "sk-dash-batch"}

CONFIG: dict[str, Any] = {
    "admin_key_sha256": sha(ADMIN_KEY),
    "backends": [
        {
            "name": "sim",
            "engine": "vllm",
            "models": [{"name": "kvgate-sim-tiny", "context_window": 1024}],
            "max_concurrency": 4,
            "adaptive": {"enabled": True, "poll_interval": 0.2},
        }
    ],
    "tenants": [
        {
            "name": "chat",
            "api_key_sha256": [sha(KEYS["chat"])],
            "priority": "critical",
            "max_wait_ms": 30000,
        },
        {
            "name": "docs",
            "api_key_sha256": [sha(KEYS["docs"])],
            "priority": "standard",
            "max_wait_ms": 30000,
        },
        {
            "name": "batch",
            "api_key_sha256": [sha(KEYS["batch"])],
            "priority": "sheddable",
            "max_wait_ms": 0,
        },
    ],
    "slo": {"critical": {"ttft_p99_s": 5.0}, "min_samples": 1},
}

#: the page's state, read in one evaluation: samples polled, every chart path, every tile,
#: the tenants table, the SLO rows and the store mode
DOM_STATE = """(() => ({
  samples: Number(document.body.dataset.samples || 0),
  status: document.getElementById("status").textContent,
  store: document.getElementById("store").dataset.mode || null,
  paths: Object.fromEntries([...document.querySelectorAll("path[data-series]")].map((p) => [
    p.closest("[data-backend]") ? p.closest("[data-backend]").dataset.backend + "/" + p.dataset.series
                                : p.dataset.series,
    {points: Number(p.dataset.points), max: p.dataset.max === "" ? null : Number(p.dataset.max),
     d: p.getAttribute("d")}])),
  tiles: Object.fromEntries([...document.querySelectorAll("[data-backend] .tile")].map((t) => [
    t.closest("[data-backend]").dataset.backend + "/" + t.dataset.field,
    t.dataset.value === "" ? null : Number(t.dataset.value)])),
  tenants: Object.fromEntries([...document.querySelectorAll("tr[data-tenant]")].map((r) => [
    r.dataset.tenant, [...r.children].map((c) => c.textContent)])),
  slo: [...document.querySelectorAll("tr[data-slo-class]")].map((r) => r.dataset.sloClass),
}))()"""


async def _state(page: Page) -> dict[str, Any]:
    value = await page.evaluate(DOM_STATE)
    assert isinstance(value, dict)
    return value


async def _traffic(base_url: str) -> dict[str, dict[str, int]]:
    """Streamed chat from the three tenants at once (the sheddable one may not wait, so the
    four slots refuse some of it); outcomes per tenant."""
    outcomes: dict[str, dict[str, int]] = {t: {} for t in KEYS}

    async def one(tenant: str, i: int) -> None:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=KEYS[tenant], max_retries=0)
        try:
            stream = await client.chat.completions.create(
                model="kvgate-sim-tiny",
                messages=[{"role": "user", "content": f"request {i} of {tenant}: " + "word " * 60}],
                max_tokens=120,
                stream=True,
                extra_body={"ignore_eos": True, "user": tenant},
            )
            async for _ in stream:
                pass
            kind = "ok"
        except openai.APIStatusError as exc:
            kind = str(exc.status_code)
        finally:
            await client.close()
        outcomes[tenant][kind] = outcomes[tenant].get(kind, 0) + 1

    await asyncio.gather(
        *(one(t, i) for i in range(6) for t in ("chat", "docs")),
        *(one("batch", i) for i in range(8)),
    )
    return outcomes


@pytest.mark.timeout(300)
async def test_the_dashboard_draws_the_live_gateway_in_headless_chromium() -> None:
    chromium_path()  # skip (or fail under CI) before starting anything
    sim_args = ("--profile", "tiny", "--speed", "4", "--seed", "1")
    async with run_replicas(CONFIG, n=1, sim_args=sim_args, admin_key=ADMIN_KEY) as gws:
        await _check_in_browser(gws)
        stderr = gws.stderr(0)
    # the key came in a query string and a cookie: it is in no log line
    assert ADMIN_KEY.encode() not in stderr


async def _check_in_browser(gws: Replicas) -> None:
    url = gws.url(0)
    async with open_browser() as browser:
        page = await browser.new_page()
        await page.navigate(f"{url}/dashboard?key={ADMIN_KEY}")
        # the 303 took the key out of the address bar; the cookie carries it from then on
        assert await page.evaluate("location.pathname + location.search") == "/dashboard"
        assert await page.evaluate("document.cookie") == ""  # HttpOnly: no script reads it
        await until(lambda: _samples_at_least(page, 2), timeout=30, interval=0.2)

        outcomes = await _traffic(gws.base_url(0))
        assert sum(o.get("ok", 0) for o in outcomes.values()) >= 12, outcomes
        assert sum(n for o in outcomes.values() for k, n in o.items() if k != "ok") > 0, outcomes

        # once the traffic has ended, the page and the gateway agree, number for number
        async def agree() -> bool:
            admin = await gws.admin_state(0)
            text = await gws.metrics(0)
            st = await _state(page)
            backend = admin["backends"][0]
            tiles = st["tiles"]
            want = {
                "sim/in_use": backend["in_use"],
                "sim/inflight_tokens": backend["inflight_tokens"],
                "sim/base_concurrency": backend["max_concurrency"],
                "sim/effective_concurrency": backend["effective_concurrency"],
                "sim/base_inflight_tokens": backend["inflight_token_limit"],
                "sim/effective_inflight_tokens": backend["effective_inflight_token_limit"],
                "sim/base_tpm": backend["tokens_per_minute"],
                "sim/prefill_budget": admin["prefill"]["sim"]["budget"],
                "sim/refusals": metric(text, "kvgate_rejections_total") or 0,
            }
            tokens = {t: metric(text, "kvgate_tenant_tokens_total", tenant=t) or 0 for t in KEYS}
            shown = {t: float(row[2].replace(" k", "e3").replace(" M", "e6"))
                     for t, row in st["tenants"].items()}  # fmt: skip
            return (
                all(tiles.get(k) == v for k, v in want.items())
                and backend["in_use"] == 0
                and all(abs(shown.get(t, -1) - n) <= max(1, n * 0.001) for t, n in tokens.items())
            )

        await until(agree, timeout=30, interval=0.5)
        st = await _state(page)
        paths = st["paths"]
        # the charts hold what the live gateway went through
        assert paths["sim/in_use"]["max"] > 0, paths["sim/in_use"]
        assert paths["sim/in_use"]["points"] >= 5
        assert paths["sim/in_use"]["d"].count("L") >= 4
        assert paths["sim/kv_usage"]["max"] > 0, paths["sim/kv_usage"]
        assert paths["sim/ttft_p99_critical"]["points"] > 0
        refusals = [k for k in paths if k.startswith("sim/refusals_")]
        assert refusals, paths
        assert max(paths[k]["max"] or 0 for k in refusals) > 0, paths
        assert any(paths[k]["max"] or 0 for k in paths if k.startswith("tenant_"))
        assert st["slo"] == ["critical", "standard", "sheddable"]
        assert st["store"] == "local"
        assert st["status"].startswith("live")

        ARTEFACT.parent.mkdir(parents=True, exist_ok=True)
        png = await page.screenshot()
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        assert len(png) > 10_000
        ARTEFACT.write_bytes(png)
        print(f"\ndashboard screenshot: {ARTEFACT}")
        assert page.errors == []

        # everything admitted was released: nothing leaked
        backend = (await gws.admin_state(0))["backends"][0]
        assert backend["in_use"] == 0
        assert backend["inflight_tokens"] == 0


async def _samples_at_least(page: Page, n: int) -> bool:
    with contextlib.suppress(RuntimeError):  # the page may still be loading
        return int(await page.evaluate("Number(document.body.dataset.samples || 0)")) >= n
    return False
