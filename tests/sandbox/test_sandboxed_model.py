"""Model code runs in a sandboxed child: its own user, no secrets, rlimits, a syscall filter
(servemesh/sandbox/). The hostile child (hostile_child.py) confines itself as the real one
does, then tries, in arbitrary Python, what a model with a memory-corruption primitive
could: read secrets, write files, reach the network, start programs, signal its caller.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from servemesh.contract.demo import build_fraud_model, demo_artifact
from servemesh.sandbox.child import may_be_torch_export
from servemesh.sandbox.model import ModelCrashed, ModelFailed, ModelRefused, SandboxedModel
from servemesh.services.model.tensors import Signature, TensorSig
from tests.model.torch_models import Churn, churn_example, exported
from tests.sandbox import hostile_child
from tests.sandbox.spy import status_of

pytestmark = pytest.mark.timeout(300)

HOSTILE = str(Path(hostile_child.__file__).resolve())
FRAUD = Signature(TensorSig("x", "FP32", (-1, 64)), TensorSig("y", "FP32", (-1, 1)))
ROOT = os.geteuid() == 0


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[bytes, Path]]:
    """A credential the caller holds: in its environment, its memory and a private file."""
    value = hostile_child.MARKER + secrets.token_hex(16).encode()
    monkeypatch.setenv("SERVEMESH_TEST_REDIS_PASSWORD", value.decode())
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    path = folder / "control.token"
    path.write_bytes(value)
    path.chmod(0o600)
    yield value, path


def hostile(*argv: str, timeout_s: float = 60.0) -> SandboxedModel:
    # The load may take its time on a busy host; `timeout_s` bounds what runs after it.
    return SandboxedModel.open(
        b"", entry=(HOSTILE, *argv), timeout_s=timeout_s, load_timeout_s=max(timeout_s, 60.0)
    )


def run_attack(model: SandboxedModel, code: int) -> bytes:
    found = model.run({"attack": np.array([[code]], dtype=np.int64)})["found"]
    return bytes(found.reshape(-1)).rstrip(b"\x00")


def test_a_model_answers_from_its_sandbox_as_it_does_in_process() -> None:
    rows = torch.cat([torch.zeros(1, 64), torch.ones(1, 64)])
    with torch.no_grad():
        expected = build_fraud_model(1)(rows).numpy()
    # A TorchScript child skips torch.export's loader (half its start), told by bytes alone.
    assert not may_be_torch_export(demo_artifact(1).data)
    with SandboxedModel.open(demo_artifact(1).data, declared=FRAUD) as model:
        assert model.format == "torchscript"
        assert model.signature == FRAUD
        assert np.allclose(model.probe()["y"], expected, atol=1e-6)
        answer = model.run({"x": rows.numpy()})
        assert np.allclose(answer["y"], expected, atol=1e-6)


def test_an_exported_program_loads_and_answers_in_its_sandbox() -> None:
    # torch.export's loader imports torch._dynamo, which probes for a temporary folder by
    # writing a file: the child imports it before the filter forbids that, for any artifact
    # whose bytes may hold torch.export's layout.
    model = Churn(seed=1)
    features, category = churn_example()
    data = exported(model, (features, category))
    assert may_be_torch_export(data)
    with SandboxedModel.open(data) as sandboxed:
        assert sandboxed.format == "torch_export"
        answer = sandboxed.run({"features": features.numpy(), "category": category.numpy()})
    with torch.no_grad():
        expected = model(features, category)
    assert np.allclose(answer["output_0"], expected[0].numpy(), atol=1e-6)
    assert np.array_equal(answer["output_1"], expected[1].numpy())


def test_the_child_runs_confined_as_read_from_proc() -> None:
    with SandboxedModel.open(demo_artifact(1).data, declared=FRAUD) as model:
        status = status_of(model.pid)
        limits = Path(f"/proc/{model.pid}/limits").read_text()
        environ = Path(f"/proc/{model.pid}/environ").read_bytes().split(b"\0")
        fds = os.listdir(f"/proc/{model.pid}/fd")
    assert status["Seccomp"].strip() == "2"  # a filter is on
    assert status["NoNewPrivs"].strip() == "1"
    if ROOT:
        assert status["Uid"].split()[0] not in {"0", str(os.getuid())}
        assert int(status["CapBnd"], 16) == 0 and int(status["CapEff"], 16) == 0
    assert re.search(r"Max file size\s+0\s+0", limits), limits
    assert re.search(r"Max core file size\s+0\s+0", limits), limits
    assert not re.search(r"Max address space\s+unlimited", limits), limits
    assert sorted(e.split(b"=")[0] for e in environ if e) == [b"HOME", b"LANG", b"PATH"]
    assert len(fds) <= 4, fds  # stdin, stdout, stderr, the reply descriptor


def test_the_guard_still_refuses_inside_the_sandbox() -> None:
    with pytest.raises(ModelRefused, match="damaged archive"):
        SandboxedModel.open(b"PK\x03\x04 not an archive", declared=FRAUD)


def test_the_child_cannot_see_its_callers_secrets(secret: tuple[bytes, Path]) -> None:
    value, path = secret
    assert value in os.environ["SERVEMESH_TEST_REDIS_PASSWORD"].encode()  # the caller has it
    with hostile(str(path)) as model:
        own = run_attack(model, 1)
        callers = run_attack(model, 2)
        by_path = run_attack(model, 3)
    # It found its own copy of the marker (its code), never the caller's secret.
    assert hostile_child.MARKER in own
    assert value not in own
    assert value not in callers
    if ROOT:  # a user of its own: the caller's /proc and files are closed to it
        assert callers == b"" and by_path == b""
    else:  # one user for both: file modes cannot keep them apart (docs/security.md)
        assert by_path in (b"", value)


def test_writing_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "written"
    tmp_path.chmod(0o777)  # the child's user could write here, but for the filter
    with hostile("-", str(target)) as model:
        assert run_attack(model, 4) == b""
    assert not target.exists()


@pytest.fixture
def listener() -> Iterator[tuple[int, list[socket.socket]]]:
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    server.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()
    for conn in accepted:
        conn.close()


@pytest.mark.parametrize(
    ("code", "what"), [(5, "connect"), (6, "exec"), (7, "fork"), (8, "signal its caller")]
)
def test_the_syscall_filter_ends_a_model_that_reaches_out(
    code: int, what: str, listener: tuple[int, list[socket.socket]]
) -> None:
    port, accepted = listener
    with hostile("-", "-", str(port)) as model:
        with pytest.raises(ModelCrashed, match="system call the sandbox forbids") as caught:
            run_attack(model, code)
    assert caught.value.signal_name == "SIGSYS", what
    assert accepted == []  # the connection never reached the listener


def test_a_crash_is_the_childs_alone() -> None:
    with hostile() as model:
        with pytest.raises(ModelCrashed, match="segmentation fault") as caught:
            run_attack(model, 9)
    assert caught.value.signal_name == "SIGSEGV"


def test_a_model_that_hangs_is_stopped() -> None:
    with hostile(timeout_s=3) as model:
        model_pid = model.pid
        with pytest.raises(ModelCrashed, match="no answer within 3 s"):
            run_attack(model, 10)
    assert not Path(f"/proc/{model_pid}").exists() or "Z" in status_of(model_pid)["State"]


def test_a_run_is_bounded_by_max_batch_size_on_both_sides() -> None:
    with SandboxedModel.open(demo_artifact(1).data, declared=FRAUD, max_batch_size=4) as model:
        rows = np.zeros((5, 64), dtype=np.float32)
        with pytest.raises(ValueError, match="5 rows in one run; at most 4"):
            model.run({"x": rows})
        # The child refuses it too (a caller that skips the check gets no answer).
        with pytest.raises(ModelFailed, match="at most 4") as caught:
            model.ask("run", arrays={"x": rows})
        assert caught.value.kind == "limit"
        assert model.run({"x": rows[:4]})["y"].shape == (4, 1)


def test_an_op_of_a_child_entry_refuses_in_its_own_words() -> None:
    from servemesh.quantize import ENTRY

    with SandboxedModel.open(demo_artifact(1).data, declared=FRAUD, entry=ENTRY) as model:
        with pytest.raises(ModelFailed, match="--to 'int4' is not one of") as caught:
            model.ask("derive", {"to": "int4"})
        assert (caught.value.kind, caught.value.error) == ("refused", "QuantizeError")
        with pytest.raises(ModelFailed, match="unknown op 'nope'"):
            model.ask("nope")
        assert model.probe()["y"].shape == (2, 1)  # it answers on


def test_a_child_outlives_the_thread_that_opened_it() -> None:
    # The parent-death signal follows the thread that forked: children are forked from one
    # long-lived thread, so a Dask task's or an executor's thread may open them and end.
    opened: list[SandboxedModel] = []
    thread = threading.Thread(
        target=lambda: opened.append(SandboxedModel.open(demo_artifact(1).data, declared=FRAUD))
    )
    thread.start()
    thread.join()
    (model,) = opened
    with model:
        assert model.run({"x": np.ones((3, 64), dtype=np.float32)})["y"].shape == (3, 1)
