"""HTTPS on the listener (``listen.tls``): the files are checked at load and by ``kvgate
check-config``; the gateway in front of the simulator serves the official ``openai`` client
over TLS, streamed and not, and its own endpoints; a plain-HTTP request on the TLS port is
closed without harming the gateway; ``kvgate serve --tls-certificate/--tls-key``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from pathlib import Path

import aiohttp
import openai
import pytest

from kvgate.__main__ import main
from kvgate.config import ConfigError, load_config
from kvgate.gateway_build import build_gateway
from kvgate.server import run_gateway
from kvgate.sim import SimConfig, run_sim
from kvgate.tls import server_context

from .conftest import config_for
from .helpers import exited_stderr, free_port, start_kvgate, stop_process, until
from .tls_certs import self_signed, wait_https_up


def write_config(folder: Path, tls: dict[str, str]) -> Path:
    path = folder / "kvgate.yaml"
    path.write_text(
        json.dumps(
            {
                "listen": {"port": 8443, "tls": tls},
                "backends": [
                    {
                        "name": "b0",
                        "url": "http://127.0.0.1:9",
                        "max_concurrency": 2,
                        "models": [{"name": "m", "context_window": 100}],
                    }
                ],
            }
        )
    )
    return path


def test_tls_files_are_resolved_and_checked_at_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = self_signed(tmp_path, "good")
    other = self_signed(tmp_path, "other")
    # relative to the config file, not the working directory
    cfg = load_config(write_config(tmp_path, {"certificate": "good.crt", "key": "good.key"}))
    assert cfg.listen.tls is not None
    assert cfg.listen.tls.certificate == str(good.certificate.resolve())
    assert cfg.listen.tls.key == str(good.key.resolve())
    assert main(["check-config", str(tmp_path / "kvgate.yaml")]) == 0
    assert "listen 127.0.0.1:8443 over TLS" in capsys.readouterr().out

    cases = {
        # the other certificate's key
        "does not match": {"certificate": "good.crt", "key": "other.key"},
        "file not found": {"certificate": "good.crt", "key": "missing.key"},
        # a certificate where the key should be, a key where the certificate should be
        "not a usable PEM private key": {"certificate": "good.crt", "key": "good.crt"},
        "not a PEM certificate": {"certificate": "good.key", "key": "good.key"},
    }
    assert other.key.is_file()
    for expected, tls in cases.items():
        path = write_config(tmp_path, tls)
        with pytest.raises(ConfigError) as err:
            load_config(path)
        text = str(err.value)
        assert "listen.tls" in text, text
        assert expected in text, text
        bad = tls["key"] if expected != "not a PEM certificate" else tls["certificate"]
        assert str(tmp_path / bad) in text, text
        assert main(["check-config", str(path)]) == 2
        out = capsys.readouterr()
        assert expected in out.err
        assert "Traceback" not in out.err
    # the field itself is required in full
    with pytest.raises(ConfigError, match=r"listen\.tls\.key"):
        load_config(write_config(tmp_path, {"certificate": "good.crt"}))


def test_encrypted_key_is_refused_not_prompted(tmp_path: Path) -> None:
    import subprocess

    cert = self_signed(tmp_path)
    locked = tmp_path / "locked.key"
    subprocess.run(
        [
            "openssl",
            "pkey",
            "-in",
            str(cert.key),
            "-aes128",
            "-passout",
            "pass:x",
            "-out",
            str(locked),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    with pytest.raises(ValueError, match="encrypted"):
        server_context(cert.certificate, locked)


def test_context_offers_tls_12_and_later_only(tmp_path: Path) -> None:
    cert = self_signed(tmp_path)
    assert server_context(cert.certificate, cert.key).minimum_version == ssl.TLSVersion.TLSv1_2


@contextlib.asynccontextmanager
async def tls_stack(tmp_path: Path):  # type: ignore[no-untyped-def]
    cert = self_signed(tmp_path)
    async with run_sim(SimConfig.from_profile("tiny", speed=50, seed=4)) as sim:
        model = sim.engine.config.model
        gateway = build_gateway(config_for(sim.url, [model]))
        ctx = server_context(cert.certificate, cert.key)
        async with run_gateway(gateway, ssl_context=ctx) as url:
            yield url, model, gateway, cert


async def test_openai_client_over_tls_streamed_and_not(tmp_path: Path) -> None:
    async with tls_stack(tmp_path) as (url, model, gateway, cert):
        assert url.startswith("https://127.0.0.1:")
        http = openai.DefaultAsyncHttpxClient(verify=cert.client_context())
        client = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="unused", http_client=http, max_retries=0
        )
        async with client:
            answer = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=6
            )
            assert answer.choices[0].message.content
            assert answer.usage is not None
            assert answer.usage.completion_tokens > 0
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, usage = "", None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                usage = chunk.usage or usage
            assert text
            assert usage is not None
            assert usage.completion_tokens > 0
            models = await client.models.list()
            assert [m.id for m in models.data] == [model]
        # the gateway's own endpoints over TLS
        async with aiohttp.ClientSession() as s:
            for path in ("/healthz", "/readyz", "/metrics"):
                async with s.get(url + path, ssl=cert.client_context()) as r:
                    assert r.status == 200, path
        # an untrusting client is refused by its own check, not served in clear
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await s.get(url + "/healthz")
        ctl = gateway.controller
        await until(lambda: dict(ctl.backend_state(0))["in_use"] == 0, timeout=10)
        assert dict(ctl.backend_state(0))["inflight_tokens"] == 0


async def test_plain_http_on_the_tls_port_is_closed_and_serving_goes_on(tmp_path: Path) -> None:
    async with tls_stack(tmp_path) as (url, _model, gateway, cert):
        port = int(url.rsplit(":", 1)[1])
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await writer.drain()
            received = b""
            with contextlib.suppress(ConnectionError):
                while chunk := await asyncio.wait_for(reader.read(4096), timeout=20):
                    received += chunk
            # at most a TLS alert record (content type 21), never an HTTP answer in clear
            assert b"HTTP/" not in received
            assert received == b"" or received[0] == 21, received[:16]
            writer.close()
        # a TLS 1.2 client is served (the floor), and the gateway is unharmed
        client_ctx = cert.client_context()
        client_ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx)
        assert writer.get_extra_info("ssl_object").version() == "TLSv1.2"
        writer.write(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), timeout=20)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:100]
        writer.close()
        assert dict(gateway.controller.backend_state(0))["in_use"] == 0


async def test_serve_tls_flags_serve_https(tmp_path: Path) -> None:
    cert = self_signed(tmp_path)
    async with run_sim(SimConfig.from_profile("tiny", speed=50, seed=4)) as sim:
        port = free_port()
        gw = await start_kvgate(
            "serve",
            "--upstream",
            sim.url,
            "--port",
            str(port),
            "--no-adaptive",
            "--tls-certificate",
            str(cert.certificate),
            "--tls-key",
            str(cert.key),
        )
        try:
            url = f"https://127.0.0.1:{port}"
            await wait_https_up(url + "/readyz", cert)
            http = openai.DefaultAsyncHttpxClient(verify=cert.client_context())
            async with openai.AsyncOpenAI(
                base_url=url + "/v1", api_key="unused", http_client=http, max_retries=0
            ) as client:
                answer = await client.chat.completions.create(
                    model=sim.engine.config.model,
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=4,
                )
                assert answer.choices[0].message.content
        finally:
            err = await stop_process(gw)
        assert gw.returncode == 0, err.decode(errors="replace")[-2000:]

    # one flag without the other: refused with the field named, before anything starts
    gw = await start_kvgate(
        "serve", "--upstream", "http://127.0.0.1:9", "--model", "m", "--tls-key", str(cert.key)
    )
    try:
        err = await exited_stderr(gw, timeout=60)
    finally:
        await stop_process(gw)
    assert gw.returncode == 2
    assert b"listen.tls.certificate" in err, err
