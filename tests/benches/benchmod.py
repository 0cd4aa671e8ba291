"""Loads a benchmark script (``benches/...``, not a package) as a module, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load(name: str, relpath: str) -> ModuleType:
    """The script ``ROOT/relpath`` imported as module ``name`` (registered in ``sys.modules``,
    where dataclasses look their module up). Raises ImportError when it cannot be loaded."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {relpath}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
