"""Streaming a feature file to a feature service's LoadFeatures, all or nothing."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from servemesh.contract.control_credential import Metadata
from servemesh.contract.errors import ServemeshError
from servemesh.contract.wire import message_size_options
from servemesh.features._read import FeatureFile, FileError, FileRows, Layout
from servemesh.identity import Dial, dial_service
from servemesh.spec import ResolvedSpec
from servemesh_api.feature.v1 import feature_pb2, feature_pb2_grpc

# Problems a refused file lists; reading stops once this many are found.
MAX_PROBLEMS = 20
# Share of the message size limit one chunk of rows may take.
CHUNK_SHARE = 0.5
# How long to wait for a feature service to accept a connection.
CONNECT_TIMEOUT_S = 3.0


class LoadError(ServemeshError):
    """The load did not happen; the message says why. Nothing of it is in the store."""


class BadFile(LoadError):
    """The file has problems; `problems` name each one's line (CSV) or row and column."""

    def __init__(self, path: Path, problems: list[str], more: bool) -> None:
        self.path = path
        self.problems = problems[:MAX_PROBLEMS]
        self.more = more or len(problems) > MAX_PROBLEMS
        count = f"{len(self.problems)}{'+' if self.more else ''}"
        super().__init__(f"{path.name}: {count} problem(s); nothing was loaded")

    def report(self) -> str:
        lines = [str(self), *(f"  {p}" for p in self.problems)]
        if self.more:
            lines.append(f"  (reading stopped after {MAX_PROBLEMS} problems)")
        return "\n".join(lines)


@dataclass(frozen=True)
class LoadSummary:
    view: str
    version: int
    rows: int
    entities: int
    replaced_version: int
    deleted_keys: int
    seconds: float
    # A replicated store's replicas that held the load when it was acknowledged (0: none
    # within the wait); -1: a single Redis.
    replicas_acknowledged: int = -1

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class _Outcome:
    """What the request stream saw; the gRPC thread fills it while it reads the file."""

    problems: list[str] = field(default_factory=list)
    fatal: FileError | None = None
    sent: int = 0


def feature_addresses(spec: ResolvedSpec, address: str | None = None) -> list[Dial]:
    """Every feature service of the mesh, in spec order (only the one at `address`, when
    given: it must be one of the mesh's, whose certificate the load then checks)."""
    dials = [dial_service(spec, i.name) for i in spec.instances() if i.service == "feature"]
    if address is None:
        return dials
    chosen = [d for d in dials if d.address == address]
    if not chosen:
        known = ", ".join(d.address for d in dials)
        raise LoadError(f"--address {address}: not a feature service of the mesh ({known})")
    return chosen


def _ready_channel(dials: list[Dial], options: list[tuple[str, int]]) -> grpc.Channel:
    """A channel to the first feature service that accepts a connection."""
    for dial in dials:
        channel = dial.channel(options=options)
        try:
            grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
            return channel
        except grpc.FutureTimeoutError:
            channel.close()
    where = ", ".join(d.address for d in dials) or "(none)"
    raise LoadError(f"no feature service answers at {where}")


def rows_per_message(rows: FileRows, max_message_bytes: int) -> int:
    """Rows one LoadChunk may carry and stay well under the message size limit."""
    longest = max((len(e.encode()) for e in rows.entity_ids), default=1)
    row_bytes = 4 * rows.values.shape[1] + longest + 24  # values, key, time, framing
    return max(1, int(max_message_bytes * CHUNK_SHARE) // row_bytes)


def chunks(rows: FileRows, max_message_bytes: int) -> Iterator[feature_pb2.LoadFeaturesRequest]:
    """The batch as LoadChunk messages under the size limit."""
    step = rows_per_message(rows, max_message_bytes)
    values = np.ascontiguousarray(rows.values, dtype="<f4")
    for start in range(0, len(rows), step):
        end = start + step
        times = rows.event_ms[start:end].tolist() if rows.event_ms is not None else []
        yield feature_pb2.LoadFeaturesRequest(
            chunk=feature_pb2.LoadChunk(
                entity_ids=rows.entity_ids[start:end],
                values=values[start:end].tobytes(),
                event_times_unix_ms=times,
                first_row=rows.first + start,
            )
        )


def load_file(
    addresses: list[Dial],
    file: FeatureFile,
    layout: Layout,
    *,
    view: str,
    allow_nan: bool,
    max_message_bytes: int,
    credential: Metadata,
    progress: Callable[[int], None] | None = None,
    timeout: float | None = None,
) -> LoadSummary:
    """Stream `file` into `view` through the first feature service that answers.
    `credential` is the mesh's control call metadata (a load is a control call).

    BadFile when the file has problems (nothing was loaded); LoadError when the service
    refused or failed the load (nothing was loaded either).
    """
    started = time.perf_counter()
    outcome = _Outcome()
    header = feature_pb2.LoadHeader(
        view=view,
        feature_names=layout.features,
        source=file.path.name,
        row_label=(
            feature_pb2.ROW_LABEL_LINE if file.row_label == "line" else feature_pb2.ROW_LABEL_ROW
        ),
    )

    def messages() -> Iterator[feature_pb2.LoadFeaturesRequest]:
        yield feature_pb2.LoadFeaturesRequest(header=header)
        try:
            for rows in file.read(layout, allow_nan):
                outcome.problems += rows.problems
                if len(outcome.problems) >= MAX_PROBLEMS:
                    return  # enough to fix; the stream ends without a commit
                if outcome.problems:
                    continue  # read on for more problems, send nothing more
                for chunk in chunks(rows, max_message_bytes):
                    yield chunk
                outcome.sent += len(rows)
                if progress is not None:
                    progress(outcome.sent)
        except FileError as exc:
            outcome.fatal = exc
            return
        if not outcome.problems:
            yield feature_pb2.LoadFeaturesRequest(commit=feature_pb2.LoadCommit(rows=outcome.sent))

    options = message_size_options(max_message_bytes)
    channel = _ready_channel(addresses, options)
    try:
        stub = feature_pb2_grpc.FeatureServiceStub(channel)
        reply = stub.LoadFeatures(messages(), timeout=timeout, metadata=credential)
    except grpc.RpcError as exc:
        if outcome.fatal is not None:
            raise LoadError(f"{outcome.fatal}; nothing was loaded") from None
        if outcome.problems:
            more = len(outcome.problems) >= MAX_PROBLEMS
            raise BadFile(file.path, outcome.problems, more) from None
        details = exc.details() or ""
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("rows:"):
            problems = [line.strip() for line in details.splitlines()[1:]]
            raise BadFile(file.path, problems, "(and more)" in details.splitlines()[0]) from None
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            # A load is all or nothing: what was staged is removed, the view's version stays.
            raise LoadError(
                f"UNAVAILABLE: {details}; nothing of the file became current: load it "
                "again once the store answers (a failover takes seconds)"
            ) from None
        raise LoadError(f"{exc.code().name}: {details}") from None
    finally:
        channel.close()
    return LoadSummary(
        view=reply.view,
        version=reply.version,
        rows=reply.rows,
        entities=reply.entities,
        replaced_version=reply.replaced_version,
        deleted_keys=reply.deleted_keys,
        seconds=time.perf_counter() - started,
        replicas_acknowledged=reply.replicas_acknowledged,
    )
