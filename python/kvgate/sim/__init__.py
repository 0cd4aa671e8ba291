"""``kvgate sim``: an OpenAI-compatible fake engine with a paged KV cache and vLLM metrics.

There is no GPU in tests, benchmarks or the demo, yet kvgate has to be tried against an engine
whose memory fills up and breaks the way a real one does. The simulator models vLLM: a paged KV
cache (``kv_blocks`` × ``block_size`` tokens), a continuous-batching step loop with vLLM V1's
chunked prefill (a per-step token budget; ``--no-chunked-prefill`` for whole prefills),
optional prefix caching, preemption (or a CUDA-OOM crash) when blocks run out, abort on client
disconnect, and ``/metrics`` in vLLM's names.

* :mod:`kvgate.sim.engine` — the sans-IO scheduler (drive it with a virtual clock).
* :mod:`kvgate.sim.server` — the aiohttp app: :func:`create_app`, :func:`run_sim`.
* :mod:`kvgate.sim.profiles` — named GPU/model presets with the KV bytes-per-token arithmetic.
* :mod:`kvgate.sim.cli` — ``kvgate sim`` flags.
"""

from __future__ import annotations

from kvgate.sim.config import SimConfig
from kvgate.sim.engine import Engine
from kvgate.sim.profiles import PROFILES, Profile, get_profile
from kvgate.sim.server import RunningSim, create_app, run_sim

__all__ = [
    "PROFILES",
    "Engine",
    "Profile",
    "RunningSim",
    "SimConfig",
    "create_app",
    "get_profile",
    "run_sim",
]
