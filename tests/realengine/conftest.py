"""Fixtures of the real-engine suite: llama.cpp's ``llama-server`` (or ``kvgate sim``) on
127.0.0.1 with a generated model, and ``kvgate serve --upstream URL`` in front of it with no
other setting than the tokenizer.

The ``llama-server`` binary comes from ``scripts/build-llama-server.sh`` (built once from the
llama-cpp-python sdist and cached under ``~/.cache/kvgate/llama-server/<version>/``; ``make
test`` builds it before pytest runs). ``KVGATE_LLAMA_SERVER`` names another binary. A binary
that cannot be built or found fails the suite: it is never skipped.

Every engine runs as a child process with a generous start-up bound; the suite polls for
conditions, never sleeps a fixed time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from realengine.make_model import CHAT_TEMPLATE, SLOW, write_model

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "build-llama-server.sh"
#: llama-server slots (``-np``) and total context (``-c``): 1,024 tokens per slot.
SLOTS = 4
CTX = 4096
SLOT_CTX = CTX // SLOTS
STARTUP_S = 120.0


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def until(pred: Callable[[], Any], timeout: float, interval: float = 0.01) -> Any:
    """Poll ``pred`` until it returns a truthy value (returned); fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """``(status, body)`` of ``GET url``; raises ``OSError`` when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _get_ok(url: str) -> bool:
    try:
        return http_get(url, timeout=2.0)[0] == 200
    except OSError:
        return False


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL after a bounded wait."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


@pytest.fixture(scope="session")
def llama_server_bin() -> str:
    """Path of the ``llama-server`` binary (built and cached by the build script)."""
    given = os.environ.get("KVGATE_LLAMA_SERVER")
    if given:
        if not os.access(given, os.X_OK):
            pytest.fail(f"KVGATE_LLAMA_SERVER={given} is not an executable file")
        return given
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=3600, check=False
    )
    if done.returncode != 0:
        pytest.fail(
            f"cannot build llama-server ({BUILD_SCRIPT}, exit {done.returncode}):\n"
            f"{done.stderr[-4000:]}"
        )
    path = done.stdout.strip().splitlines()[-1]
    assert os.access(path, os.X_OK), path
    return path


@pytest.fixture(scope="session")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """``(gguf, tokenizer.json, chat template file)`` of the larger random model: about 100 M
    parameters, so a stream keeps a slot busy for seconds (deterministic, seed 0)."""
    out = tmp_path_factory.mktemp("model")
    gguf, tok = write_model(out, SLOW, seed=0, name="slow")
    template = out / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE, encoding="utf-8")
    return gguf, tok, template


@dataclass
class Engine:
    """An engine on 127.0.0.1: ``kind`` is ``llama-server`` or ``sim``."""

    kind: str
    url: str
    proc: subprocess.Popen[Any]
    log: Path
    #: the engine's counter of generated tokens and prompt tokens (Prometheus names)
    generated_metric: str = ""
    prompt_metric: str = ""

    def slots(self) -> list[dict[str, Any]]:
        """``GET /slots``."""
        status, body = http_get(self.url + "/slots")
        assert status == 200, (status, body[:200])
        data: list[dict[str, Any]] = json.loads(body)
        return data

    def busy_slots(self) -> int:
        """Slots with ``is_processing`` true."""
        return sum(1 for s in self.slots() if s["is_processing"])

    def decoded(self) -> int:
        """The most tokens a busy slot has generated so far (``next_token[0].n_decoded``)."""
        return max(
            (s["next_token"][0]["n_decoded"] for s in self.slots() if s["is_processing"]),
            default=0,
        )

    def metric(self, name: str) -> float:
        """Sum of the samples of ``name`` in ``GET /metrics``."""
        return _metric_sum(http_get(self.url + "/metrics")[1].decode(), name)


def _start_llama(binary: str, gguf: Path, tmp: Path) -> Engine:
    port = free_port()
    log = tmp / "llama-server.log"
    cmd = [
        binary,
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(SLOTS),
        "-c",
        str(CTX),
        "-t",
        "2",
        "--metrics",
        "--slots",
        "--no-webui",
        "--alias",
        "slow",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    return Engine(
        "llama-server",
        url,
        proc,
        log,
        generated_metric="llamacpp:tokens_predicted_total",
        prompt_metric="llamacpp:prompt_tokens_total",
    )


def _start_sim(tok: Path, template: Path, tmp: Path) -> Engine:
    port = free_port()
    log = tmp / "sim.log"
    cmd = [
        sys.executable,
        "-m",
        "kvgate",
        "sim",
        "--port",
        str(port),
        "--model",
        "slow",
        "--max-num-seqs",
        str(SLOTS),
        "--context-window",
        str(SLOT_CTX),
        "--kv-blocks",
        str(CTX // 16),
        "--block-size",
        "16",
        "--tokenizer",
        str(tok),
        "--chat-template",
        str(template),
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return Engine(
        "sim",
        f"http://127.0.0.1:{port}",
        proc,
        log,
        generated_metric="vllm:generation_tokens_total",
        prompt_metric="vllm:prompt_tokens_total",
    )


@pytest.fixture(scope="module", params=["llama-server", "sim"])
def engine(
    request: pytest.FixtureRequest,
    model_files: tuple[Path, Path, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Engine]:
    """The engine under test, up (``GET /health`` 200), with 4 slots of 1,024 tokens."""
    gguf, tok, template = model_files
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "llama-server":
        eng = _start_llama(request.getfixturevalue("llama_server_bin"), gguf, tmp)
    else:
        eng = _start_sim(tok, template, tmp)
    try:
        until(lambda: eng.proc.poll() is not None or _get_ok(eng.url + "/health"), STARTUP_S, 0.05)
        if eng.proc.poll() is not None:
            pytest.fail(f"{eng.kind} exited {eng.proc.returncode}: {eng.log.read_text()[-3000:]}")
        yield eng
    finally:
        _stop(eng.proc)


@dataclass
class Gateway:
    """``kvgate serve --upstream`` in front of :class:`Engine`."""

    url: str
    proc: subprocess.Popen[Any]
    stdout: Path

    @property
    def base_url(self) -> str:
        """For an OpenAI client."""
        return self.url + "/v1"

    def state(self) -> dict[str, Any]:
        """``GET /admin/state``, the one backend."""
        status, body = http_get(self.url + "/admin/state")
        assert status == 200, (status, body[:200])
        backend: dict[str, Any] = json.loads(body)["backends"][0]
        return backend

    def metric(self, name: str) -> float:
        """Sum of the samples of ``name`` in kvgate's ``GET /metrics``."""
        return _metric_sum(http_get(self.url + "/metrics")[1].decode(), name)


@pytest.fixture(scope="module")
def gateway(
    engine: Engine, model_files: tuple[Path, Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """``kvgate serve --upstream URL --tokenizer tokenizer.json``: everything else discovered."""
    _, tok, _ = model_files
    port = free_port()
    out = tmp_path_factory.mktemp("kvgate") / "stdout.txt"
    cmd = [
        sys.executable,
        "-m",
        "kvgate",
        "serve",
        "--upstream",
        engine.url,
        "--port",
        str(port),
        "--tokenizer",
        str(tok),
    ]
    with out.open("wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    gw = Gateway(f"http://127.0.0.1:{port}", proc, out)
    try:
        until(lambda: proc.poll() is not None or _get_ok(gw.url + "/readyz"), STARTUP_S, 0.05)
        if proc.poll() is not None:
            pytest.fail(f"kvgate exited {proc.returncode}: {out.read_text()[-3000:]}")
        yield gw
    finally:
        _stop(proc)
