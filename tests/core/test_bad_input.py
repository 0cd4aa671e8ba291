"""Bad input to the admission core raises clearly and changes nothing."""

from __future__ import annotations

import sys

import pytest

import kvgate
from kvgate import (
    AdaptiveLaw,
    AdmissionController,
    InvalidAmountError,
    InvalidConfigError,
    ManualClock,
    NeverAdmissibleError,
    OverReleaseError,
    SlotPool,
    TokenBucket,
)

BAD_INTS = [-1, -(2**70), 2**63, 2**62 + 1]
BAD_TYPES = [1.0, 0.5, None, "3", True]


def test_error_tree() -> None:
    assert issubclass(InvalidAmountError, kvgate.CoreError)
    assert issubclass(InvalidAmountError, ValueError)
    assert issubclass(NeverAdmissibleError, ValueError)
    assert issubclass(OverReleaseError, ValueError)
    assert issubclass(kvgate.SharedStateError, OSError)
    assert issubclass(InvalidConfigError, ValueError)


@pytest.mark.parametrize("bad", BAD_INTS)
def test_slot_pool_bad_ints(bad: int) -> None:
    pool = SlotPool(4)
    with pytest.raises(InvalidAmountError, match="invalid n amount"):
        pool.try_acquire(bad)
    with pytest.raises(InvalidAmountError):
        pool.release(bad)
    with pytest.raises(InvalidAmountError):
        SlotPool(bad)
    assert pool.in_use == 0


@pytest.mark.parametrize("bad", BAD_TYPES)
def test_slot_pool_bad_types(bad: object) -> None:
    pool = SlotPool(4)
    if bad is None:  # None means "the default n=1" for the optional argument
        assert pool.try_acquire(bad)
        pool.release(bad)
        return
    with pytest.raises(TypeError, match="must be an int"):
        pool.try_acquire(bad)  # type: ignore[arg-type]
    assert pool.in_use == 0


def test_slot_pool_argument_forms() -> None:
    """try_acquire / release are hand-written CPython methods: they take n by position or by
    keyword, refuse anything else like any Python method, and are introspectable."""
    import inspect

    pool = SlotPool(8)
    assert pool.try_acquire(n=3)
    assert pool.in_use == 3
    pool.release(n=2)
    assert SlotPool.try_acquire(pool, 2)  # unbound call
    SlotPool.release(pool, n=None)
    assert pool.in_use == 2
    for call in (pool.try_acquire, pool.release):
        with pytest.raises(TypeError, match="at most 1 argument"):
            call(1, 2)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="multiple values for argument 'n'"):
            call(1, n=1)  # type: ignore[call-arg, misc]
        with pytest.raises(TypeError, match="unexpected keyword argument 'slots'"):
            call(slots=1)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="must be an int"):
            call(n=2.0)  # type: ignore[arg-type]
        with pytest.raises(InvalidAmountError):
            call(n=-1)
        assert str(inspect.signature(call)) == "(n=None)"
        assert call.__doc__
    with pytest.raises(TypeError):
        SlotPool.try_acquire(TokenBucket(10), 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        SlotPool.release(object())  # type: ignore[arg-type]
    with pytest.raises(OverReleaseError, match="release of 3 but only 2 held"):
        pool.release(n=3)
    assert pool.in_use == 2
    assert not pool.try_acquire(7)
    pool.release(2)
    assert pool.in_use == 0


def _assert_errors_hold_no_references(calls: list[tuple[object, type[BaseException]]]) -> None:
    """Each ``call`` raises ``kind`` 2,000 times; the exception type's reference count must not
    grow with the calls (an error that parks references would add one or two per call)."""
    for call, kind in calls:
        before = sys.getrefcount(kind)
        for _ in range(2_000):
            with pytest.raises(kind):
                call()  # type: ignore[operator]
        assert sys.getrefcount(kind) - before < 50, (call, kind)


def test_slot_pool_errors_hold_no_references() -> None:
    """Errors raised by the hand-written methods release what they hold at once (no reference
    parked in pyo3's deferred pool until some other call runs)."""
    pool = SlotPool(4)
    # each kind of error on its own: a call that converts a core error goes through pyo3's
    # attach, which would flush references parked by the calls before it
    calls = [
        (lambda: pool.release(1.5), TypeError),
        (lambda: pool.try_acquire(slots=1), TypeError),
        (lambda: pool.release(1, 2), TypeError),
        (lambda: pool.try_acquire(-1), InvalidAmountError),
        (lambda: pool.release(2**100), InvalidAmountError),
        (lambda: pool.release(), OverReleaseError),
    ]
    _assert_errors_hold_no_references(calls)
    assert pool.in_use == 0


def test_slot_pool_zero_and_over_release() -> None:
    pool = SlotPool(1)
    assert pool.try_acquire(0)
    pool.release(0)
    with pytest.raises(OverReleaseError, match="only 0 held"):
        pool.release()
    assert pool.try_acquire()
    with pytest.raises(OverReleaseError):
        pool.release(2)
    assert pool.in_use == 1
    with pytest.raises(TypeError):
        pool.limit = 2.5  # type: ignore[assignment]


@pytest.mark.parametrize("bad", [*BAD_INTS, *BAD_TYPES])
def test_token_bucket_bad_amounts(bad: object) -> None:
    clock = ManualClock()
    b = TokenBucket(600, clock=clock)
    exc = InvalidAmountError if isinstance(bad, int) and not isinstance(bad, bool) else TypeError
    with pytest.raises(exc):
        b.try_reserve(bad)  # type: ignore[arg-type]
    with pytest.raises(exc):
        b.reconcile(10, bad)  # type: ignore[arg-type]
    with pytest.raises(exc):
        TokenBucket(bad)  # type: ignore[arg-type]
    assert b.available == 600


def test_token_bucket_zero_and_never() -> None:
    b = TokenBucket(60, 10, clock=ManualClock())
    assert b.try_reserve(0)
    b.reconcile(0, 0)
    assert b.available == 10
    with pytest.raises(NeverAdmissibleError) as ei:
        b.try_reserve(11)
    assert (ei.value.requested, ei.value.limit) == (11, 10)
    with pytest.raises(NeverAdmissibleError):
        b.retry_after(11)
    with pytest.raises(InvalidConfigError):
        TokenBucket(0)
    with pytest.raises(InvalidConfigError):
        TokenBucket(10, 0)


def test_adaptive_law_bad_input() -> None:
    law = AdaptiveLaw(clock=ManualClock())
    for bad in (1.01, -0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="kv_usage"):
            law.target(bad, 0)
        with pytest.raises(ValueError, match="kv_usage"):
            law.update(bad, 0)
    with pytest.raises(ValueError, match="waiting"):
        law.update(0.5, -1)
    assert law.scale == 1.0
    with pytest.raises(InvalidConfigError):
        AdaptiveLaw(high=0.5, low=0.7)
    with pytest.raises(InvalidConfigError):
        AdaptiveLaw(floor=0.0)


def _controller() -> tuple[AdmissionController, int, int]:
    ctl = AdmissionController(clock=ManualClock())
    b = ctl.add_backend("b", max_concurrency=2, tokens_per_minute=6000, inflight_token_limit=500)
    t = ctl.add_tenant("t", priority="standard", tokens_per_minute=1000)
    return ctl, b, t


@pytest.mark.parametrize("bad", [*BAD_INTS, *BAD_TYPES])
def test_admit_bad_tokens(bad: object) -> None:
    ctl, b, t = _controller()
    exc = InvalidAmountError if isinstance(bad, int) and not isinstance(bad, bool) else TypeError
    with pytest.raises(exc):
        ctl.admit(b, t, "standard", bad)  # type: ignore[arg-type]
    assert ctl.backend_state(b)["in_use"] == 0
    assert ctl.tenant_state(t)["available_tokens"] == 1000


def test_admit_and_release_argument_forms() -> None:
    """``admit`` and ``Reservation.release`` (hand-written CPython entry points) bind positional
    and keyword arguments like a Python function, refuse bad forms with a TypeError that names
    the call, and hold nothing after a refused call."""
    import inspect

    ctl, b, t = _controller()
    r = ctl.admit(backend=b, tenant=t, priority="standard", tokens=100)
    assert r.admitted
    assert r.tokens == 100
    r.release(actual_tokens=60)
    assert r.released
    r2 = AdmissionController.admit(ctl, b, t, priority=1, tokens=50)  # unbound call, class code
    assert r2.admitted
    kvgate.Reservation.release(r2)
    assert r2.released
    # a priority spelled by a str that is not the interned literal still parses
    r3 = ctl.admit(b, t, "".join(["stand", "ard"]), 10)
    assert r3.admitted
    r3.release(None)
    assert str(inspect.signature(ctl.admit)) == "(backend, tenant, priority, tokens)"
    assert str(inspect.signature(r.release)) == "(actual_tokens=None)"
    assert ctl.admit.__doc__
    assert r.release.__doc__
    bad_calls: list[tuple[object, str]] = [
        (lambda: ctl.admit(b, t, "standard"), "missing required argument 'tokens'"),
        (lambda: ctl.admit(), "missing required argument 'backend'"),
        (lambda: ctl.admit(b, t, "standard", 1, 2), "takes at most 4 arguments"),
        (lambda: ctl.admit(b, t, "standard", 1, x=2), "unexpected keyword argument 'x'"),
        (lambda: ctl.admit(b, t, "standard", backend=b), "multiple values for argument 'backend'"),
        (lambda: ctl.admit("0", t, "standard", 1), "argument 'backend'"),
        (lambda: ctl.admit(b, 0.0, "standard", 1), "argument 'tenant'"),
        (lambda: ctl.admit(b, t, None, 1), "priority must be"),
        (lambda: AdmissionController.admit(SlotPool(1), b, t, "standard", 1), "admit"),
    ]
    for call, message in bad_calls:
        with pytest.raises(TypeError, match=message):
            call()  # type: ignore[operator]
    with pytest.raises(OverflowError):
        ctl.admit(-1, t, "standard", 1)
    with pytest.raises(OverflowError):
        ctl.admit(b, 2**40, "standard", 1)
    held = ctl.admit(b, t, "standard", 10)
    for call, message in [
        (lambda: held.release(1, 2), "takes at most 1 argument"),
        (lambda: held.release(tokens=1), "unexpected keyword argument 'tokens'"),
        (lambda: held.release(1, actual_tokens=1), "multiple values"),
        (lambda: kvgate.Reservation.release(object()), "release"),
    ]:
        with pytest.raises(TypeError, match=message):
            call()  # type: ignore[operator]
    assert not held.released, "a bad release call must not release"
    held.release()
    assert ctl.backend_state(b)["in_use"] == 0
    assert ctl.tenant_state(t)["in_use"] == 0


def test_admit_errors_hold_no_references() -> None:
    """Errors raised by the hand-written ``admit`` / ``release`` free what they hold at once, and
    a refused or admitted call leaves no reference to its arguments behind."""
    ctl, b, t = _controller()
    held = ctl.admit(b, t, "standard", 10)
    calls = [
        (lambda: ctl.admit(b, t, "standard", 1.5), TypeError),
        (lambda: ctl.admit(b, t, "standard", x=1), TypeError),
        (lambda: ctl.admit(b, t, "urgent", 1), InvalidConfigError),
        (lambda: ctl.admit(7, t, "standard", 1), InvalidConfigError),
        (lambda: ctl.admit(b, t, "standard", -1), InvalidAmountError),
        (lambda: held.release(1.5), TypeError),
        (lambda: held.release(2**100), InvalidAmountError),
    ]
    _assert_errors_hold_no_references(calls)
    held.release()
    assert ctl.backend_state(b)["in_use"] == 0
    big = AdmissionController()
    b2 = big.add_backend(
        "b", max_concurrency=2, tokens_per_minute=10**9, inflight_token_limit=10**6
    )
    t2 = big.add_tenant("t", priority="standard")
    tokens, actual = 10**6 + 7, 10**5 + 3  # not cached small ints: their counts show a leak
    key = "standard"
    counts = (tokens, actual, big, key)
    before = [sys.getrefcount(o) for o in counts]
    for _ in range(2_000):
        assert not big.admit(b2, t2, key, tokens)  # never admissible: above the in-flight budget
        big.admit(b2, t2, key, 10**5 + 5).release(actual)
    assert [sys.getrefcount(o) for o in counts] == before
    assert big.backend_state(b2)["in_use"] == 0


def test_admit_bad_ids_priority_and_release() -> None:
    ctl, b, t = _controller()
    with pytest.raises(InvalidConfigError, match="unknown backend"):
        ctl.admit(7, t, "standard", 1)
    with pytest.raises(InvalidConfigError, match="unknown tenant"):
        ctl.admit(b, 7, "standard", 1)
    with pytest.raises(InvalidConfigError, match="priority"):
        ctl.admit(b, t, "urgent", 1)
    with pytest.raises(TypeError, match="priority"):
        ctl.admit(b, t, 1.0, 1)  # type: ignore[arg-type]
    r = ctl.admit(b, t, "standard", 0)
    assert r.admitted
    assert isinstance(r, kvgate.Reservation)
    with pytest.raises(InvalidAmountError):
        r.release(-5)
    assert not r.released, "a bad release argument must not release"
    with pytest.raises(TypeError):
        r.release(2.5)  # type: ignore[arg-type]
    r.release(0)
    r.release(0)  # second release is a no-op
    assert ctl.backend_state(b)["in_use"] == 0
    with pytest.raises(InvalidConfigError):
        ctl.set_scale(b, 0.0)
    with pytest.raises(InvalidConfigError):
        ctl.set_scale(b, 1.5)
    with pytest.raises(InvalidConfigError, match="sheddable"):
        ctl.add_tenant("s", priority="sheddable", guaranteed_slots=1)
    with pytest.raises(InvalidConfigError, match="guaranteed"):
        ctl.add_tenant("g", priority="critical", guaranteed_slots=3)
    with pytest.raises(InvalidConfigError, match="already exists"):
        ctl.add_backend("b", max_concurrency=1, tokens_per_minute=1)


class _IntSub(int):
    pass


class _Index:
    """Not an int, but convertible through ``__index__`` (as numpy integers are)."""

    calls = 0

    def __index__(self) -> int:
        _Index.calls += 1
        return 0


@pytest.mark.parametrize("arg", ["backend", "tenant"])
@pytest.mark.parametrize("bad", [True, False, _Index(), 0.0, "0", None])
def test_admit_refuses_bool_and_non_int_ids(arg: str, bad: object) -> None:
    """A backend or tenant id is an int like the token amounts: ``admit(True, ...)`` used to
    admit on backend 1 (``False`` on id 0) and an object with ``__index__`` was called; both
    are a ``TypeError`` naming the argument now, and nothing is held."""
    ctl, b, t = _controller()
    args = {"backend": b, "tenant": t, "priority": "standard", "tokens": 10}
    args[arg] = bad
    _Index.calls = 0
    with pytest.raises(
        TypeError, match=f"argument '{arg}': must be an int .*got {type(bad).__name__}"
    ):
        ctl.admit(**args)  # type: ignore[arg-type]
    assert _Index.calls == 0, "no Python code runs while reading an id"
    assert ctl.backend_state(b)["in_use"] == 0
    assert ctl.tenant_state(t)["in_use"] == 0
    # an int subclass is an int: its value is used
    args[arg] = _IntSub(0)
    r = ctl.admit(**args)  # type: ignore[arg-type]
    assert r.admitted
    r.release()


@pytest.mark.parametrize("arg", ["backend", "tenant"])
@pytest.mark.parametrize("bad", [-1, 2**32, -(2**40), 2**64, 2**200, _IntSub(-3)])
def test_admit_id_out_of_range_names_the_argument(arg: str, bad: int) -> None:
    ctl, b, t = _controller()
    args = {"backend": b, "tenant": t, "priority": "standard", "tokens": 10}
    args[arg] = bad
    with pytest.raises(OverflowError, match=f"argument '{arg}': id .*outside 0..2\\*\\*32"):
        ctl.admit(**args)  # type: ignore[arg-type]
    assert ctl.backend_state(b)["in_use"] == 0
    # in range but never registered: the core's error
    args[arg] = 2**32 - 1
    with pytest.raises(InvalidConfigError, match=f"unknown {arg} id 4294967295"):
        ctl.admit(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "shown"),
    [
        (-1, "code -1:"),
        (3, "code 3:"),
        (2**64, f"code {2**64}:"),
        (_IntSub(-2), "code -2:"),
        (2**200, "code outside the 128-bit range:"),
        ("\ud800", 'class "\ufffd+"'),  # regex: a lone surrogate shows as replacement chars
        ("critical\ud800", 'class "critical\ufffd+"'),
    ],
)
def test_admit_bad_priority_shows_the_value_given(bad: object, shown: str) -> None:
    """A negative or huge priority code used to be reported as 18446744073709551615 (wrapped),
    and a str with a lone surrogate raised ``UnicodeEncodeError``; both are an
    ``InvalidConfigError`` that shows what was given, for ``admit`` and ``add_tenant``."""
    ctl, b, t = _controller()
    with pytest.raises(InvalidConfigError, match=f"unknown priority {shown}"):
        ctl.admit(b, t, bad, 10)  # type: ignore[arg-type]
    assert ctl.backend_state(b)["in_use"] == 0
    with pytest.raises(InvalidConfigError, match=f"unknown priority {shown}"):
        ctl.add_tenant("t2", priority=bad)  # type: ignore[arg-type]


def test_fast_methods_unexpected_surrogate_keyword() -> None:
    """A keyword name that is not valid UTF-8 is an unexpected keyword argument (a TypeError
    naming the call), as for a Python function, not a ``UnicodeEncodeError``; nothing is held
    or released."""
    ctl, b, t = _controller()
    bad = {"\ud800": 1}
    with pytest.raises(TypeError, match="admit\\(\\) got an unexpected keyword argument"):
        ctl.admit(b, t, "standard", 10, **bad)
    held = ctl.admit(b, t, "standard", 10)
    with pytest.raises(TypeError, match="release\\(\\) got an unexpected keyword argument"):
        held.release(**bad)
    assert not held.released
    assert ctl.backend_state(b)["in_use"] == 1
    held.release()
    pool = SlotPool(2)
    for call in (pool.try_acquire, pool.release):
        with pytest.raises(TypeError, match="got an unexpected keyword argument"):
            call(**bad)
    assert pool.in_use == 0
    assert ctl.backend_state(b)["in_use"] == 0


_ID_METHODS: list[tuple[str, tuple[str, ...], object]] = [
    ("backend_state", ("backend",), lambda c, b, t: c.backend_state(b)),
    ("tenant_state", ("tenant",), lambda c, b, t: c.tenant_state(t)),
    ("set_scale", ("backend",), lambda c, b, t: c.set_scale(b, 0.5)),
    ("set_shedding", ("backend",), lambda c, b, t: c.set_shedding(b, True)),
    ("set_inflight_external", ("backend",), lambda c, b, t: c.set_inflight_external(b, 1)),
    ("update_backend", ("backend",), lambda c, b, t: c.update_backend(b, max_concurrency=1)),
    ("update_tenant", ("tenant",), lambda c, b, t: c.update_tenant(t, max_concurrency=1)),
    ("rate_limit_headers", ("backend", "tenant"), lambda c, b, t: c.rate_limit_headers(b, t)),
    (
        "refusal_headers",
        ("backend", "tenant"),
        lambda c, b, t: c.refusal_headers(b, t, 1.0, "backend-slots"),
    ),
    ("relay_http", ("backend", "tenant"), lambda c, b, t: c.relay_http(b, t, 200, [], b"{}")),
]


@pytest.mark.parametrize(("name", "args", "call"), _ID_METHODS, ids=[m[0] for m in _ID_METHODS])
@pytest.mark.parametrize(
    ("bad", "kind", "message"),
    [
        (True, TypeError, "must be an int .*got bool"),
        (_Index(), TypeError, "must be an int .*got _Index"),
        (1.0, TypeError, "must be an int .*got float"),
        (-1, OverflowError, "id -1 is outside 0..2\\*\\*32"),
        (2**40, OverflowError, f"id {2**40} is outside 0..2\\*\\*32"),
    ],
)
def test_controller_methods_read_ids_like_admit(
    name: str,
    args: tuple[str, ...],
    call: object,
    bad: object,
    kind: type[Exception],
    message: str,
) -> None:
    """Every controller method that takes a backend or tenant id reads it as ``admit`` does:
    a bool or non-int is a ``TypeError``, an int outside ``0..2**32`` an ``OverflowError``,
    each naming the argument (``backend_state(True)`` used to read backend 1, ``set_scale(-1,
    ...)`` said 'out of range integral type conversion attempted'); nothing changes."""
    ctl, b, t = _controller()
    before = (ctl.backend_state(b), ctl.tenant_state(t))
    for arg in args:
        ids = {"backend": b, "tenant": t, arg: bad}
        with pytest.raises(kind, match=f"argument '{arg}': {message}"):
            call(ctl, ids["backend"], ids["tenant"])  # type: ignore[operator]
    assert (ctl.backend_state(b), ctl.tenant_state(t)) == before
