"""Files copied with their sha256, and checked against it later: what the prediction log's
and the routes' parts of a backup are made of."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.digests import file_sha256
from servemesh.contract.errors import ServemeshError

PART_MANIFEST = "manifest.json"


class BackupDamaged(ServemeshError, ValueError):
    """A part of the backup does not verify; nothing was restored."""


@dataclass(frozen=True)
class CopiedFile:
    path: str  # relative to the part's folder
    bytes: int
    sha256: str


def copy_hashed(source: Path, part: Path, relative: str) -> CopiedFile:
    """Copy `source` to `part/relative` (owner-only), hashing what was written."""
    target = part / relative
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    shutil.copyfile(source, target)
    return hashed(part, relative)


def hashed(part: Path, relative: str) -> CopiedFile:
    """The file at `part/relative`, made owner-only, with its size and sha256."""
    target = part / relative
    os.chmod(target, 0o600)
    return CopiedFile(relative, target.stat().st_size, file_sha256(target))


def write_part_manifest(part: Path, files: list[CopiedFile], **summary: object) -> str:
    """The part's manifest (its files with their sha256, and `summary`); its own sha256."""
    body = json.dumps({**summary, "files": [asdict(f) for f in files]}, indent=1) + "\n"
    atomic_write_text(part / PART_MANIFEST, body)
    os.chmod(part / PART_MANIFEST, 0o600)
    return hashlib.sha256(body.encode()).hexdigest()


def verified_files(part: Path) -> tuple[dict[str, object], list[CopiedFile]]:
    """The part's manifest and its files, once every file matched its size and sha256;
    BackupDamaged naming each one that did not."""
    try:
        manifest = json.loads((part / PART_MANIFEST).read_text())
        files = [CopiedFile(**f) for f in manifest.pop("files")]
    except FileNotFoundError:
        raise BackupDamaged(f"{part}: no {PART_MANIFEST}") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise BackupDamaged(f"{part / PART_MANIFEST}: unreadable ({exc})") from None
    problems = []
    for entry in files:
        path = part / entry.path
        if ".." in Path(entry.path).parts or Path(entry.path).is_absolute():
            problems.append(f"{entry.path}: a path outside the backup")
        elif not path.is_file():
            problems.append(f"{entry.path}: missing")
        elif path.stat().st_size != entry.bytes or file_sha256(path) != entry.sha256:
            problems.append(f"{entry.path}: its sha256 is not the manifest's (changed or damaged)")
    if problems:
        raise BackupDamaged(f"{part}: " + "; ".join(problems))
    return manifest, files
