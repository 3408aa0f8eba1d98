"""The committed gRPC code must be what the .proto files generate today."""

from __future__ import annotations

from servemesh.dev.protogen import stale_files


def test_generated_code_matches_the_protos() -> None:
    stale = stale_files()
    assert not stale, f"regenerate with `python -m servemesh.dev.protogen`: {stale}"
