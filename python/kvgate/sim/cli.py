"""``kvgate sim``: run the engine simulator from the command line."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from kvgate.sim.config import SimConfig
from kvgate.sim.profiles import DEFAULT_PROFILE, PROFILES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the simulator's flags to ``parser`` (sizes default to the chosen profile's)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "profiles (KV bytes/token = layers × kv_heads × head_dim × 2 (K,V) × bytes/element;\n"
        "blocks = (gpus × memory × 0.90 − weights − overhead) / (bytes/token × block_size)):\n"
        + "\n".join(f"  {p.name}: {p.summary}" for p in PROFILES.values())
    )
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    a("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    a(
        "--profile",
        choices=sorted(PROFILES),
        default=None,
        help=f"GPU/model preset (default: {DEFAULT_PROFILE}); see the list below",
    )
    a("--model", help="served model name (default: the profile's)")
    a("--context-window", type=int, help="max prompt + completion tokens (max_model_len)")
    a("--kv-blocks", type=int, help="KV-cache blocks (num_gpu_blocks)")
    a("--block-size", type=int, help="tokens per KV block")
    a("--max-num-seqs", type=int, help="most sequences in one batch")
    a(
        "--max-num-batched-tokens",
        type=int,
        help="tokens one step may schedule (vLLM's max_num_batched_tokens); default: the "
        "profile's (vLLM's default for that GPU); without chunked prefill: no budget",
    )
    a(
        "--no-chunked-prefill",
        action="store_true",
        help="prefill a prompt whole in the step that admits it, stalling every running "
        "sequence meanwhile (default: chunked prefill, as vLLM V1: running sequences first, "
        "then prompt chunks fill the rest of the step's token budget)",
    )
    a(
        "--on-overflow",
        choices=["preempt", "oom"],
        default="preempt",
        help="when blocks run out in decode: preempt the newest sequence (vLLM) or crash with "
        "CUDA OOM, failing every request with 500 (default: %(default)s)",
    )
    a(
        "--restart-seconds",
        type=float,
        default=10.0,
        help="seconds unhealthy after an OOM crash, then back empty (default: %(default)s)",
    )
    a(
        "--speed",
        type=float,
        default=1.0,
        help="divide every simulated duration by this; 10 = 10× faster (default: %(default)s)",
    )
    a("--seed", type=int, default=0, help="seed of generated text and output lengths")
    a(
        "--mean-output-tokens",
        type=float,
        default=128.0,
        help="mean drawn output length, capped by max_tokens (default: %(default)s)",
    )
    a("--tokenizer", help="tokenizer.json to count prompt tokens (default: UTF-8 bytes / 4)")
    a(
        "--chat-template",
        metavar="FILE",
        help="the model's Jinja chat template (a file): chat prompts are the rendered template, "
        "stated by GET /props (default: a fixed, model-neutral template)",
    )
    a(
        "--metric-names",
        choices=["v1", "v0", "both"],
        default="v1",
        help="vLLM metric names: v1 (vllm:kv_cache_usage_perc), v0 (vllm:gpu_cache_usage_perc), "
        "or both as in vLLM 0.9.2-0.10 (default: %(default)s)",
    )
    a(
        "--prefix-caching",
        action="store_true",
        help="vLLM's automatic prefix caching: full prompt blocks are shared by prompts that "
        "start alike, whose prefill skips them; vllm:prefix_cache_queries / _hits count tokens "
        "(default: off)",
    )
    a("--no-usage", action="store_true", help="never send a usage chunk in streams")
    a("--prefill-s-per-token", type=float, help="prefill seconds per prompt token")
    a("--decode-base-s", type=float, help="fixed seconds per decode step")
    a("--decode-per-seq-s", type=float, help="added decode-step seconds per running sequence")


def _read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read --chat-template {path}: {exc}") from None


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Build the :class:`SimConfig` the parsed ``args`` describe.

    Raises:
        ValueError: invalid combination (e.g. a context window larger than the KV cache).
    """
    return SimConfig.from_profile(
        args.profile,
        model=args.model,
        context_window=args.context_window,
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        chunked_prefill=not args.no_chunked_prefill,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_caching=args.prefix_caching,
        on_overflow=args.on_overflow,
        restart_seconds=args.restart_seconds,
        speed=args.speed,
        seed=args.seed,
        mean_output_tokens=args.mean_output_tokens,
        tokenizer=args.tokenizer,
        chat_template=_read_template(args.chat_template),
        metric_names=args.metric_names,
        no_usage=args.no_usage,
        prefill_s_per_token=args.prefill_s_per_token,
        decode_base_s=args.decode_base_s,
        decode_per_seq_s=args.decode_per_seq_s,
    )


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (port 0: an ephemeral one).

    Raises:
        OSError: the address does not resolve, or it cannot be bound (e.g. already in use).
    """
    family, *_ = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    # socket.create_server sets SO_REUSEADDR on POSIX, as aiohttp's own listener does
    return socket.create_server((host, port), family=family)


def _prefill_words(config: SimConfig) -> str:
    """How prompts are prefilled, for the banner."""
    budget = config.token_budget
    if config.chunked_prefill:
        return f"chunked prefill, {budget} tokens per step"
    if budget is None:
        return "whole prefill"
    return f"whole prefill, {budget} tokens per step"


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; returns 0, or 2 for invalid settings or an address that cannot
    be listened on (one line on stderr). The banner is printed once the port is bound."""
    import uvloop
    from aiohttp import web

    from kvgate.sim.server import create_app

    try:
        config = config_from_args(args)
        app = create_app(config)
    except ValueError as exc:
        print(f"kvgate sim: error: {exc}", file=sys.stderr)
        return 2
    where = f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"
    try:
        sock = _listen(args.host, args.port)
    except OSError as exc:
        # create_server appends "(while attempting to bind ...)" to strerror; keep the reason
        errno = exc.errno or 0
        reason = os.strerror(errno) if errno > 0 else exc.strerror or str(exc)
        print(f"kvgate sim: error: cannot listen on {where}: {reason}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    where = f"[{args.host}]:{port}" if ":" in args.host else f"{args.host}:{port}"
    print(
        f"kvgate sim: {config.model} ({config.profile}) on http://{where} — "
        f"{config.kv_blocks} blocks × {config.block_size} = {config.kv_capacity_tokens} KV tokens, "
        f"context {config.context_window}, max_num_seqs {config.max_num_seqs}, "
        f"{_prefill_words(config)}{', prefix caching' if config.prefix_caching else ''}, "
        f"on_overflow={config.on_overflow}, speed ×{config.speed:g}",
        flush=True,
    )
    web.run_app(
        app,
        sock=sock,
        loop=uvloop.new_event_loop(),
        handler_cancellation=True,
        access_log=None,
        print=None,
    )
    return 0
