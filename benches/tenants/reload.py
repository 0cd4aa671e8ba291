"""How long a gateway holding N tenants takes to start and to reload (SIGHUP's
:meth:`kvgate.app.Gateway.reload`): its configuration as JSON (``benches/tenants/run.py``'s),
the reload dropping 100 tenants and adding 100; then the reload's three parts timed alone
(reading and checking the file; trying its limits on a scratch core and working out what
changes; applying the changes). At SIGHUP the first two run on a worker thread; the applying
runs on the event loop, and for its duration the gateway answers nothing.

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
from kvgate.gateway_build import apply_config, build_gateway, prepare_reload  # noqa: E402


def churned(cfg: dict[str, Any], tag: str = "n") -> dict[str, Any]:
    """``cfg`` (:func:`run.config`) with its first 100 tenants removed and 100 new ones
    (``<tag>0`` ...)."""
    new = [
        {"name": f"{tag}{i}", "api_key_sha256": [sha(f"sk-{tag}{i}")], "max_concurrency": 5}
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
    path.write_text(json.dumps(churned(churned(cfg), "m")))  # 100 more out, 100 more in
    t0 = time.perf_counter()
    new = load_config(path)
    t1 = time.perf_counter()
    plan = prepare_reload(gw, new)
    t2 = time.perf_counter()
    apply_config(gw, plan)
    t3 = time.perf_counter()
    print(
        f"  of which reading and checking the file {t1 - t0:.2f} s, trying its limits and "
        f"working out the changes {t2 - t1:.2f} s (both on a worker thread at SIGHUP), "
        f"applying them {t3 - t2:.2f} s (on the event loop)"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)
