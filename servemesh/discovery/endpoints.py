"""From a catalog's instances to Envoy's endpoint (EDS) files: a pure translation, and the
atomic write of the files that changed.

The shape is the renderer's (`load_assignment`: one locality per zone, the caller's zone at
priority 0 and the others at 1) and the files are the ones `xds_files` names: the control
plane only replaces what the spec alone put in them, the instances' addresses.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from servemesh.catalog.file import CatalogEntry
from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.yaml_text import dump_yaml
from servemesh.proxy.render import EnvoyResources, ZoneEndpoint, load_assignment, xds_files
from servemesh.state.paths import XdsLayout


def load_assignments(
    resources: EnvoyResources, entries: Iterable[CatalogEntry]
) -> dict[str, dict[str, Any]]:
    """Every cluster's endpoints: for a cluster of service instances, the passing entries of
    its kind; any other cluster (the trace collector) as the renderer left it."""
    by_kind: dict[str, list[CatalogEntry]] = {}
    for entry in sorted(set(entries)):
        if entry.passing:
            by_kind.setdefault(entry.kind, []).append(entry)
    assignments = dict(resources.load_assignments)
    for name, members in resources.endpoint_sets.items():
        found = by_kind.get(members.kind, [])
        assignments[name] = load_assignment(
            name, (ZoneEndpoint(e.zone, e.address, e.port) for e in found), members.local_zone
        )
    return assignments


def _version(resources: list[dict[str, Any]]) -> str:
    # Of the content itself: the same endpoints keep the same version, across restarts of
    # the control plane too, so an unchanged file is never rewritten.
    text = json.dumps(resources, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def endpoint_files(
    resources: EnvoyResources, layout: XdsLayout, entries: Sequence[CatalogEntry]
) -> dict[Path, dict[str, Any]]:
    """The content of every endpoint file, by path, for the catalog's `entries`; each
    file's version is a digest of its endpoints."""
    with_catalog = replace(resources, load_assignments=load_assignments(resources, entries))
    files = {}
    for path, content in xds_files(with_catalog, layout, "").items():
        if path.parent != layout.eds(".").parent:
            continue  # routes and clusters are the spec's, written once by whoever renders it
        files[path] = {**content, "version_info": _version(content["resources"])}
    return files


def write_endpoint_files(files: dict[Path, dict[str, Any]]) -> list[Path]:
    """Rename each file whose content changed into place (Envoy notices only a rename);
    returns those written."""
    written = []
    for path, content in sorted(files.items()):
        text = dump_yaml(content)
        try:
            if path.read_text() == text:
                continue
        except FileNotFoundError:
            pass
        atomic_write_text(path, text)
        written.append(path)
    return written
