"""benches/core_results.py: the RESULTS.md section rewriting and the figures it derives."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmod import load

ROOT = Path(__file__).resolve().parents[2]
cr = load("core_results", "benches/core_results.py")

DOC = (
    "# Benchmark results\n\n"
    "## Admission core\n\nold core\n\n| a | b |\n|---|---|\n\n"
    "## Request analysis\n\nold analysis\n### sub heading stays inside\n\n"
    "## Gateway load\n\nload  text with  spaces \r\nand a CRLF line\n\n"
    "## Protection scenario\n\nlast section, no trailing newline"
)


def test_replace_one_section_keeps_the_others_byte_identical() -> None:
    body = "## Request analysis\n\nnew figures\n"
    out = cr.replace_section(DOC, "## Request analysis", body)
    before, after = DOC.split("## Request analysis")[0], DOC.split("old analysis\n")[1]
    after = after[after.index("## Gateway load") :]
    assert out == before + body + "\n" + after
    assert "old analysis" not in out
    assert "sub heading stays inside" not in out  # ### belongs to the replaced section


def test_replace_last_section_and_append_missing_one() -> None:
    out = cr.replace_section(DOC, "## Protection scenario", "## Protection scenario\nX\n\n")
    assert out == DOC[: DOC.index("## Protection")] + "## Protection scenario\nX\n"
    added = cr.replace_section(DOC, "## New section", "## New section\n\nY")
    assert added == DOC + "\n\n## New section\n\nY\n"


def test_rewriting_the_real_results_file_with_its_own_text_changes_nothing() -> None:
    text = (ROOT / "benches/RESULTS.md").read_text()
    for heading in (cr.CORE_HEADING, cr.ANALYZE_HEADING):
        start = text.index(heading + "\n")
        end = text.index("\n## ", start + len(heading))
        own = text[start:end].rstrip("\n") + "\n"
        assert cr.replace_section(text, heading, own) == text


def test_bad_bodies_and_duplicate_headings_raise() -> None:
    with pytest.raises(ValueError, match="must start with"):
        cr.replace_section(DOC, "## Admission core", "## Something else\n")
    twice = DOC + "\n## Admission core\n"
    with pytest.raises(ValueError, match="occurs 2 times"):
        cr.replace_section(twice, "## Admission core", "## Admission core\n")


def _stats(
    rust_s: float, ref_s: float, tenants: tuple[float, float] = (100e-6, 104e-6)
) -> dict[str, object]:
    out: dict[str, object] = {}
    for _, rust, ref, _, _ in cr.CORE_GROUPS:
        out[rust] = cr.Stat(
            min=rust_s, median=rust_s * 1.1, rounds=10, extra={"pairs_per_call": 1000}
        )
        out[ref] = cr.Stat(min=ref_s, median=ref_s * 1.1, rounds=10, extra={})
    for name, t in zip(cr.TENANT_BENCHES, tenants, strict=True):
        out[name] = cr.Stat(min=t, median=t * 1.1, rounds=10, extra={"pairs_per_call": 1000})
    return out


def test_tenant_count_row_and_its_verdict() -> None:
    run = cr.parse_rust(
        "rust admit+release: 5000000 pairs in 1.259 s = 3972832 pairs/s (251.7 ns/pair)\n"
        "rust floor: atomic read-modify-write 5.50 ns, "
        "clock_gettime(CLOCK_MONOTONIC_COARSE) 6.00 ns (CLOCK_MONOTONIC 20.00 ns)\n"
    )
    met = cr.core_section(_stats(250e-6, 3e-3), [run], "CMD", "MACHINE", "now")
    assert "| 10 | 100 ns / 110 ns | 10.00 M / 9.09 M |" in met
    assert "| 100,000 | 104 ns / 114 ns |" in met
    assert "1.04× / 1.04× (min / median) what 10 cost: within 10%: **met**" in " ".join(met.split())
    missed = cr.core_section(_stats(250e-6, 3e-3, (100e-6, 120e-6)), [run], "CMD", "M", "now")
    assert "1.20× / 1.20× (min / median) what 10 cost: within 10%: **not met**" in " ".join(
        missed.split()
    )


def test_core_section_figures_and_verdicts() -> None:
    line = "rust admit+release: 5000000 pairs in 1.259 s = 3972832 pairs/s (251.7 ns/pair)"
    floor = (
        "rust floor: atomic read-modify-write 5.50 ns, "
        "clock_gettime(CLOCK_MONOTONIC_COARSE) 6.00 ns (CLOCK_MONOTONIC 20.00 ns)"
    )
    run = cr.parse_rust("noise\n" + line + "\n." + floor + "\n")
    assert (run.pairs, run.rate, run.ns, run.line) == (5_000_000, 3_972_832.0, 251.7, line)
    assert (run.rmw_ns, run.clock_ns, run.precise_clock_ns, run.floor_line) == (
        5.5,
        6.0,
        20.0,
        floor,
    )
    # 1,000 pairs in 250 µs = 4 M pairs/s, reference 12x slower: both targets met.
    met = cr.core_section(_stats(250e-6, 3e-3), [run], "CMD", "MACHINE", "now")
    assert met.startswith(cr.CORE_HEADING + "\n")
    assert "| 12.00× / 12.00× | 4.00 M / 3.64 M |" in met
    assert "not met" not in met
    assert "Why admit+release" not in met
    # the shared-memory row is shown for comparison, with no verdict of its own
    assert "shared-memory controller (`AdmissionController(shm_name=...)`" in met
    assert "(12.00× / 12.00× the reference)" in " ".join(met.split())
    assert "shared memory 12.00×" not in met
    # 1,000 pairs in 600 µs = 1.67 M pairs/s, reference 5x slower: neither met from Python.
    missed = cr.core_section(_stats(600e-6, 3e-3), [run], "CMD", "MACHINE", "now")
    prose = missed.split("```")[::2]  # outside the code blocks (commands are never wrapped)
    assert max(len(ln) for p in prose for ln in p.splitlines() if not ln.startswith("|")) <= 100
    assert f"```\n{cr.display(cr.RUST_CMD)}\n{line}\n{floor}\n```" in missed  # never wrapped
    missed = " ".join(missed.split())  # prose is wrapped at 100 columns
    assert "admit+release 5.00× / 5.00× (min / median): **not met**" in missed
    assert "from Python **not met** on the best round (1.67 M/s)" in missed
    # 10x of 3,000 ns allows 300 ns; 600 ns from Python = 252 in Rust + 348 on the Python side.
    assert "best round allows 300 ns per pair from Python" in missed
    assert "takes 600 ns: 252 ns in the Rust core alone" in missed
    assert "about 348 ns on the Python side" in missed
    assert "One clock reading takes 6.0 ns of the core's part" in missed
    assert "adds 12 locked read-modify-writes at about 5.5 ns each" in missed
    with pytest.raises(cr.BenchError, match="cargo output"):
        cr.parse_rust("test result: ok")
    with pytest.raises(cr.BenchError, match="rust floor"):
        cr.parse_rust(line)
