"""The liveness watch's verdicts (pure), its reading of a stopped process, and its probe
against a real gRPC health service."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from servemesh.contract.wire import LIVENESS_HEALTH_NAME
from servemesh.procs.liveness import LivenessVerdicts, probe_liveness, stopped_by_job_control
from tests.waiting import wait_until

NAME = "model-fraud-zone-a-0"


def test_a_process_is_due_after_the_set_number_of_failures_in_a_row() -> None:
    verdicts = LivenessVerdicts(failures=3)
    assert not verdicts.observe(NAME, 10, None)
    assert not verdicts.observe(NAME, 10, "no answer within 2 s")
    assert not verdicts.observe(NAME, 10, "NOT_SERVING")
    assert verdicts.observe(NAME, 10, "NOT_SERVING")
    # Being killed: the same process is not judged again.
    assert not any(verdicts.observe(NAME, 10, "NOT_SERVING") for _ in range(5))


def test_an_answer_in_between_starts_the_count_again() -> None:
    verdicts = LivenessVerdicts(failures=2)
    assert not verdicts.observe(NAME, 10, None)
    assert not verdicts.observe(NAME, 10, "late")
    assert not verdicts.observe(NAME, 10, None)
    assert not verdicts.observe(NAME, 10, "late")
    assert verdicts.observe(NAME, 10, "late")


def test_a_process_that_never_answered_is_still_starting() -> None:
    verdicts = LivenessVerdicts(failures=1)
    assert not any(verdicts.observe(NAME, 10, "UNAVAILABLE") for _ in range(10))
    assert not verdicts.observe(NAME, 10, None)
    assert verdicts.observe(NAME, 10, "UNAVAILABLE")


def test_a_new_pid_is_a_new_process_with_no_history() -> None:
    verdicts = LivenessVerdicts(failures=2)
    verdicts.observe(NAME, 10, None)
    verdicts.observe(NAME, 10, "late")
    assert verdicts.failures_of(NAME) == 1
    # Its replacement has not answered yet: nothing counts.
    assert not verdicts.observe(NAME, 11, "late")
    assert verdicts.failures_of(NAME) == 0


def test_a_pause_clears_the_failures_so_far_and_gone_processes_are_forgotten() -> None:
    verdicts = LivenessVerdicts(failures=2)
    verdicts.observe(NAME, 10, None)
    verdicts.observe(NAME, 10, "late")
    verdicts.paused(NAME)
    assert not verdicts.observe(NAME, 10, "late")
    verdicts.forget_others([])
    assert not verdicts.observe(NAME, 10, "late")  # forgotten: not armed any more


def test_failures_counts_from_one() -> None:
    with pytest.raises(ValueError, match="from 1"):
        LivenessVerdicts(failures=0)


def test_a_stopped_process_reads_as_stopped_and_a_continued_one_does_not() -> None:
    # Killed below by its PID; the sleep only keeps it there meanwhile.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert not stopped_by_job_control(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(lambda: stopped_by_job_control(child.pid), "the child stopped")
        os.kill(child.pid, signal.SIGCONT)
        wait_until(lambda: not stopped_by_job_control(child.pid), "the child continued")
    finally:
        child.kill()
        child.wait()
    assert not stopped_by_job_control(child.pid)  # gone: no /proc entry


@pytest.fixture
def health_server() -> Iterator[tuple[health.HealthServicer, grpc.Channel]]:
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield servicer, channel
    finally:
        channel.close()
        server.stop(None)


def test_the_probe_names_what_it_got(
    health_server: tuple[health.HealthServicer, grpc.Channel],
) -> None:
    servicer, channel = health_server
    status = health_pb2.HealthCheckResponse
    assert probe_liveness(channel, 5.0) == "NOT_FOUND"
    servicer.set(LIVENESS_HEALTH_NAME, status.SERVING)
    assert probe_liveness(channel, 5.0) is None
    servicer.set(LIVENESS_HEALTH_NAME, status.NOT_SERVING)
    assert probe_liveness(channel, 5.0) == "NOT_SERVING"
