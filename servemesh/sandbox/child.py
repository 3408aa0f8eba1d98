"""The sandboxed model process: `python -I -B -m servemesh.sandbox.child`.

Started by `servemesh.sandbox.model.SandboxedModel` with a clean environment, no
descriptors but its pipes, and (when the caller is root) a user of its own. It imports
what it needs, confines itself (`confine`) before it reads a byte of the model, then
loads the model through the same guard as a model server and answers the caller's
frames on its pipe until the caller closes it:

    load  (blob: the artifact; declared signature)  -> format, signature
    probe                                           -> the answer to two rows (zeros, ones)
    run   (arrays: the inputs, by name)             -> the outputs, by name
                                                       (at most max_batch_size rows)

A layer above adds ops of its own by running `serve(ops, prepare)` as its child entry
(`servemesh.edge.child`: export; `servemesh.quantize`: derive; each traces the model): each op
gets the loaded model (`Loaded`) and the request frame, and answers a frame of raw arrays
and bytes, in the same confined process.

An error the model raises is an answer (`ok: false`, with its kind and first line): kind
"model" for the model's own error, "refused" for a ServemeshError an op raised (our own
checks, their message meant for the operator); a crash, or a forbidden system call, ends
the process, and the caller reads why from its exit status.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from servemesh.contract.errors import ServemeshError
from servemesh.sandbox.frames import Frame, FrameReader, PeerGone, arrays_of, write_frame
from servemesh.services.runtime.confine import SandboxPolicy, confine

# Generous: the caller checks what comes back against its own limit.
_MAX_REQUEST_BYTES = 1 << 34


@dataclass(frozen=True)
class Loaded:
    """The model as the child holds it once loaded: what an op of a layer above reads."""

    runner: Any  # services.model.runner.ModelRunner
    data: bytes  # the artifact's bytes, as the guard accepted them
    format: str  # "torchscript", "torch_export" or "onnx"
    signature: Any  # services.model.tensors.Signature
    model: str
    version: str


# An op beyond load/probe/run: the loaded model and the request -> the answer (`ok` is set
# by the child). It raises a ServemeshError to refuse, saying why.
Op = Callable[[Loaded, Frame], Frame]


def main() -> int:
    return serve()


def serve(ops: Mapping[str, Op] | None = None, prepare: Callable[[], None] | None = None) -> int:
    """Answer the caller's frames until it closes the pipe. `ops`: ops beyond probe and
    run; `prepare`: imports they need, run before the walls go up (nothing may be written
    or opened for writing after)."""
    # Replies go to the descriptor stdout was; stdout itself becomes stderr, so that a
    # print anywhere (torch, a warning) cannot corrupt a frame.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.dont_write_bytecode = True
    reader = FrameReader(0, _MAX_REQUEST_BYTES)
    try:
        first = reader.read()
    except PeerGone:
        return 0
    policy = SandboxPolicy(**first.header.get("policy", {}))
    # Everything a model run touches is imported before the walls go up (imports open
    # files and the interpreter may write nothing after).
    import tempfile

    import torch

    if may_be_torch_export(first.blob):
        # torch.export's loader imports torch._dynamo, which probes /tmp: half the child's
        # start. A TorchScript artifact never needs it (`_load` refuses a mismatch).
        import torch.export.pt2_archive  # noqa: F401

    from servemesh.services.model import artifacts, runner  # noqa: F401

    if artifacts.may_be_onnx(first.blob):
        # Parsed and run behind the walls; its modules are read before them.
        import onnx  # noqa: F401
        import onnxruntime  # type: ignore[import-untyped]  # noqa: F401

    tempfile.gettempdir()  # probed once, by creating a file: not possible once confined
    if prepare is not None:
        prepare()

    threads = first.header.get("num_threads", 1)
    if threads is not None:  # None: torch's own default (every core), for a batch run
        torch.set_num_threads(int(threads))
    confine(policy)
    loaded = _load(first, replies)
    if loaded is None:
        return 0
    while True:
        try:
            frame = reader.read()
        except PeerGone:
            return 0
        _answer(loaded, frame, replies, ops or {})


# Every torch.export archive holds a file of this name under its top folder; zip names are
# stored as they are, so its bytes are in any such archive (services/model/pt2_guard.py).
_EXPORT_MARK = b"/archive_format"


def may_be_torch_export(blob: bytes) -> bool:
    """Whether `blob` may be a torch.export archive: a byte search, not a parse (nothing of
    the model is parsed before the walls go up). False only for bytes that hold no file of
    torch.export's layout, which `_load` then never loads as one."""
    return _EXPORT_MARK in blob


def _fail(replies: BinaryIO, kind: str, exc: BaseException) -> None:
    text = str(exc).strip()
    first = text.splitlines()[0][:300] if text else ""
    write_frame(replies, Frame({"ok": False, "kind": kind, "error": type(exc).__name__,
                                "message": first}))  # fmt: skip


def _load(frame: Frame, replies: BinaryIO) -> Loaded | None:
    from servemesh.services.model.artifacts import (
        ArtifactError,
        detect_format,
        open_artifact,
        reconcile_signature,
    )
    from servemesh.services.model.runner import ModelRunner
    from servemesh.services.model.tensors import Signature, TensorSig

    header = frame.header
    declared = None
    if header.get("declared"):
        specs = header["declared"]
        declared = Signature.from_specs(
            [TensorSig(i["name"], i["datatype"], tuple(i["shape"])) for i in specs["inputs"]],
            [TensorSig(o["name"], o["datatype"], tuple(o["shape"])) for o in specs["outputs"]],
        )
    try:
        if detect_format(frame.blob) == "torch_export" and not may_be_torch_export(frame.blob):
            # Not reachable for a zip (its names are stored as they are); kept so that the
            # loader torch.export needs is never imported behind the walls.
            raise ArtifactError("a torch.export archive without its archive_format file")
        threads = header.get("num_threads", 1)
        opened = open_artifact(frame.blob, "cpu", None if threads is None else int(threads))
        signature = reconcile_signature(opened.signature, declared)
    except ArtifactError as exc:
        _fail(replies, "artifact", exc)
        return None
    model = ModelRunner(
        opened.module,
        model=str(header.get("model", "model")),
        version=str(header.get("version", "v")),
        signature=signature,
        device="cpu",
        max_batch_size=int(header.get("max_batch_size", 64)),
        num_threads=None if threads is None else int(threads),
        inject_latency_ms=float(header.get("inject_latency_ms", 0.0)),
    )
    described = {
        kind: [
            {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
            for t in getattr(signature, kind)
        ]
        for kind in ("inputs", "outputs")
    }
    write_frame(replies, Frame({"ok": True, "format": opened.format, "signature": described}))
    return Loaded(model, frame.blob, opened.format, signature, model.model, model.version)


def _batch(model: Any, inputs: dict[str, Any]) -> Any:
    """The runner's form of `inputs`: one array for a one-tensor model, else NamedRows in
    the signature's order (every input named, nothing else)."""
    from servemesh.services.model.batching.rows import NamedRows

    names = [t.name for t in model.signature.inputs]
    if sorted(inputs) != sorted(names):
        raise ValueError(f"inputs {sorted(inputs)}; the model takes {names}")
    if model.single:
        return inputs[names[0]]
    return NamedRows({name: inputs[name] for name in names})


class TooManyRows(ServemeshError, ValueError):
    """A run of more rows than the load allowed (max_batch_size)."""


def _answer(loaded: Loaded, frame: Frame, replies: BinaryIO, ops: Mapping[str, Op]) -> None:
    from servemesh.services.model.runner import SignatureViolation

    model = loaded.runner
    op = frame.header.get("op")
    single = model.signature.output.name
    try:
        if op == "probe":
            answer = model.probe()
        elif op == "run":
            rows = {len(a) if a.ndim else 0 for a in frame.arrays.values()}
            if max(rows, default=0) > model.max_batch_size:
                raise TooManyRows(
                    f"{max(rows)} rows in one run; at most {model.max_batch_size} (max_batch_size)"
                )
            answer = model.run(_batch(model, frame.arrays))
        elif isinstance(op, str) and op in ops:
            reply = ops[op](loaded, frame)
            write_frame(replies, Frame(dict(reply.header, ok=True), reply.arrays, reply.blob))
            return
        else:
            raise ValueError(f"unknown op {op!r}")
    except SignatureViolation as exc:
        _fail(replies, "signature", exc)
        return
    except TooManyRows as exc:
        _fail(replies, "limit", exc)
        return
    except ServemeshError as exc:  # an op's own refusal: its message is for the operator
        _fail(replies, "refused", exc)
        return
    except Exception as exc:  # the model's own error is an answer, not a crash
        _fail(replies, "model", exc)
        return
    write_frame(replies, Frame({"ok": True}, arrays_of(answer, single)))


if __name__ == "__main__":
    sys.exit(main())
