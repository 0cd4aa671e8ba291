"""Settings of the engine simulator (one frozen dataclass, validated once)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from kvgate.sim.profiles import DEFAULT_PROFILE, get_profile

OnOverflow = Literal["preempt", "oom"]
MetricNames = Literal["v1", "v0", "both"]

DEFAULT_MAX_NUM_BATCHED_TOKENS: int = 2048
"""vLLM's generic per-step token budget (``SchedulerConfig``), used with chunked prefill when
neither a profile nor ``max_num_batched_tokens`` gives one."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything ``kvgate sim`` can be told. Build it with :meth:`from_profile`.

    Attributes:
        model: served model name (``/v1/models`` id, ``model_name`` metric label).
        context_window: ``max_model_len`` in tokens (prompt + completion).
        kv_blocks: KV-cache blocks (``num_gpu_blocks``).
        block_size: tokens per KV block.
        max_num_seqs: most sequences running in one batch.
        prefill_s_per_token: simulated prefill cost, seconds per prompt token.
        decode_base_s: simulated fixed decode-step cost, seconds.
        decode_per_seq_s: simulated decode-step cost per running sequence, seconds.
        kv_bytes_per_token: KV bytes per token (only used in the OOM message; 0 = unknown).
        on_overflow: ``"preempt"`` (vLLM: evict the newest running sequence back to the waiting
            queue) or ``"oom"`` (crash: every request fails with 500, then restart).
        restart_seconds: simulated seconds the engine stays unhealthy after an OOM.
        speed: every simulated duration is divided by this (> 0); 10 = ten times faster.
        seed: seeds generated text and output lengths.
        mean_output_tokens: mean of the drawn output length (exponential, ≥ 1), capped by
            ``max_tokens`` and the context window.
        tokenizer: path to a HuggingFace ``tokenizer.json``; ``None`` = the estimate
            ceil(UTF-8 bytes / 4).
        metric_names: ``"v1"`` (``vllm:kv_cache_usage_perc``, ``engine`` label), ``"v0"``
            (``vllm:gpu_cache_usage_perc``, ``model_name`` only), or ``"both"`` (vLLM
            0.9.2–0.10.x, where both KV names exist).
        no_usage: never send a usage chunk in streams (engines that send none).
        embedding_dim: length of the vectors ``/v1/embeddings`` returns.
        chat_template: the model's Jinja chat template (text); chat prompts are then the
            rendered template, counted without adding special tokens (as vLLM does), and
            ``GET /props`` states it. ``None``: a fixed, model-neutral template.
        chunked_prefill: vLLM V1's chunked prefill (its default): each step schedules at most
            ``max_num_batched_tokens`` tokens, running sequences first, and a prompt that does
            not fit is prefilled over several steps. False: a prompt is prefilled whole in the
            step that admits it (vLLM ``--no-enable-chunked-prefill``).
        max_num_batched_tokens: the per-step token budget (vLLM's ``max_num_batched_tokens``).
            ``None``: with chunked prefill, :data:`DEFAULT_MAX_NUM_BATCHED_TOKENS`
            (:meth:`from_profile` puts the profile's default here); without, no budget (every
            admissible prompt is prefilled in one step, the simulator's behaviour before
            chunked prefill). Given without chunked prefill, whole prompts are admitted while
            they fit the budget, which must then hold a whole context window (vLLM refuses to
            start otherwise).
        prefix_caching: vLLM's automatic prefix caching: full prompt blocks are kept under a
            hash of the prompt up to them, shared by every sequence whose prompt starts the
            same way (whose prefill then skips them), and stay cached once unreferenced until
            evicted (see :mod:`kvgate.sim.engine`). Off by default here (vLLM V1 turns it on;
            the simulator keeps it opt-in so every request costs its full prefill).
        profile: the preset the sizes came from (informational).

    Raises (from :meth:`validate`):
        ValueError: a size ≤ 0, speed ≤ 0, unknown mode, a context window larger than the
            KV cache (vLLM refuses to start in that case too), a token budget smaller than
            ``max_num_seqs`` (with chunked prefill) or than the context window (without), as
            vLLM's ``SchedulerConfig`` refuses them.
    """

    model: str
    context_window: int
    kv_blocks: int
    block_size: int
    max_num_seqs: int
    prefill_s_per_token: float
    decode_base_s: float
    decode_per_seq_s: float
    kv_bytes_per_token: int = 0
    on_overflow: OnOverflow = "preempt"
    restart_seconds: float = 10.0
    speed: float = 1.0
    seed: int = 0
    mean_output_tokens: float = 128.0
    tokenizer: str | None = None
    metric_names: MetricNames = "v1"
    no_usage: bool = False
    embedding_dim: int = 16
    chat_template: str | None = None
    chunked_prefill: bool = True
    max_num_batched_tokens: int | None = None
    prefix_caching: bool = False
    profile: str | None = None

    @classmethod
    def from_profile(cls, name: str | None = None, **overrides: Any) -> SimConfig:
        """Preset ``name`` (default ``tiny``) with ``overrides`` (``None`` values are ignored).

        Raises:
            ValueError: unknown profile, unknown override field, or an invalid result.
        """
        p = get_profile(name or DEFAULT_PROFILE)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - fields
        if unknown:
            raise ValueError(f"unknown SimConfig fields: {sorted(unknown)}")
        base: dict[str, Any] = {
            "model": p.model,
            "context_window": p.context_window,
            "kv_blocks": p.kv_blocks,
            "block_size": p.block_size,
            "max_num_seqs": p.max_num_seqs,
            "prefill_s_per_token": p.prefill_s_per_token,
            "decode_base_s": p.decode_base_s,
            "decode_per_seq_s": p.decode_per_seq_s,
            "kv_bytes_per_token": p.kv_bytes_per_token,
            "profile": p.name,
        }
        base.update({k: v for k, v in overrides.items() if v is not None})
        if base.get("chunked_prefill", True) and base.get("max_num_batched_tokens") is None:
            base["max_num_batched_tokens"] = p.max_num_batched_tokens
        cfg = cls(**base)
        cfg.validate()
        return cfg

    @property
    def token_budget(self) -> int | None:
        """Tokens one step may schedule (prefill chunks + one per decoding sequence), or
        ``None`` for no budget (whole prefills, ``max_num_batched_tokens`` not given)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_MAX_NUM_BATCHED_TOKENS if self.chunked_prefill else None

    @property
    def kv_capacity_tokens(self) -> int:
        """KV-cache capacity in tokens: ``kv_blocks × block_size``."""
        return self.kv_blocks * self.block_size

    def validate(self) -> None:
        """Check the settings; see the class docstring for what raises ``ValueError``."""
        for name in ("context_window", "kv_blocks", "block_size", "max_num_seqs", "embedding_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        for name in ("prefill_s_per_token", "decode_base_s", "decode_per_seq_s", "restart_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be ≥ 0, got {getattr(self, name)}")
        if not self.speed > 0:
            raise ValueError(f"speed must be > 0, got {self.speed}")
        if not self.mean_output_tokens >= 1:
            raise ValueError(f"mean_output_tokens must be ≥ 1, got {self.mean_output_tokens}")
        if self.on_overflow not in ("preempt", "oom"):
            raise ValueError(f"on_overflow must be 'preempt' or 'oom', got {self.on_overflow!r}")
        if self.metric_names not in ("v1", "v0", "both"):
            raise ValueError(f"metric_names must be v1, v0 or both, got {self.metric_names!r}")
        budget = self.max_num_batched_tokens
        if budget is not None and budget < 1:
            raise ValueError(f"max_num_batched_tokens must be ≥ 1, got {budget}")
        if self.chunked_prefill and (self.token_budget or 0) < self.max_num_seqs:
            # vLLM's SchedulerConfig: every running sequence must be able to decode in one step
            raise ValueError(
                f"max_num_batched_tokens ({self.token_budget}) must be ≥ max_num_seqs "
                f"({self.max_num_seqs})"
            )
        if not self.chunked_prefill and budget is not None and budget < self.context_window:
            # vLLM's SchedulerConfig: without chunked prefill a whole prompt must fit one step
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than the context window "
                f"({self.context_window}): without chunked prefill a longer prompt could never "
                "be scheduled; raise it or enable chunked prefill"
            )
        if self.context_window > self.kv_capacity_tokens:
            # vLLM: "The model's max seq len is larger than the maximum number of tokens that
            # can be stored in KV cache" — it refuses to start, and so do we (else one request
            # could never fit and preemption would livelock).
            raise ValueError(
                f"context_window {self.context_window} is larger than the KV cache "
                f"({self.kv_blocks} blocks × {self.block_size} = {self.kv_capacity_tokens} tokens)"
            )
