"""Triton Inference Server (through nvidia-pytriton) serving a bench model: the bench's peer.

    .venv-pytriton/bin/python servemesh/bench/model/triton_server.py \\
        --model-file fraud.pt --port-file triton.json --cpu 0

Run by path with the pytriton venv's interpreter (`make pytriton-venv`), never imported by
servemesh: pytriton pins its own grpcio, protobuf and numpy, so this file imports nothing
of the project. The model is the same artifact the model server loads (the bench writes it
to --model-file: TorchScript, or a torch.export program with `--format torch_export`, which
the bench built itself), run with torch on the CPU inside the pytriton callable,
one intra-op thread like the model server's runner. Dynamic batching as configured
(default: max batch 64, 2 ms queue delay). Every process (tritonserver, its Python backend
stub, this proxy) inherits the --cpu pinning. Once the model is ready, the ports are
written as JSON to --port-file: {"port": gRPC, "metrics_port": Prometheus}; SIGTERM stops
the server.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sysconfig
import threading
from pathlib import Path
from typing import Any

N_FEATURES = 64


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _prefer_own_libpython() -> None:
    """Make the Python backend stub load this interpreter's libpython.

    pytriton's stub for this Python version links `libpython3.X.so.1.0` by name; where the
    system holds another build of the same minor version (Debian's 3.11.2 beside a 3.11.7
    that made the venv), the stub ran the system's library with this interpreter's stdlib,
    and the model failed to load (`'_thread.RLock' object has no attribute
    '_recursion_count'`). The stub inherits LD_LIBRARY_PATH through tritonserver.
    """
    libdir = sysconfig.get_config_var("LIBDIR")
    library = sysconfig.get_config_var("INSTSONAME")
    if libdir and library and (Path(libdir) / library).exists():
        paths = [libdir, *filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":"))]
        os.environ["LD_LIBRARY_PATH"] = ":".join(paths)


def _infer_func(model_file: Path, format: str) -> Any:
    import numpy as np
    import torch
    from pytriton.decorators import batch  # type: ignore[import-not-found]

    if format == "torch_export":
        module = torch.export.load(str(model_file)).module()
    else:
        module = torch.jit.load(str(model_file), map_location="cpu").eval()
    pinned: set[int] = set()

    @batch  # type: ignore[untyped-decorator]
    def infer(features: np.ndarray) -> dict[str, np.ndarray]:
        # Intra-op threads are per calling thread: one, as the model server's runner sets.
        ident = threading.get_ident()
        if ident not in pinned:
            torch.set_num_threads(1)
            pinned.add(ident)
        with torch.inference_mode():
            score = module(torch.from_numpy(features))
        return {"score": score.numpy().astype(np.float32, copy=False)}

    return infer


def serve(args: argparse.Namespace) -> None:
    import numpy as np
    from pytriton.model_config import (  # type: ignore[import-not-found]
        DynamicBatcher,
        ModelConfig,
        Tensor,
    )
    from pytriton.triton import Triton, TritonConfig  # type: ignore[import-not-found]

    grpc_port, http_port, metrics_port = _free_port(), _free_port(), _free_port()
    config = TritonConfig(
        grpc_address="127.0.0.1",
        grpc_port=grpc_port,
        http_address="127.0.0.1",
        http_port=http_port,
        metrics_port=metrics_port,
        log_verbose=0,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    triton = Triton(config=config, workspace=args.workspace)
    try:
        triton.bind(
            model_name=args.model_name,
            infer_func=_infer_func(args.model_file, args.format),
            inputs=[Tensor(name="features", dtype=np.float32, shape=(N_FEATURES,))],
            outputs=[Tensor(name="score", dtype=np.float32, shape=(1,))],
            config=ModelConfig(
                max_batch_size=args.max_batch,
                batcher=DynamicBatcher(max_queue_delay_microseconds=args.delay_us),
            ),
            strict=False,
        )
        triton.run()  # returns once the server and the model are ready
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": grpc_port, "metrics_port": metrics_port}))
        tmp.replace(args.port_file)
        stop.wait()
    finally:
        triton.stop()


def main() -> None:
    parser = argparse.ArgumentParser(prog="triton_server.py")
    parser.add_argument("--model-file", type=Path, required=True, help="the model artifact")
    parser.add_argument("--format", choices=["torchscript", "torch_export"], default="torchscript")
    parser.add_argument("--model-name", default="fraud")
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--workspace", type=Path, help="pytriton's model store (default: temp)")
    parser.add_argument("--cpu", type=int, help="pin this process and its children to this CPU")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--delay-us", type=int, default=2000)
    args = parser.parse_args()
    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    _prefer_own_libpython()
    serve(args)


if __name__ == "__main__":
    main()
