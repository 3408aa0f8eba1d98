"""The spec a replica loads a version by: the live spec, plus entries loads brought along.

A replica follows the running mesh's resolved spec (`servemesh apply` rewrites it), but
`servemesh apply` loads a new version on every replica before it writes the new spec, so
that Envoy routes to the version only once every replica holds it. Such a load
(RepositoryModelLoad) carries the model's spec entry; it governs that model's loads until
the spec itself lists the model again after a change.
"""

from __future__ import annotations

from servemesh.spec import MeshSpec, ModelSpec


class LoadSpecs:
    """The current spec for loading: batching, injected latency and inputs per model."""

    def __init__(self, spec: MeshSpec) -> None:
        self._spec = spec
        self._brought: dict[str, ModelSpec] = {}

    @property
    def spec(self) -> MeshSpec:
        """The spec the replica follows (without the entries loads brought)."""
        return self._spec

    def current(self) -> MeshSpec:
        """The followed spec with each brought entry in place of the model's own."""
        if not self._brought:
            return self._spec
        return self._spec.model_copy(update={"models": {**self._spec.models, **self._brought}})

    def bring(self, model: str, config: ModelSpec) -> None:
        """A load request carried `model`'s entry: use it for that model's next loads."""
        self._brought[model] = config

    def follow(self, spec: MeshSpec) -> None:
        """A new spec: it governs every model it lists from now on."""
        self._spec = spec
        self._brought = {
            model: config for model, config in self._brought.items() if model not in spec.models
        }
