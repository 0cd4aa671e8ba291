"""kvgate.loadgen.percentile does what its docstring says (sorted index round(q * (n - 1)))."""

from __future__ import annotations

import math

from kvgate.loadgen import percentile


def test_empty_is_none() -> None:
    assert percentile([], 0.5) is None


def test_index_is_round_q_times_n_minus_one() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # unsorted on purpose
    assert percentile(values, 0.99) == 99.0  # index 98: the second-largest of 100
    assert percentile(values, 0.5) == 51.0  # round(49.5) = 50 (halves to even) → 51
    assert percentile(values, 0.0) == 1.0
    assert percentile(values, 1.0) == 100.0


def test_halves_round_to_even_and_q_is_clamped() -> None:
    assert percentile([1.0, 2.0], 0.5) == 1.0  # round(0.5) = 0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 3.0  # round(1.5) = 2
    assert percentile([1.0, 2.0, 3.0], 1.5) == 3.0
    assert percentile([1.0, 2.0, 3.0], -0.5) == 1.0


def test_differs_from_the_textbook_nearest_rank() -> None:
    """Why the docstring must not say "nearest rank": for q=0.9 over 7 values the textbook
    method takes the ceil(6.3) = 7th smallest (index 6); ours takes index round(5.4) = 5."""
    values = [float(v) for v in range(7)]
    assert math.ceil(0.9 * 7) - 1 == 6
    assert percentile(values, 0.9) == 5.0
