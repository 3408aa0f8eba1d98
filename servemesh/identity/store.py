"""Where the mesh keeps its CA and certificates, and how they are replaced.

Layout under `<state_dir>/tls/` (every directory 0700, every file 0600):

    ca/ca.pem, ca/ca.key      the mesh CA (the key never leaves this directory)
    trust.pem                 the CA certificates every hop trusts
    <identity>/gen-<n>/       cert.pem + key.pem of one issue
    <identity>/current        symlink to the live gen-<n>
    sds/<identity>.yaml       Envoy's SDS file for a certificate Envoy presents
    sds/trust.yaml            Envoy's SDS file for the trusted CAs

A rotation writes a new gen-<n+1>, then swaps `current` (and the SDS file naming the
files) by an atomic rename, so a reader sees the old pair or the new pair, never half of
each. Python servers read through `current` at every new handshake (see credentials);
Envoy re-reads an SDS file when it is renamed into place. Connections already open keep
the certificate they began with: a rotation interrupts nothing.

`share(identity, gid)` lets one group read one identity's pair (the model servers' own
user, servemesh.procs.sandbox): its folder and generations become 0750 and its files 0640,
that group's; a later issue of the identity is shared alike. The CA's key and every other
identity stay 0700/0600.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from servemesh.contract.atomic import atomic_write_bytes
from servemesh.contract.private import check_secret
from servemesh.identity.authority import (
    KeyPair,
    create_authority,
    issue_leaf,
    lifetime,
    time_left,
)

# Issue a new leaf at `up` when less than this share of its life is left.
RENEW_AT_FRACTION = 1 / 3
SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
TRUST_SECRET = "mesh-trust"


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def _share_generation(generation: Path, gid: int) -> None:
    os.chown(generation, -1, gid)
    os.chmod(generation, 0o750)
    for item in generation.iterdir():
        os.chown(item, -1, gid)
        os.chmod(item, 0o640)


@dataclass(frozen=True)
class LeafFiles:
    """The live certificate and key of one identity, resolved to one generation."""

    cert: Path
    key: Path

    def read(self) -> KeyPair:
        return KeyPair(self.cert.read_bytes(), self.key.read_bytes())


class MeshIdentity:
    """The CA and leaf certificates of one mesh, under `<state_dir>/tls`."""

    def __init__(
        self, state_dir: str | Path, mesh: str, sds_identities: frozenset[str] = frozenset()
    ) -> None:
        self.root = Path(state_dir) / "tls"
        self.mesh = mesh
        # The identities Envoy presents: only theirs get an SDS file.
        self.sds_identities = sds_identities

    # -- paths -----------------------------------------------------------------------------
    @property
    def ca_dir(self) -> Path:
        return self.root / "ca"

    @property
    def trust_file(self) -> Path:
        return self.root / "trust.pem"

    @property
    def sds_dir(self) -> Path:
        return self.root / "sds"

    def sds_file(self, secret: str) -> Path:
        return self.sds_dir / f"{secret}.yaml"

    def current(self, identity: str) -> Path:
        return self.root / identity / "current"

    def leaf(self, identity: str) -> LeafFiles:
        """The live pair of `identity`, resolved now (a later rotation does not move it)."""
        generation = self.root / identity / os.readlink(self.current(identity))
        return LeafFiles(generation / "cert.pem", generation / "key.pem")

    def exists(self, identity: str) -> bool:
        return self.current(identity).is_symlink()

    # -- the CA ----------------------------------------------------------------------------
    def authority(self) -> KeyPair:
        """The mesh CA, created on first use."""
        cert, key = self.ca_dir / "ca.pem", self.ca_dir / "ca.key"
        if cert.exists() and key.exists():
            check_secret(key)  # another user's, or readable by others: refused, not used
            return KeyPair(cert.read_bytes(), key.read_bytes())
        _private_dir(self.root)
        _private_dir(self.ca_dir)
        pair = create_authority(self.mesh)
        atomic_write_bytes(key, pair.key_pem, 0o600)
        atomic_write_bytes(cert, pair.cert_pem, 0o600)
        # A new CA: the bundle keeps the group and mode it was shared with, if any.
        atomic_write_bytes(self.trust_file, pair.cert_pem)
        return pair

    @property
    def ca_key_file(self) -> Path:
        return self.ca_dir / "ca.key"

    def trust_pem(self) -> bytes:
        return self.trust_file.read_bytes()

    # -- leaves ----------------------------------------------------------------------------
    def ensure(
        self, identities: Iterable[str], *, days: int, extra_names: dict[str, tuple[str, ...]]
    ) -> list[str]:
        """Issue a leaf for each identity that has none, whose names changed, or whose life
        is mostly spent; returns those issued."""
        authority = self.authority()
        issued = []
        for identity in identities:
            names = extra_names.get(identity, ())
            if self.exists(identity) and not self._needs_new(identity, names):
                continue
            pair = issue_leaf(authority, identity, self.mesh, days=days, extra_names=names)
            # The names go with it, so the next `ensure` sees them unchanged.
            self.install(identity, pair, names)
            issued.append(identity)
        self._write_trust_sds()
        return issued

    def _needs_new(self, identity: str, names: tuple[str, ...]) -> bool:
        pair = self.leaf(identity).read()
        if time_left(pair.cert_pem) < lifetime(pair.cert_pem) * RENEW_AT_FRACTION:
            return True
        meta = self.root / identity / os.readlink(self.current(identity)) / "names.json"
        recorded = json.loads(meta.read_text()) if meta.exists() else []
        return list(names) != recorded

    def rotate(self, identity: str, *, days: int, extra_names: tuple[str, ...] = ()) -> Path:
        """Issue `identity` a new leaf and make it live; returns its generation directory."""
        pair = issue_leaf(self.authority(), identity, self.mesh, days=days, extra_names=extra_names)
        return self.install(identity, pair, extra_names)

    def install(self, identity: str, pair: KeyPair, names: tuple[str, ...] = ()) -> Path:
        base = self.root / identity
        shared_with = self._shared_group(base)
        _private_dir(base) if shared_with is None else base.mkdir(parents=True, exist_ok=True)
        numbers = [int(p.name[4:]) for p in base.glob("gen-*") if p.name[4:].isdigit()]
        generation = _private_dir(base / f"gen-{max(numbers, default=0) + 1}")
        atomic_write_bytes(generation / "key.pem", pair.key_pem, 0o600)
        atomic_write_bytes(generation / "cert.pem", pair.cert_pem, 0o600)
        atomic_write_bytes(generation / "names.json", json.dumps(list(names)).encode(), 0o600)
        if shared_with is not None:
            _share_generation(generation, shared_with)
        link = base / f".current.{os.getpid()}.tmp"
        link.unlink(missing_ok=True)
        link.symlink_to(generation.name)
        os.replace(link, self.current(identity))
        if identity in self.sds_identities:
            self._write_leaf_sds(identity, generation)
        self._prune(base, keep={generation.name, f"gen-{max(numbers, default=0)}"})
        return generation

    @staticmethod
    def _shared_group(base: Path) -> int | None:
        """The group `base` (an identity's folder) is shared with, None when private."""
        try:
            info = os.stat(base)
        except FileNotFoundError:
            return None
        return info.st_gid if info.st_mode & stat.S_IRGRP else None

    def share(self, identity: str, gid: int) -> None:
        """Let group `gid` read `identity`'s live pair, and the pairs issued to it later
        (only that identity's: tls/ itself lets the group pass, not list)."""
        base = self.root / identity
        os.chown(base, -1, gid)
        os.chmod(base, 0o750)
        for generation in base.glob("gen-*"):
            _share_generation(generation, gid)

    @staticmethod
    def _prune(base: Path, keep: set[str]) -> None:
        # The generation before stays: a reader may have resolved `current` just before.
        for old in base.glob("gen-*"):
            if old.name not in keep:
                shutil.rmtree(old, ignore_errors=True)

    # -- Envoy's SDS files -----------------------------------------------------------------
    def _write_leaf_sds(self, identity: str, generation: Path) -> None:
        secret = {
            "@type": SECRET_TYPE,
            "name": identity,
            "tls_certificate": {
                "certificate_chain": {"filename": str((generation / "cert.pem").resolve())},
                "private_key": {"filename": str((generation / "key.pem").resolve())},
            },
        }
        self._write_sds(identity, secret)

    def _write_trust_sds(self) -> None:
        secret = {
            "@type": SECRET_TYPE,
            "name": TRUST_SECRET,
            "validation_context": {
                "trusted_ca": {"filename": str(self.trust_file.resolve())},
            },
        }
        self._write_sds(TRUST_SECRET, secret)

    def _write_sds(self, name: str, secret: Mapping[str, object]) -> None:
        _private_dir(self.sds_dir)
        # JSON is YAML: Envoy reads either, and json needs no dependency here.
        atomic_write_bytes(self.sds_file(name), json.dumps({"resources": [secret]}).encode(), 0o600)

    def expiry(self, identity: str) -> dt.datetime:
        return self.leaf(identity).read().certificate.not_valid_after_utc

    def identities(self) -> list[str]:
        """Every identity with a certificate here."""
        if not self.root.is_dir():
            return []
        return sorted(p.parent.name for p in self.root.glob("*/current") if p.is_symlink())
