"""The registry's own Prometheus metrics: uploads by outcome and their bytes, downloads,
alias changes and refusals, beside the RPC metrics every service has."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

# accepted: a new version stored; existing: the same bytes again (the version returned);
# refused: a registry error (bad header, digest mismatch, quota, idle); cancelled: the
# uploader went away.
UPLOAD_OUTCOMES = ("accepted", "existing", "refused", "cancelled")


class RegistryMetrics:
    """Counters on `registry` (a service's own; a fresh one when none is given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        uploads = Counter(
            "servemesh_registry_uploads",
            "UploadVersion streams by outcome (accepted, existing, refused, cancelled).",
            ["outcome"],
            registry=self.registry,
        )
        self.uploads = {outcome: uploads.labels(outcome) for outcome in UPLOAD_OUTCOMES}
        self.upload_bytes = Counter(
            "servemesh_registry_upload_bytes",
            "Artifact bytes of accepted new versions.",
            registry=self.registry,
        )
        self.downloads = Counter(
            "servemesh_registry_downloads",
            "DownloadArtifact streams begun.",
            registry=self.registry,
        )
        self.download_bytes = Counter(
            "servemesh_registry_download_bytes",
            "Artifact bytes sent by DownloadArtifact.",
            registry=self.registry,
        )
        self.not_modified = Counter(
            "servemesh_registry_downloads_not_modified",
            "DownloadArtifact calls whose if_none_match was current: answered without bytes.",
            registry=self.registry,
        )
        self.aliases = Counter(
            "servemesh_registry_aliases_set",
            "Aliases set or moved (SetAlias).",
            registry=self.registry,
        )
        self.errors = Counter(
            "servemesh_registry_errors",
            "Registry operations refused, by operation and status code.",
            ["operation", "code"],
            registry=self.registry,
        )
