"""The baseline: a bare aiohttp pass-through proxy (one pooled ``ClientSession``, no policy).

Usage: ``python bare_proxy.py PORT UPSTREAM_URL``
"""

from __future__ import annotations

import sys

import aiohttp
import uvloop
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)


async def proxy(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    session = request.app[SESSION]
    url = request.app["upstream"] + request.path
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as up:
        if up.content_type == "text/event-stream":
            response = web.StreamResponse(
                status=up.status, headers={"Content-Type": "text/event-stream"}
            )
            await response.prepare(request)
            async for data in up.content.iter_any():
                await response.write(data)
            await response.write_eof()
            return response
        return web.Response(status=up.status, body=await up.read(), content_type=up.content_type)


async def session_ctx(app: web.Application):
    app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    yield
    await app[SESSION].close()


def main() -> None:
    app = web.Application()
    app["upstream"] = sys.argv[2].rstrip("/")
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/chat/completions", proxy)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)


if __name__ == "__main__":
    main()
