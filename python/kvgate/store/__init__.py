"""Where the limits live: this host (:class:`LocalStore`) or Redis shared by several gateway
replicas (:class:`kvgate.store.redis_store.RedisStore`).

The admission stage asks the store after the admission core admitted a request: the core keeps
this process's (or this host's, with ``--workers N``) view of every limit, the store makes the
limits hold across replicas. Stages of the request path see only :class:`Store`:

- :meth:`Store.try_admit` (no await): a hold taken from what this replica already holds, or
  ``None`` when the store must be asked (:meth:`Store.admit`, which awaits at most the store's
  deadline);
- :meth:`Store.release`: the hold given back with the tokens the request is charged;
  :meth:`Store.flushed`: awaited, while :attr:`Store.unsent`, before the client learns that its
  request ended (its next request, on any replica, then finds the slot given back).

The local store holds nothing and admits everything: the core alone decides, as before there
were replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["LOCAL_HOLD", "LocalStore", "Store", "StoreRefusal"]


@dataclass(frozen=True, slots=True)
class StoreRefusal:
    """A refusal decided by the store (the limit held across replicas, or the store's
    fallback): the same attributes as the core's ``Rejection``.

    Attributes:
        reason: the limit that refused (``tenant-concurrency``, ``tenant-tpm``,
            ``backend-slots``, ``inflight-tokens``, ``backend-tpm``, ``shed``) or
            ``store-unavailable`` (Redis could not be reached and the policy is ``closed``).
        scope: ``tenant`` (HTTP 429) or ``backend`` (HTTP 503).
        retry_after: seconds until a retry may succeed (``None``: never).
        never: the request can never be admitted.
        remaining: units left under the refusing limit across the replicas as the store
            knows them (slots, or tokens in its bucket), or ``None``: the refusal's
            ``x-ratelimit-remaining-*`` header then says this one where this replica's core
            says its own share.
        reset_after: seconds until the refusing token bucket is full again, or ``None``.
        note: how it was decided when not by the limit across the replicas (by this replica
            alone while Redis did not answer), for the error message; or ``None``.
    """

    reason: str
    scope: str = "backend"
    retry_after: float | None = 1.0
    never: bool = False
    admitted: bool = False
    remaining: int | None = None
    reset_after: float | None = None
    note: str | None = None


class Store(Protocol):
    """What the admission stage needs of a store (see the module docstring)."""

    mode: str

    def try_admit(self, backend: Any, tenant: Any, priority: str, tokens: int) -> Any | None:
        """A hold on ``tokens`` (prompt + reserved completion) and one slot, from what this
        replica holds, or ``None`` when the store must be asked."""

    async def admit(
        self, backend: Any, tenant: Any, priority: str, tokens: int
    ) -> Any | StoreRefusal:
        """A hold, or the refusal; waits at most the store's deadline."""

    def release(self, hold: Any, reserved: int, actual: int) -> None:
        """Gives the hold back: the slots, the in-flight tokens, and ``reserved - actual``
        tokens (refunded, or charged when negative)."""

    @property
    def unsent(self) -> bool:
        """Whether a release may not have reached the other replicas' view yet (then await
        :meth:`flushed` before the client can learn that its request ended)."""

    async def flushed(self) -> None:
        """Waits (briefly: at most the store's deadline) until what the releases gave back is
        in the shared store, where the other replicas' next decisions see it."""

    async def start(self, backends: Sequence[str] = ()) -> None:
        """Connects (called once the event loop runs); ``backends``: the configured backends'
        names (a shared store joins their scopes)."""

    def reload(self) -> None:
        """The base limits changed (a reload, a limit discovered from the engine)."""

    def adopt_running(self, tenant: str, running: Callable[[], int]) -> None:
        """A reload gave ``tenant`` a concurrency limit it did not have: count its requests
        from before against it (``running``: how many of them still run here)."""

    async def close(self) -> None:
        """Gives back what this replica holds and disconnects."""


class _LocalHold:
    __slots__ = ()


#: The hold of the local store: it holds nothing.
LOCAL_HOLD = _LocalHold()


class LocalStore:
    """The limits of this host only: the admission core decides alone (no store)."""

    mode = "local"

    def try_admit(self, backend: Any, tenant: Any, priority: str, tokens: int) -> Any:
        """Always :data:`LOCAL_HOLD`."""
        return LOCAL_HOLD

    async def admit(self, backend: Any, tenant: Any, priority: str, tokens: int) -> Any:
        """Always :data:`LOCAL_HOLD`."""
        return LOCAL_HOLD

    def release(self, hold: Any, reserved: int, actual: int) -> None:
        """Nothing to give back."""

    #: the core's release is seen at once by every worker of this host
    unsent = False

    async def flushed(self) -> None:
        """Nothing is on its way anywhere."""

    async def start(self, backends: Sequence[str] = ()) -> None:
        """Nothing to connect."""

    def reload(self) -> None:
        """Nothing to forget."""

    def adopt_running(self, tenant: str, running: Callable[[], int]) -> None:
        """Nothing to do: the core counts every running request of the tenant."""

    async def close(self) -> None:
        """Nothing to close."""

    def state(self, tenants: Iterable[str] | None = None) -> dict[str, Any]:
        """``/admin/state``'s ``store`` entry (``tenants``: the names listed; nothing here is
        per tenant)."""
        return {"mode": "local"}

    def inflight_allocated(self, backend: str) -> int | None:
        """Always ``None``: this host's in-flight tokens are the core's own."""
        return None
