"""The sandboxed process of `models export` and `edge sync`: `python -I -B -m
servemesh.edge.child`.

It is `servemesh.sandbox.child` (the same clean start, the same walls, the artifact loaded
through the same guard), with one op more, since exporting a model means torch tracing it:
running its code, which the caller's process never does (docs/security.md, "Offline runs").

    export (header: format "onnx" | "pt2"; arrays: the reference rows, by input name)
        -> blob: the exported file's bytes (for "pt2" of a torch.export version: none, the
           caller writes the bytes it already holds); arrays: the export's answer to the
           rows, one per output, keyed "0", "1", ... in the order the export answers them
           (onnxruntime's, or the .pt2 loaded back through the guard); header: opset,
           runtime (what ran the check), note (where the program came from)

The ONNX exporter works under the syscall filter: it serializes to memory, and a cache
folder it may try to create (torchinductor's) is refused with EPERM, which it survives.
"""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass

from servemesh.sandbox.child import Loaded, serve
from servemesh.sandbox.frames import Frame

EXPORT_OP = "export"
ENTRY: tuple[str, ...] = ("-m", "servemesh.edge.child")


@dataclass(frozen=True)
class _Source:
    """The fields of a registry version that `program_of` reads."""

    model: str
    version: str
    format: str


def _prepare() -> None:
    """Imported before the walls go up (an import after them still reads, but must write
    nothing; these are the big ones, loaded once here)."""
    import torch._export.converter  # noqa: F401

    import servemesh.edge.export  # noqa: F401

    try:  # the edge extra; without it an ONNX export is refused, saying so
        import onnx  # noqa: F401
        import onnxruntime  # type: ignore[import-untyped]  # noqa: F401
        import onnxscript  # noqa: F401
        import torch.onnx  # noqa: F401
    except ImportError:
        pass


def export(loaded: Loaded, frame: Frame) -> Frame:
    """The `export` op: the program (stored, or converted from TorchScript), exported, and
    the export's own answer to the reference rows."""
    import torch

    from servemesh.edge.export import (
        ExportError,
        _onnx_bytes,
        _pt2_answers,
        _quiet,
        program_of,
        run_onnx,
    )

    format = frame.header.get("format")
    if format not in ("onnx", "pt2"):
        raise ExportError(f"format {format!r} is not one of ['onnx', 'pt2']")
    signature = loaded.signature
    source = _Source(loaded.model, loaded.version, loaded.format)
    reference = {t.name: frame.arrays[t.name] for t in signature.inputs}
    count = int(next(iter(reference.values())).shape[0])
    program, note = program_of(loaded.data, source, signature)
    header: dict[str, object] = {"note": note}
    if format == "onnx":
        exported, opset = _onnx_bytes(program, signature, f"{loaded.model} {loaded.version}")
        got = run_onnx(exported, reference)
        import onnxruntime

        header["runtime"] = {
            "onnxruntime": onnxruntime.__version__,
            "opset": opset,
            "exported_with": f"torch {torch.__version__}",
        }
        blob = exported
    else:
        if loaded.format == "torch_export":
            exported, blob = loaded.data, b""  # the caller writes its own copy
        else:
            buffer = io.BytesIO()
            with _quiet():
                torch.export.save(program, buffer)
            exported = blob = buffer.getvalue()
        got = _pt2_answers(exported, source, signature, reference, count)
        header["runtime"] = {"torch": torch.__version__}
    import numpy as np

    return Frame(header, {str(i): np.asarray(a) for i, a in enumerate(got)}, blob)


def main() -> int:
    return serve({EXPORT_OP: export}, _prepare)


if __name__ == "__main__":
    sys.exit(main())
