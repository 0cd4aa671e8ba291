"""Stubs and user docs for the native module ``kvgate._core`` (rust/src/python/).

Units: tokens (prompt + completion tokens of the model's tokenizer), slots (requests in flight),
seconds (floats), nanoseconds (``*_ns`` ints), ratios 0..1. Every amount is an ``int`` in
``0..=MAX_AMOUNT`` (2**62): a negative or larger int raises :class:`InvalidAmountError`; a
``float``, ``bool`` or ``None`` raises ``TypeError``. Zero is a valid no-op. A refusal on the hot
path is a value (``False`` or a :class:`Rejection`), never an exception; exceptions are for bad
arguments and configuration only.
"""

from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Final, Literal, Self, final

from typing_extensions import disjoint_base

__all__ = [
    "BOARD_PAYLOAD_BYTES",
    "EVENT_LIMIT",
    "MAX_AMOUNT",
    "MAX_PROCS",
    "REASONS",
    "RESPONSES_TEXT_EVENTS",
    "UNLIMITED_TPM",
    "AdaptiveLaw",
    "AdmissionController",
    "Analysis",
    "AnalysisError",
    "CoreError",
    "InvalidAmountError",
    "InvalidConfigError",
    "ManualClock",
    "ModelRegistry",
    "NeverAdmissibleError",
    "OverReleaseError",
    "QuotaLedger",
    "Rejection",
    "ReplicaSet",
    "RequestAnalyzer",
    "Reservation",
    "SSEInspector",
    "SharedStateError",
    "SlotPool",
    "StreamAssembler",
    "TokenBucket",
    "__version__",
    "check_content_length",
    "go_duration",
    "http_response",
    "peek_model",
    "relay_http",
    "usage_tokens",
]

__version__: str
MAX_AMOUNT: int
"""Largest accepted amount (2**62 tokens or slots)."""
BOARD_PAYLOAD_BYTES: int
"""Largest payload of a poll-board entry (:meth:`AdmissionController.publish_board`), in bytes
(488)."""
MAX_PROCS: int
"""Default number of processes that can attach to one shared region at a time (64)."""
UNLIMITED_TPM: int
"""A backend token rate (tokens per minute) at or above which there is no limit (2**40): the
gateway gives a backend without ``tokens_per_minute`` this rate, a bucket that never binds, and
sends no token headers for it."""
REASONS: tuple[str, ...]
"""Every :attr:`Rejection.reason` label."""
EVENT_LIMIT: int
"""Bytes of one SSE event held while its end has not arrived (32 MiB): an upstream that sends
more without an event's end is not an engine's stream (:attr:`SSEInspector.overlong`)."""
RESPONSES_TEXT_EVENTS: tuple[str, ...]
"""The Responses API's stream events whose ``delta`` is generated text (output, refusal,
reasoning, tool-call arguments): what a stream cut before its end is charged from."""

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

@final
class ManualClock:
    """A test clock: time moves only when :meth:`advance` is called. Pass it as ``clock=`` to
    any limiter or controller so refill and recovery are tested without sleeping."""

    def __new__(cls, start_ns: int = 0) -> Self: ...
    def advance(self, seconds: float) -> None:
        """Moves the clock forward by ``seconds`` (finite, >= 0; else ``ValueError``)."""
    def advance_ns(self, ns: int) -> None:
        """Moves the clock forward by ``ns`` nanoseconds."""
    @property
    def now_ns(self) -> int:
        """The current reading in nanoseconds."""

@final
class SlotPool:
    """A lock-free pool of concurrency slots (compare-and-swap on one counter).

    ``in_use`` is never above the limit in force when a slot was taken and never negative.
    Lowering :attr:`limit` never cancels what is in flight; it only blocks new acquires until
    ``in_use`` drops below it. ``clock`` is accepted for a uniform constructor and unused.

    Raises: ``InvalidAmountError`` / ``TypeError`` for a bad ``limit``.
    """

    def __new__(cls, limit: int, *, clock: ManualClock | None = None) -> Self: ...
    def try_acquire(self, n: int | None = None) -> bool:
        """Takes ``n`` slots (``None`` = 1) if that stays within the limit; returns whether it
        did."""
    def release(self, n: int | None = None) -> None:
        """Gives ``n`` slots (``None`` = 1) back. Raises ``OverReleaseError`` (changing nothing)
        when fewer than ``n`` are held."""
    @property
    def in_use(self) -> int:
        """Slots held now."""
    @property
    def limit(self) -> int:
        """The concurrency limit (slots); settable at run time."""
    @limit.setter
    def limit(self, value: int) -> None: ...

@final
class TokenBucket:
    """A lock-free token bucket: ``tokens_per_minute`` refill from the system's monotonic clock
    (``CLOCK_MONOTONIC``, the clock of ``time.monotonic()``, so a :meth:`retry_after` waited out
    by it finds the tokens) or from ``clock``, holding at most ``burst_tokens`` (default: one
    minute of tokens).

    Starts full. :meth:`try_reserve` takes tokens up front (prompt + reserved completion);
    :meth:`reconcile` settles with the real usage: unused tokens go back (never above full) and
    an overrun is charged, which may put the bucket into debt bounded by one ``burst_tokens``
    (an overrun is never free). The state is one word updated by compare-and-swap (GCRA).
    Time costs are rounded up to whole nanoseconds, refunds down.

    Raises: ``InvalidConfigError`` for a rate or burst of 0 or above 2**62, or a burst that
    would take more than about 70 years to refill at the rate; ``InvalidAmountError`` /
    ``TypeError`` for bad amounts. (A burst that refills in under a nanosecond still holds a
    burst.)
    """

    def __new__(
        cls,
        tokens_per_minute: int,
        burst_tokens: int | None = None,
        *,
        clock: ManualClock | None = None,
    ) -> Self: ...
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

@final
class AdaptiveLaw:
    """The adaptive control law (docs/adaptive.md).

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

    def __new__(
        cls,
        high: float = 0.85,
        low: float = 0.70,
        floor: float = 0.6,
        recovery_per_second: float = 0.05,
        waiting_threshold: int = 8,
        *,
        clock: ManualClock | None = None,
    ) -> Self: ...
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
    def overloaded(self) -> bool:
        """Whether the last reading was at or above the high watermark (or missing): the
        scale then binds every class, not only ``sheddable``."""
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

@final
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
        with ``actual_tokens`` (prompt + real completion; ``None`` = as reserved). Unused
        tokens give back the time they were charged at admission (an adaptive scale change in
        between neither inflates nor shrinks the refund); an overrun is charged at the rates in
        force now. Idempotent. A bad ``actual_tokens`` (``InvalidAmountError``/``TypeError``)
        raises before anything is released."""
    def __enter__(self) -> Reservation: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> bool: ...

@final
class Rejection:
    """A refused admission: nothing is held. Falsy."""

    @property
    def admitted(self) -> Literal[False]: ...
    @property
    def reason(self) -> RejectReason:
        """Which limit refused (low-cardinality metric label)."""
    @property
    def scope(self) -> Literal["tenant", "backend"]:
        """``"tenant"`` (HTTP 429) or ``"backend"`` (HTTP 503; 429 when :attr:`never`)."""
    @property
    def retry_after(self) -> float | None:
        """Estimated seconds until a retry may succeed; ``None`` when it never can."""
    @property
    def never(self) -> bool:
        """True when the request can never be admitted (larger than a whole bucket or the
        whole in-flight budget): answer with a 4xx, not "retry later"."""

@final
class AdmissionController:
    """Admission against every limit: tenant concurrency and TPM, backend slots (guaranteed +
    burst pool), in-flight tokens and backend TPM, in one lock-free call.

    State lives in one fixed-capacity region, private (``shm_name=None``) or in named POSIX
    shared memory so several worker processes share one set of limits: the master creates it
    (``create=True`` replaces a stale region of that name and unlinks the name when the
    controller is dropped), workers attach (``create=False`` or :meth:`attach`). Each process
    keeps a ledger of what it holds; :meth:`reclaim_dead` (from any live process) gives back
    what dead processes held (pid + start time, so pid reuse is detected).

    A shared-memory controller updates every limit by compare-and-swap. A private one relies on
    the GIL, which every call holds from entry to return, and updates its limits with plain
    atomic loads and stores (no locked instruction per limit; compare-and-swap on a
    free-threaded CPython build). Time is the system's monotonic clock at kernel-tick resolution
    (``CLOCK_MONOTONIC_COARSE``, a few ms; the limits are per minute) or ``clock``; before a
    token bucket refuses, it looks again at the precise clock (``time.monotonic()``'s), which
    also times the ``retry_after`` hint, so a retry at or after the hint finds the tokens.

    Slots: each tenant's ``guaranteed_slots`` are carved out of the (scaled)
    ``max_concurrency`` of every backend its ``guaranteed_backends`` names (all backends by
    default); the rest is each backend's shared burst pool. The guarantees that apply to one
    backend must sum to at most its ``max_concurrency``. A smaller scale shrinks the burst
    pool first and the guarantees (proportionally) only when nothing else is left.
    ``critical``/``standard`` requests use the tenant's guarantee, then the burst pool;
    ``sheddable`` requests use only the burst pool and are refused (``shed``) while shedding.
    The scale binds ``sheddable`` requests always (they fit under the scaled limit counting
    every class's slots) and ``critical``/``standard`` ones only while the backend is
    overloaded (:meth:`set_overload`); otherwise those keep the base concurrency and TPM.

    Backend and tenant ids (``backend``/``tenant`` arguments) are ints in ``0..2**32``: a bool
    or another type is a ``TypeError``, an int outside that range an ``OverflowError`` (both
    naming the argument), an id never registered an ``InvalidConfigError``.

    Capacity: there is no fixed ceiling on tenants or backends. The region is sized when it is
    created from the expected counts ``backends``, ``tenants`` and ``guarantees`` (the
    (tenant, backend) pairs a guarantee names: one per listed backend, or one per backend for a
    tenant with guaranteed slots on every backend), with headroom: ``max(2 × count, 64)``
    backends, ``max(2 × count, 1024)`` tenants and guarantee entries, and ``processes`` process
    entries (a private region has one). Memory is proportional: about 200 bytes per tenant
    and per backend, about 100 per guarantee entry, plus, per process entry of a shared region, 8
    bytes per tenant, guarantee-table slot and (× 3) backend (:attr:`region_bytes`). Past the
    capacity, ``add_backend`` / ``add_tenant`` raise ``InvalidConfigError`` saying a restart
    is needed. Admission cost does not depend on the counts.

    Raises: ``SharedStateError`` when the region cannot be created or attached;
    ``OverflowError`` for a negative count.
    """

    def __new__(
        cls,
        *,
        clock: ManualClock | None = None,
        shm_name: str | None = None,
        create: bool = True,
        backends: int = 0,
        tenants: int = 0,
        guarantees: int = 0,
        processes: int = 64,
    ) -> Self: ...
    @property
    def capacity(self) -> dict[str, int]:
        """What the region holds at most: ``backends``, ``tenants``, ``guarantees``,
        ``processes`` (fixed when it was created)."""
    @property
    def region_bytes(self) -> int:
        """Size of the region in bytes."""
    @property
    def free_tenant_ids(self) -> int:
        """Tenants that can still be added: unused ids plus removed tenants' ids that hold
        nothing."""
    @property
    def guarantee_entries_free(self) -> int:
        """Guarantee-table entries not used yet (the table is sized at creation,
        :attr:`capacity` ``guarantees``). Entries are never freed: a removed tenant's stay with
        its id and serve the tenant that takes the id next."""
    def guarantee_entries_needed(
        self,
        tenant: int | None = None,
        *,
        guaranteed_slots: int | None = None,
        guaranteed_backends: Iterable[int] | Literal["all"] | None = None,
    ) -> list[int]:
        """The backends (ids, ascending) on which setting ``tenant`` (``None``: a tenant added
        with a fresh id) to this guarantee, as ``add_tenant`` / ``replace_tenant`` take it,
        would add a guarantee-table entry: those it guarantees slots on where the tenant has
        no entry yet (backend ids past the registered ones count as none). Raises
        ``TypeError`` / ``ValueError`` for an argument ``add_tenant`` would refuse the same
        way."""
    def guarantee_entries_of(self, tenant: int) -> list[int]:
        """The backends (ids, ascending) on which ``tenant`` holds a guarantee-table entry: one
        per backend it has had a guarantee on (kept after its removal); none for an id past
        the registered tenants."""
    def remove_tenant(self, tenant: int) -> None:
        """Removes a tenant (a reload that drops it). It becomes a tombstone: every admission
        is refused (``tenant-concurrency``), its guarantees go back to the burst pools, its
        name is free at once, its held requests release as usual. Its id is given to a new
        tenant only once it holds nothing, so no request of the removed tenant is counted
        against the new one. Raises ``InvalidConfigError`` (unknown or already removed id)."""
    def remove_tenant_named(self, tenant: int, name: str) -> bool:
        """Removes ``tenant`` as :meth:`remove_tenant` does if it is still the live tenant
        ``name``; whether it did. Each worker of ``--workers N`` applies the same reload to the
        shared core: another may have removed the tenant already and given its id to a tenant
        it added, which must stay. Raises ``InvalidConfigError`` (an id past the registered
        tenants)."""
    def tenant_removed(self, tenant: int) -> bool:
        """Whether ``tenant`` was removed and its id not reused yet."""
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
        guaranteed slots of the tenants whose guarantee applies to every backend, the region's
        backend capacity reached: restart to grow it)."""
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
    def replace_backend(
        self,
        backend: int,
        *,
        max_concurrency: int,
        tokens_per_minute: int,
        burst_tokens: int | None = None,
        inflight_token_limit: int | None = None,
    ) -> None:
        """Hot reload of a backend with its whole configuration, as :meth:`add_backend` takes
        it: ``burst_tokens`` ``None`` is one minute's worth, ``inflight_token_limit`` ``None``
        no in-flight budget (where :meth:`update_backend` keeps the value in force). Held
        slots and tokens are untouched. Raises as :meth:`update_backend`."""
    def add_tenant(
        self,
        name: str,
        *,
        priority: PriorityClass | int,
        tokens_per_minute: int | None = None,
        max_concurrency: int | None = None,
        guaranteed_slots: int | None = None,
        burst_tokens: int | None = None,
        guaranteed_backends: Iterable[int] | Literal["all"] | None = None,
    ) -> int:
        """Registers a tenant; returns its id. ``tokens_per_minute``/``max_concurrency``
        ``None`` = no tenant limit. ``guaranteed_slots`` (slots, ``None`` = 0) are reserved for
        it on each backend of ``guaranteed_backends``: registered backend ids, or ``None`` /
        ``"all"`` = every backend, including backends added later (which then must have room
        for it). A sheddable tenant cannot have any. A removed tenant's id is reused only
        once it holds nothing, and only when no never-used id is left or the guarantee table
        is full; of those ids, for a tenant with a guarantee the first whose guarantee entries
        cover it, else (of the first 64 with entries) the one that leaves the fewest to add;
        for a tenant without, the first without entries.

        Raises:
            InvalidConfigError: duplicate name, a sheddable tenant with guaranteed slots, an
                unknown backend id, guarantees that would sum above a backend's
                ``max_concurrency`` (the message names the backend), or the region's tenant or
                guarantee capacity reached (the message says a restart is needed).
            TypeError: ``guaranteed_backends`` is not an iterable of ints, ``"all"`` or
                ``None``.
        """
    def update_tenant(
        self,
        tenant: int,
        *,
        priority: PriorityClass | int | None = None,
        tokens_per_minute: int | None = None,
        max_concurrency: int | None = None,
        guaranteed_slots: int | None = None,
        burst_tokens: int | None = None,
        guaranteed_backends: Iterable[int] | Literal["all"] | None = None,
    ) -> None:
        """Hot reload of a tenant (``None`` = unchanged; ``guaranteed_backends="all"``: every
        backend). Slots held on a guarantee that is lowered or moved to other backends stay
        held until released; meanwhile that backend gives no burst slot beyond its limit.
        Raises as :meth:`add_tenant` (nothing changes then)."""
    def replace_tenant(
        self,
        tenant: int,
        *,
        priority: PriorityClass | int,
        tokens_per_minute: int | None = None,
        max_concurrency: int | None = None,
        guaranteed_slots: int | None = None,
        burst_tokens: int | None = None,
        guaranteed_backends: Iterable[int] | Literal["all"] | None = None,
    ) -> None:
        """Hot reload of a tenant with its whole configuration, as :meth:`add_tenant` takes
        it: ``None`` is no limit, no guaranteed slot, every backend (where
        :meth:`update_tenant` keeps the value in force), so a reload that drops a limit from
        the file drops it here. Held slots stay held, as with :meth:`update_tenant`; raises
        as :meth:`add_tenant` (nothing changes then)."""
    def set_scale(self, backend: int, scale: float) -> None:
        """Sets the adaptive scale (0 < scale <= 1), applied at once to the backend's
        concurrency and TPM (rate and burst) limits; the in-flight token budget is never scaled
        (see :meth:`set_inflight_external`). Raises ``InvalidConfigError`` out of range."""
    def set_inflight_external(self, backend: int, tokens: int) -> None:
        """Sets the engine's external KV occupancy (tokens): what its KV cache holds beyond
        kvgate's own in-flight tokens (other clients, fragmentation), measured from its
        metrics. The in-flight budget in force becomes ``max(0, inflight_token_limit −
        tokens)`` for every request, guaranteed slot or not; held tokens stay held; 0 = no
        correction. Shared by every worker of a shared region. Raises
        ``InvalidAmountError``/``TypeError`` for a bad ``tokens``, ``InvalidConfigError`` for
        an unknown backend."""
    def set_shedding(self, backend: int, on: bool) -> None:
        """Turns shedding of the sheddable class on or off."""
    def publish_board(self, backend: int, payload: bytes) -> int | None:
        """Publishes ``payload`` (at most :data:`BOARD_PAYLOAD_BYTES` bytes) on the backend's
        entry of the region's poll board, where the process that polls the backend's engine
        leaves what it read for the other processes attached to the region. Returns the
        entry's new sequence number (even, > 0), or ``None`` when another process was writing
        the entry at that moment (the payload is dropped). An entry left mid-write by a
        process that died is taken over after 1 s. Raises ``InvalidConfigError`` for an
        unknown backend or an oversized payload."""
    def read_board(self, backend: int) -> tuple[int, bytes] | None:
        """The payload last published on the backend's poll-board entry with its sequence
        number, or ``None`` when nothing was published yet (or a write was in progress on every
        try: read again later). A payload is never torn. Raises ``InvalidConfigError`` for an
        unknown backend."""
    def set_overload(self, backend: int, on: bool) -> None:
        """Marks the backend overloaded (KV pressure at or above the adaptive law's high
        watermark, or stale metrics) or not (the initial state). While overloaded the scale
        binds every class; otherwise only the ``sheddable`` class, and ``critical`` /
        ``standard`` requests keep the base concurrency and TPM."""
    def admit(
        self, backend: int, tenant: int, priority: PriorityClass | int, tokens: int
    ) -> Reservation | Rejection:
        """Admits a request of ``tokens`` (prompt + reserved completion; charged to the tenant
        TPM, the backend TPM and the backend in-flight budget) or refuses it. Checks, in order:
        never-admissible sizes, shedding, tenant concurrency, tenant TPM, backend slots,
        in-flight tokens, backend TPM. After a refusal nothing is held. Raises
        ``InvalidAmountError``/``TypeError`` for a bad ``tokens``, ``InvalidConfigError`` for an
        unknown id or priority, ``TypeError`` for a missing, extra or non-int argument (ids,
        like ``tokens``, refuse bools and objects with ``__index__``), ``OverflowError`` for an
        id outside ``0..2**32``; each error names the argument."""
    def reclaim_dead(self) -> int:
        """Gives back what dead attached processes held; returns the slots reclaimed."""
    def backend_state(self, backend: int) -> dict[str, object]:
        """Snapshot: name, scale, shedding, overloaded, max_concurrency,
        effective_concurrency (scaled: the limit of ``sheddable`` requests, and of every class
        while overloaded), in_use,
        guaranteed_slots (sum of the guarantees that apply to this backend), burst_pool, burst_in_use, tokens_per_minute,
        effective_tokens_per_minute, burst_tokens, effective_burst_tokens, available_tokens,
        time_to_full (s), inflight_tokens, inflight_token_limit (base budget, ``None`` =
        unlimited), inflight_external_tokens (:meth:`set_inflight_external`),
        effective_inflight_token_limit (base less external, never below 0; not scaled),
        hold_time_ewma (s: weight 1/8, fed by the first
        release and then about one in eight, a random draw; every release under a manual clock)."""
    def rate_limit_headers(self, backend: int, tenant: int) -> list[tuple[str, str]]:
        """OpenAI's six ``x-ratelimit-*`` headers (docs/engines.md §4) for ``tenant`` on
        ``backend``, as ``(name, value)`` pairs in this order: ``limit-requests``,
        ``remaining-requests``, ``reset-requests``, ``limit-tokens``, ``remaining-tokens``,
        ``reset-tokens`` (each prefixed ``x-ratelimit-``).

        "Requests" is a concurrency limit (slots), not a per-minute count: the tenant's own
        ``max_concurrency`` if it has one, else the backend's effective (scaled) limit; remaining
        is the free slots; reset is the backend's hold-time EWMA when no slot is free, else
        ``0s``. "Tokens" is the tenant's TPM bucket if it has one, else the backend's effective
        bucket: limit in tokens per minute, remaining the tokens available now (``0`` in debt),
        reset the time until the bucket is full again. Without a token limit (the tenant has no
        TPM and its backend none below 2**40 tokens per minute, kvgate's "no limit") only the
        three request headers are returned. Resets are Go ``time.Duration`` strings
        (:func:`go_duration`). One read of the shared state, formatted in Rust.

        Raises:
            InvalidConfigError: unknown backend or tenant id.
        """
    def refusal_headers(
        self, backend: int, tenant: int, retry_after: float | None, reason: str
    ) -> list[tuple[str, str]]:
        """The headers of a refusal, as ``(name, value)`` pairs: :meth:`rate_limit_headers`,
        then ``Retry-After`` (RFC 9110 whole seconds, rounded up, at least 1) and
        ``retry-after-ms`` (rounded up, at least 1; the official OpenAI Python client reads it
        first) for a wait of ``retry_after`` seconds — or, when ``retry_after`` is ``None``
        (never admissible), ``x-should-retry: false`` and no ``Retry-After`` — then
        ``x-kvgate-reject-reason: <reason>`` and ``Content-Type: application/json``.

        Raises:
            InvalidConfigError: unknown backend or tenant id.
            TypeError: ``retry_after`` not a number or ``None``; ``reason`` not a ``str``.
        """
    def refusal_response(
        self,
        backend: int,
        tenant: int,
        refusal: Rejection | Any,
        model: str | None,
        tenant_name: str,
        requested: int,
        connection: str | None = None,
    ) -> tuple[int, str, bytes]:
        """A whole refusal as it goes on the wire, with its status and reason. ``refusal``: a
        :class:`Rejection` (read natively) or any object with ``reason`` (str), ``scope``
        (``"tenant"`` / ``"backend"``), ``retry_after`` (seconds or ``None``) and ``never``.
        The status is 429 when the tenant's own quota refused it (scope ``tenant``) or when it
        can never fit (``never``: OpenAI's "Request too large", ``type`` ``tokens``), else 503.
        The message is an HTTP/1.1 response (:func:`http_response`): the :meth:`refusal_headers`
        (with ``Retry-After`` for a wait of ``retry_after`` seconds, none when ``never``),
        ``Content-Length``, ``Date`` and, when given, ``Connection: <connection>``, then OpenAI's
        error body (docs/engines.md §4): for 429 ``type`` ``tokens`` (a TPM reason) or
        ``requests`` and ``code`` ``rate_limit_exceeded``; for 503 ``type`` ``server_error`` and
        ``code`` ``server_is_overloaded``; the message names ``model`` (``None``: "this
        backend"), ``tenant_name``, the reason, the wait (rounded up to the millisecond) or,
        when ``never``, the ``requested`` tokens (prompt + completion). One read of the shared
        state; the gateway writes the bytes with one write.

        Raises:
            InvalidConfigError: unknown backend or tenant id.
            ValueError: a reason or ``connection`` with a control character (CR, LF, NUL,
                ...; tab is allowed).
            AttributeError, TypeError: ``refusal`` lacks one of the attributes, or has the
                wrong types.
            OverflowError: ``requested`` negative or above 2**64 - 1.
        """
    def relay_http(
        self,
        backend: int,
        tenant: int,
        status: int,
        upstream_headers: Iterable[tuple[bytes, bytes]],
        body: bytes | None = None,
        connection: str | None = None,
        chunked: bool = True,
        *,
        request_id: str | None = None,
    ) -> bytes:
        """:func:`relay_http` with kvgate's :meth:`rate_limit_headers` for ``tenant`` on
        ``backend`` after the engine's headers (an engine's own ``x-ratelimit-*`` of the same
        names are replaced), and ``x-request-id: request_id`` when given (an engine's own
        ``x-request-id`` is then dropped: the client gets kvgate's). One read of the shared
        state.

        Raises:
            InvalidConfigError: unknown backend or tenant id.
            ValueError: ``request_id`` empty or not printable ASCII (0x20–0x7E).
            TypeError, ValueError, OverflowError: as :func:`relay_http`.
        """
    def tenant_state(self, tenant: int) -> dict[str, object]:
        """Snapshot: name, priority, guaranteed_slots (on each backend of
        guaranteed_backends), guaranteed_backends (ids of the registered backends its
        guarantee applies to), max_concurrency, in_use (across backends), tokens_per_minute, burst_tokens, available_tokens, time_to_full (s)."""

# --- SSE relay inspection (rust/src/python/sse.rs) ---

@final
class SSEInspector:
    """Cuts an upstream SSE byte stream into complete events and inspects each one.

    The relay writes upstream bytes to the client exactly as the engine framed them (``data:
    <json>\n\n``, docs/engines.md §4; events may also end with ``\r\n\r\n`` or ``\r\r``)
    and reads, on the way, what settling the token account needs. Only events that may carry a
    non-null ``usage`` or an ``error`` key are parsed as they pass (a byte test: inside JSON
    strings quotes are escaped, so ``"usage"`` in the bytes is never generated text); the
    others are kept as bytes and parsed for their text only if :attr:`delivered_text`,
    :attr:`content_chunks` or :attr:`delivered_tokens` is read, or when more than 4 KiB of them
    wait. Memory per stream is bounded whatever its length: past 2 KiB, the delivered text is
    handed to ``count_text`` in pieces (during :meth:`feed`) and only the remainder is kept; only
    the last usage and error objects are kept. The stream ends at ``data: [DONE]``: nothing after
    it is handed out or kept. One per streamed response; not for sharing between threads.

    Args:
        strip_usage_chunk: drop the usage-only chunk (``"choices": []`` with a ``usage``
            object) and cut the ``"usage": null`` member an OpenAI-style engine adds to every
            other chunk (only when the event holds exactly one, at the top level; else the
            event passes as it came; events with ``"usage"`` are then parsed as they pass).
            Set when the gateway added ``stream_options.include_usage`` itself and the client
            did not ask for it, so the client sees what it would have seen.
        count_text: the tokenizer count (tokens) of a piece of generated text (the model's
            ``count_text``); ``None``: the text is not counted (:attr:`delivered_tokens` is 0).
            Each piece ends just before a run of whitespace, so the sum of the counts equals
            the count of the whole text for a tokenizer that pre-splits before whitespace
            (GPT-2-style byte-level BPE, ``Whitespace``, ``Metaspace``); for one that merges
            across whitespace, or a text without whitespace for 8 KiB, it is an approximation
            (usually a slight over-count).
        responses: read a Responses stream (``POST /v1/responses``) instead: its events are
            named (``event: response.output_text.delta``, a ``type`` in each data); the text is
            the ``delta`` of the text events (output text, refusal, reasoning, tool-call
            arguments), the usage is ``response.usage`` of the terminal
            ``response.completed`` / ``response.incomplete`` event (``input_tokens`` and
            ``output_tokens`` in :attr:`usage_tokens`), which also sets :attr:`done` (such a
            stream has no ``[DONE]``); ``response.failed`` and ``error`` events set
            :attr:`error`. ``strip_usage_chunk`` is ignored.
    """

    def __new__(
        cls,
        *,
        strip_usage_chunk: bool,
        count_text: Callable[[str], int] | None = None,
        responses: bool = False,
    ) -> Self: ...
    def feed(self, data: bytes) -> bytes:
        """Take the next upstream bytes; return the complete events to write now (maybe
        ``b""``; ``data`` itself when it is exactly that). Bytes of an event whose end has not
        arrived yet are held until it does; nothing is re-encoded (byte for byte what upstream
        sent, minus, when stripping, the usage chunk and the ``"usage": null`` members).
        After ``data: [DONE]``, returns nothing more.

        Raises:
            TypeError: ``data`` is not ``bytes``.
            Exception: whatever ``count_text`` raises.
        """
    def flush(self) -> bytes:
        """Whatever partial event remains at the end of the stream (to be written as is; it is
        inspected too)."""
    @property
    def usage(self) -> dict[str, Any] | None:
        """The last non-null ``usage`` object seen (as ``json.loads`` gives it), or ``None``."""
    @property
    def usage_tokens(self) -> tuple[int | None, int | None] | None:
        """``(prompt_tokens, completion_tokens)`` of :attr:`usage` (a Responses usage's
        ``input_tokens``, ``output_tokens``), each only when it is a non-negative integer (else
        ``None``); ``None`` when no usage was seen. What settling a reservation needs, without
        building the dict."""
    @property
    def error(self) -> dict[str, Any] | None:
        """The ``error`` object of an error event, if one was seen."""
    @property
    def done(self) -> bool:
        """``True`` once ``data: [DONE]`` was seen (a Responses stream: its terminal event)."""
    @property
    def overlong(self) -> bool:
        """``True`` once an event grew past 32 MiB (``EVENT_LIMIT`` of the core) before its end:
        nothing more is handed out; the relay ends the stream with an error."""
    @property
    def delivered_text(self) -> list[str]:
        """Text pieces (``delta.content``, ``reasoning_content``, ``reasoning``, tool-call
        ``name`` and ``arguments``, legacy ``text``) of the events handed out so far and not yet
        handed to ``count_text``, in stream order (all of them for a short stream)."""
    @property
    def delivered_tokens(self) -> int:
        """Tokens of all the text delivered so far by ``count_text`` (the text still kept is
        counted now), or 0 without ``count_text``.

        Raises:
            Exception: whatever ``count_text`` raises.
        """
    @property
    def content_chunks(self) -> int:
        """Events handed out so far that carried generated text."""

@final
class StreamAssembler:
    """Rebuilds the non-streamed answer of one request from the SSE stream the engine sent
    instead (one per request; not shared between threads). The bytes are cut into the
    ``data:`` payloads of their events (LF, CRLF or CR line ends; an event's ``data:`` lines
    joined with LF; other fields and comments skipped); ``data: [DONE]`` marks the stream
    complete; a payload that is not JSON is skipped; every other event is merged in.

    Chat and legacy completions (OpenAI's streaming chunks, as vLLM, SGLang, TGI and
    llama.cpp's server send them): :meth:`answer` has ``id``, ``object``
    (``chat.completion`` / ``text_completion``), ``created`` and ``model`` (the first non-null
    value of each), every other top-level member (the last non-null value), ``choices`` in
    ``index`` order and the last ``usage`` object. Each choice has ``index``, ``logprobs``
    (its list members concatenated over the chunks), the last non-null ``finish_reason`` and
    its other members' last non-null value; a chat choice's ``message`` has ``role``, its
    string members concatenated (``content`` null when none came), ``function_call`` and
    ``tool_calls`` put together by ``index`` (the first ``id``, ``type`` and
    ``function.name``, the ``function.arguments`` concatenated); a legacy choice has ``text``.

    Responses (OpenAI's Responses API): the answer is the ``response`` object of the terminal
    ``response.completed`` / ``response.incomplete`` event; before it, ``{}`` or one message
    holding the text of the ``delta`` events so far (what a cut stream is charged).

    Args:
        kind: ``"chat"``, ``"completions"`` or ``"responses"``.

    Raises:
        ValueError: another ``kind``.
    """

    def __new__(cls, kind: str) -> Self: ...
    def feed(self, data: bytes) -> None:
        """Take the next bytes of the stream; every event they complete is merged in. Nothing
        more is taken once :attr:`overlong`."""
    def finish(self) -> None:
        """The stream ended: an event it left without its closing empty line is merged in."""
    @property
    def complete(self) -> bool:
        """Whether the stream's end was seen: ``data: [DONE]``, or a Responses terminal or
        ``response.failed`` event."""
    @property
    def overlong(self) -> bool:
        """Whether an event grew past :data:`EVENT_LIMIT` bytes before its end (the stream is
        broken; what was held is dropped)."""
    @property
    def all_finished(self) -> bool:
        """Whether the chat or completions answer so far has choices, each with its
        ``finish_reason`` (a stream complete without ``data: [DONE]``); never for Responses."""
    @property
    def error(self) -> dict[str, Any] | None:
        """The ``error`` object of the last error event (a chunk's ``error`` object; a
        Responses ``response.failed`` event's ``response.error``, else ``{"message": "response
        failed"}``; a Responses ``error`` event's ``message``, ``param`` and ``code``), or
        ``None``."""
    def answer(self) -> bytes:
        """The non-streamed answer built so far, as JSON (UTF-8)."""

def usage_tokens(body: bytes) -> tuple[int | None, int | None] | None:
    """``(prompt_tokens, completion_tokens)`` of the ``usage`` object of a non-streamed JSON
    response body (a Responses body's ``input_tokens``, ``output_tokens``), each only when it is a non-negative integer (else ``None``); ``None`` when the
    body is not a JSON object or has no usage object. Only ``usage`` is built; every other field
    is skipped (faster than a full parse of the response)."""

# --- request analysis (rust/src/python/analyze.rs) ---

@disjoint_base
class AnalysisError(ValueError):
    """A request refused by the analyser, carrying OpenAI's error shape.

    OpenAI ``Error`` schema (openai-openapi ``openapi.yaml``): ``{"error": {"message", "type",
    "param", "code"}}``; all four keys are present, ``param`` / ``code`` may be ``None``.
    ``str(err)`` is ``message``. (Standalone ``ValueError`` subclass for now; the admission
    core's ``CoreError`` base, if any, is to be reconciled at merge time.)

    Attributes:
        status: HTTP status, ``400`` (invalid JSON / field, context overflow), ``404`` (unknown
            model: code ``model_not_found``; unknown route: code ``unknown_url``), ``413`` (body
            over the byte cap: code ``request_too_large``) or ``500`` (internal failure,
            ``type`` ``server_error``, code ``internal_error``; never the client's fault).
        type: ``"invalid_request_error"`` (or ``"server_error"`` for 500).
        param: the offending field, e.g. ``"messages"``, ``"max_tokens"``, ``"prompt"``,
            ``"input"``, ``"model"``, ``"messages[2].content[0].type"``; ``None`` for
            whole-body errors (invalid JSON, 413).
        code: ``"context_length_exceeded"``, ``"invalid_json"``, ``"invalid_type"``,
            ``"invalid_value"``, ``"missing_required_parameter"``, ``"empty_array"``,
            ``"integer_below_min_value"``, ``"integer_above_max_value"``,
            ``"chat_template_error"`` (the template's ``raise_exception`` or a render failure),
            ``"model_not_found"``, ``"unknown_url"``, ``"request_too_large"``,
            ``"internal_error"``.
        message: human-readable text. Context overflow keeps OpenAI's phrase: "This model's
            maximum context length is N tokens. However, you requested M tokens (P in the
            messages, C in the completion). ..." or, for the prompt alone, "... However, your
            messages resulted in P tokens. ...".
    """

    status: Final[int]
    type: Final[str]
    param: Final[str | None]
    code: Final[str | None]
    message: Final[str]
    def __new__(
        cls,
        message: str,
        status: int = 400,
        type: str = ...,
        param: str | None = None,
        code: str | None = None,
        /,
    ) -> Self:
        """Arguments are positional only (``BaseException.__init__`` takes no keywords).
        ``type`` defaults to ``"invalid_request_error"`` (the native signature shows it as
        ``...``)."""
    def body(self) -> dict[str, dict[str, Any]]:
        """The error body ``{"error": {"message", "type", "param", "code"}}`` as a dict."""
    def to_json(self) -> bytes:
        """The same body as compact JSON bytes, ready to send with ``status``."""

@final
class Analysis:
    """What one request costs, as computed by ``RequestAnalyzer.analyze`` (immutable).

    Attributes:
        model: the body's ``model``.
        route: ``"/v1/chat/completions"``, ``"/v1/completions"``, ``"/v1/embeddings"`` or
            ``"/v1/responses"``.
        prompt_tokens: prompt tokens (tokens), summed over the prompts of a batched
            completions / embeddings request.
        completion_tokens: completion tokens reserved (tokens): per-choice limit × ``n`` ×
            number of prompts. The per-choice limit is ``max_completion_tokens``, else
            ``max_tokens`` on chat, and ``max_tokens``, else ``max_completion_tokens`` on
            ``/v1/completions`` (the legacy API's own field); when both are absent, ``default_max_tokens`` (capped at the room
            left) if configured, else ``context_window - prompt_tokens`` (what vLLM / SGLang /
            TGI allow, docs/engines.md §4). Always 0 for embeddings. On ``/v1/responses`` the
            limit is ``max_output_tokens`` (absent: as above), and the prompt is the chat
            conversation the body renders as: ``instructions`` as a system message, ``input``
            (a string: one user message; or items: messages whose ``content`` is a string or
            ``input_text`` / ``output_text`` / image / audio parts, ``function_call`` and
            ``function_call_output`` items), ``tools``.
        n: choices per prompt: ``n``, or ``max(n, best_of)`` on ``/v1/completions``; 1 for
            embeddings and Responses.
        stream: the body's ``stream`` (``False`` when absent or null).
        include_usage: the body's ``stream_options.include_usage`` (always ``False`` on
            ``/v1/responses``, whose stream always ends with its usage).
        addable: none of the members the gateway may add to the forwarded body — ``stream``
            (none is added when the body has ``"stream": true``), ``stream_options`` and the
            output cap (``max_tokens``; ``max_output_tokens`` on ``/v1/responses``) — is in the
            body, whatever its value, so they can be spliced in without parsing the body again
            (always ``False`` for embeddings).
        reserved_tokens: ``prompt_tokens + completion_tokens`` (tokens): the TPM / in-flight
            reservation to make before forwarding, reconciled with the real usage afterwards.
        inject_max_tokens: set only when ``default_max_tokens`` was applied: the per-choice limit
            (tokens) the gateway must write into the forwarded body as ``max_tokens``
            (``max_output_tokens`` on ``/v1/responses``) so the
            engine honours the same bound as the reservation.
        counting: how ``prompt_tokens`` was obtained: ``"chat_template"`` (chat, the rendered
            template counted with the tokenizer, no extra special tokens), ``"overhead"`` (chat
            without a template: content, ``name``, ``tool_calls`` and ``tools`` JSON counted with
            the tokenizer, plus ``per_message_overhead`` per message), ``"tokenizer"``
            (completions / embeddings, counted with the tokenizer's special tokens), or
            ``"estimate"`` (no tokenizer configured: ``ceil(utf8_bytes / 4)`` per text).
        drop_cap: ``"max_tokens"`` or ``"max_completion_tokens"`` when the body has both keys:
            the one not reserved, which the gateway removes from the forwarded body so the
            engine receives exactly the cap reserved for (engines differ in which key they
            read; TGI takes the two as one field); else ``None``.
    """

    model: Final[str]
    route: Final[str]
    prompt_tokens: Final[int]
    completion_tokens: Final[int]
    n: Final[int]
    stream: Final[bool]
    include_usage: Final[bool]
    addable: Final[bool]
    reserved_tokens: Final[int]
    inject_max_tokens: Final[int | None]
    counting: Final[Literal["chat_template", "overhead", "tokenizer", "estimate"]]
    drop_cap: Final[Literal["max_tokens", "max_completion_tokens"] | None]

@final
class RequestAnalyzer:
    """One model's request analyser: body cap, OpenAI fields, prompt count, context check.

    Thread-safe and immutable; ``analyze`` releases the GIL for bodies of 1 KiB or more, so the
    gateway can call it from a thread pool (``loop.run_in_executor``) without blocking its event
    loop.

    Args:
        model: the model name clients send in ``model``; ``analyze`` refuses any other name
            with 404 ``model_not_found`` (use ``ModelRegistry`` to serve several).
        context_window: context window in tokens (prompt + completion), e.g. vLLM's
            ``max_model_len``; at least 1.
        tokenizer_path: path of the model's HuggingFace ``tokenizer.json``.
        tokenizer_json: the same file's text (give one of the two, or neither). Truncation and
            padding settings in the file are switched off (they would falsify counts). With
            no tokenizer, counts are the cheap deterministic estimate ``ceil(utf8_bytes / 4)``
            per text (``counting == "estimate"``), never exact.
        chat_template: a Jinja chat template's text; overrides the one in
            ``tokenizer_config_path``.
        chat_template_path: the path of a Jinja chat template file (give this or
            ``chat_template``, not both); overrides the one in ``tokenizer_config_path``.
            Errors about it name the path and the line.
        tokenizer_config_path: path of the model's ``tokenizer_config.json``: ``chat_template``
            (a string, or a list of ``{"name", "template"}`` with ``default`` and ``tool_use``,
            the latter used when the request has ``tools``), ``bos_token``, ``eos_token``.
            Templates render like transformers' ``apply_chat_template`` (trim_blocks,
            lstrip_blocks, loop controls; context ``messages``, ``tools``,
            ``add_generation_prompt`` (the body's, default true), the body's
            ``chat_template_kwargs`` as extra variables (vLLM's field, e.g.
            ``enable_thinking``), ``bos_token``, ``eos_token``, ``raise_exception``,
            ``strftime_now``; ``tojson`` as ``json.dumps(ensure_ascii=False)``; Python ``str`` /
            ``dict`` methods such as ``strip``, ``startswith``, ``split``, ``items``, ``get``).
            Content-part arrays reach the template as their text parts joined with ``"\\n"``
            (vLLM's "string" content format), and tool-call ``arguments`` strings as parsed
            objects (as vLLM does). With ``continue_final_message: true`` in the body the
            rendered prompt ends right after the last message's text (transformers' rule, which
            vLLM applies). Any template is rendered once here on a sample conversation (system,
            user, an assistant tool call, its result, with ``tools``; a template that refuses
            it with ``raise_exception`` is tried without the system message, then on one user
            message), so one that cannot render fails now, not on the first request.
        per_message_overhead: chat without a template: tokens added per message for the role
            and delimiters (tokens, default 4).
        image_tokens: tokens charged per image content part (``image_url`` / ``input_image``);
            default 765, OpenAI's price of one high-detail 512×512 tile (85 + 170 × 4).
        audio_tokens: tokens charged per audio content part (``input_audio``), default 200.
        default_max_tokens: completion tokens to reserve when a request sets neither
            ``max_tokens`` nor ``max_completion_tokens`` (then reported as
            ``Analysis.inject_max_tokens``); ``None`` reserves the rest of the window.
        max_body_bytes: cap on the raw body (bytes, default 32 MiB); larger bodies get 413
            without being parsed.

    Raises:
        ValueError: bad settings (``context_window`` 0, ``default_max_tokens`` 0, a token
            amount above 2**62, both tokenizer sources, both template sources, an invalid
            ``tokenizer.json`` / config / template, a template that cannot render the sample
            conversation; the message names the template's file and line).
        OSError: a path that cannot be read (``FileNotFoundError`` when it does not exist;
            the message names the argument and the path).
    """

    def __new__(
        cls,
        *,
        model: str,
        context_window: int,
        tokenizer_path: str | None = None,
        tokenizer_json: str | None = None,
        chat_template: str | None = None,
        tokenizer_config_path: str | None = None,
        per_message_overhead: int = 4,
        image_tokens: int = 765,
        audio_tokens: int = 200,
        default_max_tokens: int | None = None,
        max_body_bytes: int = ...,  # 33554432 (32 MiB, analyze::DEFAULT_MAX_BODY_BYTES)
        chat_template_path: str | None = None,
    ) -> Self: ...
    def analyze(self, route: str, body: bytes) -> Analysis:
        """Analyse one request body.

        Args:
            route: the request path: ``/v1/chat/completions``, ``/v1/completions``,
                ``/v1/embeddings`` or ``/v1/responses`` (the ``/v1`` prefix is optional, a
                query string is ignored).
            body: the raw body bytes.

        Returns:
            The ``Analysis``.

        Raises:
            AnalysisError: 413 body over ``max_body_bytes`` (checked before parsing); 400
                invalid JSON (including invalid UTF-8 and nesting deeper than 128 levels; a
                lone surrogate escape such as ``"\\ud800"`` is accepted, as Python's ``json``
                and vLLM accept it, and counted as U+FFFD), a non-object body, a missing /
                mistyped / out-of-range field (``max_tokens`` and ``max_completion_tokens``
                must be JSON integers in 1..2**62, ``n`` and ``best_of`` in 1..128 with
                ``best_of >= n``; a number past the range, such as ``1e30`` or an integer too
                large for 64 bits, is ``integer_above_max_value`` naming the bound;
                ``chat_template_kwargs`` an object, ``add_generation_prompt`` and
                ``continue_final_message`` booleans, not both true), empty ``messages`` /
                ``prompt`` / ``input``, unknown content-part type, token ids outside the
                vocabulary, more than 2048 embedding inputs, a chat template error, or the
                context check (``prompt_tokens >= context_window`` with no limit requested, or
                ``prompt + max_tokens > context_window``, per prompt), a reservation above
                2**62 tokens (``max_tokens``); 404 ``model_not_found``
                when ``model`` differs from this analyser's, ``unknown_url`` for another route;
                500 on an internal failure (panics are caught, never crash the process).
        """
    @property
    def model(self) -> str: ...
    @property
    def context_window(self) -> int:
        """Context window (tokens)."""
    @property
    def max_body_bytes(self) -> int:
        """Body cap (bytes)."""
    @property
    def default_max_tokens(self) -> int | None:
        """Completion reservation when the request sets no limit (tokens), if configured."""
    @property
    def has_chat_template(self) -> bool: ...
    @property
    def has_tokenizer(self) -> bool:
        """True when counts are exact (a ``tokenizer.json`` was given)."""
    def count_tokens(self, text: str) -> int:
        """Tokens in ``text`` without special tokens (tokens): the tokenizer's count, or
        ``ceil(utf8_bytes / 4)`` without a tokenizer. The gateway settles a stream whose engine
        sent no usage with it. Raises ``AnalysisError`` (500) if the tokenizer fails."""

@final
class ModelRegistry:
    """Analysers of several models, picked by the body's ``model``.

    Args:
        analyzers: one ``RequestAnalyzer`` per model name.

    Raises:
        ValueError: two analysers for the same model.
    """

    def __new__(cls, analyzers: Sequence[RequestAnalyzer]) -> Self: ...
    def analyze(self, route: str, body: bytes) -> Analysis:
        """Parse once, choose the analyser by ``model``, check its body cap, analyse.

        Raises:
            AnalysisError: as ``RequestAnalyzer.analyze``; 404 ``model_not_found`` (param
                ``"model"``) for a model no analyser serves; 413 above ``max_body_bytes`` of the
                registry before parsing, and above the chosen model's cap after.
        """
    def get(self, model: str) -> RequestAnalyzer | None: ...
    def models(self) -> list[str]:
        """Model names, sorted."""
    @property
    def max_body_bytes(self) -> int:
        """The largest body cap among the analysers (bytes): what to check ``Content-Length``
        against before the model is known."""
    def __len__(self) -> int: ...
    def __contains__(self, model: str, /) -> bool: ...

def go_duration(seconds: float) -> str:
    """Format a duration (seconds) the way Go's ``time.Duration.String`` does, as OpenAI's
    ``x-ratelimit-reset-*`` headers carry it: ``"0s"``, ``"850ms"``, ``"1.5s"``, ``"6m0s"``,
    ``"1h2m3s"``. The duration is rounded to the nearest millisecond first (``0.088000004`` →
    ``"88ms"``), so the text has at most three decimals and parses back within 0.5 ms. Below one
    second the unit is ``ms``; trailing zeros of fractions are dropped; anything under 1 ms but
    above zero is ``"1ms"`` (Go's ``µs`` is not ASCII, and a header must be); negative, zero and
    NaN are ``"0s"``; infinity and anything from Go's ``MaxInt64`` nanoseconds on is
    ``"2562047h47m16.854s"``."""

def http_response(
    status: int,
    headers: list[tuple[str, str]],
    body: bytes,
    connection: str | None = None,
) -> bytes:
    """A complete HTTP/1.1 response in one buffer: ``HTTP/1.1 <status> <reason phrase>``, the
    ``(name, value)`` ``headers`` in order, ``Content-Length`` (bytes of ``body``), ``Date``
    (RFC 9110 IMF-fixdate, system clock), ``Connection: <connection>`` when given (``close``, or
    ``keep-alive`` for an HTTP/1.0 client), a blank line, ``body``. ``headers`` must not carry
    ``Content-Length``, ``Date``, ``Connection`` or ``Transfer-Encoding``.

    Raises:
        ValueError: ``status`` outside 100..=999; a header name that is not an RFC 9110 token or
            a value (or ``connection``) with a control character other than tab (CR, LF, NUL, DEL,
            ...) — nothing that could split a response
            is ever written.
        OverflowError: ``status`` negative or above 65535.
        TypeError: ``headers`` not a list of ``(str, str)`` pairs.
    """

def relay_http(
    status: int,
    upstream_headers: Iterable[tuple[bytes, bytes]],
    body: bytes | None = None,
    connection: str | None = None,
    chunked: bool = True,
) -> bytes:
    """An engine's answer relayed to the client, serialized as HTTP/1.1: with ``body`` a whole
    response (``Content-Length``), else the head of a stream (``Transfer-Encoding: chunked``
    when ``chunked`` — an HTTP/1.1 client — else nothing: the body ends when the connection
    closes, pass ``connection="close"``). The headers are the engine's ``upstream_headers``
    (``(name, value)`` byte pairs in order, each value — aiohttp's ``raw_headers``) minus the
    hop-by-hop ones (RFC 9110 §7.6.1: ``Connection``, ``Keep-Alive``, ``Proxy-Authenticate``,
    ``Proxy-Authorization``, ``TE``, ``Trailer``, ``Transfer-Encoding``, ``Upgrade``) and those
    kvgate writes itself (``Content-Length``, ``Content-Encoding`` — the body is relayed
    decoded —, ``Date``, ``Server``), minus any that could split the response (a name that is
    not an RFC 9110 token; a control character other than tab in a value), minus those the
    engine's ``Connection`` header names and ``Proxy-Connection``, then ``Date`` and ``Connection`` as
    :func:`http_response` writes them.

    Raises:
        TypeError: ``upstream_headers`` not an iterable of ``(bytes, bytes)`` pairs.
        ValueError: ``status`` outside 100..=999, or ``connection`` with a control character.
        OverflowError: ``status`` negative or above 65535.
    """

def check_content_length(content_length: int | None, max_body_bytes: int) -> None:
    """Pre-reject a body from its declared size, before reading any of it.

    Call with the ``Content-Length`` header value (``None`` when absent, e.g. chunked), and
    while reading a chunked body with the running byte count.

    Args:
        content_length: declared or counted body size (bytes), or ``None``.
        max_body_bytes: the cap (bytes).

    Raises:
        AnalysisError: 413, code ``request_too_large``, when ``content_length > max_body_bytes``.
        OverflowError: a negative size.
    """

def peek_model(body: bytes) -> str:
    """Read only ``model`` from a body (the rest is skipped without building values).

    Raises:
        AnalysisError: 400 ``invalid_json`` / ``invalid_type`` (non-object body or non-string
            model) / ``missing_required_parameter`` (no ``model``).
    """

@final
class QuotaLedger:
    """A replica's quotas in a store shared by several gateway replicas (Redis), and the
    admissions taken from them without a call to the store: the local fast path of
    :class:`kvgate.store.redis_store.RedisStore`, whose agent talks to Redis and sizes the
    quotas. Flat arrays indexed by small integers: scopes (a tenant or a backend: a lease, the
    live replicas), pools (slots or in-flight tokens: quota ``q``, ``in_use``, demand ``taken``,
    ``unit`` of the last request, ``near`` the limit, effective ``limit``, configured ``base``),
    token buckets (``avail`` pre-debited tokens, ``taken``, grant ``chunk``, ``near``,
    ``burst``), and plans (the parts one kind of request takes from). Used from one event loop.

    Field numbers: pools ``0`` q, ``1`` in_use, ``2`` taken, ``3`` unit, ``4`` near (0/1),
    ``5`` limit, ``6`` base; buckets ``0`` avail, ``1`` taken, ``2`` chunk, ``3`` near (0/1),
    ``4`` burst.

    Args:
        chunk_fraction: ratio 0..1 of a limit ÷ live replicas a replica keeps beyond its use.
        on_kick: called with a scope's index when the agent must tell Redis about it now (a
            pool under its low-water mark, a bucket under a third of its grant, units given
            back near a limit, an overrun); after the call that caused it, in order, repeats
            kept.
        on_active: called with a scope's index when an admission made it active (until
            :meth:`set_active` clears the flag).

    Raises:
        ValueError: ``chunk_fraction`` outside 0..1; an unknown index or field number (every
            method that takes one).
    """

    def __new__(
        cls,
        chunk_fraction: float,
        *,
        on_kick: Callable[[int], object] | None = None,
        on_active: Callable[[int], object] | None = None,
    ) -> Self: ...
    def add_scope(self) -> int:
        """A new scope (lease expired, one live replica, inactive); its index."""
    def add_pool(self, scope: int, base: int) -> int:
        """A new pool of ``scope`` with its configured limit ``base`` (units); its index."""
    def add_bucket(self, scope: int, burst: int) -> int:
        """A new token bucket of ``scope`` of ``burst`` tokens; its index."""
    def add_plan(
        self,
        parts: list[tuple[int, list[tuple[bool, list[int]]], list[int]]],
        key: int | None = None,
    ) -> int:
        """A plan: per part ``(scope, [(counts_tokens, [pool, ...]), ...], [bucket, ...])``: a
        request takes one unit (or its tokens when ``counts_tokens``) from the first pool of
        each list with room, and its tokens from each bucket; its index. With ``key`` (an
        integer ≥ 0) :meth:`try_admit_key` finds it too."""
    def clear_plans(self) -> None:
        """Forgets every plan (the base limits changed); pools, buckets and holds stay."""
    def pool_get(self, pool: int, field: int) -> int:
        """A pool's field (see the class docstring)."""
    def pool_set(self, pool: int, field: int, value: int) -> None:
        """Sets a pool's field."""
    def bucket_get(self, bucket: int, field: int) -> int:
        """A bucket's field."""
    def bucket_set(self, bucket: int, field: int, value: int) -> None:
        """Sets a bucket's field."""
    def pool_take(self, pool: int, n: int) -> bool:
        """Takes ``n`` units of ``pool`` for a request the agent decided (in Redis, or from this
        replica's quota while it waited): ``in_use`` and ``taken`` grow by ``n``, ``unit``
        becomes ``n``. Whether the quota left is under the low-water mark (half of
        :meth:`pool_headroom`). Raises ``ValueError`` for an unknown pool."""
    def pool_gives_back(self, pool: int) -> bool:
        """Whether what ``pool`` holds beyond its use goes back to Redis now rather than at the
        next heartbeat: near its limit, or holding more than twice its headroom (the rule of
        :meth:`release`). Raises ``ValueError`` for an unknown pool."""
    def pool_headroom(self, pool: int) -> int:
        """Units this replica keeps beyond its use in ``pool``: ``chunk_fraction`` of the limit
        ÷ live replicas, within room for two requests of the last size and half of its even
        share; 0 near the limit, or when half of its even share is under one unit (a limit
        under twice the live replicas). The low-water mark is half of it."""
    def bucket_chunk_cap(self, bucket: int) -> int:
        """The largest grant of ``bucket`` (tokens): ``chunk_fraction`` of the burst ÷ live
        replicas, at least one."""
    def bucket_first_chunk(self, bucket: int, tokens: int) -> int:
        """The grant size of ``bucket`` before its demand is measured: eight requests of
        ``tokens``, within :meth:`bucket_chunk_cap`."""
    def scope_lease(self, scope: int) -> float:
        """Until when (seconds of the clock passed to :meth:`try_admit`) the scope's lease runs."""
    def set_scope_lease(self, scope: int, until: float) -> None:
        """Sets the scope's lease end (seconds)."""
    def scope_live(self, scope: int) -> int:
        """Live replicas in the scope as the store last said."""
    def set_scope_live(self, scope: int, live: int) -> None:
        """Sets the scope's live replicas."""
    def set_active(self, scope: int, active: bool) -> None:
        """Sets the scope's active flag (the agent clears it when it stops heartbeating there)."""
    def try_admit(self, plan: int, tokens: int, now: float) -> int | None:
        """Takes ``tokens`` (prompt + reserved completion) for a request of ``plan`` at ``now``
        (seconds): a hold id (never 0), or ``None`` with nothing taken when a scope's lease ran
        out, a pool list has no room, or a bucket holds fewer tokens."""
    def try_admit_key(self, key: int, tokens: int, now: float) -> int | None:
        """:meth:`try_admit` for the plan added with ``key``. Raises ``KeyError`` when no plan
        has that key (since the last :meth:`clear_plans`)."""
    def release(self, hold: int, reserved: int, actual: int) -> bool:
        """Gives a hold back: its units to the pools, ``reserved - actual`` tokens to each
        bucket (an overrun goes below zero). ``False`` (nothing changed) for a hold already
        given back or unknown."""
    def hold_parts(self, hold: int) -> tuple[list[tuple[int, int]], list[int]] | None:
        """The ``(pool, units)`` and buckets of a hold not yet given back, else ``None``."""
    def pools_in_use(self, scope: int) -> list[tuple[int, int]]:
        """The ``(pool, units in use)`` of the pools of ``scope`` whose requests hold units,
        in index order (one pass in Rust). Raises ``ValueError`` for an unknown scope."""
    @property
    def admissions(self) -> int:
        """Admissions counted (by :meth:`try_admit`, and by the agent's own)."""
    @admissions.setter
    def admissions(self, value: int) -> None: ...
    @property
    def warming(self) -> bool:
        """Whether the replica is warming up (its first heartbeats: it may not know yet how
        many replicas share its limits): a pool's headroom is then ``chunk_fraction`` of the
        limit ÷ live replicas only, without the floor of two requests, which at a small limit
        would be half of it. Off by default."""
    @warming.setter
    def warming(self, on: bool) -> None: ...

@final
class ReplicaSet:
    """The replicas (backends) that can serve a request, with what the routing stage reads of
    each: whether its health check passes and its last KV-cache usage. The gateway keeps one
    per served model (and one of every backend), updated as health checks and engine metrics
    arrive, so that choosing among a thousand replicas reads the admission core's atomics in
    Rust and no Python object. Used from one event loop.

    Args:
        backends: the members' backend ids in the admission core, in order (ties go to the
            earlier one); every member starts healthy, its KV-cache usage unknown.

    Raises:
        ValueError: an id given twice.
    """

    def __new__(cls, backends: Sequence[int]) -> Self: ...
    def __len__(self) -> int: ...
    @property
    def backends(self) -> list[int]:
        """The members' backend ids, in order."""
    @property
    def healthy(self) -> int:
        """How many members are healthy."""
    def set_healthy(self, backend: int, healthy: bool) -> None:
        """Marks member ``backend`` (its id) healthy or not: an unhealthy one is never chosen.

        Raises:
            ValueError: ``backend`` is not a member.
        """
    def set_kv_usage(self, backend: int, kv_usage: float | None) -> None:
        """Member ``backend``'s KV-cache usage (ratio 0..1 as its engine last reported it;
        ``None``: unknown, counted as 0).

        Raises:
            ValueError: ``backend`` is not a member, or ``kv_usage`` is not finite.
        """
    def most_headroom(self, controller: AdmissionController) -> int | None:
        """The position (in :attr:`backends`) of the healthy member with the most headroom in
        ``controller``: the largest free slot ratio ``(limit - in_use) / limit`` of its
        effective (scaled) concurrency limit, then the lowest KV-cache usage; ties go to the
        earlier member. ``None`` when no member is healthy.

        Raises:
            InvalidConfigError: a member id that ``controller`` does not know.
        """
