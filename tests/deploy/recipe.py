"""Read the deployment recipe the way Docker and Kubernetes would, for the tests of this folder:
the Dockerfile's instructions per stage, and the Kubernetes manifests' documents."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
KUBERNETES = ROOT / "deploy" / "kubernetes"


@dataclass
class Stage:
    """One ``FROM`` stage: its base image, its name (``AS name``) and its instructions as
    ``(INSTRUCTION, arguments)`` in order."""

    image: str
    name: str | None
    steps: list[tuple[str, str]] = field(default_factory=list)

    def all(self, instruction: str) -> list[str]:
        return [args for ins, args in self.steps if ins == instruction]

    def last(self, instruction: str) -> str:
        found = self.all(instruction)
        assert found, f"no {instruction} in the stage FROM {self.image}"
        return found[-1]


def dockerfile_stages(path: Path = DOCKERFILE) -> list[Stage]:
    """The Dockerfile's stages (comments dropped, ``\\`` continuations joined)."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    stages: list[Stage] = []
    for line in lines:
        instruction, _, args = line.partition(" ")
        instruction, args = instruction.upper(), args.strip()
        if instruction == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        else:
            assert stages, f"{instruction} before FROM"
            stages[-1].steps.append((instruction, args))
    return stages


def exec_form(args: str) -> list[str]:
    """A ``CMD`` / ``ENTRYPOINT`` / ``HEALTHCHECK CMD`` argument in exec (JSON array) form:
    the command runs without a shell, so the program itself gets the signals (PID 1)."""
    value = json.loads(args)
    assert isinstance(value, list), f"not a JSON array: {args}"
    assert all(isinstance(v, str) for v in value)
    return value


def healthcheck_command(args: str) -> tuple[dict[str, str], list[str]]:
    """``HEALTHCHECK --opt=value ... CMD [...]`` → its options and its command."""
    head, _, command = args.partition("CMD ")
    options = dict(opt.removeprefix("--").split("=", 1) for opt in shlex.split(head))
    return options, exec_form(command)


def manifests(folder: Path = KUBERNETES) -> list[dict[str, Any]]:
    """Every YAML document of every ``*.yaml`` file under ``deploy/kubernetes/``."""
    docs = []
    for path in sorted(folder.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def manifest(kind: str, folder: Path = KUBERNETES, app: str = "kvgate") -> dict[str, Any]:
    """The one document of ``kind`` (``Deployment``, ``ConfigMap``, ...) of ``app`` (its
    ``app.kubernetes.io/name`` label: ``kvgate``, or ``kvgate-redis`` for the shared store)."""
    found = [
        d
        for d in manifests(folder)
        if d["kind"] == kind and d["metadata"]["labels"]["app.kubernetes.io/name"] == app
    ]
    assert len(found) == 1, f"{len(found)} {kind} documents of {app}"
    return found[0]


def config_map_file() -> tuple[str, str, str]:
    """``(mount path of the file in the container, file name, file text)`` of the kvgate
    configuration the Deployment mounts from the ConfigMap."""
    deployment = manifest("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    cm = manifest("ConfigMap")
    volume = next(
        v for v in pod["volumes"] if v.get("configMap", {}).get("name") == cm["metadata"]["name"]
    )
    container = pod["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert "subPath" not in mount  # a subPath mount never sees ConfigMap updates
    (name, text), *rest = cm["data"].items()
    assert not rest, "one file in the ConfigMap"
    return mount["mountPath"], name, text


def secret_env() -> dict[str, str]:
    """The environment the Deployment gives kvgate from the Secret: ``{variable: value}``."""
    secret = manifest("Secret")
    pod = manifest("Deployment")["spec"]["template"]["spec"]
    env = {}
    for var in pod["containers"][0].get("env", []):
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            assert ref["name"] == secret["metadata"]["name"], var
            env[var["name"]] = secret["stringData"][ref["key"]]
    return env
