"""Turning verified artifact bytes into a served model: runner, warm-up, batcher."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from servemesh.services.model.artifacts import (
    FORMATS,
    PLATFORMS,
    ArtifactError,
    Format,
    as_format,
)
from servemesh.services.model.batching import Batcher
from servemesh.services.model.errors import LoadError
from servemesh.services.model.runner import (
    DEFAULT_NUM_THREADS,
    ArtifactMismatch,
    ModelRunner,
    SignatureViolation,
)
from servemesh.services.model.tensors import Signature
from servemesh.spec import BatchingSpec, MeshSpec
from servemesh.spec.model_contract import check_model_contract

log = logging.getLogger(__name__)

PLATFORM = PLATFORMS["torchscript"]


@dataclass
class LoadedModel:
    """One (model, version) this replica serves."""

    model: str
    version: str
    signature: Signature
    batching: BatchingSpec
    runner: ModelRunner
    batcher: Batcher
    sha256: str
    platform: str = PLATFORM
    # Bytes of its weights, measured at load (`on_demand.weight_bytes`): what it costs an
    # on-demand pool's memory budget.
    memory_bytes: int = 0

    async def close(self) -> None:
        """Finish the queued and in-flight requests, then stop the batcher."""
        await self.batcher.close()


# (model, version) -> the loaded model; raises LoadError (or ServingError) on failure.
ModelLoader = Callable[[str, str], Awaitable[LoadedModel]]

# registry.client.fetch_verified's shape: (channel, model, version, *, timeout, max_bytes)
# -> (ModelVersion, artifact bytes).
FetchVerified = Callable[..., Awaitable[tuple[Any, bytes]]]


def warm_up_sizes(batching: BatchingSpec) -> list[int]:
    """Batch sizes to run before serving: 1, the maximum and every preferred size."""
    return sorted({1, batching.max_batch_size, *batching.preferred_batch_sizes})


async def load_model(
    data: bytes,
    *,
    model: str,
    version: str,
    sha256: str,
    signature: Signature,
    format: Format = "torchscript",
    batching: BatchingSpec | None = None,
    inject_latency_ms: float = 0.0,
    device: torch.device | str | None = None,
    num_threads: int | None = DEFAULT_NUM_THREADS,
) -> LoadedModel:
    """Verify, load and warm up an artifact (`artifacts`: TorchScript or torch.export);
    returns it ready to serve.

    The sha256 is checked here again even though the registry client already verified the
    download: the bytes are about to be parsed by torch, so this is the last gate. Loading
    and warm-up run in a thread so the event loop keeps answering health checks.
    """
    batching = batching or BatchingSpec()
    started = time.perf_counter()
    runner = await asyncio.to_thread(
        ModelRunner.from_bytes,
        data,
        sha256=sha256,
        model=model,
        version=version,
        format=format,
        signature=signature,
        max_batch_size=batching.max_batch_size,
        device=device,
        inject_latency_ms=inject_latency_ms,
        num_threads=num_threads,
    )
    batcher = Batcher(runner, batching, name=f"{model}:{version}")
    try:
        await batcher.warm_up(warm_up_sizes(batching))
    except BaseException as exc:
        await batcher.close()
        where = f"model {model!r} version {version!r}"
        if isinstance(exc, SignatureViolation):
            raise LoadError(f"{where}: warm-up: {exc}") from None
        if isinstance(exc, Exception):
            # The model's own error may carry internals: its type here, the rest in the log.
            log.error("warm-up failed", extra={"model": model, "version": version}, exc_info=exc)
            raise LoadError(f"{where}: warm-up failed ({type(exc).__name__})") from None
        raise
    log.info(
        "model loaded",
        extra={
            "model": model,
            "version": version,
            "sha256": sha256,
            "device": str(runner.device),
            "load_ms": round((time.perf_counter() - started) * 1000, 1),
        },
    )
    return LoadedModel(
        model=model,
        version=version,
        signature=signature,
        batching=batching,
        runner=runner,
        batcher=batcher,
        sha256=sha256,
        platform=PLATFORMS[format],
        memory_bytes=runner.weight_bytes(),
    )


def _registry_fetch() -> FetchVerified:
    # Imported on first use so this module (and its tests) need no registry client.
    from servemesh.registry.client import fetch_verified

    return fetch_verified


def registry_loader(
    channel: grpc.aio.Channel | Sequence[grpc.aio.Channel],
    spec: MeshSpec | Callable[[], MeshSpec],
    *,
    fetch: FetchVerified | None = None,
    device: torch.device | str | None = None,
    retry_for_s: float = 30.0,
) -> ModelLoader:
    """A ModelLoader that downloads versions from the registry behind `channel` (or the
    first of several that answers: the registry, then its zone's mirror).

    Batching and injected latency come from the spec's entry for the model (defaults for a
    model the spec does not list); `spec` may be a function answering the current spec, read
    at each load, so a replica that follows live changes loads by the spec of now. An
    unreachable registry (UNAVAILABLE) is retried with backoff for `retry_for_s`, since
    replicas may start while the registry still is.
    """

    current = spec if callable(spec) else (lambda: spec)
    channels = list(channel) if isinstance(channel, list | tuple) else [channel]

    async def load(model: str, version: str) -> LoadedModel:
        fetcher = fetch or _registry_fetch()
        where = f"model {model!r} version {version!r}"
        live = current()
        model_spec = live.models.get(model)
        version_spec = model_spec.versions.get(version) if model_spec else None
        batching = model_spec.batching if model_spec else BatchingSpec()
        record, data = await fetch_with_retry(fetcher, channels, model, version, live, retry_for_s)
        if record.format not in FORMATS:
            raise LoadError(f"{where}: format {record.format!r} is not one of {list(FORMATS)}")
        format = as_format(record.format)
        if record.size_bytes and len(data) != record.size_bytes:
            raise LoadError(
                f"{where}: artifact is {len(data)} bytes, registry says {record.size_bytes}"
            )
        try:
            signature = Signature.from_specs(
                record.inputs, record.outputs, where=f"{where} signature"
            )
        except ValueError as exc:
            raise LoadError(str(exc)) from None
        if model_spec is not None:
            # Every input the spec fills from a view has its width, every input of the
            # signature is filled: the gateway could not call the model otherwise.
            problems = check_model_contract(model, model_spec, record.inputs, record.outputs)
            if problems:
                raise LoadError(f"{where}: " + "; ".join(problems))
        try:
            return await load_model(
                data,
                model=model,
                # An alias ("latest") resolves to the version the registry answered with.
                version=record.version or version,
                sha256=record.sha256,
                signature=signature,
                format=format,
                batching=batching,
                inject_latency_ms=version_spec.inject_latency_ms if version_spec else 0.0,
                device=device,
            )
        except ArtifactMismatch as exc:
            raise LoadError(f"{where}: {exc}", code=grpc.StatusCode.DATA_LOSS) from None
        except ArtifactError as exc:
            raise LoadError(f"{where}: {exc}") from None

    return load


# How long a model server gives the registry to accept a connection before it asks its
# zone's mirror: a lost zone's address may swallow packets (or its port now belong to
# another process), and the fetch's own 60 s deadline would hold every load that long.
REGISTRY_CONNECT_TIMEOUT_S = 3.0


async def _connects(channel: grpc.aio.Channel) -> bool:
    """Whether `channel` reaches its server (TLS handshake included) within
    REGISTRY_CONNECT_TIMEOUT_S; at once when it already has."""
    try:
        await asyncio.wait_for(channel.channel_ready(), REGISTRY_CONNECT_TIMEOUT_S)
    except TimeoutError:
        return False
    return True


async def fetch_with_retry(
    fetch: FetchVerified,
    channel: grpc.aio.Channel | Sequence[grpc.aio.Channel],
    model: str,
    version: str,
    spec: MeshSpec,
    retry_for_s: float,
) -> tuple[Any, bytes]:
    """The version's record and bytes through `fetch`, from the first of the channels that
    answers (the registry, then its zone's mirror): one that is unreachable (UNAVAILABLE)
    hands over to the next, and when none answers they are tried again with backoff for
    `retry_for_s`; any other refusal is a LoadError naming it. The client's own checks
    (size, sha256) raise as they do."""
    channels = list(channel) if isinstance(channel, list | tuple) else [channel]
    give_up = time.monotonic() + retry_for_s
    backoff = 0.1
    where = f"model {model!r} version {version!r}"
    while True:
        try:
            for index, tried in enumerate(channels):
                last = index == len(channels) - 1
                if not last and not await _connects(tried):
                    log.warning(
                        "registry not reachable; trying its zone's mirror",
                        extra={"model": model, "version": version},
                    )
                    continue
                try:
                    return await fetch(
                        tried,
                        model,
                        version,
                        timeout=60.0,
                        max_bytes=spec.limits.max_artifact_bytes,
                    )
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or last:
                        raise
                    log.warning(
                        "registry unavailable; trying its zone's mirror",
                        extra={"model": model, "version": version},
                    )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + backoff > give_up:
                raise LoadError(f"{where}: registry: {exc.details()}", code=exc.code()) from None
            log.warning(
                "registry unavailable; retrying", extra={"model": model, "version": version}
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
        except Exception as exc:
            # The client's own checks: a size or sha256 mismatch in transit, an artifact
            # above the size limit.
            raise LoadError(f"model {model!r} version {version!r}: {exc}") from None
