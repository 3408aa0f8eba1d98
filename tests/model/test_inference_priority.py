"""The thread that runs a model has a lower CPU priority than the server's event loop
(`batching.inference_nice`), read back from the kernel (/proc) for each thread."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pydantic
import pytest

from servemesh.services.model.batching import Batcher
from servemesh.services.model.batching.rows import Rows
from servemesh.services.model.batching.worker import Worker
from servemesh.spec import BatchingSpec


def _nice_of(tid: int) -> int:
    """The nice value the kernel holds for one thread of this process."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[16])  # field 19 of proc(5)


def _own_nice() -> int:
    return _nice_of(threading.get_native_id())


class _Doubling:
    def run(self, batch: Rows) -> Rows:
        assert isinstance(batch, np.ndarray)
        return batch * 2


def _thread_named(name: str) -> threading.Thread:
    return next(t for t in threading.enumerate() if t.name == name)


async def test_a_batchers_model_thread_runs_at_the_specs_nice_and_the_loop_keeps_its_own() -> None:
    loop_nice = _own_nice()
    batcher = Batcher(_Doubling(), BatchingSpec(inference_nice=7), name="nice-test")
    try:
        thread = _thread_named("infer-nice-test")
        assert thread.native_id is not None
        assert _nice_of(thread.native_id) == min(19, loop_nice + 7)
        assert _own_nice() == loop_nice
        # The lowered thread still runs the model and answers.
        out = await batcher.submit(np.ones((1, 3), dtype=np.float32), 1e12, "r1")
        assert isinstance(out, np.ndarray) and out.tolist() == [[2.0, 2.0, 2.0]]
    finally:
        await batcher.close()


async def test_by_default_the_model_thread_keeps_the_loops_priority() -> None:
    loop_nice = _own_nice()
    assert BatchingSpec().inference_nice == 0
    level, lowered = Worker("infer-default"), Worker("infer-10", nice=10)
    try:
        assert level.niceness == _nice_of(_thread_named("infer-default").native_id or 0)
        assert level.niceness == loop_nice
        assert lowered.niceness == _nice_of(_thread_named("infer-10").native_id or 0)
        assert lowered.niceness == min(19, loop_nice + 10)
    finally:
        level.stop()
        lowered.stop()


@pytest.mark.parametrize("value", [-1, 20])
def test_a_nice_value_out_of_range_is_refused_naming_the_field(value: int) -> None:
    with pytest.raises(pydantic.ValidationError, match="inference_nice"):
        BatchingSpec(inference_nice=value)
