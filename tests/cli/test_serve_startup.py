"""``kvgate serve`` refuses to start with a clear message (exit 2), never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvgate", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_unloadable_tokenizer_is_a_clear_startup_error(tmp_path: Path) -> None:
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"not": "a tokenizer"}')
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text(
        "backends:\n"
        "  - name: b0\n"
        "    url: http://127.0.0.1:9\n"
        "    max_concurrency: 4\n"
        "    models:\n"
        f"      - {{name: m, context_window: 1024, tokenizer: {tok}}}\n"
    )
    done = _serve("--config", str(cfg), "--port", "0")
    assert done.returncode == 2
    assert "kvgate serve: cannot start:" in done.stderr
    assert "Traceback" not in done.stderr


def test_invalid_config_lists_the_bad_fields(tmp_path: Path) -> None:
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text("backends:\n  - name: b0\n    url: http://127.0.0.1:9\n    max_concurrency: 0\n")
    done = _serve("--config", str(cfg))
    assert done.returncode == 2
    assert "backends[0].max_concurrency" in done.stderr
    assert "backends[0].models" in done.stderr
    assert "Traceback" not in done.stderr


def test_neither_config_nor_upstream(tmp_path: Path) -> None:
    done = _serve()
    assert done.returncode == 2
    assert "--config" in done.stderr


def test_unreachable_upstream_for_model_discovery() -> None:
    done = _serve("--upstream", "http://127.0.0.1:9")
    assert done.returncode == 2
    assert "cannot list models" in done.stderr
    assert "Traceback" not in done.stderr


def test_malformed_http_is_not_logged_as_an_error() -> None:
    """aiohttp's ERROR + traceback for a malformed request (a client error) is demoted to
    DEBUG, so anonymous clients cannot flood the log; other errors keep their level."""
    import logging

    from aiohttp.http_exceptions import BadHttpMessage
    from aiohttp.web_protocol import RequestPayloadError

    from kvgate.cli_serve import _BadHttpToDebug

    log = logging.getLogger("aiohttp.server")
    log.setLevel(logging.INFO)
    flt = _BadHttpToDebug()

    def record(exc: BaseException) -> logging.LogRecord:
        return log.makeRecord(
            log.name,
            logging.ERROR,
            __file__,
            1,
            "Error handling request",
            (),
            (type(exc), exc, None),
        )

    bad = record(BadHttpMessage("Duplicate Content-Length"))
    assert flt.filter(bad) is False
    assert bad.levelno == logging.DEBUG
    # an undecodable Content-Encoding, answered 400, raised again when aiohttp drains the body
    payload = record(RequestPayloadError("Can not decode content-encoding: gzip"))
    assert flt.filter(payload) is False
    assert payload.levelno == logging.DEBUG
    real = record(RuntimeError("a bug of ours"))
    assert flt.filter(real) is True
    assert real.levelno == logging.ERROR
