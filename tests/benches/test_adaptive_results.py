"""benches/adaptive_results.py reads the e2e test's printed figures into its RESULTS.md section."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches"))
_spec = importlib.util.spec_from_file_location(
    "adaptive_results", ROOT / "benches/adaptive_results.py"
)
assert _spec is not None
assert _spec.loader is not None
adaptive_results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(adaptive_results)

OUTPUT = """.
preempt burst:
  {'mode': 'direct', 'ok': 12, 'preemptions': 11, 'peak_kv': 1.0, 'mean_running': 4.9, 'seconds': 1.8}
  {'mode': 'adaptive', 'ok': 12, 'preemptions': 0, 'peak_kv': 0.7, 'mean_running': 3.0, 'seconds': 2.7}
  {'mode': 'off', 'ok': 12, 'preemptions': 9, 'peak_kv': 1.0, 'mean_running': 4.8, 'seconds': 1.9}
.
1 passed in 7.7s
"""


def test_parse_and_section() -> None:
    rows = adaptive_results.parse(OUTPUT)
    assert [r["mode"] for r in rows] == ["direct", "adaptive", "off"]
    body = adaptive_results.section(rows)
    assert body.startswith(adaptive_results.SECTION)
    assert "| straight to the engine | 12 | 11 | 1.00 | 4.90 | 1.8 |" in body
    assert "| through kvgate, adaptation off (static limits) | 12 | 9 |" in body
