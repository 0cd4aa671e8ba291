"""``repr()`` of the native classes reads as Python: ``None`` / ``True`` / ``1.0`` and strings
quoted as Python's ``repr`` quotes them, never Rust's ``Some(..)``, ``true`` or ``"..."``."""

from __future__ import annotations

import json

import pytest

from kvgate import (
    AdaptiveLaw,
    AdmissionController,
    AnalysisError,
    ManualClock,
    Rejection,
    RequestAnalyzer,
    Reservation,
)

# a model name Python quotes with double quotes and escapes (Rust's Debug would not)
ODD_MODEL = "o'neil\tm\u00e9"


@pytest.fixture
def ctl() -> AdmissionController:
    return AdmissionController(clock=ManualClock())


def test_rejection_repr(ctl: AdmissionController) -> None:
    b = ctl.add_backend("b", max_concurrency=1, tokens_per_minute=6000, inflight_token_limit=1000)
    t = ctl.add_tenant("t", priority="standard", tokens_per_minute=600, max_concurrency=5)
    never = ctl.admit(b, t, "standard", 601)
    assert isinstance(never, Rejection)
    assert never.retry_after is None
    assert repr(never) == "Rejection(reason='tenant-tpm', scope='tenant', retry_after=None)"
    held = ctl.admit(b, t, "standard", 10)
    assert isinstance(held, Reservation)
    busy = ctl.admit(b, t, "standard", 10)
    assert isinstance(busy, Rejection)
    assert isinstance(busy.retry_after, float)
    assert repr(busy) == (
        f"Rejection(reason={busy.reason!r}, scope={busy.scope!r}, retry_after={busy.retry_after!r})"
    )
    assert "Some(" not in repr(busy)
    assert '"' not in repr(busy)
    held.release(10)


def test_reservation_repr(ctl: AdmissionController) -> None:
    b = ctl.add_backend("b", max_concurrency=4, tokens_per_minute=6000, inflight_token_limit=1000)
    t = ctl.add_tenant("t", priority="standard", tokens_per_minute=600)
    r = ctl.admit(b, t, "standard", 100)
    assert isinstance(r, Reservation)
    assert repr(r) == (
        f"Reservation(backend={b}, tenant={t}, tokens=100, pool={r.pool!r}, released=False)"
    )
    assert r.pool in ("guaranteed", "burst")
    r.release(100)
    assert repr(r).endswith(", released=True)")


def test_controller_and_law_repr(ctl: AdmissionController) -> None:
    assert repr(ctl) == "AdmissionController(backends=0, tenants=0, shm_name=None)"
    law = AdaptiveLaw(clock=ManualClock())
    assert repr(law) == f"AdaptiveLaw(scale={round(law.scale, 3)!r}, shedding=False)"
    assert repr(law) == "AdaptiveLaw(scale=1.0, shedding=False)"


def test_analyzer_analysis_and_error_repr() -> None:
    analyzer = RequestAnalyzer(model=ODD_MODEL, context_window=1000)
    assert repr(analyzer) == (
        f"RequestAnalyzer(model={ODD_MODEL!r}, context_window=1000, tokenizer=False, "
        "chat_template=False)"
    )
    body = {"model": ODD_MODEL, "prompt": "hello there", "max_tokens": 5}
    a = analyzer.analyze("/v1/completions", json.dumps(body).encode())
    assert repr(a) == (
        f"Analysis(model={ODD_MODEL!r}, route='/v1/completions', prompt_tokens={a.prompt_tokens}, "
        f"completion_tokens=5, n=1, stream=False, include_usage=False, addable=False, "
        f"reserved_tokens={a.reserved_tokens}, inject_max_tokens=None, "
        f"counting={a.counting!r}, drop_cap=None)"
    )
    with pytest.raises(AnalysisError) as caught:
        analyzer.analyze("/v1/completions", b"{not json")
    e = caught.value
    assert repr(e) == (
        f"AnalysisError(status={e.status}, type={e.type!r}, param={e.param!r}, "
        f"code={e.code!r}, message={e.message!r})"
    )
    assert "Some(" not in repr(e)
