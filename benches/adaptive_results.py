"""Write the "Adaptive limits vs preemptions" section of ``benches/RESULTS.md``.

Runs the end-to-end test that sends one burst three ways to the simulator in ``preempt`` mode
(``tiny`` profile: 2,048 KV tokens; 12 requests of ~190 prompt + 300 generated tokens) — straight
to the engine, through kvgate with adaptation and the discovered in-flight budget, and through
kvgate with adaptation off — reads the figures it prints and replaces only that section.

Usage: ``python benches/adaptive_results.py [--no-write]`` (``make bench`` runs it).
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core_results import RESULTS, replace_section

SECTION = "## Adaptive limits vs preemptions"
CMD = [
    sys.executable,
    "-m",
    "pytest",
    "tests/gateway/test_adaptive.py",
    "-k",
    "preempt",
    "-s",
    "-q",
    "-p",
    "no:randomly",
]
LABELS = {
    "direct": "straight to the engine",
    "adaptive": "through kvgate, adaptation on (in-flight budget discovered from the engine)",
    "off": "through kvgate, adaptation off (static limits)",
}


def parse(output: str) -> list[dict[str, Any]]:
    """The three result dicts the test prints after its ``preempt burst:`` line."""
    lines = output.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("preempt burst:"))
    return [ast.literal_eval(ln.strip()) for ln in lines[start + 1 : start + 4]]


# the test's request shape (tests/gateway/test_adaptive.py: PROMPT, max_tokens)
PROMPT_TOKENS = 190
GENERATED_TOKENS = 300


def _closing(rows: list[dict[str, Any]]) -> str:
    """The sentence under the table, from the figures in ``rows``."""
    by = {str(r["mode"]): r for r in rows}
    if all(r["ok"] == r["sent"] for r in rows):
        done = (
            "Every request completes on every path (preemption only delays, kvgate's queue only "
            "waits)"
        )
    else:
        done = "Completed: " + ", ".join(
            f"{r['ok']} of {r['sent']} {LABELS.get(str(r['mode']), r['mode'])}" for r in rows
        )
    ad = by.get("adaptive")
    if ad is None:
        return done + "."
    others = "; ".join(
        f"{r['preemptions']} {LABELS.get(m, m).split(' (')[0]}"
        for m, r in by.items()
        if m != "adaptive"
    )
    pre = int(ad["preemptions"])
    what = "without a single preemption" if pre == 0 else f"with {pre} preemption(s)"
    return (
        f"{done}; with adaptation kvgate kept {float(ad['mean_running']):.2f} requests "
        f"running on average {what}" + (f" (preemptions: {others})." if others else ".")
    )


def section(rows: list[dict[str, Any]]) -> str:
    """The RESULTS.md section for ``rows`` (each with ``mode``, ``sent``, ``ok``,
    ``preemptions``, ``peak_kv``, ``mean_running``, ``seconds``).

    Raises:
        ValueError: a row lacks one of those keys (e.g. output of an older test without
            ``sent``).
    """
    keys = ("mode", "sent", "ok", "preemptions", "peak_kv", "mean_running", "seconds")
    for r in rows:
        missing = [k for k in keys if k not in r]
        if missing:
            raise ValueError(f"result row {r!r} lacks {', '.join(missing)}")
    sent = sorted({int(r["sent"]) for r in rows})
    n_text = " / ".join(str(n) for n in sent)
    total = max(sent) * (PROMPT_TOKENS + GENERATED_TOKENS)
    table = "\n".join(
        f"| {LABELS.get(str(r['mode']), r['mode'])} | {r['ok']} of {r['sent']} | "
        f"{r['preemptions']} | {float(r['peak_kv']):.2f} | "
        f"{float(r['mean_running']):.2f} | {r['seconds']} |"
        for r in rows
    )
    return f"""{SECTION}

Written by `make bench` (`benches/adaptive_results.py`), from the end-to-end test

```
.venv/bin/python -m pytest tests/gateway/test_adaptive.py -k preempt -s -q -p no:randomly
```

One burst, sent three ways to `kvgate sim` in `preempt` mode (`tiny` profile: 128 blocks × 16 =
2,048 KV tokens, speed 20): {n_text} requests of ~{PROMPT_TOKENS} prompt tokens and {GENERATED_TOKENS} generated
tokens each (`ignore_eos`), about {total:,} tokens against 2,048. Peak KV is the simulator's
high-water mark; "mean running" is the engine's running requests, sampled every ~10 ms, averaged
over the samples in which at least one request was running (samples with none running, e.g.
while the gateway starts, are left out); seconds are wall time.

| path | completed | preemptions | peak KV | mean running | seconds |
|---|---|---|---|---|---|
{table}

{_closing(rows)}
"""


def main(argv: list[str] | None = None) -> int:
    """Run the test, print the section, write it unless ``--no-write``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    root = RESULTS.parent.parent
    done = subprocess.run(CMD, cwd=root, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
        return 1
    body = section(parse(done.stdout))
    print(body)
    if not args.no_write:
        RESULTS.write_text(replace_section(RESULTS.read_text(), SECTION, body))
        print(f"wrote {SECTION!r} in benches/RESULTS.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
