"""Build a :class:`~kvgate.app.Gateway` from a validated :class:`~kvgate.config.Config`.

* :func:`build_controller` registers every backend and tenant in the Rust admission core (a
  private region, or a named shared-memory region that worker processes attach to).
* :func:`build_gateway` adds the per-model request analysers, the routing table, the tenants'
  key table and, when asked, the engine metrics pollers that feed the adaptive control law.
* :func:`apply_config` is SIGHUP's hot reload: new base limits, tenants and keys apply at once;
  held slots and in-flight streams are untouched.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

# A backend without ``tokens_per_minute`` in the config has no TPM limit; the core's bucket is
# then sized so it never binds: UNLIMITED_TPM, 2**40 tokens per minute (about 18 billion per
# second), the rate at or above which the core sends no token headers.
from kvgate._core import UNLIMITED_TPM
from kvgate.admission.identity import TenantIndex, TenantTable
from kvgate.app import Backend, Gateway, ModelRoute, Tenant
from kvgate.config import ConfigError

if TYPE_CHECKING:
    from kvgate.config import Config

__all__ = [
    "UNLIMITED_TPM",
    "Reload",
    "apply_config",
    "build_controller",
    "build_gateway",
    "check_limits",
    "prepare_reload",
    "slot_limit",
]

logger = logging.getLogger("kvgate.gateway")


def slot_limit(b: Any, guaranteed: int, stated: int | None) -> int:
    """The slot limit (concurrent requests) of backend ``b`` (a
    :class:`~kvgate.config.BackendConfig`): its ``max_concurrency`` when configured; else the
    engine's own batch limit ``stated`` (slots: llama.cpp ``total_slots``, SGLang
    ``max_running_requests``, TGI ``max_concurrent_requests``; ``None`` when the engine states
    none, as vLLM, or could not be asked), else :data:`~kvgate.config.DEFAULT_SLOTS`; in both
    cases at least ``guaranteed``, the guaranteed slots of the tenants that use the backend."""
    from kvgate.config import DEFAULT_SLOTS

    if b.max_concurrency is not None:
        return int(b.max_concurrency)
    return max(stated or DEFAULT_SLOTS, guaranteed)


def _guaranteed_sums(config: Config) -> dict[str, int]:
    """Backend name → the guaranteed slots of the tenants that use it (summed)."""
    from kvgate.config import guarantees_by_backend

    return {name: sum(n for _, n in users) for name, users in guarantees_by_backend(config).items()}


def _backend_limits(b: Any, slots: int) -> dict[str, Any]:
    """The core's backend arguments; ``slots`` is the slot limit in force (:func:`slot_limit`)."""
    return {
        "max_concurrency": slots,
        "tokens_per_minute": b.tokens_per_minute or UNLIMITED_TPM,
        "burst_tokens": b.burst_tokens,
        "inflight_token_limit": b.inflight_token_limit,
    }


def _tenant_limits(t: Any, controller: Any) -> dict[str, Any]:
    """The core's tenant arguments. The guarantee applies to the backends the tenant may use
    (``backends``, names → core ids; ``None`` → ``"all"``). Backends must be registered first.
    """
    guaranteed_backends: list[int] | str = (
        "all" if t.backends is None else [controller.backend_id(name) for name in t.backends]
    )
    return {
        "priority": t.priority,
        "tokens_per_minute": t.tokens_per_minute,
        # explicit, so a reload that drops `burst_tokens` goes back to one minute's worth
        "burst_tokens": t.burst_tokens if t.burst_tokens is not None else t.tokens_per_minute,
        "max_concurrency": t.max_concurrency,
        "guaranteed_slots": t.guaranteed_slots,
        "guaranteed_backends": guaranteed_backends,
    }


def _entries_wanted(t: Any, backends: int) -> int:
    """The guarantee-table entries tenant ``t`` holds once set: one per backend its
    ``backends`` names (even at 0 guaranteed slots), or one per backend (``backends``: how
    many) for guaranteed slots on every backend."""
    if t.backends is not None:
        return len(set(t.backends))
    return backends if t.guaranteed_slots else 0


def _tenants_of(config: Config) -> list[Any]:
    """The configured tenants, or one implicit ``anonymous`` tenant when none are declared."""
    if config.tenants:
        return list(config.tenants)
    from kvgate.config import TenantConfig

    return [TenantConfig(name="anonymous")]


def _capacity_counts(config: Config) -> tuple[int, int, int]:
    """The counts the core's region is sized from (it adds the headroom): backends, tenants, and
    (tenant, backend) guarantee entries: one per backend a tenant's ``backends`` lists, or one
    per backend for a tenant with guaranteed slots on every backend."""
    tenants = _tenants_of(config)
    n_backends = len(config.backends)
    guarantees = sum(_entries_wanted(t, n_backends) for t in tenants)
    return n_backends, len(tenants), guarantees


def build_controller(
    config: Config,
    *,
    shm_name: str | None = None,
    create: bool = True,
    discovery: Mapping[str, Any] | None = None,
) -> Any:
    """The admission core for ``config``.

    The core's region is sized here, once, for twice the configured backends, tenants and
    guarantee entries (at least 64 backends, 1,024 tenants and 1,024 entries), and a shared one
    for twice the processes of ``workers``: reloads can add tenants up to that without a
    restart (see :func:`apply_config`).

    Args:
        config: the validated configuration.
        shm_name: a shared-memory region name (``--workers N``), or ``None`` for a private one.
        create: create (master) or attach to (worker) the named region.
        discovery: backend name → what its engine said about itself
            (:class:`~kvgate.telemetry.discovery.EngineInfo`): its ``slots`` is the slot limit
            of a backend without ``max_concurrency`` (:func:`slot_limit`).

    Raises:
        kvgate.SharedStateError: the region cannot be created or attached.
        kvgate.InvalidConfigError: a limit the core refuses.
    """
    from kvgate import AdmissionController

    if shm_name is not None and not create:
        return AdmissionController.attach(shm_name)
    from kvgate._core import MAX_PROCS

    backends, tenants, guarantees = _capacity_counts(config)
    controller = AdmissionController(
        shm_name=shm_name,
        create=True,
        backends=backends,
        tenants=tenants,
        guarantees=guarantees,
        # the master and its workers, twice over (a dead worker's entry is reclaimed before its
        # replacement attaches): each entry is a ledger of 8 bytes per tenant
        processes=min(MAX_PROCS, 2 * (config.workers + 1)),
    )
    guaranteed = _guaranteed_sums(config)
    found = discovery or {}
    for b in config.backends:
        stated = getattr(found.get(b.name), "slots", None)
        slots = slot_limit(b, guaranteed[b.name], stated)
        controller.add_backend(b.name, **_backend_limits(b, slots))
    for t in _tenants_of(config):
        controller.add_tenant(t.name, **_tenant_limits(t, controller))
    return controller


def _analyzer(model: Any) -> Any:
    """The model's request analyser. ``chat_template`` is the text of the file it names, or
    the inline template; without one, the ``chat_template`` of the ``tokenizer_config.json``
    beside ``tokenizer`` (HuggingFace's layout, which vLLM loads with the tokenizer) is used,
    and that file's ``bos_token`` / ``eos_token`` fill the template's variables either way.
    The analyser renders the template once on a sample conversation.

    Raises:
        ValueError: a tokenizer or template the analyser refuses (the message starts with the
            model's name and names the template file and line).
        OSError: a tokenizer or template file that cannot be read.
    """
    from kvgate import RequestAnalyzer
    from kvgate._core import MAX_AMOUNT

    kwargs: dict[str, Any] = {
        "model": model.name,
        "context_window": model.context_window,
        # the gateway caps bodies while reading them (``Gateway.max_body_bytes``, which a reload
        # changes); a cap of its own here would keep the start-up value
        "max_body_bytes": MAX_AMOUNT,
    }
    if model.tokenizer:
        kwargs["tokenizer_path"] = model.tokenizer
        beside = Path(model.tokenizer).with_name("tokenizer_config.json")
        if beside.is_file():
            kwargs["tokenizer_config_path"] = str(beside)
    if model.chat_template_file is not None:
        kwargs["chat_template_path"] = model.chat_template_file
    elif model.chat_template:
        kwargs["chat_template"] = model.chat_template
    if model.default_max_tokens:
        kwargs["default_max_tokens"] = model.default_max_tokens
    try:
        return RequestAnalyzer(**kwargs)
    except ValueError as exc:
        raise ValueError(f"model {model.name}: {exc}") from None


def build_gateway(
    config: Config,
    *,
    shm_name: str | None = None,
    config_path: str | None = None,
    poll: bool = True,
    controller: Any = None,
    discovery: dict[str, Any] | None = None,
) -> Gateway:
    """The gateway state for ``config``.

    Args:
        config: the validated configuration.
        shm_name: attach to this shared region (a worker of ``--workers N``); ``None`` builds a
            private admission core.
        config_path: the file SIGHUP reloads (``None``: reload disabled).
        poll: start engine metrics pollers (adaptive limits, health checks) with the app.
        controller: use this admission core instead of building one (tests, embedding).
        discovery: backend name → :class:`~kvgate.telemetry.discovery.EngineInfo` (the quick
            start's discovery, and ``kvgate serve --config``'s for backends without
            ``max_concurrency``): its KV capacity × ``capacity_safety_factor`` is the backend's
            in-flight token budget from the start when the configuration sets none (the poller
            keeps it current), its slots are the slot limit of a backend without
            ``max_concurrency`` (:func:`slot_limit`), a slot limit that is the engine's follows
            the engine's slot count on later polls, and ``/admin/state`` shows it.
    """
    if controller is None:
        controller = build_controller(
            config, shm_name=shm_name, create=shm_name is None, discovery=discovery
        )
    backends: list[Backend] = []
    models: dict[str, ModelRoute] = {}
    for b in config.backends:
        backend_id = controller.backend_id(b.name)
        backend = Backend(
            name=b.name,
            url=b.url.rstrip("/"),
            id=backend_id,
            models=[m.name for m in b.models],
            metrics_url=b.effective_metrics_url,
            engine=b.engine,
            config=b,
        )
        backends.append(backend)
        for m in b.models:
            route = models.get(m.name)
            if route is None:
                analyzer = _analyzer(m)
                models[m.name] = ModelRoute(
                    m.name, analyzer, [backend], count_text=analyzer.count_tokens
                )
            else:
                route.backends.append(backend)
    gateway = Gateway(
        controller=controller,
        models=models,
        backends=backends,
        tenants=[],
        max_body_bytes=config.max_body_bytes,
        timeouts=config.timeouts,
        config=config,
        started_config=config,
        config_path=config_path,
        poll=poll,
        discovery=dict(discovery or {}),
        apply_config=apply_config,
        prepare_config=prepare_reload,
    )
    _set_tenants(gateway, config)
    gateway.slo = _slo_controller(gateway, config.slo)
    if config.tracing is not None:  # OpenTelemetry is imported only then
        try:
            from kvgate.tracing import Tracing
        except ImportError as exc:
            raise ValueError(str(exc)) from None
        gateway.tracing = Tracing(config.tracing)
    if config.store is not None:
        gateway.store = _redis_store(gateway, config.store)
        gateway.metrics.store_gauges.store = gateway.store
    from kvgate.config import DEFAULT_SLOTS

    for b in config.backends:
        found = gateway.discovery.get(b.name)
        gateway.set_prefill_capacity(b.name, getattr(found, "kv_capacity_tokens", None))
        if b.max_concurrency is None:
            # polls keep it the engine's (64 until the engine states a batch limit)
            gateway.engine_slots[b.name] = getattr(found, "slots", None) or DEFAULT_SLOTS
        elif found is not None and found.slots == b.max_concurrency:
            gateway.engine_slots[b.name] = b.max_concurrency  # polls keep it the engine's
        cap = getattr(found, "kv_capacity_tokens", None)
        if cap and b.inflight_token_limit is None:
            budget = max(1, int(cap * b.capacity_safety_factor))
            gateway.discovered_capacity[b.name] = budget
            controller.update_backend(controller.backend_id(b.name), inflight_token_limit=budget)
    return gateway


def _slo_controller(gateway: Gateway, slo: Any) -> Any:
    """The latency-target controller of ``slo`` (``None`` without targets)."""
    if slo is None:
        return None
    from kvgate.admission.slo import ClassTargets, SloController

    targets = {
        cls: ClassTargets(t.ttft_p99_s, t.tpot_p99_s)
        for cls in ("critical", "standard", "sheddable")
        if (t := getattr(slo, cls)) is not None
    }
    if not targets:
        return None
    ctl = gateway.controller

    def ceiling(name: str) -> int:
        bid = ctl.backend_id(name)
        return int(ctl.backend_state(bid)["effective_concurrency"]) if bid is not None else 1

    return SloController(
        targets,
        ceiling,
        interval_s=slo.interval_s,
        window_s=slo.window_s,
        min_samples=slo.min_samples,
        on_raise=gateway.notify_waiters,
    )


def _redis_store(gateway: Gateway, store_config: Any) -> Any:
    """The Redis store of ``gateway``: the scale and shedding in force across the replicas go
    to the admission core as they change."""
    from kvgate.store.redis_store import RedisStore

    ctl = gateway.controller

    def on_effective(backend: str, scale: float, shedding: bool) -> None:
        bid = ctl.backend_id(backend)
        if bid is not None:
            ctl.set_scale(bid, scale)
            ctl.set_shedding(bid, shedding)

    return RedisStore(store_config, ctl, metrics=gateway.metrics, on_effective=on_effective)


def check_startup(config: Config) -> str | None:
    """What ``kvgate serve`` would refuse in a valid ``config`` at start-up, beyond the file's
    own rules: the admission core's limits, tokenizers and chat templates (built here and
    dropped), a listen host that does not resolve. ``None`` when it would start (binding the
    port is not tried). Starts nothing."""
    import socket

    from kvgate import CoreError

    try:
        build_gateway(config, poll=False)
    except (CoreError, ValueError, OSError) as exc:
        return str(exc)
    try:
        socket.getaddrinfo(config.listen.host, config.listen.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        return f"listen.host {config.listen.host!r} does not resolve: {exc}"
    return None


def _tenant(t: Any, tid: int) -> Tenant:
    """The request path's :class:`Tenant` for tenant configuration ``t``, core id ``tid``."""
    return Tenant(
        id=tid,
        name=t.name,
        priority=t.priority,
        key_hashes=tuple(t.api_key_sha256),
        max_wait_ms=t.max_wait_ms,
        shadow=(t.mode == "shadow"),
        backends=None if t.backends is None else frozenset(t.backends),
    )


def _set_tenants(
    gateway: Gateway,
    config: Config,
    tenants: list[Tenant] | None = None,
    index: TenantIndex | None = None,
) -> None:
    """Installs the gateway's tenant table for ``config`` (keys, classes, wait times):
    ``tenants`` and their lookups ``index`` when given (one per configured tenant, in
    order), else built here."""
    if tenants is None:
        ctl = gateway.controller
        tenants = [_tenant(t, ctl.tenant_id(t.name)) for t in _tenants_of(config)]
    anonymous_name = config.anonymous_tenant or ("anonymous" if not config.tenants else None)
    if anonymous_name is None:
        anonymous = None
    elif index is not None:
        anonymous = index.by_name.get(anonymous_name)
    else:
        anonymous = next((t for t in tenants if t.name == anonymous_name), None)
    gateway.set_tenants(tenants, anonymous, index)
    gateway.metrics.label_tenants(len(tenants), config.metrics.tenant_labels)


def _check_guarantee_room(
    ctl: Any, changed: list[Any], ids: dict[str, int | None], removed_ids: list[int]
) -> None:
    """Refuses, before anything is changed, a reload whose guarantees cannot fit in the core's
    guarantee table (one entry per (tenant, backend) pair a guarantee names, sized at start-up
    and never freed). ``changed``: the tenants the reload sets; ``ids``: their core ids
    (``None``: added); ``removed_ids``: the tenants it removes.

    A tenant already in the core gets its missing entries from the free ones. An added tenant
    may instead take a removed tenant's id, with the entries it holds: at most one id each,
    and an id's entry on backend ``b`` serves only a tenant that needs one on ``b``; so on each
    backend at most ``min(added tenants that need an entry there, removed ids that hold one)``
    entries come that way. The test counts that much, and every removed id (those still
    running requests too): it errs on the side of applying, so it never refuses a reload that
    would apply, while one it lets through can still stop part way (``add_tenant`` then names
    the full table). The free entries are read before the ids: a tenant another worker of a
    shared core adds meanwhile has taken entries the count then no longer asks for.

    Raises:
        kvgate.config.ConfigError: the entries the reload needs exceed what can serve them.
    """
    from kvgate.config import ConfigError

    free = int(ctl.guarantee_entries_free)
    for_kept = 0  # entries tenants already in the core need: only free ones serve them
    for_added: dict[int, int] = {}  # backend id → added tenants that need an entry there
    per_added: list[int] = []  # the entries each added tenant needs
    for t in changed:
        if not t.guaranteed_slots and t.backends is None:
            continue  # no guarantee, no list: no entry
        limits = _tenant_limits(t, ctl)
        tid = ids[t.name] if ids[t.name] is not None else ctl.tenant_id(t.name)
        backends = ctl.guarantee_entries_needed(
            tid,
            guaranteed_slots=limits["guaranteed_slots"],
            guaranteed_backends=limits["guaranteed_backends"],
        )
        if tid is not None:
            for_kept += len(backends)
        elif backends:
            per_added.append(len(backends))
            for b in backends:
                for_added[b] = for_added.get(b, 0) + 1
    needed = for_kept + sum(per_added)
    if needed <= free:
        return
    inherited = 0
    if per_added:
        held: dict[int, int] = {}  # backend id → removed ids holding an entry there
        per_id: list[int] = []  # the entries each removed id holds
        reusable = set(removed_ids) | {i for i in range(ctl.tenant_count) if ctl.tenant_removed(i)}
        for i in reusable:
            entries = ctl.guarantee_entries_of(i)
            per_id.append(len(entries))
            for b in entries:
                held[b] = held.get(b, 0) + 1
        # three bounds, each never below what the ids can pass on: per backend; one tenant per
        # id (the ids holding most); one id per tenant (the tenants needing most)
        pairs = min(len(per_added), len(per_id))
        inherited = min(
            sum(min(n, held.get(b, 0)) for b, n in for_added.items()),
            sum(sorted(per_id, reverse=True)[:pairs]),
            sum(sorted(per_added, reverse=True)[:pairs]),
        )
    if needed - inherited > free:
        raise ConfigError(
            [
                (
                    "tenants",
                    f"the guarantees of this configuration need {needed} more (tenant, backend) "
                    f"entries in the admission core's guarantee table, which was sized at "
                    f"start-up for {ctl.capacity['guarantees']} and has {free} free (and "
                    f"{inherited} that removed tenants' ids could pass on); one entry per "
                    "backend a tenant's guaranteed_slots or backends name; restart kvgate to "
                    "apply this configuration",
                )
            ]
        )


def _warn_start_only(gateway: Gateway, new: Config) -> None:
    """Warns about the settings of ``new`` that apply only at the next start (compared with
    what the gateway started with)."""
    old = gateway.config
    if old is None:
        return
    # what applies only at start is compared with what the gateway started with
    start = gateway.started_config if gateway.started_config is not None else old
    models_before = [m for b in start.backends for m in b.models]
    models_after = [m for b in new.backends for m in b.models]
    if models_before != models_after:
        # the request analysers (tokenizer, chat template, context window, default
        # max_tokens) are built at start-up
        logger.warning(
            "reload: model settings (tokenizer, chat_template, context_window, "
            "default_max_tokens) changed in the file; they apply only at the next start"
        )
    if new.store != start.store:
        logger.warning(
            "reload: the store section changed in the file; it applies only at the next "
            "start (the limits stay shared as they were)"
        )
    if new.listen != start.listen or new.workers != start.workers:
        logger.warning(
            "reload: listen address and workers changed in the file; they apply only at "
            "the next start (still %s:%d, %d worker(s))",
            start.listen.host,
            start.listen.port,
            start.workers,
        )
    if new.tracing != start.tracing:
        logger.warning("reload: tracing changed in the file; it applies only at the next start")


class RemovedTenantsRunning(ConfigError):
    """A reload that fits once requests of tenants it removes have ended (their ids go to the
    tenants it adds): :meth:`kvgate.app.Gateway.reload_soon` tries it again every
    :attr:`retry_after_s` seconds, so that every replica applies it, whichever had such
    requests running."""

    #: seconds between tries
    retry_after_s = 1.0


def _add_tenant(ctl: Any, t: Any) -> int:
    """Adds tenant ``t`` to the core; its id. One that another worker of the same shared core
    added a moment ago (each worker applies the file) gets these limits instead."""
    from kvgate import InvalidConfigError

    try:
        return int(ctl.add_tenant(t.name, **_tenant_limits(t, ctl)))
    except InvalidConfigError:
        tid = ctl.tenant_id(t.name)
        if tid is None:
            raise
        ctl.replace_tenant(tid, **_tenant_limits(t, ctl))
        return int(tid)


def check_limits(new: Config) -> None:
    """Tries every limit of ``new`` on a scratch core (a slot limit left to the engine is at
    least the guarantees, whatever the engine states), as :func:`apply_config` does first.

    Raises:
        kvgate.InvalidConfigError: the core refuses a limit.
    """
    build_controller(new)


@dataclass(slots=True)
class Reload:
    """A new configuration made ready to apply (:func:`prepare_reload`): what it changes,
    worked out without touching the running gateway, so that the applying, which holds the
    event loop, does only the changes (a reload of 100,000 tenants that changes 200 of them
    no longer walks them all on the loop).

    Attributes:
        config: the new configuration.
        ids: tenant name → its core id at preparation (``None``: a tenant this reload adds).
        changed: the configurations of the tenants whose core limits are set: the new ones and
            those that differ from the running configuration.
        tenants: the new tenant table, one per configured tenant in order; ``None`` where a
            tenant is added (built once the core gives it an id).
        added_at: the positions of the added tenants in ``tenants``.
        index: the lookups of ``tenants`` (the added ones go in once built).
        removed: the names of the running tenants the new configuration drops.
    """

    config: Config
    ids: dict[str, int | None]
    changed: list[Any]
    tenants: list[Tenant | None]
    added_at: list[int]
    index: TenantIndex
    removed: list[str]


def prepare_reload(gateway: Gateway, new: Config) -> Reload:
    """Checks ``new`` against the core (:func:`check_limits`) and works out what applying it
    changes. Reads the running gateway, changes nothing: a SIGHUP reload runs it on a worker
    thread, beside the reading of the file (reloads run one at a time, so what it read still
    holds when :func:`apply_config` runs).

    Raises:
        kvgate.InvalidConfigError: the core refuses a limit.
    """
    check_limits(new)
    ctl = gateway.controller
    old = gateway.config
    # (after a reload that failed part way, what the core holds is not the running file's:
    # every tenant is set again)
    before = {} if old is None or gateway.partly_applied else {t.name: t for t in _tenants_of(old)}
    ids: dict[str, int | None] = {}
    changed: list[Any] = []
    tenants: list[Tenant | None] = []
    added_at: list[int] = []
    for t in _tenants_of(new):
        tid = ids[t.name] = ctl.tenant_id(t.name)
        if tid is None:
            changed.append(t)
            added_at.append(len(tenants))
            tenants.append(None)
            continue
        kept = gateway.identity.named(t.name)
        if kept is not None and kept.id == tid and before.get(t.name) == t:
            tenants.append(kept)  # as it runs: nothing to set
            continue
        changed.append(t)
        tenants.append(_tenant(t, tid))
    if gateway.partly_applied:
        # the core may hold tenants of the file that failed part way: every live one that the
        # new file does not name goes
        live = (
            ctl.tenant_state(i)["name"]
            for i in range(ctl.tenant_count)
            if not ctl.tenant_removed(i)
        )
        removed = [name for name in live if name not in ids]
    else:
        removed = [name for name in before if name not in ids]
    return Reload(new, ids, changed, tenants, added_at, TenantTable.index(tenants), removed)


def apply_config(gateway: Gateway, new: Config | Reload) -> None:
    """Hot reload: apply ``new`` (a configuration, or the :class:`Reload`
    :func:`prepare_reload` made of it) to a running gateway (SIGHUP).

    Base limits of existing backends and tenants change in the core (held slots and in-flight
    streams are untouched); new tenants are added; tenants no longer in the file are removed
    (their keys stop working at once; their requests in flight finish and release as usual,
    and their id in the core is reused only once they hold nothing); keys, priority classes
    and wait times are replaced at once; queued requests that fit the new limits are admitted
    at once. Backends and models cannot be added or removed by a reload (restart for that).

    Raises:
        kvgate.config.ConfigError: the backends or models differ from the running set, or the
            new tenants or their guarantees do not fit in the core's region, which was sized
            at start-up (a restart is needed; nothing is changed;
            :func:`_check_guarantee_room`).
        kvgate.InvalidConfigError: the core refuses a limit (tried on a scratch core first:
            nothing is changed).
    """
    from kvgate.config import ConfigError

    # every limit is tried on a scratch core first, so a refusal leaves the running one as it is
    plan = new if isinstance(new, Reload) else prepare_reload(gateway, new)
    new = plan.config
    old = gateway.config
    if old is not None:
        before = [(b.name, b.url, [m.name for m in b.models]) for b in old.backends]
        after = [(b.name, b.url, [m.name for m in b.models]) for b in new.backends]
        if before != after:
            raise ConfigError(
                [("backends", "backends and models cannot change on reload; restart kvgate")]
            )
    ctl = gateway.controller
    ids = plan.ids
    # with --workers N every worker applies the file to the one shared core, at the same time:
    # another worker may remove and add tenants between the reads below, which come in the
    # order that can only overstate the room (the tenants to remove, the free ids, then the
    # tenants another worker added since this one prepared its reload), so that no worker
    # refuses a file that fits
    removed = [(tid, name) for name in plan.removed if (tid := ctl.tenant_id(name)) is not None]
    removed_ids = [tid for tid, _ in removed]
    free = ctl.free_tenant_ids
    for t in plan.changed:
        if ids[t.name] is None:
            ids[t.name] = ctl.tenant_id(t.name)
    adding = sum(1 for t in plan.changed if ids[t.name] is None)
    # a removed tenant's id can be reused at once only if it holds nothing now
    busy = sum(1 for tid in removed_ids if ctl.tenant_state(tid)["in_use"] != 0)
    room = free + len(removed_ids) - busy
    if room < adding <= room + busy:
        raise RemovedTenantsRunning(
            [
                (
                    "tenants",
                    f"{adding} new tenants need the ids of removed tenants, and {busy} of "
                    "those still have requests running here (an id is reused once its "
                    "requests end); a SIGHUP reload is tried again every "
                    f"{RemovedTenantsRunning.retry_after_s:g} s until it applies",
                )
            ]
        )
    if adding > room:
        raise ConfigError(
            [
                (
                    "tenants",
                    f"{adding} new tenants do not fit: the admission core was sized at start-up "
                    f"for {ctl.capacity['tenants']} tenants and has room for {room} more; "
                    "restart kvgate to apply this configuration",
                )
            ]
        )
    _check_guarantee_room(ctl, plan.changed, ids, removed_ids)
    from kvgate.config import DEFAULT_SLOTS

    _warn_start_only(gateway, new)
    # from here a refusal leaves part of the file applied: the next reload sets every tenant
    gateway.partly_applied = True
    guaranteed = _guaranteed_sums(new)
    slot_limits: dict[int, int] = {}
    for b in new.backends:
        if b.max_concurrency is None:
            # the limit stays the engine's: what it stated at start or on a later poll
            stated = gateway.engine_slots.get(b.name)
            if stated is None:
                stated = getattr(gateway.discovery.get(b.name), "slots", None) or DEFAULT_SLOTS
            gateway.engine_slots[b.name] = stated
        else:
            stated = None
            if gateway.engine_slots.get(b.name) != b.max_concurrency:
                gateway.engine_slots.pop(b.name, None)  # a configured limit: polls keep out
        bid = ctl.backend_id(b.name)
        slots = slot_limit(b, guaranteed[b.name], stated)
        limits = _backend_limits(b, slots)
        if limits["inflight_token_limit"] is None and gateway.discovered_capacity.get(b.name):
            limits["inflight_token_limit"] = gateway.discovered_capacity[b.name]
        # the core refuses a slot limit below the guarantees it holds now; one that only the
        # new tenants' smaller guarantees allow is set once they are in place (below)
        held = int(ctl.backend_state(bid)["guaranteed_slots"])
        limits["max_concurrency"] = max(slots, held)
        ctl.replace_backend(bid, **limits)
        slot_limits[bid] = slots
    for tid, name in removed:
        # by id and name: with --workers N another worker may have removed the tenant and given
        # its id to one it added, which stays
        ctl.remove_tenant_named(tid, name)
    # guarantees that shrink go first: the core refuses a step that puts a backend's guarantees
    # above its slots, even where the file as a whole fits (one tenant's guarantee moved to
    # another); the new tenants last
    changed = [t for t in plan.changed if ids[t.name] is not None]
    changed.sort(
        key=lambda t: t.guaranteed_slots - ctl.tenant_state(ids[t.name])["guaranteed_slots"]
    )
    # tenants that get a concurrency limit they did not have: their running requests were
    # admitted without it (the store takes them in, below)
    limited = [
        t
        for t in changed
        if t.max_concurrency is not None
        and ctl.tenant_state(ids[t.name])["max_concurrency"] is None
    ]
    for t in changed:
        ctl.replace_tenant(ids[t.name], **_tenant_limits(t, ctl))
    # the new tenants that need the most guarantee entries first: each takes the removed id
    # whose entries suit it, before a tenant that needs fewer takes that id
    added = [t for t in plan.changed if ids[t.name] is None]
    added.sort(key=lambda t: -_entries_wanted(t, len(plan.config.backends)))
    for t in added:
        ids[t.name] = _add_tenant(ctl, t)
    for bid, slots in slot_limits.items():
        if ctl.backend_state(bid)["max_concurrency"] != slots:
            ctl.update_backend(bid, max_concurrency=slots)
    for backend, b in zip(gateway.backends, new.backends, strict=True):
        backend.config = b
    if old is not None:  # the listening socket and the workers stay those of the start
        new = new.model_copy(update={"listen": old.listen, "workers": old.workers})
    gateway.config = new
    gateway.max_body_bytes = new.max_body_bytes
    for b in new.backends:
        found = gateway.discovery.get(b.name)
        cap = getattr(found, "kv_capacity_tokens", None)
        if cap is None and gateway.discovered_capacity.get(b.name):
            cap = int(gateway.discovered_capacity[b.name] / b.capacity_safety_factor)
        gateway.set_prefill_capacity(b.name, cap)
    gateway.slo = _slo_controller(gateway, new.slo)
    gateway.store.reload()
    now = time.monotonic()
    for t in limited:
        tid = ids[t.name]
        assert tid is not None  # (a tenant already in the core)
        gateway.store.adopt_running(t.name, functools.partial(gateway.running.count, tid, now))
    gateway.timeouts = new.timeouts
    # the table as prepared, with the added tenants now that the core gave them ids
    tenants = list(plan.tenants)
    configs = _tenants_of(new) if plan.added_at else []
    for at in plan.added_at:
        t = configs[at]
        tid = ids[t.name]
        assert tid is not None
        tenants[at] = tenant = _tenant(t, tid)
        plan.index.add(tenant)
    _set_tenants(gateway, new, cast(list[Tenant], tenants), plan.index)
    gateway.index_replicas()  # (forgets the replica sets of the old tenants' backend limits)
    gateway.partly_applied = False
    gateway.notify_waiters()  # limits that grew: waiters may fit now
    logger.info(
        "configuration reloaded: %d backends, %d tenants", len(new.backends), len(_tenants_of(new))
    )
