"""The models one replica serves: loading, unloading, resolving a request's version, and the
OIP model-repository extension (RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload).

Several models and versions live in one replica (Triton-like multi-model hosting), keyed by
(model, version); a request naming no version gets the model's highest loaded one.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Iterable

import grpc

from servemesh.services.model.batching import Batcher
from servemesh.services.model.errors import ModelNotFound, NotInSpec, RequestError, ServingError
from servemesh.services.model.loader import LoadedModel, ModelLoader
from servemesh.services.runtime.errors import Internal
from servemesh.spec import ModelSpec
from servemesh.wire import LOAD_CONFIG_PARAMETER, LOAD_VERSION_PARAMETER
from servemesh_api.inference import grpc_service_pb2 as oip

log = logging.getLogger(__name__)

Key = tuple[str, str]
Listener = Callable[[], Awaitable[None]]
# Takes the spec entry a RepositoryModelLoad brought for a model, before the load runs.
ConfigSink = Callable[[str, ModelSpec], None]
# Does the replica's spec name (model, version)?
SpecNames = Callable[[str, str], bool]


def natural_key(version: str) -> tuple[object, ...]:
    """Sort key under which v10 comes after v9."""
    parts = re.split(r"(\d+)", version)
    return tuple(int(part) if index % 2 else part for index, part in enumerate(parts))


def _by_model_then_version(key: Key) -> tuple[str, tuple[object, ...]]:
    return (key[0], natural_key(key[1]))


class ModelRepository:
    """The (model, version)s this replica serves.

    `expected` lists the versions the replica must serve before it calls itself ready;
    `loader` backs `load`, `load_all` and RepositoryModelLoad (without one, loading
    answers UNIMPLEMENTED).
    """

    def __init__(self, *, loader: ModelLoader | None = None, expected: Iterable[Key] = ()) -> None:
        self.loader = loader
        self.expected: set[Key] = set(expected)
        self._models: dict[Key, LoadedModel] = {}
        # Each model's default version (its highest loaded), kept current by install/unload.
        self._latest: dict[str, str] = {}
        # RepositoryIndex states of versions not (or no longer) serving: LOADING, UNAVAILABLE.
        self._states: dict[Key, tuple[str, str]] = {}
        self._locks: dict[Key, asyncio.Lock] = {}
        self._listeners: list[Listener] = []
        # Where a load request's `config` goes (the replica's load specs); None: refused.
        self.configure: ConfigSink | None = None
        # Which versions a RepositoryModelLoad without `config` may load: those its spec
        # names. None (a repository with no spec, built in-process): any.
        self.spec_names: SpecNames | None = None

    def on_change(self, listener: Listener) -> None:
        """Call `listener` after every install and unload (the replica's health follows)."""
        self._listeners.append(listener)

    async def _changed(self) -> None:
        for listener in self._listeners:
            await listener()

    # --- what is served ---------------------------------------------------------------

    def models(self) -> dict[Key, LoadedModel]:
        return dict(self._models)

    def keys(self) -> list[Key]:
        """Every (model, version) served, by model, then version in natural order."""
        return sorted(self._models, key=_by_model_then_version)

    def batchers(self) -> list[tuple[str, str, Batcher]]:
        """(model, version, batcher) of every version served: what the metrics read."""
        return [
            (model, version, loaded.batcher) for (model, version), loaded in self._models.items()
        ]

    def is_ready(self) -> bool:
        return bool(self._models) and all(key in self._models for key in self.expected)

    def versions_of(self, model: str) -> list[str]:
        return sorted((v for m, v in self._models if m == model), key=natural_key)

    def not_found(self, model: str, version: str | None) -> ModelNotFound:
        versions = self.versions_of(model)
        if not versions:
            return ModelNotFound(f"model {model!r} is not loaded")
        return ModelNotFound(
            f"model {model!r} version {version!r} is not loaded; loaded: {versions}"
        )

    def resolve(self, model: str, version: str = "") -> LoadedModel:
        """The loaded version asked for, or the model's default (its highest version)."""
        if not model:
            raise RequestError("model_name: required")
        if not version:
            latest = self._latest.get(model)
            if latest is None:
                raise self.not_found(model, None)
            version = latest
        loaded = self._models.get((model, version))
        if loaded is None:
            raise self.not_found(model, version)
        return loaded

    # --- loading and unloading --------------------------------------------------------

    async def install(self, loaded: LoadedModel) -> None:
        """Serve `loaded`; a previous load of the same version drains after the swap."""
        key = (loaded.model, loaded.version)
        previous = self._models.get(key)
        self._models[key] = loaded
        self._states.pop(key, None)
        self._latest[loaded.model] = self.versions_of(loaded.model)[-1]
        await self._changed()
        if previous is not None and previous is not loaded:
            await previous.close()

    async def load(self, model: str, version: str) -> LoadedModel:
        """Load (or reload) a version with the injected loader and serve it."""
        if self.loader is None:
            raise ServingError(
                "model loading is not configured on this replica",
                code=grpc.StatusCode.UNIMPLEMENTED,
            )
        key = (model, version)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in self._models:
                self._states[key] = ("LOADING", "")
            try:
                loaded = await self.loader(model, version)
            except Exception as exc:
                reason = (
                    exc.message if isinstance(exc, ServingError) else f"{type(exc).__name__}: {exc}"
                )
                if key not in self._models:
                    self._states[key] = ("UNAVAILABLE", reason[:500])
                log.error(
                    "model load failed",
                    extra={"model": model, "version": version, "reason": reason},
                )
                raise
            if loaded.version != version:  # an alias resolved to a concrete version
                self._states.pop(key, None)
            self.expected.add((loaded.model, loaded.version))
            await self.install(loaded)
            return loaded

    async def load_all(self) -> None:
        """Load every expected version, one after another (they share the same cores)."""
        for model, version in sorted(self.expected, key=_by_model_then_version):
            if (model, version) not in self._models:
                await self.load(model, version)

    async def unload(self, model: str, version: str | None = None) -> list[LoadedModel]:
        """Stop serving one version (or all of a model); queued requests still finish."""
        keys = [k for k in self._models if k[0] == model and (version is None or k[1] == version)]
        if not keys:
            raise self.not_found(model, version)
        gone = [self._models.pop(key) for key in keys]
        versions = self.versions_of(model)
        if versions:
            self._latest[model] = versions[-1]
        else:
            self._latest.pop(model, None)
        for key in keys:
            self.expected.discard(key)
            self._states[key] = ("UNAVAILABLE", "unloaded")
        await self._changed()  # before the drain of the batchers: health goes first
        for loaded in gone:
            await loaded.close()
        return gone

    async def close(self) -> None:
        """Drain every batcher (the server's stop hook)."""
        loaded = list(self._models.values())
        await asyncio.gather(*(model.close() for model in loaded))

    # --- the OIP model-repository extension -----------------------------------------

    def index(self, request: oip.RepositoryIndexRequest) -> oip.RepositoryIndexResponse:
        """Every version served (READY) and, unless `ready` is asked, those that are not."""
        rows: dict[Key, tuple[str, str]] = {key: ("READY", "") for key in self._models}
        if not request.ready:
            for key, row in self._states.items():
                rows.setdefault(key, row)
        response = oip.RepositoryIndexResponse()
        for (model, version), (state, reason) in sorted(
            rows.items(), key=lambda item: _by_model_then_version(item[0])
        ):
            response.models.add(name=model, version=version, state=state, reason=reason)
        return response

    async def load_requested(self, request: oip.RepositoryModelLoadRequest) -> None:
        """RepositoryModelLoad: the version named in `parameters['version']`, loaded by
        the model's spec entry in `parameters['config']` (JSON) when one is given.

        A version neither the replica's spec nor that entry names is refused
        (FAILED_PRECONDITION, `NotInSpec`). A loader's own refusal keeps its status (an
        unknown version is NOT_FOUND); any other failure answers INTERNAL naming only the
        exception's type.
        """
        if not request.model_name:
            raise RequestError("model_name: required")
        param = request.parameters.get(LOAD_VERSION_PARAMETER)
        if (
            param is None
            or param.WhichOneof("parameter_choice") != "string_param"
            or not param.string_param
        ):
            raise RequestError(
                f"parameters['{LOAD_VERSION_PARAMETER}']: a string_param naming the version "
                "is required"
            )
        model, version = request.model_name, param.string_param
        config = request.parameters.get(LOAD_CONFIG_PARAMETER)
        brought = self._read_config(config) if config is not None else None
        self._check_named(model, version, brought)
        if brought is not None:
            self._bring(model, brought)
        try:
            await self.load(model, version)
        except ServingError:
            raise
        except Exception as exc:
            raise Internal(f"load failed: {type(exc).__name__}") from exc

    def _read_config(self, param: oip.ModelRepositoryParameter) -> ModelSpec:
        field = f"parameters['{LOAD_CONFIG_PARAMETER}']"
        if param.WhichOneof("parameter_choice") != "string_param":
            raise RequestError(f"{field}: a string_param holding the model's spec entry as JSON")
        try:
            return ModelSpec.model_validate_json(param.string_param)
        except ValueError as exc:
            first = str(exc).splitlines()
            raise RequestError(f"{field}: not a model spec entry: {' '.join(first[:3])}") from None

    def _check_named(self, model: str, version: str, brought: ModelSpec | None) -> None:
        """Refuse a version neither the replica's spec nor the load's own spec entry (an
        apply in progress) names: a control credential alone does not choose what runs."""
        if brought is not None and version in brought.versions:
            return
        if self.spec_names is None or self.spec_names(model, version):
            return
        raise NotInSpec(
            f"{model[:128]}/{version[:128]}: the mesh's spec does not name this version; add "
            "it to the spec's models and run `servemesh apply`, which loads it on every replica"
        )

    def _bring(self, model: str, config: ModelSpec) -> None:
        if self.configure is None:
            raise ServingError(
                f"parameters['{LOAD_CONFIG_PARAMETER}']: this replica loads by its spec only",
                code=grpc.StatusCode.UNIMPLEMENTED,
            )
        self.configure(model, config)

    async def unload_requested(self, request: oip.RepositoryModelUnloadRequest) -> None:
        """RepositoryModelUnload: one version (`parameters['version']`) or the whole model."""
        param = request.parameters.get(LOAD_VERSION_PARAMETER)
        version = param.string_param if param is not None and param.string_param else None
        await self.unload(request.model_name, version)
