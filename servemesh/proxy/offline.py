"""Validating a spec's Envoy config away from any running mesh (`servemesh check`, tests).

Envoy refuses a config whose SDS files are missing, and a spec that never ran has no
certificates yet: the check renders for a scratch state dir that gets a throwaway CA and
certificates of its own, so what Envoy validates is exactly what the mesh would run.
"""

from __future__ import annotations

from pathlib import Path

from servemesh.contract.yaml_text import dump_yaml
from servemesh.identity import issue_mesh_certificates
from servemesh.identity.tokens import ensure_signing_key
from servemesh.proxy.process import validate_config
from servemesh.proxy.render import render_proxies, static_bootstrap
from servemesh.spec import EDGE_PROXY, ResolvedSpec


def validate_offline(spec: ResolvedSpec, workdir: Path) -> Path:
    """Render `spec` for a scratch state dir under `workdir` and have Envoy validate every
    Envoy's config (one per zone and the edge's in the per-zone layout); returns the edge's
    config file (EnvoyConfigError when Envoy refuses one, naming the file)."""
    scratch = spec.model_copy(update={"state_dir": str(workdir / "state")})
    issue_mesh_certificates(scratch)
    if scratch.traffic.edge_auth.active_mode == "jwt":
        ensure_signing_key(scratch.state_dir)  # Envoy reads the JWKS it publishes
    edge = workdir / "envoy.yaml"
    for proxy, resources in render_proxies(scratch, workdir).items():
        config = edge if proxy == EDGE_PROXY else workdir / f"envoy-{proxy}.yaml"
        bootstrap = static_bootstrap(scratch, resources, workdir, proxy)
        config.write_text(dump_yaml(bootstrap, sort_keys=True))
        validate_config(config)
    return edge
