"""The store alone, two checkouts side by side: runs the store-alone part of
``benches/replicas/run.py`` (:func:`run.store_decisions`: two ``RedisStore`` objects in one
process taking turns on a tenant whose concurrency limit is 1, 3 ms apart, so each admission is
decided in Redis; then ``PING`` at the same pace) from each checkout in turn, each run in a
fresh process with its own ``redis-server``, the order reversed every other round. Prints, per
checkout, the medians over the rounds of: a decision's p50, the decision's p50 minus the paced
``PING``'s p50 (what the store adds to a round trip), and Redis's own µs per ``FCALL``.

Usage: ``.venv/bin/python benches/replicas/checkouts_ab.py DIR_A DIR_B [--rounds 10]
[--decisions 600]``, where each DIR is a checkout whose extension module is built
(``git worktree add /tmp/base <commit>`` and a copy of ``python/kvgate/_core*.so`` when the
Rust code is the same, else ``make build`` there).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

_ONE_RUN = r"""
import sys, pathlib, tempfile
root = sys.argv[1]
sys.path[:0] = [root, root + "/python"]
import uvloop
import kvgate
assert kvgate.__file__.startswith(root), kvgate.__file__
from benches.replicas import run
from tests.store.redis_servers import start_redis
def p50(v): return sorted(v)[len(v) // 2] * 1e3
with tempfile.TemporaryDirectory(prefix="checkouts-ab-") as tmp, start_redis(pathlib.Path(tmp)) as r:
    d, paced, _, us = uvloop.run(run.store_decisions(r.url, int(sys.argv[2])))
print(p50(d), p50(paced), us if us is not None else -1)
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkouts", nargs=2, type=Path)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--decisions", type=int, default=600)
    args = p.parse_args(argv)
    trees = [str(t.resolve()) for t in args.checkouts]
    got: dict[str, list[tuple[float, float, float]]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            out = subprocess.run(
                [sys.executable, "-c", _ONE_RUN, tree, str(args.decisions)],
                capture_output=True,
                text=True,
                cwd=tree,
                check=False,
            )
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            d, ping, us = (float(x) for x in out.stdout.split())
            got[tree].append((d, ping, us))
    print("| checkout | rounds | decision p50 ms | decision − PING p50 ms | Redis µs per FCALL |")
    print("|---|---|---|---|---|")
    for tree, v in got.items():
        print(
            f"| {tree} | {len(v)} | {statistics.median(x[0] for x in v):.3f} "
            f"| {statistics.median(x[0] - x[1] for x in v):.3f} "
            f"| {statistics.median(x[2] for x in v):.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
