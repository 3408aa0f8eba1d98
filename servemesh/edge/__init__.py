"""Models on devices: a registry version exported for a device runtime (`export`: ONNX checked
in onnxruntime, or a torch.export program), and an alias's current artifact kept in sync on a
device (`sync`: sha256-verified, swapped atomically, "not modified" without the bytes).

Nothing is re-exported here: `export` needs torch (and the `edge` extra for ONNX), `sync`
needs only grpc, and a device that syncs the registry's artifact never imports torch.
"""
