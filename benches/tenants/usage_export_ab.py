"""``GET /admin/usage`` with 100,000 tenants (two minutes of rows): how long the export takes and
the event loop's longest stop meanwhile (a task that wakes every millisecond measures it), for
the ``kvgate.usage`` of an earlier revision and of the working tree, side by side in one run.

    .venv/bin/python benches/tenants/usage_export_ab.py 8d714f5

(8d714f5: the export built on the event loop; since then it is built in a worker thread.)
"""

import asyncio
import importlib.util
import subprocess
import sys
import tempfile

from aiohttp.test_utils import make_mocked_request

from kvgate import usage as new

rev = sys.argv[1] if len(sys.argv) > 1 else "8d714f5"
text = subprocess.run(
    ["git", "show", f"{rev}:python/kvgate/usage.py"], capture_output=True, check=True
).stdout
with tempfile.NamedTemporaryFile(suffix=".py", delete=False) as f:
    f.write(text)
    path = f.name
spec = importlib.util.spec_from_file_location("old_usage", path)
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
T0 = 1_767_225_600


def ledger(mod):
    led = mod.UsageLedger(clock=lambda: float(T0))
    led.started = float(T0)
    rows = {(f"tenant-{i:06d}", "m", "ok"): [3, 1200, 300] for i in range(100_000)}
    led.add(rows)
    led.clock = lambda: float(T0 + 60)
    led.add(rows)
    return led


async def run(mod, fmt):
    led = ledger(mod)
    loop = asyncio.get_running_loop()
    gaps = []
    done = asyncio.Event()

    async def tick():
        last = loop.time()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = loop.time()
            gaps.append(now - last)
            last = now

    t = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    began = loop.time()
    r = mod.usage_reply(
        led, make_mocked_request("GET", f"/admin/usage?from={T0}&to={T0 + 120}&format={fmt}")
    )
    if asyncio.iscoroutine(r):
        r = await r
    took = loop.time() - began
    done.set()
    await t
    return took, max(gaps), len(r.body)


async def main():
    for fmt in ("json", "csv"):
        for name, mod in ((rev, old), ("working tree", new)):
            took, gap, n = await run(mod, fmt)
            print(
                f"{fmt:4} {name:12}: export {took * 1000:4.0f} ms, loop's longest stop {gap * 1000:4.0f} ms, {n} bytes"
            )


asyncio.run(main())
