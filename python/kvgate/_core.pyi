"""Stubs and user docs for the native module ``kvgate._core`` (rust/src/python.rs).

Units: tokens (prompt + completion tokens of the model's tokenizer), slots (requests in flight),
seconds (floats), nanoseconds (``*_ns`` ints), ratios 0..1. Every amount is an ``int`` in
``0..=MAX_AMOUNT`` (2**62): a negative or larger int raises :class:`InvalidAmountError`; a
``float``, ``bool`` or ``None`` raises ``TypeError``. Zero is a valid no-op. A refusal on the hot
path is a value (``False`` or a :class:`Rejection`), never an exception; exceptions are for bad
arguments and configuration only.
"""

from types import TracebackType
from typing import Literal

__version__: str
MAX_AMOUNT: int
"""Largest accepted amount (2**62 tokens or slots)."""
MAX_BACKENDS: int
"""Backends one controller (region) can hold (32)."""
MAX_TENANTS: int
"""Tenants one controller (region) can hold (256)."""
MAX_PROCS: int
"""Processes that can attach to one shared region at a time (64)."""
REGION_SIZE: int
"""Size of the shared-memory region in bytes."""
REASONS: tuple[str, ...]
"""Every :attr:`Rejection.reason` label."""

PriorityClass = Literal["critical", "standard", "sheddable"]
RejectReason = Literal[
    "tenant-tpm", "tenant-concurrency", "backend-slots", "backend-tpm", "inflight-tokens", "shed"
]

class CoreError(Exception):
    """Base of every error raised by the admission core."""

class InvalidAmountError(CoreError, ValueError):
    """A token/slot amount is negative or above ``MAX_AMOUNT`` (2**62)."""

class NeverAdmissibleError(CoreError, ValueError):
    """More than the limit can ever hold (e.g. more tokens than a whole bucket): retrying can
    never succeed."""

    requested: int
    """The amount asked for."""
    limit: int
    """The largest amount the limit can ever grant."""

class OverReleaseError(CoreError, ValueError):
    """A release of more than is held; nothing is changed."""

class InvalidConfigError(CoreError, ValueError):
    """An invalid configuration value or an unknown backend/tenant id."""

class SharedStateError(CoreError, OSError):
    """The shared-memory region could not be created, attached or validated."""

class ManualClock:
    """A test clock: time moves only when :meth:`advance` is called. Pass it as ``clock=`` to
    any limiter or controller so refill and recovery are tested without sleeping."""

    def __init__(self, start_ns: int = 0) -> None: ...
    def advance(self, seconds: float) -> None:
        """Moves the clock forward by ``seconds`` (finite, >= 0; else ``ValueError``)."""
    def advance_ns(self, ns: int) -> None:
        """Moves the clock forward by ``ns`` nanoseconds."""
    @property
    def now_ns(self) -> int:
        """The current reading in nanoseconds."""

class SlotPool:
    """A lock-free pool of concurrency slots (compare-and-swap on one counter).

    ``in_use`` is never above the limit in force when a slot was taken and never negative.
    Lowering :attr:`limit` never cancels what is in flight; it only blocks new acquires until
    ``in_use`` drops below it. ``clock`` is accepted for a uniform constructor and unused.

    Raises: ``InvalidAmountError`` / ``TypeError`` for a bad ``limit``.
    """

    def __init__(self, limit: int, *, clock: ManualClock | None = None) -> None: ...
    def try_acquire(self, n: int = 1) -> bool:
        """Takes ``n`` slots if that stays within the limit; returns whether it did."""
    def release(self, n: int = 1) -> None:
        """Gives ``n`` slots back. Raises ``OverReleaseError`` (changing nothing) when fewer
        than ``n`` are held."""
    @property
    def in_use(self) -> int:
        """Slots held now."""
    @property
    def limit(self) -> int:
        """The concurrency limit (slots); settable at run time."""
    @limit.setter
    def limit(self, value: int) -> None: ...

class TokenBucket:
    """A lock-free token bucket: ``tokens_per_minute`` refill, continuous from a monotonic clock
    (or ``clock``), holding at most ``burst_tokens`` (default: one minute of tokens).

    Starts full. :meth:`try_reserve` takes tokens up front (prompt + reserved completion);
    :meth:`reconcile` settles with the real usage: unused tokens go back (never above full) and
    an overrun is charged, which may put the bucket into debt bounded by one ``burst_tokens``
    (an overrun is never free). The state is one word updated by compare-and-swap (GCRA).
    Time costs are rounded up to whole nanoseconds, refunds down.

    Raises: ``InvalidConfigError`` for a rate or burst of 0; ``InvalidAmountError`` /
    ``TypeError`` for bad amounts.
    """

    def __init__(
        self,
        tokens_per_minute: int,
        burst_tokens: int | None = None,
        *,
        clock: ManualClock | None = None,
    ) -> None: ...
    def try_reserve(self, tokens: int) -> bool:
        """Takes ``tokens`` if available now. Raises ``NeverAdmissibleError`` when ``tokens >
        burst_tokens`` (it can never succeed)."""
    def reconcile(self, reserved: int, actual: int) -> None:
        """Settles a reservation of ``reserved`` tokens with ``actual`` usage (refund or
        overrun charge)."""
    @property
    def available(self) -> int:
        """Whole tokens available now (negative when in debt)."""
    @property
    def tokens_per_minute(self) -> int:
        """Refill rate (tokens per minute); settable: the current token level is kept."""
    @tokens_per_minute.setter
    def tokens_per_minute(self, value: int) -> None: ...
    @property
    def burst_tokens(self) -> int:
        """Capacity (tokens)."""
    def retry_after(self, tokens: int) -> float:
        """Seconds until ``tokens`` are available (0.0 if now). Raises ``NeverAdmissibleError``
        when ``tokens > burst_tokens``."""
    def time_to_full(self) -> float:
        """Seconds until the bucket is full again (for ``x-ratelimit-reset-tokens``)."""

class AdaptiveLaw:
    """The adaptive control law (DESIGN.md "Adaptive feedback").

    Pressure is the engine's KV-cache usage ratio 0..1 (vLLM ``vllm:kv_cache_usage_perc``,
    SGLang ``sglang:token_usage``); when the waiting requests (``vllm:num_requests_waiting``)
    exceed ``waiting_threshold`` the pressure counts as the high watermark. Scale:
    ``pressure >= high`` → ``floor``; ``<= low`` → 1.0; linear in between; a missing/stale
    reading (``None``) → ``floor``. :meth:`update` applies decreases at once and bounds
    increases to ``recovery_per_second`` per second. Shedding turns on at ``pressure >= high``
    (or a missing reading) and off only when ``pressure < low`` (hysteresis).

    Raises: ``InvalidConfigError`` unless ``0 <= low < high <= 1``, ``0 < floor <= 1``,
    ``recovery_per_second > 0``.
    """

    def __init__(
        self,
        high: float = 0.85,
        low: float = 0.70,
        floor: float = 0.6,
        recovery_per_second: float = 0.05,
        waiting_threshold: int = 8,
        *,
        clock: ManualClock | None = None,
    ) -> None: ...
    def target(self, kv_usage: float | None, waiting: int = 0) -> float:
        """The scale aimed at for a reading (pure). Raises ``InvalidConfigError`` (a
        ``ValueError``) for ``kv_usage`` outside [0, 1] or NaN, ``ValueError`` for
        ``waiting < 0``."""
    def update(self, kv_usage: float | None, waiting: int = 0) -> float:
        """Feeds one reading (at the clock's now) and returns the new, smoothed scale."""
    @property
    def scale(self) -> float:
        """Current scale (floor..1)."""
    @property
    def shedding(self) -> bool:
        """Whether the sheddable class should be shed."""
    @property
    def high(self) -> float: ...
    @property
    def low(self) -> float: ...
    @property
    def floor(self) -> float: ...
    @property
    def recovery_per_second(self) -> float: ...
    @property
    def waiting_threshold(self) -> int: ...

class Reservation:
    """An admitted request's hold on its slot, in-flight tokens and TPM tokens.

    Release exactly once with :meth:`release` (a second call is a no-op), or use it as a
    context manager. If it is dropped without release it releases itself (as reserved) and
    increments :attr:`AdmissionController.leaks`. Truthy.
    """

    @property
    def admitted(self) -> Literal[True]: ...
    @property
    def tokens(self) -> int:
        """Tokens reserved (prompt + reserved completion)."""
    @property
    def backend(self) -> int: ...
    @property
    def tenant(self) -> int: ...
    @property
    def pool(self) -> Literal["guaranteed", "burst"]:
        """Where the slot came from."""
    @property
    def released(self) -> bool: ...
    def release(self, actual_tokens: int | None = None) -> None:
        """Frees the slot and in-flight tokens and reconciles the tenant and backend buckets
        with ``actual_tokens`` (prompt + real completion; ``None`` = as reserved). Idempotent.
        A bad ``actual_tokens`` raises before anything is released."""
    def __enter__(self) -> Reservation: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> bool: ...

class Rejection:
    """A refused admission: nothing is held. Falsy."""

    @property
    def admitted(self) -> Literal[False]: ...
    @property
    def reason(self) -> RejectReason:
        """Which limit refused (low-cardinality metric label)."""
    @property
    def scope(self) -> Literal["tenant", "backend"]:
        """``"tenant"`` (HTTP 429) or ``"backend"`` (HTTP 503)."""
    @property
    def retry_after(self) -> float | None:
        """Estimated seconds until a retry may succeed; ``None`` when it never can."""
    @property
    def never(self) -> bool:
        """True when the request can never be admitted (larger than a whole bucket or the
        whole in-flight budget): answer with a 4xx, not "retry later"."""

class AdmissionController:
    """Admission against every limit: tenant concurrency and TPM, backend slots (guaranteed +
    burst pool), in-flight tokens and backend TPM, in one lock-free call.

    State lives in one fixed-capacity region, private (``shm_name=None``) or in named POSIX
    shared memory so several worker processes share one set of limits: the master creates it
    (``create=True`` replaces a stale region of that name and unlinks the name when the
    controller is dropped), workers attach (``create=False`` or :meth:`attach`). Each process
    keeps a ledger of what it holds; :meth:`reclaim_dead` (from any live process) gives back
    what dead processes held (pid + start time, so pid reuse is detected).

    Slots: each tenant's ``guaranteed_slots`` are carved out of every backend's (scaled)
    ``max_concurrency``; the rest is the shared burst pool. A smaller scale shrinks the burst
    pool first and the guarantees (proportionally) only when nothing else is left.
    ``critical``/``standard`` requests use the tenant's guarantee, then the burst pool;
    ``sheddable`` requests use only the burst pool and are refused (``shed``) while shedding.

    Raises: ``SharedStateError`` when the region cannot be created or attached.
    """

    def __init__(
        self,
        *,
        clock: ManualClock | None = None,
        shm_name: str | None = None,
        create: bool = True,
    ) -> None: ...
    @staticmethod
    def attach(shm_name: str, *, clock: ManualClock | None = None) -> AdmissionController:
        """Attaches to an existing shared region (a worker process)."""
    @property
    def shm_name(self) -> str | None: ...
    @property
    def leaks(self) -> int:
        """Reservations dropped without release in this process (each released itself)."""
    @property
    def backend_count(self) -> int: ...
    @property
    def tenant_count(self) -> int: ...
    def backend_id(self, name: str) -> int | None: ...
    def tenant_id(self, name: str) -> int | None: ...
    def add_backend(
        self,
        name: str,
        *,
        max_concurrency: int,
        tokens_per_minute: int,
        burst_tokens: int | None = None,
        inflight_token_limit: int | None = None,
    ) -> int:
        """Registers a backend; returns its id. ``inflight_token_limit`` (tokens, from the
        engine's KV capacity) ``None`` = unlimited; ``burst_tokens`` defaults to one minute.
        Raises ``InvalidConfigError`` (duplicate name, zero limits, max_concurrency below the
        tenants' guaranteed slots, more than ``MAX_BACKENDS``)."""
    def update_backend(
        self,
        backend: int,
        *,
        max_concurrency: int | None = None,
        tokens_per_minute: int | None = None,
        burst_tokens: int | None = None,
        inflight_token_limit: int | None = None,
    ) -> None:
        """Hot reload of base limits (``None`` = unchanged). Held slots and tokens are
        untouched; the bucket's token level is kept."""
    def add_tenant(
        self,
        name: str,
        *,
        priority: PriorityClass | int,
        tokens_per_minute: int | None = None,
        max_concurrency: int | None = None,
        guaranteed_slots: int | None = 0,
        burst_tokens: int | None = None,
    ) -> int:
        """Registers a tenant; returns its id. ``tokens_per_minute``/``max_concurrency``
        ``None`` = no tenant limit. ``guaranteed_slots`` are reserved on every backend; a
        sheddable tenant cannot have any. Raises ``InvalidConfigError``."""
    def update_tenant(
        self,
        tenant: int,
        *,
        priority: PriorityClass | int | None = None,
        tokens_per_minute: int | None = None,
        max_concurrency: int | None = None,
        guaranteed_slots: int | None = None,
        burst_tokens: int | None = None,
    ) -> None:
        """Hot reload of a tenant (``None`` = unchanged)."""
    def set_scale(self, backend: int, scale: float) -> None:
        """Sets the adaptive scale (0 < scale <= 1), applied at once to the backend's
        concurrency, TPM (rate and burst) and in-flight token limits. Raises
        ``InvalidConfigError`` out of range."""
    def set_shedding(self, backend: int, on: bool) -> None:
        """Turns shedding of the sheddable class on or off."""
    def admit(
        self, backend: int, tenant: int, priority: PriorityClass | int, tokens: int
    ) -> Reservation | Rejection:
        """Admits a request of ``tokens`` (prompt + reserved completion; charged to the tenant
        TPM, the backend TPM and the backend in-flight budget) or refuses it. Checks, in order:
        never-admissible sizes, shedding, tenant concurrency, tenant TPM, backend slots,
        in-flight tokens, backend TPM. After a refusal nothing is held. Raises
        ``InvalidAmountError``/``TypeError`` for a bad ``tokens``, ``InvalidConfigError`` for an
        unknown id or priority."""
    def reclaim_dead(self) -> int:
        """Gives back what dead attached processes held; returns the slots reclaimed."""
    def backend_state(self, backend: int) -> dict[str, object]:
        """Snapshot: name, scale, shedding, max_concurrency, effective_concurrency, in_use,
        guaranteed_slots, burst_pool, burst_in_use, tokens_per_minute,
        effective_tokens_per_minute, burst_tokens, effective_burst_tokens, available_tokens,
        time_to_full (s), inflight_tokens, inflight_token_limit,
        effective_inflight_token_limit, hold_time_ewma (s)."""
    def tenant_state(self, tenant: int) -> dict[str, object]:
        """Snapshot: name, priority, guaranteed_slots, max_concurrency, in_use,
        tokens_per_minute, burst_tokens, available_tokens, time_to_full (s)."""
