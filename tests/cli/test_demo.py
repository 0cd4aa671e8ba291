"""``kvgate demo``: the same seeded traffic straight to the simulator and through kvgate, a
side-by-side table and one sentence of what kvgate prevented, both built from what was measured.

The end-to-end test runs a shortened demo (``--seconds 8 --speed 20``) as a child process, opens
the live view at the address it prints while the traffic goes through kvgate, and checks every
number of the printed table and sentence against the ``--report`` JSON the same run wrote. The
sentence's rules are checked on their own with made-up numbers both ways, so no outcome is
written into the text.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvgate.demo import RunResult, summary
from kvgate.loadgen import ClassStats


def _table(lines: list[str]) -> tuple[dict[str, tuple[str, str]], int]:
    """The side-by-side table's rows ``{label: (direct, kvgate)}`` and the index of the line
    after it (columns found from the header's positions)."""
    (start,) = [
        i
        for i, line in enumerate(lines)
        if "straight to the engine" in line and "through kvgate" in line
    ]
    header = lines[start]
    c1, c2 = header.index("straight to the engine"), header.index("through kvgate")
    rows: dict[str, tuple[str, str]] = {}
    i = start + 1
    while i < len(lines) and lines[i].strip():
        line = lines[i]
        rows[line[:c1].strip()] = (line[c1:c2].strip(), line[c2:].strip())
        i += 1
    return rows, i


def _ttft(c: dict[str, Any]) -> str:
    if c["ttft_p50_s"] is None:
        return "-"
    return f"{c['ttft_p50_s']:.2f} / {c['ttft_p99_s']:.2f} s"


CLASS_OF = {"chat": "critical", "docs": "standard", "batch": "sheddable"}


@pytest.mark.timeout(400)
async def test_the_demo_compares_the_same_traffic_and_reports_what_it_measured(
    tmp_path: Path,
) -> None:
    report = tmp_path / "report.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgate", "demo", "--seconds", "8", "--speed", "20",
        "--report", str(report),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    seen_live_view = False
    try:
        async with asyncio.timeout(360):
            while raw := await proc.stdout.readline():
                line = raw.decode().rstrip("\n")
                lines.append(line)
                found = re.search(
                    r"live view: (http://127\.0\.0\.1:\d+)/dashboard\?key=(\S+)$", line
                )
                if found and not seen_live_view:
                    # the address works while the traffic runs: the key opens the page and
                    # the cookie it sets opens the data
                    base, key = found.groups()
                    jar = aiohttp.CookieJar(unsafe=True)  # the cookie of an IP-address host
                    async with aiohttp.ClientSession(cookie_jar=jar) as s:
                        async with s.get(f"{base}/dashboard", params={"key": key}) as r:
                            assert r.status == 200
                            assert "/dashboard/dashboard.js" in await r.text()
                        async with s.get(f"{base}/dashboard/data") as r:
                            assert r.status == 200
                            assert [b["name"] for b in (await r.json())["backends"]] == ["sim"]
                    seen_live_view = True
            assert await proc.wait() == 0, "\n".join(lines)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    out = "\n".join(lines)
    assert seen_live_view, out
    # both passes completed: the folder of their logs is gone (kept only when a pass fails)
    logs = re.search(r"\(logs in (\S+), kept only if a pass fails\)", out)
    assert logs is not None, out
    assert not await asyncio.to_thread(os.path.isdir, logs.group(1))
    assert out.index("[1/2] straight to the engine") < out.index("[2/2] through kvgate")
    data = json.loads(report.read_text())
    d, g = data["direct"], data["kvgate"]

    # the same seeded traffic both times, every request accounted for
    assert set(d["classes"]) == set(g["classes"]) == set(CLASS_OF)
    for name in CLASS_OF:
        assert d["classes"][name]["sent"] == g["classes"][name]["sent"] > 0
        for run in (d, g):
            c = run["classes"][name]
            assert c["done"] + c["refused"] + c["errors"] == c["sent"], (name, c)

    # the table is the report, number for number
    rows, after = _table(lines)
    assert rows["engine OOM crashes"] == (str(d["ooms"]), str(g["ooms"]))
    assert rows["engine preemptions"] == (str(d["preemptions"]), str(g["preemptions"]))
    assert rows["requests failed by the engine"] == (str(d["failed"]), str(g["failed"]))
    assert rows["peak KV-cache usage"] == (f"{d['peak_kv']:.2f}", f"{g['peak_kv']:.2f}")
    assert rows["tokens generated"] == (
        f"{d['generated_tokens']:,}",
        f"{g['generated_tokens']:,}",
    )
    for name, cls in CLASS_OF.items():
        dc, gc = d["classes"][name], g["classes"][name]
        head = f"{name} ({cls})"
        assert rows[f"{head}: done / sent"] == (
            f"{dc['done']} / {dc['sent']}",
            f"{gc['done']} / {gc['sent']}",
        )
        assert rows[f"{head}: errors"] == (str(dc["errors"]), str(gc["errors"]))
        assert rows[f"{head}: TTFT p50 / p99"] == (_ttft(dc), _ttft(gc))
        for shown, c in zip(rows[f"{head}: refused or failed (non-2xx)"], (dc, gc), strict=True):
            assert shown.split(" ")[0] == str(c["refused"])
            for reason, n in c["reasons"].items():
                assert f"{reason} {n}" in shown

    # the limits kvgate used, from its own state
    (limits,) = g["limits"].values()
    assert (
        f"kvgate limits (backend sim): {limits['max_concurrency']} slots, "
        f"{limits['tokens_per_minute']:,} tokens/min, in-flight budget "
        f"{limits['inflight_token_limit']:,} tokens"
    ) in out
    assert "tenants: support (critical, 8 guaranteed slots" in out

    # the sentence claims exactly what the numbers show
    (sentence,) = [line for line in lines[after:] if line.startswith("kvgate prevented")]
    claims = 0
    for key, phrase in (
        ("ooms", "engine OOM crashes"),
        ("preemptions", "preemptions"),
        ("failed", "requests failed by the engine"),
    ):
        text = f"{phrase} ({d[key]} → {g[key]})"
        assert (text in sentence) == (g[key] < d[key]), (text, sentence)
        claims += g[key] < d[key]
    d99, g99 = d["classes"]["chat"]["ttft_p99_s"], g["classes"]["chat"]["ttft_p99_s"]
    faster = g99 < 0.9 * d99
    assert (f"(p99 TTFT {d99:.2f} s → {g99:.2f} s)" in sentence) == faster
    claims += faster
    for name, cls in CLASS_OF.items():
        if (n := g["classes"][name]["refused"]) > 0:
            assert f"{n} {cls}" in sentence
    assert sentence.startswith("kvgate prevented nothing measurable") == (claims == 0)
    assert sentence.endswith(".")
    assert sentence.count(". ") == 0


def _result(label: str, *, ooms: int, preempted: int, ttft: float, refused: int) -> RunResult:
    chat = ClassStats(sent=10, ok=10 - refused, ttft=[ttft] * (10 - refused))
    chat.statuses = Counter({503: refused} if refused else {})
    engine = {"kvgate_sim_oom_total": float(ooms), "vllm:num_preemptions_total": float(preempted)}
    return RunResult(label, {"chat": chat}, engine, peak_kv=0.5)


def test_the_sentence_follows_the_numbers_both_ways() -> None:
    direct = _result("direct", ooms=2, preempted=40, ttft=3.0, refused=0)
    gated = _result("kvgate", ooms=0, preempted=0, ttft=0.25, refused=3)
    assert summary(direct, gated) == (
        "kvgate prevented engine OOM crashes (2 → 0), preemptions (40 → 0) and slow critical "
        "first tokens (p99 TTFT 3.00 s → 0.25 s), at the cost of refusing 3 critical requests."
    )
    # other numbers, another sentence: nothing is claimed that the numbers do not show
    worse = _result("kvgate", ooms=2, preempted=41, ttft=2.9, refused=0)
    assert summary(direct, worse) == (
        "kvgate prevented nothing measurable in this run: OOM crashes 2 → 2, preemptions "
        "40 → 41, critical p99 TTFT 3.00 s → 2.90 s."
    )
    only = _result("kvgate", ooms=1, preempted=40, ttft=3.0, refused=0)
    assert summary(direct, only) == "kvgate prevented engine OOM crashes (2 → 1), refusing none."
