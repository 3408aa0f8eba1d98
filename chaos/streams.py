"""Stream drills: a producer at a fixed rate into a stream of the drill's mesh, its
consumer killed and restarted, and what came out (servemesh/streams/).

| fault | restore |
| --- | --- |
| kill_stream_consumer (SIGKILL) | restart_stream_consumer |

`start_stream_load` runs the producer (bounded: rate x seconds events) and samples the
group's lag every LAG_EVERY_S onto the drill; `stream_settled` waits until every event was
handled; `stream_delivery` says whether each had exactly one output; `stream_lag` gives the
lag's peak and its recovery, and writes `stream-lag.md` and `stream-lag.png` beside the
drill's report.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from servemesh.chaos.drill import current
from servemesh.chaos.errors import DrillError
from servemesh.streams.keys import StreamKeys
from servemesh.streams.metrics import read_lag_now
from servemesh.streams.produce import delivery, produce

LAG_EVERY_S = 0.25

__all__ = [
    "start_stream_load",
    "stop_stream_load",
    "kill_stream_consumer",
    "restart_stream_consumer",
    "stream_settled",
    "stream_delivery",
    "stream_lag",
    "stream_exactly_once",
    "stream_consumer_running",
]


@dataclass
class _StreamLoad:
    keys: StreamKeys
    client: Any
    stop: threading.Event = field(default_factory=threading.Event)
    ids: list[str] = field(default_factory=list)
    # (drill time s, pending, undelivered, oldest pending age s)
    samples: list[tuple[float, int, int, float]] = field(default_factory=list)
    producer: threading.Thread | None = None
    sampler: threading.Thread | None = None
    produced: threading.Event = field(default_factory=threading.Event)


_loads: dict[str, _StreamLoad] = {}


def _client() -> Any:
    spec = current().spec
    return redis.Redis.from_url(spec.redis_url, password=spec.redis_password())


def _lag(client: Any, keys: StreamKeys) -> tuple[int, int, float]:
    """Pending, undelivered and the oldest pending entry's age: one consistent reading."""
    lag = read_lag_now(client, keys)
    if lag is None:
        return 0, 0, 0.0
    return lag.pending, lag.undelivered or 0, lag.oldest_pending_age_s


def start_stream_load(
    stream: str = "events", rate: float = 500, seconds: float = 10
) -> dict[str, Any]:
    """Produce `rate` events/s for `seconds` in the background; sample the lag meanwhile."""
    drill = current()
    keys = StreamKeys.of(drill.spec.stream(stream))
    load = _StreamLoad(keys=keys, client=_client())
    entities = max(1, drill.spec.demo.entities)

    def run_producer() -> None:
        try:
            load.ids += produce(load.client, keys, float(rate), float(seconds), entities, load.stop)
        finally:
            load.produced.set()

    def run_sampler() -> None:
        client = _client()
        try:
            while not load.stop.wait(LAG_EVERY_S):
                try:
                    pending, undelivered, age = _lag(client, keys)
                except redis.RedisError:
                    continue
                load.samples.append((drill.now_s(), pending, undelivered, age))
        finally:
            client.close()

    load.producer = threading.Thread(target=run_producer, name="stream-producer", daemon=True)
    load.sampler = threading.Thread(target=run_sampler, name="stream-lag", daemon=True)
    _loads[stream] = load
    drill.timeline.mark(f"stream load: {rate:.0f} events/s for {seconds:.0f} s", "phase")
    load.producer.start()
    load.sampler.start()
    return {"stream": stream, "rate": rate, "seconds": seconds}


def stop_stream_load(stream: str = "events") -> dict[str, Any]:
    """Stop the producer and the sampler (safe to run twice)."""
    load = _loads.get(stream)
    if load is None:
        return {"stopped": False}
    load.stop.set()
    for thread in (load.producer, load.sampler):
        if thread is not None:
            thread.join(timeout=10)
    return {"stopped": True, "sent": len(load.ids)}


def kill_stream_consumer(stream: str = "events", after_outputs: int = 200) -> dict[str, Any]:
    """SIGKILL the stream's consumer once it has written `after_outputs` outputs (mid-stream)."""
    drill = current()
    load = _loads.get(stream)
    keys = StreamKeys.of(drill.spec.stream(stream))
    client = load.client if load is not None else _client()
    deadline = time.monotonic() + 60
    while client.xlen(keys.output) < after_outputs:
        if time.monotonic() > deadline:
            raise DrillError(f"stream {stream}: no {after_outputs} outputs within 60 s")
        if drill.sleep(0.05) is False:
            break
    name = f"stream-{stream}"
    drill.timeline.open_window(f"kill:{name}", f"kill {name}")
    return {"killed": {name: drill.kill(name)}}


def restart_stream_consumer(stream: str = "events", timeout_s: float = 60) -> dict[str, Any]:
    """Start the stream's consumer again if it is down (safe to run twice)."""
    drill = current()
    mesh = drill.running_mesh
    name = f"stream-{stream}"
    started = {}
    if not mesh.is_running(name):
        started[name] = mesh.restart(name, timeout_s=timeout_s)
    drill.timeline.close_window(f"kill:{name}")
    return {"restarted": started}


def stream_settled(stream: str = "events", timeout_s: float = 120) -> float:
    """Seconds until the producer is done and every event is handled (nothing pending,
    nothing undelivered); -1 when that does not happen within `timeout_s`."""
    load = _loads[stream]
    began = time.monotonic()
    load.produced.wait(timeout_s)
    while time.monotonic() - began < timeout_s:
        pending, undelivered, _ = _lag(load.client, load.keys)
        if load.produced.is_set() and pending == 0 and undelivered == 0:
            # What was seen here is a sample too: the sampler's next one may come after
            # it stopped, and the lag's recovery would then have no point at its end.
            load.samples.append((current().now_s(), 0, 0, 0.0))
            return round(time.monotonic() - began, 2)
        time.sleep(0.05)
    return -1.0


def stream_delivery(stream: str = "events") -> dict[str, Any]:
    """Every event sent, and how many had no output or more than one."""
    load = _loads[stream]
    found = delivery(load.client, load.keys, load.ids)
    dead = int(load.client.xlen(load.keys.dead_letter))
    return {
        "sent": found.sent,
        "with_output": len(found.outputs),
        "missing": found.missing,
        "duplicated": found.duplicated,
        "dead_letters": dead,
        "exactly_once": found.exactly_once and found.sent > 0,
    }


def stream_exactly_once(stream: str = "events") -> bool:
    """The steady-state check: one output per event sent, none lost, none twice."""
    return bool(stream_delivery(stream)["exactly_once"])


def stream_lag(stream: str = "events") -> dict[str, Any]:
    """The lag's peak (pending + undelivered), when it peaked, and when it was back to its
    level before the kill; writes stream-lag.md and stream-lag.png beside the report."""
    drill = current()
    load = _loads[stream]
    samples = list(load.samples)
    if not samples:
        return {"samples": 0}
    backlog = [(t, p + u, age) for t, p, u, age in samples]
    peak_t, peak, _ = max(backlog, key=lambda s: s[1])
    oldest = max(age for _, _, age in backlog)
    windows = [w for w in drill.windows if w.label.startswith(f"kill stream-{stream}")]
    killed_at = windows[0].start_s if windows else None
    before = [b for t, b, _ in backlog if killed_at is not None and t < killed_at]
    normal = max(before[-8:], default=0) if before else 0
    recovered_at = next((t for t, b, _ in backlog if t > peak_t and b <= max(normal, 64)), None)
    found = {
        "samples": len(samples),
        "killed_at_s": killed_at,
        "backlog_before_kill": normal,
        "peak_backlog": peak,
        "peak_at_s": round(peak_t, 2),
        "peak_oldest_pending_s": round(oldest, 2),
        "recovered_at_s": round(recovered_at, 2) if recovered_at is not None else None,
        "recovery_s": round(recovered_at - peak_t, 2) if recovered_at is not None else None,
    }
    _write_lag_files(drill.out_dir, stream, samples, found)
    return found


def _write_lag_files(out_dir: Any, stream: str, samples: list[Any], found: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    ts = [s[0] for s in samples]
    ax.plot(ts, [s[1] + s[2] for s in samples], label="backlog (pending + undelivered)")
    ax.plot(ts, [s[1] for s in samples], label="pending", linestyle="--")
    if found.get("killed_at_s") is not None:
        ax.axvline(found["killed_at_s"], color="red", label="consumer SIGKILL")
    ax.set_xlabel("drill time (s)")
    ax.set_ylabel("events")
    ax.set_title(f"stream {stream}: lag around the consumer's crash")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out_dir / "stream-lag.png", dpi=100)
    plt.close(fig)
    lines = [
        f"# Stream {stream}: lag around the consumer's crash",
        "",
        "![lag](stream-lag.png)",
        "",
        "| what | value |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in found.items()),
        "",
        "| t (s) | pending | undelivered | oldest pending (s) |",
        "| --- | --- | --- | --- |",
        *(
            f"| {t:.2f} | {p} | {u} | {a:.2f} |"
            for t, p, u, a in samples[:: max(1, len(samples) // 40)]
        ),
    ]
    (out_dir / "stream-lag.md").write_text("\n".join(lines) + "\n")


def stream_consumer_running(stream: str = "events") -> bool:
    """The stream's consumer process runs (the steady state, before and after)."""
    return current().running_mesh.is_running(f"stream-{stream}")
