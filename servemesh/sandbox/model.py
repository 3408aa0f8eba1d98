"""Running a model in a sandboxed child and getting only its outputs back.

    with SandboxedModel.open(data, declared=signature, model="churn", version="v9") as m:
        m.format, m.signature        # what the child found in the artifact
        m.probe()                    # {"y": array}: two rows, zeros and ones
        m.run({"x": rows})           # {"y": array}: at most max_batch_size rows
        m.ask("export", ...)         # an op of a child entry of a layer above (`entry`)

The child (`servemesh.sandbox.child`) is a fresh interpreter, not a fork: nothing of this
process's memory (a Redis password, the control token, a private key) is in it. It gets
no environment but a path and a locale, no descriptor but its three pipes, `/` as its
directory, and, when this process is root, a user of its own with no groups or
capabilities (`procs.sandbox.offline_user`). It confines itself before it reads the
model (`confine`). Its answers are frames of raw arrays checked against a size limit
(`frames`), never pickles.

Errors: `ModelRefused` (the guard refused the artifact: the model never ran),
`ModelFailed` (the model raised, or broke its signature, on a batch), `ModelCrashed` (the
child died: a crash, a forbidden system call, a limit; the message says which).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from types import TracebackType
from typing import Any

import numpy as np

from servemesh.contract.errors import ServemeshError
from servemesh.procs.sandbox import RunAs, offline_user
from servemesh.procs.spawn import with_death_signal
from servemesh.sandbox.frames import Frame, FrameError, FrameReader, PeerGone, write_frame
from servemesh.services.model.tensors import Signature, TensorSig
from servemesh.services.runtime.confine import SandboxPolicy

CHILD_ENTRY: tuple[str, ...] = ("-m", "servemesh.sandbox.child")
# Starting an interpreter and importing torch takes seconds on a small box; a load or a
# batch that takes longer than this is a model that hangs.
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_MAX_REPLY_BYTES = 1 << 30
_STDERR_KEPT = 16 * 1024

# Children are started from one thread that lives as long as this process: the parent-death
# signal follows the thread that forked the child, and a child opened from a short-lived
# thread (a Dask task's, an executor's) would be killed when that thread ended.
_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _popen(argv: list[str]) -> subprocess.Popen[bytes]:
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawner")
        spawner = _spawner
    return spawner.submit(
        subprocess.Popen,
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_environment(),
        cwd="/",
        close_fds=True,
        start_new_session=True,
    ).result()


class SandboxedModelError(ServemeshError, RuntimeError):
    """Running a model in its sandbox did not give an answer; the message says why."""


class ModelRefused(SandboxedModelError):
    """The artifact was refused before any of its code ran."""


class ModelFailed(SandboxedModelError):
    """The model raised an error (or broke its signature) on a batch."""

    def __init__(self, kind: str, message: str, error: str = "") -> None:
        super().__init__(message)
        self.kind = kind  # model, signature or protocol
        self.error = error  # the exception's type name, as the model raised it


class ModelCrashed(SandboxedModelError):
    """The sandboxed process died; `signal_name` says how, when a signal ended it."""

    def __init__(self, message: str, signal_name: str | None) -> None:
        super().__init__(message)
        self.signal_name = signal_name


def clean_environment() -> dict[str, str]:
    """The whole environment the child gets: nothing of the caller's (no credentials)."""
    return {"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": "/nonexistent"}


class SandboxedModel:
    """A model loaded in a sandboxed child; `open` starts it, `close` ends it."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        reader: FrameReader,
        stderr: collections.deque[bytes],
        timeout_s: float,
    ) -> None:
        self._process = process
        self._reader = reader
        self._stderr = stderr
        self._timeout_s = timeout_s
        self.max_batch_size = 64
        self.format = ""
        self.signature: Signature | None = None
        self.run_as: RunAs | None = None

    @classmethod
    def open(
        cls,
        data: bytes,
        *,
        declared: Signature | None = None,
        model: str = "model",
        version: str = "v",
        max_batch_size: int = 64,
        num_threads: int | None = 1,
        inject_latency_ms: float = 0.0,
        policy: SandboxPolicy | None = None,
        run_as: RunAs | None | str = "auto",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        entry: Sequence[str] = CHILD_ENTRY,
        load_timeout_s: float | None = None,
    ) -> SandboxedModel:
        """Start the child and load `data` in it. ModelRefused when the guard refuses it.

        `run_as`: "auto" (a user of its own when this process is root), None (this
        process's user) or a RunAs. `entry`: what the interpreter runs (tests give a
        script of their own that confines itself the same way; a layer with ops of its own,
        its child module). `max_batch_size`: the most rows one `run` may carry (the child
        refuses more). `num_threads`: torch's intra-op threads in the child (None: torch's
        default, every core). `inject_latency_ms`: the spec's drill knob, slept before
        each batch as a model server does. `timeout_s` bounds each request; the load (a
        fresh interpreter's imports, the guard, the model's load) is bounded by
        `load_timeout_s` instead when given: on a busy host it may take longer than a run.
        """
        user = offline_user() if run_as == "auto" else run_as
        assert not isinstance(user, str)
        argv = [sys.executable, "-I", "-B", *entry]
        process = _popen(with_death_signal(argv, signal.SIGKILL, user))
        assert process.stdout is not None and process.stderr is not None
        stderr: collections.deque[bytes] = collections.deque()
        threading.Thread(
            target=_drain, args=(process.stderr, stderr), name="sandbox-stderr", daemon=True
        ).start()
        sandboxed = cls(process, FrameReader(process.stdout.fileno(), max_reply_bytes), stderr,
                        timeout_s)  # fmt: skip
        sandboxed.run_as = user
        try:
            sandboxed._timeout_s = load_timeout_s if load_timeout_s is not None else timeout_s
            sandboxed._load(
                data, declared, model, version, max_batch_size, num_threads, inject_latency_ms,
                policy,
            )  # fmt: skip
            sandboxed._timeout_s = timeout_s
        except BaseException:
            sandboxed.close()
            raise
        return sandboxed

    @property
    def pid(self) -> int:
        return self._process.pid

    def _load(
        self,
        data: bytes,
        declared: Signature | None,
        model: str,
        version: str,
        max_batch_size: int,
        num_threads: int | None,
        inject_latency_ms: float,
        policy: SandboxPolicy | None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size: at least 1")
        header: dict[str, Any] = {
            "op": "load",
            "policy": asdict(policy or SandboxPolicy()),
            "model": model,
            "version": version,
            "max_batch_size": max_batch_size,
            "num_threads": num_threads,
            "inject_latency_ms": inject_latency_ms,
        }
        if declared is not None:
            header["declared"] = _described(declared)
        answer = self._ask(Frame(header, blob=data))
        if not answer.header.get("ok"):
            message = str(answer.header.get("message", ""))
            if answer.header.get("kind") == "artifact":
                raise ModelRefused(message)
            raise _failure(answer.header)
        self.max_batch_size = max_batch_size
        self.format = str(answer.header.get("format", ""))
        self.signature = _signature_from(answer.header.get("signature"))

    def probe(self) -> dict[str, np.ndarray]:
        """The model's answer to two rows (zeros, ones) of every input, by output name."""
        return self._outputs(self._ask(Frame({"op": "probe"})))

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's outputs for `inputs` (rows first, at most `max_batch_size`), by
        output name."""
        rows = max((len(a) if np.ndim(a) else 0 for a in inputs.values()), default=0)
        if rows > self.max_batch_size:
            raise ValueError(f"{rows} rows in one run; at most {self.max_batch_size}")
        return self._outputs(self._ask(Frame({"op": "run"}, dict(inputs))))

    def ask(
        self,
        op: str,
        header: Mapping[str, Any] | None = None,
        arrays: Mapping[str, np.ndarray] | None = None,
        blob: bytes = b"",
    ) -> Frame:
        """The answer to an op of the child's entry beyond probe and run (its arrays and
        bytes, checked against the reply limit; never unpickled). ModelFailed when the op
        refused (`kind` "refused") or the model raised."""
        answer = self._ask(Frame({**(header or {}), "op": op}, dict(arrays or {}), blob))
        if not answer.header.get("ok"):
            raise _failure(answer.header)
        return answer

    def _outputs(self, answer: Frame) -> dict[str, np.ndarray]:
        if not answer.header.get("ok"):
            raise _failure(answer.header)
        assert self.signature is not None
        expected = {t.name for t in self.signature.outputs}
        if set(answer.arrays) != expected:
            raise ModelFailed(
                "signature",
                f"answered outputs {sorted(answer.arrays)}, the signature has {sorted(expected)}",
            )
        return answer.arrays

    def _ask(self, frame: Frame) -> Frame:
        assert self._process.stdin is not None
        deadline = time.monotonic() + self._timeout_s
        try:
            write_frame(self._process.stdin, frame)  # type: ignore[arg-type]
            return self._reader.read(deadline)
        except (BrokenPipeError, PeerGone):
            raise self._crashed() from None
        except TimeoutError:
            self._process.kill()
            self._process.wait()
            raise ModelCrashed(
                f"the sandboxed model gave no answer within {self._timeout_s:g} s and was stopped",
                "SIGKILL",
            ) from None
        except FrameError as exc:
            raise ModelFailed("protocol", f"the sandboxed model answered garbage: {exc}") from None

    def _crashed(self) -> ModelCrashed:
        code = self._process.wait()
        tail = b"".join(self._stderr).decode(errors="replace").strip().splitlines()
        last = f"; its last words: {tail[-1][:200]}" if tail else ""
        if code < 0:
            name = signal.Signals(-code).name
            why = {
                "SIGSYS": "it made a system call the sandbox forbids (the syscall filter ended it)",
                "SIGSEGV": "it crashed (a segmentation fault)",
                "SIGABRT": "it aborted",
                "SIGKILL": "it was killed (out of memory, or stopped)",
                "SIGXFSZ": "it wrote past the sandbox's file size limit",
            }.get(name, f"it was ended by {name}")
            return ModelCrashed(f"the sandboxed model died: {why}{last}", name)
        return ModelCrashed(f"the sandboxed model exited with status {code}{last}", None)

    def close(self) -> None:
        """End the child: close its pipe, give it a moment, then kill it (by PID)."""
        process = self._process
        if process.stdin is not None and not process.stdin.closed:
            try:
                process.stdin.close()
            except BrokenPipeError:
                pass
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()

    def __enter__(self) -> SandboxedModel:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _failure(header: Mapping[str, Any]) -> ModelFailed:
    return ModelFailed(
        str(header.get("kind", "model"))[:40],
        str(header.get("message", ""))[:300],
        str(header.get("error", ""))[:80],
    )


def _drain(stream: Any, kept: collections.deque[bytes]) -> None:
    """Keep the last few KiB the child wrote to stderr (its last words), drop the rest."""
    size = 0
    for chunk in iter(lambda: stream.read1(4096), b""):
        kept.append(chunk)
        size += len(chunk)
        while size > _STDERR_KEPT and len(kept) > 1:
            size -= len(kept.popleft())
    stream.close()


def _described(signature: Signature) -> dict[str, list[dict[str, Any]]]:
    return {
        kind: [
            {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
            for t in getattr(signature, kind)
        ]
        for kind in ("inputs", "outputs")
    }


def _signature_from(described: object) -> Signature:
    """The signature the child reports, held to the same checks as a declared one."""
    try:
        assert isinstance(described, dict)
        specs = {
            kind: [
                TensorSig(str(t["name"]), str(t["datatype"]), tuple(int(d) for d in t["shape"]))
                for t in described[kind]
            ]
            for kind in ("inputs", "outputs")
        }
        return Signature.from_specs(specs["inputs"], specs["outputs"], where="the model")
    except (AssertionError, KeyError, TypeError, ValueError) as exc:
        raise ModelFailed(
            "protocol", f"the sandboxed model reported no valid signature: {exc}"
        ) from None
