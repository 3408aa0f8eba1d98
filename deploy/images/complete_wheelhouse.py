"""Adds to a wheelhouse the wheels the image's Python needs and this machine's did not.

`pip wheel` evaluates environment markers against the Python it runs on: a wheelhouse made
with Python 3.11.7 lacks `async-timeout` (redis-py needs it below 3.11.3), which Debian
bookworm's Python 3.11.2 installs. This reads every wheel's requirements, evaluates their
markers for the image's Python, and has this machine's pip fetch what is missing, until
nothing is:

    python deploy/images/complete_wheelhouse.py build/images/service/deps --python 3.11.2
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename


def _requirements(wheel: Path) -> list[Requirement]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = HeaderParser().parsestr(archive.read(name).decode())
    return [Requirement(line) for line in metadata.get_all("Requires-Dist") or []]


def missing(wheelhouse: Path, python: str, roots: list[Requirement]) -> list[Requirement]:
    """What the image's Python would install and the wheelhouse has no wheel of."""
    env: dict[str, str] = dict(default_environment())
    env["python_full_version"] = python
    env["python_version"] = ".".join(python.split(".")[:2])
    wheels = {parse_wheel_filename(w.name)[0]: w for w in wheelhouse.glob("*.whl")}
    needed: dict[str, Requirement] = {}
    todo = list(roots)
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate(env)):
            continue
        seen.add(name)
        wheel = wheels.get(name)
        if wheel is None:
            needed[name] = req
            continue
        for extra in req.extras or {""}:
            for sub in _requirements(wheel):
                if sub.marker is None or sub.marker.evaluate({**env, "extra": extra}):
                    todo.append(sub)
    return list(needed.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheelhouse", type=Path, help="holds the wheels and requirements.txt")
    parser.add_argument("--python", required=True, help="the image's Python, e.g. 3.11.2")
    args = parser.parse_args()
    lines = (args.wheelhouse / "requirements.txt").read_text().splitlines()
    roots = [Requirement(line) for line in lines if line.strip()]
    for _ in range(5):
        wanted = missing(args.wheelhouse, args.python, roots)
        if not wanted:
            return 0
        names = [str(req).split(";")[0] for req in wanted]
        print(f"for Python {args.python}: {' '.join(names)}")
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(args.wheelhouse)]
            + names,
            check=True,
        )
    print("error: the wheelhouse is still incomplete after five rounds", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
