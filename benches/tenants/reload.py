"""How long a gateway holding N tenants takes to start and to reload (SIGHUP's
:meth:`kvgate.app.Gateway.reload`): its configuration as JSON (``benches/tenants/run.py``'s),
the reload dropping 100 tenants and adding 100; then the reload's two parts timed alone
(reading and checking the file, applying it). A reload runs on the event loop: for its
duration the gateway answers nothing.

Usage: ``.venv/bin/python benches/tenants/reload.py [N]`` (default 100,000)
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "load"))

from run import config, sha  # noqa: E402

from kvgate.config import load_config  # noqa: E402
from kvgate.gateway_build import apply_config, build_gateway  # noqa: E402


def churned(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` (:func:`run.config`) with its first 100 tenants removed and 100 new ones."""
    new = [
        {"name": f"n{i}", "api_key_sha256": [sha(f"sk-n{i}")], "max_concurrency": 5}
        for i in range(100)
    ]
    return {**cfg, "tenants": cfg["tenants"][100:] + new}


def main(n: int) -> None:
    cfg = config("http://127.0.0.1:9", 9, n, None)
    path = Path(tempfile.mkdtemp()) / "kvgate.json"
    path.write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    gw = build_gateway(load_config(path), config_path=str(path), poll=False)
    print(f"{n:,} tenants: read, checked and built in {time.perf_counter() - t0:.2f} s")
    path.write_text(json.dumps(churned(cfg)))
    t0 = time.perf_counter()
    assert gw.reload()
    print(f"reload (100 tenants out, 100 in): {time.perf_counter() - t0:.2f} s")
    t0 = time.perf_counter()
    new = load_config(path)
    t1 = time.perf_counter()
    apply_config(gw, new)
    t2 = time.perf_counter()
    print(f"  of which reading and checking the file {t1 - t0:.2f} s, applying it {t2 - t1:.2f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)
