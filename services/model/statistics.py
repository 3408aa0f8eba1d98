"""The OIP statistics extension: ModelStatistics, read from each version's batcher counters.

Triton's conventions (services/model/batching/stats.py): inference_count counts rows,
execution_count model calls; durations are per request, per batch size for batch_stats.
"""

from __future__ import annotations

from servemesh.services.model.batching import BatcherStats
from servemesh.services.model.repository import ModelRepository
from servemesh_api.inference import grpc_service_pb2 as oip

_REQUEST_DURATIONS = (
    "success",
    "fail",
    "queue",
    "compute_input",
    "compute_infer",
    "compute_output",
)
_BATCH_DURATIONS = ("compute_input", "compute_infer", "compute_output")


def model_statistics(
    repository: ModelRepository, request: oip.ModelStatisticsRequest
) -> oip.ModelStatisticsResponse:
    """Statistics of every version served, of one model, or of one version.

    Raises ModelNotFound when a named model (or version) is not served.
    """
    keys = repository.keys()
    if request.name:
        keys = [k for k in keys if k[0] == request.name]
        if request.version:
            keys = [k for k in keys if k[1] == request.version]
        if not keys:
            raise repository.not_found(request.name, request.version or None)
    served = repository.models()
    response = oip.ModelStatisticsResponse()
    for model, version in keys:
        _add_entry(response, model, version, served[(model, version)].batcher.stats)
    return response


def _add_entry(
    response: oip.ModelStatisticsResponse, model: str, version: str, stats: BatcherStats
) -> None:
    entry = response.model_stats.add(
        name=model,
        version=version,
        last_inference=stats.last_inference_ms,
        inference_count=stats.inference_count,
        execution_count=stats.executions,
    )
    for name in _REQUEST_DURATIONS:
        duration = getattr(stats, name)
        target = getattr(entry.inference_stats, name)
        target.count, target.ns = duration.count, duration.ns
    for size, per_size in sorted(stats.batch_sizes.items()):
        batch = entry.batch_stats.add(batch_size=size)
        for name in _BATCH_DURATIONS:
            duration = getattr(per_size, name)
            target = getattr(batch, name)
            target.count, target.ns = duration.count, duration.ns
