"""What the container lane's modules share: the images, built once per session.

The lane's modules run in the order the suite's groups give them, not by file name, so
each module that starts containers asks for the images itself (`make images`: a cold
build takes minutes, a warm one seconds, every step cached)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.containers.drive import engine_missing

REPO = Path(__file__).resolve().parents[2]
TAG = os.environ.get("IMAGE_TAG", "dev")


@pytest.fixture(scope="session")
def images() -> str:
    """Builds the images, or reuses them when nothing changed; their tag."""
    reason = engine_missing()
    if reason is not None:
        pytest.skip(reason)
    built = subprocess.run(
        ["make", "images", f"IMAGE_TAG={TAG}"], cwd=REPO, capture_output=True, text=True
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return TAG
