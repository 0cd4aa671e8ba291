"""benches/adaptive_results.py reads the e2e test's printed figures into its RESULTS.md section."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from benchmod import load

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches"))
adaptive_results = load("adaptive_results", "benches/adaptive_results.py")

OUTPUT = """.
preempt burst:
  {'mode': 'direct', 'sent': 12, 'ok': 12, 'preemptions': 11, 'peak_kv': 1.0, 'mean_running': 4.9, 'seconds': 1.8}
  {'mode': 'adaptive', 'sent': 12, 'ok': 12, 'preemptions': 0, 'peak_kv': 0.7, 'mean_running': 3.0, 'seconds': 2.7}
  {'mode': 'off', 'sent': 12, 'ok': 12, 'preemptions': 9, 'peak_kv': 1.0, 'mean_running': 4.8, 'seconds': 1.9}
.
1 passed in 7.7s
"""


def test_parse_and_section() -> None:
    rows = adaptive_results.parse(OUTPUT)
    assert [r["mode"] for r in rows] == ["direct", "adaptive", "off"]
    body = adaptive_results.section(rows)
    assert body.startswith(adaptive_results.SECTION)
    assert "| straight to the engine | 12 of 12 | 11 | 1.00 | 4.90 | 1.8 |" in body
    assert "| through kvgate, adaptation off (static limits) | 12 of 12 | 9 |" in body
    # the request count and the token total come from the rows, not fixed text
    assert "speed 20): 12 requests of ~190 prompt tokens" in body
    assert "about 5,880 tokens against 2,048" in body
    # what "mean running" averages is said exactly
    flat = " ".join(body.split())
    assert "averaged over the samples in which at least one request was running" in flat
    assert body.rstrip().endswith(
        "Every request completes on every path (preemption only delays, kvgate's queue only "
        "waits); with adaptation kvgate kept 3.00 requests running on average without a single "
        "preemption (preemptions: 11 straight to the engine; 9 through kvgate, adaptation off)."
    )


def test_closing_sentence_follows_the_data() -> None:
    rows = [
        {"mode": "direct", "sent": 10, "ok": 8, "preemptions": 5, "peak_kv": 1.0},
        {"mode": "adaptive", "sent": 10, "ok": 10, "preemptions": 2, "peak_kv": 0.8},
    ]
    for r in rows:
        r |= {"mean_running": 2.5, "seconds": 1.0}
    body = adaptive_results.section(rows)
    assert "Every request completes" not in body
    assert "Completed: 8 of 10 straight to the engine, 10 of 10 through kvgate" in body
    assert "with 2 preemption(s) (preemptions: 5 straight to the engine)." in body
    assert "speed 20): 10 requests" in body
    assert "| straight to the engine | 8 of 10 | 5 |" in body


def test_rows_without_sent_are_refused() -> None:
    old = OUTPUT.replace("'sent': 12, ", "")
    with pytest.raises(ValueError, match="lacks sent"):
        adaptive_results.section(adaptive_results.parse(old))
