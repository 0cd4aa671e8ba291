"""A ``kvgate serve`` holding N tenants (``benches/tenants/run.py``'s configuration, as JSON,
with an admin key) in front of the fast fixed-answer upstream; every tenant sends one request
(32 at a time); then the gateway's resident memory and the time and size of ``GET /metrics``,
``/admin/state``, ``/dashboard/data`` and ``/admin/usage``.

Usage: ``.venv/bin/python benches/tenants/one_each.py [N]`` (default 100,000; about 2 minutes
on 2 cores)
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches" / "load"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import config, rss_mb, sha  # noqa: E402
from run_load import free_port  # noqa: E402

ADMIN = "bench-admin"


def main(n: int) -> None:
    py = sys.executable
    up_port, port = free_port(), free_port()
    up = subprocess.Popen([py, str(ROOT / "benches/load/fast_upstream.py"), str(up_port)])
    # the bench's own gateway configuration (benches/tenants/run.py), with an admin key
    cfg = config(f"http://127.0.0.1:{up_port}", port, n, None)
    cfg["admin_key_sha256"] = sha(ADMIN)
    path = Path(tempfile.mkdtemp()) / "kvgate.json"
    path.write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    gw = subprocess.Popen([py, "-m", "kvgate", "serve", "--config", str(path),
                           "--log-level", "WARNING"])  # fmt: skip
    try:
        asyncio.run(drive(n, f"http://127.0.0.1:{port}", gw.pid, t0))
    finally:
        gw.terminate()
        up.terminate()
        gw.wait()
        up.wait()


async def drive(n: int, url: str, pid: int, t0: float) -> None:
    """Waits for the gateway at ``url`` (process ``pid``, started at ``t0``), sends one
    request of each of its ``n`` tenants and reads its admin routes."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with aiohttp.ClientSession() as s:
        for _ in range(900):
            try:
                async with s.get(url + "/healthz") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        print(f"{n:,} tenants: up in {time.perf_counter() - t0:.1f} s, "
              f"{rss_mb(pid):.0f} MB resident", flush=True)  # fmt: skip
        body = {"model": "fast", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 16}  # fmt: skip
        gate = asyncio.Semaphore(32)

        async def one(i: int) -> None:
            async with gate, s.post(url + "/v1/chat/completions", json=body,
                                    headers={"Authorization": f"Bearer sk-t{i}"}) as r:  # fmt: skip
                await r.read()
                assert r.status == 200, r.status

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        print(f"one request of each: {time.perf_counter() - t0:.1f} s, "
              f"{rss_mb(pid):.0f} MB resident", flush=True)  # fmt: skip
        for route, headers in (("/metrics", {}), ("/admin/state", admin),
                               ("/dashboard/data", admin), ("/admin/usage", admin)):  # fmt: skip
            t0 = time.perf_counter()
            async with s.get(url + route, headers=headers) as r:
                data = await r.read()
            print(f"GET {route}: {r.status}, {time.perf_counter() - t0:.3f} s, "
                  f"{len(data) / 1e6:.2f} MB; {rss_mb(pid):.0f} MB resident", flush=True)  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)
