"""Latency targets per priority class: an adaptive concurrency controller on LLM signals.

Config (optional, top level)::

    slo:
      critical: {ttft_p99_s: 1.0, tpot_p99_s: 0.1}
      standard: {ttft_p99_s: 8.0}

What it does, per backend and per gateway process, once per ``interval_s``:

- It measures each class's time to first token (TTFT: from the request leaving kvgate to the
  first bytes of the engine's answer) and time per output token (TPOT: the rest of the stream ÷
  the tokens after the first) of the requests that finished in the last ``window_s`` seconds,
  and takes their 99th percentile (with at least ``min_samples`` requests; fewer say nothing).
- While a class misses a target, every lower class (critical > standard > sheddable) gets a
  concurrency cap on this backend, lowered multiplicatively (× ``decrease``) from what it runs
  now, never below 1 — again at each step that brings requests finished since the last cut (old
  evidence does not cut twice): lower classes give way, as in gradient and AIMD concurrency
  limiters.
- While every class with a target meets it with a margin (p99 ≤ ``headroom`` × target), the caps
  of the lower classes rise additively (+ ``max(1, 10 %)``) and disappear once above the
  backend's effective concurrency.

A capped class is refused with reason ``slo-limit`` (HTTP 503 and a retry hint; a tenant that may
wait waits in the priority queue). The KV watermarks and the in-flight token budget stay the hard
safety net: this controller only lowers limits further, never raises them past the configured or
discovered ones.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CLASSES", "ClassTargets", "SloController"]

#: priority classes, highest first
CLASSES = ("critical", "standard", "sheddable")


@dataclass(frozen=True, slots=True)
class ClassTargets:
    """One class's targets (seconds; ``None``: no target)."""

    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None


@dataclass(slots=True)
class _Window:
    """Observations of one class on one backend: (time, ttft, tpot) of finished requests."""

    samples: deque[tuple[float, float, float | None]] = field(default_factory=deque)

    def add(self, now: float, ttft: float, tpot: float | None, limit: int) -> None:
        self.samples.append((now, ttft, tpot))
        while len(self.samples) > limit:
            self.samples.popleft()

    def p99(
        self, now: float, window_s: float, min_samples: int
    ) -> tuple[float | None, float | None]:
        while self.samples and self.samples[0][0] < now - window_s:
            self.samples.popleft()
        if len(self.samples) < min_samples:
            return None, None
        ttfts = sorted(s[1] for s in self.samples)
        tpots = sorted(s[2] for s in self.samples if s[2] is not None)
        return _p99(ttfts), (_p99(tpots) if len(tpots) >= min_samples else None)


def _p99(values: list[float]) -> float:
    """The 99th percentile of sorted ``values`` (nearest rank)."""
    return values[max(0, math.ceil(0.99 * len(values)) - 1)]


@dataclass(slots=True)
class _Backend:
    windows: dict[str, _Window] = field(default_factory=lambda: {c: _Window() for c in CLASSES})
    running: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    caps: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(CLASSES, None))
    bound_by: dict[str, str] = field(default_factory=lambda: dict.fromkeys(CLASSES, "none"))
    last: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    #: when the caps were last lowered: a miss lowers them again only on newer evidence
    last_cut: float = float("-inf")


class SloController:
    """Per-class latency targets turned into concurrency caps on the lower classes (see the
    module docstring).

    Args:
        targets: class name → :class:`ClassTargets`.
        ceiling: backend name → its effective concurrency now (slots), for dropping a cap that
            rose past it.
        interval_s, window_s, min_samples, decrease, headroom: the controller's period
            (seconds), measurement window (seconds), least requests for a percentile, the
            multiplicative decrease (ratio 0..1) and the margin under which caps rise (ratio
            0..1).
        clock: seconds, monotonic (tests inject one).
        on_raise: called when a cap rose or disappeared (the wait queue's ``notify``).
    """

    def __init__(
        self,
        targets: Mapping[str, ClassTargets],
        ceiling: Callable[[str], int],
        *,
        interval_s: float = 1.0,
        window_s: float = 10.0,
        min_samples: int = 10,
        decrease: float = 0.8,
        headroom: float = 0.8,
        clock: Callable[[], float] = time.monotonic,
        on_raise: Callable[[], None] | None = None,
    ) -> None:
        unknown = set(targets) - set(CLASSES)
        if unknown:
            raise ValueError(f"unknown priority class in slo: {sorted(unknown)}")
        self.targets = dict(targets)
        self.ceiling = ceiling
        self.interval_s = interval_s
        self.window_s = window_s
        self.min_samples = min_samples
        self.decrease = decrease
        self.headroom = headroom
        self.clock = clock
        self.on_raise = on_raise
        self._backends: dict[str, _Backend] = {}
        self._next = 0.0

    def _b(self, backend: str) -> _Backend:
        b = self._backends.get(backend)
        if b is None:
            b = self._backends[backend] = _Backend()
        return b

    # ---- the request path -----------------------------------------------------------------
    def allow(self, backend: str, priority: str) -> bool:
        """Whether a request of class ``priority`` may start on ``backend`` now (its class is
        under its cap). Runs the controller when its period has passed."""
        now = self.clock()
        if now >= self._next:
            self.tick(now)
        b = self._b(backend)
        cap = b.caps.get(priority)
        return cap is None or b.running[priority] < cap

    def started(self, backend: str, priority: str) -> None:
        """A request of class ``priority`` started on ``backend``."""
        self._b(backend).running[priority] += 1

    def finished(
        self,
        backend: str,
        priority: str,
        ttft: float | None,
        duration: float | None = None,
        completion_tokens: int = 0,
    ) -> None:
        """A request ended: its slot in the class count goes back, and its TTFT (seconds;
        ``None`` when it produced nothing) and TPOT (from ``duration`` seconds and
        ``completion_tokens``) are observed."""
        b = self._b(backend)
        b.running[priority] = max(0, b.running[priority] - 1)
        if ttft is None:
            return
        tpot = None
        if duration is not None and completion_tokens >= 2 and duration > ttft:
            tpot = (duration - ttft) / (completion_tokens - 1)
        b.windows[priority].add(self.clock(), ttft, tpot, 4096)

    # ---- the controller -------------------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        """One control step for every backend (see the module docstring)."""
        now = self.clock() if now is None else now
        self._next = now + self.interval_s
        raised = False
        for name, b in self._backends.items():
            missed_by: str | None = None
            all_met = True
            for cls in CLASSES:
                target = self.targets.get(cls)
                ttft, tpot = b.windows[cls].p99(now, self.window_s, self.min_samples)
                b.last[cls] = (ttft, tpot)
                if target is None:
                    continue
                miss = None
                if target.ttft_p99_s is not None and ttft is not None:
                    if ttft > target.ttft_p99_s:
                        miss = f"{cls}-ttft"
                    elif ttft > self.headroom * target.ttft_p99_s:
                        all_met = False
                if target.tpot_p99_s is not None and tpot is not None:
                    if tpot > target.tpot_p99_s:
                        miss = miss or f"{cls}-tpot"
                    elif tpot > self.headroom * target.tpot_p99_s:
                        all_met = False
                if miss is not None:
                    missed_by = miss
                    samples = b.windows[cls].samples
                    if samples and samples[-1][0] > b.last_cut:
                        self._lower_below(b, cls, miss)
                        b.last_cut = now
                    break  # the highest class that misses decides
            if missed_by is None and all_met:
                raised |= self._raise(b, self.ceiling(name))
        if raised and self.on_raise is not None:
            self.on_raise()

    def _lower_below(self, b: _Backend, cls: str, why: str) -> None:
        for lower in CLASSES[CLASSES.index(cls) + 1 :]:
            base = b.caps[lower]
            if base is None:
                base = max(1, b.running[lower])
            b.caps[lower] = max(1, math.floor(base * self.decrease))
            b.bound_by[lower] = why

    def _raise(self, b: _Backend, ceiling: int) -> bool:
        raised = False
        for cls in CLASSES:
            cap = b.caps[cls]
            if cap is None:
                continue
            cap += max(1, math.ceil(cap * 0.1))
            raised = True
            if cap >= ceiling:
                b.caps[cls] = None
                b.bound_by[cls] = "none"
            else:
                b.caps[cls] = cap
        return raised

    # ---- state ------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """``/admin/state``'s ``slo`` entry: per backend and class, the cap (``None``: none),
        what bound it, the requests running, and the p99 TTFT / TPOT measured (seconds)."""
        out: dict[str, Any] = {}
        for name, b in self._backends.items():
            out[name] = {
                cls: {
                    "cap": b.caps[cls],
                    "bound_by": b.bound_by[cls],
                    "running": b.running[cls],
                    "ttft_p99_s": (b.last.get(cls) or (None, None))[0],
                    "tpot_p99_s": (b.last.get(cls) or (None, None))[1],
                    "target": (
                        None
                        if cls not in self.targets
                        else {
                            "ttft_p99_s": self.targets[cls].ttft_p99_s,
                            "tpot_p99_s": self.targets[cls].tpot_p99_s,
                        }
                    ),
                }
                for cls in CLASSES
            }
        return out
