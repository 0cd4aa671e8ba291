"""Stubs and user docs for the native module ``kvgate._core`` (rust/src/python.rs)."""

__version__: str

# --- request analysis (rust/src/python_analyze.rs) ---

from collections.abc import Sequence
from typing import Any, Final, Literal, final

class AnalysisError(ValueError):
    """A request refused by the analyser, carrying OpenAI's error shape.

    OpenAI ``Error`` schema (openai-openapi ``openapi.yaml``): ``{"error": {"message", "type",
    "param", "code"}}``; all four keys are present, ``param`` / ``code`` may be ``None``.
    ``str(err)`` is ``message``. (Standalone ``ValueError`` subclass for now; the admission
    core's ``CoreError`` base, if any, is to be reconciled at merge time.)

    Attributes:
        status: HTTP status, ``400`` (invalid JSON / field, context overflow), ``404`` (unknown
            model: code ``model_not_found``; unknown route: code ``unknown_url``), ``413`` (body
            over the byte cap: code ``request_too_large``) or ``500`` (internal failure,
            ``type`` ``server_error``, code ``internal_error``; never the client's fault).
        type: ``"invalid_request_error"`` (or ``"server_error"`` for 500).
        param: the offending field, e.g. ``"messages"``, ``"max_tokens"``, ``"prompt"``,
            ``"input"``, ``"model"``, ``"messages[2].content[0].type"``; ``None`` for
            whole-body errors (invalid JSON, 413).
        code: ``"context_length_exceeded"``, ``"invalid_json"``, ``"invalid_type"``,
            ``"invalid_value"``, ``"missing_required_parameter"``, ``"empty_array"``,
            ``"integer_below_min_value"``, ``"integer_above_max_value"``,
            ``"chat_template_error"`` (the template's ``raise_exception`` or a render failure),
            ``"model_not_found"``, ``"unknown_url"``, ``"request_too_large"``,
            ``"internal_error"``.
        message: human-readable text. Context overflow keeps OpenAI's phrase: "This model's
            maximum context length is N tokens. However, you requested M tokens (P in the
            messages, C in the completion). ..." or, for the prompt alone, "... However, your
            messages resulted in P tokens. ...".
    """

    status: Final[int]
    type: Final[str]
    param: Final[str | None]
    code: Final[str | None]
    message: Final[str]
    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        /,
    ) -> None:
        """Arguments are positional only (``BaseException.__init__`` takes no keywords)."""
    def body(self) -> dict[str, dict[str, Any]]:
        """The error body ``{"error": {"message", "type", "param", "code"}}`` as a dict."""
    def to_json(self) -> bytes:
        """The same body as compact JSON bytes, ready to send with ``status``."""

@final
class Analysis:
    """What one request costs, as computed by ``RequestAnalyzer.analyze`` (immutable).

    Attributes:
        model: the body's ``model``.
        route: ``"/v1/chat/completions"``, ``"/v1/completions"`` or ``"/v1/embeddings"``.
        prompt_tokens: prompt tokens (tokens), summed over the prompts of a batched
            completions / embeddings request.
        completion_tokens: completion tokens reserved (tokens): per-choice limit × ``n`` ×
            number of prompts. The per-choice limit is ``max_completion_tokens``, else
            ``max_tokens``; when both are absent, ``default_max_tokens`` (capped at the room
            left) if configured, else ``context_window - prompt_tokens`` (what vLLM / SGLang /
            TGI allow, ENGINES.md §5.5). Always 0 for embeddings.
        n: choices per prompt: ``n``, or ``max(n, best_of)`` on ``/v1/completions``; 1 for
            embeddings.
        stream: the body's ``stream`` (``False`` when absent or null).
        include_usage: the body's ``stream_options.include_usage``.
        reserved_tokens: ``prompt_tokens + completion_tokens`` (tokens): the TPM / in-flight
            reservation to make before forwarding, reconciled with the real usage afterwards.
        inject_max_tokens: set only when ``default_max_tokens`` was applied: the per-choice limit
            (tokens) the gateway must write into the forwarded body as ``max_tokens`` so the
            engine honours the same bound as the reservation.
        counting: how ``prompt_tokens`` was obtained: ``"chat_template"`` (chat, the rendered
            template counted with the tokenizer, no extra special tokens), ``"overhead"`` (chat
            without a template: content, ``name``, ``tool_calls`` and ``tools`` JSON counted with
            the tokenizer, plus ``per_message_overhead`` per message), ``"tokenizer"``
            (completions / embeddings, counted with the tokenizer's special tokens), or
            ``"estimate"`` (no tokenizer configured: ``ceil(utf8_bytes / 4)`` per text).
    """

    model: Final[str]
    route: Final[str]
    prompt_tokens: Final[int]
    completion_tokens: Final[int]
    n: Final[int]
    stream: Final[bool]
    include_usage: Final[bool]
    reserved_tokens: Final[int]
    inject_max_tokens: Final[int | None]
    counting: Final[Literal["chat_template", "overhead", "tokenizer", "estimate"]]

@final
class RequestAnalyzer:
    """One model's request analyser: body cap, OpenAI fields, prompt count, context check.

    Thread-safe and immutable; ``analyze`` releases the GIL for bodies of 1 KiB or more, so the
    gateway can call it from a thread pool (``loop.run_in_executor``) without blocking its event
    loop.

    Args:
        model: the model name clients send in ``model``; ``analyze`` refuses any other name
            with 404 ``model_not_found`` (use ``ModelRegistry`` to serve several).
        context_window: context window in tokens (prompt + completion), e.g. vLLM's
            ``max_model_len``; at least 1.
        tokenizer_path: path of the model's HuggingFace ``tokenizer.json``.
        tokenizer_json: the same file's text (give one of the two, or neither). Truncation and
            padding settings in the file are switched off (they would falsify counts). With
            no tokenizer, counts are the cheap deterministic estimate ``ceil(utf8_bytes / 4)``
            per text (``counting == "estimate"``), never exact.
        chat_template: a Jinja chat template; overrides the one in ``tokenizer_config_path``.
        tokenizer_config_path: path of the model's ``tokenizer_config.json``: ``chat_template``
            (a string, or a list of ``{"name", "template"}`` with ``default`` and ``tool_use``,
            the latter used when the request has ``tools``), ``bos_token``, ``eos_token``.
            Templates render like transformers' ``apply_chat_template`` (trim_blocks,
            lstrip_blocks, loop controls; context ``messages``, ``tools``,
            ``add_generation_prompt=True``, ``bos_token``, ``eos_token``, ``raise_exception``,
            ``strftime_now``; ``tojson`` as ``json.dumps(ensure_ascii=False)``; Python ``str`` /
            ``dict`` methods such as ``strip``, ``startswith``, ``split``, ``items``, ``get``).
            Content-part arrays reach the template as their text parts joined with ``"\\n"``
            (vLLM's "string" content format), and tool-call ``arguments`` strings as parsed
            objects (as vLLM does).
        per_message_overhead: chat without a template: tokens added per message for the role
            and delimiters (tokens, default 4).
        image_tokens: tokens charged per image content part (``image_url`` / ``input_image``);
            default 765, OpenAI's price of one high-detail 512×512 tile (85 + 170 × 4).
        audio_tokens: tokens charged per audio content part (``input_audio``), default 200.
        default_max_tokens: completion tokens to reserve when a request sets neither
            ``max_tokens`` nor ``max_completion_tokens`` (then reported as
            ``Analysis.inject_max_tokens``); ``None`` reserves the rest of the window.
        max_body_bytes: cap on the raw body (bytes, default 32 MiB); larger bodies get 413
            without being parsed.

    Raises:
        ValueError: bad settings (``context_window`` 0, ``default_max_tokens`` 0, both
            tokenizer sources, an invalid ``tokenizer.json`` / config / template).
        OSError: a path that cannot be read.
    """

    def __init__(
        self,
        *,
        model: str,
        context_window: int,
        tokenizer_path: str | None = None,
        tokenizer_json: str | None = None,
        chat_template: str | None = None,
        tokenizer_config_path: str | None = None,
        per_message_overhead: int = 4,
        image_tokens: int = 765,
        audio_tokens: int = 200,
        default_max_tokens: int | None = None,
        max_body_bytes: int = 33554432,
    ) -> None: ...
    def analyze(self, route: str, body: bytes) -> Analysis:
        """Analyse one request body.

        Args:
            route: the request path: ``/v1/chat/completions``, ``/v1/completions`` or
                ``/v1/embeddings`` (the ``/v1`` prefix is optional, a query string is ignored).
            body: the raw body bytes.

        Returns:
            The ``Analysis``.

        Raises:
            AnalysisError: 413 body over ``max_body_bytes`` (checked before parsing); 400
                invalid JSON (including invalid UTF-8, lone surrogate escapes, nesting deeper
                than 128 levels), a non-object body, a missing / mistyped / out-of-range field
                (``max_tokens`` and ``max_completion_tokens`` must be JSON integers >= 1,
                ``n`` and ``best_of`` in 1..128 with ``best_of >= n``), empty ``messages`` /
                ``prompt`` / ``input``, unknown content-part type, token ids outside the
                vocabulary, more than 2048 embedding inputs, a chat template error, or the
                context check (``prompt_tokens >= context_window`` with no limit requested, or
                ``prompt + max_tokens > context_window``, per prompt); 404 ``model_not_found``
                when ``model`` differs from this analyser's, ``unknown_url`` for another route;
                500 on an internal failure (panics are caught, never crash the process).
        """
    @property
    def model(self) -> str: ...
    @property
    def context_window(self) -> int:
        """Context window (tokens)."""
    @property
    def max_body_bytes(self) -> int:
        """Body cap (bytes)."""
    @property
    def default_max_tokens(self) -> int | None:
        """Completion reservation when the request sets no limit (tokens), if configured."""
    @property
    def has_chat_template(self) -> bool: ...
    @property
    def has_tokenizer(self) -> bool:
        """True when counts are exact (a ``tokenizer.json`` was given)."""

@final
class ModelRegistry:
    """Analysers of several models, picked by the body's ``model``.

    Args:
        analyzers: one ``RequestAnalyzer`` per model name.

    Raises:
        ValueError: two analysers for the same model.
    """

    def __init__(self, analyzers: Sequence[RequestAnalyzer]) -> None: ...
    def analyze(self, route: str, body: bytes) -> Analysis:
        """Parse once, choose the analyser by ``model``, check its body cap, analyse.

        Raises:
            AnalysisError: as ``RequestAnalyzer.analyze``; 404 ``model_not_found`` (param
                ``"model"``) for a model no analyser serves; 413 above ``max_body_bytes`` of the
                registry before parsing, and above the chosen model's cap after.
        """
    def get(self, model: str) -> RequestAnalyzer | None: ...
    def models(self) -> list[str]:
        """Model names, sorted."""
    @property
    def max_body_bytes(self) -> int:
        """The largest body cap among the analysers (bytes): what to check ``Content-Length``
        against before the model is known."""
    def __len__(self) -> int: ...
    def __contains__(self, model: str) -> bool: ...

def check_content_length(content_length: int | None, max_body_bytes: int) -> None:
    """Pre-reject a body from its declared size, before reading any of it.

    Call with the ``Content-Length`` header value (``None`` when absent, e.g. chunked), and
    while reading a chunked body with the running byte count.

    Args:
        content_length: declared or counted body size (bytes), or ``None``.
        max_body_bytes: the cap (bytes).

    Raises:
        AnalysisError: 413, code ``request_too_large``, when ``content_length > max_body_bytes``.
        OverflowError: a negative size.
    """

def peek_model(body: bytes) -> str:
    """Read only ``model`` from a body (the rest is skipped without building values).

    Raises:
        AnalysisError: 400 ``invalid_json`` / ``invalid_type`` (non-object body or non-string
            model) / ``missing_required_parameter`` (no ``model``).
    """
