"""Headless Chromium driven over the Chrome DevTools Protocol, with aiohttp's websocket client
(no Selenium, no Playwright, nothing downloaded).

:func:`open_browser` starts Debian's ``chromium`` with ``--headless`` and
``--remote-debugging-port=0``, reads the DevTools websocket address it prints on stderr, and
yields a :class:`Browser`; :meth:`Browser.new_page` opens a tab (a flattened target session)
with the ``Runtime``, ``Log`` and ``Page`` domains on, so the page's console errors, uncaught
exceptions and failed loads are collected (:attr:`Page.errors`). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest


def chromium_path() -> str:
    """The ``chromium`` binary (Debian's package; ``KVGATE_CHROMIUM`` names another).

    Skips the test when there is none, except under CI (``CI`` set), where it fails:
    ``make test-packages`` installs it."""
    path = os.environ.get("KVGATE_CHROMIUM") or shutil.which("chromium")
    if path:
        return path
    message = "chromium is not installed (apt-get install chromium)"
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but {message}; `make test-packages` installs it", pytrace=False)
    pytest.skip(message)


class Page:
    """One tab, attached with a flattened session.

    Attributes:
        errors: what the page reported as errors so far: ``console.error`` calls, uncaught
            exceptions, and the browser's own error log entries (a load that failed, a
            Content-Security-Policy violation), each as one line of text.
    """

    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session
        self.errors: list[str] = []

    async def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """A CDP command on this tab; its result (``RuntimeError`` on a protocol error)."""
        return await self.browser.call(method, params, session=self.session)

    async def navigate(self, url: str) -> None:
        """Go to ``url`` (returns once the navigation is committed)."""
        result = await self.call("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise RuntimeError(f"navigation to {url} failed: {result['errorText']}")

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page (awaited if a promise)."""
        result = await self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self) -> bytes:
        """A PNG of the whole page (not only the viewport)."""
        metrics = await self.call("Page.getLayoutMetrics")
        size = metrics.get("cssContentSize") or metrics["contentSize"]
        shot = await self.call(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {
                    "x": 0,
                    "y": 0,
                    "width": size["width"],
                    "height": size["height"],
                    "scale": 1,
                },
            },
        )
        return base64.b64decode(shot["data"])

    def _event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            self.errors.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            self.errors.append(f"uncaught: {text}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            entry = params["entry"]
            self.errors.append(
                f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}"
            )


class Browser:
    """A connection to the browser's DevTools websocket: commands by id, events to their tab."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._pages: dict[str, Page] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = orjson.loads(msg.data)
            if "id" in data:
                fut = self._pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            elif (page := self._pages.get(data.get("sessionId", ""))) is not None:
                page._event(data["method"], data.get("params", {}))
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(RuntimeError("the DevTools connection closed"))

    async def call(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        *,
        session: str | None = None,
        timeout: float = 30.0,
    ) -> dict[str, Any]:
        """Send one command and wait (at most ``timeout`` seconds) for its answer."""
        ident = next(self._ids)
        message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[ident] = fut
        # DevTools reads text frames only
        await self.ws.send_str(orjson.dumps(message).decode())
        answer = await asyncio.wait_for(fut, timeout)
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return answer.get("result", {})  # type: ignore[no-any-return]

    async def new_page(self, width: int = 1400, height: int = 1000) -> Page:
        """A new blank tab of ``width`` × ``height`` CSS pixels, its errors collected."""
        target = await self.call("Target.createTarget", {"url": "about:blank"})
        attached = await self.call(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
        )
        page = Page(self, attached["sessionId"])
        self._pages[page.session] = page
        for domain in ("Runtime", "Log", "Page"):
            await page.call(f"{domain}.enable")
        await page.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        return page

    async def close(self) -> None:
        """Close the connection (the browser process is stopped by :func:`open_browser`)."""
        with contextlib.suppress(Exception):
            await self.call("Browser.close", timeout=5)
        await self.ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


@contextlib.asynccontextmanager
async def open_browser(timeout: float = 60.0) -> AsyncIterator[Browser]:
    """Headless Chromium for a block: a fresh profile in a temporary folder, no first-run
    pages, no background network, no GPU; stopped (SIGTERM, then SIGKILL) after the block.

    Raises:
        TimeoutError: no DevTools address within ``timeout`` seconds.
        RuntimeError: the browser exited before printing it (message with its stderr).
    """
    binary = chromium_path()
    with tempfile.TemporaryDirectory(prefix="kvgate-chromium-") as profile:
        proc = await asyncio.create_subprocess_exec(
            binary,
            "--headless",
            "--no-sandbox",  # tests may run as root, where Chromium's sandbox refuses to start
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-default-apps",
            "--hide-scrollbars",
            "--mute-audio",
            f"--user-data-dir={profile}",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            "about:blank",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stderr is not None
        seen = bytearray()
        try:
            async with asyncio.timeout(timeout):
                while True:
                    line = await proc.stderr.readline()
                    if not line:
                        await proc.wait()
                        raise RuntimeError(
                            f"chromium exited with {proc.returncode}: {seen.decode(errors='replace')}"
                        )
                    seen.extend(line)
                    found = re.search(rb"DevTools listening on (ws://\S+)", line)
                    if found:
                        ws_url = found.group(1).decode()
                        break

            # keep reading stderr so the browser never blocks on a full pipe
            async def drain() -> None:
                assert proc.stderr is not None
                while await proc.stderr.read(65536):
                    pass

            drainer = asyncio.create_task(drain())
            async with aiohttp.ClientSession() as session:
                ws = await session.ws_connect(
                    ws_url, max_msg_size=0, timeout=aiohttp.ClientWSTimeout(ws_close=5)
                )
                browser = Browser(ws)
                try:
                    yield browser
                finally:
                    await browser.close()
            drainer.cancel()
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
