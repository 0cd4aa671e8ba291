"""A refusal decided in Python rather than by the admission core."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Refusal"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """A refusal decided in Python (queue full, shed while waiting, wait timed out before the
    core was asked); mirrors the core's ``Rejection`` (``admitted``, ``reason``, ``scope``,
    ``retry_after`` seconds or ``None``, ``never``); ``remaining``, ``reset_after`` and ``note``
    as :class:`kvgate.store.StoreRefusal` has them (``None`` here: the core's view)."""

    reason: str
    scope: str = "backend"
    retry_after: float | None = 1.0
    never: bool = False
    admitted: bool = False
    remaining: int | None = None
    reset_after: float | None = None
    note: str | None = None
