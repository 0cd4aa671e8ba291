"""TLS on the gateway's listener: the server-side ``ssl.SSLContext`` built from ``listen.tls``.

The certificate file is PEM (the server's certificate, then any intermediate certificates the
clients need to reach a root they trust); the key file is the matching PEM private key,
unencrypted (the gateway starts unattended: there is nobody to type a passphrase). Only TLS 1.2
and 1.3 are offered (RFC 8996 deprecates TLS 1.0 and 1.1); the cipher suites are Python's
defaults for a server context.
"""

from __future__ import annotations

import ssl
from pathlib import Path

__all__ = ["server_context"]


def _encrypted_key() -> bytes:
    # called by OpenSSL only when the key is encrypted: refuse instead of prompting on a terminal
    raise ValueError("the key is encrypted with a passphrase; give an unencrypted PEM key")


def server_context(certificate: str | Path, key: str | Path) -> ssl.SSLContext:
    """A server ``SSLContext`` serving ``certificate`` with ``key``, TLS 1.2 or later only.

    Args:
        certificate: path of the PEM certificate chain file (the server's certificate first).
        key: path of the PEM private key file matching the certificate, unencrypted.

    Returns:
        The context, for aiohttp's site (``ssl_context``) or ``loop.create_server(ssl=...)``.

    Raises:
        ValueError: a file cannot be read, the certificate file holds no PEM certificate, the
            key file holds no usable private key (or an encrypted one), or the key does not
            match the certificate; the message names the file(s) involved.
    """
    certificate, key = str(certificate), str(key)
    for name, path in (("certificate", certificate), ("key", key)):
        try:
            Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read the {name} file {path}: {exc.strerror or exc}") from None
    # the certificate alone first, so a bad certificate is not reported as a bad key
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        probe.load_verify_locations(cafile=certificate)
    except (ssl.SSLError, ValueError) as exc:
        raise ValueError(
            f"{certificate} is not a PEM certificate file ({exc.__class__.__name__}: {exc})"
        ) from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(certificate, key, password=_encrypted_key)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(
                f"the key {key} does not match the certificate {certificate}"
            ) from None
        raise ValueError(
            f"{key} is not a usable PEM private key for {certificate} ({exc})"
        ) from None
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
    return context
