"""CPU of the prediction log in one gateway process: the request path's share (a watch and
its record), and the writer thread's per flush (rows, the Parquet file, the merge check,
the status file), at two batch sizes.

    python -m tests.predlog.bench_writer [--rounds 20]

A flush's batch is what one `flush_interval_ms` (500 ms) collects: 75 records at 150 req/s
per gateway, 500 at 1,000. CPU is the whole process's (time.process_time, so that any
thread pyarrow uses counts too), medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from servemesh.predlog.buffer import PredictionLog
from servemesh.predlog.parquet_store import ParquetStore
from servemesh.predlog.record import RowContext, to_row
from servemesh.spec import PredictionLogSpec
from servemesh_api.gateway.v1 import gateway_pb2

CONTEXT = RowContext("gateway-zone-a-0", "zone-a", entity_of_model={"fraud": "user"})
METADATA = (
    ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"),
    ("x-request-id", "7d1c6d0e-5d0c-4c8e-9f3c-3f3b6b2f1a11"),
)


def _answer() -> gateway_pb2.PredictResponse:
    answer = gateway_pb2.PredictResponse(
        scores=[0.638087],
        model_version="v1",
        model_replica="model-fraud-zone-a-0",
        model_zone="zone-a",
    )
    score = answer.outputs["score"]
    score.datatype = "FP32"
    score.shape.extend([1, 1])
    score.float_values.append(0.638087)
    return answer


def main(rounds: int) -> None:
    answer = _answer()
    with tempfile.TemporaryDirectory() as root:
        store = ParquetStore(Path(root), "gateway-zone-a-0")
        log = PredictionLog(PredictionLogSpec(), store, CONTEXT, Path(root) / "status.json")

        def record(i: int) -> None:
            request = gateway_pb2.PredictRequest(model="fraud", entity_ids=[f"user-{i}"])
            log.watch(request, f"request-{i}", METADATA).answered(answer)

        started = time.process_time()
        for i in range(5000):
            record(i)
            if len(log._buffer) >= 1000:
                log._buffer.clear()
        per_call = (time.process_time() - started) / 5000 * 1e6
        print(f"request path: {per_call:.1f} µs per call (building the request included)")
        for batch in (75, 500):
            seen: list[tuple[float, float, float, float]] = []
            for _ in range(rounds):
                log._buffer.clear()
                for i in range(batch):
                    record(i)
                captured = list(log._buffer)
                t0 = time.process_time()
                rows = [to_row(c, CONTEXT) for c in captured]
                t1 = time.process_time()
                store.write(rows)
                t2 = time.process_time()
                store.compact()
                t3 = time.process_time()
                log._write_status(time.time())
                t4 = time.process_time()
                seen.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
            rows_ms, write_ms, compact_ms, status_ms = (
                statistics.median(s[k] for s in seen) * 1000 for k in range(4)
            )
            total = rows_ms + write_ms + compact_ms + status_ms
            print(
                f"flush of {batch}: rows {rows_ms:.2f} ms ({rows_ms / batch * 1000:.1f} µs each), "
                f"parquet {write_ms:.2f} ms, merge check {compact_ms:.2f} ms, "
                f"status {status_ms:.2f} ms; {total / batch * 1000:.1f} µs per record"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    main(parser.parse_args().rounds)
