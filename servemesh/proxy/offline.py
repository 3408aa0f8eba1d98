"""Validating a spec's Envoy config away from any running mesh (`servemesh check`, tests).

Envoy refuses a config whose SDS files are missing, and a spec that never ran has no
certificates yet: the check renders for a scratch state dir that gets a throwaway CA and
certificates of its own, so what Envoy validates is exactly what the mesh would run.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from servemesh.identity import issue_mesh_certificates
from servemesh.identity.tokens import ensure_signing_key
from servemesh.proxy.process import validate_config
from servemesh.proxy.render import render_resources, static_bootstrap
from servemesh.spec import ResolvedSpec


def validate_offline(spec: ResolvedSpec, workdir: Path) -> Path:
    """Render `spec` for a scratch state dir under `workdir` and have Envoy validate it;
    returns the config file (EnvoyConfigError when Envoy refuses it)."""
    scratch = spec.model_copy(update={"state_dir": str(workdir / "state")})
    issue_mesh_certificates(scratch)
    if scratch.traffic.edge_auth.active_mode == "jwt":
        ensure_signing_key(scratch.state_dir)  # Envoy reads the JWKS it publishes
    config = workdir / "envoy.yaml"
    resources = render_resources(scratch, workdir)
    config.write_text(yaml.safe_dump(static_bootstrap(scratch, resources, workdir)))
    validate_config(config)
    return config
