"""`servemesh bench batch`: batch scoring's rows/s in process against the model's own limit.

For the demo model (64 features) and the wine example's model (13 features, both inputs
filled from one `lot` view here: a batch run has no caller to send `tasting`), at each batch
size: the whole batch run (`run_score`: Redis reads, the forward passes, Parquet parts, the
checkpoints, the output put in place) over N entities, the model called in batches of that
size over chunks of `chunk_rows` (the unit of reading and writing), against the limit: the
same loaded model called in a tight loop on the same rows in batches of the same size
(`Scorer.score`: the same conversion, torch.inference_mode, the same torch threads), nothing
else. Both in the same
process, the rounds interleaved, `repeats` of each; median, spread ((max-min)/median) and
the ratio batch / limit (the goal: >= 0.8).

A registry (in this process, over mutual TLS) and a redis-server of its own, in a temp dir;
nothing of a running mesh is touched.
"""

from __future__ import annotations

import asyncio
import importlib
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from servemesh.bench.report import BenchReport
from servemesh.contract.errors import ServemeshError
from servemesh.load.stats import SPREAD_LIMIT, spread

GOAL = 0.8


@dataclass(frozen=True)
class Row:
    model: str
    batch: int
    rows: int
    batch_rows_s: list[float]
    limit_rows_s: list[float]

    @property
    def ratio(self) -> float:
        return statistics.median(self.batch_rows_s) / statistics.median(self.limit_rows_s)


def _wine_example() -> ModuleType:
    """The wine example (examples/wine/train.py) of the checkout this package runs from:
    the console script does not put the working directory on sys.path."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "examples" / "wine" / "train.py").is_file():
        raise ServemeshError(
            f"bench batch scores the wine example, which is not at {root}/examples/wine: "
            "run it from a checkout of the repository"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("examples.wine.train")


def _wine_artifact(folder: Path) -> Path:
    wine = _wine_example()
    path = folder / "wine.pt2"
    wine.export(wine.train(wine.load()).model, path)
    return path


async def _measure(
    rows: int,
    batch_sizes: list[int],
    repeats: int,
    threads: int | None,
    folder: Path,
    chunk_rows: int,
) -> list[Row]:
    import redis.asyncio as aioredis

    from servemesh.batch.scorer import load_scorer
    from servemesh.contract.control_credential import control_metadata, ensure_control_token
    from servemesh.contract.demo import DEMO_FEATURES, demo_artifact, demo_features, demo_signature
    from servemesh.identity import dial_registry
    from servemesh.procs import RedisServer, Supervisor
    from servemesh.registry.app import build_server
    from servemesh.registry.client import push_version
    from servemesh.registry.records import TensorSpec
    from servemesh.services.feature.store import RedisFeatureStore
    from servemesh.services.model.artifacts import open_artifact
    from servemesh.spec import (
        FeatureStoreSpec,
        FeatureViewSpec,
        MeshSpec,
        ModelInputSpec,
        ModelSpec,
        ModelVersionSpec,
        Ports,
        Replicas,
        dump_spec,
        resolve,
    )
    from servemesh.state.paths import MeshPaths

    wine_example = _wine_example()
    CHEMISTRY, TASTING = wine_example.CHEMISTRY, wine_example.TASTING
    wine_features = [*CHEMISTRY, *TASTING]
    with Supervisor(folder / "logs") as supervisor:
        redis_server = RedisServer(supervisor, folder / "redis")
        redis_server.start(timeout_s=15)
        url = f"redis://:{redis_server.password}@{redis_server.host}:{redis_server.port}/0"
        state_dir = folder / "state"
        state_dir.mkdir()
        spec = resolve(
            MeshSpec(
                zones=["zone-a"],
                ports=Ports.free(),
                state_dir=str(state_dir),
                gateway=Replicas(per_zone={"zone-a": 1}),
                feature=Replicas(per_zone={"zone-a": 1}),
                model_servers=Replicas(per_zone={"zone-a": 1}),
                models={
                    "fraud": ModelSpec(
                        versions={"v1": ModelVersionSpec(source="registry")}, traffic={"v1": 100}
                    ),
                    "wine": ModelSpec(
                        inputs={
                            "chemistry": ModelInputSpec(view="lot", features=list(CHEMISTRY)),
                            "tasting": ModelInputSpec(view="lot", features=list(TASTING)),
                        },
                        versions={"v1": ModelVersionSpec(source="registry")},
                        traffic={"v1": 100},
                    ),
                },
                feature_views={
                    "user": FeatureViewSpec(features=list(DEMO_FEATURES)),
                    "lot": FeatureViewSpec(features=wine_features),
                },
                feature_store=FeatureStoreSpec(
                    redis_url=url, key_prefix=f"b{uuid.uuid4().hex[:8]}"
                ),
            )
        )
        MeshPaths(state_dir).resolved_spec.write_text(dump_spec(spec))
        token = ensure_control_token(state_dir)
        server = await build_server(spec, spec.registry_instance)
        await server.start()
        channel = dial_registry(spec).aio_channel()
        client = aioredis.Redis.from_url(url)
        try:
            await push_version(
                channel, model="fraud", version="v1", data=demo_artifact(1).data,
                credential=control_metadata(token), **demo_signature(64),  # type: ignore[arg-type]
            )  # fmt: skip
            wine_file = await asyncio.to_thread(_wine_artifact, folder)
            data = wine_file.read_bytes()
            # The bench's own export: opened (and checked) as the registry's loaders open it,
            # for the signature it records.
            opened = await asyncio.to_thread(open_artifact, data)
            assert opened.signature is not None  # a torch.export program records one
            sig = opened.signature
            await push_version(
                channel, model="wine", version="v1", data=data, format=opened.format,
                inputs=[TensorSpec(t.name, t.datatype, t.shape) for t in sig.inputs],
                outputs=[TensorSpec(t.name, t.datatype, t.shape) for t in sig.outputs],
                credential=control_metadata(token),
            )  # fmt: skip
            store = RedisFeatureStore(client, spec.feature_store.key_prefix)
            demo = demo_features(rows, 7)
            views: dict[str, tuple[list[str], np.ndarray, list[str]]] = {
                "user": (list(demo), np.stack(list(demo.values())), list(DEMO_FEATURES)),
            }
            wine = _wine_example().load()
            both = np.concatenate([wine.chemistry, wine.tasting], axis=1)
            tiled = both[np.arange(rows) % len(both)]
            views["lot"] = ([f"L-{i:06d}" for i in range(rows)], tiled, wine_features)
            now = time.time_ns() // 1_000_000
            for view, (ids, values, features) in views.items():
                load_ = await store.begin_load(view, features, "bench")
                try:
                    for start in range(0, rows, 2000):
                        end = start + 2000
                        event = np.full(len(ids[start:end]), now, dtype=np.int64)
                        await load_.add(ids[start:end], values[start:end], event)
                    await load_.commit()
                finally:
                    await load_.abort()
            results = []
            for model, view in (("fraud", "user"), ("wine", "lot")):
                # The limit: the same sandboxed child a run scores with, called in a loop.
                scorer = await load_scorer(
                    channel, spec, model, "v1", num_threads=threads, batch_size=max(batch_sizes)
                )
                ids, values, features = views[view]
                matrices = {
                    vi.name: np.ascontiguousarray(
                        values[:, [features.index(f) for f in vi.features]], dtype=np.float32
                    )
                    for vi in scorer.inputs
                }
                try:
                    results += await _rounds(
                        model, scorer, matrices, batch_sizes, repeats, rows, folder, chunk_rows,
                        spec, channel, client, threads,
                    )  # fmt: skip
                finally:
                    await asyncio.to_thread(scorer.close)
            return results
        finally:
            await client.aclose()
            await channel.close()
            await server.drain()


async def _rounds(
    model: str,
    scorer: Any,
    matrices: dict[str, np.ndarray],
    batch_sizes: list[int],
    repeats: int,
    rows: int,
    folder: Path,
    chunk_rows: int,
    spec: Any,
    channel: Any,
    client: Any,
    threads: int | None,
) -> list[Row]:
    """Each batch size's rounds, the whole run and the limit interleaved."""
    from servemesh.batch.checkpoint import RunDir
    from servemesh.batch.job import ScoreJob, run_score

    results: list[Row] = []
    await asyncio.to_thread(_limit, scorer, matrices, max(batch_sizes))  # warm-up
    for size in batch_sizes:
        batch_rates: list[float] = []
        limit_rates: list[float] = []
        for r in range(repeats):
            job = ScoreJob(model=model, out=str(folder / f"{model}-{size}-{r}.parquet"),
                           batch_size=size, chunk_rows=chunk_rows)  # fmt: skip
            result = await run_score(
                job, spec=spec, registry=channel, redis=client,
                run_dir=RunDir(folder / f"run-{model}-{size}-{r}"), num_threads=threads,
            )  # fmt: skip
            batch_rates.append(result.rows / result.seconds)
            (folder / f"{model}-{size}-{r}.parquet").unlink()
            limit_rates.append(await asyncio.to_thread(_limit, scorer, matrices, size))
        results.append(Row(model, size, rows, batch_rates, limit_rates))
    return results


def _limit(scorer: Any, matrices: dict[str, np.ndarray], size: int) -> float:
    """rows/s of the model alone: every row, in batches of `size`, in a tight loop."""
    n = len(next(iter(matrices.values())))
    started = time.perf_counter()
    for start in range(0, n, size):
        scorer.score({k: v[start : start + size] for k, v in matrices.items()})
    return n / (time.perf_counter() - started)


def as_report(rows: list[Row]) -> BenchReport:
    """The rows for people: a line each, batch rows/s against the model's own limit."""
    lines = [
        f"{'model':<6} {'batch':>5} {'rows':>7} {'batch rows/s':>13} {'spread':>7} "
        f"{'limit rows/s':>13} {'spread':>7} {'ratio':>6}"
    ]
    for row in rows:
        b, lim = row.batch_rows_s, row.limit_rows_s
        flag = " (noisy)" if max(spread(b), spread(lim)) > SPREAD_LIMIT else ""
        below = "" if row.ratio >= GOAL else f" < {GOAL}"
        lines.append(
            f"{row.model:<6} {row.batch:>5} {row.rows:>7,} {statistics.median(b):>13,.0f} "
            f"{spread(b):>7.0%} {statistics.median(lim):>13,.0f} {spread(lim):>7.0%} "
            f"{row.ratio:>5.2f}x{below}{flag}"
        )
    lines.append(
        f"batch: the whole run (reads, forward passes, Parquet, checkpoints, put in place), "
        f"the model called in batches of that size; limit: the model "
        f"alone on the same rows; median of {len(rows[0].batch_rows_s) if rows else 0} rounds, "
        f"spread (max-min)/median, noisy above {SPREAD_LIMIT:.0%}; goal ratio >= {GOAL}"
    )
    shown = BenchReport("servemesh bench batch", [asdict(r) | {"ratio": r.ratio} for r in rows])
    shown.note("\n".join(lines))
    return shown


def main(
    *,
    rows: int | None,
    batch_size: list[int] | None,
    repeats: int,
    threads: int | None,
    chunk_rows: int | None = None,
) -> BenchReport:
    """Batch scoring in process; `rows` default 20000, `batch_size` default 64 and 1024."""
    from servemesh.batch.job import DEFAULT_CHUNK_ROWS

    with tempfile.TemporaryDirectory(prefix="servemesh-bench-batch-") as tmp:
        folder = Path(tmp)
        folder.chmod(0o700)
        results = asyncio.run(
            _measure(
                rows or 20_000,
                batch_size or [64, 1024],
                repeats,
                threads,
                folder,
                chunk_rows or DEFAULT_CHUNK_ROWS,
            )
        )
    return as_report(results)
