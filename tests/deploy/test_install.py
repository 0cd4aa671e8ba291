"""The wheel installs and runs on its own, the way the Dockerfile builds and runs it.

One test, outside Docker (no base image can be pulled here): build the wheel with maturin (as
the Dockerfile's build stage does), run the runtime stage's ``RUN pip install`` line in a fresh
virtual environment, start ``kvgate sim`` and then the Dockerfile's ``CMD`` — both from that
environment — with the configuration the Kubernetes ConfigMap carries (its backend pointed at
the simulator, its listen address at 127.0.0.1, its ``store`` at a ``redis-server`` on
loopback) and the Secret's variables; then the
HEALTHCHECK command, one chat request with the official ``openai`` client, and a SIGTERM
during a stream: the stream finishes (drain) and kvgate exits 0.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from tests.store.redis_servers import require_redis, start_redis

from .recipe import (
    ROOT,
    config_map_file,
    dockerfile_stages,
    exec_form,
    healthcheck_command,
    secret_env,
)

# The wheel is built in a target folder of its own: `maturin develop` (make build) and
# `maturin build` fingerprint the crate differently, so sharing target/release would rebuild it
# at every alternation; this folder makes the test's build incremental from its second run.
WHEEL_TARGET = ROOT / "target" / "wheel-test"
CLIENT_KEY = "sk-install-test"


def _run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done


def _clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment without this test run's virtual environment or source tree on it."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME") and not k.startswith("PROMETHEUS_")
    }
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p
    )
    env.update(extra or {})
    return env


def _wait_line(proc: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    """The first stdout line of ``proc`` that starts with ``prefix`` (bounded wait)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise AssertionError(f"{proc.args} exited {proc.returncode} before {prefix!r}")
            time.sleep(0.05)
            continue
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"no {prefix!r} line within {timeout} s")


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A ``redis-server`` on loopback for the ConfigMap's ``store`` (the Redis of
    deploy/kubernetes/redis.yaml), as its URL; skipped without one outside CI."""
    require_redis()
    with start_redis(tmp_path / "redis") as server:
        yield f"redis://127.0.0.1:{server.port}/0"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_wheel_installs_and_serves_as_the_dockerfile_runs_it(
    tmp_path: Path, redis_url: str
) -> None:
    build, final = dockerfile_stages()

    # 1. the build stage: `maturin build --release`
    (build_run,) = [r for r in build.all("RUN") if "maturin build" in r]
    assert "--release" in build_run
    wheels = tmp_path / "wheels"
    maturin = Path(sys.executable).parent / "maturin"
    _run(
        [str(maturin), "build", "--release", "-q", "--out", str(wheels)],
        cwd=ROOT,
        timeout=1500,
        env={**os.environ, "CARGO_TARGET_DIR": str(WHEEL_TARGET)},
    )
    (wheel,) = wheels.glob("kvgate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    # what a non-editable install needs beside the .py files: the extension, its stubs, the
    # PEP 561 marker, the simulator's notes, the dashboard's page
    assert any(re.fullmatch(r"kvgate/_core\..*\.so", n) for n in names), names
    for needed in (
        "kvgate/py.typed",
        "kvgate/_core.pyi",
        "kvgate/sim/README.md",
        "kvgate/dashboard/index.html",
        "kvgate/dashboard/dashboard.css",
        "kvgate/dashboard/dashboard.js",
    ):
        assert needed in names

    # 2. the runtime stage's `pip install`, run in a fresh virtual environment
    venv = tmp_path / "venv"
    # the interpreter this test runs on, outside its virtual environment: the wheel is built
    # for its version
    python3 = Path(sys.base_prefix) / "bin" / "python3"
    _run([str(python3), "-m", "venv", str(venv)], env=_clean_env(), timeout=300)
    bin_dir = venv / "bin"
    env = _clean_env({"PATH": f"{bin_dir}{os.pathsep}{_clean_env()['PATH']}"})
    (install,) = [r for r in final.all("RUN") if "pip install" in r]
    step = install.replace("/wheels", str(wheels))
    _run(["bash", "-c", step], env=env, cwd=tmp_path, timeout=600)
    kvgate = bin_dir / "kvgate"
    assert kvgate.is_file()
    # the installed package, not the source tree, is what runs
    where = _run(
        [str(bin_dir / "python"), "-c", "import kvgate; print(kvgate.__file__)"],
        env=env,
        cwd=tmp_path,
    ).stdout
    assert where.startswith(str(venv)), where

    # 3. the configuration the ConfigMap mounts, pointed at a simulator, with the Secret's env
    _, _, text = config_map_file()
    data = yaml.safe_load(text)
    secret = secret_env()
    tenant = data["tenants"][0]
    (ref,) = re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", tenant["api_key_sha256"][0])
    secret[ref] = hashlib.sha256(CLIENT_KEY.encode()).hexdigest()  # a key this test knows
    backend = data["backends"][0]
    model = backend["models"][0]["name"]

    sim = subprocess.Popen(
        [str(kvgate), "sim", "--profile", "tiny", "--port", "0", "--model", model],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        banner = _wait_line(sim, "kvgate sim:", 60)
        found = re.search(r"on (http://\S+)", banner)
        assert found is not None, banner
        backend["url"] = found.group(1)
        data["listen"] = {"host": "127.0.0.1", "port": 0}
        assert data["store"]["url"].startswith("redis://")
        data["store"]["url"] = redis_url  # the replicas' shared Redis, here on loopback
        config = tmp_path / "kvgate.yaml"
        config.write_text(yaml.safe_dump(data))

        # 4. the image's CMD, exactly, but for the file's path in the container
        cmd = exec_form(final.last("CMD"))
        assert cmd[0] == "kvgate"
        cmd = [str(kvgate), *cmd[1:]]
        cmd[cmd.index("--config") + 1] = str(config)
        log = tmp_path / "kvgate.log"
        with log.open("w") as log_file:  # the child keeps its own copy of the descriptor
            gateway = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=log_file,
                text=True,
                env={**env, **secret},
                cwd=tmp_path,
            )
        try:
            url = _wait_line(gateway, "kvgate: serving on", 60).split()[-1]
            host_port = url.removeprefix("http://")

            # 5. the HEALTHCHECK: exits 0 once /readyz answers 200
            _, check = healthcheck_command(final.last("HEALTHCHECK"))
            check = [
                str(bin_dir / "python") if a == "python" else a.replace("127.0.0.1:8080", host_port)
                for a in check
            ]
            deadline = time.monotonic() + 60
            while subprocess.run(check, env=env, capture_output=True, check=False).returncode:
                assert time.monotonic() < deadline, "/readyz never answered 200"
                time.sleep(0.2)

            # the dashboard's files come from the installed package
            for name in ("dashboard.js", "dashboard.css"):
                with urllib.request.urlopen(f"{url}/dashboard/{name}", timeout=10) as resp:
                    assert resp.status == 200
                    served = resp.read()
                assert served == (Path(where.strip()).parent / "dashboard" / name).read_bytes()

            # 6. one chat request, then SIGTERM while a stream runs: the stream finishes
            with openai.OpenAI(base_url=url + "/v1", api_key=CLIENT_KEY, max_retries=0) as client:
                answer = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8
                )
                assert answer.choices[0].message.content
                assert answer.usage is not None
                assert answer.usage.completion_tokens >= 1
                stream = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "a long answer"}],
                    max_tokens=64,
                    stream=True,
                    extra_body={"ignore_eos": True},  # exactly 64 tokens (~1.3 s on `tiny`)
                )
                chunks = iter(stream)
                first = next(chunks)
                assert first.choices
                gateway.send_signal(signal.SIGTERM)
                rest = list(chunks)
            finish = [c.choices[0].finish_reason for c in rest if c.choices]
            assert finish[-1] == "length", finish
            assert len(rest) >= 2  # chunks kept coming after SIGTERM
            assert gateway.wait(timeout=60) == 0
            assert "Traceback" not in log.read_text()
        finally:
            if gateway.poll() is None:
                gateway.kill()
                gateway.wait(timeout=30)
            assert gateway.stdout is not None
            gateway.stdout.close()
    finally:
        sim.send_signal(signal.SIGTERM)
        try:
            sim.wait(timeout=30)
        except subprocess.TimeoutExpired:
            sim.kill()
            sim.wait(timeout=30)
        assert sim.stdout is not None
        sim.stdout.close()
