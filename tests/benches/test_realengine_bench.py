"""benches/realengine/run.py: metric parsing, the burst summary (percentiles), the disconnect
arithmetic and the RESULTS.md section, on fixed inputs (the run itself is reported, not tested)."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmod import load

rb = load("realengine_run", "benches/realengine/run.py")

METRICS = """# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 12
llamacpp:requests_deferred_total_not_this 99
kvgate_queue_depth{class="critical"} 1
kvgate_queue_depth{class="standard"} 4
"""


def test_metric_sum_adds_labelled_samples_and_ignores_longer_names() -> None:
    assert rb.metric_sum(METRICS, "llamacpp:requests_deferred") == 12.0
    assert rb.metric_sum(METRICS, "kvgate_queue_depth") == 5.0
    assert rb.metric_sum(METRICS, "absent") == 0.0


def test_summary_percentiles_and_cells() -> None:
    b = rb.Burst("kvgate", 16, ttft_s=[float(v) for v in range(16, 0, -1)], completed=15)
    b.status_5xx, b.other_errors, b.engine_queue_peak, b.kvgate_queue_peak = 0, 1, 0.0, 12.0
    b.wall_s = 6.25
    s = rb.summarize(b)
    # index round(0.5 * 15) = 8 (halves to even) of 1..16 → 9; round(0.99 * 15) = 15 → 16
    assert (s["ttft_p50"], s["ttft_p99"]) == ("9.00", "16.00")
    assert s["completed"] == "15 / 16"
    assert (s["5xx"], s["other"], s["engine_queue"], s["kvgate_queue"]) == ("0", "1", "0", "12")
    assert s["wall"] == "6.2"  # 6.25 rounds half to even
    direct = rb.summarize(rb.Burst("direct", 16))
    assert (direct["ttft_p50"], direct["kvgate_queue"]) == ("–", "–")


def test_tokens_after_the_disconnect_never_negative() -> None:
    d = rb.Disconnect("direct", 4, 400, growth=1600.0, before_disconnect=207)
    assert d.after_disconnect == 1393.0
    # the engine counts a request when it ends: growth may lag what /slots showed decoded
    assert (
        rb.Disconnect("kvgate", 4, 400, growth=200.0, before_disconnect=224).after_disconnect == 0
    )


def _section() -> str:
    bursts = [
        rb.Burst("direct", 16, ttft_s=[1.0, 2.0], completed=16, engine_queue_peak=12.0),
        rb.Burst("kvgate", 16, ttft_s=[0.5], completed=16, kvgate_queue_peak=12.0),
    ]
    discs = [
        rb.Disconnect("direct", 4, 400, growth=1600.0, before_disconnect=207),
        rb.Disconnect("kvgate", 4, 400, growth=228.0, before_disconnect=224),
    ]
    meta = {
        "model": "tiny",
        "disconnect_model": "slow",
        "slots": 4,
        "ctx": 4096,
        "requests": 16,
        "max_tokens": 400,
        "disconnects": 4,
        "disconnect_after": 1.0,
        "poll": 0.1,
        "command": "make bench-realengine",
    }
    text: str = rb.render(bursts, discs, meta, "2026-12-01 22:28 UTC")
    return text


def test_render_names_the_command_time_and_rows() -> None:
    text = _section()
    assert text.startswith(rb.SECTION + "\n")
    assert "`make bench-realengine` (2026-12-01 22:28 UTC)" in text
    assert "| direct | 1.00 | 2.00 | 16 / 16 | 0 | 0 | 12 | – | 0.0 |" in text
    assert "| kvgate | 0.50 | 0.50 | 16 / 16 | 0 | 0 | 0 | 12 | 0.0 |" in text
    assert "| direct | 1600 | 207 | 1393 | 1600 |" in text
    assert "| kvgate | 228 | 224 | 4 | 1600 |" in text


def test_write_section_replaces_only_its_own_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Other\n\nkept\n")
    monkeypatch.setattr(rb, "RESULTS", results)
    rb.write_section(_section())
    first = results.read_text()
    assert first.startswith("# Benchmark results\n\n## Other\n\nkept\n\n" + rb.SECTION)
    results.write_text(first + "\n## Later\n\nalso kept\n")
    rb.write_section(_section().replace("1393", "7"))
    again = results.read_text()
    assert again.count(rb.SECTION) == 1
    assert "| direct | 1600 | 207 | 7 | 1600 |" in again
    assert "1393" not in again
    assert again.endswith("## Later\n\nalso kept\n")
