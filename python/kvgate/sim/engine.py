"""The simulated engine: a paged KV cache and a continuous-batching scheduler, with no I/O.

Nothing here sleeps, reads a clock or touches the network: :meth:`Engine.step` takes ``now``
(seconds on any monotonic clock), changes the state the way one engine iteration would, and
returns how long that iteration takes (wall seconds, already divided by ``speed``) and the events
it produced. The server (:mod:`kvgate.sim.server`) sleeps that long and then delivers the events;
tests drive it with a virtual clock.

Memory model (vLLM's paged attention): the cache has ``kv_blocks`` blocks of ``block_size``
tokens. A running sequence holds ``ceil(computed / block_size)`` blocks, ``computed`` being the
tokens whose KV it has computed (vLLM's ``num_computed_tokens``): its prompt so far while it is
prefilled, then prompt + generated − 1 (the newest token's KV is computed by the next step).
Blocks go back to the pool the moment it finishes, is aborted, is preempted or fails.
``kv_cache_usage = 1 − free_blocks / kv_blocks`` (vLLM ``BlockPool.get_usage``).

One step follows vLLM V1's ``Scheduler.schedule`` (``vllm/v1/core/sched/scheduler.py``), which
has no separate prefill and decode phases: every sequence has ``num_tokens`` (prompt + generated)
and ``computed``, and a step gives each scheduled sequence ``num_tokens − computed`` tokens (one
for a decoding sequence, the rest of its prompt for one being prefilled), within a per-step
token budget (``max_num_batched_tokens``):

1. Running sequences, in the order they entered the batch, while budget is left: each gets
   ``min(num_tokens − computed, budget left)`` tokens, so a partly prefilled prompt takes its
   next chunk. Blocks are allocated for the tokens scheduled (vLLM ``allocate_slots``: enough
   for ``computed + scheduled`` tokens). With no free block, ``on_overflow="preempt"`` evicts
   the *newest* running sequence (its blocks are freed, ``computed`` goes back to 0, it goes to
   the front of the waiting queue and later recomputes its prompt plus the tokens it already
   sent, which are not sent again) and counts a preemption; ``"oom"`` crashes: every running and
   waiting sequence fails, and the engine is unhealthy for ``restart_seconds / speed``, then
   comes back empty.
2. Waiting sequences, only if nothing was preempted in this step, first come first served
   (head-of-line blocking, vLLM's FCFS policy) while budget, ``max_num_seqs`` and free blocks
   allow: each gets ``min(num_tokens, budget left)`` tokens (its first chunk). Without chunked
   prefill a prompt that does not fit the budget left waits for the next step, and with no
   budget set every admissible prompt is prefilled whole (the simulator's behaviour before
   chunked prefill).
3. After the step (vLLM ``update_from_output``), each scheduled sequence's ``computed`` grows by
   its tokens; one that has computed all its tokens produces one token (the first one of a
   prompt whose last chunk ran: its time to first token ends here). Finished sequences free
   their blocks, for the next step.
4. Duration = ``prefill_s_per_token × prefill tokens scheduled + decode_base_s +
   decode_per_seq_s × tokens produced``, divided by ``speed``: a long prompt costs the same
   prefill time in total, but spread over ``ceil(prompt / budget)`` steps, and decoding
   sequences get a token at each of them instead of waiting for the whole prefill.

Prefix caching (``prefix_caching``, vLLM's ``--enable-prefix-caching``; ``BlockPool`` and
``KVCacheManager`` in ``vllm/v1/core/``): every full block of a prompt has a hash chained over
the prompt's tokens up to its end (:func:`prefix_block_hashes`). A block whose tokens are
scheduled is entered in the cache under its hash; a sequence admitted with ``computed = 0``
first looks up the longest run of its leading block hashes in the cache (at most
``num_tokens − 1`` tokens, since the last token must be computed to sample the next), takes
those blocks (reference-counted, shared with whoever else holds them) and starts its prefill
after them, so only the rest is prefilled and costs time. Each lookup of a request that was
never preempted adds its ``num_tokens`` to ``prefix_cache_queries`` and the tokens found to
``prefix_cache_hits`` (vLLM ``PrefixCacheStats``; the simulator counts a lookup once, when the
request is admitted). A block nobody references any more goes back to the free queue still
cached: it counts as free in ``kv_cache_usage`` (as in vLLM) and is evicted, least recently
freed first, when a new block is needed. Only prompt blocks are cached (the simulator's
generated words have no token ids a later prompt could share).

Per-user oracle: every sequence carries the ``user`` of its request (the OpenAI body field), and
the engine keeps, per user, what it really ran (:class:`UserStats`): sequences in the running set
now and at their peak, requests accepted and in flight, prompt and completion tokens. Peaks are
updated at each admission into the running set (and at each request's start for the in-flight
peak), never sampled, so a test can judge an admission gateway in front of the engine by what
the engine saw. :meth:`Engine.reset_peaks` starts a new measuring window.
"""

from __future__ import annotations

import enum
import hashlib
import math
import random
import sys
from collections import OrderedDict, deque
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field

from kvgate.sim.config import SimConfig

# Words the simulator "generates"; one word = one token.
_WORDS: tuple[str, ...] = (
    "the", "cache", "block", "token", "engine", "request", "batch", "memory", "prefill", "decode",
    "slot", "queue", "window", "context", "model", "stream", "budget", "page", "tensor", "kernel",
    "quiet", "river", "stone", "light", "paper", "garden", "signal", "orbit", "harbor", "lantern",
    "and", "of", "to", "in", "is", "that", "with", "for", "on", "as",
)  # fmt: skip


def prefix_block_hashes(
    prompt: bytes | Sequence_[int], block_size: int, *, bytes_per_token: int = 4
) -> list[bytes]:
    """Hashes of a prompt's full KV blocks, each chained over every token up to its block's end
    (vLLM ``hash_block_tokens``: parent hash + the block's tokens), so two prompts share block
    ``i``'s hash exactly when their first ``(i + 1) × block_size`` tokens are equal.

    Args:
        prompt: token ids, or prompt bytes read as one token per ``bytes_per_token`` bytes (the
            simulator's estimate when it has no tokenizer).
        block_size: tokens per block.
        bytes_per_token: bytes per token when ``prompt`` is bytes.

    Returns:
        One 16-byte hash per full block (a partial last block has none).
    """
    width = bytes_per_token if isinstance(prompt, bytes) else 1
    span = block_size * width
    parent = b""
    out: list[bytes] = []
    for end in range(span, len(prompt) + 1, span):
        chunk = prompt[end - span : end]
        data = chunk if isinstance(chunk, bytes) else ",".join(map(str, chunk)).encode()
        parent = hashlib.blake2b(parent + data, digest_size=16).digest()
        out.append(parent)
    return out


class SeqState(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(eq=False, slots=True)
class Sequence:
    """One generated sequence (a request has ``n`` of them per prompt).

    Attributes:
        seq_id: unique id, the key of :meth:`Engine.abort`.
        prompt_tokens: prompt length, tokens.
        max_tokens: most tokens it may generate (already capped by the context window).
        target_tokens: the output length drawn for it (1 ≤ target ≤ max_tokens); reaching
            ``max_tokens`` finishes with ``"length"``, fewer with ``"stop"``.
        rng: source of its generated words.
        generated: tokens generated so far (and sent to the client).
        computed: tokens whose KV is computed (vLLM ``num_computed_tokens``); 0 while waiting.
        prefill_end: ``computed`` at which its current prefill ends (prompt + tokens generated
            before a preemption); below it the sequence is being prefilled.
        block_ids: the KV blocks it holds (``ceil(computed / block_size)`` while running),
            first to last; with prefix caching its leading ones may be shared.
        block_hashes: hashes of its prompt's full blocks (:func:`prefix_block_hashes`), empty
            without prefix caching.
        blocks_cached: how many of its leading blocks were entered in the prefix cache.
        state: see :class:`SeqState`.
        finish_reason: ``"stop"`` / ``"length"`` once finished, ``"abort"`` once aborted.
        preemptions: how often it was preempted.
        user: the request's ``user`` field (``""`` without one), the key of its
            :class:`UserStats`.
        counts_prompt: True for the first choice of each prompt, whose first prefill adds the
            prompt to the user's ``prompt_tokens`` (the other choices share that prompt).
        prompt_counted: its prompt was counted (at the end of its first prefill).
    """

    seq_id: int
    prompt_tokens: int
    max_tokens: int
    target_tokens: int
    rng: random.Random
    generated: int = 0
    computed: int = 0
    prefill_end: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    blocks_cached: int = 0
    state: SeqState = SeqState.WAITING
    finish_reason: str | None = None
    preemptions: int = 0
    prompt_counted: bool = False
    user: str = ""
    counts_prompt: bool = True

    @property
    def blocks(self) -> int:
        """KV blocks held now."""
        return len(self.block_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known: prompt + generated (vLLM ``Request.num_tokens``)."""
        return self.prompt_tokens + self.generated

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV it holds: ``computed`` (0 while waiting)."""
        return self.computed

    @property
    def prefilling(self) -> bool:
        """True while running with part of its (re)computed prompt still to prefill."""
        return self.state is SeqState.RUNNING and self.computed < self.prefill_end


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """A sequence produced one token; ``finish_reason`` is set on its last one."""

    seq_id: int
    text: str
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class FailEvent:
    """A sequence failed (the engine crashed with CUDA OOM); ``message`` is the error text."""

    seq_id: int
    message: str


Event = TokenEvent | FailEvent


@dataclass(slots=True)
class UserStats:
    """What the engine ran for one user (the request body's ``user`` field; ``""`` without one).

    Attributes:
        running: its sequences in the running set now (a request with ``n`` choices has ``n``;
            a waiting or preempted sequence is not running).
        peak_running: the most it had in the running set at once, updated at each admission
            (exact, not sampled) since start or the last :meth:`Engine.reset_peaks`.
        requests: generation requests accepted into the engine's queue (refused ones are not).
        in_flight: those requests not ended yet (waiting, running or preempted).
        peak_in_flight: the most in flight at once, updated at each request's start.
        prompt_tokens: prompt tokens prefilled, each prompt once when its first prefill ends
            (the ``n`` choices of one prompt share it, as the answer's ``usage`` counts it; a
            request aborted before its prefill ends adds none).
        completion_tokens: tokens generated, including those of sequences aborted afterwards.
    """

    running: int = 0
    peak_running: int = 0
    requests: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(slots=True)
class StepResult:
    """What one :meth:`Engine.step` did.

    Attributes:
        duration_s: wall seconds the step takes (simulated time / speed).
        events: tokens and failures, to deliver once ``duration_s`` has passed.
        progressed: False when nothing could run (idle, or down after an OOM).
        prefill_tokens: prompt tokens prefilled in this step (chunks included).
        batch_size: sequences that got a token in this step.
        scheduled_tokens: every token scheduled in this step (prefill + decode), never more
            than the token budget.
    """

    duration_s: float = 0.0
    events: list[Event] = field(default_factory=list)
    progressed: bool = False
    prefill_tokens: int = 0
    batch_size: int = 0
    scheduled_tokens: int = 0


class Engine:
    """Paged KV cache + continuous-batching scheduler (sans-IO; see the module docstring).

    Counters (read by the ``/metrics`` collector; all monotonic):
        peak_used_blocks (high-water mark of blocks in use: a burst that fills the cache shows
        here even when the preemption that follows frees blocks before the next scrape),
        preemptions, ooms, failed, aborted, wasted_tokens (tokens generated for sequences that
        were then aborted), prompt_tokens_total (each sequence's prompt once, on its first
        prefill ends), generation_tokens_total, finished (by finish reason: stop, length, abort).

    Peaks (reset by :meth:`reset_peaks`): peak_running (most sequences in the running set at
    once), peak_in_flight (most requests in flight at once) and, per user, :class:`UserStats`
    in ``users``.
    """

    def __init__(self, config: SimConfig) -> None:
        """Build an empty engine for ``config`` (already validated by ``SimConfig``)."""
        self.config = config
        # the free queue, least recently freed first (vLLM ``FreeKVCacheBlockQueue``); with
        # prefix caching it also holds cached blocks nobody references (evictable)
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(config.kv_blocks))
        self._ref: list[int] = [0] * config.kv_blocks
        self._hash_of: dict[int, bytes] = {}
        self._cached: dict[bytes, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.peak_used_blocks: int = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.down_until: float | None = None
        self.preemptions = 0
        self.ooms = 0
        self.failed = 0
        self.aborted = 0
        self.wasted_tokens = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.users: dict[str, UserStats] = {}
        self.peak_running = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self._next_id = 0
        self._by_id: dict[int, Sequence] = {}

    # ----------------------------------------------------------------- requests in and out

    def new_sequence(
        self,
        prompt_tokens: int,
        max_tokens: int | None,
        *,
        fingerprint: bytes,
        index: int = 0,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        user: str = "",
        block_hashes: Sequence_[bytes] = (),
    ) -> Sequence:
        """Create (not queue) a sequence with its output length drawn from the seed.

        Args:
            prompt_tokens: prompt length, tokens (≥ 1, ≤ context window − 1).
            max_tokens: cap on generated tokens; ``None`` = the rest of the context window.
            fingerprint: bytes identifying the request (e.g. its prompt); with ``seed`` and
                ``index`` it seeds the text and the length, so equal requests get equal output.
            index: choice index within the request.
            ignore_eos: generate exactly the cap (vLLM's ``ignore_eos``).
            min_tokens: lower bound on the drawn length (vLLM's ``min_tokens``).
            user: the request's ``user`` field, the key of its :class:`UserStats`.
            block_hashes: the prompt's full-block hashes (:func:`prefix_block_hashes`), for
                prefix caching; ignored without it.

        Raises:
            ValueError: prompt + max_tokens over the context window, or a bad size.
        """
        ctx = self.config.context_window
        if prompt_tokens < 1 or prompt_tokens >= ctx:
            raise ValueError(f"prompt_tokens must be in 1..{ctx - 1}, got {prompt_tokens}")
        room = ctx - prompt_tokens
        cap = room if max_tokens is None else max_tokens
        if cap < 1 or cap > room:
            raise ValueError(f"max_tokens must be in 1..{room}, got {max_tokens}")
        digest = hashlib.blake2b(fingerprint, digest_size=16).hexdigest()
        rng = random.Random(f"{self.config.seed}:{digest}:{index}")
        if ignore_eos:
            target = cap
        else:
            drawn = 1 + int(rng.expovariate(1.0 / self.config.mean_output_tokens))
            target = min(cap, max(drawn, min_tokens, 1))
        seq = Sequence(
            seq_id=self._next_id,
            prompt_tokens=prompt_tokens,
            max_tokens=cap,
            target_tokens=target,
            rng=rng,
            user=user,
            counts_prompt=index == 0,
        )
        if self.config.prefix_caching:
            seq.block_hashes = list(block_hashes[: prompt_tokens // self.config.block_size])
        self._next_id += 1
        return seq

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` at the back of the waiting queue.

        Raises:
            RuntimeError: the engine is down after an OOM (check :meth:`is_healthy` first).
        """
        if self.down_until is not None:
            raise RuntimeError("engine is down (restarting after CUDA out of memory)")
        seq.state = SeqState.WAITING
        self.waiting.append(seq)
        self._by_id[seq.seq_id] = seq

    def abort(self, seq_id: int) -> bool:
        """Abort a waiting or running sequence and free its blocks at once.

        Returns True if it was still live (then it counts as aborted; its generated tokens
        count as wasted), False if it had already ended or is unknown.
        """
        seq = self._by_id.pop(seq_id, None)
        if seq is None:
            return False
        if seq.state is SeqState.RUNNING:
            self._leave_running(seq)
            self._free(seq)
        elif seq.state is SeqState.WAITING:
            self.waiting.remove(seq)
        seq.state = SeqState.ABORTED
        seq.finish_reason = "abort"
        self.aborted += 1
        self.wasted_tokens += seq.generated
        self.finished["abort"] += 1
        return True

    def begin_request(self, user: str) -> None:
        """Count a request of ``user`` accepted into the queue (its sequences already added):
        ``requests`` and ``in_flight`` go up, and the in-flight peaks with them."""
        stats = self.user_stats(user)
        stats.requests += 1
        stats.in_flight += 1
        stats.peak_in_flight = max(stats.peak_in_flight, stats.in_flight)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def end_request(self, user: str) -> None:
        """A request of ``user`` counted by :meth:`begin_request` ended (answered, failed or
        aborted): ``in_flight`` goes down."""
        self.user_stats(user).in_flight -= 1
        self.in_flight -= 1

    def user_stats(self, user: str) -> UserStats:
        """The :class:`UserStats` of ``user`` (created empty on first use)."""
        stats = self.users.get(user)
        if stats is None:
            stats = self.users[user] = UserStats()
        return stats

    def reset_peaks(self) -> None:
        """Start a new measuring window: every peak (running, in flight; overall and per user)
        becomes its current value."""
        self.peak_running = len(self.running)
        self.peak_in_flight = self.in_flight
        for stats in self.users.values():
            stats.peak_running = stats.running
            stats.peak_in_flight = stats.in_flight

    # ------------------------------------------------------------------------ state

    def is_healthy(self, now: float) -> bool:
        """False while restarting after an OOM; the restart completes once ``now`` passes it."""
        if self.down_until is not None and now >= self.down_until:
            self.down_until = None
        return self.down_until is None

    @property
    def has_work(self) -> bool:
        """True when a sequence is waiting or running (and the engine is not down)."""
        return self.down_until is None and bool(self.waiting or self.running)

    @property
    def free_blocks(self) -> int:
        """Blocks in the free queue: never used, or cached and referenced by nobody."""
        return len(self._free_queue)

    @property
    def cached_blocks(self) -> int:
        """Blocks in the prefix cache (referenced or not; 0 without prefix caching)."""
        return len(self._cached)

    @property
    def used_blocks(self) -> int:
        """Blocks held by running sequences (a shared block once)."""
        return self.config.kv_blocks - self.free_blocks

    @property
    def kv_cache_usage(self) -> float:
        """Ratio 0..1: ``1 − free_blocks / kv_blocks`` (vLLM ``BlockPool.get_usage``)."""
        return self.used_blocks / self.config.kv_blocks

    def snapshot(self) -> dict[str, object]:
        """A JSON-able view of the state (the server's ``GET /sim/state``)."""
        return {
            "healthy": self.down_until is None,
            "kv_blocks": self.config.kv_blocks,
            "block_size": self.config.block_size,
            "used_blocks": self.used_blocks,
            "free_blocks": self.free_blocks,
            "kv_cache_usage": self.kv_cache_usage,
            "peak_used_blocks": self.peak_used_blocks,
            "prefix_caching": self.config.prefix_caching,
            "cached_blocks": self.cached_blocks,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_prefilling": sum(1 for s in self.running if s.prefilling),
            "chunked_prefill": self.config.chunked_prefill,
            "max_num_batched_tokens": self.config.token_budget,
            "preemptions": self.preemptions,
            "ooms": self.ooms,
            "failed": self.failed,
            "aborted": self.aborted,
            "wasted_tokens": self.wasted_tokens,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "finished": dict(self.finished),
            "peak_running": self.peak_running,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "by_user": {
                user: {
                    "running": u.running,
                    "peak_running": u.peak_running,
                    "requests": u.requests,
                    "in_flight": u.in_flight,
                    "peak_in_flight": u.peak_in_flight,
                    "prompt_tokens": u.prompt_tokens,
                    "completion_tokens": u.completion_tokens,
                }
                for user, u in self.users.items()
            },
            "running": [
                {
                    "seq_id": s.seq_id,
                    "prompt_tokens": s.prompt_tokens,
                    "generated": s.generated,
                    "computed": s.computed,
                    "prefilling": s.prefilling,
                    "blocks": s.blocks,
                }
                for s in self.running
            ],
        }

    # ------------------------------------------------------------------------- step

    def step(self, now: float) -> StepResult:
        """Run one engine iteration at time ``now`` (seconds); see the module docstring."""
        result = StepResult()
        if not self.is_healthy(now):
            return result
        cfg = self.config
        chunked = cfg.chunked_prefill
        limit = cfg.token_budget
        budget = sys.maxsize if limit is None else limit
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        # 1. running sequences, in batch order, while budget is left
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            tokens = min(seq.num_tokens - seq.computed, budget)
            need = self._blocks_for(seq.computed + tokens) - seq.blocks
            while need > self.free_blocks:
                if cfg.on_overflow == "oom":
                    return self._crash(now)
                victim = self.running[-1]  # the newest; never one scheduled before seq
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            # _preempt() above may have moved seq itself back to WAITING (mypy cannot see that)
            if seq.state is not SeqState.RUNNING:
                break  # type: ignore[unreachable]
            self._take(seq, need)
            self._cache_blocks(seq, seq.computed + tokens)
            scheduled.append((seq, tokens))
            budget -= tokens
            i += 1
        # 2. waiting sequences, first come first served, unless this step preempted
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs
        ):
            seq = self.waiting[0]
            hit = self._lookup(seq)
            start = len(hit) * cfg.block_size
            tokens = seq.num_tokens - start
            if tokens > budget:
                if not chunked:
                    break  # a whole prompt waits for a step with room for it
                tokens = budget
            need = self._blocks_for(start + tokens) - len(hit)
            evictable = sum(1 for b in hit if self._ref[b] == 0)
            if need + evictable > self.free_blocks:
                break
            if cfg.prefix_caching and not seq.preemptions:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += start
            self.waiting.popleft()
            seq.state = SeqState.RUNNING
            seq.prefill_end = seq.num_tokens
            self.running.append(seq)
            self.peak_running = max(self.peak_running, len(self.running))
            stats = self.user_stats(seq.user)
            stats.running += 1
            stats.peak_running = max(stats.peak_running, stats.running)
            for b in hit:  # the cached blocks: shared, no longer evictable
                if self._ref[b] == 0:
                    del self._free_queue[b]
                self._ref[b] += 1
                seq.block_ids.append(b)
            seq.computed = start
            self._take(seq, need)
            self._cache_blocks(seq, start + tokens)
            scheduled.append((seq, tokens))
            budget -= tokens
        # 3. the step ran: computed tokens advance, complete sequences produce a token
        for seq, tokens in scheduled:
            result.scheduled_tokens += tokens
            if seq.computed < seq.prefill_end:
                result.prefill_tokens += tokens
            seq.computed += tokens
            if seq.computed < seq.num_tokens:
                continue  # a prefill chunk: no token yet
            if not seq.prompt_counted:
                seq.prompt_counted = True
                self.prompt_tokens_total += seq.prompt_tokens
                if seq.counts_prompt:
                    self.user_stats(seq.user).prompt_tokens += seq.prompt_tokens
            self._emit(seq, result)
        if scheduled:
            simulated = (
                cfg.prefill_s_per_token * result.prefill_tokens
                + cfg.decode_base_s
                + cfg.decode_per_seq_s * result.batch_size
            )
            result.duration_s = simulated / cfg.speed
            result.progressed = True
        return result

    # ------------------------------------------------------------------------ internals

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.block_size)

    def _take(self, seq: Sequence, blocks: int) -> None:
        """Give ``seq`` ``blocks`` new blocks from the head of the free queue (evicting a cached
        block from the prefix cache when it is one)."""
        for _ in range(blocks):
            b, _ = self._free_queue.popitem(last=False)
            h = self._hash_of.pop(b, None)
            if h is not None:
                del self._cached[h]
            self._ref[b] = 1
            seq.block_ids.append(b)
        self.peak_used_blocks = max(self.peak_used_blocks, self.used_blocks)

    def _lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting ``seq`` starts with: the longest run of its leading block
        hashes in the cache, short of its last token (vLLM ``get_computed_blocks``)."""
        if not self.config.prefix_caching or seq.computed:
            return []
        most = (seq.num_tokens - 1) // self.config.block_size
        hit: list[int] = []
        for h in seq.block_hashes[:most]:
            b = self._cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def _cache_blocks(self, seq: Sequence, tokens: int) -> None:
        """Enter in the prefix cache every full prompt block of ``seq`` within its first
        ``tokens`` tokens (those scheduled so far; vLLM caches them when it schedules them)."""
        full = min(tokens // self.config.block_size, len(seq.block_hashes))
        for i in range(seq.blocks_cached, full):
            h, b = seq.block_hashes[i], seq.block_ids[i]
            if h not in self._cached and b not in self._hash_of:
                self._cached[h] = b
                self._hash_of[b] = h
        seq.blocks_cached = max(seq.blocks_cached, full)

    def _leave_running(self, seq: Sequence) -> None:
        """Take ``seq`` out of the running set (its user's ``running`` with it)."""
        self.running.remove(seq)
        self.user_stats(seq.user).running -= 1

    def _free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, last first (so a prompt's tail is evicted before its head,
        as vLLM frees them); a block nobody references joins the free queue, cached or not."""
        for b in reversed(seq.block_ids):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free_queue[b] = None
        seq.block_ids.clear()
        seq.blocks_cached = 0
        seq.computed = 0

    def _emit(self, seq: Sequence, result: StepResult) -> None:
        """Generate one token for a running sequence that has computed all its tokens."""
        word = seq.rng.choice(_WORDS)
        text = word if seq.generated == 0 else " " + word
        seq.generated += 1
        self.generation_tokens_total += 1
        self.user_stats(seq.user).completion_tokens += 1
        result.batch_size += 1
        finish: str | None = None
        if seq.generated >= seq.max_tokens:
            finish = "length"
        elif seq.generated >= seq.target_tokens:
            finish = "stop"
        if finish is not None:
            self._leave_running(seq)
            self._free(seq)
            seq.state = SeqState.FINISHED
            seq.finish_reason = finish
            self.finished[finish] += 1
            self._by_id.pop(seq.seq_id, None)
        result.events.append(TokenEvent(seq.seq_id, text, finish))

    def _preempt(self, seq: Sequence) -> None:
        self._leave_running(seq)
        self._free(seq)
        seq.computed = 0
        seq.state = SeqState.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _crash(self, now: float) -> StepResult:
        """CUDA OOM: every live sequence fails, all blocks are freed, the engine goes down."""
        cfg = self.config
        block_bytes = cfg.kv_bytes_per_token * cfg.block_size
        size = f"{block_bytes / (1 << 20):.2f} MiB (one KV-cache block)" if block_bytes else None
        message = (
            f"CUDA out of memory. Tried to allocate {size or 'one more KV-cache block'}; all "
            f"{cfg.kv_blocks} blocks ({cfg.kv_capacity_tokens} tokens) are in use. "
            f"The engine crashed and is restarting (kvgate sim --on-overflow oom)."
        )
        result = StepResult(progressed=True)
        self.peak_used_blocks = cfg.kv_blocks  # it asked for more than all of them
        for seq in self.running:
            self.user_stats(seq.user).running -= 1
        for seq in [*self.running, *self.waiting]:
            seq.state = SeqState.FAILED
            seq.block_ids.clear()
            seq.computed = 0
            self.failed += 1
            self._by_id.pop(seq.seq_id, None)
            result.events.append(FailEvent(seq.seq_id, message))
        self.running.clear()
        self.waiting.clear()
        # the restarted engine's cache is empty
        self._free_queue = OrderedDict.fromkeys(range(cfg.kv_blocks))
        self._ref = [0] * cfg.kv_blocks
        self._hash_of.clear()
        self._cached.clear()
        self.ooms += 1
        self.down_until = now + cfg.restart_seconds / cfg.speed
        return result
