"""Shadow mode: refusals only counted (``kvgate_shadow_rejections_total{reason}``), never
enforced — set on the gateway (``mode: shadow``), on a backend, or on a tenant. A request
refused in shadow mode runs with :data:`SHADOW_ADMISSION`, which holds nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvgate.app import Backend, Tenant

__all__ = ["SHADOW_ADMISSION", "ShadowAdmission", "in_shadow"]


class ShadowAdmission:
    """What a request refused in shadow mode runs with: it holds nothing and releases nothing
    (the refusal was counted in ``kvgate_shadow_rejections_total``)."""

    __slots__ = ()
    admitted = True

    def release(self, actual_tokens: int | None = None) -> None:
        """Nothing to give back."""


#: the one shadow admission every such request shares
SHADOW_ADMISSION = ShadowAdmission()


def in_shadow(config: Any, backend: Backend, tenant: Tenant) -> bool:
    """Whether refusals for ``tenant`` on ``backend`` are only counted: ``mode: shadow`` on the
    tenant, the backend, or the gateway's configuration ``config`` (``None``: none)."""
    if tenant.shadow:
        return True
    return config is not None and (
        config.mode == "shadow" or (backend.config is not None and backend.config.mode == "shadow")
    )
