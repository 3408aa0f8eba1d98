"""The images `make images` builds, started for real: each runs its part, as a user not root.

Marked `containers` (tests/conftest.py): `make test` runs them after the other tests, on
their own (a cold build takes minutes), and `make test-containers` alone. Without a Docker
engine they are skipped, saying why.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TAG = os.environ.get("IMAGE_TAG", "dev")
SERVICE = f"servemesh-service:{TAG}"
MODEL = f"servemesh-model:{TAG}"
ENVOY = f"servemesh-envoy:{TAG}"
REDIS = f"servemesh-redis:{TAG}"
PROMETHEUS = f"servemesh-prometheus:{TAG}"

# A cold `make images` (base, wheelhouse, five builds) takes minutes; a warm one seconds.
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(autouse=True)
def _built(images: str) -> None:
    """Every test here runs the images `make images` builds (tests/containers/conftest.py)."""


def run(image: str, *argv: str, entrypoint: str | None = None) -> str:
    """What a fresh container of `image` prints for `argv`, on a network of its own."""
    cmd = ["docker", "run", "--rm", "--network", "none"]
    if entrypoint is not None:
        cmd += ["--entrypoint", entrypoint]
    done = subprocess.run(
        [*cmd, image, *argv], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"{image} {argv}: {done.stdout}{done.stderr}"
    return done.stdout + done.stderr


@pytest.mark.parametrize(
    "module",
    [
        "servemesh.services.gateway",
        "servemesh.services.feature",
        "servemesh.registry",
        "servemesh.tracestore",
        "servemesh.discovery",
    ],
)
def test_the_service_image_starts_each_service_it_carries(module: str) -> None:
    assert "usage:" in run(SERVICE, "python", "-m", module, "--help")


def test_the_service_image_runs_the_command_line_and_the_seed() -> None:
    assert "compose" in run(SERVICE, "servemesh", "--help")
    assert "seed" in run(SERVICE, "servemesh", "compose", "--help")


def test_the_service_image_has_no_torch_and_the_model_image_has_the_cpu_build() -> None:
    probe = "import importlib.util as u; print(u.find_spec('torch') is not None)"
    assert run(SERVICE, "python", "-c", probe).strip() == "False"
    version = run(MODEL, "python", "-c", "import torch; print(torch.__version__)").strip()
    assert version == "2.13.0+cpu"


def test_the_model_image_starts_the_model_server_and_its_sandboxed_child_finds_torch() -> None:
    assert "usage:" in run(MODEL, "python", "-m", "servemesh.services.model", "--help")
    # The sandboxed model child runs Python isolated (-I): torch must be in the venv itself.
    assert run(MODEL, "python", "-I", "-c", "import torch, numpy; print('ok')").strip() == "ok"


def test_the_envoy_image_runs_the_wheel_s_envoy() -> None:
    assert "/1.40.0/" in run(ENVOY)
    assert "/1.40.0/" in run(ENVOY, "--version")


def test_redis_and_prometheus_images_run_debian_s_builds() -> None:
    assert "Redis server v=7." in run(REDIS, "redis-server", "--version")
    assert "prometheus, version 2." in run(PROMETHEUS, "--version")
    assert "promtool, version 2." in run(PROMETHEUS, "--version", entrypoint="promtool")


@pytest.mark.parametrize("image", [SERVICE, MODEL, ENVOY, REDIS, PROMETHEUS])
def test_every_image_runs_as_a_user_not_root(image: str) -> None:
    uid = run(image, "-u", entrypoint="id").strip()
    assert uid != "0", f"{image} runs as root"
