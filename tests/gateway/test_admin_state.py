"""``GET /admin/state`` with many tenants: a page of them by default (the whole list held the
event loop most of a second at 100,000 tenants), pages by ``offset`` / ``limit``, tenants by
name, and a clear 400 / 404 for a bad query."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from kvgate.app import ADMIN_STATE_MAX_TENANTS, ADMIN_STATE_TENANTS
from kvgate.config import Config
from kvgate.gateway_build import build_gateway
from kvgate.server import run_gateway

from .conftest import sha
from .fake_upstream import run_upstream
from .helpers import bearer

ADMIN_KEY = "sk-admin-state-0123"
TENANTS = 2 * ADMIN_STATE_TENANTS + 345


def config(url: str) -> dict[str, Any]:
    return {
        "backends": [
            {
                "name": "b0",
                "url": url,
                "models": [{"name": "replay", "context_window": 1024}],
                "max_concurrency": 8,
                "adaptive": {"enabled": False},
            }
        ],
        "tenants": [
            {"name": f"t{i}", "api_key_sha256": [sha(f"sk-t{i}")], "max_concurrency": 3 + i % 5}
            for i in range(TENANTS)
        ],
        "admin_key_sha256": sha(ADMIN_KEY),
    }


async def test_admin_state_lists_tenants_by_page_and_by_name_and_refuses_a_bad_query() -> None:
    async with run_upstream() as up:
        gateway = build_gateway(Config.model_validate(config(up.url)), poll=False)
        async with run_gateway(gateway) as url, aiohttp.ClientSession() as s:
            admin = bearer(ADMIN_KEY)

            async def state(query: str = "", status: int = 200) -> dict[str, Any]:
                async with s.get(url + "/admin/state" + query, headers=admin) as r:
                    body = orjson.loads(await r.read())
                    assert r.status == status, (query, body)
                    if status != 200:
                        assert r.content_type == "application/json"
                    return dict(body)

            # by default the first page; the backends and the store are always there
            doc = await state()
            assert [t["name"] for t in doc["tenants"]] == [
                f"t{i}" for i in range(ADMIN_STATE_TENANTS)
            ]
            assert doc["tenant_page"] == {
                "total": TENANTS,
                "offset": 0,
                "limit": ADMIN_STATE_TENANTS,
                "next": ADMIN_STATE_TENANTS,
            }
            assert doc["backends"][0]["name"] == "b0"
            assert "store" in doc
            assert doc["tenants"][7]["max_concurrency"] == 3 + 7 % 5
            # following `next` walks every tenant once, in configuration order
            seen: list[str] = []
            offset: int | None = 0
            while offset is not None:
                page = await state(f"?offset={offset}&limit=700")
                seen += [t["name"] for t in page["tenants"]]
                assert page["tenant_page"]["limit"] == 700
                offset = page["tenant_page"]["next"]
            assert seen == [f"t{i}" for i in range(TENANTS)]
            # leading zeros are still the number
            doc = await state("?offset=000000000000000000000000001&limit=0002")
            assert [t["name"] for t in doc["tenants"]] == ["t1", "t2"]
            # past the end: an empty page
            doc = await state(f"?offset={TENANTS + 5}")
            assert doc["tenants"] == []
            assert doc["tenant_page"]["next"] is None
            # by name, in the order asked, with each one's own state
            doc = await state("?tenant=t2344&tenant=t3&tenant=t3")
            assert [t["name"] for t in doc["tenants"]] == ["t2344", "t3", "t3"]
            assert doc["tenants"][0]["max_concurrency"] == 3 + 2344 % 5
            assert doc["tenant_page"] == {"total": TENANTS, "offset": 0, "limit": 3, "next": None}
            # an unknown name is a 404 naming it; a bad query a 400 naming the parameter
            err = (await state("?tenant=t3&tenant=nobody", 404))["error"]
            assert (err["code"], err["param"]) == ("tenant_not_found", "tenant")
            assert "'nobody'" in err["message"]
            for query, param in [
                ("?offset=-1", "offset"),
                ("?offset=1.5", "offset"),
                ("?offset=abc", "offset"),
                ("?offset=%EF%BC%91", "offset"),  # a full-width digit
                ("?offset=99999999999999999999999", "offset"),
                ("?limit=0", "limit"),
                (f"?limit={ADMIN_STATE_MAX_TENANTS + 1}", "limit"),
                ("?limit=", "limit"),
                ("?offset=1&offset=2", "offset"),
                ("?tenant=t1&limit=5", "tenant"),
                ("?tenants=t1", "tenants"),
                ("?tenant=", "tenant"),
                ("?offset=" + "9" * 5000, "offset"),  # past int()'s own limit on digits
            ]:
                err = (await state(query, 400))["error"]
                assert (err["code"], err["param"], err["type"]) == (
                    "invalid_value",
                    param,
                    "invalid_request_error",
                ), query
            # still the admin key's: a page is no way around it
            async with s.get(url + "/admin/state?tenant=t1") as r:
                assert r.status == 401
