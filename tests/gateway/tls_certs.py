"""A self-signed certificate for the TLS tests, made by the ``openssl`` command-line tool (run
on this machine, nothing downloaded), and an HTTPS client context that trusts it."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from .helpers import until


@dataclass(frozen=True)
class Cert:
    """PEM files: ``certificate`` (for 127.0.0.1 and localhost; also the clients' CA file) and
    its unencrypted ``key``."""

    certificate: Path
    key: Path

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts only this certificate."""
        return ssl.create_default_context(cafile=str(self.certificate))


def self_signed(folder: Path, name: str = "server") -> Cert:
    """A new RSA-2048 self-signed certificate valid one day, in ``folder/name.{crt,key}``."""
    openssl = shutil.which("openssl")
    if openssl is None:  # scripts/install-test-packages.sh installs it for `make test`
        pytest.fail("the openssl command-line tool is needed to make test certificates")
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return Cert(cert, key)


async def wait_https_up(url: str, cert: Cert, timeout: float = 60.0) -> None:
    """Poll ``GET url`` over HTTPS (trusting ``cert``) until it answers 200."""
    ctx = cert.client_context()

    async def up() -> bool:
        try:
            async with aiohttp.ClientSession() as s, s.get(url, ssl=ctx) as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    await until(up, timeout=timeout, interval=0.2)
