"""The model server: OIP v2 inference over gRPC for TorchScript models, with dynamic batching.

tensors (request validation and encoding), runner (one loaded module), batching (the
deadline-aware dynamic batcher, a package), latency (expected time per batch size), loader
(artifact bytes to a served model), repository (the models served; load, unload, resolve),
inference (ModelInfer and ModelMetadata), statistics (ModelStatistics), service (the gRPC
servicer over those three), metrics (Prometheus), shadow (shadowed calls' ledger), app
(wiring from the mesh spec), as the gateway and feature services name theirs.
"""
