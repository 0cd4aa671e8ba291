"""The Kubernetes example (deploy/kubernetes/) and the Dockerfile: the manifests validate
against Kubernetes' own schemas (kubernetes-validate ships them offline), and the pieces fit
together — the image's command reads the file the ConfigMap mounts, the probes and the
HEALTHCHECK hit the port that file listens on, the Secret fills every variable it needs, and
the grace periods nest. Running the recipe for real is tests/deploy/test_install.py."""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from kvgate.config import parse_config
from kvgate.gateway_build import check_startup

from .recipe import (
    config_map_file,
    dockerfile_stages,
    exec_form,
    healthcheck_command,
    manifest,
    manifests,
    secret_env,
)


def _flag(cmd: list[str], name: str) -> str:
    assert name in cmd, f"{name} not in {cmd}"
    return cmd[cmd.index(name) + 1]


def test_every_manifest_validates_against_the_kubernetes_schemas() -> None:
    docs = manifests()
    kinds = sorted((d["metadata"]["labels"]["app.kubernetes.io/name"], d["kind"]) for d in docs)
    assert kinds == [
        ("kvgate", "ConfigMap"),
        ("kvgate", "Deployment"),
        ("kvgate", "Secret"),
        ("kvgate", "Service"),
        ("kvgate-redis", "Deployment"),
        ("kvgate-redis", "Service"),
    ]
    for doc in docs:
        # strict: an unknown or misspelt field is an error, not silently ignored
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_a_misspelt_field_is_caught_by_the_validator() -> None:
    doc = manifest("Deployment")
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = doc["spec"]["template"][
        "spec"
    ]["containers"][0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_configmap_file_is_a_valid_configuration_with_the_secret() -> None:
    _, _, text = config_map_file()
    env = secret_env()
    cfg = parse_config(yaml.safe_load(text), env=env, source="configmap")
    assert check_startup(cfg) is None  # what `kvgate check-config` runs
    # the engine's key comes from the Secret, by name
    for backend in cfg.backends:
        if backend.api_key_env is not None:
            assert backend.api_key == env[backend.api_key_env]
    # every ${VAR} of the file is given by the Deployment (no silent default)
    assert set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", text)) <= set(env)
    assert cfg.tenants
    assert all(t.api_key_sha256 for t in cfg.tenants)


def test_deployment_probes_drain_and_config_match_the_image() -> None:
    final = dockerfile_stages()[-1]
    cmd = exec_form(final.last("CMD"))
    grace = float(_flag(cmd, "--grace"))
    config_path = PurePosixPath(_flag(cmd, "--config"))
    mount, name, text = config_map_file()
    assert PurePosixPath(mount) / name == config_path
    port = yaml.safe_load(text)["listen"]["port"]
    assert yaml.safe_load(text)["listen"]["host"] == "0.0.0.0"

    deployment = manifest("Deployment")
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "command" not in container
    assert "args" not in container
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == port
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # Kubernetes counts the preStop hook and the SIGTERM drain against the grace period
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + grace
    assert pod["securityContext"]["runAsNonRoot"] is True
    # the non-root user and group of the pod are the image's
    user, group = final.last("USER").split(":")
    assert str(pod["securityContext"]["runAsUser"]) == user
    assert str(pod["securityContext"]["runAsGroup"]) == group

    service = manifest("Service")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_the_dockerfile_is_multi_stage_non_root_and_checks_readyz() -> None:
    build, final = dockerfile_stages()
    assert build.name is not None
    # the wheel is built in the first stage and only the wheel reaches the runtime
    assert any("maturin build --release" in run for run in build.all("RUN"))
    assert final.all("COPY") == [f"--from={build.name} /wheels /wheels"]
    assert "slim" in final.image
    user = final.last("USER").split(":")[0]
    assert user not in ("root", "0")
    assert any(f"--uid {user}" in run for run in final.all("RUN"))  # the user exists
    _, _, text = config_map_file()
    port = yaml.safe_load(text)["listen"]["port"]
    assert final.last("EXPOSE") == str(port)
    options, check = healthcheck_command(final.last("HEALTHCHECK"))
    assert f"http://127.0.0.1:{port}/readyz" in " ".join(check)
    assert float(options["timeout"].rstrip("s")) < float(options["interval"].rstrip("s"))
    cmd = exec_form(final.last("CMD"))  # exec form: kvgate is PID 1 and gets SIGTERM itself
    assert cmd[:2] == ["kvgate", "serve"]
    assert not final.all("ENTRYPOINT")
    assert final.last("STOPSIGNAL") == "SIGTERM"


def test_the_replicas_share_their_limits_through_the_redis_of_the_example() -> None:
    """The ConfigMap's ``store.url`` names the Redis Service and its port; that Service selects
    the Redis pod, which runs without eviction and with its append-only file."""
    _, _, text = config_map_file()
    cfg = parse_config(yaml.safe_load(text), env=secret_env(), source="configmap")
    assert cfg.store is not None
    url = urlsplit(cfg.store.url)
    service = manifest("Service", app="kvgate-redis")
    assert url.scheme == "redis"
    assert url.hostname == service["metadata"]["name"]
    (port,) = service["spec"]["ports"]
    assert url.port == port["port"]
    deployment = manifest("Deployment", app="kvgate-redis")
    assert deployment["spec"]["replicas"] == 1
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[port["targetPort"]] == 6379
    args = container["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--appendonly") + 1] == "yes"
    # Redis Functions (kvgate's store) need Redis 7.0 or later
    major = int(container["image"].split(":")[1].split(".")[0])
    assert major >= 7
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/data")
    assert any(v["name"] == mount["name"] for v in pod["volumes"])
    assert manifest("Deployment")["spec"]["replicas"] == 3
    # the image installs the Redis client the store needs
    (install,) = [r for r in dockerfile_stages()[-1].all("RUN") if "pip install" in r]
    assert re.search(r"\.whl\)?\[[a-z,]*redis[a-z,]*\]", install), install
