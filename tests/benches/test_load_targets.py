"""benches/load/run_load.py: the target rows and their verdicts, from measurements."""

from __future__ import annotations

from benchmod import load

rl = load("run_load", "benches/load/run_load.py")


def m(
    key: str, cpu: float, *, n: int = 1000, secs: float = 1.0, non2xx: int = 0, p50_ms: float = 1.0
):
    target, path = key.split("/")
    return rl.Measure(target, path, 32, n, secs, n / secs, cpu, p50_ms, p50_ms * 2, non2xx, 0)


def test_verdicts_use_the_unrounded_value() -> None:
    assert rl.verdict(1.149, "≤ 1.15×") == "met"
    assert rl.verdict(1.1504, "≤ 1.15×") == "not met"  # prints as 1.15×, still not met
    assert rl.verdict(30.0, "≥ 30×") == "met"
    assert rl.verdict(0.999, "< 1 ms") == "met"
    assert rl.verdict(1.0, "< 1 ms") == "not met"
    assert rl.verdict(2.0, "–") == rl.verdict(None, "≤ 1.2×") == rl.verdict(1.0, "(baseline)") == ""


def test_rows_ratios_and_admitted_rps_count_2xx_only() -> None:
    res = {
        k: m(k, cpu)
        for k, cpu in {
            "bare-429/refuse": 40.0,
            "kvgate-refuse-1w/refuse": 47.0,  # 1.175: met
            "kvgate-refuse-2w/refuse": 49.0,  # 1.225: not met
            "bare-proxy/admit": 200.0,
            "bare-proxy/admit-stream": 200.0,
            "kvgate-1w/admit": 210.0,
            "kvgate-1w/admit-stream": 231.0,  # 1.155: not met (prints 1.16×)
            "kvgate-2w/admit": 220.0,
            "kvgate-2w/admit-stream": 229.0,
        }.items()
    }
    res["litellm/admit"] = m("litellm/admit", 11_000.0, n=40, non2xx=10)  # 30 ok/s
    res["litellm/admit-stream"] = m("litellm/admit-stream", 20_000.0, n=30)
    lat = {k: m(k, 0.0, p50_ms=p) for k, p in {"direct/admit": 0.1, "kvgate-1w/admit": 0.5}.items()}
    rows = {what: (val, target, verdict) for what, val, target, verdict in rl.target_rows(res, lat)}
    assert rows["refusal CPU/request, kvgate 1w ÷ bare-429"] == ("1.18×", "≤ 1.2×", "met")
    assert rows["refusal CPU/request, kvgate 2w ÷ bare-429"] == ("1.23×", "≤ 1.2×", "not met")
    assert rows["admit-stream CPU/request, kvgate 1w ÷ bare-proxy"] == (
        "1.16×",
        "≤ 1.15×",
        "not met",
    )
    assert rows["admit p50 added latency (c=1), kvgate 1w vs direct"] == ("400 µs", "< 1 ms", "met")
    assert rows["admit p50 added latency (c=1), kvgate 2w vs direct"] == ("–", "< 1 ms", "")
    # 1,000 kvgate answers/s against LiteLLM's 30 2xx/s (40 answers, 10 of them non-2xx)
    assert rows["admit admitted (2xx) req/s, kvgate 1w ÷ LiteLLM"] == ("33.33×", "≥ 30×", "met")
