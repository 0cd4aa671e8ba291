"""kvgate: an admission gateway for OpenAI-compatible LLM engines.

Importing this package does nothing but bind names: the admission core (``SlotPool``,
``TokenBucket``, ``AdmissionController``, ...) and the request analyser come from the native
module ``kvgate._core`` (Rust, built by maturin). The gateway, the engine simulator and the CLI
live in submodules and are imported only when used.
"""

from __future__ import annotations

from kvgate import _core

# --- request analysis (rust/src/python/analyze.rs) ---
from kvgate._core import (
    AdaptiveLaw,
    AdmissionController,
    Analysis,
    AnalysisError,
    CoreError,
    InvalidAmountError,
    InvalidConfigError,
    ManualClock,
    ModelRegistry,
    NeverAdmissibleError,
    OverReleaseError,
    Rejection,
    ReplicaSet,
    RequestAnalyzer,
    Reservation,
    SharedStateError,
    SlotPool,
    TokenBucket,
    check_content_length,
    peek_model,
)

__version__: str = _core.__version__

__all__ = [
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
    "Rejection",
    "ReplicaSet",
    "RequestAnalyzer",
    "Reservation",
    "SharedStateError",
    "SlotPool",
    "TokenBucket",
    "__version__",
    "check_content_length",
    "peek_model",
]
