"""Generate the Python gRPC code in protos/servemesh_api from the .proto files beside it.

Run `python -m servemesh.dev.protogen` after editing a .proto; CI regenerates into a temporary
folder and fails when the committed code differs (tests/unit/test_generated_code.py).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parents[2] / "protos"
PACKAGE = "servemesh_api"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto below the generated package, relative to the include root."""
    return sorted(p.relative_to(proto_root) for p in (proto_root / PACKAGE).rglob("*.proto"))


def generate(out_root: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc for every proto into out_root; return the generated files, relative."""
    from grpc_tools import protoc  # only needed by developers, not at runtime

    include = Path(protoc.__file__).parent / "_proto"
    # google/api/annotations.proto and http.proto (the REST bindings Envoy's transcoder
    # reads), from googleapis-common-protos, which also holds their generated modules.
    import google.api.annotations_pb2 as annotations  # type: ignore[import-untyped]

    googleapis = Path(annotations.__file__).parents[2]
    files = [str(p) for p in proto_files(proto_root)]
    args = [
        "protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"-I{googleapis}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {files}")
    package_dirs = {out_root / PACKAGE} | {
        d for f in files for d in (out_root / f).parents if PACKAGE in d.parts
    }
    for folder in package_dirs:
        (folder / "__init__.py").touch()
    (out_root / PACKAGE / "py.typed").touch()
    return sorted(
        p.relative_to(out_root)
        for p in (out_root / PACKAGE).rglob("*")
        if p.is_file()
        and (p.name.endswith(GENERATED_SUFFIXES) or p.name in {"__init__.py", "py.typed"})
    )


def stale_files(proto_root: Path = PROTO_ROOT) -> list[str]:
    """Generated files that differ from, or are missing beside, their committed copies."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp), proto_root)
        stale = [
            str(rel)
            for rel in fresh
            if not (proto_root / rel).is_file()
            or (proto_root / rel).read_bytes() != (Path(tmp) / rel).read_bytes()
        ]
    committed = {
        p.relative_to(proto_root)
        for p in (proto_root / PACKAGE).rglob("*")
        if p.name.endswith(GENERATED_SUFFIXES)
    }
    stale += [f"{rel} (no .proto produces it)" for rel in sorted(committed - set(fresh))]
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: {name}", file=sys.stderr)
        return 1 if stale else 0
    with tempfile.TemporaryDirectory() as tmp:
        for rel in generate(Path(tmp)):
            (PROTO_ROOT / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(tmp) / rel, PROTO_ROOT / rel)
            print(f"wrote protos/{rel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
