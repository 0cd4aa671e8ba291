"""The longest a ``kvgate serve`` holding N tenants leaves a request unanswered while it
reloads its configuration (SIGHUP): a client sends ``GET /healthz`` one after another over
10 s, the reload (100 tenants out, 100 in) starts after 3 s; prints the slowest answers.

Usage: ``.venv/bin/python benches/tenants/reload_pause.py [N]`` (default 100,000)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "load"))

from reload import churned  # noqa: E402
from run import config  # noqa: E402
from run_load import free_port  # noqa: E402


def main(n: int) -> None:
    port = free_port()
    cfg = config("http://127.0.0.1:9", port, n, None)
    path = Path(tempfile.mkdtemp()) / "kvgate.json"
    path.write_text(json.dumps(cfg))
    gw = subprocess.Popen([sys.executable, "-m", "kvgate", "serve", "--config", str(path),
                           "--log-level", "WARNING"])  # fmt: skip
    url = f"http://127.0.0.1:{port}/healthz"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url, timeout=2):
                    break
            except OSError:
                time.sleep(0.2)
        path.write_text(json.dumps(churned(cfg)))
        waits = []
        start = time.monotonic()
        sent = False
        while time.monotonic() - start < 10:
            if not sent and time.monotonic() - start > 3:
                os.kill(gw.pid, signal.SIGHUP)
                sent = True
            t0 = time.monotonic()
            with urllib.request.urlopen(url, timeout=30) as r:
                r.read()
            waits.append(time.monotonic() - t0)
        waits.sort()
        print(f"{n:,} tenants, {len(waits)} requests: slowest answers "
              + ", ".join(f"{w * 1000:.0f}" for w in waits[-5:][::-1]) + " ms; median "
              f"{waits[len(waits) // 2] * 1000:.1f} ms")  # fmt: skip
    finally:
        gw.terminate()
        gw.wait()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)
