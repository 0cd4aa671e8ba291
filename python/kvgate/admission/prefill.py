"""The prefill budget: how many prompt tokens a backend may be prefilling at once.

Why: an engine computes a request's prompt (prefill) before its first token, and a batch of
long prompts admitted together is prefilled together while every running request waits for its
next token — a burst of 32k-token prompts stalls the chat that is already streaming. kvgate
knows which admitted requests have not produced a byte yet, so it can feed long prompts to the
engine at the rate the engine prefills them instead of all at once.

Rule (per backend, per gateway process):

- A request enters prefill at admission with its prompt tokens and leaves it when the engine's
  first bytes of the answer arrive (or when it ends without any).
- A critical request has a lane of its own: it enters while the critical prompts in prefill plus
  its own fit in the budget. Other classes share the other lane under the same budget. So a
  burst of long standard prompts never delays critical requests, and critical requests never
  starve the rest.
- A lane with nothing in prefill always admits one request, however long its prompt (a prompt
  larger than the budget goes alone).
- A request that does not fit is refused with reason ``prefill-tokens`` (HTTP 503, a retry hint);
  when the tenant may wait it waits in the priority queue and is woken when a prompt leaves
  prefill.

Budget: the backend's ``prefill_token_budget`` (tokens) or, when unset, twice the engine's
per-step prefill chunk where the engine states one, else :data:`CAPACITY_FRACTION` of its KV
capacity in tokens (at least :data:`MIN_BUDGET`); no budget when neither is known. With ``--workers N`` each worker applies the
whole budget to its own requests.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = [
    "CAPACITY_FRACTION",
    "MIN_BUDGET",
    "PrefillGate",
    "PrefillTicket",
    "default_budget",
    "gate_for",
]

#: the budget, as a fraction of the engine's KV capacity (tokens), when nothing better is known
CAPACITY_FRACTION = 0.03
#: the smallest derived budget (tokens): a small engine's prefill is never the bottleneck
MIN_BUDGET = 4096


def default_budget(kv_capacity_tokens: int | None, chunk_tokens: int | None = None) -> int | None:
    """The prefill budget (tokens) of an engine: twice its per-step prefill chunk
    (``chunk_tokens``: SGLang's ``chunked_prefill_size``, the counterpart of vLLM's
    ``max_num_batched_tokens``, which vLLM does not publish) when known, else
    :data:`CAPACITY_FRACTION` of its KV capacity, at least :data:`MIN_BUDGET`; ``None`` when
    neither is known."""
    if chunk_tokens:
        return max(MIN_BUDGET, 2 * int(chunk_tokens))
    if kv_capacity_tokens:
        return max(MIN_BUDGET, int(kv_capacity_tokens * CAPACITY_FRACTION))
    return None


def gate_for(
    configured: int | None,
    kv_capacity_tokens: int | None,
    on_leave: Callable[[], None] | None = None,
    chunk_tokens: int | None = None,
) -> PrefillGate | None:
    """The gate of a backend: its configured ``prefill_token_budget`` (``0``: none), else
    :func:`default_budget` of the engine's prefill chunk or its KV capacity (tokens); ``None``
    when there is no budget."""
    if configured == 0:
        return None
    budget = (
        configured if configured is not None else default_budget(kv_capacity_tokens, chunk_tokens)
    )
    return None if budget is None else PrefillGate(budget, on_leave)


class PrefillTicket:
    """A request's prompt tokens in prefill; :meth:`leave` (idempotent) takes them out."""

    __slots__ = ("_gate", "critical", "tokens")

    def __init__(self, gate: PrefillGate, tokens: int, critical: bool) -> None:
        self._gate: PrefillGate | None = gate
        self.tokens = tokens
        self.critical = critical

    def leave(self) -> None:
        """The request's first bytes arrived, or it ended: its tokens leave prefill."""
        gate = self._gate
        if gate is None:
            return
        self._gate = None
        gate._leave(self)


class PrefillGate:
    """One backend's prefill budget (see the module docstring).

    Args:
        budget: prompt tokens in prefill at once per lane (tokens, ≥ 1).
        on_leave: called when a prompt leaves prefill (the wait queue's ``notify``).

    Attributes:
        in_prefill: prompt tokens of non-critical requests in prefill now.
        critical_in_prefill: prompt tokens of critical requests in prefill now.
        refused: requests refused so far.
    """

    __slots__ = ("budget", "critical_in_prefill", "in_prefill", "on_leave", "refused")

    def __init__(self, budget: int, on_leave: Callable[[], None] | None = None) -> None:
        if budget < 1:
            raise ValueError(f"prefill budget must be at least 1 token, got {budget}")
        self.budget = budget
        self.in_prefill = 0
        self.critical_in_prefill = 0
        self.on_leave = on_leave
        self.refused = 0

    def enter(self, prompt_tokens: int, priority: str) -> PrefillTicket | None:
        """A ticket for ``prompt_tokens`` (tokens) of a request of class ``priority``, or
        ``None`` when its lane is full."""
        if priority == "critical":
            held = self.critical_in_prefill
            if held and held + prompt_tokens > self.budget:
                self.refused += 1
                return None
            self.critical_in_prefill = held + prompt_tokens
            return PrefillTicket(self, prompt_tokens, True)
        held = self.in_prefill
        if held and held + prompt_tokens > self.budget:
            self.refused += 1
            return None
        self.in_prefill = held + prompt_tokens
        return PrefillTicket(self, prompt_tokens, False)

    def _leave(self, ticket: PrefillTicket) -> None:
        if ticket.critical:
            self.critical_in_prefill = max(0, self.critical_in_prefill - ticket.tokens)
        else:
            self.in_prefill = max(0, self.in_prefill - ticket.tokens)
        if self.on_leave is not None:
            self.on_leave()

    def state(self) -> dict[str, int]:
        """``/admin/state``'s view: budget, tokens in prefill per lane, refusals."""
        return {
            "budget": self.budget,
            "in_prefill": self.in_prefill,
            "critical_in_prefill": self.critical_in_prefill,
            "refused": self.refused,
        }
