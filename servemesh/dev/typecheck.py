"""Type-check servemesh, its tests and examples as Python imports them (`make typecheck`).

The repository is laid out by architecture, and pyproject maps its folders into one import
namespace (services/ is servemesh.services, registry/ is servemesh.registry, chaos/ is
servemesh.chaos, protos/servemesh_api is servemesh_api). mypy follows neither that mapping
nor the editable install's import hook, so this lays the same tree out with symlinks in a
temporary folder and runs mypy there, with pyproject's [tool.mypy] settings. Errors name
the package path (servemesh/services/model/...), which is the import path. tests/ and examples/
are checked in the same run, as the packages `tests` and `examples` (pyproject relaxes the
annotation rules there, not the checking of bodies).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from mypy import api

REPO = Path(__file__).resolve().parents[2]
# Import package -> folder in the repository, as pyproject's package-dir says.
REMAPPED = {"services": "services", "registry": "registry", "chaos": "chaos"}
# Checked alongside the package, under their own names.
ALONGSIDE = ("tests", "examples")


def lay_out(root: Path) -> None:
    """servemesh/ and servemesh_api/ under root, arranged as the installed package, with tests/
    and examples/ beside them."""
    package = root / "servemesh"
    package.mkdir()
    for entry in (REPO / "servemesh").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in REMAPPED.items():
        (package / name).symlink_to(REPO / folder)
    (root / "servemesh_api").symlink_to(REPO / "protos" / "servemesh_api")
    for name in ALONGSIDE:
        (root / name).symlink_to(REPO / name)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="servemesh-typecheck-") as tmp:
        root = Path(tmp)
        lay_out(root)
        os.chdir(root)
        stdout, stderr, status = api.run(
            [
                "--config-file", str(REPO / "pyproject.toml"),
                "--cache-dir", str(REPO / ".mypy_cache"),
                "--python-executable", sys.executable,
                "-p", "servemesh",
                *(arg for name in ALONGSIDE for arg in ("-p", name)),
            ]
        )  # fmt: skip
    sys.stdout.write(stdout)
    sys.stderr.write(stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
