"""Who is calling: the tenant of a request's API key and its priority class (the
authentication stage; no HTTP here: it reads a mapping of header names to values).

The key comes from ``Authorization: Bearer <key>`` (or, without a Bearer authorization, the
``api-key`` header Azure OpenAI clients send); its SHA-256 digest is looked up in a dict of the
declared digests, one lookup whatever the number of tenants and keys. A request may lower its
priority class with ``x-kvgate-priority``, never raise it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvgate.admission.wait_queue import PRIORITY_CLASSES
from kvgate.errors import GatewayError

if TYPE_CHECKING:
    from kvgate.app import Tenant

__all__ = ["PRIORITY_HEADER", "TenantIndex", "TenantTable", "api_key"]

#: the request header that lowers a request's priority class (a higher class is ignored)
PRIORITY_HEADER = "x-kvgate-priority"


def api_key(headers: Mapping[str, str]) -> str | None:
    """The API key a request sends: the value of ``Authorization: Bearer <key>`` (scheme
    case-insensitive, RFC 9110 §11.1), else its ``api-key`` header; ``None`` when it sends
    neither (or an empty one)."""
    auth = headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return headers.get("api-key") or None


@dataclass(slots=True)
class TenantIndex:
    """A tenant table's lookups: the tenant of each API key (by the SHA-256 digest, bytes) and
    of each name."""

    by_hash: dict[bytes, Tenant]
    by_name: dict[str, Tenant]

    def add(self, tenant: Tenant) -> None:
        """Adds ``tenant`` under its name and each of its keys (configuration validation
        refuses a key or a name used twice)."""
        for digest in tenant.key_hashes:
            self.by_hash[bytes.fromhex(digest)] = tenant
        self.by_name[tenant.name] = tenant


class TenantTable:
    """The tenants by the SHA-256 digest of their API keys, and the anonymous tenant (the one
    a request without a key runs as, if any). Replaced whole on reload (:meth:`replace`).

    Attributes:
        tenants: every tenant, in core id order.
        anonymous: the tenant of requests that send no key, or ``None`` (they are refused).
    """

    __slots__ = ("_by_hash", "_by_name", "anonymous", "tenants")

    def __init__(self, tenants: list[Tenant], anonymous: Tenant | None) -> None:
        self.tenants: list[Tenant] = []
        self.anonymous: Tenant | None = None
        self._by_hash: dict[bytes, Tenant] = {}
        self._by_name: dict[str, Tenant] = {}
        self.replace(tenants, anonymous)

    @staticmethod
    def index(tenants: Iterable[Tenant | None]) -> TenantIndex:
        """The lookups of ``tenants`` (``None`` entries skipped; more go in with
        :meth:`TenantIndex.add`), built apart from the table, so that a reload builds them off
        the event loop."""
        index = TenantIndex({}, {})
        for tenant in tenants:
            if tenant is not None:
                index.add(tenant)
        return index

    def replace(
        self, tenants: list[Tenant], anonymous: Tenant | None, index: TenantIndex | None = None
    ) -> None:
        """Takes a new tenant list (start-up and reload): keys, classes, wait times;
        ``index``: its lookups (:meth:`index`) when built already."""
        if index is None:
            index = self.index(tenants)
        self.tenants, self.anonymous = tenants, anonymous
        self._by_hash, self._by_name = index.by_hash, index.by_name

    def named(self, name: str) -> Tenant | None:
        """The tenant called ``name`` (configuration ``tenants[].name``), or ``None``."""
        return self._by_name.get(name)

    def identify(self, headers: Mapping[str, str]) -> tuple[Tenant, str]:
        """The tenant of a request and its priority class (``critical`` | ``standard`` |
        ``sheddable``), from its headers.

        A lookup's timing can only tell an attacker about the digest of the key they sent,
        never about a declared key (finding a key from its SHA-256 digest is a preimage
        attack), so no constant-time comparison against every digest is needed. Only a request
        with no key runs as the anonymous tenant; when no tenant has a key, keys are not read
        and every request is the anonymous tenant's.

        Raises:
            GatewayError: 401 ``invalid_api_key`` for a key that matches no tenant, and for a
                request with no key when there is no anonymous tenant.
        """
        tenant: Tenant | None = None
        # no keys configured: whatever key a client sends, it is the anonymous tenant
        key = api_key(headers) if self._by_hash else None
        if key:
            digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
            tenant = self._by_hash.get(digest)
            if tenant is None:
                raise GatewayError(
                    401,
                    "Incorrect API key provided.",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
        if tenant is None:
            tenant = self.anonymous
        if tenant is None:
            raise GatewayError(
                401,
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                "invalid_request_error",
                code="invalid_api_key",
            )
        priority = tenant.priority
        asked = headers.get(PRIORITY_HEADER)
        if asked in PRIORITY_CLASSES and PRIORITY_CLASSES.index(asked) > PRIORITY_CLASSES.index(
            priority
        ):
            priority = asked
        return tenant, priority
