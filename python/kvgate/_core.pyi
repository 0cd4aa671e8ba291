"""Stubs and user docs for the native module ``kvgate._core`` (rust/src/python.rs)."""

__version__: str
