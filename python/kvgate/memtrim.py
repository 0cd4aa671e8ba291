"""Giving the C heap's free pages back to the operating system (glibc's ``malloc_trim``).

Why: a gateway behind a fast engine reads what piled up in large pieces, and its answers'
bytes, the engine's reads and the SSE inspector's buffers (Rust) come from the C heap. Once
they are freed, the heap keeps their pages: glibc gives back on its own only free space at the
heap's top, and the long-lived allocations made in between pin everything below. The resident
memory then shows the peak of the busiest moment long after it, not what the gateway holds.
Measured under ``make bench-memory``'s load (1,000 open streams of 8,000 tokens, 2026-12-05;
``benches/RESULTS.md``): the heap held 90.5 MiB, of which 54.6 MiB free; ``malloc_trim(0)``
took 4.5 ms and the resident memory went from 160.0 to 111.6 MiB.

:func:`trim_heap` calls ``malloc_trim(0)`` (glibc ≥ 2.8; since 2.8 it also releases whole free
pages inside the heap, not only at its top). The server calls it every :data:`TRIM_SECONDS` on
a worker thread (``kvgate.server.gateway_runtime``). Other C libraries (musl) have no
``malloc_trim``: then nothing is trimmed and :data:`AVAILABLE` is ``False``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Final

__all__ = ["AVAILABLE", "TRIM_SECONDS", "trim_heap"]

#: How often the server trims the heap (seconds). One trim walks the heap's free chunks
#: (4.5 ms for a heap of 90 MiB with 55 MiB free, less when little is free, while other
#: threads wait on the heap's lock); pages given back and used again cost a page fault each.
TRIM_SECONDS: Final = 1.0


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``int malloc_trim(size_t pad)`` from the process's own symbols, or ``None``."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_TRIM: Final = _malloc_trim()

#: Whether this process's C library can trim its heap (glibc).
AVAILABLE: Final = _TRIM is not None


def trim_heap() -> bool:
    """Gives the C heap's free pages back to the operating system (``malloc_trim(0)``; it
    releases the interpreter's lock while it runs, so call it from a worker thread to keep
    the event loop going).

    Returns:
        Whether any memory was released (glibc's answer); ``False`` without glibc.
    """
    if _TRIM is None:
        return False
    return bool(_TRIM(0))
