"""Issuing the mesh's certificates: all at once when a mesh starts, one on first use.

`servemesh up` issues every identity before any process starts (and renews those whose
life runs low). A process started on its own (a replica under test, a bench's server, a
tool run against a state dir) gets its identity issued on first use instead, so nothing
dials or serves without one. Several processes may issue at once: they take turns.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager

from servemesh.contract.private import open_lock
from servemesh.identity.store import MeshIdentity
from servemesh.spec import TRACE_STORE_PART, MeshSpec, ResolvedSpec, registry_mirror_name

ENVOY_IDENTITY = "envoy"
EDGE_IDENTITY = "edge"
# Tools run by the mesh's operator (the CLI, drills, benches, tests) present this identity.
OPERATOR_IDENTITY = "operator"
# The echo server a benchmark runs over mutual TLS beside a mesh (bench predict --tls-cost).
BENCH_ECHO_IDENTITY = "bench-echo"
# The embedded trace store (an OTLP receiver every service and Envoy export spans to).
TRACE_STORE_IDENTITY = TRACE_STORE_PART


def mesh_identity(spec: MeshSpec) -> MeshIdentity:
    return MeshIdentity(
        spec.state_dir, spec.name, sds_identities=frozenset({ENVOY_IDENTITY, EDGE_IDENTITY})
    )


@contextmanager
def issuing(identity: MeshIdentity) -> Iterator[None]:
    identity.root.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open_lock(identity.root / ".issue.lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def edge_names(spec: MeshSpec) -> dict[str, tuple[str, ...]]:
    return {EDGE_IDENTITY: tuple(spec.tls.edge_names)}


def mesh_identities(spec: ResolvedSpec) -> list[str]:
    """Every identity a running mesh needs a certificate for."""
    found = [*(i.name for i in spec.instances()), ENVOY_IDENTITY, EDGE_IDENTITY, OPERATOR_IDENTITY]
    if spec.embedded_trace_store_port is not None:
        found.append(TRACE_STORE_IDENTITY)
    found += [registry_mirror_name(zone) for zone in spec.registry_mirror_zones()]
    return found


def issue_mesh_certificates(spec: ResolvedSpec) -> list[str]:
    """Create the CA if there is none and issue every identity that lacks a good certificate;
    returns the identities issued."""
    identity = mesh_identity(spec)
    with issuing(identity):
        return identity.ensure(
            mesh_identities(spec), days=spec.tls.leaf_days, extra_names=edge_names(spec)
        )


def enrolled(spec: MeshSpec, name: str | None) -> MeshIdentity:
    """The mesh's identities, with `name` issued if it has no certificate yet (None: only
    the CA, for a client that presents no certificate)."""
    identity = mesh_identity(spec)
    if (name is None and identity.trust_file.exists()) or (name and identity.exists(name)):
        return identity
    with issuing(identity):
        identity.ensure(
            [name] if name else [], days=spec.tls.leaf_days, extra_names=edge_names(spec)
        )
    return identity
