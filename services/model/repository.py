"""The models one replica serves: loading, unloading, resolving a request's version, and the
OIP model-repository extension (RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload).

Several models and versions live in one replica (Triton-like multi-model hosting), keyed by
(model, version); a request naming no version gets the model's highest loaded one.

An on-demand repository (`on_demand`, a pool with `load: on_demand` or a memory budget)
loads nothing at start: a call to a version it may load (`loadable`, the pool's versions in
the spec) waits for that version's one load task within its own deadline (`acquire`), and a
load that would pass the budget first evicts the least recently used version that no call
holds (`release` ends a hold; a held version is waited for, never evicted). An evicted
version stays loadable: its next call loads it again.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable

import grpc

from servemesh.contract.wire import LOAD_CONFIG_PARAMETER, LOAD_VERSION_PARAMETER
from servemesh.services.model.batching import Batcher
from servemesh.services.model.errors import (
    DeadlineMissed,
    LoadError,
    ModelNotFound,
    NotInSpec,
    RequestError,
    ServingError,
    Unavailable,
)
from servemesh.services.model.loader import LoadedModel, ModelLoader
from servemesh.services.model.on_demand import OnDemand, OnDemandStats
from servemesh.services.runtime.errors import Internal
from servemesh.spec import ModelSpec
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

    def __init__(
        self,
        *,
        loader: ModelLoader | None = None,
        expected: Iterable[Key] = (),
        on_demand: OnDemand | None = None,
    ) -> None:
        self.loader = loader
        self.on_demand = on_demand
        # On demand, `expected` names what may be loaded on a call (nothing is required
        # before the replica is ready); otherwise what must be loaded first.
        self.expected: set[Key] = set() if on_demand is not None else set(expected)
        self.loadable: set[Key] = set(expected) if on_demand is not None else set()
        self.stats = OnDemandStats()
        # Calls holding each version (queued or running): never evicted while held.
        self._holds: dict[Key, int] = {}
        # Calls waiting for each version's load: a version just loaded is theirs until they
        # have taken their holds (else the next load could evict it before they run, and
        # every load would be for nothing under a full budget).
        self._waiting: dict[Key, int] = {}
        # Loaded versions, least recently used first (a call's start counts as a use).
        self._recent: OrderedDict[Key, None] = OrderedDict()
        # Bytes each version measured at its last load: a reload's estimate before it runs.
        self._costs: dict[Key, int] = {}
        # Bytes set aside for loads under way (their estimate), so two loads at once cannot
        # both fit in the same room.
        self._reserved = 0
        self._tasks: dict[Key, asyncio.Task[LoadedModel]] = {}
        # On-demand loads run `parallel_loads` at a time: they share the same cores, and a
        # load under way holds its room in the budget, so many at once would leave little
        # room for the versions that are hot (the calls would hit less, not load faster).
        self._load_slots = asyncio.Semaphore(on_demand.parallel_loads if on_demand else 1)
        # The last failed on-demand load of a version: when, and what its callers are told.
        self._failed: dict[Key, tuple[float, ServingError]] = {}
        # Set whenever a hold ends or a version is installed: a load waiting for room looks
        # again.
        self._room = asyncio.Event()
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
        if self.on_demand is not None:  # nothing need be loaded: a call loads its version
            return True
        return bool(self._models) and all(key in self._models for key in self.expected)

    def is_loadable(self, key: Key) -> bool:
        """Whether an on-demand repository loads `key` on its first call."""
        return self.on_demand is not None and key in self.loadable

    def used_bytes(self) -> int:
        """Bytes of the weights of every version loaded (what the budget counts)."""
        return sum(loaded.memory_bytes for loaded in self._models.values())

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
        self._costs[key] = loaded.memory_bytes
        self._recent[key] = None
        self._recent.move_to_end(key)
        self._room.set()
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
            # Room for its weights first (their size at the last load, else the largest
            # version's), set aside until the load has measured its own.
            estimate = 0 if key in self._models else self._estimate(key)
            try:
                await self._make_room(estimate, key)
            except ServingError as exc:
                if key not in self._models:
                    self._states[key] = ("UNAVAILABLE", exc.message[:500])
                raise
            self._reserved += estimate
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
            finally:
                self._reserved -= estimate
            if loaded.version != version:  # an alias resolved to a concrete version
                self._states.pop(key, None)
            if self.on_demand is None:
                self.expected.add((loaded.model, loaded.version))
            else:
                self.loadable.add((loaded.model, loaded.version))
            await self.install(loaded)
            if self.on_demand is not None:
                await self._fit(loaded)
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
            self.expected.discard(key)  # an on-demand version stays loadable: a call loads it
            self._recent.pop(key, None)
            self._states[key] = ("UNAVAILABLE", "unloaded")
        await self._changed()  # before the drain of the batchers: health goes first
        for loaded in gone:
            await loaded.close()
        return gone

    # --- on demand: load on a call, evict the least recently used --------------------

    def _default_version(self, model: str) -> str:
        """A call naming no version: the highest loaded, else the highest loadable."""
        latest = self._latest.get(model)
        if latest is not None:
            return latest
        versions = sorted((v for m, v in self.loadable if m == model), key=natural_key)
        if not versions:
            raise self.not_found(model, None)
        return versions[-1]

    async def acquire(self, model: str, version: str, deadline: float) -> tuple[LoadedModel, float]:
        """The version asked for, held for one call until `release`, and the seconds the
        call waited for its load (0.0: it was loaded).

        On demand, a version not loaded is loaded first, by one task per version that
        concurrent first calls share; the call waits for it until `deadline` (monotonic)
        and is answered DEADLINE_EXCEEDED when the load is not done by then, while the
        load goes on for the next caller. A failed load answers its own status
        (FAILED_PRECONDITION for a version that cannot load, UNAVAILABLE for a registry
        or a budget that cannot take it now), and so for `retry_after_s` without another
        load.
        """
        if not model:
            raise RequestError("model_name: required")
        if self.on_demand is None:
            return self.resolve(model, version), 0.0
        key = (model, version or self._default_version(model))
        found = self._models.get(key)
        if found is not None:
            self.stats.hits += 1
            self._hold(key)
            return found, 0.0
        if key not in self.loadable:
            raise self.not_found(*key)
        self.stats.misses += 1
        started = time.monotonic()
        # The version may be evicted again between its load's end and this call's turn
        # (another load made room): then the call waits for the next load.
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            while (loaded := self._models.get(key)) is None:
                task = self._load_task(key)
                left = deadline - time.monotonic()
                try:
                    await asyncio.wait_for(asyncio.shield(task), max(left, 0.0))
                except TimeoutError:
                    raise DeadlineMissed(
                        f"model {model!r} version {key[1]!r} is loading and its load did "
                        f"not finish within the call's deadline "
                        f"({time.monotonic() - started:.2f} s waited); the load goes on for "
                        "the next call"
                    ) from None
            self._hold(key)  # before the wait ends: no eviction comes between
        finally:
            left_waiting = self._waiting[key] - 1
            if left_waiting:
                self._waiting[key] = left_waiting
            else:
                del self._waiting[key]
                self._room.set()
        return loaded, time.monotonic() - started

    def release(self, loaded: LoadedModel) -> None:
        """A call holding `loaded` is answered: the version may be evicted once none is."""
        key = (loaded.model, loaded.version)
        count = self._holds.get(key, 0) - 1
        if count > 0:
            self._holds[key] = count
            return
        self._holds.pop(key, None)
        self._room.set()

    def _hold(self, key: Key) -> None:
        self._holds[key] = self._holds.get(key, 0) + 1
        if key in self._recent:
            self._recent.move_to_end(key)

    def _load_task(self, key: Key) -> asyncio.Task[LoadedModel]:
        task = self._tasks.get(key)
        if task is not None:
            return task
        failed = self._failed.get(key)
        assert self.on_demand is not None
        if failed is not None and time.monotonic() - failed[0] < self.on_demand.retry_after_s:
            raise failed[1]
        task = asyncio.get_running_loop().create_task(
            self._load_on_demand(*key), name=f"load {key[0]}:{key[1]}"
        )
        self._tasks[key] = task
        task.add_done_callback(lambda done: self._load_done(key, done))
        return task

    def _load_done(self, key: Key, task: asyncio.Task[LoadedModel]) -> None:
        if self._tasks.get(key) is task:
            del self._tasks[key]
        if not task.cancelled():
            task.exception()  # read: a load no caller waited for is not logged as lost

    async def _load_on_demand(self, model: str, version: str) -> LoadedModel:
        key = (model, version)
        started = time.monotonic()
        try:
            async with self._load_slots:
                loaded = await self.load(model, version)
        except Exception as exc:
            self.stats.load_failures += 1
            refusal = _as_refusal(exc)
            self._failed[key] = (time.monotonic(), refusal)
            raise refusal from None
        self._failed.pop(key, None)
        self.stats.loads += 1
        self.stats.load_seconds_sum += time.monotonic() - started
        return loaded

    def _estimate(self, key: Key) -> int:
        """Bytes a load of `key` is expected to take: its last measure, else the largest
        version's (a new version is assumed no smaller than what the pool holds)."""
        if self.on_demand is None or self.on_demand.budget_bytes is None:
            return 0
        if key in self._costs:
            return self._costs[key]
        return max(self._costs.values(), default=0)

    def _victim(self, keep: Key) -> Key | None:
        """The least recently used loaded version no call holds or waits for (never
        `keep`)."""
        for key in self._recent:
            if (
                key != keep
                and key in self._models
                and not self._holds.get(key)
                and not self._waiting.get(key)
            ):
                return key
        return None

    async def _make_room(self, need: int, keep: Key) -> None:
        """Evict idle versions, least recently used first, until `need` more bytes fit the
        budget; wait (up to `room_wait_s`) while the only versions left are held."""
        if self.on_demand is None or self.on_demand.budget_bytes is None:
            return
        budget = self.on_demand.budget_bytes
        if need > budget:
            raise LoadError(
                f"model {keep[0]!r} version {keep[1]!r}: its weights ({need} bytes) are more "
                f"than the pool's memory budget ({budget} bytes)"
            )
        give_up = time.monotonic() + self.on_demand.room_wait_s
        while self.used_bytes() + self._reserved + need > budget:
            victim = self._victim(keep)
            if victim is not None:
                await self._evict(victim)
                continue
            left = give_up - time.monotonic()
            if left <= 0:
                raise Unavailable(
                    f"model {keep[0]!r} version {keep[1]!r}: no room in the pool's memory "
                    f"budget ({budget} bytes): every loaded version has calls in flight"
                )
            self._room.clear()
            try:
                await asyncio.wait_for(self._room.wait(), left)
            except TimeoutError:
                continue

    async def _fit(self, loaded: LoadedModel) -> None:
        """After a load measured itself: evict more if the estimate was short, and unload
        a version whose weights alone pass the budget."""
        assert self.on_demand is not None
        budget = self.on_demand.budget_bytes
        if budget is None:
            return
        key = (loaded.model, loaded.version)
        if loaded.memory_bytes > budget:
            await self.unload(*key)
            self._states[key] = ("UNAVAILABLE", "larger than the pool's memory budget")
            raise LoadError(
                f"model {key[0]!r} version {key[1]!r}: its weights ({loaded.memory_bytes} "
                f"bytes) are more than the pool's memory budget ({budget} bytes)"
            )
        # The fresh version is held while room is made around it: it is the one asked for.
        self._hold(key)
        try:
            await self._make_room(0, key)
        finally:
            self.release(loaded)

    async def _evict(self, key: Key) -> None:
        """Unload an idle version to make room; it stays loadable (its next call loads it)."""
        loaded = self._models.pop(key)
        self._recent.pop(key, None)
        versions = self.versions_of(key[0])
        if versions:
            self._latest[key[0]] = versions[-1]
        else:
            self._latest.pop(key[0], None)
        self._states[key] = ("UNAVAILABLE", "evicted (least recently used); loads on its next call")
        self.stats.evictions += 1
        log.info(
            "model evicted: least recently used",
            extra={"model": key[0], "version": key[1], "bytes": loaded.memory_bytes},
        )
        await self._changed()
        await loaded.close()

    async def close(self) -> None:
        """Drain every batcher (the server's stop hook); on-demand loads under way stop."""
        for task in list(self._tasks.values()):
            task.cancel()
        loaded = list(self._models.values())
        await asyncio.gather(*(model.close() for model in loaded))

    # --- the OIP model-repository extension -----------------------------------------

    def index(self, request: oip.RepositoryIndexRequest) -> oip.RepositoryIndexResponse:
        """Every version served (READY) and, unless `ready` is asked, those that are not."""
        rows: dict[Key, tuple[str, str]] = {key: ("READY", "") for key in self._models}
        if not request.ready:
            for key, row in self._states.items():
                rows.setdefault(key, row)
            for key in self.loadable:
                rows.setdefault(key, ("UNAVAILABLE", "not loaded: loads on its first call"))
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


def _as_refusal(exc: BaseException) -> ServingError:
    """What the callers of a failed on-demand load are told: the load's own refusal (a
    version that cannot load: FAILED_PRECONDITION, NOT_FOUND; the registry: its status),
    else UNAVAILABLE naming only the exception's type (the details are in the log)."""
    if isinstance(exc, ServingError):
        return exc
    return Unavailable(f"load failed: {type(exc).__name__}")
