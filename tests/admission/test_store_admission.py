"""What an admission through a shared store holds is given back whatever fails on the way, and
a finished request's early release never breaks the end of its answer."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from kvgate.admission.stage import StoreAdmission
from kvgate.proxy.relay import RelayResult, _ended


class _Reservation:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.released: list[int | None] = []

    def release(self, actual_tokens: int | None = None) -> None:
        self.released.append(actual_tokens)
        if self.fail:
            raise TypeError("not a token count")


class _Store:
    def __init__(self) -> None:
        self.released: list[tuple[Any, int, int]] = []

    def release(self, hold: Any, reserved: int, actual: int) -> None:
        self.released.append((hold, reserved, actual))


def test_the_store_hold_goes_back_even_when_the_core_release_raises() -> None:
    store = _Store()
    admission = StoreAdmission(_Reservation(fail=True), "hold", store, 100)
    with pytest.raises(TypeError):
        admission.release(40)
    assert store.released == [("hold", 100, 40)]
    admission.release(40)  # once only
    assert store.released == [("hold", 100, 40)]


def test_a_failing_early_release_is_logged_and_the_answer_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[str] = []

    async def on_end() -> None:
        calls.append("on_end")
        raise RuntimeError("boom")

    result = RelayResult()
    result.on_end = on_end
    with caplog.at_level(logging.ERROR, logger="kvgate.proxy"):
        asyncio.run(_ended(result))
    assert calls == ["on_end"]
    assert "releasing a finished request before its end failed" in caplog.text

    async def cancelled() -> None:
        raise asyncio.CancelledError

    result.on_end = cancelled
    with pytest.raises(asyncio.CancelledError):  # a client that left still cancels the relay
        asyncio.run(_ended(result))
