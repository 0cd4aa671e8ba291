"""Named GPU/model presets for ``kvgate sim --profile NAME``.

A profile fixes what a real deployment would: the served model name, its context window, the KV
cache capacity (``kv_blocks`` blocks of ``block_size`` tokens), the batch cap (``max_num_seqs``)
and the step-time model. The KV capacity is *derived* from the hardware and model shape with the
same arithmetic vLLM uses when it sizes its cache, so the numbers in ``--help`` and in this
docstring are the numbers the simulator runs with:

    KV bytes per token = layers × kv_heads × head_dim × 2 (K and V) × bytes per element

    KV pool (bytes)    = gpus × gpu_memory × gpu_memory_utilization
                         − weights (params × bytes per element)
                         − gpus × per-GPU overhead (activations, CUDA graphs, NCCL buffers)

    kv_blocks          = floor(KV pool / (KV bytes per token × block_size))

Worked examples (the presets below):

* ``h800x8-llama3-70b`` — one 8×H800 (80 GB) node, tensor parallel 8, Llama-3.1-70B in bf16:
  80 layers × 8 KV heads × 128 head_dim × 2 × 2 B = 327,680 B = 320 KiB per token (40 KiB on each
  GPU). Pool = 8 × 79.6 GiB × 0.90 − 141.1 GB of weights − 8 × 2.5 GiB ≈ 421.7 GiB → 1,381,860
  tokens → 86,366 blocks of 16. Eleven full 128k-token contexts (1.44 M tokens) overflow it.
* ``l4-llama3-8b`` — a single NVIDIA L4 (24 GB), Llama-3.1-8B in bf16: 32 × 8 × 128 × 2 × 2 B =
  131,072 B = 128 KiB per token. Pool = 22.5 GiB × 0.90 − 16.1 GB − 1.25 GiB ≈ 4.04 GiB → 33,119
  tokens → 2,069 blocks of 16; five full 8k-token contexts overflow it.
* ``tiny`` — no real hardware: 128 blocks × 16 = 2,048 tokens and a 1,024-token window, so a
  handful of requests overflows the cache in a demo or a test.

Step times (prefill seconds per prompt token, decode step = base + per-sequence × batch size) are
rough orders of magnitude for the hardware, not measurements; ``--speed`` scales them all.

Token budget per step (``max_num_batched_tokens``, chunked prefill): vLLM's defaults for an
OpenAI-compatible server (``EngineArgs.get_batch_defaults`` in ``vllm/engine/arg_utils.py``) are
8,192 tokens on a GPU with at least 70 GiB of memory that is not an A100 (H100, H800, H200,
MI300x) and 2,048 tokens otherwise. So ``h800x8-llama3-70b`` gets 8,192, ``l4-llama3-8b`` 2,048,
and ``tiny`` vLLM's generic default of 2,048 (more than its window: one prompt is never split,
only several prompts admitted in one step share the budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB: int = 1 << 30


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The attention shape that sets KV-cache bytes per token.

    Attributes:
        params_b: parameter count in billions (weights = params × ``bytes_per_element`` bytes).
        layers: transformer layers.
        kv_heads: key/value heads (grouped-query attention: fewer than query heads).
        head_dim: dimension of one head.
        bytes_per_element: 2 for bf16/fp16, 1 for an fp8 KV cache.
    """

    params_b: float
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_element: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token: layers × kv_heads × head_dim × 2 (K, V) × bytes per element."""
        return self.layers * self.kv_heads * self.head_dim * 2 * self.bytes_per_element

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights: params × bytes per element."""
        return self.params_b * 1e9 * self.bytes_per_element


@dataclass(frozen=True, slots=True)
class Profile:
    """A named preset: model, KV capacity and step-time model.

    Attributes:
        name: the ``--profile`` value.
        model: served model name (``/v1/models`` id and the ``model_name`` metric label).
        context_window: max prompt + completion tokens (``max_model_len``).
        kv_blocks: KV-cache blocks (``num_gpu_blocks``).
        block_size: tokens per block.
        max_num_seqs: most sequences in one batch.
        prefill_s_per_token: prefill cost, seconds per prompt token.
        decode_base_s: fixed cost of one decode step, seconds.
        decode_per_seq_s: added decode-step cost per running sequence, seconds.
        kv_bytes_per_token: bytes of KV per token (0 for the hardware-free ``tiny``).
        summary: one line for ``--help``, with the arithmetic.
        max_num_batched_tokens: tokens one step may schedule with chunked prefill (vLLM's
            default for this kind of GPU; see the module docstring).
    """

    name: str
    model: str
    context_window: int
    kv_blocks: int
    block_size: int
    max_num_seqs: int
    prefill_s_per_token: float
    decode_base_s: float
    decode_per_seq_s: float
    kv_bytes_per_token: int
    summary: str
    max_num_batched_tokens: int = 2048


def _hardware_profile(
    *,
    name: str,
    model: str,
    shape: ModelShape,
    gpus: int,
    gpu_memory_gib: float,
    overhead_gib_per_gpu: float,
    context_window: int,
    max_num_seqs: int,
    prefill_s_per_token: float,
    decode_base_s: float,
    decode_per_seq_s: float,
    gpu_label: str,
    max_num_batched_tokens: int,
    gpu_memory_utilization: float = 0.90,
    block_size: int = 16,
) -> Profile:
    """Build a :class:`Profile` whose ``kv_blocks`` follows the module docstring's arithmetic."""
    pool = (
        gpus * gpu_memory_gib * GIB * gpu_memory_utilization
        - shape.weight_bytes
        - gpus * overhead_gib_per_gpu * GIB
    )
    per_token = shape.kv_bytes_per_token
    blocks = math.floor(pool / (per_token * block_size))
    summary = (
        f"{gpu_label}, {model}: {shape.layers} layers × {shape.kv_heads} kv_heads × "
        f"{shape.head_dim} head_dim × 2 × {shape.bytes_per_element} B = {per_token:,} B/token; "
        f"pool {pool / GIB:.1f} GiB → {blocks:,} blocks × {block_size} = "
        f"{blocks * block_size:,} tokens; context {context_window:,}; "
        f"{max_num_batched_tokens:,} tokens per step"
    )
    return Profile(
        name=name,
        model=model,
        context_window=context_window,
        kv_blocks=blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        prefill_s_per_token=prefill_s_per_token,
        decode_base_s=decode_base_s,
        decode_per_seq_s=decode_per_seq_s,
        kv_bytes_per_token=per_token,
        summary=summary,
        max_num_batched_tokens=max_num_batched_tokens,
    )


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        _hardware_profile(
            name="h800x8-llama3-70b",
            model="meta-llama/Llama-3.1-70B-Instruct",
            shape=ModelShape(params_b=70.55, layers=80, kv_heads=8, head_dim=128),
            gpus=8,
            gpu_memory_gib=79.6,
            overhead_gib_per_gpu=2.5,
            context_window=131_072,
            max_num_seqs=256,
            prefill_s_per_token=25e-6,
            decode_base_s=0.030,
            decode_per_seq_s=0.00015,
            gpu_label="8×H800 80GB (TP=8)",
            max_num_batched_tokens=8192,  # vLLM's default on a ≥ 70 GiB GPU (not an A100)
        ),
        _hardware_profile(
            name="l4-llama3-8b",
            model="meta-llama/Llama-3.1-8B-Instruct",
            shape=ModelShape(params_b=8.03, layers=32, kv_heads=8, head_dim=128),
            gpus=1,
            gpu_memory_gib=22.5,
            overhead_gib_per_gpu=1.25,
            context_window=8_192,
            max_num_seqs=64,
            prefill_s_per_token=250e-6,
            decode_base_s=0.055,
            decode_per_seq_s=0.0003,
            gpu_label="1×L4 24GB",
            max_num_batched_tokens=2048,  # vLLM's default on a smaller GPU
        ),
        Profile(
            name="tiny",
            model="kvgate-sim-tiny",
            context_window=1_024,
            kv_blocks=128,
            block_size=16,
            max_num_seqs=16,
            prefill_s_per_token=200e-6,
            decode_base_s=0.020,
            decode_per_seq_s=0.001,
            kv_bytes_per_token=0,
            summary="toy engine, no real hardware: 128 blocks × 16 = 2,048 tokens; context 1,024; "
            "2,048 tokens per step",
            max_num_batched_tokens=2048,  # vLLM's generic default
        ),
    )
}
"""All presets by name. ``tiny`` is the default when neither ``--profile`` nor sizes are given."""

DEFAULT_PROFILE: str = "tiny"


def get_profile(name: str) -> Profile:
    """Return the preset called ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown profile {name!r}; known profiles: {known}") from None
