"""The model server: OIP v2 inference over gRPC for TorchScript models, with dynamic batching.

tensors (request validation and encoding), runner (one loaded module), batcher (deadline-aware
dynamic batching), loader (artifact bytes to a served model), servicer (the gRPC service),
service (wiring from the mesh spec).
"""
