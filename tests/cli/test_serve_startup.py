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
    done = _serve("--config", str(_config(tmp_path, tokenizer=tok)), "--port", "0")
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


def _config(tmp_path: Path, extra: str = "", tokenizer: Path | None = None) -> Path:
    model = "{name: m, context_window: 1024" + (f", tokenizer: {tokenizer}" if tokenizer else "")
    cfg = tmp_path / "kvgate.yaml"
    cfg.write_text(
        "backends:\n"
        "  - name: b0\n"
        "    url: http://127.0.0.1:9\n"
        "    max_concurrency: 4\n"
        "    adaptive: {enabled: false}\n"
        "    models:\n"
        f"      - {model}}}\n" + extra
    )
    return cfg


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_workers_that_cannot_start_stop_the_gateway(tmp_path: Path) -> None:
    """A configuration every worker would refuse ends the master with exit 2 and one error,
    instead of restarting workers forever."""
    tok = tmp_path / "tokenizer.json"
    tok.write_text("not json at all")
    cfg = _config(tmp_path, tokenizer=tok)
    done = _serve("--config", str(cfg), "--workers", "2", "--port", str(_free_port()))
    assert done.returncode == 2
    assert "cannot start" in done.stderr
    assert "restarting" not in done.stderr
    assert "Traceback" not in done.stderr


def test_a_port_in_use_is_refused_for_workers_too(tmp_path: Path) -> None:
    """Workers listen with SO_REUSEPORT, which would let them join another gateway's workers
    on the same port (each with its own limits): the master refuses a port already taken."""
    import socket

    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as another gateway's
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for workers in ("1", "2"):
            done = _serve(
                "--config", str(_config(tmp_path)), "--workers", workers, "--port", str(port)
            )
            assert done.returncode == 2, done.stderr
            assert f"127.0.0.1:{port}" in done.stderr
            assert "Traceback" not in done.stderr
            assert "restarting" not in done.stderr


def test_port_zero_needs_one_worker(tmp_path: Path) -> None:
    done = _serve("--config", str(_config(tmp_path)), "--workers", "2", "--port", "0")
    assert done.returncode == 2
    assert "need a fixed port" in done.stderr


def test_quick_start_flags_are_refused_with_a_config(tmp_path: Path) -> None:
    cfg = str(_config(tmp_path))
    for flags in (["--tpm", "5"], ["--no-adaptive"], ["--model", "x", "--max-concurrency", "1"]):
        done = _serve("--config", cfg, *flags)
        assert done.returncode == 2
        assert "only apply with --upstream" in done.stderr
        assert flags[0] in done.stderr
    done = _serve("--config", cfg, "--upstream", "http://127.0.0.1:9")
    assert done.returncode == 2
    assert "not both" in done.stderr


def test_bad_flag_values_are_argument_errors(tmp_path: Path) -> None:
    cfg = str(_config(tmp_path))
    for flag, value in (
        ("--workers", "0"),
        ("--workers", "64"),
        ("--port", "70000"),
        ("--port", "-1"),
        ("--max-body-bytes", "-1"),
        ("--max-body-bytes", "0"),
        ("--max-body-bytes", str(2**62 + 1)),
        ("--grace", "nan"),
        ("--grace", "-1"),
        ("--log-level", "bogus"),
        ("--context-window", "0"),
        ("--tpm", "2.5"),
    ):
        done = _serve("--config", cfg, flag, value)
        assert done.returncode == 2, (flag, value)
        assert f"argument {flag}" in done.stderr, (flag, value, done.stderr)
        assert "Traceback" not in done.stderr


def test_the_announced_url_has_the_real_port(tmp_path: Path) -> None:
    import signal
    import urllib.request

    cmd = [
        sys.executable,
        "-m",
        "kvgate",
        "serve",
        "--config",
        str(_config(tmp_path)),
        "--port",
        "0",
    ]
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("kvgate: serving on http://127.0.0.1:")
            url = line.split()[-1]
            assert not url.endswith(":0")
            with urllib.request.urlopen(url + "/healthz", timeout=10) as resp:
                assert resp.status == 200
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
