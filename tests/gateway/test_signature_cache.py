"""The gateway keeps each model's learned signature until the model's spec entry changes."""

from __future__ import annotations

import grpc

from servemesh.services.gateway.predict import ModelSignature, TensorMeta
from servemesh.services.gateway.service import GatewayServicer
from servemesh.spec import MeshSpec, ModelSpec

SIGNATURE = ModelSignature(
    inputs=(TensorMeta("features", "FP32", (-1, 64)),),
    outputs=(TensorMeta("score", "FP32", (-1, 1)),),
)


async def test_a_changed_model_entry_is_learned_again_and_the_others_are_kept() -> None:
    spec = MeshSpec(models={"fraud": ModelSpec(), "other": ModelSpec()})
    # Nothing is called: the channel never connects.
    channel = grpc.aio.insecure_channel("127.0.0.1:9")
    try:
        servicer = GatewayServicer(spec, channel)
        servicer.signatures = {"fraud": SIGNATURE, "other": SIGNATURE}
        await servicer.follow_spec(spec.model_copy(deep=True))
        assert set(servicer.signatures) == {"fraud", "other"}
        changed = MeshSpec(models={"fraud": ModelSpec(fallback_score=0.5), "other": ModelSpec()})
        await servicer.follow_spec(changed)
        assert set(servicer.signatures) == {"other"}
        await servicer.follow_spec(MeshSpec(models={"fraud": ModelSpec(fallback_score=0.5)}))
        assert servicer.signatures == {} and servicer.spec.models["fraud"].fallback_score == 0.5
    finally:
        await channel.close()
