"""The refusal baseline: a bare aiohttp handler that only answers 429 (no policy at all).

Usage: ``python bare_429.py PORT``
"""

from __future__ import annotations

import sys

import uvloop
from aiohttp import web

BODY = (
    b'{"error":{"message":"Rate limit reached.","type":"requests","param":null,'
    b'"code":"rate_limit_exceeded"}}'
)


async def refuse(_request: web.Request) -> web.Response:
    return web.Response(
        status=429, body=BODY, content_type="application/json", headers={"Retry-After": "1"}
    )


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", refuse)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)


if __name__ == "__main__":
    main()
