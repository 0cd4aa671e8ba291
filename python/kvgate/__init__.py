"""kvgate: an admission gateway for OpenAI-compatible LLM engines.

Importing this package does nothing but bind names: the admission core (``SlotPool``,
``TokenBucket``, ``AdmissionController``, ...) and the request analyser come from the native
module ``kvgate._core`` (Rust, built by maturin). The gateway, the engine simulator and the CLI
live in submodules and are imported only when used.
"""

from __future__ import annotations

from kvgate import _core
from kvgate._core import (
    AdaptiveLaw,
    AdmissionController,
    CoreError,
    InvalidAmountError,
    InvalidConfigError,
    ManualClock,
    NeverAdmissibleError,
    OverReleaseError,
    Rejection,
    Reservation,
    SharedStateError,
    SlotPool,
    TokenBucket,
)

__version__: str = _core.__version__

__all__ = [
    "AdaptiveLaw",
    "AdmissionController",
    "CoreError",
    "InvalidAmountError",
    "InvalidConfigError",
    "ManualClock",
    "NeverAdmissibleError",
    "OverReleaseError",
    "Rejection",
    "Reservation",
    "SharedStateError",
    "SlotPool",
    "TokenBucket",
    "__version__",
]
