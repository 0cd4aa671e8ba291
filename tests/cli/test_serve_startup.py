"""``kvgate serve`` refuses to start with a clear message (exit 2), never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvgate", "serve", *args]


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _serve_cmd(*args),
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

    cmd = _serve_cmd("--config", str(_config(tmp_path)), "--port", "0")
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


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_state_left_by_dead_masters_is_removed(tmp_path: Path) -> None:
    from kvgate.cli_serve import remove_stale_state

    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    dead, live = _dead_pid(), os.getpid()
    for name in (
        f"kvgate-{dead}-1700000000",
        f"kvgate-{live}-1700000000",
        "kvgate-bench-1",
        "other",
    ):
        (shm / name).write_bytes(b"x")
    for name in (f"kvgate-prom-{dead}-abc", f"kvgate-prom-{live}-def", "kvgate-prom-xyz"):
        (tmp / name).mkdir()
        (tmp / name / "counter_1.db").write_bytes(b"x")
    removed = remove_stale_state(str(shm), str(tmp))
    assert sorted(removed) == sorted(
        [str(shm / f"kvgate-{dead}-1700000000"), str(tmp / f"kvgate-prom-{dead}-abc")]
    )
    assert sorted(p.name for p in shm.iterdir()) == sorted(
        [f"kvgate-{live}-1700000000", "kvgate-bench-1", "other"]
    )
    assert sorted(p.name for p in tmp.iterdir()) == sorted(
        [f"kvgate-prom-{live}-def", "kvgate-prom-xyz"]
    )


def test_workers_stop_when_the_master_is_killed(tmp_path: Path) -> None:
    """SIGKILL of the master (no chance to stop its workers): the kernel sends each worker
    SIGTERM, they drain and exit, and the port is free again; the next master removes the
    region the dead one left."""
    import socket
    import time

    port = _free_port()
    cmd = _serve_cmd(
        "--config", str(_config(tmp_path)), "--workers", "2", "--port", str(port), "--grace", "1"
    )
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    ) as proc:
        assert proc.stdout is not None
        assert "2 workers serving on" in proc.stdout.readline()
        region = f"/dev/shm/kvgate-{proc.pid}-"
        deadline = time.monotonic() + 30
        workers: set[int] = set()
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = {
                int(e) for e in os.listdir("/proc") if e.isdigit() and _ppid(int(e)) == proc.pid
            }
            time.sleep(0.05)
        assert len(workers) == 2
        assert any(n.startswith(region[len("/dev/shm/") :]) for n in os.listdir("/dev/shm"))
        proc.kill()
        proc.wait(timeout=10)
    deadline = time.monotonic() + 30
    while any(_ppid(w) is not None for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_ppid(w) is None for w in workers), "orphan workers still running"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nobody listens any more
    # the next master removes what the dead one left (remove_stale_state runs at its start)
    from kvgate.cli_serve import remove_stale_state

    removed = remove_stale_state()
    assert any(r.startswith(region) for r in removed)
    assert not any(n.startswith(region[len("/dev/shm/") :]) for n in os.listdir("/dev/shm"))


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[1])
